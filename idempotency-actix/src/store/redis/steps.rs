//! The four steps of the Redis stores over any [`Transport`]: build the request, send it,
//! decode the reply, check replication. [`RedisStore`](super::RedisStore) and
//! `RedisClusterStore` (feature `redis-cluster`) differ only in their transport.

use std::time::Duration;

use super::conditional_set::ConditionalSet;
use super::exchange::{Exchange, Reply};
use super::protocol::{Begun, CommitBy, Committed, Unwritten};
use super::replication::ReplicatedWrites;
use super::{inspection, protocol};
use crate::fingerprint::Fingerprint;
use crate::lost_record;
use crate::record::StoredResponse;
use crate::scope::StorageKey;
use crate::store::{BeginOutcome, Deletion, LeaseToken, RecordSnapshot, StoreError};

/// How many times one `begin` claims a key over another token's marker before it answers
/// in flight (and a commit that writes its record anew, before it answers lost): each claim
/// fails only if yet another token was abandoned on that key meanwhile.
const MAX_CLAIMS: usize = 3;

/// How a store gets a request to Redis and its reply back.
pub(crate) trait Transport {
    /// Sends `exchange` (once, or again after a reconnection: every request is safe to send
    /// twice), on the connection shared by the store's requests, or, when the exchange
    /// blocks its connection, on one of its own.
    async fn send(&self, exchange: &Exchange) -> Result<Reply, StoreError>;
}

/// A transport, the store's replication setting, and whether commits go by `SET … IFEQ`.
pub(crate) struct Steps<'a, T> {
    pub(crate) transport: &'a T,
    pub(crate) replication: Option<ReplicatedWrites>,
    pub(crate) conditional_set: &'a ConditionalSet,
}

impl<T: Transport> Steps<'_, T> {
    pub(crate) async fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<(BeginOutcome, Option<Duration>), StoreError> {
        let exchange = Exchange::new(
            protocol::begin(key, fingerprint, token, lease),
            self.replication,
        );
        let mut reply = match self.transport.send(&exchange).await {
            // A full Redis (`noeviction`) refuses `SET` even where `NX` would write nothing:
            // read the record instead, so a key in flight still answers 409 and a completed
            // one replays; only a new key is refused (503 when failing closed).
            Err(error) if protocol::is_out_of_memory(&error) => {
                let read = self.read(key).await?;
                if read.value == redis::Value::Nil {
                    return Err(refused_as_full(error));
                }
                read
            }
            reply => reply?,
        };
        // The reply of each claim is read, the last one's too: a claim that took the key
        // holds it, whatever number it was.
        for claims in 0..=MAX_CLAIMS {
            // With replicated writes, a record found is kept for a moment: if it is this
            // token's own in-flight record, the request was sent twice (resent after a
            // reconnection), and the lock is the earlier send's write.
            let found = match (&reply.value, self.replication) {
                (redis::Value::BulkString(record), Some(_)) => Some(record.clone()),
                _ => None,
            };
            let marker = match protocol::begin_outcome(reply.value, fingerprint, token)? {
                Begun::Decided(BeginOutcome::Acquired, remaining) => {
                    // Only a lock this request holds must be on the replicas; a record found
                    // is answered as it is.
                    let outcome = match found {
                        Some(own) => self.own_lock_replicated(key, &own).await?,
                        None => {
                            reply.replication.check("begin")?;
                            BeginOutcome::Acquired
                        }
                    };
                    return Ok((outcome, remaining));
                }
                Begun::Decided(outcome, remaining) => return Ok((outcome, remaining)),
                Begun::OtherMarker(marker) if claims < MAX_CLAIMS => marker,
                Begun::OtherMarker(_) => break,
            };
            let claim = protocol::claim(key, marker, fingerprint, token, lease);
            reply = match self
                .transport
                .send(&Exchange::new(claim, self.replication))
                .await
            {
                // A full Redis refuses the claim before it runs (it may grow memory), as it
                // refuses the `SET` of a new key. But a claim sent again after a
                // reconnection may have run the first time, its reply lost: read the key,
                // and go on with this token's own lock if that is what it holds (else the
                // key stayed locked for a lease, never abandoned: a refusal wrote nothing).
                Err(error) if protocol::is_out_of_memory(&error) => {
                    let read = self.read(key).await?;
                    if !protocol::is_lock_of(&read.value, token) {
                        return Err(refused_as_full(error));
                    }
                    read
                }
                reply => reply?,
            };
        }
        // Tokens abandoned one after another kept replacing the marker: the key is busy.
        Ok((BeginOutcome::InFlight, None))
    }

    /// The record at `key` as it is (`GET`), written nothing.
    async fn read(&self, key: &StorageKey) -> Result<Reply, StoreError> {
        self.transport
            .send(&Exchange::plain(protocol::read(key)))
            .await
    }

    /// After a `begin` (or a claim) that found this token's own in-flight record, `own`,
    /// under replicated writes: whether that lock is on the replicas. The earlier send wrote
    /// it on whichever connection it had, and a `WAIT` on this one, which wrote nothing,
    /// counts nothing (Redis ≥ 7.2, Valkey) and passes at once; so the record is written
    /// over itself for the `WAIT` behind it to count (as
    /// [`after_unwritten_commit`](Self::after_unwritten_commit) does for a commit).
    /// `InFlight` when the record changed meanwhile.
    async fn own_lock_replicated(
        &self,
        key: &StorageKey,
        own: &[u8],
    ) -> Result<BeginOutcome, StoreError> {
        Ok(if self.rewritten_for_replicas(key, own, "begin").await? {
            BeginOutcome::Acquired
        } else {
            BeginOutcome::InFlight
        })
    }

    /// Writes `record` over itself (`protocol::rewrite`: `SET … IFEQ` where commits go by it,
    /// on Valkey, else the library's function), waiting for the replicas behind it, so that a
    /// `WAIT` on this connection counts a record another connection wrote, or that the step
    /// before found and left as it was: `false` when the record is no longer exactly
    /// `record` (nothing written).
    async fn rewritten_for_replicas(
        &self,
        key: &StorageKey,
        record: &[u8],
        step: &'static str,
    ) -> Result<bool, StoreError> {
        let (by, rewritten) = self
            .send_conditional(|by| protocol::rewrite(by, key, record))
            .await?;
        if !protocol::rewritten(by, rewritten.value)? {
            return Ok(false);
        }
        rewritten.replication.check(step)?;
        Ok(true)
    }

    /// Sends the request `build` makes for the way the store sends a compare-and-write
    /// (`SET … IFEQ` on Valkey, until it refuses it as a syntax error, writing nothing; the
    /// library's function elsewhere and from then on, see [`ConditionalSet`]), waiting for
    /// the replicas behind it; with the way its reply is to be read. A `SET … IFEQ` that its
    /// connection would not send (the server there is not Valkey: replaced underneath since
    /// the request was built) goes by function at once.
    async fn send_conditional(
        &self,
        build: impl Fn(CommitBy) -> protocol::Request,
    ) -> Result<(CommitBy, Reply), StoreError> {
        let mut by = self.conditional_set.commit_by();
        loop {
            match self
                .transport
                .send(&Exchange::new(build(by), self.replication))
                .await
            {
                // Its connection reached a server not trusted with it (another than the one
                // the store last learnt of: replaced underneath), which was sent nothing.
                Err(error)
                    if by == CommitBy::ConditionalSet
                        && protocol::was_not_trusted_with_conditional_set(&error) =>
                {
                    by = CommitBy::Function;
                }
                Err(error)
                    if by == CommitBy::ConditionalSet && protocol::is_syntax_error(&error) =>
                {
                    self.conditional_set.refuse();
                    by = CommitBy::Function;
                }
                reply => return Ok((by, reply?)),
            }
        }
    }

    pub(crate) async fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let renewed = self
            .transport
            .send(&Exchange::plain(protocol::renew(key, token, lease)))
            .await;
        held_unless_not_a_record(renewed)
    }

    /// Commits `response`; `false` where the token's record is not there, a key of another
    /// type included (see [`protocol::is_not_a_record`]).
    pub(crate) async fn commit(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let committed = async {
            let (by, reply) = self
                .send_conditional(|by| protocol::commit(by, key, fingerprint, token, response, ttl))
                .await?;
            match protocol::committed(by, reply.value)? {
                Committed::Written => {
                    reply.replication.check("commit")?;
                    Ok(true)
                }
                // Sent again (its reply was lost, or its replicas fell short): nothing to
                // wait for unless writes are replicated, where the record is read and
                // rewritten.
                Committed::CompletedEarlier if self.replication.is_none() => Ok(true),
                Committed::CompletedEarlier | Committed::Unwritten => {
                    self.after_unwritten_commit(key, fingerprint, token, response, ttl)
                        .await
                }
            }
        };
        match committed.await {
            Err(error) if protocol::is_not_a_record(&error) => Ok(false),
            committed => committed,
        }
    }

    /// After a commit that wrote nothing, what the key holds (see [`Unwritten`]): the record
    /// an earlier send of this commit completed (a retry after a lost reply, or after its
    /// replicas fell short), nothing that anyone took since the in-flight record was lost,
    /// where the completed record is written anew, or another request's record. A rare
    /// round trip or two: only when the lease was lost or the commit was sent twice.
    ///
    /// With replicated writes, an earlier send went out on whichever connection it had, and
    /// a `WAIT` counts the writes of its own connection (Redis ≥ 7.2, Valkey): on this one,
    /// which wrote nothing, it would count nothing and pass at once. So the record is written over
    /// itself, a write that changes nothing, for the `WAIT` behind it to count.
    async fn after_unwritten_commit(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let reply = self.read(key).await?;
        let completed = match protocol::unwritten(reply.value, fingerprint, token)? {
            Unwritten::Taken => return Ok(false),
            Unwritten::StillHeld => return Err(answered_elsewhere()),
            Unwritten::HeldOverMarker => {
                return self
                    .commit_over_marker(key, fingerprint, token, response, ttl)
                    .await;
            }
            Unwritten::CompletedEarlier(completed) => completed,
            Unwritten::Free(mut marker) => {
                let mut claims = 1;
                loop {
                    let recreate =
                        protocol::recreate(key, marker, fingerprint, token, response, ttl);
                    let reply = self
                        .transport
                        .send(&Exchange::new(recreate, self.replication))
                        .await?;
                    match protocol::recreated(reply.value, fingerprint, token)? {
                        None => {
                            lost_record::report_written_anew();
                            reply.replication.check("commit")?;
                            return Ok(true);
                        }
                        // Sent again after its connection died: the first send wrote it.
                        Some(Unwritten::CompletedEarlier(completed)) => break completed,
                        // Yet another token was abandoned on the key meanwhile: the key is
                        // still free, written over that marker (as `begin` claims a key).
                        Some(Unwritten::Free(found)) if claims < MAX_CLAIMS => {
                            marker = found;
                            claims += 1;
                        }
                        Some(Unwritten::StillHeld | Unwritten::HeldOverMarker) => {
                            return Err(answered_elsewhere());
                        }
                        // Another request took the key meanwhile.
                        Some(_) => return Ok(false),
                    }
                }
            }
        };
        if self.replication.is_none() {
            return Ok(true);
        }
        if self
            .rewritten_for_replicas(key, &completed, "commit")
            .await?
        {
            return Ok(true);
        }
        // The record read a moment before is not there to write over itself: another node
        // answered the rewrite (a failover between the two, where the new primary may still
        // hold this request's in-flight record), as a read after a commit may be answered
        // by another node (`StillHeld`). An error, so that the commit is sent again and reads
        // what it finds then, its lease renewed meanwhile; taken for "not held", the commit
        // was given up and a retry after the lease ran the handler again.
        Err(answered_elsewhere())
    }

    /// Completes this token's in-flight record that took the key over a marker (see
    /// [`Unwritten::HeldOverMarker`]), by the library's `commit`, which keeps the record for
    /// the marker's time. A rare round trip more, after a commit by `SET … IFEQ`: only for a
    /// key taken over a marker. Where even that writes nothing (see [`ChangedSinceRead`]):
    /// an error, so that the commit is sent again, which reads the record it finds (and,
    /// under replicated writes, waits for its replicas).
    async fn commit_over_marker(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let by = CommitBy::Function;
        let commit = protocol::commit(by, key, fingerprint, token, response, ttl);
        let reply = self
            .transport
            .send(&Exchange::new(commit, self.replication))
            .await?;
        match protocol::committed(by, reply.value)? {
            Committed::Written => {
                reply.replication.check("commit")?;
                Ok(true)
            }
            Committed::CompletedEarlier if self.replication.is_none() => Ok(true),
            Committed::CompletedEarlier | Committed::Unwritten => {
                Err(StoreError::Unavailable(Box::new(ChangedSinceRead)))
            }
        }
    }

    pub(crate) async fn release(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
    ) -> Result<bool, StoreError> {
        let released = self
            .transport
            .send(&Exchange::plain(protocol::release(key, token)))
            .await;
        held_unless_not_a_record(released)
    }

    pub(crate) async fn abandon(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        remember_for: Duration,
    ) -> Result<bool, StoreError> {
        let abandoned = self
            .transport
            .send(&Exchange::plain(protocol::abandon(
                key,
                token,
                remember_for,
            )))
            .await;
        held_unless_not_a_record(abandoned)
    }

    pub(crate) async fn inspect(
        &self,
        key: &StorageKey,
        with_body: bool,
    ) -> Result<Option<RecordSnapshot>, StoreError> {
        let reply = self
            .transport
            .send(&Exchange::plain(inspection::inspect(key)))
            .await?;
        inspection::snapshot(reply.value, with_body)
    }

    pub(crate) async fn delete(
        &self,
        key: &StorageKey,
        force: bool,
    ) -> Result<Deletion, StoreError> {
        let reply = self
            .transport
            .send(&Exchange::plain(inspection::delete(key, force)))
            .await?;
        inspection::deletion(reply.value)
    }
}

/// A commit that wrote nothing, after which the key still holds this token's in-flight
/// record, exactly what the commit compared with: two nodes answered for the key (on a
/// cluster, a primary that woke after its replica was promoted runs the commands queued for
/// it before it learns so, then answers `MOVED`). Neither lost nor taken: the commit is
/// retried (in the background, the lease renewed meanwhile), where it lands on the node that
/// serves the key.
#[derive(Debug, thiserror::Error)]
#[error("commit answered by a node that no longer serves the key; the record is still held")]
struct AnsweredElsewhere;

/// A commit by the library's function over a record read a moment before as this token's,
/// taken over a marker, that wrote nothing: the record changed in between (its lease ran
/// out and another request took the key, it expired, or an earlier send of this commit
/// completed it and replicated writes must see it rewritten), or another node answered.
/// The commit is sent again, which reads the key anew and acts on what it finds.
#[derive(Debug, thiserror::Error)]
#[error(
    "commit over a marker wrote nothing: the record changed since it was read; sending it again"
)]
struct ChangedSinceRead;

fn answered_elsewhere() -> StoreError {
    StoreError::Unavailable(Box::new(AnsweredElsewhere))
}

/// A `begin` step a full Redis refused before it wrote anything (out of memory): the key is
/// refused ([`StoreError::Refused`], 503 when failing closed) and, as this token holds
/// nothing, nothing is left to abandon.
fn refused_as_full(error: StoreError) -> StoreError {
    match error {
        StoreError::Unavailable(source) => StoreError::Refused(source),
        other => other,
    }
}

/// Decodes the reply to `renew`, `release` or `abandon`: a key of another type is one the
/// token does not hold (see [`protocol::is_not_a_record`]), not an error to retry.
fn held_unless_not_a_record(sent: Result<Reply, StoreError>) -> Result<bool, StoreError> {
    match sent {
        Ok(reply) => protocol::held(reply.value),
        Err(error) if protocol::is_not_a_record(&error) => Ok(false),
        Err(error) => Err(error),
    }
}

/// Implements [`IdempotencyStore`](crate::IdempotencyStore) for a store with a
/// `fn steps(&self) -> Steps<'_, impl Transport>`.
macro_rules! idempotency_store_on_steps {
    ($store:ty) => {
        impl $crate::store::IdempotencyStore for $store {
            async fn begin(
                &self,
                key: &$crate::scope::StorageKey,
                fingerprint: &$crate::fingerprint::Fingerprint,
                token: &$crate::store::LeaseToken,
                lease: ::std::time::Duration,
            ) -> Result<$crate::store::BeginOutcome, $crate::store::StoreError> {
                let (outcome, _) = self.steps().begin(key, fingerprint, token, lease).await?;
                Ok(outcome)
            }

            async fn begin_with_remaining_ttl(
                &self,
                key: &$crate::scope::StorageKey,
                fingerprint: &$crate::fingerprint::Fingerprint,
                token: &$crate::store::LeaseToken,
                lease: ::std::time::Duration,
            ) -> Result<
                ($crate::store::BeginOutcome, Option<::std::time::Duration>),
                $crate::store::StoreError,
            > {
                self.steps().begin(key, fingerprint, token, lease).await
            }

            async fn renew(
                &self,
                key: &$crate::scope::StorageKey,
                token: &$crate::store::LeaseToken,
                lease: ::std::time::Duration,
            ) -> Result<bool, $crate::store::StoreError> {
                self.steps().renew(key, token, lease).await
            }

            async fn commit(
                &self,
                key: &$crate::scope::StorageKey,
                fingerprint: &$crate::fingerprint::Fingerprint,
                token: &$crate::store::LeaseToken,
                response: &$crate::record::StoredResponse,
                ttl: ::std::time::Duration,
            ) -> Result<bool, $crate::store::StoreError> {
                self.steps()
                    .commit(key, fingerprint, token, response, ttl)
                    .await
            }

            async fn release(
                &self,
                key: &$crate::scope::StorageKey,
                token: &$crate::store::LeaseToken,
            ) -> Result<bool, $crate::store::StoreError> {
                self.steps().release(key, token).await
            }

            async fn abandon(
                &self,
                key: &$crate::scope::StorageKey,
                token: &$crate::store::LeaseToken,
                remember_for: ::std::time::Duration,
            ) -> Result<bool, $crate::store::StoreError> {
                self.steps().abandon(key, token, remember_for).await
            }

            async fn inspect(
                &self,
                key: &$crate::scope::StorageKey,
                with_body: bool,
            ) -> Result<Option<$crate::store::RecordSnapshot>, $crate::store::StoreError> {
                self.steps().inspect(key, with_body).await
            }

            async fn delete(
                &self,
                key: &$crate::scope::StorageKey,
                force: bool,
            ) -> Result<$crate::store::Deletion, $crate::store::StoreError> {
                self.steps().delete(key, force).await
            }
        }
    };
}

pub(crate) use idempotency_store_on_steps;

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use actix_web::http::StatusCode;
    use actix_web::web::Bytes;

    use super::*;
    use crate::key::IdempotencyKey;
    use crate::store::redis::exchange::Acknowledgement;
    use crate::store::redis::record;
    use crate::store::redis::server_kind::ServerKind;

    /// A transport that answers each request with the next of `replies`, whatever it is.
    struct Scripted {
        replies: RefCell<Vec<redis::Value>>,
    }

    impl Transport for Scripted {
        async fn send(&self, _exchange: &Exchange) -> Result<Reply, StoreError> {
            let value = self.replies.borrow_mut().remove(0);
            Ok(Reply {
                value,
                replication: Acknowledgement::none(),
            })
        }
    }

    /// A transport that answers each request with the next of `answers`, and notes for
    /// each whether it called a function.
    struct ScriptedResults {
        answers: RefCell<Vec<Result<redis::Value, StoreError>>>,
        called_function: RefCell<Vec<bool>>,
    }

    impl Transport for ScriptedResults {
        async fn send(&self, exchange: &Exchange) -> Result<Reply, StoreError> {
            self.called_function
                .borrow_mut()
                .push(exchange.calls_function());
            let value = self.answers.borrow_mut().remove(0)?;
            Ok(Reply {
                value,
                replication: Acknowledgement::none(),
            })
        }
    }

    /// Commits `commit` by `SET … IFEQ` first (the store last learnt of Valkey), to a
    /// transport that answers `answers` in turn: the outcome, whether each request sent
    /// called a function, and how the next commit would go.
    async fn conditional_commit(
        commit: &Commit,
        answers: Vec<Result<redis::Value, StoreError>>,
    ) -> (Result<bool, StoreError>, Vec<bool>, CommitBy) {
        let transport = ScriptedResults {
            answers: RefCell::new(answers),
            called_function: RefCell::new(Vec::new()),
        };
        let conditional_set = ConditionalSet::default();
        conditional_set.reconsider(ServerKind::Valkey);
        let steps = Steps {
            transport: &transport,
            replication: None,
            conditional_set: &conditional_set,
        };
        let committed = steps
            .commit(
                &commit.key,
                &commit.fingerprint,
                &commit.token,
                &commit.response,
                TTL,
            )
            .await;
        (
            committed,
            transport.called_function.into_inner(),
            conditional_set.commit_by(),
        )
    }

    /// A Valkey without `SET … IFEQ` (before 8.1) refuses it as a syntax error, writing
    /// nothing: the commit goes by function, and so do the next ones.
    #[actix_rt::test]
    async fn a_set_ifeq_refused_as_a_syntax_error_goes_by_function_from_then_on() {
        let syntax_error = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError),
            "An error was signalled by the server",
            "syntax error".to_owned(),
        ));
        let syntax_error: Result<redis::Value, StoreError> =
            Err(protocol::store_error(syntax_error));
        assert!(
            protocol::is_syntax_error(syntax_error.as_ref().expect_err("an error")),
            "the scripted refusal is what a server without IFEQ answers"
        );
        let (committed, called_function, next) =
            conditional_commit(&Commit::new(), vec![syntax_error, Ok(redis::Value::Int(1))]).await;
        assert!(matches!(committed, Ok(true)), "{committed:?}");
        assert_eq!(called_function, [false, true]);
        assert_eq!(next, CommitBy::Function);
    }

    /// A `SET … IFEQ` that its connection would not send (the server there is not Valkey:
    /// replaced underneath since the request was built) goes by function at once; the next
    /// commit goes as the last connection opened says.
    #[actix_rt::test]
    async fn a_set_ifeq_its_connection_would_not_send_goes_by_function() {
        let not_trusted =
            StoreError::Unavailable(Box::new(protocol::conditional_set_not_trusted()));
        let (committed, called_function, next) = conditional_commit(
            &Commit::new(),
            vec![Err(not_trusted), Ok(redis::Value::Int(1))],
        )
        .await;
        assert!(matches!(committed, Ok(true)), "{committed:?}");
        assert_eq!(called_function, [false, true]);
        assert_eq!(next, CommitBy::ConditionalSet);
    }

    /// What a full Redis (`maxmemory`, `noeviction`) answers a write that may grow memory.
    fn out_of_memory() -> StoreError {
        let reply = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n";
        let error = redis::parse_redis_value(reply)
            .and_then(redis::Value::extract_error)
            .expect_err("an error reply");
        protocol::store_error(error)
    }

    /// Begins `commit`'s key for its token on a transport that answers `answers` in turn.
    async fn begun(
        commit: &Commit,
        answers: Vec<Result<redis::Value, StoreError>>,
    ) -> Result<BeginOutcome, StoreError> {
        let transport = ScriptedResults {
            answers: RefCell::new(answers),
            called_function: RefCell::new(Vec::new()),
        };
        let steps = Steps {
            transport: &transport,
            replication: None,
            conditional_set: &ConditionalSet::default(),
        };
        let (outcome, _) = steps
            .begin(&commit.key, &commit.fingerprint, &commit.token, TTL)
            .await?;
        Ok(outcome)
    }

    /// A claim over another token's marker ran, its reply was lost with its connection,
    /// and the claim sent again on the next connection was refused by a Redis full by
    /// then: the key holds this token's lock, so the request goes on under it. Taken for
    /// "wrote nothing", the lock stayed a whole lease, never abandoned, and every retry
    /// meanwhile answered 409 (helper review).
    #[actix_rt::test]
    async fn a_claim_resent_and_refused_as_full_goes_on_under_the_lock_its_first_send_took() {
        let commit = Commit::new();
        let marker = record::abandoned(&LeaseToken::generate());
        let mut claimed = commit.own_lock();
        claimed.extend_from_slice(&marker);
        let answers = vec![
            Ok(redis::Value::BulkString(marker)),
            Err(out_of_memory()),
            Ok(redis::Value::BulkString(claimed)),
        ];
        let outcome = begun(&commit, answers).await;
        assert!(matches!(outcome, Ok(BeginOutcome::Acquired)), "{outcome:?}");
    }

    /// A claim refused by a full Redis where the key still holds the marker it was sent
    /// over: refused (503 when failing closed), nothing written, nothing to abandon.
    #[actix_rt::test]
    async fn a_claim_refused_as_full_that_took_nothing_is_refused() {
        let commit = Commit::new();
        let marker = record::abandoned(&LeaseToken::generate());
        let answers = vec![
            Ok(redis::Value::BulkString(marker.clone())),
            Err(out_of_memory()),
            Ok(redis::Value::BulkString(marker)),
        ];
        let outcome = begun(&commit, answers).await;
        assert!(
            matches!(outcome, Err(StoreError::Refused(_))),
            "{outcome:?}"
        );
    }

    const TTL: Duration = Duration::from_secs(60);

    /// One request's commit: its key, fingerprint, token and response.
    struct Commit {
        key: StorageKey,
        fingerprint: Fingerprint,
        token: LeaseToken,
        response: StoredResponse,
    }

    impl Commit {
        fn new() -> Self {
            Self {
                key: StorageKey::new(
                    "idem:",
                    b"",
                    &IdempotencyKey::parse(b"order-1").expect("a valid key"),
                ),
                fingerprint: Fingerprint::from_bytes([7; 32]),
                token: LeaseToken::generate(),
                response: StoredResponse {
                    status: StatusCode::CREATED,
                    headers: Vec::new(),
                    body: Some(Bytes::from_static(b"{}")),
                },
            }
        }

        /// The in-flight record this request's `begin` wrote.
        fn own_lock(&self) -> Vec<u8> {
            record::in_flight(&self.fingerprint, &self.token)
        }

        /// Sends the commit (by `SET … IFEQ`, the first way tried on Valkey), under `replication`, to a
        /// store that answers with `replies` in turn.
        async fn sent_to(
            &self,
            replication: Option<ReplicatedWrites>,
            replies: Vec<redis::Value>,
        ) -> Result<bool, StoreError> {
            let transport = Scripted {
                replies: RefCell::new(replies),
            };
            let conditional_set = ConditionalSet::default();
            conditional_set.reconsider(ServerKind::Valkey);
            let steps = Steps {
                transport: &transport,
                replication,
                conditional_set: &conditional_set,
            };
            let (key, token) = (&self.key, &self.token);
            steps
                .commit(key, &self.fingerprint, token, &self.response, TTL)
                .await
        }
    }

    /// A Redis Cluster primary stopped (SIGSTOP) while a commit waited for it, its replica
    /// promoted meanwhile: on waking it ran the commits queued for it before learning it
    /// was demoted, so a resent `SET … IFEQ` found the record its first send completed
    /// there and wrote nothing, and the read that followed went to the new primary, which
    /// still holds the request's in-flight record. Taken for "not held", the commit was
    /// given up, its lease no longer renewed, and once that lease ran out a retry ran the
    /// handler again. It is an error now, so the commit is retried (lease renewed).
    #[actix_rt::test]
    async fn an_unwritten_commit_that_finds_its_own_lock_is_retried_not_given_up() {
        let commit = Commit::new();
        // The commit wrote nothing; the read finds this token's own in-flight record.
        let replies = vec![
            redis::Value::Nil,
            redis::Value::BulkString(commit.own_lock()),
        ];
        let committed = commit.sent_to(None, replies).await;
        assert!(
            matches!(committed, Err(StoreError::Unavailable(_))),
            "a commit whose record is still held must be retried, not reported lost: {committed:?}"
        );
    }

    /// With replicated writes, a commit that wrote nothing, whose read found the record its
    /// earlier send completed, writes that record over itself for the `WAIT` behind it to
    /// count; where that rewrite writes nothing (another node answered it: a failover
    /// between the read and the rewrite, the new primary still holding the in-flight
    /// record), the commit is retried, not reported lost (helper review).
    #[actix_rt::test]
    async fn a_replicated_commit_whose_rewrite_finds_another_record_is_retried() {
        let commit = Commit::new();
        let completed = record::completed(&commit.own_lock(), &commit.response, TTL);
        // The commit wrote nothing; the read finds the record this token completed; the
        // rewrite of it writes nothing.
        let replies = vec![
            redis::Value::Nil,
            redis::Value::BulkString(completed),
            redis::Value::Nil,
        ];
        let replication = ReplicatedWrites::new(1, Duration::from_millis(200));
        let committed = commit.sent_to(Some(replication), replies).await;
        assert!(
            matches!(committed, Err(StoreError::Unavailable(_))),
            "a commit whose rewrite found another record must be retried: {committed:?}"
        );
    }
}
