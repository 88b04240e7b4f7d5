//! [`SilenceWatch`]: notices that a redis-rs connection has gone silent.
//!
//! A server that stops answering without closing the socket (a firewall or NAT that drops
//! the flow, a host that vanished) leaves a redis-rs multiplexed connection waiting: every
//! request gets its timeout from the engine, but the connection reports nothing wrong, so
//! it would be kept, and every protected request answered 503, until the kernel gives the
//! socket up (about 15 minutes of retransmissions). The store's own connection closes such
//! a connection itself ([`STALLED_AFTER`] past a deadline, `redis::direct`); this watch does
//! the same for redis-rs's: once a request has gone unanswered that long past its deadline,
//! with no reply on the connection since, the next request replaces the connection. A server
//! that is only slow (a long `DEBUG SLEEP`, a busy script) answers something meanwhile, or
//! within that grace.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use redis::aio::MultiplexedConnection;

use super::direct::STALLED_AFTER;

/// The earliest deadline of the requests sent on one connection since its last reply.
#[derive(Debug, Default)]
pub(super) struct SilenceWatch {
    unanswered_since: Mutex<Option<Instant>>,
    /// Whether a [`probe`](Self::probe) is under way.
    probing: AtomicBool,
}

impl SilenceWatch {
    /// A request is sent that gives up at `deadline` (`None`: at once, for one sent outside
    /// a store operation's deadline).
    pub(super) fn sent(&self, deadline: Option<Instant>) {
        let deadline = deadline.unwrap_or_else(Instant::now);
        let mut earliest = self.lock();
        *earliest = Some(earliest.map_or(deadline, |earliest| earliest.min(deadline)));
    }

    /// The server answered a request (a reply, or an error reply): it is not silent.
    pub(super) fn answered(&self) {
        *self.lock() = None;
    }

    /// Whether a request has waited [`STALLED_AFTER`] past its deadline at `now` with no
    /// reply since it was sent.
    pub(super) fn is_silent(&self, now: Instant) -> bool {
        self.lock()
            .is_some_and(|deadline| now >= deadline + STALLED_AFTER)
    }

    /// A request sent on `connection` was given up on before its reply came: sends a `PING`
    /// behind it, on a task of its own, and counts its reply as the server's answer. A late
    /// reply to a request no longer awaited reaches nobody, so without it a server that was
    /// only slow (busy past a deadline, then answering within the grace) was taken for
    /// silent by the next request, however much later it came, and its connection replaced:
    /// a reconnect for nothing, and a 503 for every request while the server took no new
    /// connection. One probe at a time; one unanswered within the grace gives up.
    pub(super) fn probe(self: Arc<Self>, mut connection: MultiplexedConnection) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        drop(runtime.spawn(async move {
            let ping = redis::cmd("PING");
            let pong = tokio::time::timeout(
                STALLED_AFTER,
                ping.query_async::<redis::Value>(&mut connection),
            )
            .await;
            // A reply, or an error the server sent (it has a code): the server answers.
            if let Ok(pong) = pong
                && pong.map_or_else(|error| error.code().is_some(), |_| true)
            {
                self.answered();
            }
            self.probing.store(false, Ordering::Release);
        }));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.unanswered_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn silent_once_a_request_waits_past_its_deadline_and_the_grace_with_no_reply() {
        let watch = SilenceWatch::default();
        let now = Instant::now();
        assert!(!watch.is_silent(now + Duration::from_secs(3600)));
        watch.sent(Some(now + Duration::from_secs(2)));
        watch.sent(Some(now + Duration::from_secs(1)));
        watch.sent(Some(now + Duration::from_secs(5)));
        // The earliest deadline counts.
        assert!(!watch.is_silent(now + Duration::from_secs(1) + STALLED_AFTER / 2));
        assert!(watch.is_silent(now + Duration::from_secs(1) + STALLED_AFTER));
        // Any reply shows the server alive.
        watch.answered();
        assert!(!watch.is_silent(now + Duration::from_secs(3600)));
    }
}
