//! [`StopSignals`]: the signals that stop the examples' long-running processes.

use std::task::Poll;

/// The signals that stop a process: SIGINT (Ctrl-C) and SIGTERM (Ctrl-C alone where there
/// is no SIGTERM).
#[cfg(unix)]
pub struct StopSignals {
    interrupt: actix_web::rt::signal::unix::Signal,
    terminate: actix_web::rt::signal::unix::Signal,
}

#[cfg(unix)]
impl StopSignals {
    /// Starts listening, on the current Actix (Tokio) runtime: from now on these signals no
    /// longer end the process by default.
    ///
    /// # Errors
    ///
    /// When the runtime cannot register the handlers.
    pub fn listen() -> std::io::Result<Self> {
        use actix_web::rt::signal::unix::{SignalKind, signal};
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    /// The next signal received: its name and number.
    pub async fn next(&mut self) -> (&'static str, u8) {
        std::future::poll_fn(|cx| {
            if self.interrupt.poll_recv(cx).is_ready() {
                Poll::Ready(("SIGINT", 2))
            } else if self.terminate.poll_recv(cx).is_ready() {
                Poll::Ready(("SIGTERM", 15))
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

/// The signal that stops a process where there is no SIGTERM: Ctrl-C.
#[cfg(not(unix))]
pub struct StopSignals;

#[cfg(not(unix))]
impl StopSignals {
    /// Listening starts with the first wait.
    ///
    /// # Errors
    ///
    /// Never here; as on Unix, for the callers' sake.
    pub fn listen() -> std::io::Result<Self> {
        Ok(Self)
    }

    /// The next Ctrl-C: its name, and the number of SIGINT.
    pub async fn next(&mut self) -> (&'static str, u8) {
        // An error means it cannot be listened for: then it never comes.
        if actix_web::rt::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
        ("Ctrl-C", 2)
    }
}
