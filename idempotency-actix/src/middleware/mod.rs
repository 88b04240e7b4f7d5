//! The two layers: [`Idempotency`] (store and defaults; App, scope or resource) and
//! [`IdempotentRoute`] (one route's policy; what `#[idempotent]` attaches).

use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use futures_util::future::{Either, LocalBoxFuture, MapOk, TryFutureExt};
use pin_project_lite::pin_project;

use crate::built_in_box::built_in_box;
use crate::engine::{Engine, Response, refuse, with_handler_body};
use crate::error::IdempotencyError;
use crate::policy::Policy;

mod app;
mod route;

pub use self::app::{Idempotency, IdempotencyMiddleware};
pub use self::route::{IdempotentRoute, IdempotentRouteMiddleware};

type PassThrough<S, B> =
    MapOk<<S as Service<ServiceRequest>>::Future, fn(ServiceResponse<B>) -> Response<B>>;
type Processing<B> = LocalBoxFuture<'static, Result<Response<B>, actix_web::Error>>;

pin_project! {
    /// The future of both middleware services' responses. A request the middleware does not
    /// touch costs no allocation: it is the inner service's own future.
    pub struct IdempotencyFuture<S, B>
    where
        S: Service<ServiceRequest>,
    {
        #[pin]
        inner: Either<PassThrough<S, B>, Processing<B>>,
    }
}

impl<S, B> Future for IdempotencyFuture<S, B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
{
    type Output = Result<Response<B>, actix_web::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx)
    }
}

impl<S: Service<ServiceRequest>, B> IdempotencyFuture<S, B> {
    pub(super) fn processing(future: Processing<B>) -> Self {
        Self {
            inner: Either::Right(future),
        }
    }
}

/// Refuses a request that a layer further out took charge of (an `Idempotency` whose
/// `protect_methods` claimed it before routing, or a route layer; with its own store, key
/// scope and settings) where a nearer `Idempotency`, or a route under it, would protect it:
/// which store and key scope hold the key must not depend silently on the layout (a scope's store shared by
/// every instance, or its key scope per user, would be passed over). A configuration
/// error: 500, and the log says what to change.
fn refuse_claimed_further_out<B>(req: ServiceRequest) -> Response<B> {
    tracing::error!(
        path = req.path(),
        "a layer further out (an Idempotency's protect_methods, before routing, or a route \
         layer) already took charge of this request, with its own store and settings, so the \
         Idempotency nearer the route would be passed over: leave this method out of the \
         outer protect_methods (or that route layer), or remove the nearer Idempotency"
    );
    refuse(req.into_parts().0, &IdempotencyError::NotConfigured)
}

/// Passes `req` to `service` untouched.
fn pass_through<S, B>(service: &S, req: ServiceRequest) -> IdempotencyFuture<S, B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
{
    IdempotencyFuture {
        inner: Either::Left(
            service
                .call(req)
                .map_ok(with_handler_body as fn(ServiceResponse<B>) -> Response<B>),
        ),
    }
}

/// Answers `response` without calling the inner service.
fn answer<S, B>(response: Response<B>) -> IdempotencyFuture<S, B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: 'static,
{
    IdempotencyFuture::processing(Box::pin(async move { Ok(response) }))
}

/// Processes `req`. A keyed request takes a slot of the worker's workload once its body has
/// arrived, or is refused with 503 when a cap is reached. The handler's run under a lock and
/// its commit complete even when the client disconnects and Actix drops this future: they
/// then go on on a task of their own (the engine's `RunToCompletion`); no request costs a
/// task otherwise. A keyless request that its route lets through takes a short path of its
/// own.
fn process<S, B>(
    engine: Rc<Engine>,
    policy: Policy,
    req: ServiceRequest,
    service: Rc<S>,
) -> IdempotencyFuture<S, B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    let keyed = req.headers().contains_key(&engine.settings.header);
    if !keyed && !policy.required && !policy.transactional {
        return IdempotencyFuture::processing(built_in_box(move || {
            engine.pass_without_key(req, service)
        }));
    }
    IdempotencyFuture::processing(built_in_box(move || engine.process(policy, req, service)))
}
