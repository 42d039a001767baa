use std::time::Duration;

use crate::error::ConfigError;

/// When a runaway tenant is demoted to batch, and for how long.
///
/// Demotion is congestion control, not punishment: a tenant with at least `throttle_limit`
/// throttles (429s attributed to it) inside the store's throttle window, or whose tokens
/// counted today exceed `budget_ratio` x its daily budget, is served as batch for
/// `demote_for`, then the demotion expires by itself. A tenant still over its budget is
/// demoted again the next time it is checked after that: the budget resets with the UTC day.
///
/// What a call counts toward the budget is [`BudgetCounts`]: by default its input tokens
/// (the job's [`cost`](crate::Job::cost)), as the write-up's daily input-token budget does;
/// or its whole weighted [`charge`](crate::Job::charge). Either is counted when the call is
/// classified and corrected to the answer's usage by a
/// [`Settler`](crate::drr_fairness::Settler); a call fairgate refused (`Busy`,
/// `QueueFull`, no upstream with room) or one the upstream refused (settled at 0) counts
/// nothing.
///
/// Defaults: 5 throttles, 1.5x a daily budget of 100,000 input tokens,
/// 5 minutes. The throttle window (60 s) belongs to the [`Store`](crate::Store), because the
/// layer that records throttles shares it.
///
/// ```
/// use fairgate::DemotionPolicy;
/// use std::time::Duration;
///
/// let policy = DemotionPolicy::builder()
///     .throttle_limit(10)
///     .budget_ratio(2.0)
///     .demote_for(Duration::from_secs(120))
///     .build()?;
/// assert_eq!(policy.throttle_limit(), 10);
/// assert!(DemotionPolicy::builder().throttle_limit(0).build().is_err());
/// # Ok::<(), fairgate::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct DemotionPolicy {
    throttle_limit: u32,
    /// The budget ratio in thousandths, so both stores compare integers the same way.
    budget_permille: u64,
    default_daily_budget: u64,
    demote_for: Duration,
    counts: BudgetCounts,
}

/// What a call counts toward its tenant's daily budget.
///
/// ```
/// use fairgate::{BudgetCounts, DemotionPolicy, Job, Origin};
///
/// // 20 input tokens, and up to 200 output tokens weighing 5 input tokens each.
/// let job = Job::new("acme", Origin::Scheduled).with_cost(20).with_output_cost(200 * 5);
/// let count = |counts: BudgetCounts| counts.count(job.cost().into(), job.charge());
/// assert_eq!(count(BudgetCounts::InputTokens), 20);
/// assert_eq!(count(BudgetCounts::Weighted), 1_020);
/// let policy = DemotionPolicy::builder().budget_counts(BudgetCounts::Weighted).build()?;
/// assert_eq!(policy.budget_counts(), BudgetCounts::Weighted);
/// # Ok::<(), fairgate::ConfigError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BudgetCounts {
    /// The call's input tokens: its [`cost`](crate::Job::cost), settled to the answer's
    /// `input_tokens` (the default, the write-up's daily input-token budget).
    #[default]
    InputTokens,
    /// The call's whole [`charge`](crate::Job::charge) (input plus weighted output, as the
    /// fair queue charges it), settled to the answer's weighted use.
    Weighted,
}

impl BudgetCounts {
    /// What a call of `input_tokens` input and `charge` in all (in the units of
    /// [`Job::charge`](crate::Job::charge)) counts: estimated when it is classified, used
    /// when its answer said.
    pub fn count(self, input_tokens: u64, charge: u64) -> u64 {
        match self {
            BudgetCounts::InputTokens => input_tokens,
            BudgetCounts::Weighted => charge,
        }
    }
}

impl Default for DemotionPolicy {
    fn default() -> Self {
        DemotionPolicy {
            throttle_limit: 5,
            budget_permille: 1500,
            default_daily_budget: 100_000,
            demote_for: Duration::from_secs(300),
            counts: BudgetCounts::InputTokens,
        }
    }
}

impl DemotionPolicy {
    /// Starts from the defaults.
    pub fn builder() -> DemotionPolicyBuilder {
        let policy = DemotionPolicy::default();
        DemotionPolicyBuilder {
            budget_ratio: policy.budget_ratio(),
            policy,
        }
    }

    /// Throttles inside the window that demote a tenant.
    pub fn throttle_limit(&self) -> u32 {
        self.throttle_limit
    }

    /// Multiple of the daily budget past which a tenant is demoted (to three decimals).
    pub fn budget_ratio(&self) -> f64 {
        self.budget_permille as f64 / 1000.0
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn budget_permille(&self) -> u64 {
        self.budget_permille
    }

    /// Daily token budget (in the unit of [`budget_counts`](Self::budget_counts)) of a
    /// tenant with none set in the store.
    pub fn default_daily_budget(&self) -> u64 {
        self.default_daily_budget
    }

    /// What a call counts toward the daily budget.
    pub fn budget_counts(&self) -> BudgetCounts {
        self.counts
    }

    /// How long a demotion lasts.
    pub fn demote_for(&self) -> Duration {
        self.demote_for
    }

    /// The rule itself; `scripts/check_demotion.lua` computes the same.
    pub(crate) fn should_demote(&self, throttles: u64, tokens_today: u64, budget: u64) -> bool {
        throttles >= u64::from(self.throttle_limit)
            || u128::from(tokens_today) * 1000
                > u128::from(budget) * u128::from(self.budget_permille)
    }
}

/// Builds a [`DemotionPolicy`]; [`build`](DemotionPolicyBuilder::build) refuses bad values.
#[derive(Clone, Debug)]
pub struct DemotionPolicyBuilder {
    policy: DemotionPolicy,
    budget_ratio: f64,
}

impl DemotionPolicyBuilder {
    /// Throttles inside the store's window that demote a tenant (at least 1).
    pub fn throttle_limit(mut self, throttles: u32) -> Self {
        self.policy.throttle_limit = throttles;
        self
    }

    /// Multiple of the daily budget past which a tenant is demoted (finite, > 0; kept to
    /// three decimals).
    pub fn budget_ratio(mut self, ratio: f64) -> Self {
        self.budget_ratio = ratio;
        self
    }

    /// Daily token budget (in the unit of [`budget_counts`](Self::budget_counts)) of
    /// tenants with none set in the store (at least 1).
    pub fn default_daily_budget(mut self, tokens: u64) -> Self {
        self.policy.default_daily_budget = tokens;
        self
    }

    /// What a call counts toward the daily budget (default: its input tokens).
    pub fn budget_counts(mut self, counts: BudgetCounts) -> Self {
        self.policy.counts = counts;
        self
    }

    /// How long a demotion lasts (1 ms to 30 days).
    pub fn demote_for(mut self, duration: Duration) -> Self {
        self.policy.demote_for = duration;
        self
    }

    /// The policy, or what is wrong with it.
    ///
    /// # Errors
    /// A zero throttle limit, budget or duration, or a ratio that is not a finite number
    /// above zero.
    pub fn build(self) -> Result<DemotionPolicy, ConfigError> {
        let mut policy = self.policy;
        if policy.throttle_limit == 0 {
            return Err(ConfigError::new("throttle limit must be at least 1"));
        }
        if !self.budget_ratio.is_finite() || self.budget_ratio <= 0.0 {
            return Err(ConfigError::new(
                "budget ratio must be a finite number above 0",
            ));
        }
        let permille = (self.budget_ratio * 1000.0).round();
        if !(1.0..=1e12).contains(&permille) {
            return Err(ConfigError::new(
                "budget ratio must be between 0.001 and 1e9",
            ));
        }
        policy.budget_permille = permille as u64;
        if policy.default_daily_budget == 0 {
            return Err(ConfigError::new(
                "default daily budget must be at least 1 token",
            ));
        }
        if policy.demote_for < Duration::from_millis(1)
            || policy.demote_for > Duration::from_secs(30 * 86_400)
        {
            return Err(ConfigError::new(
                "demotion must last between 1 ms and 30 days",
            ));
        }
        Ok(policy)
    }
}
