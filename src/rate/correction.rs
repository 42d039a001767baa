//! A success's usage correcting what learned pacing charged before the call went: read as
//! its body streams to the caller (decoded on the side when compressed), reported once.

use std::sync::Arc;

use bytes::Buf;

use super::core::Rates;
use super::encoded::UsageReader;
use crate::store::DIMS;

/// A success's body being scanned for its usage, and the correction to report once it is
/// known: when the body ends, or when it is dropped after a usage was seen.
pub(crate) struct Usage {
    /// Decodes a compressed answer on the side (`encoded.rs`).
    reader: UsageReader<2>,
    /// `None` once reported (or given up).
    report: Option<Report>,
}

struct Report {
    rates: Arc<Rates>,
    key: Arc<str>,
    /// The cells the call needed per dimension (see `needs`) ...
    need: [u32; DIMS],
    /// ... and those the store took (0 where no limit was learned) ...
    charged: [u32; DIMS],
    /// ... and the input tokens the fleet's token rate took (0: none).
    fleet_tokens: u32,
    /// The key's learned limits when the answer came.
    limits: [u32; DIMS],
}

impl Usage {
    /// The report of a call that needed `need` cells per dimension, of which learned pacing
    /// took `charged` and the fleet's token rate `fleet_tokens` input tokens.
    /// `headers` are the answer's (its `content-encoding`).
    pub(crate) fn new(
        rates: Arc<Rates>,
        (key, headers): (Arc<str>, &http::HeaderMap),
        (need, charged, fleet_tokens): ([u32; DIMS], [u32; DIMS], u32),
        limits: [u32; DIMS],
    ) -> Self {
        Usage {
            reader: UsageReader::new(headers),
            report: Some(Report {
                rates,
                key,
                need,
                charged,
                fleet_tokens,
                limits,
            }),
        }
    }

    /// Reads a data frame's bytes.
    pub(crate) fn feed(&mut self, data: &impl Buf) {
        if self.report.is_none() {
            return;
        }
        self.reader.feed(data);
        if !self.reader.readable() {
            // Nothing read from here on could be trusted (bytes that do not decode, or not
            // contiguous): no correction.
            self.report = None;
        }
    }

    /// The body ended (`ended`) or is going away: reports the correction, once, if a usage
    /// was seen. Only a complete answer's output count moves the key's expected output.
    pub(crate) fn finish(&mut self, ended: bool) {
        let scanner = *self.reader.usage();
        if !scanner.saw_usage() {
            return;
        }
        if let Some(report) = self.report.take() {
            let charge = charges(
                report.need,
                report.charged,
                report.limits,
                scanner.input_tokens(),
                scanner.output_tokens(),
            );
            let used = scanner.output_tokens().filter(|_| ended).map(|output| {
                let input = scanner.input_tokens().unwrap_or(report.need[1]);
                (input, output)
            });
            report.rates.correct_usage(&report.key, charge, used);
            if let (true, Some(input)) = (report.fleet_tokens > 0, scanner.input_tokens()) {
                let beyond = i64::from(input) - i64::from(report.fleet_tokens);
                report.rates.store.correct_fleet_tokens(beyond);
            }
        }
    }
}

impl Drop for Usage {
    fn drop(&mut self) {
        self.finish(false);
    }
}

/// The correction per dimension (requests, input, output, tokens) of a call that needed
/// `need` and was charged `charged` before it went, once its answer said it used `input`
/// and `output` tokens: the true use minus the charge, in the dimensions charged, at most
/// one minute of the limit (a call larger than the bucket empties it rather than stopping
/// the key for longer). A count the answer did not give counts as needed.
fn charges(
    need: [u32; DIMS],
    charged: [u32; DIMS],
    limits: [u32; DIMS],
    input: Option<u32>,
    output: Option<u32>,
) -> [i64; DIMS] {
    let input = input.unwrap_or(need[1]);
    let output = output.unwrap_or(need[2]);
    let used = [need[0], input, output, input.saturating_add(output)];
    let mut charge = [0; DIMS];
    for d in 0..DIMS {
        if charged[d] > 0 && limits[d] > 0 {
            charge[d] = (i64::from(used[d]) - i64::from(charged[d])).min(i64::from(limits[d]));
        }
    }
    charge
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rate::core::needs;
    use crate::rate::usage::MAX_TOKENS;
    use std::time::Duration;

    #[test]
    fn the_correction_is_true_use_minus_the_charge_in_charged_dimensions_capped_at_a_minute() {
        let need = needs(100, 1); // [1, 100, 1, 101]
        let all = [50, 40_000, 8_000, 100_000];
        assert_eq!(
            charges(need, need, all, Some(1_000), Some(500)),
            [0, 900, 499, 1_399]
        );
        // Over-estimated input is given back; so is an expected output not used.
        let expecting = needs(100, 600);
        assert_eq!(
            charges(expecting, expecting, all, Some(30), Some(1)),
            [0, -70, -599, -669]
        );
        // Only what the answer told; only dimensions charged.
        assert_eq!(
            charges(need, [1, 0, 1, 0], all, None, Some(21)),
            [0, 0, 20, 0]
        );
        // At most one minute of the limit.
        assert_eq!(
            charges(need, need, all, Some(MAX_TOKENS), Some(MAX_TOKENS)),
            [0, 40_000, 8_000, 100_000]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_usage_is_charged_once_when_the_body_ends_and_is_dropped() {
        use crate::store::PaceAsk;
        use crate::{BackoffPolicy, Store};
        // 60 output tokens a minute, paced at 57: a 57-cell bucket, one cell ~1.05 s.
        let config = BackoffPolicy::default().rate_config();
        let core = Arc::new(Rates::new(Store::memory(), config));
        let key: Arc<str> = Arc::from("k");
        let ask = |take: u32| PaceAsk {
            headroom_permille: 950,
            learn: [(0, 0), (0, 0), (60, 60), (0, 0)],
            take: [0, 0, take, 0],
            ..PaceAsk::default()
        };
        let _ = core.store.pace_learned(&key, &ask(0)).into_ready();
        let limits = [0, 0, 60, 0];
        let body = br#"{"usage":{"input_tokens":3,"output_tokens":31}}"#;
        // 30 cells charged after the fact (31 used, 1 charged before), read from the answer
        // as the API sends it to a client that asked for gzip.
        let need = needs(1, 1);
        let charged = [0, 0, 1, 0];
        let mut gzip = http::HeaderMap::new();
        gzip.insert(http::header::CONTENT_ENCODING, "gzip".parse().unwrap());
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut encoder, body).unwrap();
        let compressed = encoder.finish().unwrap();
        let mut usage = Usage::new(
            core.clone(),
            (key.clone(), &gzip),
            (need, charged, 0),
            limits,
        );
        usage.feed(&&compressed[..20]);
        usage.feed(&&compressed[20..]);
        usage.finish(true);
        drop(usage);
        // Once: 30 of 57 cells taken, a call of one cell goes at once (twice would be 60).
        let grant = core.store.pace_learned(&key, &ask(1)).into_ready().unwrap();
        assert_eq!(grant.wait, Duration::ZERO);
        // Dropped after the usage was seen, without an end: charged (27 more cells would
        // fit; 28 more do not).
        let mut usage = Usage::new(
            core.clone(),
            (key.clone(), &http::HeaderMap::new()),
            (need, charged, 0),
            limits,
        );
        usage.feed(&&br#"{"output_tokens":29}"#[..]);
        drop(usage);
        let grant = core.store.pace_learned(&key, &ask(1)).into_ready().unwrap();
        assert!(grant.wait > Duration::ZERO, "{grant:?}");
        // No usage seen: nothing charged.
        tokio::time::advance(Duration::from_secs(120)).await;
        let mut usage = Usage::new(
            core.clone(),
            (key.clone(), &http::HeaderMap::new()),
            (need, charged, 0),
            limits,
        );
        usage.feed(&&br#"{"type":"error"}"#[..]);
        usage.finish(true);
        drop(usage);
        let grant = core
            .store
            .pace_learned(&key, &ask(57))
            .into_ready()
            .unwrap();
        assert_eq!(grant.wait, Duration::ZERO, "the bucket is full again");
    }
}
