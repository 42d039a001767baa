//! The keys file (`--keys`, TOML): the clients' keys, the optional `[limits]`,
//! `[[tiers]]`, `[cost]` (what a call is charged: the `cost` module) and `[[upstreams]]`
//! (the `upstreams` module), checked in full before the gateway starts or takes a reload.
//!
//! ```toml
//! expect_keys = 2          # optional, before any table: refuse a file with another count
//!
//! [[keys]]
//! key = "sk-gw-team-a"     # the key clients send
//! tenant = "team-a"
//! tier = "premium"
//!
//! [[keys]]                 # or its SHA-256 (`printf %s KEY | sha256sum`): the file then
//! key_sha256 = "9f86d0…"   # holds nothing that authenticates (64 hex digits)
//! tenant = "team-b"
//! tier = "pro"
//! ```
//!
//! `expect_keys = N` makes a file that was cut short at an entry boundary (a partial copy,
//! a truncated template) a refusal instead of a gateway that quietly lost keys: at start
//! the gateway does not start, on `SIGHUP` the old keys are kept.
//!
//! Every refusal names the file and, where the file has one, the line; none shows a key
//! (a parse error's snippet of the file could, so only its message and line are kept, and
//! a key of the wrong type is refused by a message of our own, not serde's, which would
//! quote the value).

pub(crate) mod upstreams;

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;
use std::time::Duration;

use fairgate::extract::KeyTable;
use fairgate::{DemotionPolicy, Origin, SlotPolicy, SlotPolicyBuilder, Tier};
use serde::{Deserialize, Deserializer};
use toml::Spanned;

use crate::admission::cost::{CostModel, CostTable};
use crate::admission::identity::{Claims, Identities, KeyPolicy, origin_name, parse_origin};

use self::upstreams::{UpstreamEntry, UpstreamSpec};

/// The longest `retry_after_ms` and `max_wait_ms` taken: an hour. A client told to wait
/// longer has been told something wrong.
const MAX_WAIT_MS: u64 = 3_600_000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    /// How many `[[keys]]` the file must hold, when given.
    expect_keys: Option<Spanned<u64>>,
    #[serde(default)]
    keys: Vec<Spanned<KeyEntry>>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    tiers: Vec<Spanned<TierEntry>>,
    /// The secret the end users' ids are hashed with (see `identity`); when absent, each
    /// service key's own SHA-256.
    user_secret: Option<Spanned<Secret>>,
    #[serde(default)]
    cost: CostTable,
    /// The upstreams (the `upstreams` module); none: `--upstream`.
    #[serde(default)]
    upstreams: Vec<Spanned<UpstreamEntry>>,
    /// How the pool of `[[upstreams]]` shares calls out.
    #[serde(default)]
    pool: PoolTable,
}

/// The keys file's `[pool]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolTable {
    /// How long a call waits for the first priority with room (default 1000).
    spill_after_ms: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    /// The key, or (exactly one of the two) its SHA-256 in hex.
    key: Option<Spanned<Secret>>,
    key_sha256: Option<Spanned<Secret>>,
    tenant: String,
    tier: String,
    /// Calls name their end user, each a tenant inside `tenant`.
    #[serde(default)]
    users: bool,
    /// The origin of a call that claims none (default `user`).
    origin: Option<Spanned<String>>,
    /// The tiers (origins) a call may claim; none when absent.
    tiers: Option<Spanned<Vec<String>>>,
    origins: Option<Spanned<Vec<String>>>,
}

/// A client key as read from the file: a string, or a refusal that never quotes it.
struct Secret(String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<secret>")
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(SecretVisitor)
    }
}

struct SecretVisitor;

impl<'de> serde::de::Visitor<'de> for SecretVisitor {
    type Value = Secret;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Secret, E> {
        Ok(Secret(v.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Secret, E> {
        Ok(Secret(v))
    }

    // Every other type: refused without the value (serde's own message quotes it).
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Secret, E> {
        Err(E::custom(NOT_A_STRING))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Secret, A::Error> {
        Err(serde::de::Error::custom(NOT_A_STRING))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, _: A) -> Result<Secret, A::Error> {
        Err(serde::de::Error::custom(NOT_A_STRING))
    }
}

const NOT_A_STRING: &str = "`key` (or `key_sha256`, `user_secret`) must be a string in quotes";

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Limits {
    global_max: Option<Spanned<u32>>,
    window: Option<Spanned<usize>>,
    retry_after_ms: Option<Spanned<u64>>,
    lease_ttl_ms: Option<Spanned<u64>>,
    daily_token_budget: Option<Spanned<u64>>,
    /// What the daily budget counts: `"input"` (the default) or `"weighted"`.
    budget_counts: Option<Spanned<String>>,
    demotion_ms: Option<Spanned<u64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TierEntry {
    name: String,
    cap: u32,
    max_wait_ms: Spanned<u64>,
    /// The slots one tenant (one end user of a service key) of the tier holds at once.
    tenant_cap: Option<Spanned<u32>>,
    /// Whether clients should retry the tier's refusals (default false: they waited).
    #[serde(default)]
    retry: bool,
    /// How long its standard (scheduled) work waits (default: up to its SLA, an hour at most).
    standard_max_wait_ms: Option<Spanned<u64>>,
    /// How long its batch work waits (default 120000, the write-up's batch SLO).
    batch_max_wait_ms: Option<Spanned<u64>>,
}

impl TierEntry {
    /// The tier's options besides its cap and wait, given to `builder`.
    fn options(&self, mut builder: SlotPolicyBuilder) -> SlotPolicyBuilder {
        let name = self.name.as_str();
        builder = builder.retry(name, self.retry);
        if let Some(cap) = &self.tenant_cap {
            builder = builder.tenant_cap(name, *cap.get_ref());
        }
        if let Some(ms) = &self.standard_max_wait_ms {
            builder = builder.standard_max_wait(name, Duration::from_millis(*ms.get_ref()));
        }
        if let Some(ms) = &self.batch_max_wait_ms {
            builder = builder.batch_max_wait(name, Duration::from_millis(*ms.get_ref()));
        }
        builder
    }
}

impl fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key itself.
        f.debug_struct("KeyEntry")
            .field("tenant", &self.tenant)
            .field("tier", &self.tier)
            .field("users", &self.users)
            .finish_non_exhaustive()
    }
}

/// What the gateway runs with, from the keys file.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) keys: KeyTable,
    pub(crate) policy: SlotPolicy,
    pub(crate) window: usize,
    /// Every tenant the keys name, sorted (the demotion gauge's tick looks at each, after
    /// the store's served most).
    pub(crate) tenants: Vec<String>,
    /// Each tenant's tier (of its first key): its weight on the live page.
    pub(crate) tenant_tiers: BTreeMap<String, String>,
    pub(crate) demotion: DemotionPolicy,
    /// What each key may claim and whom it acts for, by the key's SHA-256.
    pub(crate) identities: Identities,
    /// What a call is charged (`[cost]`).
    pub(crate) cost: std::sync::Arc<CostModel>,
    /// The `[[upstreams]]`, checked (their keys are read at start); empty: `--upstream`.
    pub(crate) upstreams: Vec<UpstreamSpec>,
    /// `[pool] spill_after_ms`: how long a call waits for the first priority with room.
    pub(crate) spill_after: Duration,
}

/// Reads and checks the keys file at `path`.
pub(crate) fn load(path: &Path) -> Result<Config, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read --keys {}: {e}", path.display()))?;
    parse(&text).map_err(|e| match e.line {
        Some(line) => format!("--keys {} line {line}: {}", path.display(), e.message),
        None => format!("--keys {}: {}", path.display(), e.message),
    })
}

/// A refusal: what is wrong and on which line (1-based), when known.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) line: Option<usize>,
    pub(crate) message: String,
}

pub(crate) fn refuse(text: &str, span: Option<std::ops::Range<usize>>, message: String) -> Refusal {
    let line = span.map(|span| {
        1 + text.as_bytes()[..span.start.min(text.len())]
            .iter()
            .filter(|&&b| b == b'\n')
            .count()
    });
    Refusal { line, message }
}

/// Whether `key` can arrive in a header as it is written: visible ASCII only (a key with a
/// space, a control character or a non-ASCII letter in it could never authenticate).
fn key_is_sendable(key: &str) -> bool {
    !key.is_empty() && key.bytes().all(|b| b.is_ascii_graphic())
}

pub(crate) fn parse(text: &str) -> Result<Config, Refusal> {
    // The parse error's message and line only: its snippet of the file could show a key.
    let file: KeysFile =
        toml::from_str(text).map_err(|e| refuse(text, e.span(), e.message().to_owned()))?;
    if let Some(expected) = &file.expect_keys
        && *expected.get_ref() != file.keys.len() as u64
    {
        // Before the entries are checked: a file cut short says so, not what its last
        // entry lacks.
        return Err(refuse(
            text,
            Some(expected.span()),
            format!(
                "expect_keys = {} but the file holds {} [[keys]]: cut short, or an entry \
                 missing or extra? (update expect_keys with the keys)",
                expected.get_ref(),
                file.keys.len()
            ),
        ));
    }
    if file.keys.is_empty() {
        return Err(refuse(
            text,
            None,
            "no [[keys]]: list at least one `key`, `tenant`, `tier`".into(),
        ));
    }
    let limits = &file.limits;
    let mut builder = slot_limits(text, limits)?;
    let mut tiers: Vec<String> = [Tier::PREMIUM, Tier::PRO, Tier::FREE, Tier::GUEST]
        .map(str::to_owned)
        .to_vec();
    let mut configured = HashSet::new();
    for entry in &file.tiers {
        let tier = check_tier(text, entry, &mut configured)?;
        let wait = Duration::from_millis(*tier.max_wait_ms.get_ref());
        builder = tier.options(builder.tier(tier.name.as_str(), tier.cap, wait));
        if !tiers.contains(&tier.name) {
            tiers.push(tier.name.clone());
        }
    }
    let policy = builder
        .build()
        .map_err(|e| refuse(text, None, format!("bad [limits] or [[tiers]]: {e}")))?;
    let clients = clients(text, &file.keys, &tiers, user_secret(text, &file)?)?;
    let window = match &limits.window {
        Some(window) if *window.get_ref() == 0 => {
            return Err(refuse(
                text,
                Some(window.span()),
                "[limits] window = 0: give at least 1 (calls this gateway sends at once)".into(),
            ));
        }
        Some(window) => *window.get_ref(),
        None => policy.global_max() as usize,
    };
    let demotion = demotion(text, limits)?;
    let cost = CostModel::from_table(&file.cost).map_err(|e| refuse(text, None, e))?;
    let upstreams = self::upstreams::check(text, &file.upstreams)?;
    let spill_after = spill_after(text, &file.pool)?;
    Ok(Config {
        keys: clients.keys,
        policy,
        window,
        tenants: clients.tenants,
        tenant_tiers: clients.tenant_tiers,
        demotion,
        identities: clients.identities,
        cost: std::sync::Arc::new(cost),
        upstreams,
        spill_after,
    })
}

/// `[pool] spill_after_ms` (default 1 s), refused past an hour.
fn spill_after(text: &str, pool: &PoolTable) -> Result<Duration, Refusal> {
    match &pool.spill_after_ms {
        Some(ms) if *ms.get_ref() > 3_600_000 => Err(refuse(
            text,
            Some(ms.span()),
            "[pool] spill_after_ms: give at most 3600000 (an hour)".into(),
        )),
        Some(ms) => Ok(Duration::from_millis(*ms.get_ref())),
        None => Ok(Duration::from_secs(1)),
    }
}

/// The `user_secret`, refused when shorter than 16 bytes.
fn user_secret<'a>(text: &str, file: &'a KeysFile) -> Result<Option<&'a [u8]>, Refusal> {
    let Some(spanned) = &file.user_secret else {
        return Ok(None);
    };
    let secret = spanned.get_ref().0.as_bytes();
    if secret.len() < 16 {
        return Err(refuse(
            text,
            Some(spanned.span()),
            "user_secret is shorter than 16 bytes: give a long random string (the same on \
             every gateway of a fleet)"
                .into(),
        ));
    }
    Ok(Some(secret))
}

/// The slot policy's `[limits]`: the global cap, the Retry-After, the lease TTL.
fn slot_limits(text: &str, limits: &Limits) -> Result<SlotPolicyBuilder, Refusal> {
    let mut builder = SlotPolicy::builder();
    if let Some(global) = &limits.global_max {
        if *global.get_ref() == 0 {
            return Err(refuse(
                text,
                Some(global.span()),
                "[limits] global_max = 0: give at least 1".into(),
            ));
        }
        builder = builder.global_max(*global.get_ref());
    }
    if let Some(ms) = &limits.retry_after_ms {
        let value = *ms.get_ref();
        if value == 0 || value > MAX_WAIT_MS {
            return Err(refuse(
                text,
                Some(ms.span()),
                format!(
                    "[limits] retry_after_ms = {value}: give 1 to {MAX_WAIT_MS} (at most an hour)"
                ),
            ));
        }
        builder = builder.retry_after(Duration::from_millis(value));
    }
    if let Some(ms) = &limits.lease_ttl_ms {
        builder = builder.lease_ttl(Duration::from_millis(*ms.get_ref()));
    }
    Ok(builder)
}

/// A `[[tiers]]` entry, refused unless its name is clean and new (`configured` holds those
/// seen), its cap at least 1 and its max wait at most an hour.
fn check_tier<'a>(
    text: &str,
    entry: &'a Spanned<TierEntry>,
    configured: &mut HashSet<String>,
) -> Result<&'a TierEntry, Refusal> {
    let span = entry.span();
    let tier = entry.get_ref();
    if tier.name.trim().is_empty() || tier.name.trim() != tier.name {
        return Err(refuse(
            text,
            Some(span),
            "a [[tiers]] entry has an empty name or spaces around it".into(),
        ));
    }
    if !configured.insert(tier.name.clone()) {
        return Err(refuse(
            text,
            Some(span),
            format!(
                "[[tiers]] `{}` is listed twice: give each tier once",
                tier.name
            ),
        ));
    }
    if tier.cap == 0 {
        return Err(refuse(
            text,
            Some(span),
            format!("[[tiers]] `{}`: cap = 0: give at least 1", tier.name),
        ));
    }
    if let Some(cap) = &tier.tenant_cap
        && *cap.get_ref() == 0
    {
        return Err(refuse(
            text,
            Some(cap.span()),
            format!(
                "[[tiers]] `{}`: tenant_cap = 0: give at least 1 (or leave it out)",
                tier.name
            ),
        ));
    }
    let waits = [
        ("max_wait_ms", Some(&tier.max_wait_ms)),
        ("standard_max_wait_ms", tier.standard_max_wait_ms.as_ref()),
        ("batch_max_wait_ms", tier.batch_max_wait_ms.as_ref()),
    ];
    for (field, wait) in waits {
        if let Some(wait) = wait.filter(|wait| *wait.get_ref() > MAX_WAIT_MS) {
            return Err(refuse(
                text,
                Some(wait.span()),
                format!(
                    "[[tiers]] `{}`: {field} = {}: give at most {MAX_WAIT_MS} (an hour)",
                    tier.name,
                    wait.get_ref()
                ),
            ));
        }
    }
    Ok(tier)
}

/// The clients the `[[keys]]` name.
struct Clients {
    keys: KeyTable,
    /// Sorted.
    tenants: Vec<String>,
    tenant_tiers: BTreeMap<String, String>,
    identities: Identities,
}

/// The `[[keys]]`, each checked against `tiers` (the known tier names) and the keys before
/// it.
fn clients(
    text: &str,
    entries: &[Spanned<KeyEntry>],
    tiers: &[String],
    user_secret: Option<&[u8]>,
) -> Result<Clients, Refusal> {
    let mut keys = KeyTable::new();
    let mut tenants = HashSet::new();
    let mut tenant_tiers = BTreeMap::new();
    let mut identities = Identities::default();
    for (i, spanned) in entries.iter().enumerate() {
        let (entry, sha256) = check_key(text, i + 1, spanned, tiers, &keys)?;
        let claims = check_claims(text, i + 1, spanned, tiers)?;
        let policy = KeyPolicy::new(
            entry.tenant.as_str(),
            entry.tier.as_str(),
            claims,
            (entry.users, user_secret),
        );
        identities.insert(sha256, policy);
        keys.insert_sha256(sha256, entry.tenant.as_str(), entry.tier.as_str());
        tenants.insert(entry.tenant.clone());
        tenant_tiers
            .entry(entry.tenant.clone())
            .or_insert_with(|| entry.tier.clone());
    }
    let mut tenants: Vec<String> = tenants.into_iter().collect();
    tenants.sort();
    Ok(Clients {
        keys,
        tenants,
        tenant_tiers,
        identities,
    })
}

/// Key #`n`'s `origin` (default `user`) and `origins`, refused unless each is a known
/// origin and the key's own is among those it may claim.
fn check_origins(text: &str, n: usize, entry: &KeyEntry) -> Result<(Origin, Vec<Origin>), Refusal> {
    let origin_of = |name: &str, span| {
        parse_origin(name).ok_or_else(|| {
            refuse(
                text,
                Some(span),
                format!(
                    "key #{n} (tenant `{}`): unknown origin `{name}`; known: user, scheduled, \
                     batch",
                    entry.tenant
                ),
            )
        })
    };
    let origin = match &entry.origin {
        Some(origin) => origin_of(origin.get_ref(), origin.span())?,
        None => Origin::UserAction,
    };
    let mut origins = Vec::new();
    if let Some(list) = &entry.origins {
        for name in list.get_ref() {
            origins.push(origin_of(name, list.span())?);
        }
        if !origins.contains(&origin) {
            return Err(refuse(
                text,
                Some(list.span()),
                format!(
                    "key #{n} (tenant `{}`): its origin `{}` is not among its `origins`",
                    entry.tenant,
                    origin_name(origin)
                ),
            ));
        }
    }
    Ok((origin, origins))
}

/// Key #`n`'s `origin`, `tiers` and `origins`, refused unless each names a known origin or
/// a tier the key's own `tier` is among (a default it could not claim is a mistake).
fn check_claims(
    text: &str,
    n: usize,
    spanned: &Spanned<KeyEntry>,
    known: &[String],
) -> Result<Claims, Refusal> {
    let entry = spanned.get_ref();
    if entry.users && entry.tenant.contains('/') {
        return Err(refuse(
            text,
            Some(spanned.span()),
            format!(
                "key #{n} (tenant `{}`): a key with `users = true` names a tenant without `/` \
                 (its end users are `tenant/…`)",
                entry.tenant
            ),
        ));
    }
    let (origin, origins) = check_origins(text, n, entry)?;
    let mut tiers = Vec::new();
    if let Some(list) = &entry.tiers {
        if let Some(unknown) = list.get_ref().iter().find(|t| !known.contains(t)) {
            return Err(refuse(
                text,
                Some(list.span()),
                format!(
                    "key #{n} (tenant `{}`): unknown tier `{unknown}` in `tiers`; known: {} \
                     (add it under [[tiers]])",
                    entry.tenant,
                    known.join(", ")
                ),
            ));
        }
        tiers.clone_from(list.get_ref());
        if !tiers.contains(&entry.tier) {
            return Err(refuse(
                text,
                Some(list.span()),
                format!(
                    "key #{n} (tenant `{}`): its tier `{}` is not among its `tiers`",
                    entry.tenant, entry.tier
                ),
            ));
        }
    }
    Ok(Claims {
        origin,
        origins,
        tiers,
    })
}

/// The 32 bytes written as 64 hex digits (either case), or `None`.
fn sha256_hex(hex: &str) -> Option<[u8; 32]> {
    let digits = hex.as_bytes();
    if digits.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        let high = char::from(pair[0]).to_digit(16)?;
        let low = char::from(pair[1]).to_digit(16)?;
        *byte = u8::try_from(high << 4 | low).ok()?;
    }
    Some(out)
}

/// Key #`n`, refused unless it gives exactly one of `key` and `key_sha256`, can
/// authenticate, names a tenant and a known tier, and is not in `keys` already. The entry
/// and the SHA-256 of its key.
fn check_key<'a>(
    text: &str,
    n: usize,
    entry: &'a Spanned<KeyEntry>,
    tiers: &[String],
    keys: &KeyTable,
) -> Result<(&'a KeyEntry, [u8; 32]), Refusal> {
    let span = Some(entry.span());
    let entry = entry.get_ref();
    let (sha256, key_span) = match (&entry.key, &entry.key_sha256) {
        (Some(key), None) => {
            if !key_is_sendable(&key.get_ref().0) {
                return Err(refuse(
                    text,
                    Some(key.span()),
                    format!(
                        "key #{n} (tenant `{}`) is empty or has a character a header cannot \
                         carry (spaces, control characters, NUL or non-ASCII): it could never \
                         authenticate",
                        entry.tenant
                    ),
                ));
            }
            (KeyTable::sha256(&key.get_ref().0), Some(key.span()))
        }
        (None, Some(hash)) => match sha256_hex(&hash.get_ref().0) {
            Some(sha256) => (sha256, Some(hash.span())),
            None => {
                return Err(refuse(
                    text,
                    Some(hash.span()),
                    format!(
                        "key #{n} (tenant `{}`): `key_sha256` must be 64 hex digits, the \
                         SHA-256 of the key (`printf %s KEY | sha256sum`)",
                        entry.tenant
                    ),
                ));
            }
        },
        _ => {
            return Err(refuse(
                text,
                span,
                format!(
                    "key #{n} (tenant `{}`): give exactly one of `key` and `key_sha256`",
                    entry.tenant
                ),
            ));
        }
    };
    if entry.tenant.trim().is_empty() {
        return Err(refuse(text, span, format!("key #{n} has an empty tenant")));
    }
    if !tiers.contains(&entry.tier) {
        return Err(refuse(
            text,
            span,
            format!(
                "key #{n} (tenant `{}`): unknown tier `{}`; known: {} (add it under [[tiers]])",
                entry.tenant,
                entry.tier,
                tiers.join(", ")
            ),
        ));
    }
    if keys.get_sha256(&sha256).is_some() {
        return Err(refuse(
            text,
            key_span,
            format!("key #{n} (tenant `{}`) is listed twice", entry.tenant),
        ));
    }
    Ok((entry, sha256))
}

/// The demotion policy's `[limits]`: the daily token budget and how long a demotion lasts.
fn demotion(text: &str, limits: &Limits) -> Result<DemotionPolicy, Refusal> {
    let mut demotion = DemotionPolicy::builder();
    if let Some(tokens) = &limits.daily_token_budget {
        demotion = demotion.default_daily_budget(*tokens.get_ref());
    }
    if let Some(ms) = &limits.demotion_ms {
        demotion = demotion.demote_for(Duration::from_millis(*ms.get_ref()));
    }
    if let Some(counts) = &limits.budget_counts {
        demotion = demotion.budget_counts(match counts.get_ref().as_str() {
            "input" => fairgate::BudgetCounts::InputTokens,
            "weighted" => fairgate::BudgetCounts::Weighted,
            other => {
                return Err(refuse(
                    text,
                    Some(counts.span()),
                    format!(
                        "[limits] budget_counts = \"{other}\": give \"input\" (input tokens, \
                         the default) or \"weighted\" (the fair queue's charge)"
                    ),
                ));
            }
        });
    }
    let span = limits
        .daily_token_budget
        .as_ref()
        .map(Spanned::span)
        .or_else(|| limits.demotion_ms.as_ref().map(Spanned::span));
    demotion
        .build()
        .map_err(|e| refuse(text, span, format!("bad [limits] demotion: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "sk-secret-never-shown";

    fn entry(key_line: &str) -> String {
        format!("[[keys]]\n{key_line}\ntenant = \"t\"\ntier = \"premium\"\n")
    }

    fn refused(text: &str) -> Refusal {
        match parse(text) {
            Ok(_) => panic!("accepted:\n{text}"),
            Err(refusal) => refusal,
        }
    }

    #[test]
    fn a_key_given_by_its_sha256_authenticates_the_key() {
        let hex: String = KeyTable::sha256(SECRET)
            .iter()
            .map(|b| format!("{b:02X}"))
            .collect();
        let config = parse(&entry(&format!("key_sha256 = \"{hex}\""))).unwrap();
        assert_eq!(config.keys.get(SECRET).unwrap().0.as_str(), "t");
        assert!(config.keys.get("sk-other").is_none());
        // The same key given in clear and by its hash is listed twice.
        let twice = format!(
            "{}{}",
            entry(&format!("key = \"{SECRET}\"")),
            entry(&format!("key_sha256 = \"{}\"", hex.to_lowercase()))
        );
        let refusal = refused(&twice);
        assert_eq!(refusal.line, Some(6));
        assert!(
            refusal.message.contains("listed twice"),
            "{}",
            refusal.message
        );
    }

    #[test]
    fn an_entry_needs_exactly_one_of_key_and_key_sha256_and_a_well_formed_hash() {
        let hex = "ab".repeat(32);
        for (text, line, what) in [
            (
                entry(&format!("key = \"{SECRET}\"\nkey_sha256 = \"{hex}\"")),
                1,
                "exactly one of",
            ),
            (entry(""), 1, "exactly one of"),
            (
                entry(&format!("key_sha256 = \"{}\"", &hex[..63])),
                2,
                "64 hex digits",
            ),
            (
                entry(&format!("key_sha256 = \"{}zz\"", &hex[..62])),
                2,
                "64 hex digits",
            ),
            (entry("key_sha256 = 12"), 2, "must be a string"),
        ] {
            let refusal = refused(&text);
            assert_eq!(refusal.line, Some(line), "{text}: {}", refusal.message);
            assert!(
                refusal.message.contains(what),
                "{text}: {}",
                refusal.message
            );
            assert!(!refusal.message.contains(SECRET), "{}", refusal.message);
        }
    }

    #[test]
    fn expect_keys_refuses_a_file_with_another_count() {
        let two = format!(
            "{}\n{}",
            entry("key = \"sk-a\""),
            entry("key = \"sk-b\"").replace("\"t\"", "\"u\"")
        );
        assert_eq!(
            parse(&format!("expect_keys = 2\n\n{two}"))
                .unwrap()
                .keys
                .len(),
            2
        );
        // Cut after the first entry: the count says so, on expect_keys' line.
        let cut = format!("expect_keys = 2\n\n{}", entry("key = \"sk-a\""));
        let refusal = refused(&cut);
        assert_eq!(refusal.line, Some(1));
        assert!(
            refusal
                .message
                .contains("expect_keys = 2 but the file holds 1 [[keys]]"),
            "{}",
            refusal.message
        );
        let refusal = refused(&format!("expect_keys = 3\n\n{two}"));
        assert!(refusal.message.contains("holds 2"), "{}", refusal.message);
        // Cut before any entry.
        assert!(refused("expect_keys = 1\n").message.contains("holds 0"));
    }

    const SERVICE: &str = "[[keys]]
key = \"sk-svc\"
tenant = \"companion-app\"
users = true
tier = \"free\"
origin = \"user\"
tiers = [\"guest\", \"free\", \"pro\", \"premium\"]
origins = [\"user\", \"scheduled\", \"batch\"]
";

    #[test]
    fn a_service_key_with_the_issues_fields_is_taken() {
        let config = parse(SERVICE).unwrap();
        let sha256 = KeyTable::sha256("sk-svc");
        let policy = config.identities.get_sha256(&sha256).unwrap();
        let mut headers = http::HeaderMap::new();
        headers.insert("x-fairgate-tier", "premium".parse().unwrap());
        let job = policy.identify(&headers, Some("u1")).unwrap();
        assert!(job.tenant().as_str().starts_with("companion-app/"));
        assert_eq!(job.tier().unwrap().as_str(), "premium");
        // With a `user_secret` the same user is another tenant (and the same on every
        // gateway with that file).
        let secret = format!("user_secret = \"{}\"\n{SERVICE}", "s".repeat(16));
        let other = parse(&secret).unwrap();
        let job2 = other
            .identities
            .get_sha256(&sha256)
            .unwrap()
            .identify(&headers, Some("u1"))
            .unwrap();
        assert_ne!(job.tenant(), job2.tenant());
    }

    #[test]
    fn the_pools_spill_wait_and_the_budgets_unit_are_read_and_checked() {
        let config = parse(SERVICE).unwrap();
        assert_eq!(config.spill_after, Duration::from_secs(1));
        assert_eq!(
            config.demotion.budget_counts(),
            fairgate::BudgetCounts::InputTokens
        );
        let set = format!("{SERVICE}\n[pool]\nspill_after_ms = 250\n");
        assert_eq!(parse(&set).unwrap().spill_after, Duration::from_millis(250));
        let long = format!("{SERVICE}\n[pool]\nspill_after_ms = 3600001\n");
        assert!(refused(&long).message.contains("spill_after_ms"));
        let weighted = format!("{SERVICE}\n[limits]\nbudget_counts = \"weighted\"\n");
        assert_eq!(
            parse(&weighted).unwrap().demotion.budget_counts(),
            fairgate::BudgetCounts::Weighted
        );
        let other = weighted.replace("\"weighted\"", "\"output\"");
        assert!(refused(&other).message.contains("budget_counts"));
    }

    #[test]
    fn bad_claims_fields_are_refused_on_their_line() {
        for (from, to, line, what) in [
            (
                "origin = \"user\"",
                "origin = \"cron\"",
                6,
                "unknown origin `cron`",
            ),
            (
                "origins = [\"user\", \"scheduled\", \"batch\"]",
                "origins = [\"batch\"]",
                8,
                "not among its `origins`",
            ),
            (
                "tiers = [\"guest\", \"free\", \"pro\", \"premium\"]",
                "tiers = [\"gold\"]",
                7,
                "unknown tier `gold` in `tiers`",
            ),
            (
                "tiers = [\"guest\", \"free\", \"pro\", \"premium\"]",
                "tiers = [\"pro\"]",
                7,
                "tier `free` is not among its `tiers`",
            ),
            (
                "tenant = \"companion-app\"",
                "tenant = \"a/b\"",
                1,
                "without `/`",
            ),
            ("users = true", "users = \"yes\"", 4, "expected a boolean"),
        ] {
            let text = SERVICE.replace(from, to);
            let refusal = refused(&text);
            assert_eq!(refusal.line, Some(line), "{text}: {}", refusal.message);
            assert!(refusal.message.contains(what), "{}", refusal.message);
        }
        let short = refused(&format!("user_secret = \"short\"\n{SERVICE}"));
        assert_eq!(short.line, Some(1));
        assert!(!short.message.contains("\"short\""), "{}", short.message);
    }

    #[test]
    fn a_tiers_class_waits_are_the_policys_and_past_an_hour_refused() {
        let tiers = "[[tiers]]\nname = \"free\"\ncap = 15\nmax_wait_ms = 12000\n\
                     standard_max_wait_ms = 6000\nbatch_max_wait_ms = 600000\n";
        let config = parse(&format!("{SERVICE}{tiers}")).unwrap();
        let (_, free, _) = config.policy.limit(Some(&"free".into()));
        assert_eq!(free.standard_max_wait, Some(Duration::from_secs(6)));
        assert_eq!(free.batch_max_wait, Duration::from_secs(600));
        let (_, pro, _) = config.policy.limit(Some(&"pro".into()));
        assert_eq!(
            (pro.standard_max_wait, pro.batch_max_wait),
            (None, Duration::from_secs(120))
        );
        let long = tiers.replace("600000", "3600001");
        let refusal = refused(&format!("{SERVICE}{long}"));
        assert!(
            refusal.message.contains("batch_max_wait_ms = 3600001"),
            "{}",
            refusal.message
        );
    }

    #[test]
    fn a_tiers_refusals_say_not_to_retry_unless_it_says_retry() {
        let tiers = "[[tiers]]\nname = \"free\"\ncap = 15\nmax_wait_ms = 1000\n\
                     [[tiers]]\nname = \"batchy\"\ncap = 2\nmax_wait_ms = 1000\nretry = true\n";
        let config = parse(&format!("{SERVICE}{tiers}")).unwrap();
        assert!(!config.policy.limit(Some(&"free".into())).1.retry);
        assert!(config.policy.limit(Some(&"batchy".into())).1.retry);
    }

    #[test]
    fn a_tier_tenant_cap_is_the_policys_and_zero_is_refused() {
        let tiers = "[[tiers]]\nname = \"free\"\ncap = 15\nmax_wait_ms = 1000\ntenant_cap = 2\n";
        let config = parse(&format!("{SERVICE}\n{tiers}")).unwrap();
        assert_eq!(
            config.policy.limit(Some(&"free".into())).1.tenant_cap,
            Some(2)
        );
        let zero = refused(&format!("{SERVICE}\n{}", tiers.replace("= 2", "= 0")));
        assert_eq!(zero.line, Some(14));
        assert!(zero.message.contains("tenant_cap = 0"), "{}", zero.message);
    }
}

#[cfg(test)]
mod readme {
    use super::parse;

    /// The pages that show keys files: the README and the operator's guide.
    const PAGES: [(&str, &str); 4] = [
        ("README.md", include_str!("../../../README.md")),
        (
            "docs/gateway/keys.md",
            include_str!("../../../docs/gateway/keys.md"),
        ),
        (
            "docs/gateway/service-keys.md",
            include_str!("../../../docs/gateway/service-keys.md"),
        ),
        (
            "docs/gateway/upstreams.md",
            include_str!("../../../docs/gateway/upstreams.md"),
        ),
    ];

    /// The keys files `page` shows: its ```toml blocks and the heredocs of its install
    /// blocks (`cat > keys.toml <<'EOF'`), each with its first line.
    fn keys_files(page: &str) -> Vec<(usize, String)> {
        let mut files = Vec::new();
        let mut current: Option<(usize, String, &str)> = None;
        for (n, line) in page.lines().enumerate() {
            match &mut current {
                None if line == "```toml" => current = Some((n + 2, String::new(), "```")),
                None if line.starts_with("cat > ") && line.ends_with("<<'EOF'") => {
                    current = Some((n + 2, String::new(), "EOF"));
                }
                None => {}
                Some((first, text, end)) if line == *end => {
                    files.push((*first, std::mem::take(text)));
                    current = None;
                }
                Some((_, text, _)) => {
                    text.push_str(line);
                    text.push('\n');
                }
            }
        }
        files
    }

    #[test]
    fn every_keys_file_the_docs_show_passes_the_gateways_check() {
        for (name, page) in PAGES {
            let mut checked = 0;
            // A ```toml block without `[[keys]]` is a `[dependencies]` block or a simulator
            // policy (the simulator's `tests/replay.rs` checks those).
            for (line, text) in keys_files(page)
                .into_iter()
                .filter(|(_, text)| text.contains("[[keys]]"))
            {
                if let Err(refusal) = parse(&text) {
                    panic!("{name} line {line}: the keys file is refused: {refusal:?}\n{text}");
                }
                checked += 1;
            }
            assert!(checked > 0, "no keys file found in {name}");
        }
    }
}
