use std::time::Duration;

use crate::Tier;
use crate::error::ConfigError;
use crate::hash::HashMap;

/// The cap and the patience of one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierLimit {
    /// Most slots this tier holds at once, across every worker.
    pub cap: u32,
    /// How long a request of this tier waits for a slot before it fails with
    /// [`Busy`](crate::Busy).
    pub max_wait: Duration,
    /// Most slots one tenant of this tier holds at once, across every worker (`None`: no
    /// cap of its own; see [`SlotPolicyBuilder::tenant_cap`]).
    pub tenant_cap: Option<u32>,
    /// Whether callers should retry this tier's [`Busy`](crate::Busy) (default `false`: the
    /// request already waited its max wait; see [`SlotPolicyBuilder::retry`]).
    pub retry: bool,
    /// How long standard (scheduled) work of this tier waits (`None`, the default: up to its
    /// SLA, at most an hour; see [`SlotPolicyBuilder::standard_max_wait`]).
    pub standard_max_wait: Option<Duration>,
    /// How long batch work of this tier waits (default 120 s, the write-up's batch SLO; see
    /// [`SlotPolicyBuilder::batch_max_wait`]).
    pub batch_max_wait: Duration,
}

/// The most a standard request's SLA makes it wait.
const SLA_WAIT_MAX: Duration = Duration::from_secs(3_600);

/// How long batch work waits unless its tier says otherwise.
pub(crate) const BATCH_MAX_WAIT: Duration = Duration::from_secs(120);

impl TierLimit {
    /// A tier of `cap` slots whose user actions wait `max_wait`, with the other defaults.
    pub(crate) fn new(cap: u32, max_wait: Duration) -> TierLimit {
        TierLimit {
            cap,
            max_wait,
            tenant_cap: None,
            retry: false,
            standard_max_wait: None,
            batch_max_wait: BATCH_MAX_WAIT,
        }
    }

    /// How long a request of `class` (`None`: not classified yet) with `sla` waits for its
    /// turn: its class's wait. A critical request (a user action) waits the tier's
    /// [`max_wait`](Self::max_wait); a standard one its tier's
    /// [`standard_max_wait`](Self::standard_max_wait), else up to its SLA (at most an hour);
    /// a batch one [`batch_max_wait`](Self::batch_max_wait): a chat tier's short wait never
    /// refuses batch work. One not classified yet waits the tier's `max_wait`.
    ///
    /// ```
    /// use fairgate::{Priority, SlotPolicy};
    /// use std::time::Duration;
    ///
    /// let (_, free, _) = SlotPolicy::default().limit(Some(&"free".into()));
    /// let hour = Duration::from_secs(3_600);
    /// assert_eq!(free.max_wait_for(Some(Priority::Critical), None), Duration::from_secs(12));
    /// assert_eq!(free.max_wait_for(Some(Priority::Standard), Some(Duration::from_secs(60))), Duration::from_secs(60));
    /// assert_eq!(free.max_wait_for(Some(Priority::Standard), Some(2 * hour)), hour);
    /// assert_eq!(free.max_wait_for(Some(Priority::Batch), None), Duration::from_secs(120));
    /// ```
    pub fn max_wait_for(&self, class: Option<crate::Priority>, sla: Option<Duration>) -> Duration {
        match class {
            Some(crate::Priority::Batch) => self.batch_max_wait,
            Some(crate::Priority::Standard) => self
                .standard_max_wait
                .unwrap_or_else(|| sla.map_or(self.max_wait, |sla| sla.min(SLA_WAIT_MAX))),
            _ => self.max_wait,
        }
    }

    /// This limit with its `max_wait` the one a request of `class` with `sla` waits.
    pub(crate) fn for_class(
        mut self,
        class: Option<crate::Priority>,
        sla: Option<Duration>,
    ) -> Self {
        self.max_wait = self.max_wait_for(class, sla);
        self
    }
}

/// Global and per-tier caps, how long each tier waits, and how leases behave.
///
/// Defaults: 30 in flight globally; `premium` 30 slots and 60 s of
/// patience, `pro` 20 / 45 s, `free` 15 / 12 s, `guest` 5 / 8 s; unknown tiers are served
/// as `guest`; `queue.slow_wait` after 3 s; `Busy` says retry after 5 s; leases live 30 s
/// without a heartbeat; waiters poll every 100 ms (jittered) as a safety net.
///
/// ```
/// use fairgate::SlotPolicy;
/// use std::time::Duration;
///
/// let policy = SlotPolicy::builder()
///     .global_max(40)
///     .tier("team", 25, Duration::from_secs(30))
///     .build()?;
/// assert_eq!(policy.global_max(), 40);
/// assert_eq!(policy.limit(Some(&"team".into())).1.cap, 25);
/// assert!(SlotPolicy::builder().global_max(0).build().is_err());
/// # Ok::<(), fairgate::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotPolicy {
    pub(crate) global_max: u32,
    pub(crate) tiers: HashMap<Tier, TierLimit>,
    pub(crate) default_tier: Tier,
    pub(crate) slow_wait: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) lease_ttl: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) early_reject: bool,
    pub(crate) seed: Option<u64>,
}

impl Default for SlotPolicy {
    fn default() -> Self {
        let tier = |cap, secs| TierLimit::new(cap, Duration::from_secs(secs));
        SlotPolicy {
            global_max: 30,
            tiers: HashMap::from_iter([
                (Tier::new(Tier::PREMIUM), tier(30, 60)),
                (Tier::new(Tier::PRO), tier(20, 45)),
                (Tier::new(Tier::FREE), tier(15, 12)),
                (Tier::new(Tier::GUEST), tier(5, 8)),
            ]),
            default_tier: Tier::new(Tier::GUEST),
            slow_wait: Duration::from_secs(3),
            retry_after: Duration::from_secs(5),
            lease_ttl: Duration::from_secs(30),
            poll_interval: Duration::from_millis(100),
            early_reject: false,
            seed: None,
        }
    }
}

impl SlotPolicy {
    /// Starts from the defaults.
    pub fn builder() -> SlotPolicyBuilder {
        SlotPolicyBuilder {
            policy: SlotPolicy::default(),
            tenant_caps: HashMap::default(),
            retries: HashMap::default(),
            class_waits: HashMap::default(),
        }
    }

    /// Most slots held at once across all tiers.
    pub fn global_max(&self) -> u32 {
        self.global_max
    }

    /// The tier a request is counted under and its limit: its own if configured, else the
    /// default tier's. The `bool` says whether the tier was known.
    pub fn limit(&self, tier: Option<&Tier>) -> (Tier, TierLimit, bool) {
        if let Some(tier) = tier
            && let Some(limit) = self.tiers.get(tier)
        {
            return (tier.clone(), *limit, true);
        }
        let limit = self
            .tiers
            .get(&self.default_tier)
            .copied()
            .unwrap_or(TierLimit::new(1, Duration::ZERO));
        (self.default_tier.clone(), limit, tier.is_none())
    }

    /// The configured tiers and their limits, by name.
    pub fn tiers(&self) -> Vec<(Tier, TierLimit)> {
        let mut tiers: Vec<_> = self.tiers.iter().map(|(t, l)| (t.clone(), *l)).collect();
        tiers.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        tiers
    }

    /// How long `Busy` tells callers to wait.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// How long a Redis lease lives without a heartbeat.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }
}

/// Builds a [`SlotPolicy`]; [`build`](SlotPolicyBuilder::build) refuses bad values.
#[derive(Clone, Debug)]
pub struct SlotPolicyBuilder {
    policy: SlotPolicy,
    /// Applied by `build`, so `tier` and `tenant_cap` may come in either order.
    tenant_caps: HashMap<Tier, u32>,
    /// Applied by `build`, as `tenant_caps`.
    retries: HashMap<Tier, bool>,
    /// Standard and batch waits per tier, applied by `build`.
    class_waits: HashMap<Tier, (Option<Duration>, Option<Duration>)>,
}

impl SlotPolicyBuilder {
    /// Most slots held at once across all tiers (at least 1).
    pub fn global_max(mut self, slots: u32) -> Self {
        self.policy.global_max = slots;
        self
    }

    /// Adds a tier or replaces one: its cap (at least 1) and how long it waits.
    pub fn tier(mut self, name: impl Into<Tier>, cap: u32, max_wait: Duration) -> Self {
        // The rest is set by `build` from their own calls.
        self.policy
            .tiers
            .insert(name.into(), TierLimit::new(cap, max_wait));
        self
    }

    /// How long standard (scheduled) work of tier `name` waits, whatever its SLA (default:
    /// up to its SLA, at most an hour). See [`TierLimit::max_wait_for`].
    pub fn standard_max_wait(mut self, name: impl Into<Tier>, wait: Duration) -> Self {
        self.class_waits.entry(name.into()).or_default().0 = Some(wait);
        self
    }

    /// How long batch work of tier `name` waits (default 120 s, the write-up's batch SLO):
    /// a chat tier's short wait never refuses batch work. See [`TierLimit::max_wait_for`].
    ///
    /// ```
    /// use fairgate::SlotPolicy;
    /// use std::time::Duration;
    ///
    /// let policy = SlotPolicy::builder()
    ///     .batch_max_wait("free", Duration::from_secs(600))
    ///     .build()?;
    /// assert_eq!(policy.limit(Some(&"free".into())).1.batch_max_wait, Duration::from_secs(600));
    /// assert_eq!(policy.limit(Some(&"pro".into())).1.batch_max_wait, Duration::from_secs(120));
    /// # Ok::<(), fairgate::ConfigError>(())
    /// ```
    pub fn batch_max_wait(mut self, name: impl Into<Tier>, wait: Duration) -> Self {
        self.class_waits.entry(name.into()).or_default().1 = Some(wait);
        self
    }

    /// Whether callers should retry tier `name`'s [`Busy`](crate::Busy) (default `false`).
    ///
    /// A `Busy` comes after the request waited its tier's max wait (or was rejected early
    /// because it would have): a client that retries it, as the official SDKs retry a
    /// `529`, makes its user wait that long again. So by default a `Busy` says not to
    /// ([`Busy::should_retry`](crate::Busy::should_retry); rendered as
    /// `x-should-retry: false`, which the SDKs honour). A tier whose callers are programs
    /// that should come back later may say `true`. Refused by [`build`](Self::build) for a
    /// tier that is not configured.
    ///
    /// ```
    /// use fairgate::SlotPolicy;
    ///
    /// let policy = SlotPolicy::builder().retry("pro", true).build()?;
    /// assert!(policy.limit(Some(&"pro".into())).1.retry);
    /// assert!(!policy.limit(Some(&"free".into())).1.retry);
    /// # Ok::<(), fairgate::ConfigError>(())
    /// ```
    pub fn retry(mut self, name: impl Into<Tier>, retry: bool) -> Self {
        self.retries.insert(name.into(), retry);
        self
    }

    /// Caps the slots one tenant of tier `name` holds at once, across every worker (default:
    /// no cap of its own, only the tier's). A tenant sending from every worker can then take
    /// at most `slots` of its tier's cap, whatever the others leave free: LiteLLM's per-key
    /// `max_parallel_requests`, fleet-wide. Over its cap, a tenant's request waits for one
    /// of its own calls to end — without holding up the other tenants of its tier — and
    /// fails with [`Busy`](crate::Busy) at the tier's max wait, as it would for a full tier.
    ///
    /// The cap is checked in the same step as the global and tier caps (on Redis, the same
    /// script). A cap at or above the tier's cap is no cap (nothing is counted per tenant);
    /// `0` is refused by [`build`](Self::build), and so is a tier that is not configured.
    ///
    /// ```
    /// use fairgate::SlotPolicy;
    /// use std::time::Duration;
    ///
    /// let policy = SlotPolicy::builder()
    ///     .tier("free", 15, Duration::from_secs(12))
    ///     .tenant_cap("free", 2) // no free tenant holds more than 2 of the 15
    ///     .build()?;
    /// assert_eq!(policy.limit(Some(&"free".into())).1.tenant_cap, Some(2));
    /// assert_eq!(policy.limit(Some(&"pro".into())).1.tenant_cap, None);
    /// assert!(SlotPolicy::builder().tenant_cap("free", 0).build().is_err());
    /// # Ok::<(), fairgate::ConfigError>(())
    /// ```
    pub fn tenant_cap(mut self, name: impl Into<Tier>, slots: u32) -> Self {
        self.tenant_caps.insert(name.into(), slots);
        self
    }

    /// Removes a configured tier (its requests then count as the default tier).
    pub fn without_tier(mut self, name: impl Into<Tier>) -> Self {
        self.policy.tiers.remove(&name.into());
        self
    }

    /// The tier for requests with no tier or an unknown one (default `guest`; must be
    /// configured).
    pub fn default_tier(mut self, name: impl Into<Tier>) -> Self {
        self.policy.default_tier = name.into();
        self
    }

    /// Waiting longer than this logs `queue.slow_wait` (default 3 s), at most one line per
    /// tier per 10 s: the first of a window, with the count and the longest of the waits
    /// folded in the window before it (`folded_before`, `folded_longest_secs`).
    pub fn slow_wait(mut self, after: Duration) -> Self {
        self.policy.slow_wait = after;
        self
    }

    /// What [`Busy`](crate::Busy) tells callers to wait before trying again (default 5 s).
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.policy.retry_after = after;
        self
    }

    /// How long a Redis lease lives without a heartbeat (default 30 s, at least 100 ms):
    /// the longest a crashed worker's slots stay taken.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.policy.lease_ttl = ttl;
        self
    }

    /// The safety-net poll of waiters, jittered by +/-50% (default 100 ms; 1 ms to 60 s).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.policy.poll_interval = interval;
        self
    }

    /// Fail at once when the expected wait (requests ahead x observed hold time / cap)
    /// already exceeds the tier's max wait (default off).
    pub fn early_reject(mut self, on: bool) -> Self {
        self.policy.early_reject = on;
        self
    }

    /// Seeds the poll jitter, for deterministic tests.
    pub fn seed(mut self, seed: u64) -> Self {
        self.policy.seed = Some(seed);
        self
    }

    /// The policy, or what is wrong with it.
    ///
    /// # Errors
    /// A zero global, tier or tenant cap, a tenant cap for a tier that is not configured, a
    /// default tier that is not configured, a lease TTL under 100 ms or over a day, or a
    /// poll interval outside 1 ms - 60 s. Waits may be as long as you like: `Duration::MAX`
    /// means \"forever\".
    pub fn build(self) -> Result<SlotPolicy, ConfigError> {
        let mut policy = self.policy;
        for (tier, (standard, batch)) in self.class_waits {
            let Some(limit) = policy.tiers.get_mut(&tier) else {
                return Err(ConfigError::new(format!(
                    "a class's wait for tier {tier}, which has no slot limit configured"
                )));
            };
            limit.standard_max_wait = standard.or(limit.standard_max_wait);
            limit.batch_max_wait = batch.unwrap_or(limit.batch_max_wait);
        }
        for (tier, retry) in self.retries {
            let Some(limit) = policy.tiers.get_mut(&tier) else {
                return Err(ConfigError::new(format!(
                    "retry for tier {tier}, which has no slot limit configured"
                )));
            };
            limit.retry = retry;
        }
        for (tier, slots) in self.tenant_caps {
            if slots == 0 {
                return Err(ConfigError::new(format!(
                    "tenant cap of tier {tier} must be at least 1"
                )));
            }
            let Some(limit) = policy.tiers.get_mut(&tier) else {
                return Err(ConfigError::new(format!(
                    "tenant cap for tier {tier}, which has no slot limit configured"
                )));
            };
            // A cap the tier's own cap already enforces counts nothing more.
            limit.tenant_cap = (slots < limit.cap).then_some(slots);
        }
        if policy.global_max == 0 {
            return Err(ConfigError::new("global slot cap must be at least 1"));
        }
        if let Some((tier, _)) = policy.tiers.iter().find(|(_, limit)| limit.cap == 0) {
            return Err(ConfigError::new(format!(
                "slot cap of tier {tier} must be at least 1"
            )));
        }
        if !policy.tiers.contains_key(&policy.default_tier) {
            return Err(ConfigError::new(format!(
                "default tier {} has no slot limit configured",
                policy.default_tier
            )));
        }
        if policy.lease_ttl < Duration::from_millis(100) {
            return Err(ConfigError::new("lease ttl must be at least 100 ms"));
        }
        if policy.poll_interval < Duration::from_millis(1)
            || policy.poll_interval > Duration::from_secs(60)
        {
            return Err(ConfigError::new(
                "poll interval must be between 1 ms and 60 s",
            ));
        }
        if policy.lease_ttl > Duration::from_secs(24 * 3600) {
            return Err(ConfigError::new("lease ttl must be at most a day"));
        }
        Ok(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_cap(builder: SlotPolicyBuilder) -> Result<Option<u32>, ConfigError> {
        let policy = builder.build()?;
        Ok(policy.limit(Some(&Tier::new("free"))).1.tenant_cap)
    }

    #[test]
    fn tenant_caps_are_off_by_default() {
        let policy = SlotPolicy::default();
        for tier in policy.tiers.values() {
            assert_eq!(tier.tenant_cap, None);
        }
        assert_eq!(
            crate::store::SlotLimits::of(&policy, policy.limit(None).1).tenant,
            None
        );
    }

    #[test]
    fn tenant_cap_is_per_tier_and_reaches_the_store_limits() {
        let policy = SlotPolicy::builder().tenant_cap("free", 3).build().unwrap();
        let (_, free, _) = policy.limit(Some(&Tier::new("free")));
        assert_eq!(free.tenant_cap, Some(3));
        assert_eq!(crate::store::SlotLimits::of(&policy, free).tenant, Some(3));
        assert_eq!(policy.limit(Some(&Tier::new("pro"))).1.tenant_cap, None);
    }

    #[test]
    fn tenant_cap_and_tier_come_in_either_order() {
        let before =
            SlotPolicy::builder()
                .tenant_cap("free", 2)
                .tier("free", 8, Duration::from_secs(1));
        let after = SlotPolicy::builder()
            .tier("free", 8, Duration::from_secs(1))
            .tenant_cap("free", 2);
        assert_eq!(free_cap(before).unwrap(), Some(2));
        assert_eq!(free_cap(after).unwrap(), Some(2));
    }

    #[test]
    fn zero_tenant_cap_is_a_config_error() {
        let err = SlotPolicy::builder()
            .tenant_cap("free", 0)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("tenant cap"), "{err}");
    }

    #[test]
    fn tenant_cap_for_an_unknown_tier_is_a_config_error() {
        assert!(SlotPolicy::builder().tenant_cap("gold", 2).build().is_err());
        let removed = SlotPolicy::builder()
            .without_tier("free")
            .tenant_cap("free", 2);
        assert!(removed.build().is_err());
    }

    #[test]
    fn tenant_cap_at_or_over_the_tier_cap_is_off() {
        // free: 15 slots by default.
        assert_eq!(
            free_cap(SlotPolicy::builder().tenant_cap("free", 15)).unwrap(),
            None
        );
        assert_eq!(
            free_cap(SlotPolicy::builder().tenant_cap("free", 99)).unwrap(),
            None
        );
        assert_eq!(
            free_cap(SlotPolicy::builder().tenant_cap("free", 14)).unwrap(),
            Some(14)
        );
    }
}
