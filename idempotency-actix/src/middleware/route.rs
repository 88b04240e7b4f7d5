//! [`IdempotentRoute`]: one route's idempotency policy, applied after routing.

use std::future::{Ready, ready};
use std::rc::Rc;
use std::sync::LazyLock;
use std::time::Instant;

use actix_service::{Service, Transform, forward_ready};
use actix_web::HttpMessage;
use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};

use super::{IdempotencyFuture, answer, pass_through, process, refuse_claimed_further_out};
use crate::engine::{Claimed, EngineHandle, Response, is_safe_method, refuse, with_handler_body};
use crate::error::IdempotencyError;
use crate::log_interval::LogInterval;
use crate::policy::IdempotencyPolicy;
use crate::route_label::RouteLabels;

/// The line of a route's lease not applied at once, logged at most once per interval for the
/// process: a store that is down fails it for every request.
static LEASE_NOT_APPLIED: LazyLock<LogInterval> = LazyLock::new(LogInterval::new);

/// Route-level idempotency: protects the route it wraps with its own policy, on the store of
/// the [`Idempotency`](crate::Idempotency) above it.
///
/// [`#[idempotent(...)]`](crate::idempotent) attaches this to a route for you. Use it directly
/// for routes registered by hand. Without an `Idempotency` on the app (or an enclosing scope)
/// it answers 500 and logs what is missing. Safe methods (`GET`, `HEAD`, `OPTIONS`, `TRACE`,
/// `QUERY`) pass through untouched.
///
/// When an app-level [`Idempotency`](crate::Idempotency) also protects the route's method
/// (`protect_methods`), the app layer takes the request before routing and processes it once,
/// and this layer hands it the route's policy: `ttl`, `lease` (applied as soon as the route
/// is reached), `required`, `store_errors` (or `release_errors`), `max_stored_body` and a
/// `max_request_body` smaller than the app's all apply. Three things are decided before
/// routing and stay the app's: a `max_request_body` larger than the app's,
/// `wait_for_completion`, and a keyless request under an app policy that requires a key
/// (which `optional` cannot let through). A transactional route answers 500 there, as its
/// record would be claimed outside its transaction. The same holds under an
/// `IdempotentRoute` on an enclosing scope, which takes the request before this one.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use actix_web::{App, HttpResponse, web};
/// use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute};
///
/// async fn charge() -> HttpResponse {
///     HttpResponse::Ok().finish()
/// }
///
/// let app = App::new().wrap(Idempotency::memory()).service(
///     web::resource("/charges")
///         .wrap(IdempotentRoute::with_policy(
///             IdempotencyPolicy::default().ttl(Duration::from_secs(3600)).required(),
///         ))
///         .route(web::post().to(charge)),
/// );
/// ```
#[derive(Debug, Clone, Default)]
pub struct IdempotentRoute {
    policy: IdempotencyPolicy,
}

impl IdempotentRoute {
    /// Protection with the app's defaults.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, web};
    /// use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute};
    ///
    /// assert_eq!(IdempotentRoute::new().policy(), &IdempotencyPolicy::default());
    /// let app = App::new().wrap(Idempotency::memory()).service(
    ///     web::resource("/charges")
    ///         .wrap(IdempotentRoute::new())
    ///         .route(web::post().to(HttpResponse::Created)),
    /// );
    /// ```
    pub fn new() -> Self {
        Self::default()
    }

    /// Protection with `policy`'s overrides of the app's defaults.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, test, web};
    /// use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, MemoryStore};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let required = IdempotentRoute::with_policy(IdempotencyPolicy::default().required());
    /// let app = test::init_service(App::new().wrap(Idempotency::new(MemoryStore::new())).service(
    ///     web::resource("/charges").wrap(required).route(web::post().to(HttpResponse::Created)),
    /// ))
    /// .await;
    /// let keyless = test::TestRequest::post().uri("/charges").to_request();
    /// assert_eq!(test::call_service(&app, keyless).await.status(), 400);
    /// # });
    /// ```
    pub fn with_policy(policy: IdempotencyPolicy) -> Self {
        Self { policy }
    }

    /// The overrides this route applies.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::{IdempotencyPolicy, IdempotentRoute};
    ///
    /// let policy = IdempotencyPolicy::default().ttl(Duration::from_secs(60));
    /// let route = IdempotentRoute::with_policy(policy.clone());
    /// assert_eq!(route.policy(), &policy);
    /// ```
    pub fn policy(&self) -> &IdempotencyPolicy {
        &self.policy
    }
}

impl<S, B> Transform<S, ServiceRequest> for IdempotentRoute
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = Response<B>;
    type Error = actix_web::Error;
    type Transform = IdempotentRouteMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotentRouteMiddleware {
            service: Rc::new(service),
            policy: Rc::new(self.policy.clone()),
            route_labels: Rc::default(),
        }))
    }
}

/// The service [`IdempotentRoute`] wraps around a route.
///
/// # Examples
///
/// ```
/// use actix_web::{App, HttpResponse, test, web};
/// use idempotency_actix::{Idempotency, IdempotentRoute, MemoryStore};
///
/// # actix_web::rt::System::new().block_on(async {
/// let store = MemoryStore::new();
/// // `wrap(IdempotentRoute::new())` puts one around the route's handler:
/// let charges = web::resource("/charges")
///     .wrap(IdempotentRoute::new())
///     .route(web::post().to(HttpResponse::Created));
/// let app = App::new().wrap(Idempotency::new(store.clone())).service(charges);
/// let app = test::init_service(app).await;
/// let charge = test::TestRequest::post().uri("/charges").insert_header(("Idempotency-Key", "c1"));
/// assert_eq!(test::call_service(&app, charge.to_request()).await.status(), 201);
/// assert_eq!(store.len(), 1);
/// # });
/// ```
pub struct IdempotentRouteMiddleware<S> {
    service: Rc<S>,
    policy: Rc<IdempotencyPolicy>,
    route_labels: Rc<RouteLabels>,
}

impl<S, B> Service<ServiceRequest> for IdempotentRouteMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = Response<B>;
    type Error = actix_web::Error;
    type Future = IdempotencyFuture<S, B>;

    forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        if is_safe_method(req.method()) {
            return pass_through(&*self.service, req);
        }
        let (engine, claimed, claimed_further_out) = match req.extensions().get::<EngineHandle>() {
            Some(handle) => (
                Some(Rc::clone(&handle.engine)),
                handle.claimed.clone(),
                handle.claimed_further_out,
            ),
            None => (None, None, false),
        };
        let Some(engine) = engine else {
            tracing::error!(
                path = req.path(),
                "#[idempotent] route without idempotency state: add .wrap(Idempotency::redis(pool)) \
                 (or Idempotency::memory() / Idempotency::new(store)) to the App or an enclosing scope"
            );
            return answer::<S, B>(refuse(req.into_parts().0, &IdempotencyError::NotConfigured));
        };
        if claimed.is_some() && self.policy.is_transactional() {
            tracing::error!(
                path = req.path(),
                "a transactional route is also covered by a layer further out that claimed the \
                 request outside any transaction (Idempotency::protect_methods, before routing, \
                 or an IdempotentRoute on an enclosing scope): leave this method out of \
                 protect_methods, or take that layer off the scope"
            );
            return answer::<S, B>(refuse(req.into_parts().0, &IdempotencyError::NotConfigured));
        }
        if claimed_further_out {
            return answer::<S, B>(refuse_claimed_further_out(req));
        }
        match claimed {
            // An outer layer already processes this request: we still enforce a required key
            // and our body limit, and hand our policy to the lock it holds.
            Some(Claimed {
                key_present: false, ..
            }) if self.policy.requires_key() => {
                answer::<S, B>(refuse(req.into_parts().0, &IdempotencyError::MissingKey))
            }
            Some(Claimed {
                lock: Some(lock), ..
            }) => {
                // A route layer further out under the same claim (one on a scope) left its
                // overrides in the lock: ours go on top of them, as they would have had that
                // layer claimed the request itself.
                let overrides = match lock.route_policy.borrow().as_ref() {
                    Some(outer) => self.policy.over(outer),
                    None => IdempotencyPolicy::clone(&self.policy),
                };
                // Only what the route layers set: an option they leave unset is the claiming
                // layer's, which applied it already (the App's default, or the policy of a
                // route layer on a scope that took the request itself).
                if let Some(limit) = overrides
                    .max_request_body_override()
                    .filter(|limit| lock.body_len > *limit)
                {
                    let error = IdempotencyError::RequestBodyTooLarge { limit };
                    return answer::<S, B>(refuse(req.into_parts().0, &error));
                }
                let lease = overrides
                    .lease_override()
                    .unwrap_or_else(|| lock.lease.get());
                lock.route_policy.replace(Some(overrides));
                crate::engine::warn_if_renewals_can_outlast(lease, engine.settings.store_timeout);
                if lock.lease.replace(lease) == lease {
                    return pass_through(&*self.service, req);
                }
                let service = Rc::clone(&self.service);
                IdempotencyFuture::processing(Box::pin(async move {
                    if let Err(error) = lock.renew().await
                        && let Some(unlogged) = LEASE_NOT_APPLIED.admit(Instant::now())
                    {
                        tracing::warn!(%error, unlogged, "idempotency: could not apply the route's lease; retried at the next renewal tick");
                    }
                    service.call(req).await.map(with_handler_body)
                }))
            }
            // A handler run without a lock (failing open with no token to run under) after
            // a body the claiming layer read: ours may be smaller.
            Some(Claimed {
                body_len: Some(body_len),
                ..
            }) => match self
                .policy
                .max_request_body_override()
                .filter(|limit| body_len > *limit)
            {
                Some(limit) => {
                    let error = IdempotencyError::RequestBodyTooLarge { limit };
                    answer::<S, B>(refuse(req.into_parts().0, &error))
                }
                None => pass_through(&*self.service, req),
            },
            Some(_) => pass_through(&*self.service, req),
            None => {
                let policy = self.policy.apply_to(&engine.settings.defaults);
                process(
                    engine,
                    policy,
                    req,
                    Rc::clone(&self.service),
                    &self.route_labels,
                )
            }
        }
    }
}
