//! The labels a request is filed under everywhere: who it is for ([`TenantId`]), its plan
//! ([`Tier`]) and the class it is served in ([`Priority`]). The store, the metrics and the
//! layers read them; the [`Job`](crate::Job) that carries them builds on this module.

use std::fmt;
use std::sync::Arc;

/// Who is billed for, and protected by, a request.
///
/// Cheap to clone (an `Arc<str>` inside). Any string is a valid tenant name: the Redis store
/// escapes it before it goes into a key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(Arc<str>);

impl TenantId {
    /// Creates a tenant id from its name.
    pub fn new(name: impl AsRef<str>) -> Self {
        TenantId(Arc::from(name.as_ref()))
    }

    /// The tenant's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether both name the same tenant; a clone of the same id is recognised without
    /// reading the name.
    pub(crate) fn same(&self, other: &TenantId) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }

    /// The name itself, shared (for metric labels: no copy per request).
    pub(crate) fn shared_name(&self) -> Arc<str> {
        self.0.clone()
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Hashes and compares as its name (so a map of tenants is searched by a `&str`).
impl std::borrow::Borrow<str> for TenantId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for TenantId {
    fn from(name: &str) -> Self {
        TenantId::new(name)
    }
}

impl From<String> for TenantId {
    fn from(name: String) -> Self {
        TenantId(Arc::from(name))
    }
}

/// A plan name such as `premium`, `pro`, `free` or `guest`, or any name the layers are
/// configured with. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tier(Arc<str>);

impl Tier {
    /// The highest of the built-in plans.
    pub const PREMIUM: &'static str = "premium";
    /// A paid plan.
    pub const PRO: &'static str = "pro";
    /// The free plan.
    pub const FREE: &'static str = "free";
    /// Callers that are not signed in; the least privileged tier.
    pub const GUEST: &'static str = "guest";

    /// Creates a tier from its name.
    pub fn new(name: impl AsRef<str>) -> Self {
        Tier(Arc::from(name.as_ref()))
    }

    /// The tier's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name itself, shared (for metric labels: no copy per request).
    pub(crate) fn shared_name(&self) -> Arc<str> {
        self.0.clone()
    }
}

impl fmt::Debug for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for Tier {
    fn from(name: &str) -> Self {
        Tier::new(name)
    }
}

impl From<String> for Tier {
    fn from(name: String) -> Self {
        Tier(Arc::from(name))
    }
}

/// The class a request is served in, decided centrally by
/// [`PriorityClassify`](crate::PriorityClassify) and never by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    /// Someone is waiting: served first (but not exclusively, see `DrrFairness`).
    Critical,
    /// Needed soon.
    Standard,
    /// Needed whenever; also where demoted tenants go.
    Batch,
}

impl Priority {
    /// All priorities, highest first.
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Standard, Priority::Batch];

    /// The lowercase name used in metric labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Standard => "standard",
            Priority::Batch => "batch",
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
