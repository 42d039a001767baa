//! What a `POST /v1/messages` call costs: the charge its tenant's fair share and daily
//! budget pay, estimated from the body when the call goes and settled on the answer's
//! `usage`.
//!
//! The charge counts what the call takes from the provider, weighted as the provider's
//! limits weigh it (the Virtual Token Counter of Sheng et al., OSDI 2024, charges input and
//! output with weights the same way):
//!
//! ```text
//! charge = model_weight × (input + cache_write_weight × cache_creation_input_tokens
//!                               + cache_read_weight × cache_read_input_tokens
//!                               + output_weight × output)
//! ```
//!
//! - **At dispatch**, `input` is estimated from the body's text (ceil(bytes / 3.5), a
//!   `gzip` or `deflate` body decompressed first) and `output` is the body's `max_tokens`,
//!   the most the answer may use: a call asking for a long answer is charged for it before
//!   it holds a slot, whatever the size of its prompt.
//! - **On the answer**, its `usage` (a JSON message's, or a stream's `message_start` and
//!   `message_delta` events, read as the bytes pass by the library's [`UsageReader`],
//!   which decodes a `gzip`, `deflate` or `br` answer on the side) replaces the estimate:
//!   the difference is settled against the tenant's DRR deficit and its token count for the
//!   day ([`Settler`]). An error answer (the upstream's `429` and `529` included) cost
//!   nothing and is settled at 0. A success whose usage cannot be read (none in it, an
//!   encoding that does not decode, or cut before it) ran: it keeps the estimate, and
//!   `/usage` counts the estimate, marked so.
//!
//! The keys file's `[cost]` table sets the weights (all optional):
//!
//! ```toml
//! [cost]
//! output_weight = 5.0       # an output token weighs 5 input tokens (OTPM is commonly ITPM / 5)
//! cache_write_weight = 1.0  # cache writes count toward the input-token limit
//! cache_read_weight = 0.0   # cache reads do not (current models)
//! max_charge = 400000       # the most one call is charged in the fair queue
//!
//! [cost.models]             # a weight per model, by the longest prefix of its id
//! "claude-opus-4" = 5.0
//! "claude-haiku" = 0.25
//! ```
//!
//! A body the estimate cannot read is refused before it takes a slot, as the API would
//! refuse it: not JSON, not an object, or no whole `max_tokens` → `400`; a
//! `content-encoding` other than `gzip`, `deflate` or `identity` → `415`; a compressed body
//! that does not decompress → `400`, or that grows past `--max-body` or
//! [`MAX_RATIO`] times its compressed size (above [`RATIO_FLOOR`]) → `413`, read no
//! further (a zip bomb costs at most that much decompression).

use std::collections::BTreeMap;
use std::io::Read;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use fairgate::drr_fairness::Settler;
use fairgate::rate::{UsageReader, UsageScanner};
use fairgate::{BoxError, Job};
use http::header::{self, HeaderMap};
use http::{Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use serde::Deserialize;

use crate::body::Body;
use crate::ledger::usage::{Counts, Usage};

/// A compressed body may grow at most this many times its compressed size ...
pub(crate) const MAX_RATIO: usize = 100;
/// ... or to this many bytes, whichever is more (and never past `--max-body`).
pub(crate) const RATIO_FLOOR: usize = 1 << 20;

/// The keys file's `[cost]` table, as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct CostTable {
    output_weight: Option<f64>,
    cache_write_weight: Option<f64>,
    cache_read_weight: Option<f64>,
    max_charge: Option<u64>,
    #[serde(default)]
    models: BTreeMap<String, f64>,
}

/// The weights a call's charge is counted with; see the [module docs](self).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CostModel {
    output: f64,
    cache_write: f64,
    cache_read: f64,
    max_charge: u64,
    /// Model id prefixes and their weights, longest prefix first.
    models: Vec<(String, f64)>,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            output: 5.0,
            cache_write: 1.0,
            cache_read: 0.0,
            // A 64,000-token answer at weight 5, and a prompt beside it.
            max_charge: 400_000,
            models: Vec::new(),
        }
    }
}

impl CostModel {
    /// The model `[cost]` describes, or what is wrong with it.
    pub(crate) fn from_table(table: &CostTable) -> Result<CostModel, String> {
        let weight = |name: &str, value: Option<f64>, default: f64| match value {
            None => Ok(default),
            Some(w) if w.is_finite() && (0.0..=1_000.0).contains(&w) => Ok(w),
            Some(w) => Err(format!("[cost] {name} = {w}: give a number from 0 to 1000")),
        };
        let defaults = CostModel::default();
        let max_charge = table.max_charge.unwrap_or(defaults.max_charge);
        if max_charge == 0 {
            return Err("[cost] max_charge = 0: give at least 1".into());
        }
        let mut models = Vec::with_capacity(table.models.len());
        for (prefix, &w) in &table.models {
            if prefix.is_empty() || !w.is_finite() || !(0.001..=1_000.0).contains(&w) {
                return Err(format!(
                    "[cost.models] \"{prefix}\" = {w}: give a non-empty model id prefix and a \
                     weight from 0.001 to 1000"
                ));
            }
            models.push((prefix.clone(), w));
        }
        models.sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        Ok(CostModel {
            output: weight("output_weight", table.output_weight, defaults.output)?,
            cache_write: weight(
                "cache_write_weight",
                table.cache_write_weight,
                defaults.cache_write,
            )?,
            cache_read: weight(
                "cache_read_weight",
                table.cache_read_weight,
                defaults.cache_read,
            )?,
            max_charge,
            models,
        })
    }

    /// The most one call is charged in the fair queue, in quanta of `quantum` tokens
    /// (rounded up): a call up to it pays its whole charge before it goes.
    pub(crate) fn max_charge_quanta(&self, quantum: u64) -> u32 {
        u32::try_from(self.max_charge.div_ceil(quantum.max(1))).unwrap_or(u32::MAX)
    }

    /// The weight of `model`: that of the longest configured prefix of its id, else 1.
    fn model_weight(&self, model: Option<&str>) -> f64 {
        model
            .and_then(|model| {
                self.models
                    .iter()
                    .find(|(prefix, _)| model.starts_with(prefix.as_str()))
            })
            .map_or(1.0, |(_, w)| *w)
    }

    /// The estimate of a call from its headers and (buffered) body; `max_decoded` is the
    /// most a compressed body may decompress to (`--max-body`).
    pub(crate) fn estimate(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        max_decoded: usize,
    ) -> Result<Estimate, Refused> {
        let (head, bytes) = read_head(headers, body, max_decoded)?;
        let Some(max_tokens) = head.max_tokens else {
            return Err(Refused::bad("max_tokens: field required"));
        };
        let input = (bytes as u64).saturating_mul(2).div_ceil(7).max(1);
        let weight = self.model_weight(head.model.as_deref());
        let charge = weight * (input as f64 + self.output * max_tokens as f64);
        Ok(Estimate {
            input: u32::try_from(input).unwrap_or(u32::MAX),
            charge: to_tokens(charge),
            weight,
            max_tokens,
            user: head.user(),
            stream: head.stream == Some(serde_json::Value::Bool(true)),
        })
    }

    /// What a call estimated as `estimate` used, by its answer's usage.
    fn used(&self, estimate: &Estimate, usage: &UsageScanner) -> u64 {
        let count = |n: Option<u32>| f64::from(n.unwrap_or(0));
        let input = usage.input_tokens().unwrap_or(estimate.input);
        to_tokens(
            estimate.weight
                * (f64::from(input)
                    + self.cache_write * count(usage.cache_creation_input_tokens())
                    + self.cache_read * count(usage.cache_read_input_tokens())
                    + self.output * count(usage.output_tokens())),
        )
    }
}

/// A weighted count as whole tokens (rounded up; saturating).
fn to_tokens(charge: f64) -> u64 {
    if charge.is_finite() && charge > 0.0 {
        charge.ceil().min(u64::MAX as f64) as u64
    } else {
        0
    }
}

/// What a call is estimated to cost when it goes.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Estimate {
    /// Input tokens estimated from the body's text (what the rate gate paces on).
    input: u32,
    /// The whole weighted charge.
    charge: u64,
    /// The model's weight.
    weight: f64,
    /// The body's `max_tokens`: the most output the call may use.
    max_tokens: u64,
    /// The body's `metadata.user_id`, when it names one.
    user: Option<String>,
    /// The body asks for a stream (`"stream": true`).
    stream: bool,
}

impl Estimate {
    /// The end user the body names in `metadata.user_id`.
    pub(crate) fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    /// Whether the body asks for a stream.
    pub(crate) fn stream(&self) -> bool {
        self.stream
    }

    /// `job` charged this estimate: its input tokens, and the rest of the charge as its
    /// output cost (the model's weight scales the whole charge). The input stays the raw
    /// estimate, which the rate gate paces the provider's input-token limit on, so a model
    /// weighing less than 1 is charged at least its input until its usage settles it.
    pub(crate) fn apply(&self, job: Job) -> Job {
        let rest = self.charge.saturating_sub(u64::from(self.input));
        job.with_cost(self.input)
            .with_output_cost(u32::try_from(rest).unwrap_or(u32::MAX))
    }
}

/// Why a body's cost could not be estimated: the answer to send instead of the call.
#[derive(Debug, PartialEq)]
pub(crate) struct Refused {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl Refused {
    fn bad(message: impl Into<String>) -> Refused {
        Refused {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }

    /// The answer in Anthropic's error shape.
    pub(crate) fn response(&self) -> Response<Body> {
        // The message may quote the client's JSON: only characters safe inside a string.
        let message: String = self
            .message
            .chars()
            .filter(|c| !c.is_control() && *c != '"' && *c != '\\')
            .collect();
        crate::own_answer::error_response(self.status, self.kind, &message)
    }
}

/// The fields of a Messages API body the estimate reads; the rest is checked as JSON and
/// skipped.
#[derive(Deserialize)]
struct Head {
    model: Option<String>,
    max_tokens: Option<u64>,
    /// Read for its `user_id`: the end user a service key's call names (read here, from
    /// the decoded body, so a compressed body names its user too).
    #[serde(default)]
    metadata: Option<serde_json::Value>,
    /// Only `true` asks for a stream (anything else is the upstream's to judge).
    #[serde(default)]
    stream: Option<serde_json::Value>,
}

impl Head {
    /// `metadata.user_id` when it is a string that is not empty (anything else names no
    /// user: the upstream judges the field).
    fn user(&self) -> Option<String> {
        let user = self.metadata.as_ref()?.get("user_id")?.as_str()?;
        (!user.is_empty()).then(|| user.to_owned())
    }
}

/// The body's head and its decoded length.
fn read_head(
    headers: &HeaderMap,
    body: &[u8],
    max_decoded: usize,
) -> Result<(Head, usize), Refused> {
    let coding = headers
        .get(header::CONTENT_ENCODING)
        .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase());
    let limit = max_decoded.min(body.len().saturating_mul(MAX_RATIO).max(RATIO_FLOOR));
    match coding.as_deref() {
        None | Some("") | Some("identity") => serde_json::from_slice(body)
            .map(|head| (head, body.len()))
            .map_err(|e| Refused::bad(format!("the body is not valid JSON: {e}"))),
        Some("gzip" | "x-gzip") => decoded(flate2::read::GzDecoder::new(body), limit),
        Some("deflate") => decoded(flate2::read::ZlibDecoder::new(body), limit),
        Some(other) => Err(Refused {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            kind: "invalid_request_error",
            message: format!(
                "content-encoding {other} is not supported: send gzip, deflate or identity"
            ),
        }),
    }
}

/// Reads a decompressing reader's JSON head, refusing it past `limit` decoded bytes.
fn decoded(reader: impl Read, limit: usize) -> Result<(Head, usize), Refused> {
    let mut capped = Capped {
        inner: reader,
        read: 0,
        limit,
        over: false,
    };
    let head = serde_json::from_reader(std::io::BufReader::new(&mut capped));
    match head {
        Ok(head) => Ok((head, capped.read)),
        Err(_) if capped.over => Err(Refused {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "request_too_large",
            message: format!(
                "the body decompresses to more than {limit} bytes (at most {MAX_RATIO} times \
                 its compressed size, and the gateway's body limit)"
            ),
        }),
        Err(e) if e.is_io() => Err(Refused::bad(format!(
            "the body does not decompress as its content-encoding says: {e}"
        ))),
        Err(e) => Err(Refused::bad(format!("the body is not valid JSON: {e}"))),
    }
}

/// A reader that fails once more than `limit` bytes came out of it.
struct Capped<R> {
    inner: R,
    read: usize,
    limit: usize,
    over: bool,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        // Never asked for more than one byte past the limit: the decoder stops there.
        let room = (self.limit + 1).saturating_sub(self.read).min(buf.len());
        let n = self.inner.read(&mut buf[..room])?;
        self.read += n;
        if self.read > self.limit {
            self.over = true;
            return Err(std::io::Error::other("decompressed body too large"));
        }
        Ok(n)
    }
}

/// The response of a call sent with `estimate`, its body settling the call's charge on its
/// usage: the classified job the call went out with rides in the response's extensions
/// (put there by the innermost service); without it, nothing is settled.
///
/// What ran is what is charged: an error answer (a `429` or `529` refusal of the upstream
/// included) used nothing and is settled at 0 at once; a success is settled on the usage
/// read from its body whatever its `content-encoding`, or at its estimate when that usage
/// cannot be read (never 0).
pub(crate) fn settling(
    mut response: Response<Body>,
    (settler, usage): (&Settler, &Usage),
    model: &Arc<CostModel>,
    estimate: Estimate,
) -> Response<Body> {
    let Some(job) = response.extensions_mut().remove::<Job>() else {
        return response;
    };
    if !response.status().is_success() {
        settler.settle_usage(&job, 0, 0);
        return response;
    }
    let settle = Settle {
        settler: settler.clone(),
        usage: usage.clone(),
        model: model.clone(),
        job,
        estimate,
    };
    let reader = UsageReader::new(response.headers());
    response.map(|inner| {
        http_body_util::BodyExt::boxed_unsync(Settling {
            inner,
            usage: reader,
            settle: Some(settle),
        })
    })
}

/// What an answer's usage says it used, as billed (each count as the provider gave it).
fn billed(usage: &UsageScanner) -> Counts {
    let count = |n: Option<u32>| u64::from(n.unwrap_or(0));
    Counts {
        input_tokens: count(usage.input_tokens()),
        output_tokens: count(usage.output_tokens()),
        cache_creation_input_tokens: count(usage.cache_creation_input_tokens()),
        cache_read_input_tokens: count(usage.cache_read_input_tokens()),
        calls: 1,
        estimated_calls: 0,
    }
}

/// What settling a call needs.
struct Settle {
    settler: Settler,
    /// The book of what each tenant used, for billing.
    usage: Usage,
    model: Arc<CostModel>,
    job: Job,
    estimate: Estimate,
}

impl Settle {
    /// Settles the call at its usage.
    fn used(self, usage: &UsageScanner) {
        let used = self.model.used(&self.estimate, usage);
        let input = usage.input_tokens().unwrap_or(self.estimate.input);
        self.settler.settle_usage(&self.job, used, u64::from(input));
        self.usage.record(self.job.tenant().as_str(), billed(usage));
    }

    /// Settles a call that ran but whose usage could not be read at its estimate: the
    /// body's input and `max_tokens` of output, counted and marked estimated.
    fn estimated(self, why: &'static str) {
        let input = u64::from(self.estimate.input);
        self.settler
            .settle_usage(&self.job, self.estimate.charge, input);
        self.usage.record(
            self.job.tenant().as_str(),
            Counts {
                input_tokens: input,
                output_tokens: self.estimate.max_tokens,
                estimated_calls: 1,
                ..Counts::default()
            },
        );
        metrics::counter!("gateway_usage_estimated_total", "reason" => why).increment(1);
        unreadable_logged(why);
    }
}

/// Logs, at most once a minute, that a call was counted at its estimate.
fn unreadable_logged(why: &'static str) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let mut last = LAST.lock().unwrap_or_else(|e| e.into_inner());
    let now = std::time::Instant::now();
    if last.is_none_or(|at| now.saturating_duration_since(at) >= UNREADABLE_LOG_EVERY) {
        *last = Some(now);
        tracing::warn!(
            reason = why,
            "an answer's usage could not be read: the call is counted at its estimate \
             (gateway_usage_estimated_total counts them; logged at most once a minute)"
        );
    }
}

/// How often the gateway says at most that an answer's usage could not be read.
const UNREADABLE_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// A response body read for its usage as it passes (decoded on the side when compressed),
/// the call settled once: when it ends, or when it is dropped.
struct Settling {
    inner: Body,
    usage: UsageReader,
    settle: Option<Settle>,
}

impl Settling {
    fn finish(&mut self, ended: bool) {
        let Some(settle) = self.settle.take() else {
            return;
        };
        let usage = self.usage.usage();
        match (self.usage.unreadable_because(), usage.saw_usage(), ended) {
            (Some(why), _, _) => settle.estimated(why),
            (None, true, _) => settle.used(usage),
            (None, false, true) => settle.estimated("no_usage"),
            // Cut before any usage: it ran, and what it used is unknown.
            (None, false, false) => settle.estimated("cut"),
        }
    }
}

impl HttpBody for Settling {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    self.usage.feed(data);
                }
            }
            Some(Err(_)) => {}
            None => self.finish(true),
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        self.finish(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    const MAX: usize = 32 << 20;

    fn json(max_tokens: u64) -> String {
        format!(
            r#"{{"model":"claude-opus-4-1","max_tokens":{max_tokens},"messages":[{{"role":"user","content":"Hello there"}}]}}"#
        )
    }

    fn headers(encoding: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(encoding) = encoding {
            headers.insert(header::CONTENT_ENCODING, encoding.parse().unwrap());
        }
        headers
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    fn charge(estimate: &Estimate) -> u64 {
        estimate
            .apply(Job::new("t", fairgate::Origin::UserAction))
            .charge()
    }

    #[test]
    fn a_call_is_charged_its_input_and_max_tokens_at_the_output_weight() {
        let model = CostModel::default();
        let body = json(64_000);
        let estimate = model
            .estimate(&headers(None), body.as_bytes(), MAX)
            .unwrap();
        let input = (body.len() as u64 * 2).div_ceil(7);
        assert_eq!(estimate.input as u64, input);
        assert_eq!(charge(&estimate), input + 5 * 64_000);
        let job = estimate.apply(Job::new("t", fairgate::Origin::UserAction));
        assert_eq!(u64::from(job.cost()), input, "the input stays raw");
    }

    #[test]
    fn a_models_weight_is_that_of_its_longest_configured_prefix() {
        let table: CostTable = toml::from_str(
            "output_weight = 4\n[models]\n\"claude-opus\" = 2.0\n\"claude-opus-4\" = 5.0\n",
        )
        .unwrap();
        let model = CostModel::from_table(&table).unwrap();
        let body = json(1_000);
        let estimate = model
            .estimate(&headers(None), body.as_bytes(), MAX)
            .unwrap();
        let input = (body.len() as u64 * 2).div_ceil(7);
        assert_eq!(charge(&estimate), 5 * (input + 4 * 1_000));
        assert_eq!(model.model_weight(Some("claude-sonnet-4-5")), 1.0);
        assert_eq!(model.model_weight(Some("claude-opus-3")), 2.0);
    }

    #[test]
    fn the_usage_settles_with_cache_reads_free_and_cache_writes_counted() {
        let model = CostModel::default();
        let estimate = model
            .estimate(&headers(None), json(4_096).as_bytes(), MAX)
            .unwrap();
        let mut usage = UsageScanner::default();
        usage.feed(br#"{"usage":{"input_tokens":30,"cache_creation_input_tokens":1000,"cache_read_input_tokens":50000,"output_tokens":200}}"#);
        assert_eq!(model.used(&estimate, &usage), 30 + 1_000 + 5 * 200);
    }

    #[test]
    fn a_gzip_or_deflate_body_is_charged_at_its_decompressed_size() {
        let model = CostModel::default();
        let text = format!(
            r#"{{"model":"m","max_tokens":10,"messages":[{{"role":"user","content":"{}"}}]}}"#,
            "all work and no play ".repeat(2_000)
        );
        let plain = model
            .estimate(&headers(None), text.as_bytes(), MAX)
            .unwrap();
        let gz = gzip(text.as_bytes());
        assert!(gz.len() * 20 < text.len());
        let zipped = model.estimate(&headers(Some("gzip")), &gz, MAX).unwrap();
        assert_eq!(zipped, plain);
        let mut zlib = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
        zlib.write_all(text.as_bytes()).unwrap();
        let deflated = model
            .estimate(&headers(Some("deflate")), &zlib.finish().unwrap(), MAX)
            .unwrap();
        assert_eq!(deflated, plain);
    }

    #[test]
    fn the_end_user_is_read_from_the_decoded_body() {
        let model = CostModel::default();
        let body = br#"{"max_tokens":10,"metadata":{"user_id":"alice"},"messages":[]}"#;
        let zipped = model
            .estimate(&headers(Some("gzip")), &gzip(body), MAX)
            .unwrap();
        assert_eq!(zipped.user(), Some("alice"));
        // A user id that is not a string, an empty one, or metadata that is not an
        // object names no user (the upstream judges the field).
        for body in [
            r#"{"max_tokens":1,"metadata":{"user_id":12}}"#,
            r#"{"max_tokens":1,"metadata":{"user_id":""}}"#,
            r#"{"max_tokens":1,"metadata":[1]}"#,
            r#"{"max_tokens":1}"#,
        ] {
            let estimate = model
                .estimate(&headers(None), body.as_bytes(), MAX)
                .unwrap();
            assert_eq!(estimate.user(), None, "{body}");
        }
    }

    #[test]
    fn a_zip_bomb_is_refused_with_413_after_reading_at_most_its_allowance() {
        let model = CostModel::default();
        // 64 MiB of spaces then a message: ~64 KiB compressed, a ratio of ~1000.
        let mut bomb = vec![b' '; 64 << 20];
        bomb.extend_from_slice(json(10).as_bytes());
        let gz = gzip(&bomb);
        let refused = model
            .estimate(&headers(Some("gzip")), &gz, MAX)
            .unwrap_err();
        assert_eq!(refused.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(
            refused.message.contains("decompresses to more than"),
            "{refused:?}"
        );
        // Within the ratio but past the body limit: refused too.
        let refused = model
            .estimate(&headers(Some("gzip")), &gzip(&bomb[..(2 << 20)]), 1 << 20)
            .unwrap_err();
        assert_eq!(refused.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn bodies_the_api_would_refuse_get_400_and_never_a_panic() {
        let model = CostModel::default();
        let bad = |body: &[u8], encoding: Option<&str>| {
            model
                .estimate(&headers(encoding), body, MAX)
                .expect_err("refused")
        };
        for body in [
            &b""[..],
            b"   ",
            b"{",
            b"[1,2]",
            b"null",
            br#"{"max_tokens":"many"}"#,
            br#"{"max_tokens":-1}"#,
            br#"{"max_tokens":1.5}"#,
            br#"{"max_tokens":10} trailing"#,
            br#"{"model":7,"max_tokens":10}"#,
            b"\xff\xfe",
        ] {
            let refused = bad(body, None);
            assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{body:?}");
            assert_eq!(refused.kind, "invalid_request_error");
        }
        let missing = bad(br#"{"model":"m","messages":[]}"#, None);
        assert_eq!(missing.status, StatusCode::BAD_REQUEST);
        assert!(missing.message.contains("max_tokens"), "{missing:?}");
        // Not gzip at all, or cut short.
        assert_eq!(
            bad(b"plain text", Some("gzip")).status,
            StatusCode::BAD_REQUEST
        );
        let gz = gzip(json(10).as_bytes());
        assert_eq!(
            bad(&gz[..gz.len() / 2], Some("gzip")).status,
            StatusCode::BAD_REQUEST
        );
        // Bad JSON inside good gzip.
        assert_eq!(
            bad(&gzip(b"{nope"), Some("gzip")).status,
            StatusCode::BAD_REQUEST
        );
        // An encoding it cannot read.
        assert_eq!(
            bad(json(10).as_bytes(), Some("br")).status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        // The refusal is valid JSON even when the message quotes the client.
        let response = bad(br#"{"max_tokens":"\"x\\"}"#, None).response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    }

    /// An answer of `status`, `encoding` and `chunks` to a call of `tenant` estimated as
    /// `estimate`, sent through the layers (classified and counted as the gateway's are),
    /// through [`settling`].
    async fn answer(
        (layer, usage): (&fairgate::FairgateLayer, &Usage),
        tenant: &str,
        estimate: Estimate,
        (status, encoding, chunks): (u16, Option<&'static str>, Vec<Vec<u8>>),
    ) -> Response<Body> {
        use http_body_util::BodyExt;
        use tower::{Layer, ServiceExt};
        let send = tower::service_fn(move |req: http::Request<()>| {
            let chunks = chunks.clone();
            async move {
                let frames: Vec<Result<Frame<Bytes>, BoxError>> = chunks
                    .into_iter()
                    .map(|c| Ok(Frame::data(Bytes::from(c))))
                    .collect();
                let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                let mut response = Response::new(body.boxed_unsync());
                *response.status_mut() = StatusCode::from_u16(status).unwrap();
                if let Some(encoding) = encoding {
                    response
                        .headers_mut()
                        .insert(header::CONTENT_ENCODING, encoding.parse().unwrap());
                }
                // The job as the call went out, as the gateway's innermost service keeps it.
                response
                    .extensions_mut()
                    .insert(req.extensions().get::<Job>().unwrap().clone());
                Ok::<_, BoxError>(response)
            }
        });
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(estimate.apply(Job::new(tenant, fairgate::Origin::UserAction)));
        let response = layer.layer(send).oneshot(req).await.unwrap();
        let response = response.map(|body| body.map_err(Into::into).boxed_unsync());
        let model = Arc::new(CostModel::default());
        settling(response, (&layer.settler(), usage), &model, estimate)
    }

    fn text(chunks: &[&str]) -> Vec<Vec<u8>> {
        chunks.iter().map(|c| c.as_bytes().to_vec()).collect()
    }

    #[tokio::test]
    async fn what_ran_is_counted_once_its_usage_is_read_whatever_its_encoding() {
        use http_body_util::BodyExt;
        let layer = fairgate::FairgateLayer::new(fairgate::Store::memory());
        let usage = Usage::memory();
        let layer = (&layer, &usage);
        let model = CostModel::default();
        let estimate = model
            .estimate(&headers(None), json(64_000).as_bytes(), MAX)
            .unwrap();
        let today = |tenant: &'static str| {
            let store = layer.0.store().clone();
            async move { store.tokens_today(&fairgate::TenantId::new(tenant)).await }
        };
        // A stream split mid-field: 25 input and 40 output tokens; the day counts input.
        let stream = text(&[
            r#"data: {"usage":{"input_tokens":25,"output_to"#,
            r#"kens":1}}"#,
            r#"data: {"usage":{"output_tokens":40}}"#,
        ]);
        let response = answer(layer, "read", estimate.clone(), (200, None, stream.clone())).await;
        response.into_body().collect().await.unwrap();
        assert_eq!(today("read").await, 25);
        // The same stream gzipped (as the API answers an SDK), in 5-byte frames.
        let gz = gzip(&stream.concat())
            .chunks(5)
            .map(<[u8]>::to_vec)
            .collect();
        let response = answer(layer, "gzip", estimate.clone(), (200, Some("gzip"), gz)).await;
        response.into_body().collect().await.unwrap();
        assert_eq!(today("gzip").await, 25);
        // The upstream's refusals used nothing.
        for status in [429, 529] {
            let body = text(&[r#"{"type":"error","error":{"type":"rate_limit_error"}}"#]);
            let response = answer(layer, "refused", estimate.clone(), (status, None, body)).await;
            response.into_body().collect().await.unwrap();
            assert_eq!(today("refused").await, 0, "{status}");
        }
        // A success with no usage, one that does not decode, and one dropped before any
        // usage ran: each counts its estimate, never 0.
        let response = answer(
            layer,
            "no-usage",
            estimate.clone(),
            (200, None, text(&["{}"])),
        )
        .await;
        response.into_body().collect().await.unwrap();
        let corrupt = (200, Some("gzip"), text(&["not gzip at all"]));
        let response = answer(layer, "corrupt", estimate.clone(), corrupt).await;
        response.into_body().collect().await.unwrap();
        drop(answer(layer, "cut", estimate.clone(), (200, None, vec![])).await);
        for tenant in ["no-usage", "corrupt", "cut"] {
            assert_eq!(today(tenant).await, u64::from(estimate.input), "{tenant}");
        }
        // Billed: the read calls as their usage says, the others at their estimate, marked
        // so; the refused ones not at all.
        let billed = usage.rows(&Default::default()).await.unwrap();
        let row = |tenant: &str| billed.iter().find(|r| r.tenant == tenant).map(|r| r.counts);
        for tenant in ["read", "gzip"] {
            let read = row(tenant).unwrap();
            assert_eq!(
                (
                    read.input_tokens,
                    read.output_tokens,
                    read.calls,
                    read.estimated_calls
                ),
                (25, 40, 1, 0)
            );
        }
        assert_eq!(row("refused"), None);
        for tenant in ["no-usage", "corrupt", "cut"] {
            let guessed = row(tenant).unwrap();
            assert_eq!(
                (guessed.input_tokens, guessed.output_tokens, guessed.calls),
                (u64::from(estimate.input), 64_000, 1)
            );
            assert_eq!(guessed.estimated_calls, 1);
        }
    }
}
