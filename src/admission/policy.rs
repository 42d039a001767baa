use std::collections::HashMap;
use std::time::Duration;

use crate::Tier;
use crate::error::ConfigError;
use crate::store::SlotLimits;

/// The cap and the patience of one tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierLimit {
    /// Most slots this tier holds at once, across every worker.
    pub cap: u32,
    /// How long a request of this tier waits for a slot before it fails with
    /// [`Busy`](crate::Busy).
    pub max_wait: Duration,
}

/// Global and per-tier caps, how long each tier waits, and how leases behave.
///
/// Defaults (from the reference): 30 in flight globally; `premium` 30 slots and 60 s of
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
        let tier = |cap, secs| TierLimit {
            cap,
            max_wait: Duration::from_secs(secs),
        };
        SlotPolicy {
            global_max: 30,
            tiers: HashMap::from([
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
            .unwrap_or(TierLimit {
                cap: 1,
                max_wait: Duration::ZERO,
            });
        (self.default_tier.clone(), limit, tier.is_none())
    }

    /// How long `Busy` tells callers to wait.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// How long a Redis lease lives without a heartbeat.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// The caps an acquire for a tier of `limit` is checked against.
    pub(crate) fn limits(&self, limit: TierLimit) -> SlotLimits {
        SlotLimits {
            global: self.global_max,
            tier: limit.cap,
            lease_ttl: self.lease_ttl,
        }
    }
}

/// Builds a [`SlotPolicy`]; [`build`](SlotPolicyBuilder::build) refuses bad values.
#[derive(Clone, Debug)]
pub struct SlotPolicyBuilder {
    policy: SlotPolicy,
}

impl SlotPolicyBuilder {
    /// Most slots held at once across all tiers (at least 1).
    pub fn global_max(mut self, slots: u32) -> Self {
        self.policy.global_max = slots;
        self
    }

    /// Adds a tier or replaces one: its cap (at least 1) and how long it waits.
    pub fn tier(mut self, name: impl Into<Tier>, cap: u32, max_wait: Duration) -> Self {
        self.policy
            .tiers
            .insert(name.into(), TierLimit { cap, max_wait });
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

    /// Waiting longer than this logs `queue.slow_wait` (default 3 s).
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
    /// A zero global or tier cap, a default tier that is not configured, a lease TTL under
    /// 100 ms or over a day, or a poll interval outside 1 ms - 60 s. Waits may be as long as
    /// you like: `Duration::MAX` means \"forever\".
    pub fn build(self) -> Result<SlotPolicy, ConfigError> {
        let policy = self.policy;
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
