//! [`ReplicatedWrites`]: wait until replicas hold each write of a Redis store before going
//! on, so a failover does not lose a lock or a committed record.

use std::time::Duration;

/// Replicated writes for [`RedisStore`](crate::RedisStore) and `RedisClusterStore` (feature
/// `redis-cluster`): each write of the store (the lock that
/// `begin` creates, and the commit) is followed, in the same round trip on the same
/// connection, by `WAIT replicas timeout`, which answers once that many replicas of the
/// key's primary acknowledge every write the connection made so far, or when the timeout
/// passes.
///
/// Redis replicates asynchronously: without this, a primary that crashes right after a
/// write can take the write with it, and the replica promoted in its place has never seen
/// it. A lost lock lets a concurrent duplicate run the handler; a lost commit lets a retry,
/// after the client got its response, run the handler a second time.
///
/// What each setting guarantees:
///
/// | setting | a primary crash loses… |
/// |---|---|
/// | none (the default) | any write of the last moments: a retry may run the handler again |
/// | `ReplicatedWrites::new(n, t)` (strict) | nothing that `n` replicas acknowledged, where one of them is the replica promoted (Redis picks it, best effort: with more replicas than `n`, one that did not acknowledge can be promoted; README, "Replicated writes"), and as long as a primary that crashed comes back with its data or not at all (a primary restarted empty before a replica took over, with persistence off and a supervisor restarting it, makes its replicas drop everything as they resync: turn on persistence, or let failovers happen); the handler runs only once its lock is on `n` replicas, and a client's response waits for its commit's `WAIT` (where the replicas fall short, it is sent all the same and the commit retried: see below) |
/// | `ReplicatedWrites::new(n, t).or_warn()` | like strict when replicas keep up; when they do not, a warning and the write goes on unprotected |
///
/// When fewer replicas acknowledge within the timeout (a replica down or lagging):
///
/// * strict, in `begin`: the request is refused like any store failure (503 with
///   `Retry-After` when failing closed) and the lock it created is released; the handler
///   does not run. (A `begin` sent again after a reconnection that finds its own lock
///   writes it over itself first, so that its `WAIT` counts the lock: since Redis 7.2, and
///   on Valkey, `WAIT` counts only its own connection's writes.)
/// * strict, in the commit: the commit counts as failed. As for any failed commit, the
///   response is still sent (the handler ran; its response is never lost) and the commit
///   is retried in the background, each time with `WAIT`, until the replicas acknowledge it
///   or the record's ttl has passed (a retry that finds the record completed writes it over
///   itself first, so that its `WAIT` counts the record, whatever connection it is on).
///   Retries of the request meanwhile find the record completed on the primary and get the
///   replay. Only a failover inside that window can lose the record.
/// * [`or_warn`](Self::or_warn): a warning is logged and the step goes on as if replicated.
///
/// Cost: each new key waits for the replicas twice (the lock, the commit); a replay waits
/// too, since `begin` cannot know before it answers whether it writes, but `WAIT` answers
/// at once when the replicas already acknowledged the connection's writes. `WAIT` is not
/// allowed inside a script, hence a pipeline. Redis reads nothing else from a connection
/// while its `WAIT` is blocked, so a replicated exchange does not use the store's shared
/// connection (the writes of concurrent requests would reach the replicas one round trip
/// after another) but one of its own, kept idle afterwards for the next (up to 64 per
/// worker): concurrent waits overlap. The README's Performance section has figures. Renewals and
/// releases are not waited for: a lost renewal only shortens a lease to what the replica
/// saw, and a lost release leaves a lock that expires with its lease.
///
/// Keep the timeout well below the store timeout (2 s by default) and, on a cluster, below
/// the connection's response timeout (1 s with `RedisClusterStore::client`): a `WAIT` that
/// outlasts them is a store timeout, not a count of acknowledgements.
///
/// With one replica per primary, a failover leaves the promoted primary without a replica
/// until one rejoins: strict replicated writes then refuse new keys on that primary (503)
/// while replays go on. Run two replicas per primary and wait for one to keep serving
/// through a failover (a failover may then promote the replica that did not acknowledge a
/// write, which lacks it; waiting for both closes that, and refuses new keys while one is
/// down).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use idempotency_actix::{RedisStore, ReplicatedWrites};
///
/// # actix_web::rt::System::new().block_on(async {
/// let pool = RedisStore::pool("redis://127.0.0.1:6379").expect("a valid Redis URL");
/// let store = RedisStore::new(pool)
///     .replicated_writes(ReplicatedWrites::new(1, Duration::from_millis(200)));
/// assert_eq!(store.replication().map(|writes| writes.replicas()), Some(1));
/// assert!(store.replication().is_some_and(|writes| writes.is_strict()));
/// # });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicatedWrites {
    replicas: u32,
    timeout: Duration,
    strict: bool,
}

impl ReplicatedWrites {
    /// Wait for `replicas` replicas, at most `timeout` (at least 1 ms), per write; strict:
    /// fewer acknowledgements fail the step.
    ///
    /// # Panics
    ///
    /// If `timeout` is over [`MAX_DURATION`](crate::MAX_DURATION) (365 days), like the
    /// middleware's other durations: Redis refuses a `WAIT` timeout that large, so every
    /// replicated write would fail. (`WAIT` has no "forever" here: a zero `timeout` waits
    /// 1 ms.)
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::ReplicatedWrites;
    ///
    /// const ONE_REPLICA: ReplicatedWrites = ReplicatedWrites::new(1, Duration::from_millis(200));
    /// assert!(ONE_REPLICA.is_strict());
    /// assert_eq!(ONE_REPLICA.replicas(), 1);
    /// ```
    pub const fn new(replicas: u32, timeout: Duration) -> Self {
        assert!(
            timeout.as_secs() <= crate::MAX_DURATION.as_secs(),
            "a replicated write's timeout must be at most 365 days"
        );
        Self {
            replicas,
            timeout,
            strict: true,
        }
    }

    /// Fewer acknowledgements than asked log a warning and the step goes on.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::ReplicatedWrites;
    ///
    /// let writes = ReplicatedWrites::new(1, Duration::from_millis(200)).or_warn();
    /// assert!(!writes.is_strict());
    /// ```
    #[must_use]
    pub const fn or_warn(mut self) -> Self {
        self.strict = false;
        self
    }

    /// How many replicas each write waits for.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::ReplicatedWrites;
    ///
    /// assert_eq!(ReplicatedWrites::new(2, Duration::from_millis(200)).replicas(), 2);
    /// ```
    pub const fn replicas(&self) -> u32 {
        self.replicas
    }

    /// How long each write waits for them at most.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::ReplicatedWrites;
    ///
    /// let writes = ReplicatedWrites::new(1, Duration::from_millis(200));
    /// assert_eq!(writes.timeout(), Duration::from_millis(200));
    /// ```
    pub const fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether fewer acknowledgements fail the step (`true` unless [`or_warn`](Self::or_warn)).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::ReplicatedWrites;
    ///
    /// let strict = ReplicatedWrites::new(1, Duration::from_millis(200));
    /// assert!(strict.is_strict());
    /// assert!(!strict.or_warn().is_strict());
    /// ```
    pub const fn is_strict(&self) -> bool {
        self.strict
    }

    /// `WAIT replicas timeout-ms`.
    pub(super) fn command(&self) -> redis::Cmd {
        let mut command = redis::cmd("WAIT");
        command.arg(self.replicas).arg(timeout_millis(self.timeout));
        command
    }
}

/// Fewer replicas acknowledged a write than [`ReplicatedWrites`] asks for.
#[derive(Debug, thiserror::Error)]
#[error(
    "{step}: {acknowledged} of {} replicas acknowledged the write within {:?}",
    wait.replicas(),
    wait.timeout()
)]
pub(super) struct NotReplicated {
    pub(super) step: &'static str,
    pub(super) acknowledged: u32,
    pub(super) wait: ReplicatedWrites,
}

/// Milliseconds for `WAIT`, at least 1 (0 would wait forever).
fn timeout_millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::ReplicatedWrites;
    use crate::MAX_DURATION;

    #[test]
    fn the_longest_timeout_is_taken_as_whole_milliseconds() {
        let writes = ReplicatedWrites::new(1, MAX_DURATION);
        let command = writes.command();
        let args: Vec<_> = command.args_iter().collect();
        assert_eq!(args.len(), 3);
        assert!(matches!(args[2], redis::Arg::Simple(b"31536000000")));
    }

    #[test]
    fn a_zero_timeout_waits_one_millisecond_not_forever() {
        let command = ReplicatedWrites::new(1, Duration::ZERO).command();
        assert!(matches!(
            command.args_iter().nth(2),
            Some(redis::Arg::Simple(b"1"))
        ));
    }

    #[test]
    #[should_panic(expected = "at most 365 days")]
    fn a_timeout_over_365_days_is_refused_when_built() {
        let _ = ReplicatedWrites::new(1, Duration::MAX);
    }
}
