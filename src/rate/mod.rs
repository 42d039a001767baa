//! The rate of each upstream key: what the provider's answers taught of its limits
//! (learned pacing), a configured [`Pacing`], the cooldown gate after a 429, slow start and
//! the recovery probe.
//!
//! The retry layer ([`RetryAfterBackoff`](crate::RetryAfterBackoff)) feeds it what each
//! answer said (its `anthropic-ratelimit-*` limits, its `usage`, a throttle and its delay)
//! and, working alone, waits for it before each attempt; the fair queue consults it
//! through the layer's [`RateGate`](crate::RateGate) before it dispatches a call. The
//! requests are keyed per upstream by an [`UpstreamKey`]; each key has its own state.
//!
//! Inside the crate: `Rates` (`core.rs`) is the state of one layer's keys; `feed.rs` what
//! the retry layer tells it (`Rates::answered`, `Rates::reported`) and the rate gate it
//! hands down; `gate.rs` answers the fair queue (`RateLimit for Rates`, the protocol of
//! `crate::gate`) over `key_gate.rs`'s state, one entry per upstream key; `learned.rs`
//! reads the rate-limit headers; `pacing.rs` runs a configured [`Pacing`]; `usage.rs`
//! reads an answer's usage as its body streams, `encoded.rs` whatever its encoding, and
//! `correction.rs` corrects learned pacing by it. The GCRA arithmetic is `crate::gcra`,
//! shared with the store. Nothing here imports the retry layer.

mod core;
mod correction;
mod encoded;
mod feed;
mod gate;
mod key_gate;
mod learned;
mod pacing;
mod usage;

pub(crate) use self::core::{Ask, Learned, RateConfig, Rates, taken};
pub(crate) use self::correction::Usage;
pub(crate) use self::encoded::decoded_prefix;
pub use self::encoded::{MAX_DECODED, UsageReader};
pub(crate) use self::feed::Answer;
pub(crate) use self::learned::has_ratelimit_headers;
pub use self::learned::{ByApiKey, ByApiKeyAndModel, ByModel, OneUpstream, UpstreamKey};
pub use self::pacing::Pacing;
pub use self::usage::UsageScanner;
