//! The two layers: [`Idempotency`] (store and defaults; App, scope or resource) and
//! [`IdempotentRoute`] (one route's policy; what `#[idempotent]` attaches).

use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceRequest, ServiceResponse};
use futures_util::future::{LocalBoxFuture, MapOk, TryFutureExt};
use futures_util::ready;
use pin_project_lite::pin_project;
use tracing::Instrument;

use crate::built_in_box::built_in_box;
use crate::engine::{Engine, Response, refuse, with_handler_body};
use crate::error::IdempotencyError;
use crate::instrument::RequestRecord;
use crate::policy::Policy;
use crate::route_label::RouteLabels;

mod app;
mod route;

pub use self::app::{Idempotency, IdempotencyMiddleware};
pub use self::route::{IdempotentRoute, IdempotentRouteMiddleware};

type PassThrough<S, B> =
    MapOk<<S as Service<ServiceRequest>>::Future, fn(ServiceResponse<B>) -> Response<B>>;
type Processing<B> = LocalBoxFuture<'static, Result<Response<B>, actix_web::Error>>;

pin_project! {
    /// The future of both middleware services' responses. A request the middleware does not
    /// touch costs no allocation: it is the inner service's own future; nor does a keyless
    /// request that its route lets through while no subscriber wants its span.
    ///
    /// # Examples
    ///
    /// ```
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use actix_web::dev::{Service, Transform};
    /// use actix_web::{App, test};
    /// use idempotency_actix::{Idempotency, IdempotencyFuture, MemoryStore};
    ///
    /// // What the services of `App::new().wrap(Idempotency::memory())` return from `call`:
    /// let middleware = Idempotency::new(MemoryStore::new())
    ///     .new_transform(test::ok_service())
    ///     .await
    ///     .map_err(|()| "no middleware")?;
    /// let request = test::TestRequest::post().to_srv_request();
    /// let future: IdempotencyFuture<_, _> = middleware.call(request);
    /// assert_eq!(future.await?.status(), 200);
    /// # Ok(())
    /// # }
    /// ```
    pub struct IdempotencyFuture<S, B>
    where
        S: Service<ServiceRequest>,
    {
        #[pin]
        inner: Inner<S, B>,
    }
}

pin_project! {
    #[project = InnerProjection]
    enum Inner<S, B>
    where
        S: Service<ServiceRequest>,
    {
        PassThrough { #[pin] future: PassThrough<S, B> },
        // The record is taken when the inner service answers; dropped before that (the
        // client left), it records the outcome as it goes.
        Keyless { #[pin] future: S::Future, record: Option<RequestRecord> },
        Processing { future: Processing<B> },
    }
}

impl<S, B> Future for IdempotencyFuture<S, B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
{
    type Output = Result<Response<B>, actix_web::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().inner.project() {
            InnerProjection::PassThrough { future } => future.poll(cx),
            InnerProjection::Keyless { future, record } => {
                let result = ready!(future.poll(cx));
                if let Some(record) = record.take() {
                    record.finish(&result);
                }
                Poll::Ready(result.map(with_handler_body))
            }
            InnerProjection::Processing { future } => future.as_mut().poll(cx),
        }
    }
}

impl<S: Service<ServiceRequest>, B> IdempotencyFuture<S, B> {
    pub(super) fn processing(future: Processing<B>) -> Self {
        Self {
            inner: Inner::Processing { future },
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
        inner: Inner::PassThrough {
            future: service
                .call(req)
                .map_ok(with_handler_body as fn(ServiceResponse<B>) -> Response<B>),
        },
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
/// own. `route_labels` is the calling layer's, which finds the request's route label.
fn process<S, B>(
    engine: Rc<Engine>,
    policy: Policy,
    req: ServiceRequest,
    service: Rc<S>,
    route_labels: &Rc<RouteLabels>,
) -> IdempotencyFuture<S, B>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    let keyed = req.headers().contains_key(&engine.settings.header);
    if !keyed && !policy.required && !policy.transactional {
        let record = engine.start_without_key(&req, route_labels);
        return match record.wanted_span() {
            None => IdempotencyFuture {
                inner: Inner::Keyless {
                    future: service.call(req),
                    record: Some(record),
                },
            },
            // The inner service's `call` (routing, inner layers) runs in the span too.
            Some(span) => IdempotencyFuture::processing(Box::pin(async move {
                let result = span.in_scope(|| service.call(req)).instrument(span).await;
                record.finish(&result);
                result.map(with_handler_body)
            })),
        };
    }
    let route_labels = Rc::clone(route_labels);
    IdempotencyFuture::processing(built_in_box(move || {
        engine.process(policy, req, service, route_labels)
    }))
}
