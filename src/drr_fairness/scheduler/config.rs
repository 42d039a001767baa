//! What a scheduler is configured with: the largest charge (in quanta), the
//! classes' weights and how the next class is chosen, the queue limits.

use super::CLASSES;
use crate::Priority;
use crate::error::ConfigError;

/// Relative dispatch weights of the three priority classes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassWeights {
    /// Weight of [`Priority::Critical`].
    pub critical: u32,
    /// Weight of [`Priority::Standard`].
    pub standard: u32,
    /// Weight of [`Priority::Batch`].
    pub batch: u32,
}

impl Default for ClassWeights {
    /// 270 / 25 / 5: critical wins 90 % while it has work, the remaining
    /// 10 % split 5:1 between standard and batch.
    fn default() -> Self {
        ClassWeights {
            critical: 270,
            standard: 25,
            batch: 5,
        }
    }
}

impl ClassWeights {
    /// The weight of `class`.
    pub fn get(&self, class: Priority) -> u32 {
        match class {
            Priority::Critical => self.critical,
            Priority::Standard => self.standard,
            Priority::Batch => self.batch,
        }
    }

    pub(super) fn as_array(&self) -> [u64; 3] {
        [
            u64::from(self.critical),
            u64::from(self.standard),
            u64::from(self.batch),
        ]
    }
}

/// How the next class is chosen among the non-empty classes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClassSelection {
    /// Deterministic smooth weighted round robin (nginx): even spacing, exact
    /// shares over every `total weight` dispatches when all are backlogged.
    #[default]
    SmoothWeighted,
    /// Random choice weighted by the non-empty classes' weights, from a
    /// SplitMix64 generator seeded with `seed` (reproducible per seed).
    Probabilistic {
        /// Initial generator state.
        seed: u64,
    },
}

/// Scheduler settings. Build from [`Default`] and the `with_*` methods, then
/// check with [`SchedulerConfig::validate`] (also done by
/// [`Scheduler::new`](super::Scheduler::new)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// The unit of `max_charge_quanta`, in tokens. At least 1.
    pub quantum: u64,
    /// Charged cost is capped at `quantum × max_charge_quanta`. At least 1.
    pub max_charge_quanta: u32,
    /// Weights of the priority classes. Each at least 1.
    pub class_weights: ClassWeights,
    /// Class selection policy.
    pub selection: ClassSelection,
    /// Maximum waiting items per tenant per class (`None`: unlimited).
    pub max_per_tenant: Option<usize>,
    /// Maximum waiting items per class (`None`: unlimited).
    pub max_per_class: Option<usize>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            quantum: 5_000,
            max_charge_quanta: 4,
            class_weights: ClassWeights::default(),
            selection: ClassSelection::default(),
            max_per_tenant: None,
            max_per_class: None,
        }
    }
}

impl SchedulerConfig {
    /// Sets [`SchedulerConfig::quantum`].
    pub fn with_quantum(mut self, quantum: u64) -> Self {
        self.quantum = quantum;
        self
    }

    /// Sets [`SchedulerConfig::max_charge_quanta`].
    pub fn with_max_charge_quanta(mut self, quanta: u32) -> Self {
        self.max_charge_quanta = quanta;
        self
    }

    /// Sets [`SchedulerConfig::class_weights`].
    pub fn with_class_weights(mut self, weights: ClassWeights) -> Self {
        self.class_weights = weights;
        self
    }

    /// Sets [`SchedulerConfig::selection`].
    pub fn with_selection(mut self, selection: ClassSelection) -> Self {
        self.selection = selection;
        self
    }

    /// Sets [`SchedulerConfig::max_per_tenant`].
    pub fn with_max_per_tenant(mut self, limit: Option<usize>) -> Self {
        self.max_per_tenant = limit;
        self
    }

    /// Sets [`SchedulerConfig::max_per_class`].
    pub fn with_max_per_class(mut self, limit: Option<usize>) -> Self {
        self.max_per_class = limit;
        self
    }

    /// The largest cost charged for one item: `quantum × max_charge_quanta`
    /// (saturating).
    pub fn max_charge(&self) -> u64 {
        self.quantum
            .saturating_mul(u64::from(self.max_charge_quanta))
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let at_least_one =
            |field: &str| Err(ConfigError::new(format!("{field} must be at least 1")));
        if self.quantum == 0 {
            return at_least_one("quantum");
        }
        if self.max_charge_quanta == 0 {
            return at_least_one("max_charge_quanta");
        }
        for class in CLASSES {
            if self.class_weights.get(class) == 0 {
                return at_least_one(&format!("class_weights.{class}"));
            }
        }
        if self.max_per_tenant == Some(0) {
            return at_least_one("max_per_tenant");
        }
        if self.max_per_class == Some(0) {
            return at_least_one("max_per_class");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::Scheduler;
    use super::*;

    #[test]
    fn invalid_config_is_refused_with_message() {
        let cases = [
            (
                SchedulerConfig::default().with_quantum(0),
                "quantum must be at least 1",
            ),
            (
                SchedulerConfig::default().with_max_charge_quanta(0),
                "max_charge_quanta must be at least 1",
            ),
            (
                SchedulerConfig::default().with_class_weights(ClassWeights {
                    batch: 0,
                    ..ClassWeights::default()
                }),
                "class_weights.batch must be at least 1",
            ),
            (
                SchedulerConfig::default().with_max_per_tenant(Some(0)),
                "max_per_tenant must be at least 1",
            ),
            (
                SchedulerConfig::default().with_max_per_class(Some(0)),
                "max_per_class must be at least 1",
            ),
        ];
        for (config, message) in cases {
            let err = Scheduler::<()>::new(config).expect_err("refused");
            assert_eq!(err.message(), message);
        }
        assert!(SchedulerConfig::default().validate().is_ok());
    }
}
