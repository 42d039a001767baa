//! What the retry layer tells the rate, and what it asks of it to be handed down: an
//! answer came (its headers' limits, a throttle and the server's delay, a probe's word),
//! the store took the report, and the rate gate a fair queue below consults. An answer's
//! `usage` comes through [`Usage`](super::Usage), read as the body streams.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;

use super::core::Rates;
use crate::gate::{RateGate, RateLimit};
use crate::store::{DIMS, PaceAsk, PaceGrant};

/// What an answer to a call of one upstream key said, as the retry layer read it.
pub(crate) struct Answer<'a> {
    /// The answer's headers (`anthropic-ratelimit-*` teach the key's limits).
    pub(crate) headers: &'a HeaderMap,
    /// The key is at its limit (a throttle): after its gate, calls go one probe at a time.
    pub(crate) at_limit: bool,
    /// The key's cooldown gate closes for this long (the server's delay, or an exhausted
    /// limit's reset).
    pub(crate) closes_for: Option<Duration>,
    /// The call was the key's probe.
    pub(crate) probe: bool,
}

impl Rates {
    /// Notes what an answer to a call of `key` said. Returns the report to send to the
    /// store now, if it must not wait for the next reservation, and the key's learned
    /// limits as this worker knew them, when the call's token charges are to be corrected
    /// from its usage (else zeros).
    pub(crate) fn answered(
        &self,
        key: &Arc<str>,
        answer: &Answer<'_>,
    ) -> (Option<PaceAsk>, [u32; DIMS]) {
        if let Some(delay) = answer.closes_for {
            self.note_reopen(key, delay);
        }
        if answer.at_limit {
            self.note_at_limit(key);
        }
        self.report(key, answer.headers, answer.at_limit, answer.probe)
    }

    /// The store took an answer's report for a call that needed `need`: what it said is
    /// applied, and the calls held behind a probe (here or at a fair queue below) ask again.
    pub(crate) fn reported(&self, key: &Arc<str>, grant: &PaceGrant, need: [u32; DIMS]) {
        self.granted(key, grant, need, 1);
        self.answered.notify_waiters();
        self.gate_changed.notify_one();
    }

    /// Resolves when this worker next reports an answer to the store.
    pub(crate) fn next_answer(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let notify = self.answered.clone();
        Box::pin(async move { notify.notified().await })
    }

    /// The rate gate of these keys, for a fair queue below to consult.
    pub(crate) fn gate(self: &Arc<Self>) -> RateGate {
        let inner: Arc<dyn RateLimit> = self.clone();
        RateGate::new(inner)
    }
}
