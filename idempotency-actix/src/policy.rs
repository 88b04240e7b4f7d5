//! [`IdempotencyPolicy`] and [`Policy`]: how a protected request is treated, app-wide and per
//! route.

use std::time::Duration;

/// The default time a completed response is replayed for: 24 hours.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use idempotency_actix::{DEFAULT_TTL, Policy};
///
/// assert_eq!(Policy::default().ttl, DEFAULT_TTL);
/// assert_eq!(DEFAULT_TTL, Duration::from_secs(24 * 60 * 60));
/// ```
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// The default lease of an in-flight record: 30 seconds, renewed while the handler runs.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use idempotency_actix::{DEFAULT_LEASE, Policy};
///
/// assert_eq!(Policy::default().lease, DEFAULT_LEASE);
/// assert_eq!(DEFAULT_LEASE, Duration::from_secs(30));
/// ```
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default largest request body a keyed request may send: 1 MiB.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{DEFAULT_MAX_REQUEST_BODY, Policy};
///
/// assert_eq!(Policy::default().max_request_body, DEFAULT_MAX_REQUEST_BODY);
/// assert_eq!(DEFAULT_MAX_REQUEST_BODY, 1024 * 1024);
/// ```
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;
/// The default largest response body that is stored: 1 MiB.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{DEFAULT_MAX_STORED_BODY, Policy};
///
/// assert_eq!(Policy::default().max_stored_body, DEFAULT_MAX_STORED_BODY);
/// assert_eq!(DEFAULT_MAX_STORED_BODY, 1024 * 1024);
/// ```
pub const DEFAULT_MAX_STORED_BODY: usize = 1024 * 1024;

/// The longest ttl, lease or wait a policy accepts: 365 days (as `#[idempotent]` checks at
/// compile time).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use idempotency_actix::{IdempotencyPolicy, MAX_DURATION};
///
/// assert_eq!(MAX_DURATION, Duration::from_secs(365 * 24 * 60 * 60));
/// let longest = IdempotencyPolicy::default().ttl(MAX_DURATION); // accepted; a second more panics
/// ```
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The shortest lease a policy accepts: 500 ms. A lease is renewed every third of it while
/// the handler runs; one of a few milliseconds lapses before its first renewal can land (the
/// runtime's timers tick in milliseconds, a Redis round trip takes a fraction of one), and a
/// duplicate then takes the key and runs the handler a second time. The same holds for
/// renewals slow enough for the lease to lapse between two of them, which the store timeout
/// allows (2 s by default): a renewal waits for the previous one's answer, and each may
/// take up to the store timeout, so keep a lease above twice the store timeout plus 100 ms
/// (one at most that is logged as a warning, once).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
///
/// use idempotency_actix::{IdempotencyPolicy, MIN_LEASE};
///
/// assert_eq!(MIN_LEASE, Duration::from_millis(500));
/// let shortest = IdempotencyPolicy::default().lease(MIN_LEASE); // accepted; shorter panics
/// ```
pub const MIN_LEASE: Duration = Duration::from_millis(500);

/// Checks that `duration` is more than zero and at most [`MAX_DURATION`]: a zero lease would
/// let duplicates in, an endless ttl overflows expiry arithmetic.
pub(crate) const fn checked(duration: Duration) -> Duration {
    assert!(
        !duration.is_zero() && duration.as_nanos() <= MAX_DURATION.as_nanos(),
        "an idempotency ttl, lease, wait or timeout must be more than zero and at most 365 days"
    );
    duration
}

/// The effective policy of one protected request: the app's defaults with the route's
/// overrides applied.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use idempotency_actix::{Policy, IdempotencyPolicy};
///
/// let defaults = Policy::default();
/// assert_eq!(defaults.ttl, Duration::from_secs(86_400));
/// let route = IdempotencyPolicy::default().ttl(Duration::from_secs(60)).required();
/// let effective = route.apply_to(&defaults);
/// assert_eq!(effective.ttl, Duration::from_secs(60));
/// assert!(effective.required);
/// assert_eq!(effective.lease, defaults.lease);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// How long a completed response is replayed.
    pub ttl: Duration,
    /// How long an in-flight record holds the key without renewal.
    pub lease: Duration,
    /// Whether a request without a key is refused (400) instead of run unprotected.
    pub required: bool,
    /// The largest request body a keyed request may send (413 above).
    pub max_request_body: usize,
    /// The largest response body that is stored; a larger one is sent to the client and
    /// its record completes without a body.
    pub max_stored_body: usize,
    /// Whether responses with status >= 400 are stored too (by default they release the
    /// key, so a retry runs the handler again).
    pub store_errors: bool,
    /// How long a retry that finds its key in flight waits for the first request to finish
    /// (then replays its response) before answering 409; `None` answers 409 at once (the
    /// default).
    pub wait_for_completion: Option<Duration>,
    /// Whether the record is claimed inside a database transaction that the handler writes
    /// through (`IdempotentTransaction`), committed together
    /// with the stored response (needs the `postgres` feature and a
    /// `PostgresStore`).
    pub transactional: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            required: false,
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            max_stored_body: DEFAULT_MAX_STORED_BODY,
            store_errors: false,
            wait_for_completion: None,
            transactional: false,
        }
    }
}

impl Policy {
    /// How long the store remembers a token given up after a `begin` that did not answer
    /// (`IdempotencyStore::abandon`'s `remember_for`): the ttl, and at least the lease. A
    /// `begin` of that token landing after the marker is gone locks the key for a lease
    /// with no handler running, so on a route whose ttl is shorter than its lease the marker
    /// outlives the ttl.
    pub(crate) fn marker_lifetime(&self) -> Duration {
        self.ttl.max(self.lease)
    }

    /// Whether a response with `status` completes the record (otherwise the key is
    /// released). An informational status (1xx) is never stored, even with `store_errors`:
    /// it is not a final response, and replaying one would leave clients waiting for the
    /// response that follows it.
    pub(crate) fn stores_status(&self, status: actix_web::http::StatusCode) -> bool {
        !status.is_informational() && (self.store_errors || status.as_u16() < 400)
    }
}

/// The one policy type: how protected requests are treated, as overrides of the defaults.
/// Unset options keep the value of the level above.
///
/// The same type, with the same option names, sets the app's defaults
/// ([`Idempotency::policy`](crate::Idempotency::policy)) and one route's policy
/// ([`IdempotentRoute::with_policy`](crate::IdempotentRoute::with_policy), which is what
/// `#[idempotent(ttl = "..", required, ..)]` generates).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use actix_web::{App, HttpResponse, web};
/// use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, KeyScope};
///
/// // App-wide: a one-hour ttl and a required key.
/// let defaults = IdempotencyPolicy::default().ttl(Duration::from_secs(3600)).required();
/// // One route: store error responses too.
/// let route = IdempotentRoute::with_policy(IdempotencyPolicy::default().store_errors());
///
/// let app = App::new()
///     .wrap(Idempotency::memory().scope(KeyScope::global()).policy(defaults))
///     .service(
///         web::resource("/charges")
///             .wrap(route)
///             .route(web::post().to(HttpResponse::Ok)),
///     );
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdempotencyPolicy {
    ttl: Option<Duration>,
    lease: Option<Duration>,
    required: Option<bool>,
    max_request_body: Option<usize>,
    max_stored_body: Option<usize>,
    store_errors: Option<bool>,
    wait_for_completion: Option<Duration>,
    transactional: Option<bool>,
}

impl IdempotencyPolicy {
    /// Completed responses of this route are replayed for `ttl`.
    ///
    /// # Panics
    ///
    /// If `ttl` is zero or over [`MAX_DURATION`] (a configuration mistake).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::{IdempotencyPolicy, Policy};
    ///
    /// let policy = IdempotencyPolicy::default().ttl(Duration::from_secs(3600));
    /// assert_eq!(policy.apply_to(&Policy::default()).ttl, Duration::from_secs(3600));
    /// ```
    #[must_use]
    pub const fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(checked(ttl));
        self
    }

    /// In-flight records of this route hold the key for `lease` without renewal.
    ///
    /// # Panics
    ///
    /// If `lease` is under [`MIN_LEASE`] or over [`MAX_DURATION`] (a configuration mistake).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::{IdempotencyPolicy, MIN_LEASE, Policy};
    ///
    /// // A handler that may take minutes (a slow payment provider): a longer lease.
    /// let policy = IdempotencyPolicy::default().lease(Duration::from_secs(120));
    /// assert_eq!(policy.apply_to(&Policy::default()).lease, Duration::from_secs(120));
    /// assert_eq!(MIN_LEASE, Duration::from_millis(500)); // the shortest accepted
    /// ```
    #[must_use]
    pub const fn lease(mut self, lease: Duration) -> Self {
        assert!(
            lease.as_millis() >= MIN_LEASE.as_millis(),
            "an idempotency lease must be at least 500 ms: a shorter one can lapse before its \
             renewal lands and let a duplicate run the handler"
        );
        self.lease = Some(checked(lease));
        self
    }

    /// Requests to this route without a key are refused with 400.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyPolicy, Policy};
    ///
    /// assert!(!Policy::default().required);
    /// assert!(IdempotencyPolicy::default().required().apply_to(&Policy::default()).required);
    /// ```
    #[must_use]
    pub const fn required(mut self) -> Self {
        self.required = Some(true);
        self
    }

    /// Requests to this route without a key are let through unprotected (the default), even
    /// under an app policy that is [`required`](Self::required): it undoes that for this
    /// route. (Not where the App's layer claims the route's method with
    /// [`Idempotency::protect_methods`](crate::Idempotency::protect_methods), nor under an
    /// [`IdempotentRoute`](crate::IdempotentRoute) on an enclosing scope whose policy, its
    /// own or the App's, requires a key: that layer refuses a keyless request before the
    /// route's own layer sees it.)
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute};
    ///
    /// // Every protected route requires a key, but this one.
    /// let app = Idempotency::memory().policy(IdempotencyPolicy::default().required());
    /// let webhook = IdempotentRoute::with_policy(IdempotencyPolicy::default().optional());
    /// ```
    #[must_use]
    pub const fn optional(mut self) -> Self {
        self.required = Some(false);
        self
    }

    /// Keyed requests to this route may send at most `bytes` of body (413 above).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, IdempotencyPolicy, MemoryStore};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let small = IdempotencyPolicy::default().max_request_body(16);
    /// let idempotency = Idempotency::new(MemoryStore::new()).policy(small);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Ok))).await;
    /// let request = test::TestRequest::post().insert_header(("Idempotency-Key", "k"));
    /// let too_large = request.set_payload("x".repeat(17)).to_request();
    /// let response = test::call_service(&app, too_large).await;
    /// assert_eq!(response.status(), 413);
    /// # });
    /// ```
    #[must_use]
    pub const fn max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = Some(bytes);
        self
    }

    /// Responses of this route larger than `bytes` are not stored (the record completes
    /// without a body).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{BODY_OMITTED_HEADER, Idempotency, IdempotencyPolicy, MemoryStore};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let policy = IdempotencyPolicy::default().max_stored_body(4);
    /// let idempotency = Idempotency::new(MemoryStore::new()).policy(policy);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let handler = || async { HttpResponse::Ok().body("a long report") };
    /// let app = test::init_service(app.route("/", web::post().to(handler))).await;
    /// let request =
    ///     || test::TestRequest::post().insert_header(("Idempotency-Key", "k")).to_request();
    /// let first = test::call_service(&app, request()).await;
    /// assert_eq!(test::read_body(first).await, "a long report"); // sent whole
    /// let replay = test::call_service(&app, request()).await;
    /// assert_eq!(replay.headers().get(BODY_OMITTED_HEADER).unwrap(), "true");
    /// assert!(test::read_body(replay).await.is_empty());
    /// # });
    /// ```
    #[must_use]
    pub const fn max_stored_body(mut self, bytes: usize) -> Self {
        self.max_stored_body = Some(bytes);
        self
    }

    /// Responses of this route with status >= 400 are stored and replayed too, an error of
    /// a layer inside this one (its `Err`, as Actix renders it) included. On a transactional
    /// route such an error still rolls the transaction back and stores nothing.
    ///
    /// Every status >= 400 is stored, there is no choice by status: a route that stores a
    /// declined payment's 402 this way also stores a transient 500 or 503 of its handler
    /// (a payment provider that timed out) and the 400 of an extractor that refused the
    /// body, and replays them to every retry with that key for the whole ttl. A route whose
    /// retries must run again after a transient failure keeps the default, which releases
    /// the key on every status >= 400.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    ///
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, IdempotencyPolicy, MemoryStore};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let runs = Arc::new(AtomicUsize::new(0));
    /// let counted = Arc::clone(&runs);
    /// let declined = move || {
    ///     counted.fetch_add(1, Ordering::SeqCst);
    ///     async { HttpResponse::PaymentRequired().finish() }
    /// };
    /// let policy = IdempotencyPolicy::default().store_errors();
    /// let idempotency = Idempotency::new(MemoryStore::new()).policy(policy);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(declined))).await;
    /// for _ in 0..2 {
    ///     let request = test::TestRequest::post().insert_header(("Idempotency-Key", "k"));
    ///     assert_eq!(test::call_service(&app, request.to_request()).await.status(), 402);
    /// }
    /// assert_eq!(runs.load(Ordering::SeqCst), 1); // the retry got the stored 402
    /// # });
    /// ```
    #[must_use]
    pub const fn store_errors(mut self) -> Self {
        self.store_errors = Some(true);
        self
    }

    /// Responses of this route with status >= 400 are not stored (the default): the key is
    /// released and a retry runs the handler again, even under an app policy that
    /// [`store_errors`](Self::store_errors): it undoes that for this route.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyPolicy, Policy};
    ///
    /// let app_defaults = IdempotencyPolicy::default().store_errors().apply_to(&Policy::default());
    /// assert!(app_defaults.store_errors);
    /// let route = IdempotencyPolicy::default().release_errors();
    /// assert!(!route.apply_to(&app_defaults).store_errors);
    /// ```
    #[must_use]
    pub const fn release_errors(mut self) -> Self {
        self.store_errors = Some(false);
        self
    }

    /// A retry that finds its key in flight waits up to `bound` for the first request to
    /// finish and replays its response (409 if it is still running then). Should the first
    /// release the key instead (an error response, a panic), one waiting retry takes it and
    /// runs the handler, as any retry then would, and the others wait for that run. A store
    /// failure while it waits answers 503, or with [`FailMode::Open`](crate::FailMode::Open)
    /// 409: never an unprotected run beside the first.
    ///
    /// # Panics
    ///
    /// If `bound` is zero or over [`MAX_DURATION`] (a configuration mistake).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::{IdempotencyPolicy, Policy};
    ///
    /// let policy = IdempotencyPolicy::default().wait_for_completion(Duration::from_secs(5));
    /// let effective = policy.apply_to(&Policy::default());
    /// assert_eq!(effective.wait_for_completion, Some(Duration::from_secs(5)));
    /// assert_eq!(Policy::default().wait_for_completion, None); // 409 at once
    /// ```
    #[must_use]
    pub const fn wait_for_completion(mut self, bound: Duration) -> Self {
        self.wait_for_completion = Some(checked(bound));
        self
    }

    /// This route is transactional: its record is claimed inside a database transaction
    /// that the handler writes through with
    /// `IdempotentTransaction`; the handler's writes and its
    /// stored response commit together, or neither does. Needs `Idempotency::postgres`; on
    /// any other store the route answers 503 and logs why. A session that the database ends
    /// mid-handler rolls the claim back and a retry runs again, so side effects outside the
    /// database belong on plain routes (see `IdempotentTransaction`).
    ///
    /// Only with the `postgres` feature: without it a transactional route does not compile
    /// (it would have no store to run in, and no fail mode may run it unprotected);
    /// `#[idempotent(transactional)]` then says the feature is needed.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyPolicy, IdempotentRoute, Policy};
    ///
    /// // What `#[idempotent(transactional)]` attaches to its route:
    /// let route = IdempotentRoute::with_policy(IdempotencyPolicy::default().transactional());
    /// assert!(route.policy().apply_to(&Policy::default()).transactional);
    /// ```
    #[cfg(feature = "postgres")]
    #[must_use]
    pub const fn transactional(mut self) -> Self {
        self.transactional = Some(true);
        self
    }

    /// The effective policy: `defaults` with these overrides.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{DEFAULT_TTL, IdempotencyPolicy, Policy};
    ///
    /// let effective = IdempotencyPolicy::default().required().apply_to(&Policy::default());
    /// assert!(effective.required);
    /// assert_eq!(effective.ttl, DEFAULT_TTL); // not set: the level above's
    /// ```
    pub fn apply_to(&self, defaults: &Policy) -> Policy {
        Policy {
            ttl: self.ttl.unwrap_or(defaults.ttl),
            lease: self.lease.unwrap_or(defaults.lease),
            required: self.required.unwrap_or(defaults.required),
            max_request_body: self.max_request_body.unwrap_or(defaults.max_request_body),
            max_stored_body: self.max_stored_body.unwrap_or(defaults.max_stored_body),
            store_errors: self.store_errors.unwrap_or(defaults.store_errors),
            wait_for_completion: self.wait_for_completion.or(defaults.wait_for_completion),
            transactional: self.transactional.unwrap_or(defaults.transactional),
        }
    }

    /// These overrides on top of `outer`'s: an option this one leaves unset takes `outer`'s
    /// (a route layer inside another one, on a scope, under the App's claim).
    pub(crate) fn over(&self, outer: &Self) -> Self {
        Self {
            ttl: self.ttl.or(outer.ttl),
            lease: self.lease.or(outer.lease),
            required: self.required.or(outer.required),
            max_request_body: self.max_request_body.or(outer.max_request_body),
            max_stored_body: self.max_stored_body.or(outer.max_stored_body),
            store_errors: self.store_errors.or(outer.store_errors),
            wait_for_completion: self.wait_for_completion.or(outer.wait_for_completion),
            transactional: self.transactional.or(outer.transactional),
        }
    }

    /// The lease this route sets, if it sets one.
    pub(crate) fn lease_override(&self) -> Option<Duration> {
        self.lease
    }

    /// The request-body limit this route sets, if it sets one.
    pub(crate) fn max_request_body_override(&self) -> Option<usize> {
        self.max_request_body
    }

    /// Whether this route refuses requests without a key, whatever the app says.
    pub(crate) fn requires_key(&self) -> bool {
        self.required == Some(true)
    }

    /// Whether this route is transactional, whatever the app says.
    pub(crate) fn is_transactional(&self) -> bool {
        self.transactional == Some(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "at least 500 ms")]
    fn a_zero_lease_is_refused() {
        let _ = IdempotencyPolicy::default().lease(Duration::ZERO);
    }

    #[test]
    #[should_panic(expected = "at least 500 ms")]
    fn a_lease_of_a_few_milliseconds_is_refused() {
        let _ = IdempotencyPolicy::default().lease(Duration::from_millis(5));
    }

    #[test]
    fn the_shortest_lease_is_accepted() {
        let policy = IdempotencyPolicy::default()
            .lease(MIN_LEASE)
            .apply_to(&Policy::default());
        assert_eq!(policy.lease, MIN_LEASE);
    }

    #[test]
    #[should_panic(expected = "at most 365 days")]
    fn an_endless_ttl_is_refused() {
        let _ = IdempotencyPolicy::default().ttl(Duration::MAX);
    }

    /// Whole seconds were compared: 365 days and 999 ms passed (helper review).
    #[test]
    #[should_panic(expected = "at most 365 days")]
    fn a_year_and_a_millisecond_is_refused() {
        let _ = IdempotencyPolicy::default().ttl(MAX_DURATION + Duration::from_millis(1));
    }

    #[test]
    fn informational_statuses_are_never_stored() {
        use actix_web::http::StatusCode;
        let store_errors = IdempotencyPolicy::default()
            .store_errors()
            .apply_to(&Policy::default());
        for policy in [Policy::default(), store_errors] {
            for status in [100, 101, 103, 199] {
                assert!(!policy.stores_status(StatusCode::from_u16(status).unwrap()));
            }
            assert!(policy.stores_status(StatusCode::NO_CONTENT));
            assert!(policy.stores_status(StatusCode::NOT_MODIFIED));
        }
    }

    #[test]
    fn a_year_is_accepted() {
        let policy = IdempotencyPolicy::default()
            .ttl(MAX_DURATION)
            .apply_to(&Policy::default());
        assert_eq!(policy.ttl, MAX_DURATION);
    }
}
