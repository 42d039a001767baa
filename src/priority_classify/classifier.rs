//! What classifies a request, shared by the layer, its services and their futures: the
//! store (demotion state), the rule and the demotion policy, and how a demotion changes the
//! rule's answer.

use std::sync::Arc;

use super::DemotionPolicy;
use crate::store::Demotion;
use crate::{Job, Priority, Store};

/// The store, the rule and the demotion policy, shared by the layer's clones and services.
pub(super) struct Classifier<R> {
    pub(super) store: Store,
    pub(super) rule: Arc<R>,
    pub(super) policy: Arc<DemotionPolicy>,
}

impl<R> Clone for Classifier<R> {
    fn clone(&self) -> Self {
        Classifier {
            store: self.store.clone(),
            rule: self.rule.clone(),
            policy: self.policy.clone(),
        }
    }
}

/// Applies the demotion to the rule's answer and writes the priority into the job.
pub(super) fn decide(job: &mut Job, by_rule: Priority, demotion: Demotion) -> Priority {
    let priority = match demotion {
        Demotion::NotDemoted => by_rule,
        Demotion::Demoted { left, newly } => {
            if newly {
                tracing::warn!(
                    name: "tenant.demoted",
                    tenant = %job.tenant(),
                    for_secs = left.as_secs_f64(),
                    "tenant demoted to batch"
                );
            }
            Priority::Batch
        }
    };
    job.set_priority(priority);
    priority
}
