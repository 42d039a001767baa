//! One wake-up per freed slot: this worker's side.
//!
//! A call refused for a full tier queues its worker in the call's flow in Redis (its tenant
//! and class in the tier; the acquire script does it, in the same call). A release hands
//! the freed slot to the flow whose turn it is in the fair order of the whole fleet, and to
//! the worker queued longest for it, and tells that worker alone, on its own channel,
//! which tier and flow woke it (`slot_release.lua`), with a token: until an acquire names
//! it (for a second at most) the slot is promised to this worker, so nobody else takes it
//! meanwhile. Here the wake is kept for that flow: the fair queue takes it and sends one
//! acquire for that tenant's next call; TierSlotLimit's waiter of the tier is notified.
//! Nobody else tries, so the Redis work per call stays at one acquire and one release
//! however many workers wait.
//!
//! A wake this worker has no call left for (they were served or gave up meanwhile) is
//! passed on after [`PASS_AFTER`]: the release script runs again without a lease, frees
//! the promise and wakes the next queued worker. A wake for a worker that is gone reaches nobody, and the
//! release script skips it.
//!
//! Events that may have freed slots for any tier (a release in this process while Redis is
//! away, Redis back from an outage, a pub/sub reconnection that may have lost a message)
//! wake *everyone* here: every waiter tries again.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::lock;
use crate::Tier;
use crate::store::{SlotWake, SlotWakes};

/// How long a wake may go unanswered by an acquire of its tier before it is passed on.
pub(super) const PASS_AFTER: Duration = Duration::from_millis(50);

/// A wake no acquire has answered yet.
struct Unanswered {
    token: String,
    flow: String,
    arrived: Instant,
}

#[derive(Default)]
pub(super) struct Wakes {
    /// Tier key -> tier, for every tier this worker queued a call of.
    tiers: Mutex<HashMap<String, Tier>>,
    /// Wakes the fair queue has not taken yet: tier key, flow.
    pending: Mutex<Vec<(String, String)>>,
    /// Every waiter must try again (see the module's doc) since the last take.
    everyone: AtomicBool,
    /// What TierSlotLimit's waiter of each tier waits on, by tier key.
    notify: Mutex<HashMap<String, Arc<Notify>>>,
    /// The wakes no acquire of their flow has answered yet, by tier key, oldest first:
    /// token, flow, arrival.
    unanswered: Mutex<HashMap<String, VecDeque<Unanswered>>>,
    /// Acquires of each tier under way here, and when one was last sent or answered.
    acquires: Mutex<HashMap<String, (u32, Instant)>>,
}

impl Wakes {
    /// A call of `tier` (under `tier_key`) may queue: remember the name a wake will carry.
    pub(super) fn queueing(&self, tier_key: &str, tier: &Tier) {
        let mut tiers = lock(&self.tiers);
        if !tiers.contains_key(tier_key) {
            tiers.insert(tier_key.to_owned(), tier.clone());
        }
    }

    /// An acquire for a call of `flow` in `tier_key` is on its way: it answers the oldest
    /// wake of that flow, if any; its token goes with the acquire.
    pub(super) fn answer(&self, tier_key: &str, flow: &str) -> Option<String> {
        let mut unanswered = lock(&self.unanswered);
        let waiting = unanswered.get_mut(tier_key)?;
        let at = waiting.iter().position(|wake| wake.flow == flow)?;
        let wake = waiting.remove(at)?;
        if waiting.is_empty() {
            unanswered.remove(tier_key);
        }
        Some(wake.token)
    }

    /// A release woke this worker for `flow` of `tier_key` with `token`. `true` when the
    /// wake was counted: it must be answered within [`PASS_AFTER`], or passed on.
    pub(super) fn woken(&self, tier_key: &str, token: &str, flow: &str) -> bool {
        if !lock(&self.tiers).contains_key(tier_key) {
            return false; // never queued here: pass it on at once
        }
        // The token first: a waiter the notification wakes takes it with its acquire.
        lock(&self.unanswered)
            .entry(tier_key.to_owned())
            .or_default()
            .push_back(Unanswered {
                token: token.to_owned(),
                flow: flow.to_owned(),
                arrived: Instant::now(),
            });
        lock(&self.pending).push((tier_key.to_owned(), flow.to_owned()));
        self.notify_for(tier_key).notify_one();
        true
    }

    /// When the wake `token` of `tier_key` arrived, and for which flow, if it is still
    /// unanswered; forgets it if so.
    pub(super) fn unanswered(&self, tier_key: &str, token: &str) -> Option<(Instant, String)> {
        let mut unanswered = lock(&self.unanswered);
        let waiting = unanswered.get_mut(tier_key)?;
        let at = waiting.iter().position(|wake| wake.token == token)?;
        let wake = waiting.remove(at)?;
        if waiting.is_empty() {
            unanswered.remove(tier_key);
        }
        let mut pending = lock(&self.pending);
        if let Some(at) = pending
            .iter()
            .position(|(key, flow)| key == tier_key && *flow == wake.flow)
        {
            pending.remove(at);
        }
        Some((wake.arrived, wake.flow))
    }

    /// An acquire of `tier_key` starts (`true`) or ends.
    pub(super) fn acquiring(&self, tier_key: &str, starts: bool) {
        let mut acquires = lock(&self.acquires);
        let (n, at) = acquires
            .entry(tier_key.to_owned())
            .or_insert((0, Instant::now()));
        *n = if starts { *n + 1 } else { n.saturating_sub(1) };
        *at = Instant::now();
    }

    /// Whether no acquire of `tier_key` is under way here, nor was sent or answered since
    /// `since`: a wake that came then went unused because no call of the tier waits here
    /// (rather than because one was on its way, whose answer keeps the queue right).
    pub(super) fn idle_since(&self, tier_key: &str, since: Instant) -> bool {
        lock(&self.acquires)
            .get(tier_key)
            .is_none_or(|&(n, at)| n == 0 && at < since)
    }

    /// Every waiter must try again.
    pub(super) fn everyone(&self) {
        self.everyone.store(true, Ordering::Release);
        for notify in lock(&self.notify).values() {
            notify.notify_waiters();
        }
    }

    /// What woke this worker since the last take: every waiter, or flows (one entry per
    /// wake-up); `None` when nothing did.
    pub(super) fn take(&self) -> Option<SlotWakes> {
        let pending = std::mem::take(&mut *lock(&self.pending));
        if self.everyone.swap(false, Ordering::AcqRel) {
            return Some(SlotWakes::Everyone);
        }
        let tiers = lock(&self.tiers);
        let woken: Vec<SlotWake> = pending
            .into_iter()
            .filter_map(|(key, flow)| {
                let tier = tiers.get(&key)?.clone();
                Some(SlotWake::parse(tier, &flow))
            })
            .collect();
        (!woken.is_empty()).then_some(SlotWakes::Flows(woken))
    }

    /// What a waiter of `tier_key` waits on.
    pub(super) fn notify_for(&self, tier_key: &str) -> Arc<Notify> {
        lock(&self.notify)
            .entry(tier_key.to_owned())
            .or_default()
            .clone()
    }
}
