//! The engine: what happens to one protected request, whichever layer protects it.
//!
//! Extract the key, read the body (bounded), fingerprint, `begin` in the store, then either
//! answer from the record (replay, 409, 422) or run the handler under a renewed lease and
//! commit (or release) before the response leaves.

use std::cell::{Cell, RefCell};
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::task::Poll;
use std::time::{Duration, Instant};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::{Extensions, Payload, Service, ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderName};
use actix_web::http::{ConnectionType, StatusCode};
use actix_web::web::{Bytes, BytesMut};
use actix_web::{HttpMessage, HttpRequest, ResponseError};
use futures_util::StreamExt;
use futures_util::future::{Either, FutureExt, select};
use tracing::Instrument;

use crate::background_retry::{self, Retried, retry_in_background};
use crate::body::IdempotentBody;
use crate::capture::{CapturingBody, Commit, framed_size};
use crate::error::IdempotencyError;
use crate::fingerprint::{Fingerprint, FingerprintParts};
use crate::instrument::{
    self, LockHeld, Outcome, RequestRecord, RequestState, StoreOperation, StoreTimer,
};
use crate::key::IdempotencyKey;
use crate::log_interval::LogInterval;
use crate::lost_record::{self, NoticedBy};
use crate::policy::{IdempotencyPolicy, Policy};
use crate::record::StoredResponse;
use crate::rendered_error::RenderedError;
use crate::replay::{ReplayedHeaders, replay_response};
use crate::replay_cache::ReplayCache;
use crate::route_label::RouteLabels;
use crate::run_to_completion::{RunToCompletion, panic_message};
use crate::scope::{KeyScope, StorageKey};
use crate::store::{BeginOutcome, DynStore, LeaseToken, StoreError};
use crate::work_in_progress::{self, InProgress};
use crate::workload::{ClientAttached, WorkLimits, WorkSlot, Workload};

/// The transaction a transactional route's claim comes with.
#[cfg(feature = "postgres")]
type Transaction = crate::store::postgres::OpenTransaction;
/// Without the `postgres` feature there are none.
#[cfg(not(feature = "postgres"))]
enum Transaction {}

/// What to do when the store fails or times out.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{FailMode, Idempotency};
///
/// // Availability over safety: run the handler unprotected (and log a warning).
/// let idempotency = Idempotency::memory().on_store_error(FailMode::Open);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailMode {
    /// Refuse with 503 and `Retry-After`; the handler does not run (the default: a payment
    /// that cannot be protected is not taken).
    #[default]
    Closed,
    /// Run the handler without protection and log a warning; but a retry that waited for
    /// its key's run (`wait_for_completion`), and so knows that another request holds the
    /// key, gets 409 instead: it never runs the handler beside that one. After a `begin` that
    /// did not answer (it may have landed), the handler runs under that `begin`'s token: a
    /// duplicate meeting its record gets 409, and its response is committed right after it
    /// goes out, so where the store answers again a retry gets the replay. While the process
    /// drains (`Idempotency::drain`), a new key whose `begin` failed gets the 503
    /// `shutting-down` of any new key then: no handler runs unprotected in a process about to
    /// stop.
    Open,
}

/// Everything a protected request needs besides the route's policy.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) header: HeaderName,
    /// The most characters a key may have.
    pub(crate) max_key_length: usize,
    pub(crate) prefix: String,
    pub(crate) scope: KeyScope,
    pub(crate) fingerprint: FingerprintParts,
    pub(crate) replayed_headers: ReplayedHeaders,
    pub(crate) fail_mode: FailMode,
    pub(crate) store_timeout: Duration,
    pub(crate) retry_after: Duration,
    pub(crate) defaults: Policy,
    pub(crate) replay_cache: Option<ReplayCache>,
    pub(crate) limits: WorkLimits,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            header: HeaderName::from_static("idempotency-key"),
            max_key_length: crate::MAX_KEY_LENGTH,
            prefix: "idempotency:".to_owned(),
            scope: KeyScope::default(),
            fingerprint: FingerprintParts::default(),
            replayed_headers: ReplayedHeaders::default(),
            fail_mode: FailMode::Closed,
            store_timeout: Duration::from_secs(2),
            retry_after: Duration::from_secs(1),
            defaults: Policy::default(),
            replay_cache: None,
            limits: WorkLimits::default(),
        }
    }
}

/// A store and its settings, shared by every layer of one app instance (one worker).
pub(crate) struct Engine {
    pub(crate) store: Rc<dyn DynStore>,
    pub(crate) settings: Settings,
    /// This worker's keyed work, against `settings.limits`.
    pub(crate) workload: Rc<Workload>,
    /// The failed `begin`s' log lines, at most one per 10 s (every new key fails while the
    /// store is down or full of keys in flight); the metrics count each.
    pub(crate) store_failures: LogInterval,
}

/// Request extension: the engine of the nearest `Idempotency` above, for route layers, the
/// claim of the layer that took charge of the request, if one did, and the record of the
/// layer that processes it, if one does.
///
/// One extension for all three: each extension costs the request an allocation and an
/// insertion, and a request's extensions have room for three before they grow (a rehash,
/// about 550 instructions), one of them Actix's method guard's.
pub(crate) struct EngineHandle {
    pub(crate) engine: Rc<Engine>,
    pub(crate) claimed: Option<Claimed>,
    /// The claim was made by an `Idempotency` further out than `engine`'s, with its own
    /// store and settings: a route under `engine` must not take it as its own.
    pub(crate) claimed_further_out: bool,
    /// The request's record (its route label and outcome), for the layers that decide
    /// what becomes of it (`instrument::decided`).
    pub(crate) record: Option<Rc<RequestState>>,
}

impl EngineHandle {
    /// A handle for `engine` with no claim and no record yet.
    pub(crate) fn new(engine: &Rc<Engine>) -> Self {
        Self {
            engine: Rc::clone(engine),
            claimed: None,
            claimed_further_out: false,
            record: None,
        }
    }
}

/// The record's state of the request whose extensions these are, if a layer started one:
/// what `instrument` decides into and reads the route label of, without knowing how the
/// handle is laid out.
pub(crate) fn record_state(extensions: &Extensions) -> Option<&RequestState> {
    extensions
        .get::<EngineHandle>()
        .and_then(|handle| handle.record.as_deref())
}

/// A layer has taken charge of this request, so layers further in leave it alone (a request
/// is processed once even when the app and the route both protect it).
#[derive(Clone)]
pub(crate) struct Claimed {
    pub(crate) key_present: bool,
    /// The lock the claiming layer holds while the handler runs (failing open after a
    /// `begin` that did not answer, one it may hold); `None` when it runs the handler
    /// without one (no key, or fail-open after a store that refused the `begin`).
    pub(crate) lock: Option<Rc<HeldLock>>,
    /// The size of the body read, where the handler runs without a lock (failing open with
    /// no token to run under): a route layer further in refuses a body over its own smaller
    /// limit then too, as it does against a lock's.
    pub(crate) body_len: Option<usize>,
}

impl Claimed {
    /// The claim of a request that goes on without a key: no lock, no body read.
    fn without_key() -> Self {
        Self {
            key_present: false,
            lock: None,
            body_len: None,
        }
    }
}

/// The lock an outer layer holds for a request, shared with the route layer further in.
///
/// An app layer takes the request before routing, so it starts with the app's policy; the
/// route layer then applies its own: it refuses a body over its limit, shortens or extends
/// the lease at once, and leaves its policy for the commit (ttl, what is stored).
///
/// It carries the store that holds it: a route layer under nested `Idempotency` layers with
/// different stores renews the lock where it is held.
pub(crate) struct HeldLock {
    pub(crate) storage_key: StorageKey,
    /// The request's fingerprint, as `begin` wrote it into the record (the commit sends it).
    pub(crate) fingerprint: Fingerprint,
    pub(crate) token: LeaseToken,
    pub(crate) body_len: usize,
    /// The lease the lock is to hold; a route layer may change it (see `applied_lease`).
    pub(crate) lease: Cell<Duration>,
    /// When the store last set the record's expiry, by `begin` or a renewal...
    pub(crate) renewed_at: Cell<Instant>,
    /// ...and to how far: the record expires `applied_lease` after `renewed_at`. It differs
    /// from `lease` from the moment a route layer changes that until a renewal applies it.
    applied_lease: Cell<Duration>,
    /// The shortest lease `begin` or a renewal of this lock was sent with. A renewal given up
    /// (by the store timeout) may still land at any time, and set the record's expiry to
    /// the lease it was sent with from then: so the lock is renewed within a third of this
    /// lease too, not only of `applied_lease` (see [`HeldLock::renewal_due`]).
    shortest_lease_sent: Cell<Duration>,
    /// When the oldest renewal whose write may still answer another was sent: one on its
    /// way, or given up (by the store timeout or its caller) since a renewal answered with
    /// none on its way (see `HeldLock::renew_counted`).
    unresolved_since: Cell<Option<Instant>>,
    /// How many renewals of this lock are on their way.
    renewals_on_their_way: Cell<u32>,
    pub(crate) route_policy: RefCell<Option<IdempotencyPolicy>>,
    /// Whether the loss of this lock's record has been reported (once per request).
    lost_reported: Cell<bool>,
    /// The commit is on its way: a renewal that finds the record no longer in flight then
    /// stops without reporting it lost, as the commit itself may have completed it (and
    /// tells otherwise).
    committing: Cell<bool>,
    store: Rc<dyn DynStore>,
    store_timeout: Duration,
}

/// The response type every layer produces.
pub(crate) type Response<B> = ServiceResponse<IdempotentBody<B>>;

pub(crate) fn with_handler_body<B>(response: ServiceResponse<B>) -> Response<B> {
    response.map_body(|_, body| IdempotentBody::handler(body))
}

pub(crate) fn refuse<B>(request: HttpRequest, error: &IdempotencyError) -> Response<B> {
    instrument::refused(&request, error);
    let mut response = error.error_response();
    response.extensions_mut().insert(Refusal);
    ServiceResponse::new(
        request,
        response.map_body(|_, body| IdempotentBody::produced(body)),
    )
}

/// Marks a response that a layer of this crate answered instead of the handler (a route
/// layer's refusal under an app layer's lock): never stored, whatever the policy, as the
/// handler did not run.
struct Refusal;

impl Engine {
    /// Processes a protected request under `policy`, calling `service` at most once, in
    /// the request's span; its outcome is recorded once, when it is done, and then `client`
    /// is marked served.
    ///
    /// A keyed request takes its share of the worker's workload (its slot) once its body
    /// has arrived; a streamed response keeps it until its record is complete.
    /// `route_labels` is the calling layer's, which finds the request's route label.
    pub(crate) async fn process<S, B>(
        self: Rc<Self>,
        policy: Policy,
        req: ServiceRequest,
        service: Rc<S>,
        route_labels: Rc<RouteLabels>,
    ) -> Result<Response<B>, actix_web::Error>
    where
        S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
            + 'static,
        B: MessageBody + 'static,
    {
        let record = RequestRecord::start(&req, &route_labels);
        update_handle(&req, &self, |handle| {
            handle.record = Some(record.shared_state())
        });
        // Marks the request's slot detached if this future is dropped before it is done.
        let client = ClientAttached::new(None);
        // Each branch builds `protect`'s future where it is awaited (see `wanted_span`).
        let result = match record.wanted_span() {
            None => self.protect(policy, req, service, &client).await,
            Some(span) => {
                self.protect(policy, req, service, &client)
                    .instrument(span)
                    .await
            }
        };
        record.finish(&result);
        client.finish();
        result
    }

    /// Starts a request without a key on a route whose policy lets it through (key
    /// optional, not transactional): records its outcome and claims it so that layers
    /// further in leave it alone. The caller passes it to the inner service and
    /// [`finish`](RequestRecord::finish)es the record it gets back: no store step can
    /// follow. `route_labels` is as for [`process`](Self::process).
    pub(crate) fn start_without_key(
        self: &Rc<Self>,
        req: &ServiceRequest,
        route_labels: &RouteLabels,
    ) -> RequestRecord {
        let record = RequestRecord::start(req, route_labels);
        update_handle(req, self, |handle| {
            handle.record = Some(record.shared_state());
            go_on_without_key(handle);
        });
        record
    }

    async fn protect<S, B>(
        self: Rc<Self>,
        policy: Policy,
        mut req: ServiceRequest,
        service: Rc<S>,
        client: &ClientAttached,
    ) -> Result<Response<B>, actix_web::Error>
    where
        S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
            + 'static,
        B: MessageBody + 'static,
    {
        let key = match IdempotencyKey::from_headers_within(
            req.headers(),
            &self.settings.header,
            self.settings.max_key_length,
        ) {
            Ok(Some(key)) => key,
            Ok(None) if policy.required => {
                return Ok(self.refuse(req, IdempotencyError::MissingKey));
            }
            Ok(None) => {
                claim_without_key(&req, &self);
                #[cfg(feature = "postgres")]
                if policy.transactional {
                    // Boxed, as every transactional step here: their futures are large and
                    // would otherwise make every request's future as large (and moved).
                    return Box::pin(self.run_in_transaction_without_record(&policy, req, service))
                        .await;
                }
                return service.call(req).await.map(with_handler_body);
            }
            Err(error) => return Ok(self.refuse(req, error.into())),
        };
        claim_keyed(&req, &self, None);

        // Whose key it is, before a body is read for a request that will be refused anyway.
        let Some(scope) = self.settings.scope.of(&req) else {
            return Ok(self.refuse(req, IdempotencyError::MissingScope));
        };
        let storage_key = StorageKey::new(&self.settings.prefix, &scope, &key);
        let body = match read_body(&mut req, policy.max_request_body).await {
            Ok(body) => body,
            Err(error) => return Ok(self.refuse(req, error)),
        };
        // The request's share of the worker's keyed work, taken only now: a client that
        // stalls its upload holds no slot, so stalled uploads cannot fill the cap.
        let Some(slot) = self.workload.admit() else {
            tracing::debug!("idempotency: worker at its keyed-work cap; answering 503");
            let retry_after = self.settings.retry_after;
            return Ok(self.refuse(req, IdempotencyError::Overloaded { retry_after }));
        };
        client.attach(&slot);
        let slot = Some(slot);
        let fingerprint = self.settings.fingerprint.of(&req, &body);
        let body_len = body.len();
        // The body goes back into the request (`set_payload`) only where a handler will
        // read it: a replay or a refusal has no use for it (a payload costs about 500
        // instructions).

        // This future is dropped if the client goes away; a `begin` dropped on the way may
        // still land, so the guard abandons its token then, as after a timeout.
        let pending = PendingBegin {
            engine: Rc::clone(&self),
            lease: policy.lease,
            remember_for: policy.marker_lifetime(),
            storage_key,
            token: LeaseToken::generate(),
            armed: Cell::new(true),
            sent_at: Cell::new(Instant::now()),
        };
        let (storage_key, token) = (&pending.storage_key, &pending.token);
        let (begun, transaction) = self
            .begin_or_claim_transaction(
                storage_key,
                &fingerprint,
                token,
                &policy,
                &pending.armed,
                &pending.sent_at,
            )
            .await;
        pending.armed.set(false);
        // Failing open, the handler runs under the token of a `begin` that did not answer
        // (see `run_failed_open`), which abandons it only if its response is not committed;
        // not while draining, which refuses instead (below). Read once: a drain that began
        // between two reads would refuse the request without abandoning its token, and a
        // `begin` that landed would hold the key for a lease.
        let draining = work_in_progress::draining();
        // One that certainly wrote nothing (refused, over a record this version cannot read,
        // or never sent) holds nothing: no token to run under or to abandon.
        let wrote_nothing = matches!(&begun, Err(error) if error.wrote_nothing());
        let runs_under_token = self.settings.fail_mode == FailMode::Open
            && !policy.transactional
            && !draining
            && !wrote_nothing;
        match &begun {
            // A `begin` that timed out may have landed or may still land: abandon the token,
            // so that whatever the order the key is not blocked with no handler running. One
            // the store refused wrote nothing: a marker would only take room in a full store.
            // Nor did one that found a record this version cannot read (its key was taken):
            // an `abandon` there could take those bytes for a marker (Redis's reads only the
            // state byte) and write one over them, which frees the key for the next retry.
            Err(StoreError::Timeout(_)) if !runs_under_token => {
                self.abandon_in_background(&pending)
            }
            // Nor did one that was never sent: the store is unreachable, and an abandon for
            // each request refused meanwhile (in microseconds) would pile up, retried for a
            // lease, and write a marker per request once it is back.
            Ok(_) => {}
            Err(_) if wrote_nothing => {}
            // One the store answered with an error may have written its lock (strict
            // replicated writes whose replicas fell short leave it on the primary): abandoned
            // before the refusal goes out, so that a retry sent at once is not answered 409
            // by a lock no handler runs under (in the background if that does not land).
            // (Armed meanwhile: should the client leave, the guard abandons it then.)
            Err(_) if !runs_under_token => {
                // What the request comes to is known now: a client that leaves while the
                // abandon is on its way is counted by it, not as gone.
                if let Some(outcome) = self.outcome_of_failed_begin(draining) {
                    instrument::decided(&req.extensions(), outcome);
                }
                let (lease, remember_for) = (pending.lease, pending.remember_for);
                pending.armed.set(true);
                self.abandon_token(storage_key, *token, lease, remember_for)
                    .await;
                pending.armed.set(false);
            }
            Err(_) => {}
        }
        match begun {
            // Draining before the process stops (`Idempotency::drain`): a request that would
            // run its handler gives the key back and is refused, while replays and 409s are
            // answered as ever. Checked after `begin`, with this request's work already
            // counted, so a drain that starts meanwhile either is seen here or waits for it.
            Ok(BeginOutcome::Acquired) if work_in_progress::draining() => {
                tracing::debug!("idempotency: draining before the process stops; answering 503");
                // Decided before the key is given back: a client that leaves meanwhile is
                // counted as refused, not as gone.
                instrument::decided(&req.extensions(), Outcome::ShuttingDown);
                match transaction {
                    // Its claim lives in the transaction: rolled back as it is dropped, at
                    // the end of this arm.
                    Some(_rolled_back) => {}
                    None => self.release(storage_key, token, policy.lease).await,
                }
                let retry_after = self.settings.retry_after;
                Ok(self.refuse(req, IdempotencyError::ShuttingDown { retry_after }))
            }
            Ok(BeginOutcome::Acquired) => {
                tracing::debug!(key = storage_key.as_str(), "idempotency: executing");
                warn_if_renewals_can_outlast(policy.lease, self.settings.store_timeout);
                instrument::decided(&req.extensions(), Outcome::Executed);
                req.set_payload(Payload::from(body));
                // Held by the run, which may outlive this future (its client left), and by
                // a streamed body until its record is complete.
                let in_flight = LockHeld::enter(&req.extensions());
                let lock = Rc::new(HeldLock {
                    storage_key: storage_key.clone(),
                    fingerprint,
                    token: *token,
                    body_len,
                    lease: Cell::new(policy.lease),
                    renewed_at: Cell::new(pending.sent_at.get()),
                    applied_lease: Cell::new(policy.lease),
                    shortest_lease_sent: Cell::new(policy.lease),
                    unresolved_since: Cell::new(None),
                    renewals_on_their_way: Cell::new(0),
                    route_policy: RefCell::new(None),
                    lost_reported: Cell::new(false),
                    committing: Cell::new(false),
                    store: Rc::clone(&self.store),
                    store_timeout: self.settings.store_timeout,
                });
                // The handler runs to completion and its response is committed even when
                // the client disconnects and Actix drops this future: the run then goes on
                // on a task of its own (see `RunToCompletion`).
                let engine = Rc::clone(&self);
                let held = Rc::clone(&lock);
                let lease = policy.lease;
                let run = RunToCompletion::new(move || async move {
                    #[cfg(feature = "postgres")]
                    if let Some(transaction) = transaction {
                        let _in_flight = in_flight;
                        // Boxed: its future is several times the size of the rest, and this
                        // run's future is moved whole into its box for every new key.
                        return Box::pin(engine.run_and_commit_transaction(
                            policy,
                            lock,
                            transaction,
                            req,
                            service,
                        ))
                        .await;
                    }
                    #[cfg(not(feature = "postgres"))]
                    let _ = transaction; // never one without the feature
                    let ran = engine.run_and_commit(policy, lock, req, service, slot, in_flight);
                    match AssertUnwindSafe(ran).catch_unwind().await {
                        Ok(handled) => handled,
                        // A panic outside the handler's own catch (a response body's `size`,
                        // say), caught inside the run so that it is handled also on the task
                        // a run goes on with once its client has left.
                        Err(panic) => {
                            let (key, token) = (&held.storage_key, &held.token);
                            engine
                                .released_after_panic(key, token, held.lease.get(), panic.as_ref())
                                .await
                        }
                    }
                });
                match run.await {
                    Ok(handled) => handled,
                    Err(panic) => {
                        self.released_after_panic(storage_key, token, lease, panic.as_ref())
                            .await
                    }
                }
            }
            Ok(BeginOutcome::Completed(stored)) => {
                tracing::debug!(key = storage_key.as_str(), "idempotency: replayed");
                instrument::decided(&req.extensions(), Outcome::Replayed);
                let response = replay_response(stored);
                Ok(req.into_response(response.map_body(|_, body| IdempotentBody::produced(body))))
            }
            // Only a `begin` given up on meets its token abandoned, never one still awaited;
            // were a store to answer it, nothing ran and the client may retry: a 409.
            Ok(BeginOutcome::InFlight | BeginOutcome::Abandoned) => {
                tracing::debug!(
                    key = storage_key.as_str(),
                    "idempotency: conflict, in flight"
                );
                let retry_after = self.settings.retry_after;
                Ok(self.refuse(req, IdempotencyError::InFlight { retry_after }))
            }
            Ok(BeginOutcome::FingerprintMismatch) => {
                tracing::debug!(
                    key = storage_key.as_str(),
                    "idempotency: fingerprint mismatch"
                );
                Ok(self.refuse(req, IdempotencyError::FingerprintMismatch))
            }
            Err(error) => match self.settings.fail_mode {
                // Draining, no handler runs for a new key, not even unprotected: one whose
                // client leaves is cut short, and the retry is for another instance.
                FailMode::Open if draining => {
                    if let Some(unlogged) = self.store_failures.admit(Instant::now()) {
                        tracing::warn!(%error, unlogged, "idempotency store failed while the process drains; answering 503 (shutting-down) instead of failing open");
                    }
                    let retry_after = self.settings.retry_after;
                    Ok(self.refuse(req, IdempotencyError::ShuttingDown { retry_after }))
                }
                FailMode::Open => {
                    if let Some(unlogged) = self.store_failures.admit(Instant::now()) {
                        tracing::warn!(%error, unlogged, "idempotency store failed; running the handler unprotected (fail-open)");
                    }
                    instrument::decided(&req.extensions(), Outcome::FailOpen);
                    req.set_payload(Payload::from(body));
                    #[cfg(feature = "postgres")]
                    if policy.transactional {
                        return Box::pin(
                            self.run_in_transaction_without_record(&policy, req, service),
                        )
                        .await;
                    }
                    if error.wrote_nothing() {
                        // Nothing was written (a full store, a record this version cannot
                        // read holds the key, or the `begin` never left this process: no
                        // connection could be had): no token to run under. A route layer
                        // further in still applies its smaller body limit (the claim says
                        // how much was read). Still a keyed request's run: it goes on to
                        // its end should the client leave (its side effects are not left
                        // half done), and a panic is answered 500.
                        claim_keyed(&req, &self, Some(body_len));
                        let run = RunToCompletion::new(move || async move {
                            let _slot = slot;
                            service.call(req).await.map(with_handler_body)
                        });
                        return run
                            .await
                            .unwrap_or_else(|panic| Err(panicked_failing_open(panic.as_ref())));
                    }
                    let held = UnconfirmedBegin {
                        storage_key: storage_key.clone(),
                        token: *token,
                        sent_at: pending.sent_at.get(),
                        remember_for: pending.remember_for,
                    };
                    // Runs to its end, as a run that holds its key does, should the client
                    // leave: cut short, it would leave its side effects half done and its
                    // retry free to run again. It keeps the request's slot until then.
                    let engine = Rc::clone(&self);
                    let (key, token, lease) = (storage_key.clone(), *token, pending.lease);
                    let remember_for = pending.remember_for;
                    let run = RunToCompletion::new(move || async move {
                        let _slot = slot;
                        let ran = engine.run_failed_open(
                            policy,
                            req,
                            service,
                            held,
                            fingerprint,
                            body_len,
                        );
                        match AssertUnwindSafe(ran).catch_unwind().await {
                            Ok(handled) => handled,
                            // A panic outside the handler's own catch (a response body's
                            // `size`, say), caught inside the run so that the token is
                            // abandoned also on the task a run goes on with once its client
                            // has left: uncaught there, the `begin` that landed kept the key
                            // locked (409) for a lease with no handler running.
                            Err(panic) => {
                                let error = panicked_failing_open(panic.as_ref());
                                engine.abandon_token(&key, token, lease, remember_for).await;
                                Err(error)
                            }
                        }
                    });
                    match run.await {
                        Ok(handled) => handled,
                        Err(panic) => {
                            let error = panicked_failing_open(panic.as_ref());
                            self.abandon_in_background(&pending);
                            Err(error)
                        }
                    }
                }
                FailMode::Closed => {
                    if let Some(unlogged) = self.store_failures.admit(Instant::now()) {
                        tracing::error!(%error, unlogged, "idempotency store failed; answering 503 (fail-closed)");
                    }
                    let retry_after = self.settings.retry_after;
                    let mut refused = self.refuse(
                        req,
                        IdempotencyError::StoreUnavailable {
                            source: error,
                            retry_after,
                        },
                    );
                    if draining {
                        // As the drain's own 503: the retry opens a connection, which a load
                        // balancer sends to an instance that is not stopping.
                        refused
                            .response_mut()
                            .head_mut()
                            .set_connection_type(ConnectionType::Close);
                    }
                    Ok(refused)
                }
            },
        }
    }

    /// What a request whose `begin` failed (and whose token is abandoned before it goes on)
    /// comes to, as the `Err` arm of [`protect`](Self::protect) decides it: a 503 failing
    /// closed, or while draining; failing open (a transactional route, run without a
    /// record), nothing yet, as its handler has not run.
    fn outcome_of_failed_begin(&self, draining: bool) -> Option<Outcome> {
        match self.settings.fail_mode {
            FailMode::Closed => Some(Outcome::StoreError),
            FailMode::Open if draining => Some(Outcome::ShuttingDown),
            FailMode::Open => None,
        }
    }

    /// Fails open after a `begin` that did not answer (a timeout, a lost connection): that
    /// `begin` may have landed, and its in-flight record then holds the key. So the handler
    /// runs under its token, unprotected as far as this request knows, but as a run that
    /// holds the key would: its lease renewed while it may be held (a renewal that finds no
    /// record stops, unreported), and its response committed right after it goes out (never
    /// held back waiting for a store that just failed). Where the `begin` landed, a duplicate
    /// gets 409 during the run; where the commit lands (over that record, or written anew on
    /// a free key), a retry gets the replay instead of a second run. Where the response is
    /// not stored (an error, a panic, a streamed body) the token is abandoned before the
    /// response goes out, as a release gives the key back, so a retry runs the handler
    /// again; where its commit fails or finds another request's record, in the background.
    /// Its caller runs it to its end even if the client leaves.
    async fn run_failed_open<S, B>(
        self: &Rc<Self>,
        policy: Policy,
        req: ServiceRequest,
        service: Rc<S>,
        held: UnconfirmedBegin,
        fingerprint: Fingerprint,
        body_len: usize,
    ) -> Result<Response<B>, actix_web::Error>
    where
        S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
            + 'static,
        B: MessageBody + 'static,
    {
        let lock = Rc::new(HeldLock {
            storage_key: held.storage_key,
            fingerprint,
            token: held.token,
            body_len,
            lease: Cell::new(policy.lease),
            renewed_at: Cell::new(held.sent_at),
            applied_lease: Cell::new(policy.lease),
            shortest_lease_sent: Cell::new(policy.lease),
            unresolved_since: Cell::new(None),
            renewals_on_their_way: Cell::new(0),
            route_policy: RefCell::new(None),
            lost_reported: Cell::new(false),
            // A renewal that finds no record stops without reporting it lost: the `begin`
            // may never have landed.
            committing: Cell::new(true),
            store: Rc::clone(&self.store),
            store_timeout: self.settings.store_timeout,
        });
        // A route layer further in applies its policy (what is stored, the lease) to it.
        claim_with_lock(&req, self, &lock);
        let work = self.run_and_capture(policy, &lock, req, service);
        let handled = while_renewing_lease(work, &lock).await;
        let (result, stored) = match handled {
            Handled::Panicked => {
                tracing::error!("idempotency: handler panicked (fail-open)");
                (Err(IdempotencyError::HandlerPanicked.into()), None)
            }
            Handled::Failed(error) => (Err(error), None),
            Handled::FailedStored { error, stored, ttl } => (Err(error), Some((stored, ttl))),
            Handled::NotStored(response) => (Ok(response), None),
            Handled::Stored {
                response,
                stored,
                ttl,
            } => (Ok(response), Some((stored, ttl))),
            Handled::Streamed { response, body, .. } => (
                Ok(response.map_body(|_, ()| IdempotentBody::handler(body))),
                None,
            ),
        };
        match stored {
            Some((stored, ttl)) => self.commit_failed_open(lock, stored, ttl, held.remember_for),
            None => {
                let (key, token) = (&lock.storage_key, lock.token);
                self.abandon_token(key, token, lock.lease.get(), held.remember_for)
                    .await;
            }
        }
        result
    }

    /// Abandons `token` of `key` before the response goes out, as a release gives a key back
    /// (bounded by the store timeout), so that a retry sent as soon as the response arrives
    /// finds the key free; in the background (see
    /// [`abandon_token_in_background`](Self::abandon_token_in_background)) if that does
    /// not answer that it is done.
    async fn abandon_token(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
        remember_for: Duration,
    ) {
        let abandon = self.store.abandon(key, &token, remember_for);
        if !matches!(
            self.bounded(StoreOperation::Release, abandon).await,
            Ok(true)
        ) {
            self.abandon_token_in_background(key, token, lease, remember_for);
        }
    }

    /// Commits the response of a run that failed open under `lock`'s token, in the
    /// background and once; abandons the token where that does not land (see
    /// [`run_failed_open`](Self::run_failed_open)). Counted as work in progress, so a drain
    /// waits for it.
    fn commit_failed_open(
        self: &Rc<Self>,
        lock: Rc<HeldLock>,
        stored: StoredResponse,
        ttl: Duration,
        remember_for: Duration,
    ) {
        let engine = Rc::clone(self);
        let in_progress = InProgress::start();
        actix_rt::spawn(async move {
            let (key, token) = (&lock.storage_key, lock.token);
            let commit = engine
                .store
                .commit(key, &lock.fingerprint, &token, &stored, ttl);
            match engine.bounded(StoreOperation::Commit, commit).await {
                // At INFO, so without the storage key (named at DEBUG only).
                Ok(true) => tracing::info!(
                    "idempotency: the response of a fail-open run is stored; retries replay it"
                ),
                answer => {
                    tracing::debug!(
                        key = key.as_str(),
                        committed = ?answer.as_ref().ok(),
                        "idempotency: the response of a fail-open run is not stored"
                    );
                    engine.abandon_token_in_background(key, token, lock.lease.get(), remember_for);
                }
            }
            drop(in_progress);
        });
    }

    /// `begin`, or on a transactional route the claim inside a transaction (which comes back
    /// with it when acquired).
    async fn begin_or_claim_transaction(
        &self,
        storage_key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        policy: &Policy,
        armed: &Cell<bool>,
        sent_at: &Cell<Instant>,
    ) -> (Result<BeginOutcome, StoreError>, Option<Transaction>) {
        if policy.transactional {
            #[cfg(feature = "postgres")]
            return Box::pin(self.claim_transaction_or_wait(
                storage_key,
                fingerprint,
                token,
                policy,
                armed,
            ))
            .await;
            #[cfg(not(feature = "postgres"))]
            return (
                Err(StoreError::Protocol(
                    "transactional routes need the `postgres` feature of idempotency-actix"
                        .to_owned(),
                )),
                None,
            );
        }
        let begun = self
            .begin_or_wait(storage_key, fingerprint, token, policy, armed, sent_at)
            .await;
        (begun, None)
    }

    /// `begin`, repeated while the key is in flight and the policy allows waiting; answered
    /// from the replay cache when it holds the record, and a completed record found in the
    /// store is cached. `armed` (the guard that abandons the token if this future is
    /// dropped) is disarmed while it waits between two `begin`s, which both answered: no
    /// `begin` of the token is outstanding then.
    async fn begin_or_wait(
        &self,
        storage_key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        policy: &Policy,
        armed: &Cell<bool>,
        sent_at: &Cell<Instant>,
    ) -> Result<BeginOutcome, StoreError> {
        let cache = self.settings.replay_cache.as_ref();
        if let Some(cached) = cache.and_then(|cache| cache.lookup(storage_key, fingerprint)) {
            return Ok(cached);
        }
        let deadline = policy
            .wait_for_completion
            .map(|bound| Instant::now() + bound);
        let mut pause = Duration::from_millis(20);
        let mut waited = false;
        loop {
            // The store starts the lease, and reports how long a completed record has left,
            // as of some moment of the round trip: counted from its start, renewals are
            // never late and a cached copy never outlives the record.
            let sent = Instant::now();
            sent_at.set(sent);
            // Draining, a key found free is given back at once and no handler runs under
            // it: its lease only bounds how long the key stays locked should the process
            // stop before that release lands (or should this `begin` land late).
            let lease = if work_in_progress::draining() {
                policy.lease.min(DRAINING_LEASE)
            } else {
                policy.lease
            };
            let begun = self
                .bounded(
                    StoreOperation::Begin,
                    self.store.begin(storage_key, fingerprint, token, lease),
                )
                .await;
            let wait = match &begun {
                Ok((BeginOutcome::InFlight, _)) => wait_for_next_begin(deadline, pause),
                _ => None,
            };
            match (begun, wait) {
                (Ok((BeginOutcome::InFlight, _)), Some(wait)) => {
                    armed.set(false);
                    actix_rt::time::sleep(wait).await;
                    armed.set(true);
                    waited = true;
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
                (Err(error), _) if waited => {
                    return self.failed_while_waiting(error, storage_key, token, policy);
                }
                (Ok((BeginOutcome::Completed(response), Some(remaining))), _) => {
                    if let Some(cache) = cache {
                        let remaining = remaining.saturating_sub(sent.elapsed());
                        cache.insert(storage_key, *fingerprint, response.clone(), remaining);
                    }
                    return Ok(BeginOutcome::Completed(response));
                }
                (begun, _) => return begun.map(|(outcome, _)| outcome),
            }
        }
    }

    /// What a `begin` that failed after the request waited for its key's run comes to.
    ///
    /// The request knows that another one holds its key. Failing open here would run the
    /// handler unprotected beside that run (a second charge), which a request that did not
    /// wait would never do: it got 409 at its first `begin`. So on an app that fails open it
    /// gets that 409 (its token abandoned in the background, as the `begin` may still
    /// land); failing closed, the 503 of a failed store, as ever.
    pub(crate) fn failed_while_waiting(
        &self,
        error: StoreError,
        storage_key: &StorageKey,
        token: &LeaseToken,
        policy: &Policy,
    ) -> Result<BeginOutcome, StoreError> {
        if self.settings.fail_mode != FailMode::Open {
            return Err(error);
        }
        if let Some(unlogged) = self.store_failures.admit(Instant::now()) {
            tracing::warn!(
                %error,
                unlogged,
                "idempotency store failed while a retry waited for its key's run; answering 409 instead of running the handler beside it (fail-open)"
            );
        }
        // Nothing was written by a `begin` the store refused, that found a record this
        // version cannot read or that was never sent: no token to give up.
        if !error.wrote_nothing() {
            let remember_for = policy.marker_lifetime();
            self.abandon_token_in_background(storage_key, *token, policy.lease, remember_for);
        }
        Ok(BeginOutcome::InFlight)
    }

    /// After a panic the run's own catch did not see: nothing was committed, so the key is
    /// released for a retry, as after a handler's panic, and the client gets a 500 problem.
    async fn released_after_panic<B>(
        &self,
        storage_key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
        panic: &(dyn std::any::Any + Send),
    ) -> Result<Response<B>, actix_web::Error> {
        tracing::error!(
            panic = panic_message(panic),
            "idempotency: the request panicked; key released"
        );
        self.release(storage_key, token, lease).await;
        Err(IdempotencyError::HandlerPanicked.into())
    }

    fn refuse<B>(&self, req: ServiceRequest, error: IdempotencyError) -> Response<B> {
        refuse(req.into_parts().0, &error)
    }

    /// Bounds a store operation by the store timeout.
    pub(crate) async fn bounded<T>(
        &self,
        kind: StoreOperation,
        operation: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        within(kind, self.settings.store_timeout, operation).await
    }

    async fn run_and_commit<S, B>(
        self: &Rc<Self>,
        policy: Policy,
        lock: Rc<HeldLock>,
        req: ServiceRequest,
        service: Rc<S>,
        slot: Option<Rc<WorkSlot>>,
        in_flight: LockHeld,
    ) -> Result<Response<B>, actix_web::Error>
    where
        S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
            + 'static,
        B: MessageBody + 'static,
    {
        claim_with_lock(&req, self, &lock);
        let work = self.run_and_capture(policy, &lock, req, service);
        let outcome = while_renewing_lease(work, &lock).await;
        let (storage_key, token) = (&lock.storage_key, &lock.token);
        match outcome {
            Handled::Panicked => {
                tracing::error!("idempotency: handler panicked; key released");
                self.release(storage_key, token, lock.lease.get()).await;
                // No clone of the request may be held while an app-level layer's inner
                // service routes it (routing needs it unshared), so the 500 travels as an
                // error that Actix renders with `IdempotencyError::error_response`.
                Err(IdempotencyError::HandlerPanicked.into())
            }
            Handled::Failed(error) => {
                self.release(storage_key, token, lock.lease.get()).await;
                Err(error)
            }
            Handled::FailedStored { error, stored, ttl } => {
                // Renewed until the commit answers, as a response's is (below).
                lock.committing.set(true);
                let commit = self.commit(&lock, stored, ttl, slot.as_ref());
                while_renewing_lease(commit, &lock).await;
                Err(error)
            }
            Handled::NotStored(response) => {
                tracing::debug!(
                    key = storage_key.as_str(),
                    status = response.status().as_u16(),
                    "idempotency: response not stored (error or informational); key released"
                );
                self.release(storage_key, token, lock.lease.get()).await;
                Ok(response)
            }
            Handled::Stored {
                response,
                stored,
                ttl,
            } => {
                // Renewed until the commit answers: a renewal dropped before it reached the
                // store would leave the lease to lapse while the commit is on its way.
                lock.committing.set(true);
                let commit = self.commit(&lock, stored, ttl, slot.as_ref());
                while_renewing_lease(commit, &lock).await;
                Ok(response)
            }
            Handled::Streamed {
                response,
                body,
                stored,
                ttl,
                limit,
            } => {
                // The lease is renewed, and the request counted in flight, until the record
                // is complete: the body may take longer than the lease, and a duplicate
                // meanwhile gets 409.
                let renewals = AbortOnDrop(actix_rt::spawn({
                    let lock = Rc::clone(&lock);
                    async move { keep_renewing(&lock).await }
                }));
                let (engine, held) = (Rc::clone(self), slot.clone());
                let lease = lock.lease.get();
                let commit: Commit = Box::new(move |body| {
                    Box::pin(async move {
                        // Renewed until the commit answers (a commit that fails renews the
                        // lease itself while it is retried); a renewal that finds the record
                        // completed by this commit does not report it lost.
                        lock.committing.set(true);
                        let stored = StoredResponse { body, ..stored };
                        engine.commit(&lock, stored, ttl, held.as_ref()).await;
                        drop((renewals, held, in_flight));
                    })
                });
                let size = framed_size(response.response().head(), body.size());
                let body = CapturingBody::new(body, size, limit, lease, commit, slot);
                Ok(response.map_body(|_, ()| IdempotentBody::produced(BoxBody::new(body))))
            }
        }
    }

    /// Runs the handler and captures what is to be stored of its response.
    pub(crate) async fn run_and_capture<S, B>(
        &self,
        policy: Policy,
        lock: &HeldLock,
        req: ServiceRequest,
        service: Rc<S>,
    ) -> Handled<B>
    where
        S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>
            + 'static,
        B: MessageBody + 'static,
    {
        // `call` inside the caught future: a service that panics in `call` itself, before it
        // returns its future (a `wrap_fn` layer), is caught too.
        let called = async move { service.call(req).await };
        let Ok(result) = AssertUnwindSafe(called).catch_unwind().await else {
            return Handled::Panicked;
        };
        // An app layer that took the request before routing learns the route's policy only
        // now, from what the route layer left in the shared lock.
        let policy = match lock.route_policy.borrow().as_ref() {
            Some(route) => route.apply_to(&policy),
            None => policy,
        };
        let response = match result {
            Ok(response) => response,
            Err(error) => return self.failed(error, &policy),
        };
        let status = response.status();
        // A refusal has an error status: only such a response is looked up for the marker.
        let error_status = status.is_client_error() || status.is_server_error();
        if !policy.stores_status(status)
            || error_status && response.response().extensions().contains::<Refusal>()
        {
            return Handled::NotStored(with_handler_body(response));
        }

        let (request, response) = response.into_parts();
        let status = response.status();
        let headers = self.settings.replayed_headers.select(response.headers());
        let (response, body) = response.into_parts();
        let stored = |body| StoredResponse {
            status,
            headers,
            body,
        };
        let ttl = policy.ttl;
        let limit = policy.max_stored_body;
        let (response, stored) =
            if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
                // These statuses have no content (RFC 9110 §15.3.5, §15.4.5), yet Actix would
                // write a handler's body after the head; it is dropped, so the original and the
                // replay both end at the head, without `Content-Length`.
                drop(body);
                let response = response.set_body(IdempotentBody::produced(BoxBody::new(())));
                (response, stored(Some(Bytes::new())))
            } else if matches!(body.size(), BodySize::Sized(0) | BodySize::None) {
                // Actix never polls a body that declares itself empty, so it cannot be
                // stored as it streams: it is stored empty and committed before the head
                // goes out, as a complete body is, and the client gets it as it is.
                (
                    response.set_body(IdempotentBody::handler(body)),
                    stored(Some(Bytes::new())),
                )
            } else if matches!(body.size(), BodySize::Sized(size) if size > limit as u64) {
                // The client gets all of it; a retry gets the status and headers.
                (
                    response.set_body(IdempotentBody::handler(body)),
                    stored(None),
                )
            } else {
                match body.try_into_bytes() {
                    Ok(bytes) => {
                        let kept = (bytes.len() <= limit).then(|| bytes.clone());
                        let body = IdempotentBody::produced(BoxBody::new(bytes));
                        (response.set_body(body), stored(kept))
                    }
                    Err(body) => {
                        return Handled::Streamed {
                            response: ServiceResponse::new(request, response),
                            body,
                            stored: stored(None),
                            ttl,
                            limit,
                        };
                    }
                }
            };
        Handled::Stored {
            response: ServiceResponse::new(request, response),
            stored,
            ttl,
        }
    }

    /// What an error of the inner service comes to: the key is released, unless the policy
    /// stores responses of its status (`store_errors`, or a status under 400), as Actix
    /// renders it (a layer inside this one that fails after the handler ran, say); the client
    /// then gets the rendering that was stored, not one of its own.
    fn failed<B>(&self, error: actix_web::Error, policy: &Policy) -> Handled<B> {
        if !policy.stores_status(error.as_response_error().status_code()) {
            return Handled::Failed(error);
        }
        // Rendered once, and the client gets that rendering (see `RenderedError`).
        let rendered = error.error_response();
        let status = rendered.status();
        let headers = self.settings.replayed_headers.select(rendered.headers());
        let (error, body) = RenderedError::new(error, rendered);
        let body = body.filter(|body| body.len() <= policy.max_stored_body);
        Handled::FailedStored {
            error: error.into(),
            stored: StoredResponse {
                status,
                headers,
                body,
            },
            ttl: policy.ttl,
        }
    }

    /// Commits `stored`; if the store fails, the response goes out meanwhile (never held
    /// back or lost) and the commit is retried in the background under a renewed lease, so
    /// the key stays locked (409) rather than free for a second run; see [`keep_committing`].
    ///
    /// A commit retried in the background keeps the request's `slot`, counted as detached
    /// work: it holds the stored response for as long as it retries, so a store that takes
    /// `begin`s but fails their commits fills the worker's detached cap, and new keyed
    /// requests get 503, instead of piling up retries and their bodies without bound.
    async fn commit(
        &self,
        lock: &Rc<HeldLock>,
        stored: StoredResponse,
        ttl: Duration,
        slot: Option<&Rc<WorkSlot>>,
    ) {
        let storage_key = &lock.storage_key;
        match self
            .bounded(
                StoreOperation::Commit,
                self.store
                    .commit(storage_key, &lock.fingerprint, &lock.token, &stored, ttl),
            )
            .await
        {
            Ok(true) => tracing::debug!(key = storage_key.as_str(), "idempotency: committed"),
            Ok(false) => lock.report_lost(NoticedBy::Commit),
            Err(error) => {
                tracing::warn!(
                    %error,
                    "idempotency: commit failed; response sent, key kept locked and commit retried in the background"
                );
                let in_progress = InProgress::start();
                let slot = slot.map(|slot| {
                    slot.detach();
                    Rc::clone(slot)
                });
                let committing = keep_committing(Rc::clone(lock), stored, ttl);
                actix_rt::spawn(async move {
                    committing.await;
                    drop((in_progress, slot));
                });
            }
        }
    }

    /// Abandons the token of `pending` in the background (see
    /// [`IdempotencyStore::abandon`](crate::IdempotencyStore::abandon)), retried with backoff
    /// (50 ms doubling to 1 s) until it answers `true` or a lease has passed. `false` means
    /// another record holds the key: the late `begin` could only land once it is gone, so
    /// the abandon is tried again.
    fn abandon_in_background(&self, pending: &PendingBegin) {
        let (key, token) = (&pending.storage_key, pending.token);
        self.abandon_token_in_background(key, token, pending.lease, pending.remember_for);
    }

    /// Abandons `token` of `key` in the background (see
    /// [`abandon_in_background`](Self::abandon_in_background)), for at most `lease`; the store
    /// remembers it for `remember_for`.
    fn abandon_token_in_background(
        &self,
        key: &StorageKey,
        token: LeaseToken,
        lease: Duration,
        remember_for: Duration,
    ) {
        let store = Rc::clone(&self.store);
        let key = key.clone();
        // The first attempt counts as work in progress, so that a drain waits for it (50 ms
        // and at most the store timeout): a graceful stop right after a client left during
        // its `begin` would otherwise end the process before the abandon is sent, and the
        // key would answer 409 for a lease with no handler running. The attempts after it
        // do not count: they may go on for a whole lease while another record holds the
        // key or the store is down, and a late `begin` they failed to cover only locks the
        // key for a lease, with no handler run.
        let mut first_attempt = Some(InProgress::start());
        let operation = move || {
            let (store, key, token) = (Rc::clone(&store), key.clone(), token);
            let counted = first_attempt.take();
            async move {
                // Dropped when the attempt ends, answered or cut off by the store timeout.
                let _counted = counted;
                store.abandon(&key, &token, remember_for).await
            }
        };
        let timeout = self.settings.store_timeout;
        let deadline = Instant::now() + lease;
        actix_rt::spawn(async move {
            let kind = StoreOperation::Release;
            match retry_in_background(kind, timeout, deadline, operation, |done| *done).await {
                Retried::Done => {
                    tracing::info!("idempotency: a begin that did not answer is abandoned");
                }
                Retried::Answered => tracing::debug!(
                    "idempotency: another record held the key while a begin that did not answer was abandoned"
                ),
                Retried::Unanswered => background_retry::log_unanswered(
                    "a begin that did not answer is not abandoned (a record it wrote expires by itself)",
                ),
            }
        });
    }

    /// Gives the key back: deletes the in-flight record of `token` (compare-and-delete),
    /// bounded by the store timeout. It runs to its end even if whoever awaits it stops
    /// waiting (the client left, and Actix dropped the request's future): cut short, it would
    /// leave the key answering 409 for a whole lease with no handler running. It counts as
    /// work in progress until it is done, so that a drain waits for it too. One that fails
    /// (the store unreachable, or slower than its timeout) is sent again in the background
    /// until the store answers, for at most `lease` (by then the record has expired): the
    /// key is free soon after the store is back, rather than answering 409 for the rest of
    /// the lease. Those retries are not work in progress: a drain does not wait on a store
    /// that is down.
    async fn release(&self, storage_key: &StorageKey, token: &LeaseToken, lease: Duration) {
        let store = Rc::clone(&self.store);
        let (key, token) = (storage_key.clone(), *token);
        let timeout = self.settings.store_timeout;
        let in_progress = InProgress::start();
        let release = RunToCompletion::new(move || async move {
            let released = within(
                StoreOperation::Release,
                timeout,
                store.release(&key, &token),
            );
            let failed = released.await.err();
            drop(in_progress);
            if let Some(error) = failed {
                tracing::warn!(%error, "idempotency: release failed; sent again in the background until the store answers");
                let deadline = Instant::now() + lease;
                let step = move || {
                    let (store, key) = (Rc::clone(&store), key.clone());
                    async move { store.release(&key, &token).await }
                };
                actix_rt::spawn(async move {
                    let kind = StoreOperation::Release;
                    match retry_in_background(kind, timeout, deadline, step, |_| true).await {
                        Retried::Done | Retried::Answered => {
                            tracing::info!("idempotency: a release that failed is done");
                        }
                        Retried::Unanswered => background_retry::log_unanswered(
                            "a release that failed is not done (the key frees itself as its lease expires)",
                        ),
                    }
                });
            }
        });
        if let Err(panic) = release.await {
            tracing::error!(
                panic = panic_message(panic.as_ref()),
                "idempotency: the store panicked in a release; the key frees itself when its lease expires"
            );
        }
    }
}

/// A `begin` under way in a request's future, which Actix drops if the client goes away: the
/// `begin` may still land then, so dropping the guard while it is armed abandons the token
/// in the background (as after a timeout), and the key is not blocked with no handler
/// running.
struct PendingBegin {
    engine: Rc<Engine>,
    lease: Duration,
    /// How long the store remembers the abandoned token (`Policy::marker_lifetime`).
    remember_for: Duration,
    storage_key: StorageKey,
    token: LeaseToken,
    /// Cleared once `begin` has answered (or failed): the request takes it from there.
    armed: Cell<bool>,
    /// When the last `begin` was sent: its lease runs from no earlier.
    sent_at: Cell<Instant>,
}

impl Drop for PendingBegin {
    fn drop(&mut self) {
        if self.armed.get() {
            tracing::debug!("idempotency: client gone during begin; abandoning in the background");
            self.engine.abandon_in_background(self);
        }
    }
}

/// The `begin` a request that fails open runs under: it did not answer, so it may hold the
/// key or never will (see [`Engine::run_failed_open`]).
struct UnconfirmedBegin {
    storage_key: StorageKey,
    token: LeaseToken,
    /// When it was sent: a lease it took runs from no earlier.
    sent_at: Instant,
    /// How long the store remembers the token if it is abandoned: the route's ttl.
    remember_for: Duration,
}

/// What became of a request whose lock was acquired.
pub(crate) enum Handled<B> {
    /// The handler panicked.
    Panicked,
    /// The inner service answered an error whose status the policy does not store.
    Failed(actix_web::Error),
    /// The inner service answered an error whose status the policy stores: `stored` is that
    /// error as Actix renders it for the client.
    FailedStored {
        error: actix_web::Error,
        stored: StoredResponse,
        ttl: Duration,
    },
    /// A response the policy does not store (status >= 400 by default).
    NotStored(Response<B>),
    /// A response to store whose body is known: committed before it is returned.
    Stored {
        response: Response<B>,
        stored: StoredResponse,
        ttl: Duration,
    },
    /// A response to store whose body streams: forwarded as it comes, and committed (with
    /// `stored` and the captured body) before the response is complete.
    Streamed {
        response: ServiceResponse<()>,
        body: B,
        stored: StoredResponse,
        ttl: Duration,
        limit: usize,
    },
}

/// Runs `work` to completion while renewing the lease of `lock` every third of it.
async fn while_renewing_lease<T>(work: impl Future<Output = T>, lock: &Rc<HeldLock>) -> T {
    let work = std::pin::pin!(work);
    let renewals = std::pin::pin!(keep_renewing(lock));
    match select(work, renewals).await {
        Either::Left((output, _)) => output,
        Either::Right(((), work)) => work.await,
    }
}

/// Renews the lease of `lock` every third of it until the lease is lost. The lease is read
/// afresh at every tick, so a route layer that changes it is honoured at once.
///
/// Each renewal runs on a task of its own, so one that is on its way when this stops (the
/// handler returned, the commit is next) still reaches the store: cancelled before it was
/// written (while its connection reconnects, say), it would leave the lease to run out from
/// the renewal before it while the commit is on its way.
///
/// A failed renewal is retried at the next tick. Only the first failure of a run of them is
/// logged as a warning (the others at debug level), and the renewal that ends the run at
/// info level: a store that stays down would otherwise log a warning per request every tick.
async fn keep_renewing(lock: &Rc<HeldLock>) {
    let mut failures: u64 = 0;
    loop {
        let lease = lock.lease.get();
        actix_rt::time::sleep((lease / 3).min(RENEWAL_TICK)).await;
        if !lock.renewal_due() {
            continue;
        }
        let renewal = actix_rt::spawn({
            let lock = Rc::clone(lock);
            async move { lock.renew().await }
        });
        let Ok(renewed) = renewal.await else {
            continue;
        };
        match renewed {
            Ok(true) => {
                if failures > 0 {
                    tracing::info!(failures, "idempotency: lease renewed after failed renewals");
                    failures = 0;
                }
            }
            Ok(false) => {
                if !lock.committing.get() {
                    lock.report_lost(NoticedBy::Renewal);
                }
                return;
            }
            Err(error) => {
                failures += 1;
                if failures == 1 {
                    tracing::warn!(
                        %error,
                        "idempotency: lease renewal failed; will retry (further failures of this lease at debug level)"
                    );
                } else {
                    tracing::debug!(%error, failures, "idempotency: lease renewal failed again");
                }
            }
        }
    }
}

/// Retries the commit of `stored` after it failed (Redis out of memory, unreachable, slow),
/// renewing the lease meanwhile so that the key stays locked: retries get 409, never a
/// second run of a handler whose response went out. Backoff 50 ms doubling to 1 s (at most a
/// third of the lease). The lease is renewed on a task of its own, on the schedule it keeps
/// while the handler runs ([`keep_renewing`]), not between two attempts: a renewal and an
/// attempt that each take almost the store timeout, and the pause after them, would add up
/// to more than the lease, and let a retry in.
///
/// Bounded by `ttl`, how long the record was wanted: had the commit landed, it would have
/// expired by then and a retry would have run the handler again anyway. Stops at the first
/// answer: committed (over this token's in-flight record, or written anew where its record
/// was lost and the key is free), or "not held" (another request holds or completed the
/// key: the loss is reported). A commit answered "committed" is looked at again a second
/// later and sent again if the store still holds the in-flight record (a node that took it
/// and lost it in a failover: see [`still_in_flight_after_landing`]).
async fn keep_committing(lock: Rc<HeldLock>, stored: StoredResponse, ttl: Duration) {
    let deadline = Instant::now() + ttl;
    let mut pause = Duration::from_millis(50);
    // Renewal stops at the first "not held", unreported: the commit then tells whether the
    // record was lost or already completed by this token (a commit that timed out but
    // landed). It ends when this does.
    lock.committing.set(true);
    let _renewals = AbortOnDrop(actix_rt::spawn({
        let lock = Rc::clone(&lock);
        async move { keep_renewing(&lock).await }
    }));
    let mut attempts = 0_u32;
    while Instant::now() + pause < deadline {
        actix_rt::time::sleep(pause).await;
        attempts += 1;
        instrument::background_retry(StoreOperation::Commit);
        let commit = lock.store.commit(
            &lock.storage_key,
            &lock.fingerprint,
            &lock.token,
            &stored,
            ttl,
        );
        match within(StoreOperation::Commit, lock.store_timeout, commit).await {
            Ok(true) => {
                if !still_in_flight_after_landing(&lock, deadline).await {
                    tracing::info!(attempts, "idempotency: background commit landed");
                    return;
                }
                tracing::warn!(
                    attempts,
                    "idempotency: a background commit that landed is not in the store a moment later (taken by a node that lost it in a failover?); committing again"
                );
                pause = Duration::from_millis(50);
                continue;
            }
            Ok(false) => {
                lock.report_lost(NoticedBy::Commit);
                return;
            }
            Err(error) => {
                tracing::debug!(%error, attempts, "idempotency: background commit failed; retrying")
            }
        }
        pause = (pause * 2)
            .min(Duration::from_secs(1))
            .min(lock.lease.get() / 3);
    }
    tracing::error!(
        attempts,
        "idempotency: commit kept failing for the record's whole ttl; the key is released when its lease expires"
    );
}

/// After a commit retried in the background answered that it wrote: whether the store still
/// holds the request's in-flight record [`COMMIT_LOOK_AGAIN_AFTER`] later (at most a third of
/// the lease), asked by a renewal, which succeeds only on that record (and then keeps it
/// locked while the commit is sent again). A commit that needed retries is one that met a
/// store in trouble, a failover among them: a Redis Cluster primary paused past the
/// cluster's node timeout, woken after its replica was promoted, takes the commits queued
/// for it before it learns it was demoted, answers them, and loses them with the demotion;
/// the promoted replica still holds the in-flight record. A second later the old primary
/// redirects, so the renewal reaches the node that serves the key. A renewal that fails is
/// sent again after the same pause, for a lease at most (by then an in-flight record that no
/// renewal reached has expired: there is nothing left to complete) and never past
/// `deadline`; `false` then.
async fn still_in_flight_after_landing(lock: &HeldLock, deadline: Instant) -> bool {
    let landed = Instant::now();
    let deadline = deadline.min(landed + lock.lease.get());
    loop {
        let pause = COMMIT_LOOK_AGAIN_AFTER.min(lock.lease.get() / 3);
        if Instant::now() + pause >= deadline {
            return false;
        }
        actix_rt::time::sleep(pause).await;
        match lock.renew_counted().await {
            // Answered with the write of a renewal sent before the commit landed (see
            // `HeldLock::renew_counted`): it may have found the record in flight before the
            // commit completed it.
            (Ok(true), counted_from) if counted_from < landed => tracing::debug!(
                "idempotency: the look at a background commit met an earlier renewal; asking again"
            ),
            (Ok(held), _) => return held,
            (Err(error), _) => tracing::debug!(
                %error,
                "idempotency: the look at a background commit failed; asking again"
            ),
        }
    }
}

/// How long after a commit retried in the background answered the store is asked whether
/// it kept it (see [`still_in_flight_after_landing`]).
const COMMIT_LOOK_AGAIN_AFTER: Duration = Duration::from_secs(1);

/// A background task that stops when this is dropped.
struct AbortOnDrop(actix_rt::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How often a running request checks whether its lease is due for renewal.
const RENEWAL_TICK: Duration = Duration::from_millis(100);

/// The lease of a `begin` sent while the process drains (`Idempotency::drain`), when the
/// route's is longer. Such a `begin` runs no handler: the key it finds free is given back
/// at once (the drain is for good, so the check after it sees the drain too). A process
/// stopped before that release lands leaves the key locked (409) for this long rather than
/// a whole lease.
const DRAINING_LEASE: Duration = Duration::from_secs(2);

/// Logs, once per process, a lease that a renewal may outlast. The lease is counted from
/// when a `begin` or renewal is sent; the next renewal is sent a third of the lease later,
/// but not before the previous one answered (up to the store timeout), and on the next
/// renewal tick; it may then take up to the store timeout to reach the store. So a lease of
/// at most twice the store timeout plus a tick can lapse while a renewal is on its way, every
/// step slow but within the timeout, and let a duplicate run the handler.
pub(crate) fn warn_if_renewals_can_outlast(lease: Duration, store_timeout: Duration) {
    if !renewals_can_outlast(lease, store_timeout) {
        return;
    }
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            lease_ms = lease.as_millis(),
            store_timeout_ms = store_timeout.as_millis(),
            "idempotency: a lease of at most twice the store timeout (plus 100 ms) can lapse \
             while its renewal, slow but within the timeout, is on its way, and let a \
             duplicate run the handler: lengthen the lease or shorten the store timeout"
        );
    });
}

/// Logs the panic that ended a request failing open; the error its client gets (500
/// `handler-panicked`).
fn panicked_failing_open(panic: &(dyn std::any::Any + Send)) -> actix_web::Error {
    tracing::error!(
        panic = panic_message(panic),
        "idempotency: the request panicked (fail-open)"
    );
    IdempotencyError::HandlerPanicked.into()
}

/// Whether `lease` can lapse while a renewal is on its way, every step slow but within
/// `store_timeout` (see [`warn_if_renewals_can_outlast`]).
fn renewals_can_outlast(lease: Duration, store_timeout: Duration) -> bool {
    lease <= store_timeout * 2 + RENEWAL_TICK
}

/// How long a request that waits for its key's run (`wait_for_completion`) sleeps before it
/// asks again: `pause`, or what is left until `deadline` if that is less, so that its last
/// `begin` is sent at the bound itself; `None` once the bound has passed (409 then), or
/// when it does not wait at all (no `deadline`).
pub(crate) fn wait_for_next_begin(deadline: Option<Instant>, pause: Duration) -> Option<Duration> {
    let left = deadline?.checked_duration_since(Instant::now())?;
    (!left.is_zero()).then(|| pause.min(left))
}

impl HeldLock {
    /// Reports the loss of this lock's record, once however many steps notice it.
    fn report_lost(&self, noticed_by: NoticedBy) {
        if !self.lost_reported.replace(true) {
            lost_record::report(&self.storage_key, noticed_by);
        }
    }

    /// Extends the lease to its current length, bounded by the store timeout.
    pub(crate) async fn renew(&self) -> Result<bool, StoreError> {
        self.renew_counted().await.0
    }

    /// [`renew`](Self::renew), and the moment the lease is counted from if it renewed.
    ///
    /// The lease is counted from when the renewal was sent: the store extends it as of some
    /// moment of the round trip, no earlier. Where another renewal of this lock was on its
    /// way when this one was sent, or one was given up since, from when the oldest of them
    /// was sent: a store may answer this renewal with that one's answer (the PostgreSQL
    /// store sends one renewal of a lease at a time, and a renewal sent while one is on its
    /// way waits for that one's answer), whose write may be older than this renewal. Two
    /// renewals of one lock meet when a route layer changes the lease, when the commit
    /// follows the handler, and after renewals given up by the store timeout.
    pub(crate) async fn renew_counted(&self) -> (Result<bool, StoreError>, Instant) {
        let lease = self.lease.get();
        self.shortest_lease_sent
            .set(self.shortest_lease_sent.get().min(lease));
        let sent = Instant::now();
        let counted_from = *self.unresolved_since.get().get_or_insert(sent);
        self.unresolved_since.set(Some(counted_from));
        let on_its_way = RenewalOnItsWay::start(&self.renewals_on_their_way);
        let renewal = self.store.renew(&self.storage_key, &self.token, lease);
        let renewed = within(StoreOperation::Renew, self.store_timeout, renewal).await;
        let others_on_their_way = on_its_way.answered();
        if let Ok(true) = renewed {
            self.renewed_at.set(counted_from);
            self.applied_lease.set(lease);
            if !others_on_their_way {
                self.unresolved_since.set(None);
            }
        }
        (renewed, counted_from)
    }

    /// Whether the lease is to be renewed now: a third of the lease the store holds has
    /// passed, or of the shortest lease sent for this lock if that is shorter, or the lease
    /// was changed and the store does not hold the new one yet (a route layer's renewal
    /// failed: the record still expires by the old one, however long the new one is).
    ///
    /// The shortest lease sent counts because a renewal given up by the store timeout may
    /// land after the renewals that followed it (a connection that stalled, then delivered
    /// it): where a route layer lengthened the lease, such a renewal of the old lease cut the
    /// record's expiry back to that lease while the lock went on being renewed every third of
    /// the new one, and a duplicate ran the handler a second time once it expired
    /// (`lease_timing.rs`).
    fn renewal_due(&self) -> bool {
        // `applied_lease` was sent too, so it is never shorter than `shortest_lease_sent`.
        self.lease.get() != self.applied_lease.get()
            || self.renewed_at.get().elapsed() >= self.shortest_lease_sent.get() / 3
    }
}

/// A renewal of a lock on its way, counted in the lock's `renewals_on_their_way` until it
/// is answered or dropped.
struct RenewalOnItsWay<'a>(&'a Cell<u32>);

impl<'a> RenewalOnItsWay<'a> {
    fn start(on_their_way: &'a Cell<u32>) -> Self {
        on_their_way.set(on_their_way.get() + 1);
        Self(on_their_way)
    }

    /// It was answered; whether other renewals of the lock are still on their way.
    fn answered(self) -> bool {
        self.0.get() > 1
    }
}

impl Drop for RenewalOnItsWay<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

/// Runs a store operation for at most `limit`, timed as `kind`.
pub(crate) async fn within<T>(
    kind: StoreOperation,
    limit: Duration,
    operation: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let started = Instant::now();
    let timer = StoreTimer::start(kind, started);
    let deadline = started + limit;
    let mut operation = std::pin::pin!(operation);
    // No timer while the operation waits on something that keeps the deadline itself (the
    // store's own Redis connection: see `store::deadline`), nor when it answers on the first
    // poll (the memory store, a cached reply): arming and disarming one costs more than
    // such an operation. A timer of its own from the first poll that leaves it waiting on
    // anything else.
    let mut fallback = std::pin::pin!(None::<actix_rt::time::Sleep>);
    let result = std::future::poll_fn(|cx| {
        let (polled, kept) =
            crate::store::deadline::polling(deadline, || operation.as_mut().poll(cx));
        if let Poll::Ready(result) = polled {
            return Poll::Ready(result);
        }
        if fallback.is_none() {
            if kept {
                return Poll::Pending;
            }
            fallback
                .as_mut()
                .set(Some(actix_rt::time::sleep_until(deadline.into())));
        }
        match fallback.as_mut().as_pin_mut() {
            Some(sleep) => sleep.poll(cx).map(|()| Err(StoreError::Timeout(limit))),
            None => Poll::Pending,
        }
    })
    .await;
    // A connection that kept the deadline answers a late command with an error of its own.
    let result = match result {
        // Not one that was never sent: that holds whenever it came.
        Err(error)
            if !matches!(error, StoreError::Timeout(_))
                && !error.was_not_sent()
                && Instant::now() >= deadline =>
        {
            tracing::debug!(%error, "idempotency: store operation past its deadline");
            Err(StoreError::Timeout(limit))
        }
        result => result,
    };
    timer.finish(&result);
    result
}

/// Reads the request body, refusing more than `limit` bytes, and refusing a body that has
/// no end (see [`asks_for_websocket_upgrade`] and [`opens_a_tunnel`]).
async fn read_body(req: &mut ServiceRequest, limit: usize) -> Result<Bytes, IdempotencyError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if asks_for_websocket_upgrade(req.headers()) || opens_a_tunnel(req, declared) {
        return Err(IdempotencyError::UpgradeRequested);
    }
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(IdempotencyError::RequestBodyTooLarge { limit });
    }
    let mut payload = req.take_payload();
    // A body that arrives in one chunk (most do) is kept as it came, without a copy.
    let mut first = None;
    let mut body = BytesMut::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(IdempotencyError::RequestBodyUnreadable)?;
        let read = first.as_ref().map_or(0, Bytes::len) + body.len();
        if read + chunk.len() > limit {
            return Err(IdempotencyError::RequestBodyTooLarge { limit });
        }
        match first.take() {
            None if body.is_empty() => first = Some(chunk),
            earlier => {
                if let Some(earlier) = earlier {
                    body.extend_from_slice(&earlier);
                }
                body.extend_from_slice(&chunk);
            }
        }
    }
    Ok(first.unwrap_or_else(|| body.freeze()))
}

/// Whether the request names `websocket` in an `Upgrade` header: Actix's HTTP/1 decoder then
/// makes its body whatever the connection carries until it ends, whatever its
/// `Content-Length` says, so reading it for the fingerprint would wait for the client to
/// close the connection.
fn asks_for_websocket_upgrade(headers: &header::HeaderMap) -> bool {
    headers.get_all(header::UPGRADE).any(|value| {
        value
            .to_str()
            .is_ok_and(|value| value.trim().eq_ignore_ascii_case("websocket"))
    })
}

/// Whether `req` is a `CONNECT` that declares no body (neither chunked nor a `Content-Length`
/// above 0): Actix's HTTP/1 decoder then makes its body whatever the connection carries
/// until it ends, as for a WebSocket upgrade.
fn opens_a_tunnel(req: &ServiceRequest, declared: Option<u64>) -> bool {
    let chunked = req.version() == actix_web::http::Version::HTTP_11
        && req
            .headers()
            .get(header::TRANSFER_ENCODING)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.trim().eq_ignore_ascii_case("chunked"));
    req.method() == actix_web::http::Method::CONNECT
        && !chunked
        && declared.is_none_or(|length| length == 0)
}

/// Updates the handle the layer that took `req` left (in place: no second extension); a
/// request without one gets one, for `engine`.
fn update_handle(
    req: &ServiceRequest,
    engine: &Rc<Engine>,
    update: impl FnOnce(&mut EngineHandle),
) {
    let mut extensions = req.extensions_mut();
    match extensions.get_mut::<EngineHandle>() {
        Some(handle) => update(handle),
        None => {
            let mut handle = EngineHandle::new(engine);
            update(&mut handle);
            extensions.insert(handle);
        }
    }
}

/// Claims `req` for `engine` (see [`update_handle`]).
fn claim(req: &ServiceRequest, engine: &Rc<Engine>, claimed: Claimed) {
    update_handle(req, engine, |handle| handle.claimed = Some(claimed));
}

/// Claims keyed `req` with no lock (yet), so that layers further in leave it alone; with
/// the size of its body once read, for a route layer's smaller limit.
fn claim_keyed(req: &ServiceRequest, engine: &Rc<Engine>, body_len: Option<usize>) {
    let claimed = Claimed {
        key_present: true,
        lock: None,
        body_len,
    };
    claim(req, engine, claimed);
}

/// Hands `lock` to the layers further in, through the claim made when the request was
/// taken.
pub(crate) fn claim_with_lock(req: &ServiceRequest, engine: &Rc<Engine>, lock: &Rc<HeldLock>) {
    let claimed = Claimed {
        key_present: true,
        lock: Some(Rc::clone(lock)),
        body_len: None,
    };
    claim(req, engine, claimed);
}

/// Records that `req` goes on without a key, and claims it so that layers further in leave
/// it alone.
fn claim_without_key(req: &ServiceRequest, engine: &Rc<Engine>) {
    update_handle(req, engine, go_on_without_key);
}

/// Records in `handle` that its request goes on without a key: the outcome in its record,
/// if one started, and the claim.
fn go_on_without_key(handle: &mut EngineHandle) {
    if let Some(record) = &handle.record {
        record.decide(Outcome::NoKey);
    }
    handle.claimed = Some(Claimed::without_key());
}

/// The safe methods (RFC 9110 §9.2.1, and `QUERY` by the IETF draft "The HTTP QUERY
/// Method"), as HTTP writes them: idempotent by definition, so never protected, whatever a
/// route or `protect_methods` says. `#[idempotent]` refuses a route that has only these; its
/// own list is checked against this one (`idempotency-macros/src/expand.rs`).
pub const SAFE_METHODS: [&str; 5] = ["GET", "HEAD", "OPTIONS", "TRACE", "QUERY"];

/// Whether `method` is one of the [`SAFE_METHODS`], never touched.
pub(crate) fn is_safe_method(method: &actix_web::http::Method) -> bool {
    SAFE_METHODS.contains(&method.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Helper 41's run: a 3 s lease under a 2 s store timeout lapsed between two renewals that
    /// each answered within the timeout; the old bound (1.5 times the timeout) let it pass.
    #[test]
    fn a_lease_is_short_where_two_slow_renewals_can_outlast_it() {
        let (timeout, ms) = (Duration::from_secs(2), Duration::from_millis);
        for short in [500, 3_000, 4_000, 4_100] {
            assert!(renewals_can_outlast(ms(short), timeout), "{short} ms");
        }
        for long in [4_101, 30_000] {
            assert!(!renewals_can_outlast(ms(long), timeout), "{long} ms");
        }
    }
}
