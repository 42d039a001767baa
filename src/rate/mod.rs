//! The rate of each upstream key: what the provider's answers taught of its limits
//! (learned pacing), a configured [`Pacing`], the cooldown gate after a 429, slow start and
//! the recovery probe.
//!
//! The retry layer ([`RetryAfterBackoff`](crate::RetryAfterBackoff)) feeds it what each
//! answer said (its `anthropic-ratelimit-*` limits, its `usage`, a throttle and its delay);
//! the fair queue consults it through the layer's rate gate before it dispatches a call.
//! The requests are keyed per upstream by an [`UpstreamKey`].

mod core;
mod gate;
mod key_gate;
mod learned;
mod pacing;
mod usage;

pub(crate) use self::core::{Ask, Learned, RateConfig, Rates, taken};
pub(crate) use self::learned::has_ratelimit_headers;
pub use self::learned::{ByApiKey, ByApiKeyAndModel, ByModel, OneUpstream, UpstreamKey};
pub use self::pacing::Pacing;
pub(crate) use self::usage::Usage;
pub use self::usage::UsageScanner;
