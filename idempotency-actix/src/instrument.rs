//! Instrumentation: the one place where what the engine decides becomes tracing fields and,
//! with the `metrics` feature, metrics. The engine calls it once per outcome and once per
//! store operation; without the feature the metric calls compile to nothing.
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `idempotency_requests_total` | counter | `route`, `outcome` | protected requests, one per request, by what became of it |
//! | `idempotency_store_operation_duration_seconds` | histogram | `operation`, `result` | how long each store operation took (bounded by the store timeout) |
//! | `idempotency_requests_in_flight` | gauge | `route` | requests running their handler under a lock right now (a streamed response until its record is complete) |
//! | `idempotency_background_retries_total` | counter | `operation` | store operations retried off the request path |
//! | `idempotency_evictions_total` | counter | `source` | records evicted to stay within a byte bound |
//!
//! Labels take a bounded set of values: `route` is the matched route pattern
//! (`/orders/{id}`, never the raw path or the key; [`UNMATCHED_ROUTE`] when no route
//! matches), `outcome` one of [`Outcome::as_str`], `operation` one of `begin`, `renew`,
//! `commit`, `release`, `result` one of `ok`, `error`, `timeout`, `source` one of
//! [`EvictionSource::as_str`].

use std::cell::Cell;
use std::rc::Rc;

use actix_web::dev::{Extensions, ServiceRequest, ServiceResponse};
use actix_web::{HttpMessage, HttpRequest};
use tracing::Span;

use crate::engine::record_state;
use crate::error::IdempotencyError;
use crate::route_label::{RouteLabel, RouteLabels};
use crate::store::StoreError;

/// The `route` label of a request that matched no route pattern.
///
/// # Examples
///
/// ```
/// use idempotency_actix::UNMATCHED_ROUTE;
///
/// assert_eq!(UNMATCHED_ROUTE, "unmatched");
/// ```
pub const UNMATCHED_ROUTE: &str = "unmatched";

/// What became of one protected request: the `outcome` label of
/// `idempotency_requests_total` and the `outcome` field of its span.
///
/// # Examples
///
/// ```
/// use idempotency_actix::Outcome;
///
/// assert_eq!(Outcome::Replayed.as_str(), "replayed");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran under a lock (its response stored, or the key released after an
    /// error response or a panic).
    Executed,
    /// A stored response was replayed.
    Replayed,
    /// 409: the key is in flight.
    Conflict,
    /// 422: the key was used for another request.
    Mismatch,
    /// 400: the key is malformed or repeated.
    InvalidKey,
    /// 400: the route requires a key and there is none.
    MissingKey,
    /// The request had no key and the route does not require one: the handler ran
    /// unprotected.
    NoKey,
    /// 400: the key's scope could not be determined.
    MissingScope,
    /// 400: the request body could not be read, or has no end (a keyed request that asks
    /// for a WebSocket upgrade, or a keyed `CONNECT` that declares no body).
    BodyUnreadable,
    /// 413: the request body is over the limit.
    TooLarge,
    /// 503: the store failed or timed out (fail closed).
    StoreError,
    /// The store failed or timed out and the handler ran unprotected (fail open).
    FailOpen,
    /// 503: the worker was at its cap of keyed work; the handler did not run.
    Overloaded,
    /// 503: a new key while the process drained its keyed work before it stopped
    /// ([`Idempotency::drain`](crate::Idempotency::drain)); the handler did not run.
    ShuttingDown,
    /// The client left before anything was decided for its request: while its body was
    /// still arriving (its connection reset: one that only closes its side before its body is
    /// all sent gets a 400, [`BodyUnreadable`](Self::BodyUnreadable), as Actix reads a body
    /// cut short), while its `begin` was on its way to the store (its token is then
    /// abandoned in the background), or while it waited for another request with its key
    /// ([`wait_for_completion`](crate::IdempotencyPolicy::wait_for_completion)). The handler
    /// did not run for it. A request the server drops as it stops (at the end of its
    /// shutdown timeout) at such a point counts here too.
    ClientGone,
}

impl Outcome {
    /// Every outcome, for dashboards and tests.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::Outcome;
    ///
    /// assert!(Outcome::ALL.contains(&Outcome::Replayed));
    /// let labels: Vec<&str> = Outcome::ALL.iter().map(|outcome| outcome.as_str()).collect();
    /// assert!(labels.contains(&"fail_open"));
    /// ```
    pub const ALL: [Self; 15] = [
        Self::Executed,
        Self::Replayed,
        Self::Conflict,
        Self::Mismatch,
        Self::InvalidKey,
        Self::MissingKey,
        Self::NoKey,
        Self::MissingScope,
        Self::BodyUnreadable,
        Self::TooLarge,
        Self::StoreError,
        Self::FailOpen,
        Self::Overloaded,
        Self::ShuttingDown,
        Self::ClientGone,
    ];

    /// The label value: `executed`, `replayed`, `conflict`, `mismatch`, `invalid_key`,
    /// `missing_key`, `no_key`, `missing_scope`, `body_unreadable`, `too_large`,
    /// `store_error`, `fail_open`, `overloaded`, `shutting_down` or `client_gone`.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::Outcome;
    ///
    /// assert_eq!(Outcome::Executed.as_str(), "executed");
    /// assert_eq!(Outcome::InvalidKey.as_str(), "invalid_key");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::InvalidKey => "invalid_key",
            Self::MissingKey => "missing_key",
            Self::NoKey => "no_key",
            Self::MissingScope => "missing_scope",
            Self::BodyUnreadable => "body_unreadable",
            Self::TooLarge => "too_large",
            Self::StoreError => "store_error",
            Self::FailOpen => "fail_open",
            Self::Overloaded => "overloaded",
            Self::ShuttingDown => "shutting_down",
            Self::ClientGone => "client_gone",
        }
    }

    /// The outcome of a request refused with `error`, if it was refused rather than run.
    pub(crate) fn of_refusal(error: &IdempotencyError) -> Option<Self> {
        Some(match error {
            IdempotencyError::MissingKey => Self::MissingKey,
            IdempotencyError::InvalidKey(_) => Self::InvalidKey,
            IdempotencyError::MissingScope => Self::MissingScope,
            IdempotencyError::RequestBodyTooLarge { .. } => Self::TooLarge,
            IdempotencyError::RequestBodyUnreadable(_) | IdempotencyError::UpgradeRequested => {
                Self::BodyUnreadable
            }
            IdempotencyError::InFlight { .. } => Self::Conflict,
            IdempotencyError::FingerprintMismatch => Self::Mismatch,
            IdempotencyError::StoreUnavailable { .. }
            | IdempotencyError::CommitUnconfirmed { .. }
            | IdempotencyError::TransactionUnavailable { .. } => Self::StoreError,
            IdempotencyError::Overloaded { .. } => Self::Overloaded,
            IdempotencyError::ShuttingDown { .. } => Self::ShuttingDown,
            // A panic is the outcome of an executed request; a route layer without an
            // `Idempotency` above it has no request record to count in (it logs an error).
            IdempotencyError::HandlerPanicked | IdempotencyError::NotConfigured => return None,
        })
    }
}

/// A store operation, the `operation` label of the store metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreOperation {
    Begin,
    Renew,
    Commit,
    Release,
}

impl StoreOperation {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    const fn as_str(self) -> &'static str {
        match self {
            Self::Begin => "begin",
            Self::Renew => "renew",
            Self::Commit => "commit",
            Self::Release => "release",
        }
    }
}

/// Which bounded cache evicted records: the `source` label of `idempotency_evictions_total`.
///
/// # Examples
///
/// ```
/// use idempotency_actix::EvictionSource;
///
/// assert_eq!(EvictionSource::MemoryStore.as_str(), "memory_store");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EvictionSource {
    /// The in-memory store, evicting completed records to stay within its bound.
    MemoryStore,
    /// The local replay cache in front of a shared store.
    ReplayCache,
}

impl EvictionSource {
    /// The label value: `memory_store` or `replay_cache`.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::EvictionSource;
    ///
    /// assert_eq!(EvictionSource::ReplayCache.as_str(), "replay_cache");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::MemoryStore => "memory_store",
            Self::ReplayCache => "replay_cache",
        }
    }
}

/// Counts `count` records evicted by `source` in `idempotency_evictions_total`.
///
/// Stores and caches that evict records to stay within a bound call this once per
/// eviction pass. Without the `metrics` feature it does nothing.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{EvictionSource, record_evictions};
///
/// // A cache that just dropped three replayable responses to make room:
/// record_evictions(EvictionSource::ReplayCache, 3);
/// ```
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub fn record_evictions(source: EvictionSource, count: u64) {
    #[cfg(feature = "metrics")]
    {
        describe_once();
        crate::metric_handles::count_evictions(source.as_str(), count);
    }
}

/// Describes every metric of this crate (help text and unit) to the installed recorder.
///
/// Called by the middleware once, the first time it records anything; call it yourself
/// only if you install a recorder after that. Without the `metrics` feature it does
/// nothing.
///
/// # Examples
///
/// ```
/// idempotency_actix::describe_metrics();
/// ```
pub fn describe_metrics() {
    #[cfg(feature = "metrics")]
    names::describe();
}

/// Metric names, help texts and units.
#[cfg(feature = "metrics")]
pub(crate) mod names {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};

    pub(crate) const REQUESTS: &str = "idempotency_requests_total";
    pub(crate) const STORE_DURATION: &str = "idempotency_store_operation_duration_seconds";
    pub(crate) const IN_FLIGHT: &str = "idempotency_requests_in_flight";
    pub(crate) const BACKGROUND_RETRIES: &str = "idempotency_background_retries_total";
    pub(crate) const EVICTIONS: &str = "idempotency_evictions_total";

    pub(super) fn describe() {
        describe_counter!(
            REQUESTS,
            Unit::Count,
            "Protected requests by matched route pattern and outcome."
        );
        describe_histogram!(
            STORE_DURATION,
            Unit::Seconds,
            "Duration of idempotency store operations (begin, renew, commit, release)."
        );
        describe_gauge!(
            IN_FLIGHT,
            Unit::Count,
            "Protected requests running their handler under an idempotency lock."
        );
        describe_counter!(
            BACKGROUND_RETRIES,
            Unit::Count,
            "Store operations retried in the background after a failure on the request path."
        );
        describe_counter!(
            EVICTIONS,
            Unit::Count,
            "Records evicted from a bounded cache (memory store, replay cache)."
        );
    }
}

/// Describes the metrics to the recorder installed when the first one is recorded.
#[cfg(feature = "metrics")]
fn describe_once() {
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(describe_metrics);
}

/// One protected request, from the engine's first look until its response: its span, its
/// route label and the outcome decided for it (the last decision wins, so a route layer
/// that refuses a request an app layer passed on has the last word). Recorded once, when
/// the request finishes, or when its future is dropped (the client left; a handler that
/// runs under a lock then goes on by itself, and its request still counts).
pub(crate) struct RequestRecord {
    span: Span,
    state: Rc<RequestState>,
    /// Whether [`finish`](Self::finish) recorded the request.
    finished: bool,
}

/// What [`RequestRecord`] shares with the layers, through the request's
/// [`EngineHandle`](crate::engine::EngineHandle): its route label and the outcome decided
/// so far.
pub(crate) struct RequestState {
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    route: Option<RouteLabel>,
    outcome: Cell<Option<Outcome>>,
}

impl RequestRecord {
    /// Opens the request's span. The caller makes its [`shared_state`](Self::shared_state)
    /// reachable by later layers, in the request's
    /// [`EngineHandle`](crate::engine::EngineHandle) (one extension for the
    /// engine, the claim and the record: each extension a request gets costs an allocation
    /// and an insertion). `route_labels` is the calling layer's: it finds the route label.
    pub(crate) fn start(req: &ServiceRequest, route_labels: &RouteLabels) -> Self {
        let span = tracing::info_span!(
            "idempotency",
            http.route = tracing::field::Empty,
            outcome = tracing::field::Empty,
            http.response.status_code = tracing::field::Empty,
        );
        // The pattern may cost a lookup and an allocation: only when someone will read it.
        let route =
            (cfg!(feature = "metrics") || !span.is_disabled()).then(|| route_labels.of(req));
        if let Some(route) = &route
            && !span.is_disabled()
        {
            span.record("http.route", route.as_str());
        }
        let state = Rc::new(RequestState {
            route,
            outcome: Cell::new(None),
        });
        Self {
            span,
            state,
            finished: false,
        }
    }

    /// What the layers further in reach of this record (see [`decided`]).
    pub(crate) fn shared_state(&self) -> Rc<RequestState> {
        Rc::clone(&self.state)
    }

    /// The request's span, if a subscriber wants it: the request's processing runs in it
    /// (`.instrument(span)`); otherwise it runs as it is.
    ///
    /// A span no subscriber wants is neither entered nor given fields: with tracing's `log`
    /// feature on (Actix turns it on) each enter, exit and field of a disabled span still
    /// asks the `log` crate whether to print it, about 750 instructions per request that
    /// no one reads. The caller awaits its work itself, between [`start`](Self::start) and
    /// [`finish`](Self::finish), rather than through a wrapping future: a request's future
    /// is then built once in its box, not built and moved into one layer after another.
    pub(crate) fn wanted_span(&self) -> Option<Span> {
        (!self.span.is_disabled()).then(|| self.span.clone())
    }

    /// Records the outcome and the status, once, when the request is done.
    pub(crate) fn finish<B>(mut self, result: &Result<ServiceResponse<B>, actix_web::Error>) {
        if !self.span.is_disabled() {
            let status = match result {
                Ok(response) => response.status(),
                Err(error) => error.as_response_error().status_code(),
            };
            self.span
                .record("http.response.status_code", status.as_u16());
        }
        self.record_outcome(None);
        self.finished = true;
    }

    /// Records the outcome decided so far, else `undecided`, if either is an outcome.
    fn record_outcome(&self, undecided: Option<Outcome>) {
        let traced = !self.span.is_disabled();
        let Some(outcome) = self.state.outcome.get().or(undecided) else {
            return;
        };
        if traced {
            self.span.record("outcome", outcome.as_str());
        }
        tracing::debug!(parent: &self.span, "idempotency: request finished");
        #[cfg(feature = "metrics")]
        {
            describe_once();
            route_handles_of(Some(&self.state)).count_request(outcome.as_str());
        }
    }
}

/// A request whose future was dropped before it finished (its client left) is recorded with
/// the outcome decided so far, or as [`Outcome::ClientGone`] where none was, and no status.
impl Drop for RequestRecord {
    fn drop(&mut self) {
        if !self.finished {
            self.record_outcome(Some(Outcome::ClientGone));
        }
    }
}

impl RequestState {
    /// Records `outcome` as what became of the request (the last decision wins).
    pub(crate) fn decide(&self, outcome: Outcome) {
        self.outcome.set(Some(outcome));
    }
}

/// Records what became of the request whose extensions these are.
pub(crate) fn decided(extensions: &Extensions, outcome: Outcome) {
    if let Some(state) = record_state(extensions) {
        state.decide(outcome);
    }
}

/// Records the outcome of a request refused with `error`: in its record when the engine
/// keeps one, else (refused before the engine took it) counted at once.
pub(crate) fn refused(request: &HttpRequest, error: &IdempotencyError) {
    let Some(outcome) = Outcome::of_refusal(error) else {
        return;
    };
    let extensions = request.extensions();
    if let Some(state) = record_state(&extensions) {
        state.decide(outcome);
    } else {
        count_now(request, outcome);
    }
}

/// Counts the outcome of a request that has no record.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
fn count_now(request: &HttpRequest, outcome: Outcome) {
    #[cfg(feature = "metrics")]
    {
        describe_once();
        let route = request.match_pattern();
        let route = route.as_deref().unwrap_or(UNMATCHED_ROUTE);
        crate::metric_handles::route_handles(route).count_request(outcome.as_str());
    }
}

/// Counts the request in `idempotency_requests_in_flight` until the guard is dropped.
pub(crate) struct LockHeld {
    /// The route's metrics, whose gauge the guard moves up and then down again.
    #[cfg(feature = "metrics")]
    route: Rc<crate::metric_handles::RouteHandles>,
}

impl LockHeld {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn enter(extensions: &Extensions) -> Self {
        #[cfg(feature = "metrics")]
        {
            let route = route_handles_of(record_state(extensions));
            route.in_flight().increment(1.0);
            Self { route }
        }
        #[cfg(not(feature = "metrics"))]
        Self {}
    }
}

#[cfg(feature = "metrics")]
impl Drop for LockHeld {
    fn drop(&mut self) {
        self.route.in_flight().decrement(1.0);
    }
}

/// The request metrics of the route `state` is recorded under ([`UNMATCHED_ROUTE`]'s for a
/// request without a record or a route label).
#[cfg(feature = "metrics")]
fn route_handles_of(state: Option<&RequestState>) -> Rc<crate::metric_handles::RouteHandles> {
    match state.and_then(|state| state.route.as_ref()) {
        Some(route) => route.handles(),
        None => crate::metric_handles::route_handles(UNMATCHED_ROUTE),
    }
}

/// Times one store operation into `idempotency_store_operation_duration_seconds`.
pub(crate) struct StoreTimer {
    #[cfg(feature = "metrics")]
    operation: StoreOperation,
    #[cfg(feature = "metrics")]
    started: std::time::Instant,
}

impl StoreTimer {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn start(operation: StoreOperation, started: std::time::Instant) -> Self {
        Self {
            #[cfg(feature = "metrics")]
            operation,
            #[cfg(feature = "metrics")]
            started,
        }
    }

    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn finish<T>(self, result: &Result<T, StoreError>) {
        #[cfg(feature = "metrics")]
        {
            let result = match result {
                Ok(_) => "ok",
                Err(StoreError::Timeout(_)) => "timeout",
                Err(_) => "error",
            };
            crate::metric_handles::record_store_duration(
                self.operation.as_str(),
                result,
                self.started.elapsed().as_secs_f64(),
            );
        }
    }
}

/// Counts one background retry of `operation` in `idempotency_background_retries_total`.
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn background_retry(operation: StoreOperation) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(names::BACKGROUND_RETRIES, "operation" => operation.as_str()).increment(1);
}
