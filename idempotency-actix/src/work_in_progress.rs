//! The keyed work in progress in this process, and draining it before the process stops.
//!
//! Actix's graceful stop waits for the requests whose connections are still open, and then
//! its worker threads end, dropping whatever they still run. A keyed request whose client
//! left goes on without a connection (its handler runs to its end, a streamed body is read
//! on, a failed commit is retried), so that stop
//! cuts it short: a handler half done, its key locked until the lease ends. Each piece of
//! keyed work holds an [`InProgress`] until it is done, counted for the whole process, so
//! that a shutdown can [`drain`] it first: run no handler for a new key any more, and wait
//! for the work in progress, before it stops the server.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// Keyed work in progress in this process, every app and worker included.
static IN_PROGRESS: AtomicUsize = AtomicUsize::new(0);

/// The tasks waiting for [`IN_PROGRESS`] to reach zero.
static WAITING: Mutex<Vec<Waker>> = Mutex::new(Vec::new());

/// Set by [`drain`], for good: keyed requests are refused from then on.
static DRAINING: AtomicBool = AtomicBool::new(false);

/// One piece of keyed work in progress, from its start until it is dropped.
#[derive(Debug)]
pub(crate) struct InProgress(());

impl InProgress {
    pub(crate) fn start() -> Self {
        IN_PROGRESS.fetch_add(1, Ordering::SeqCst);
        Self(())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        if IN_PROGRESS.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Taken under the lock that a waiter holds while it checks the count and
            // registers, so no waiter registers after this look and misses the zero.
            let waiting = std::mem::take(&mut *waiting());
            for waker in waiting {
                waker.wake();
            }
        }
    }
}

fn waiting() -> std::sync::MutexGuard<'static, Vec<Waker>> {
    // A waker's `wake` runs outside the lock, so nothing can panic while it is held.
    WAITING
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How much keyed work is in progress now.
fn count() -> usize {
    IN_PROGRESS.load(Ordering::SeqCst)
}

/// Whether the process is draining its keyed work: no handler runs for a new key.
///
/// Sequentially consistent with [`drain`]'s store and count, as a request's own count
/// before it asks: either the request sees the flag, or the drain sees the request.
pub(crate) fn draining() -> bool {
    DRAINING.load(Ordering::SeqCst)
}

/// Runs no handler for a new key from now on, and waits until no keyed work is in
/// progress or `timeout` has passed: how much was still in progress then (0 once drained).
pub(crate) async fn drain(timeout: Duration) -> usize {
    DRAINING.store(true, Ordering::SeqCst);
    match actix_rt::time::timeout(timeout, Finished::default()).await {
        Ok(()) => 0,
        Err(_elapsed) => count(),
    }
}

/// Ready once no keyed work is in progress (at once if none is).
#[derive(Debug, Default)]
struct Finished(());

impl Future for Finished {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if count() == 0 {
            return Poll::Ready(());
        }
        let mut waiting = waiting();
        // Checked again under the lock: the last piece of work may have ended since.
        if count() == 0 {
            return Poll::Ready(());
        }
        if !waiting.iter().any(|waker| waker.will_wake(cx.waker())) {
            waiting.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    // Only `Finished`: the count is the whole process's and the tests of this crate run in
    // parallel threads, some with keyed work of their own, so it is only compared with
    // itself here; `drain` would refuse their keyed requests (it has a test binary of its
    // own, `tests/tests/drain.rs`).
    #[actix_rt::test]
    async fn finished_waits_for_every_piece_of_work() {
        let first = InProgress::start();
        let second = InProgress::start();
        let waiting = actix_rt::spawn(Finished::default());
        actix_rt::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "ready while work was in progress");
        drop(first);
        actix_rt::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "ready while one piece was in progress"
        );
        // Ended on another thread, as a worker's work ends.
        std::thread::spawn(move || drop(second)).join().unwrap();
        actix_rt::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("still waiting once the work ended")
            .unwrap();
    }
}
