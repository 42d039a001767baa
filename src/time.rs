//! Time arithmetic that cannot panic on the durations a caller may configure.

use std::time::Duration;

use tokio::time::Instant;

/// What "never" means here: far enough ahead that no deadline is ever reached, near enough
/// that adding it cannot overflow.
const NEVER: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `at + wait`, capped at a hundred years: `Duration::MAX` reads as "forever", not a panic.
pub(crate) fn after(at: Instant, wait: Duration) -> Instant {
    at + wait.min(NEVER)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_wait_is_a_far_deadline_not_a_panic() {
        let now = Instant::now();
        assert!(after(now, Duration::MAX) > now + Duration::from_secs(3_000_000_000));
        assert_eq!(
            after(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
    }
}
