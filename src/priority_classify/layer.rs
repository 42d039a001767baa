use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::classifier::Classifier;
use super::{ClassifyRule, DefaultRule, DemotionPolicy, PriorityClassify};
use crate::Store;

/// Applies [`PriorityClassify`] to a service.
///
/// # Clone
/// Cloning shares the store, the rule and the policy; it creates no new state.
pub struct PriorityClassifyLayer<R = DefaultRule> {
    pub(super) shared: Classifier<R>,
}

impl PriorityClassifyLayer {
    /// Classifies with [`DefaultRule`] and the default [`DemotionPolicy`].
    pub fn new(store: Store) -> Self {
        PriorityClassifyLayer {
            shared: Classifier {
                store,
                rule: Arc::new(DefaultRule::new()),
                policy: Arc::new(DemotionPolicy::default()),
            },
        }
    }
}

impl<R: ClassifyRule> PriorityClassifyLayer<R> {
    /// Replaces the classification rule (a [`ClassifyRule`] or a closure `Fn(&Job) -> Priority`).
    ///
    /// [`Job`]: crate::Job
    pub fn rule<R2: ClassifyRule>(self, rule: R2) -> PriorityClassifyLayer<R2> {
        PriorityClassifyLayer {
            shared: Classifier {
                store: self.shared.store,
                rule: Arc::new(rule),
                policy: self.shared.policy,
            },
        }
    }

    /// Replaces the demotion thresholds.
    pub fn demotion(mut self, policy: DemotionPolicy) -> Self {
        self.shared.policy = Arc::new(policy);
        self
    }
}

impl<R> Clone for PriorityClassifyLayer<R> {
    fn clone(&self) -> Self {
        PriorityClassifyLayer {
            shared: self.shared.clone(),
        }
    }
}

impl<R> fmt::Debug for PriorityClassifyLayer<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PriorityClassifyLayer")
            .field("store", &self.shared.store)
            .field("rule", &std::any::type_name::<R>())
            .field("policy", &self.shared.policy)
            .finish()
    }
}

impl<S, R> Layer<S> for PriorityClassifyLayer<R> {
    type Service = PriorityClassify<S, R>;

    fn layer(&self, inner: S) -> Self::Service {
        PriorityClassify {
            inner,
            shared: self.shared.clone(),
        }
    }
}
