//! [`RunToCompletion`]: a run that completes even when whoever awaits it stops waiting.
//!
//! A handler that runs under a lock must run to its end and have its response committed even
//! if the client disconnects and Actix drops the request's future: a run cut short would
//! leave its side effects half done and its key locked until the lease expires. Spawning the
//! run on a task of its own guarantees that, but costs every request a task: its allocation,
//! its scheduling, and a second wake-up (the reply wakes the task, the task's end wakes the
//! request). So the run is polled inline, by the request's own future, and is handed to a
//! task of its own only if that future is dropped before the run is done.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::future::LocalBoxFuture;
use tracing::Instrument;

use crate::built_in_box::built_in_box;

/// A boxed run, polled by its owner and, if the owner drops it before its end, finished on a
/// task of its own (spawned on the current worker).
///
/// Its output is the run's, or the payload of the panic that ended it: a panicking run is
/// dropped (its guards release what it held) and reported, as a task would report it,
/// instead of unwinding into the worker.
pub(crate) struct RunToCompletion<T: 'static> {
    run: Option<LocalBoxFuture<'static, T>>,
}

impl<T: 'static> RunToCompletion<T> {
    /// The run `make` returns, built in its box (see [`built_in_box`]): a run's future is
    /// about 2 KB, which would otherwise be built on the stack and copied.
    pub(crate) fn new<F: Future<Output = T> + 'static>(make: impl FnOnce() -> F) -> Self {
        Self {
            run: Some(built_in_box(make)),
        }
    }
}

impl<T: 'static> Future for RunToCompletion<T> {
    type Output = Result<T, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let run = self
            .run
            .as_mut()
            .expect("RunToCompletion polled after it completed");
        let polled = catch_unwind(AssertUnwindSafe(|| run.as_mut().poll(cx)));
        let output = match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(output)) => Ok(output),
            Err(panic) => Err(panic),
        };
        self.run = None;
        Poll::Ready(output)
    }
}

impl<T: 'static> Drop for RunToCompletion<T> {
    fn drop(&mut self) {
        if let Some(run) = self.run.take() {
            // In the span of the request whose future is being dropped (an instrumented
            // future enters its span while it drops what it wraps), so that what the run
            // logs from now on still carries the request's fields.
            let span = tracing::Span::current();
            actix_rt::spawn(
                async move {
                    run.await;
                }
                .instrument(span),
            );
        }
    }
}

/// What the panic that ended a run said, when it said it with a string (as `panic!` with a
/// message does).
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;
    use std::time::Duration;

    use super::*;

    #[actix_rt::test]
    async fn a_run_awaited_to_its_end_gives_its_output() {
        let run = RunToCompletion::new(|| async {
            actix_rt::time::sleep(Duration::from_millis(1)).await;
            7
        });
        assert_eq!(run.await.ok(), Some(7));
    }

    #[actix_rt::test]
    async fn a_run_dropped_before_its_end_finishes_on_a_task_of_its_own() {
        let finished = Rc::new(Cell::new(false));
        let run = RunToCompletion::new(|| {
            let finished = Rc::clone(&finished);
            async move {
                actix_rt::time::sleep(Duration::from_millis(20)).await;
                finished.set(true);
            }
        });
        // The owner stops waiting after one poll, as Actix does when the client goes away.
        let owner = actix_rt::time::timeout(Duration::from_millis(1), run).await;
        assert!(owner.is_err(), "the run ended before its owner gave up");
        assert!(!finished.get());
        actix_rt::time::sleep(Duration::from_millis(100)).await;
        assert!(finished.get(), "the dropped run was not finished");
    }

    #[actix_rt::test]
    async fn a_panicking_run_is_reported_and_dropped() {
        struct Guard(Rc<Cell<bool>>);
        impl Drop for Guard {
            fn drop(&mut self) {
                self.0.set(true);
            }
        }
        let released = Rc::new(Cell::new(false));
        let run = RunToCompletion::new(|| {
            let guard = Guard(Rc::clone(&released));
            async move {
                let _guard = guard;
                actix_rt::time::sleep(Duration::from_millis(1)).await;
                panic!("the handler panics");
            }
        });
        let panic = run.await.expect_err("the panic was not reported");
        assert_eq!(panic_message(panic.as_ref()), "the handler panics");
        assert!(released.get(), "the panicked run was not dropped");
    }
}
