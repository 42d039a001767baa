//! What one key holder may hold of what every client shares, whatever it sends or leaves
//! unread.
//!
//! A key holder is the tenant a key authenticates as (a team, or a service); its keys
//! share its limits. Each request of it, from the key check to its answer's last byte
//! handed to the connection, holds a [`Claim`] on three things:
//!
//! - **requests in progress** (`--key-max-requests`): reading a body, waiting in the fair
//!   queue, or answering. Each is a busy connection, which the connection cap never evicts,
//!   so this is what one key may take of `--max-connections`. Past it: `429`.
//! - **request body bytes** (`--key-body-budget`), taken as they arrive, beside the
//!   gateway's `--body-budget`: a body that declares 32 MiB and trickles holds what it has
//!   sent, not what it declared. Past it: `429` (the key's own share), or `529` when the
//!   whole gateway's budget is spent.
//! - **answer bytes not yet read by its client** (`--key-answer-buffer`), beside the
//!   gateway's `--answer-buffer`: an answer is relayed through a buffer so the call's slot
//!   is free at the upstream's last byte, not the client's (`answer.rs`).
//!
//! The table holds one entry per key holder named in the keys file (a bounded set).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fairgate::TenantId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The limits of each key holder.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HolderLimits {
    pub(crate) requests: usize,
    pub(crate) body_bytes: usize,
    pub(crate) answer_bytes: usize,
}

/// One key holder's share in use.
struct Holder {
    requests: AtomicUsize,
    body: Arc<Semaphore>,
    answers: Arc<Semaphore>,
    answers_max: usize,
}

/// Every key holder's share; shared by every connection.
pub(crate) struct Holders {
    limits: HolderLimits,
    table: Mutex<HashMap<TenantId, Arc<Holder>>>,
    /// The gateway's own bounds, over all holders.
    body: Arc<Semaphore>,
    answers: Arc<Semaphore>,
    body_max: usize,
    answers_max: usize,
}

/// A request in progress: its holder's count is taken until it drops.
pub(crate) struct Claim {
    holder: Arc<Holder>,
    body: Arc<Semaphore>,
    answers: Arc<Semaphore>,
    answers_max: usize,
}

/// Bytes held from both the key holder's share and the gateway's bound, given back when
/// dropped.
pub(crate) struct Held {
    key: OwnedSemaphorePermit,
    all: OwnedSemaphorePermit,
}

impl Held {
    /// Holds `more` with these.
    pub(crate) fn merge(&mut self, more: Held) {
        self.key.merge(more.key);
        self.all.merge(more.all);
    }
}

/// Which bound a reservation found spent.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Spent {
    /// The key holder's own share.
    Key,
    /// The gateway's, over all holders.
    Gateway,
}

impl Holders {
    /// `limits` per key holder; `body_max` and `answers_max` bytes over all of them.
    pub(crate) fn new(limits: HolderLimits, body_max: usize, answers_max: usize) -> Holders {
        let body_max = body_max.min(Semaphore::MAX_PERMITS);
        let answers_max = answers_max.min(Semaphore::MAX_PERMITS);
        Holders {
            limits,
            table: Mutex::new(HashMap::new()),
            body: Arc::new(Semaphore::new(body_max)),
            answers: Arc::new(Semaphore::new(answers_max)),
            body_max,
            answers_max,
        }
    }

    pub(crate) fn limits(&self) -> HolderLimits {
        self.limits
    }

    /// Body bytes being buffered now, over all holders.
    pub(crate) fn body_used(&self) -> usize {
        self.body_max - self.body.available_permits()
    }

    pub(crate) fn body_max(&self) -> usize {
        self.body_max
    }

    /// Answer bytes waiting for their clients now, over all holders.
    pub(crate) fn answers_used(&self) -> usize {
        self.answers_max - self.answers.available_permits()
    }

    /// A new request of `tenant`, or `None` when it has `requests` in progress already.
    pub(crate) fn begin(&self, tenant: &TenantId) -> Option<Claim> {
        let holder = {
            let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
            table
                .entry(tenant.clone())
                .or_insert_with(|| {
                    let body = self.limits.body_bytes.min(Semaphore::MAX_PERMITS);
                    let answers_max = self.limits.answer_bytes.min(Semaphore::MAX_PERMITS);
                    Arc::new(Holder {
                        requests: AtomicUsize::new(0),
                        body: Arc::new(Semaphore::new(body)),
                        answers: Arc::new(Semaphore::new(answers_max)),
                        answers_max,
                    })
                })
                .clone()
        };
        let taken = holder
            .requests
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limits.requests).then_some(n + 1)
            });
        taken.ok().map(|_| Claim {
            holder,
            body: self.body.clone(),
            answers: self.answers.clone(),
            answers_max: self.answers_max,
        })
    }
}

impl Claim {
    /// `n` body bytes now, or which bound is spent.
    pub(crate) fn take_body(&self, n: usize) -> Result<Held, Spent> {
        take_now(&self.holder.body, &self.body, n)
    }

    /// `n` answer bytes, waiting for them (clamped to what either bound can ever hold, so a
    /// frame larger than a share still goes, alone).
    pub(crate) async fn answer_bytes(&self, n: usize) -> Held {
        let n = n.min(self.answers_max).min(self.holder.answers_max);
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        Held {
            key: acquire(&self.holder.answers, n).await,
            all: acquire(&self.answers, n).await,
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.holder.requests.fetch_sub(1, Ordering::AcqRel);
    }
}

fn take_now(key: &Arc<Semaphore>, all: &Arc<Semaphore>, n: usize) -> Result<Held, Spent> {
    let n = u32::try_from(n).map_err(|_| Spent::Key)?;
    let key = key
        .clone()
        .try_acquire_many_owned(n)
        .map_err(|_| Spent::Key)?;
    let all = all
        .clone()
        .try_acquire_many_owned(n)
        .map_err(|_| Spent::Gateway)?;
    Ok(Held { key, all })
}

/// `n` permits of `semaphore` (never closed, so never an error).
async fn acquire(semaphore: &Arc<Semaphore>, n: u32) -> OwnedSemaphorePermit {
    loop {
        if let Ok(permit) = semaphore.clone().acquire_many_owned(n).await {
            return permit;
        }
    }
}
