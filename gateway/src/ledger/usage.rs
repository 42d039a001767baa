//! What each tenant used, per UTC day, for billing: input, output and cache tokens and
//! calls, as the answers' `usage` said them (`GET /usage` on the admin listener).
//!
//! A call counts once its answer's usage is read (when its body ends, or is dropped after
//! the usage passed), whatever its encoding: the same moment its charge is settled
//! (`cost.rs`). A success whose usage cannot be read counts its estimate, marked so; an
//! error answer (a refusal included) and a call the gateway refused count nothing.
//!
//! Without Redis the counts are this process's, and an end user's rows are kept for
//! today and yesterday: older days keep their service's total (memory stays bounded with
//! 100,000 users a day). With `--redis` they are the fleet's: each
//! gateway adds its counts to one Redis hash per day (`fairgate:usage:<YYYY-MM-DD>`, field
//! `<counter>:<tenant>`, kept [`KEPT_DAYS`] days) every [`FLUSH_EVERY`] and when it stops,
//! and `/usage` reads the hashes, plus what this gateway has not sent yet. While Redis is
//! away the counts wait in memory and go with the next flush that succeeds.
//!
//! `GET /usage` answers a JSON object `{"usage":[row, ...]}` sorted by day then tenant, a
//! row being `{"day":"2026-12-05","tenant":"team-a","input_tokens":..,"output_tokens":..,
//! "cache_creation_input_tokens":..,"cache_read_input_tokens":..,"calls":..,
//! "estimated_calls":..}`; `estimated_calls` of the `calls` were counted at their estimate
//! (an answer whose usage could not be read: the body's input, `max_tokens` of output);
//! `?format=jsonl` answers the rows one a line. `?day=YYYY-MM-DD` keeps one day;
//! `?tenant=NAME` keeps that tenant and its end users (`NAME/...`), so a service is billed
//! with its users.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

/// How long a day's counts are kept.
pub(crate) const KEPT_DAYS: u32 = 40;
/// How often a gateway on Redis sends its counts.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(500);
/// The longest a Redis command of the book may take.
const REDIS_TIMEOUT: Duration = Duration::from_secs(2);
/// The Redis keys of the days: this prefix and the day.
const KEY_PREFIX: &str = "fairgate:usage:";

/// What one tenant used on one day.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Counts {
    pub(crate) input_tokens: u64,
    pub(crate) output_tokens: u64,
    pub(crate) cache_creation_input_tokens: u64,
    pub(crate) cache_read_input_tokens: u64,
    pub(crate) calls: u64,
    /// Of `calls`, those whose answer's usage could not be read: counted at their estimate
    /// (the body's input, `max_tokens` of output).
    pub(crate) estimated_calls: u64,
}

/// The counters as named in a Redis hash's fields.
const COUNTERS: [&str; 6] = [
    "in",
    "out",
    "cache_write",
    "cache_read",
    "calls",
    "estimated",
];

impl Counts {
    fn values(&self) -> [u64; 6] {
        [
            self.input_tokens,
            self.output_tokens,
            self.cache_creation_input_tokens,
            self.cache_read_input_tokens,
            self.calls,
            self.estimated_calls,
        ]
    }

    fn counter_mut(&mut self, name: &str) -> Option<&mut u64> {
        Some(match name {
            "in" => &mut self.input_tokens,
            "out" => &mut self.output_tokens,
            "cache_write" => &mut self.cache_creation_input_tokens,
            "cache_read" => &mut self.cache_read_input_tokens,
            "calls" => &mut self.calls,
            "estimated" => &mut self.estimated_calls,
            _ => return None,
        })
    }

    fn add(&mut self, other: &Counts) {
        for (name, value) in COUNTERS.iter().zip(other.values()) {
            if let Some(counter) = self.counter_mut(name) {
                *counter = counter.saturating_add(value);
            }
        }
    }
}

/// A UTC day, as days since 1970-01-01.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Day(u32);

impl Day {
    pub(crate) fn today() -> Day {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Day(u32::try_from(secs / 86_400).unwrap_or(u32::MAX))
    }

    /// Reads `YYYY-MM-DD` (a real date from 1970 on), or `None`.
    pub(crate) fn parse(text: &str) -> Option<Day> {
        let bytes = text.as_bytes();
        let digits = |range: std::ops::Range<usize>| -> Option<u32> {
            let part = bytes.get(range)?;
            part.iter().all(u8::is_ascii_digit).then_some(())?;
            std::str::from_utf8(part).ok()?.parse().ok()
        };
        if bytes.len() != 10 || bytes[4] != b'-' || bytes[7] != b'-' {
            return None;
        }
        let (year, month, day) = (digits(0..4)?, digits(5..7)?, digits(8..10)?);
        let days = days_from_civil(year, month, day)?;
        (Day(days).name() == text).then_some(Day(days))
    }

    /// `YYYY-MM-DD`.
    pub(crate) fn name(self) -> String {
        let (year, month, day) = civil_from_days(self.0);
        format!("{year:04}-{month:02}-{day:02}")
    }

    fn days_before(self, n: u32) -> Day {
        Day(self.0.saturating_sub(n))
    }
}

/// Days since 1970-01-01 of a date (H. Hinnant's `days_from_civil`), `None` before 1970 or
/// for a month or day out of range.
fn days_from_civil(year: u32, month: u32, day: u32) -> Option<u32> {
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || year < 1970 {
        return None;
    }
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    (era * 146_097 + doe).checked_sub(719_468)
}

/// The date of a count of days since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: u32) -> (u32, u32, u32) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u32::from(month <= 2);
    (year, month, day)
}

/// Which rows `/usage` answers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Filter {
    pub(crate) day: Option<Day>,
    pub(crate) tenant: Option<String>,
}

impl Filter {
    fn keeps(&self, day: Day, tenant: &str) -> bool {
        self.day.is_none_or(|d| d == day)
            && self.tenant.as_deref().is_none_or(|wanted| {
                tenant == wanted
                    || tenant
                        .strip_prefix(wanted)
                        .is_some_and(|rest| rest.starts_with('/'))
            })
    }

    /// The days to read: the one asked, or every day kept.
    fn days(&self) -> Vec<Day> {
        let today = Day::today();
        match self.day {
            Some(day) => vec![day],
            None => (0..KEPT_DAYS).rev().map(|n| today.days_before(n)).collect(),
        }
    }
}

/// One row of `/usage`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct Row {
    pub(crate) day: String,
    pub(crate) tenant: String,
    #[serde(flatten)]
    pub(crate) counts: Counts,
}

type Book = HashMap<(Day, String), Counts>;

/// The counts kept in this process, and the day the old ones were last dropped.
#[derive(Default)]
struct Here {
    book: Book,
    pruned_on: Option<Day>,
}

/// Drops the days past those kept. With `fold_users` (a book kept in memory), the end
/// users' rows of the days before yesterday are added to their service's row (`svc/9f2c`
/// to `svc`, a tenant whose own calls all name a user): a service with 100,000 users a
/// day keeps two days of their rows in the process, not [`KEPT_DAYS`]. On Redis every row
/// is kept, in Redis.
fn prune(book: &mut Book, today: Day, fold_users: bool) {
    let oldest = today.days_before(KEPT_DAYS - 1);
    let users_from = today.days_before(1);
    let mut folded = Vec::new();
    book.retain(|(day, tenant), counts| {
        if *day < oldest {
            return false;
        }
        match tenant.split_once('/') {
            Some((service, _)) if fold_users && *day < users_from => {
                folded.push(((*day, service.to_owned()), *counts));
                false
            }
            _ => true,
        }
    });
    for (row, counts) in folded {
        book.entry(row).or_default().add(&counts);
    }
    book.shrink_to_fit();
}

/// The usage book: counts kept here, and (with Redis) sent to the fleet's.
#[derive(Clone)]
pub(crate) struct Usage {
    /// In memory: every count of the days kept; on Redis: the counts not sent yet.
    here: Arc<Mutex<Here>>,
    redis: Option<Arc<RedisLink>>,
    /// The last flush failed: the next failure is not logged again (one line an outage).
    failing: Arc<AtomicBool>,
    /// Held by a flush while its counts are on their way, and by a read of Redis and of
    /// the counts here: a read sees each count once, in Redis or here.
    flushing: Arc<tokio::sync::Mutex<()>>,
}

/// The book's own connection to Redis, made at its first use (a gateway starts while
/// Redis is away, as its store does) and made again after a failure to connect.
struct RedisLink {
    client: redis::Client,
    connection: tokio::sync::Mutex<Option<redis::aio::ConnectionManager>>,
}

impl RedisLink {
    async fn connection(&self) -> Result<redis::aio::ConnectionManager, String> {
        let mut connection = self.connection.lock().await;
        if let Some(connection) = connection.as_ref() {
            return Ok(connection.clone());
        }
        let made = tokio::time::timeout(REDIS_TIMEOUT, self.client.get_connection_manager())
            .await
            .map_err(|_| "Redis: no answer".to_owned())?
            .map_err(|e| format!("Redis: {e}"))?;
        *connection = Some(made.clone());
        Ok(made)
    }
}

impl std::fmt::Debug for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Usage")
            .field("redis", &self.redis.is_some())
            .finish_non_exhaustive()
    }
}

impl Usage {
    /// A book in this process.
    pub(crate) fn memory() -> Usage {
        Usage {
            here: Arc::default(),
            redis: None,
            failing: Arc::default(),
            flushing: Arc::default(),
        }
    }

    /// A book shared by every gateway on the Redis at `url` (connected at its first use).
    pub(crate) fn redis(url: &str) -> Result<Usage, String> {
        let client = redis::Client::open(url).map_err(|e| format!("--redis: {e}"))?;
        let link = RedisLink {
            client,
            connection: tokio::sync::Mutex::new(None),
        };
        Ok(Usage {
            here: Arc::default(),
            redis: Some(Arc::new(link)),
            failing: Arc::default(),
            flushing: Arc::default(),
        })
    }

    /// Counts a call of `tenant` that used `counts` (its `calls` is set to 1).
    pub(crate) fn record(&self, tenant: &str, mut counts: Counts) {
        counts.calls = 1;
        let today = Day::today();
        let mut here = self.here.lock().unwrap_or_else(|e| e.into_inner());
        if here.pruned_on != Some(today) {
            // Once a day: the days past those kept go (in memory, their end users too).
            prune(&mut here.book, today, self.redis.is_none());
            here.pruned_on = Some(today);
        }
        here.book
            .entry((today, tenant.to_owned()))
            .or_default()
            .add(&counts);
    }

    /// The rows `filter` keeps: this process's, or the fleet's on Redis (with what this
    /// gateway has not sent yet).
    pub(crate) async fn rows(&self, filter: &Filter) -> Result<Vec<Row>, String> {
        let mut merged: BTreeMap<(Day, String), Counts> = BTreeMap::new();
        let _no_flush = self.flushing.lock().await;
        if let Some(redis) = &self.redis {
            let connection = redis.connection().await?;
            for day in filter.days() {
                for (tenant, counts) in read_day(connection.clone(), day).await? {
                    if filter.keeps(day, &tenant) {
                        merged.entry((day, tenant)).or_default().add(&counts);
                    }
                }
            }
        }
        let here = self.here.lock().unwrap_or_else(|e| e.into_inner());
        let oldest = Day::today().days_before(KEPT_DAYS - 1);
        for ((day, tenant), counts) in here.book.iter() {
            if *day >= oldest && filter.keeps(*day, tenant) {
                merged
                    .entry((*day, tenant.clone()))
                    .or_default()
                    .add(counts);
            }
        }
        Ok(merged
            .into_iter()
            .map(|((day, tenant), counts)| Row {
                day: day.name(),
                tenant,
                counts,
            })
            .collect())
    }

    /// Sends the counts not sent yet to Redis (nothing to do in memory); on failure they
    /// are kept for the next flush.
    pub(crate) async fn flush(&self) {
        let Some(redis) = &self.redis else {
            return;
        };
        let _flushing = self.flushing.lock().await;
        let pending = std::mem::take(&mut self.here.lock().unwrap_or_else(|e| e.into_inner()).book);
        if pending.is_empty() {
            return;
        }
        let sent = match redis.connection().await {
            Ok(connection) => send(connection, &pending).await,
            Err(error) => Err(error),
        };
        let failed_before = self.failing.swap(sent.is_err(), Ordering::Relaxed);
        if let Err(error) = sent {
            if !failed_before {
                tracing::warn!(%error, "usage: not sent to Redis; kept until it answers");
            }
            let mut here = self.here.lock().unwrap_or_else(|e| e.into_inner());
            for (key, counts) in pending {
                here.book.entry(key).or_default().add(&counts);
            }
        } else if failed_before {
            tracing::info!("usage: Redis answers again; the counts kept were sent");
        }
    }

    /// Flushes every [`FLUSH_EVERY`] until the task is aborted (on Redis only).
    pub(crate) async fn flush_forever(self) {
        if self.redis.is_none() {
            return;
        }
        let mut every = tokio::time::interval(FLUSH_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            self.flush().await;
        }
    }
}

fn day_key(day: Day) -> String {
    format!("{KEY_PREFIX}{}", day.name())
}

/// Adds `pending` to the days' hashes, in one pipeline (atomic per command).
async fn send(mut redis: redis::aio::ConnectionManager, pending: &Book) -> Result<(), String> {
    let mut pipe = redis::pipe();
    let mut days = Vec::new();
    for ((day, tenant), counts) in pending {
        let key = day_key(*day);
        for (name, value) in COUNTERS.iter().zip(counts.values()) {
            if value > 0 {
                let value = i64::try_from(value).unwrap_or(i64::MAX);
                pipe.hincr(&key, format!("{name}:{tenant}"), value).ignore();
            }
        }
        if !days.contains(day) {
            days.push(*day);
        }
    }
    for day in days {
        let ttl = i64::from(KEPT_DAYS) * 86_400;
        pipe.expire(day_key(day), ttl).ignore();
    }
    let sent = pipe.query_async::<()>(&mut redis);
    tokio::time::timeout(REDIS_TIMEOUT, sent)
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| e.to_string())
}

/// One day's counts in Redis, by tenant; fields it does not know are skipped.
async fn read_day(
    mut redis: redis::aio::ConnectionManager,
    day: Day,
) -> Result<HashMap<String, Counts>, String> {
    let mut command = redis::cmd("HGETALL");
    command.arg(day_key(day));
    let read = command.query_async::<Vec<(String, i64)>>(&mut redis);
    let fields = tokio::time::timeout(REDIS_TIMEOUT, read)
        .await
        .map_err(|_| "Redis: no answer".to_owned())?
        .map_err(|e| format!("Redis: {e}"))?;
    let mut by_tenant: HashMap<String, Counts> = HashMap::new();
    for (field, value) in fields {
        let Some((name, tenant)) = field.split_once(':') else {
            continue;
        };
        let mut counts = Counts::default();
        if let Some(counter) = counts.counter_mut(name) {
            *counter = u64::try_from(value).unwrap_or(0);
            by_tenant.entry(tenant.to_owned()).or_default().add(&counts);
        }
    }
    Ok(by_tenant)
}

/// The query of `/usage`: its filter and whether JSON lines are asked for; or why not.
pub(crate) fn query(query: Option<&str>) -> Result<(Filter, bool), String> {
    let mut filter = Filter::default();
    let mut lines = false;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value).ok_or_else(|| format!("{name}: bad escape"))?;
        match name {
            "day" => {
                let day = Day::parse(&value).ok_or("day: give YYYY-MM-DD")?;
                filter.day = Some(day);
            }
            "tenant" => filter.tenant = Some(value),
            "format" => match value.as_str() {
                "json" => lines = false,
                "jsonl" => lines = true,
                _ => return Err("format: json or jsonl".into()),
            },
            _ => return Err(format!("unknown parameter {name:?}: day, tenant, format")),
        }
    }
    Ok((filter, lines))
}

/// `%XX` escapes and `+` as a space, into UTF-8; `None` if malformed.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The rows as `/usage` answers them: one JSON object, or JSON lines.
pub(crate) fn render(rows: &[Row], lines: bool) -> String {
    if lines {
        let mut text = String::new();
        for row in rows {
            text.push_str(&serde_json::to_string(row).unwrap_or_default());
            text.push('\n');
        }
        return text;
    }
    serde_json::json!({ "usage": rows }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_read_and_print_as_utc_dates() {
        assert_eq!(Day(0).name(), "1970-01-01");
        assert_eq!(Day::parse("1970-01-01"), Some(Day(0)));
        assert_eq!(
            Day::parse("2026-12-05").map(Day::name).as_deref(),
            Some("2026-12-05")
        );
        assert_eq!(
            Day::parse("2024-02-29").map(Day::name).as_deref(),
            Some("2024-02-29")
        );
        for bad in [
            "2026-02-30",
            "2025-02-29",
            "2026-13-01",
            "1969-12-31",
            "2026-1-05",
            "",
            "+026-12-05",
            "2026-12-05x",
        ] {
            assert_eq!(Day::parse(bad), None, "{bad}");
        }
        let today = Day::today();
        assert_eq!(Day::parse(&today.name()), Some(today));
    }

    #[test]
    fn the_query_is_read_and_anything_else_refused() {
        assert_eq!(query(None), Ok((Filter::default(), false)));
        let (filter, lines) = query(Some("day=2026-12-05&tenant=svc%2Fa+b&format=jsonl")).unwrap();
        assert_eq!(filter.day, Day::parse("2026-12-05"));
        assert_eq!(filter.tenant.as_deref(), Some("svc/a b"));
        assert!(lines);
        for bad in [
            "day=yesterday",
            "format=xml",
            "tenant=%zz",
            "limit=3",
            "tenant=%ff",
        ] {
            assert!(query(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_tenant_filter_keeps_the_tenant_and_its_end_users() {
        let filter = Filter {
            day: None,
            tenant: Some("svc".into()),
        };
        let today = Day::today();
        assert!(filter.keeps(today, "svc"));
        assert!(filter.keeps(today, "svc/9f2c"));
        assert!(!filter.keeps(today, "svc2"));
        assert!(!filter.keeps(today, "other/svc"));
    }

    #[test]
    fn in_memory_the_end_users_of_days_before_yesterday_fold_into_their_service() {
        let today = Day(20_000);
        let calls = |n| Counts {
            input_tokens: 10 * n,
            calls: n,
            ..Counts::default()
        };
        let mut book = Book::new();
        for day in [today, today.days_before(1), today.days_before(2)] {
            book.insert((day, "svc/u1".into()), calls(1));
            book.insert((day, "svc/u2".into()), calls(2));
            book.insert((day, "team".into()), calls(4));
        }
        book.insert((today.days_before(KEPT_DAYS), "team".into()), calls(8));
        let mut on_redis = book.clone();
        prune(&mut book, today, true);
        let mut rows: Vec<_> = book
            .iter()
            .map(|((d, t), c)| (today.0 - d.0, t.as_str(), c.calls))
            .collect();
        rows.sort();
        assert_eq!(
            rows,
            [
                (0, "svc/u1", 1),
                (0, "svc/u2", 2),
                (0, "team", 4),
                (1, "svc/u1", 1),
                (1, "svc/u2", 2),
                (1, "team", 4),
                (2, "svc", 3),
                (2, "team", 4),
            ]
        );
        assert_eq!(
            book[&(today.days_before(2), "svc".to_owned())].input_tokens,
            30
        );
        prune(&mut on_redis, today, false);
        assert_eq!(
            on_redis.len(),
            9,
            "on Redis only the days past those kept go"
        );
    }

    #[tokio::test]
    async fn calls_add_up_per_tenant_and_day_in_memory() {
        let usage = Usage::memory();
        let used = Counts {
            input_tokens: 10,
            output_tokens: 3,
            cache_read_input_tokens: 7,
            ..Counts::default()
        };
        usage.record("a", used);
        usage.record("a", used);
        usage.record("b/u1", used);
        let rows = usage.rows(&Filter::default()).await.unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].tenant, "a");
        assert_eq!(rows[0].day, Day::today().name());
        assert_eq!(
            rows[0].counts,
            Counts {
                input_tokens: 20,
                output_tokens: 6,
                cache_creation_input_tokens: 0,
                cache_read_input_tokens: 14,
                calls: 2,
                estimated_calls: 0,
            }
        );
        let lines = render(&rows, true);
        assert_eq!(lines.lines().count(), 2);
        let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
        assert_eq!(first["input_tokens"], 20);
        assert_eq!(first["calls"], 2);
        let only_b = Filter {
            day: Some(Day::today()),
            tenant: Some("b".into()),
        };
        assert_eq!(usage.rows(&only_b).await.unwrap().len(), 1);
    }
}
