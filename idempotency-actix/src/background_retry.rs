//! [`retry_in_background`]: a store step sent again off the request path, with backoff,
//! until it is done or its time is up.
//!
//! Used for the steps that keep a key from being blocked with no handler running: the
//! abandon of a token whose `begin` did not answer, and a release that failed. Each retry
//! is counted in `idempotency_background_retries_total`.

use std::future::Future;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

use crate::engine::within;
use crate::instrument::{self, StoreOperation};
use crate::log_interval::LogInterval;
use crate::store::StoreError;

/// How a step retried in the background ended.
pub(crate) enum Retried {
    /// An answer the caller took as done.
    Done,
    /// The store answered, but never so that the step was done, before the deadline.
    Answered,
    /// The store never answered before the deadline.
    Unanswered,
}

/// The store's silence for a whole lease, logged at most once per interval for the whole
/// process: in an outage every request whose step failed would log it.
static UNANSWERED: LazyLock<LogInterval> = LazyLock::new(LogInterval::new);

/// Sends `step` again, 50 ms after its failure and then at intervals that double up to a
/// second, each bounded by `timeout` and counted as a background retry of `kind`, until an
/// answer is `done` or the next one would start after `deadline`.
pub(crate) async fn retry_in_background<T, Step, Sent>(
    kind: StoreOperation,
    timeout: Duration,
    deadline: Instant,
    mut step: Step,
    done: impl Fn(&T) -> bool,
) -> Retried
where
    Step: FnMut() -> Sent,
    Sent: Future<Output = Result<T, StoreError>>,
{
    let mut pause = Duration::from_millis(50);
    let mut answered = false;
    while Instant::now() + pause < deadline {
        actix_rt::time::sleep(pause).await;
        instrument::background_retry(kind);
        match within(kind, timeout, step()).await {
            Ok(answer) if done(&answer) => return Retried::Done,
            Ok(_) => answered = true,
            Err(_) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(1));
    }
    if answered {
        Retried::Answered
    } else {
        Retried::Unanswered
    }
}

/// Logs, at most once per interval, that the store did not answer `what` for a whole lease.
pub(crate) fn log_unanswered(what: &str) {
    if let Some(unlogged) = UNANSWERED.admit(Instant::now()) {
        tracing::error!(
            unlogged,
            "idempotency: store unreachable for a whole lease; {what}"
        );
    }
}
