//! One `info` line per answer of the gateway's own that refuses a call (`gateway.refused`:
//! its `request-id`, status, path, and where known the tenant, tier and reason), so an
//! operator can find the line a client quotes. Past [`PER_SECOND`] lines in a second the
//! rest are counted, and one line (`gateway.refusals_left_out`) says how many when the
//! next second's first refusal comes: a flood of bad keys cannot flood the logs.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use fairgate::{TenantId, Tier};
use http::Response;
use tracing::info;

use crate::body::Body;
use crate::own_answer::Own;

/// Refusal lines logged in one second at most.
pub(crate) const PER_SECOND: u32 = 100;

/// Who a refusal of the stack was for and why, put on the answer by the handler.
#[derive(Clone, Debug)]
pub(crate) struct Refused {
    pub(crate) tenant: TenantId,
    pub(crate) tier: Option<Tier>,
    pub(crate) reason: String,
}

/// The sampler: a window of one second, its lines counted, the rest left out.
#[derive(Debug, Default)]
pub(crate) struct Sampler {
    window: Option<Instant>,
    logged: u32,
    left_out: u64,
}

/// What to do with one refusal.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Log its line.
    pub(crate) log: bool,
    /// First say that this many were left out in the window before.
    pub(crate) left_out: u64,
}

impl Sampler {
    /// A refusal at `now`.
    pub(crate) fn refusal(&mut self, now: Instant) -> Verdict {
        let mut left_out = 0;
        let fresh = self
            .window
            .is_none_or(|start| now.saturating_duration_since(start) >= Duration::from_secs(1));
        if fresh {
            left_out = std::mem::take(&mut self.left_out);
            *self = Sampler {
                window: Some(now),
                logged: 0,
                left_out: 0,
            };
        }
        if self.logged < PER_SECOND {
            self.logged += 1;
            Verdict {
                log: true,
                left_out,
            }
        } else {
            self.left_out += 1;
            Verdict {
                log: false,
                left_out,
            }
        }
    }
}

/// Logs `response` if it is a refusal of the gateway's own (an error status it answered
/// itself, not the upstream's), sampled.
pub(crate) fn log(path: &str, response: &Response<Body>) {
    static SAMPLER: Mutex<Sampler> = Mutex::new(Sampler {
        window: None,
        logged: 0,
        left_out: 0,
    });
    let status = response.status();
    if status.as_u16() < 400 || response.extensions().get::<Own>().is_none() {
        return;
    }
    let verdict = SAMPLER
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .refusal(Instant::now());
    if verdict.left_out > 0 {
        info!(
            name: "gateway.refusals_left_out",
            left_out = verdict.left_out,
            "refusals not logged in the second before (past {PER_SECOND} a second)"
        );
    }
    if !verdict.log {
        return;
    }
    let request_id = response
        .headers()
        .get("request-id")
        .and_then(|id| id.to_str().ok())
        .unwrap_or("");
    let refused = response.extensions().get::<Refused>();
    info!(
        name: "gateway.refused",
        request_id,
        status = status.as_u16(),
        path,
        tenant = refused.map(|r| r.tenant.as_str()),
        tier = refused.and_then(|r| r.tier.as_ref()).map(Tier::as_str),
        reason = refused.map(|r| r.reason.as_str()),
        "refused"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_a_hundred_a_second_refusals_are_counted_and_told_in_the_next_second() {
        let mut sampler = Sampler::default();
        let t0 = Instant::now();
        let logged = (0..250)
            .filter(|i| sampler.refusal(t0 + Duration::from_millis(*i)).log)
            .count();
        assert_eq!(logged, PER_SECOND as usize);
        let next = sampler.refusal(t0 + Duration::from_secs(1));
        assert_eq!(
            next,
            Verdict {
                log: true,
                left_out: 150
            }
        );
        // Told once: the window after says nothing of it.
        let later = sampler.refusal(t0 + Duration::from_secs(3));
        assert_eq!(
            later,
            Verdict {
                log: true,
                left_out: 0
            }
        );
    }
}
