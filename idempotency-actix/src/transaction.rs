//! Transactional routes: [`IdempotentTransaction`], the database transaction a handler
//! writes through, and how the engine claims, commits or rolls it back.
//!
//! The record of a transactional route is claimed inside a transaction on a connection of
//! its own (`BEGIN` pipelined with the claim: one round trip). The claim holds a
//! transaction-scoped advisory lock on the key, so duplicates never wait on the uncommitted
//! row: they read the committed state and answer 409 (or replay) at once. The handler
//! writes through the same transaction; then the stored response is written and the
//! transaction committed, in one more round trip, before the response leaves. An error
//! response, an error or a panic rolls everything back, so nothing is stored and the key is
//! free. A crash at any point leaves both or neither: the database rolls back the
//! transaction of a connection that died.

use std::cell::{Cell, RefCell};
use std::future::{Ready, ready};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::time::{Duration, Instant};

use actix_web::body::{BodySize, BodyStream, BoxBody, MessageBody, SizedStream};
use actix_web::dev::{Payload, ResponseHead, Service, ServiceRequest, ServiceResponse};
use actix_web::web::{Bytes, BytesMut};
use actix_web::{FromRequest, HttpMessage, HttpRequest};
use futures_util::{FutureExt, StreamExt};

use crate::body::IdempotentBody;
use crate::capture::framed_size;
use crate::engine::{
    Engine, Handled, HeldLock, Response, claim_with_lock, refuse, wait_for_next_begin,
    with_handler_body,
};
use crate::error::IdempotencyError;
use crate::fingerprint::Fingerprint;
use crate::instrument::StoreOperation;
use crate::policy::Policy;
use crate::scope::StorageKey;
use crate::store::postgres::{OpenTransaction, PostgresStore};
use crate::store::{BeginOutcome, LeaseToken, StoreError};

/// The database transaction of a transactional route's request: the handler's writes go
/// through it and commit together with the stored response, or not at all.
///
/// It dereferences to a [`tokio_postgres::Client`] inside `BEGIN`: run statements with
/// `execute`, `query`, `query_one`, … as usual. Do not `COMMIT` or `ROLLBACK` it yourself,
/// and do not keep it beyond the handler: the middleware commits it after the handler
/// returns a response it stores (status < 400 by default), and rolls it back when the
/// handler answers an error status, fails or panics, so a retry runs the handler again.
///
/// Only transactional routes have one: `#[idempotent(transactional)]`
/// or [`IdempotentRoute::with_policy`](crate::IdempotentRoute::with_policy) of an
/// [`IdempotencyPolicy::transactional`](crate::IdempotencyPolicy::transactional) policy, under
/// [`Idempotency::postgres`](crate::Idempotency::postgres). `#[idempotent]` without
/// `transactional` on a handler that takes it is a compile error; anywhere else the
/// extractor fails with a 500 and an error in the log that names the fix. A request without
/// a key to a transactional route also gets a transaction (committed or rolled back the same
/// way, and opened with the same settings as a claim's, below), without any record.
///
/// The claim lasts as long as the database session. It turns off the server's
/// `idle_in_transaction_session_timeout` and `transaction_timeout` for its transaction, so
/// the handler may be away from the database for as long as it runs (but not with a reply
/// half read: a large streamed result, `query_raw`, left unread for about 5/6 of the lease
/// ends the session as a client cut off would); anything else that ends the session while
/// the handler runs (a restart, a failover, `pg_terminate_backend`) rolls
/// back the claim together with the handler's writes: the request fails, and a retry runs
/// the handler again. What the handler did outside the transaction (a call to a payment
/// provider, an email) is not rolled back: such side effects belong on plain routes, whose
/// record is committed before the handler runs.
///
/// Change settings for the transaction only, with `SET LOCAL` (or
/// `set_config(name, value, true)`). The transaction runs on a pooled connection, and what
/// the handler changes for the session (`SET` without `LOCAL`, `SET ROLE`,
/// `set_config(name, value, false)`) stays on it once the transaction commits: it applies to
/// later requests' transactions and to the store's own statements on that connection (a role
/// that may not write the record table fails them with a 503). A `SET LOCAL` lasts until the
/// commit, so it also applies to the completion of the record, which runs in this transaction
/// after the handler returns: a role set with `SET LOCAL ROLE` must be able to update the
/// table. The middleware does not reset the connection (`RESET ALL` would also undo settings
/// an app gives its pooled connections on purpose).
///
/// If the commit fails or goes unanswered, the client gets a 503 instead of the handler's
/// response ([`IdempotencyError::CommitUnconfirmed`]): with a key, a retry is replayed if the
/// writes committed and runs again if not.
///
/// # Examples
///
/// ```no_run
/// use actix_web::{App, HttpResponse, HttpServer, post, web};
/// use idempotency_actix::{Idempotency, IdempotentTransaction, PostgresStore, idempotent};
///
/// #[idempotent(transactional)]
/// #[post("/transfers")]
/// async fn transfer(
///     tx: IdempotentTransaction,
///     amount: web::Json<i64>,
/// ) -> Result<HttpResponse, actix_web::Error> {
///     let row = tx
///         .query_one(
///             "INSERT INTO transfers (amount) VALUES ($1) RETURNING id",
///             &[&*amount],
///         )
///         .await
///         .map_err(actix_web::error::ErrorInternalServerError)?;
///     let id: i64 = row.get(0);
///     Ok(HttpResponse::Created().json(serde_json::json!({ "id": id })))
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::new(PostgresStore::pool("postgres://postgres@127.0.0.1/app")?);
/// store.migrate().await?;
/// HttpServer::new(move || {
///     App::new()
///         .wrap(Idempotency::postgres(store.clone()))
///         .service(transfer)
/// })
/// .bind("127.0.0.1:8080")?
/// .run()
/// .await?;
/// # Ok(())
/// # }
/// ```
pub struct IdempotentTransaction {
    transaction: Option<OpenTransaction>,
    slot: Rc<TransactionSlot>,
}

impl std::fmt::Debug for IdempotentTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTransaction")
            .finish_non_exhaustive()
    }
}

impl std::ops::Deref for IdempotentTransaction {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &Self::Target {
        // Taken out only in `drop`.
        self.transaction
            .as_ref()
            .expect("the extractor holds its transaction until it is dropped")
            .client()
    }
}

impl Drop for IdempotentTransaction {
    fn drop(&mut self) {
        // Back to the request, for the middleware to commit or roll back.
        if let Some(transaction) = self.transaction.take() {
            self.slot.0.replace(Some(transaction));
        }
    }
}

/// What the fix is, in the log line of a misused extractor.
const NOT_TRANSACTIONAL: &str = "IdempotentTransaction is only available on transactional \
     routes: put #[idempotent(transactional)] above the route attribute (or wrap the resource \
     in IdempotentRoute::with_policy(IdempotencyPolicy::default().transactional())), with .wrap(Idempotency::postgres(store)) on \
     the App";

impl FromRequest for IdempotentTransaction {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, Self::Error>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let slot = req.extensions().get::<Rc<TransactionSlot>>().cloned();
        let Some(slot) = slot else {
            tracing::error!(path = req.path(), "{NOT_TRANSACTIONAL}");
            return ready(Err(IdempotencyError::NotConfigured.into()));
        };
        let transaction = slot.0.borrow_mut().take();
        match transaction {
            Some(transaction) => ready(Ok(Self {
                transaction: Some(transaction),
                slot,
            })),
            None => {
                tracing::error!(
                    path = req.path(),
                    "IdempotentTransaction is taken twice in one request; take it once"
                );
                ready(Err(IdempotencyError::NotConfigured.into()))
            }
        }
    }
}

/// Request extension: where the transaction waits for the extractor, and where it comes
/// back when the extractor is dropped.
pub(crate) struct TransactionSlot(RefCell<Option<OpenTransaction>>);

impl TransactionSlot {
    /// Hands `transaction` to the handler of `req`.
    fn offer(req: &ServiceRequest, transaction: OpenTransaction) -> Rc<Self> {
        let slot = Rc::new(Self(RefCell::new(Some(transaction))));
        req.extensions_mut().insert(Rc::clone(&slot));
        slot
    }

    /// The transaction once the handler is done with it; `None` if the handler kept it (moved
    /// it to a task that still runs).
    fn take_back(&self) -> Option<OpenTransaction> {
        let transaction = self.0.borrow_mut().take();
        if transaction.is_none() {
            tracing::error!(
                "idempotency: the handler kept its IdempotentTransaction beyond the request; \
                 it is rolled back when dropped"
            );
        }
        transaction
    }
}

impl Engine {
    /// The PostgreSQL store, which alone runs transactional routes.
    fn postgres(&self) -> Result<&PostgresStore, StoreError> {
        self.store
            .as_any()
            .downcast_ref::<PostgresStore>()
            .ok_or_else(|| {
                StoreError::Protocol(
                    "a transactional route needs the PostgreSQL store: wrap the App in \
                     Idempotency::postgres(store)"
                        .to_owned(),
                )
            })
    }

    /// Claims the record inside a transaction; repeated while the key is in flight and the
    /// policy allows waiting. The transaction comes back when the claim is acquired.
    pub(crate) async fn claim_transaction_or_wait(
        &self,
        storage_key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        policy: &Policy,
        armed: &Cell<bool>,
    ) -> (Result<BeginOutcome, StoreError>, Option<OpenTransaction>) {
        let store = match self.postgres() {
            Ok(store) => store,
            Err(error) => return (Err(error), None),
        };
        let deadline = policy
            .wait_for_completion
            .map(|bound| Instant::now() + bound);
        let mut pause = Duration::from_millis(20);
        let mut waited = false;
        loop {
            let claim = store.claim_in_transaction(storage_key, fingerprint, token, policy.lease);
            let claimed = self.bounded(StoreOperation::Begin, claim).await;
            let wait = match &claimed {
                Ok((BeginOutcome::InFlight, _)) => wait_for_next_begin(deadline, pause),
                _ => None,
            };
            match (claimed, wait) {
                (Ok((BeginOutcome::InFlight, _)), Some(wait)) => {
                    // No claim of the token is outstanding while it waits (see `begin_or_wait`).
                    armed.set(false);
                    actix_rt::time::sleep(wait).await;
                    armed.set(true);
                    waited = true;
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
                (Err(error), _) if waited => {
                    let answer = self.failed_while_waiting(error, storage_key, token, policy);
                    return (answer, None);
                }
                (Ok((outcome, transaction)), _) => return (Ok(outcome), transaction),
                (Err(error), _) => return (Err(error), None),
            }
        }
    }

    /// Runs the handler with `transaction`, then completes the record and commits before the
    /// response leaves; rolls back on an error response, an error or a panic. No lease is
    /// renewed: the row is invisible until it commits, and the advisory lock lasts as long
    /// as the transaction (a crash ends both).
    pub(crate) async fn run_and_commit_transaction<S, B>(
        self: &Rc<Self>,
        policy: Policy,
        lock: Rc<HeldLock>,
        transaction: OpenTransaction,
        req: ServiceRequest,
        service: Rc<S>,
    ) -> Result<Response<B>, actix_web::Error>
    where
        S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
            + 'static,
        B: MessageBody + 'static,
    {
        claim_with_lock(&req, self, &lock);
        let slot = TransactionSlot::offer(&req, transaction);
        let outcome = self.run_and_capture(policy, &lock, req, service).await;
        let transaction = slot.take_back();
        let key = lock.storage_key.as_str();
        let (response, stored, ttl) = match outcome {
            Handled::Stored {
                response,
                stored,
                ttl,
            } => (response, stored, ttl),
            Handled::Streamed {
                response,
                body,
                mut stored,
                ttl,
                limit,
            } => match AssertUnwindSafe(read_before_commit(
                body,
                response.response().head(),
                limit,
                lock.lease.get(),
            ))
            .catch_unwind()
            .await
            {
                Ok((body, kept)) => {
                    stored.body = kept;
                    let response = response.map_body(|_, ()| IdempotentBody::produced(body));
                    (response, stored, ttl)
                }
                Err(_panic) => {
                    tracing::error!("idempotency: response body panicked; transaction rolled back");
                    self.roll_back(transaction).await;
                    return Err(IdempotencyError::HandlerPanicked.into());
                }
            },
            Handled::Panicked => {
                tracing::error!("idempotency: handler panicked; transaction rolled back");
                self.roll_back(transaction).await;
                return Err(IdempotencyError::HandlerPanicked.into());
            }
            // An error rolls the handler's writes back, stored or not: nothing it did stays,
            // so a retry runs it afresh.
            Handled::Failed(error) | Handled::FailedStored { error, .. } => {
                self.roll_back(transaction).await;
                return Err(error);
            }
            Handled::NotStored(response) => {
                tracing::debug!(key, "idempotency: error response; transaction rolled back");
                self.roll_back(transaction).await;
                return Ok(response);
            }
        };
        let Some(transaction) = transaction else {
            return Ok(refuse(
                response.into_parts().0,
                &IdempotencyError::NotConfigured,
            ));
        };
        let store = self
            .postgres()
            .map_err(actix_web::error::ErrorInternalServerError)?;
        let committed = self.bounded(
            StoreOperation::Commit,
            store.complete_and_commit(transaction, &lock.storage_key, &lock.token, &stored, ttl),
        );
        match committed.await {
            Ok(()) => {
                tracing::debug!(key, "idempotency: committed with the handler's transaction");
                Ok(response)
            }
            Err(error) => {
                // Not committed (or unknown, if the connection died during COMMIT): the
                // handler's writes are not known to have happened, so neither is its
                // response sent. A retry with the key replays or runs again, whichever is true.
                tracing::error!(%error, "idempotency: the transaction did not commit; answering 503");
                let retry_after = self.settings.retry_after;
                let error = IdempotencyError::CommitUnconfirmed {
                    source: error,
                    retry_after,
                    recorded: true,
                };
                Ok(refuse(response.into_parts().0, &error))
            }
        }
    }

    /// A transactional route's request without a record (no key, or the store failed and the
    /// app fails open): the handler still gets a transaction, committed when the policy
    /// would store its response, rolled back otherwise.
    pub(crate) async fn run_in_transaction_without_record<S, B>(
        &self,
        policy: &Policy,
        req: ServiceRequest,
        service: Rc<S>,
    ) -> Result<Response<B>, actix_web::Error>
    where
        S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
            + 'static,
        B: MessageBody + 'static,
    {
        let opened = match self.postgres() {
            Ok(store) => {
                self.bounded(StoreOperation::Begin, store.open_transaction(policy.lease))
                    .await
            }
            Err(error) => Err(error),
        };
        let transaction = match opened {
            Ok(transaction) => transaction,
            Err(error) => {
                // Rate-limited with the other store failures: in an outage every request
                // of the route comes here.
                if let Some(unlogged) = self.store_failures.admit(std::time::Instant::now()) {
                    tracing::error!(%error, unlogged, "idempotency: no transaction for a transactional route; answering 503");
                }
                let retry_after = self.settings.retry_after;
                let error = IdempotencyError::TransactionUnavailable {
                    source: error,
                    retry_after,
                };
                return Ok(refuse(req.into_parts().0, &error));
            }
        };
        let slot = TransactionSlot::offer(&req, transaction);
        // `call` inside the caught future, as in `run_and_capture`.
        let called = AssertUnwindSafe(async move { service.call(req).await })
            .catch_unwind()
            .await;
        let transaction = slot.take_back();
        let response = match called {
            Ok(Ok(response)) if policy.stores_status(response.status()) => response,
            Ok(Ok(response)) => {
                self.roll_back(transaction).await;
                return Ok(with_handler_body(response));
            }
            Ok(Err(error)) => {
                self.roll_back(transaction).await;
                return Err(error);
            }
            Err(_panic) => {
                self.roll_back(transaction).await;
                return Err(IdempotencyError::HandlerPanicked.into());
            }
        };
        let Some(transaction) = transaction else {
            return Ok(refuse(
                response.into_parts().0,
                &IdempotencyError::NotConfigured,
            ));
        };
        match self
            .bounded(StoreOperation::Commit, transaction.commit())
            .await
        {
            Ok(()) => Ok(with_handler_body(response)),
            Err(error) => {
                // No record commits with the handler's writes: whether they happened is
                // unknown, and a retry (with the same key or not) would run the handler again.
                tracing::error!(%error, "idempotency: the transaction did not commit; answering 503");
                let retry_after = self.settings.retry_after;
                let error = IdempotencyError::CommitUnconfirmed {
                    source: error,
                    retry_after,
                    recorded: false,
                };
                Ok(refuse(response.into_parts().0, &error))
            }
        }
    }

    /// Rolls `transaction` back before the response leaves, so a retry finds the key free.
    async fn roll_back(&self, transaction: Option<OpenTransaction>) {
        let Some(transaction) = transaction else {
            return;
        };
        if let Err(error) = self
            .bounded(StoreOperation::Release, transaction.roll_back())
            .await
        {
            // The connection is broken or slow; the server rolls back a transaction whose
            // connection dies, and a dropped one is rolled back in the background.
            tracing::warn!(%error, "idempotency: rollback failed");
        }
    }
}

/// Reads a streamed response body before the transaction commits, since nothing may leave
/// before then: all of it when it fits in `limit` (stored and sent), else what was read is
/// sent before the rest and the record completes without a body, as on other routes. A body
/// that fails midway is sent up to its failure and stored without a body; so is one that
/// produces nothing for `idle` (the lease): it would hold the transaction, its advisory lock
/// and its pooled connection for as long as it stalls, also once its client has left. A body
/// of known size is whole once that size is read: what it sends past it is neither sent nor
/// stored, as on other routes. Its size is the one its response `head` tells the client (see
/// [`framed_size`]).
async fn read_before_commit<B>(
    body: B,
    head: &ResponseHead,
    limit: usize,
    idle: Duration,
) -> (BoxBody, Option<Bytes>)
where
    B: MessageBody + 'static,
{
    // A body of known size that ends before that size is a response cut short: sent with
    // that size (the client sees the connection close before the end) and stored without
    // a body, as on other routes, never sent and stored as a complete shorter one.
    let declared = match framed_size(head, body.size()) {
        BodySize::Sized(size) => Some(size),
        BodySize::None | BodySize::Stream => None,
    };
    let mut body = Box::pin(body);
    let mut read = BytesMut::new();
    loop {
        let next = std::future::poll_fn(|cx| body.as_mut().poll_next(cx));
        let Ok(next) = actix_rt::time::timeout(idle, next).await else {
            tracing::warn!(
                "idempotency: a response body produced nothing for a lease before its transaction committed; its record completes without a body"
            );
            let stalled: Box<dyn std::error::Error> =
                "the response body produced nothing for a lease".into();
            let failed = futures_util::stream::iter([Ok(read.freeze()), Err(stalled)]);
            return (BoxBody::new(BodyStream::new(failed)), None);
        };
        match next {
            None => {
                let bytes = read.freeze();
                if let Some(size) = declared.filter(|&size| size > bytes.len() as u64) {
                    tracing::error!(
                        "idempotency: the response body ended before its declared size; its record completes without a body"
                    );
                    // Ended as the handler's body ended: Actix closes the connection then.
                    let cut = futures_util::stream::iter([Ok::<_, actix_web::Error>(bytes)]);
                    return (BoxBody::new(SizedStream::new(size, cut)), None);
                }
                return (BoxBody::new(bytes.clone()), Some(bytes));
            }
            Some(Ok(chunk)) => {
                read.extend_from_slice(&chunk);
                // Of a body of known size the client gets no more than that size (Actix
                // writes no more), as on other routes: once that much is read, it is the
                // whole body, sent and stored as such, if it fits in `limit` (checked
                // first: the chunk that reaches the size may also pass the limit).
                let whole = declared
                    .and_then(|size| usize::try_from(size).ok())
                    .filter(|&size| read.len() >= size);
                if whole.unwrap_or(read.len()) > limit {
                    let rest = futures_util::stream::poll_fn(move |cx| body.as_mut().poll_next(cx));
                    let all = futures_util::stream::once(ready(Ok(read.freeze()))).chain(rest);
                    return (BoxBody::new(BodyStream::new(all)), None);
                }
                if let Some(size) = whole {
                    read.truncate(size);
                    let bytes = read.freeze();
                    return (BoxBody::new(bytes.clone()), Some(bytes));
                }
            }
            Some(Err(error)) => {
                let failed = futures_util::stream::iter([Ok(read.freeze()), Err(error)]);
                return (BoxBody::new(BodyStream::new(failed)), None);
            }
        }
    }
}
