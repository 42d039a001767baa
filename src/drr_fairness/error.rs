//! Errors of [`DrrFairness`](crate::DrrFairness).

use std::fmt;

use crate::{Priority, TenantId};

/// A queue limit refused the request: it was not queued and nothing was sent.
///
/// Only returned when the layer is built with a per-tenant or per-class queue limit
/// ([`DrrFairnessBuilder::max_queued_per_tenant`](crate::drr_fairness::DrrFairnessBuilder::max_queued_per_tenant),
/// [`max_queued_per_class`](crate::drr_fairness::DrrFairnessBuilder::max_queued_per_class)).
/// The refused request is always the incoming one — the youngest — so time others already
/// spent waiting is not wasted. Fail fast: answer it with a 429/503 and a short retry hint.
///
/// ```
/// # use fairgate::drr_fairness::error::QueueFull;
/// # fn handle(err: fairgate::BoxError) {
/// if let Some(full) = err.downcast_ref::<QueueFull>() {
///     eprintln!("{} queue of {} is full", full.priority(), full.tenant());
/// }
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueFull {
    priority: Priority,
    tenant: TenantId,
    tenant_limit: bool,
}

impl QueueFull {
    pub(crate) fn new(priority: Priority, tenant: TenantId, tenant_limit: bool) -> Self {
        QueueFull {
            priority,
            tenant,
            tenant_limit,
        }
    }

    /// The class whose queue was full.
    pub fn priority(&self) -> Priority {
        self.priority
    }

    /// The tenant of the refused request.
    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }

    /// Whether the tenant's own queue limit refused it (`false`: the whole class was full).
    pub fn is_tenant_limit(&self) -> bool {
        self.tenant_limit
    }
}

impl fmt::Display for QueueFull {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.tenant_limit {
            write!(
                f,
                "{} queue of tenant {} is full",
                self.priority, self.tenant
            )
        } else {
            write!(f, "{} queue is full", self.priority)
        }
    }
}

impl std::error::Error for QueueFull {}
