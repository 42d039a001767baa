//! The choice between the three priority classes: which class is served next.

use super::config::{ClassSelection, SchedulerConfig};
use super::{CLASSES, clamp_i64, class_index};
use crate::Priority;
use crate::rng::Rng;

/// Chooses the next class among those that may go: nginx's smooth weighted
/// round robin, or a random draw by weight (seeded). Used by
/// [`Scheduler::pop`], and by a caller that picks over several schedulers
/// (the layer keeps one per tier) with [`Scheduler::pop_class`].
#[derive(Clone, Debug)]
pub(crate) struct ClassPicker {
    weights: [u64; 3],
    selection: ClassSelection,
    /// Smooth weighted round robin credit of each class.
    current: [i64; 3],
    rng: Rng,
}

impl ClassPicker {
    pub(crate) fn new(config: &SchedulerConfig) -> Self {
        let rng = match config.selection {
            ClassSelection::Probabilistic { seed } => Rng::seeded(seed),
            ClassSelection::SmoothWeighted => Rng::seeded(0),
        };
        ClassPicker {
            weights: config.class_weights.as_array(),
            selection: config.selection,
            current: [0; 3],
            rng,
        }
    }

    /// The class to serve next among `candidates` (indexed critical,
    /// standard, batch), or `None` if there is none.
    pub(crate) fn pick(&mut self, candidates: [bool; 3]) -> Option<Priority> {
        let weights = self.weights;
        let total: u64 = (0..3).filter(|&i| candidates[i]).map(|i| weights[i]).sum();
        if total == 0 {
            return None;
        }
        let chosen = match self.selection {
            ClassSelection::SmoothWeighted => {
                let mut best: Option<usize> = None;
                for i in (0..3).filter(|&i| candidates[i]) {
                    self.current[i] = self.current[i].saturating_add(clamp_i64(weights[i]));
                    // Strict `>`: ties go to the higher priority.
                    if best.is_none_or(|b| self.current[i] > self.current[b]) {
                        best = Some(i);
                    }
                }
                let chosen = best?;
                self.current[chosen] = self.current[chosen].saturating_sub(clamp_i64(total));
                chosen
            }
            ClassSelection::Probabilistic { .. } => {
                // Multiply-shift maps 64 random bits onto 0..total.
                let draw = u128::from(self.rng.next_u64()) * u128::from(total);
                let mut point = u64::try_from(draw >> 64).unwrap_or(0);
                let mut chosen = None;
                for i in (0..3).filter(|&i| candidates[i]) {
                    if point < weights[i] {
                        chosen = Some(i);
                        break;
                    }
                    point -= weights[i];
                }
                chosen?
            }
        };
        Some(CLASSES[chosen])
    }

    /// `class` has nothing waiting: it banks no credit.
    pub(crate) fn forget(&mut self, class: Priority) {
        self.current[class_index(class)] = 0;
    }
}
