//! [`IdempotentBody`]: the body type of responses that pass through the middleware.

use std::error::Error as StdError;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::web::Bytes;
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a response that went through idempotency middleware: the handler's own
    /// body untouched, or a body the middleware made (a replay, a problem document, or the
    /// handler's body as it passes while the middleware stores it).
    ///
    /// Handlers never see this type; it appears in the middleware's `Service` signature.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::body::{BodySize, MessageBody};
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, IdempotentBody, MemoryStore};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let idempotency = Idempotency::new(MemoryStore::new()).protect_methods([Method::POST]);
    /// let handler = || async { HttpResponse::Created().body("order 7") };
    /// let app = App::new().wrap(idempotency).route("/", web::post().to(handler));
    /// let app = test::init_service(app).await;
    /// let request =
    ///     || test::TestRequest::post().insert_header(("Idempotency-Key", "k")).to_request();
    /// test::call_service(&app, request()).await;
    /// // A replay's body is one the middleware made, from the stored bytes:
    /// let replay = test::call_service(&app, request()).await;
    /// let body: &IdempotentBody<_> = replay.response().body();
    /// assert_eq!(body.size(), BodySize::Sized(7));
    /// assert_eq!(test::read_body(replay).await, "order 7");
    /// # });
    /// ```
    pub struct IdempotentBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProjection]
    enum Kind<B> {
        // The handler's body, not read by the middleware.
        Handler { #[pin] body: B },
        // A body the middleware produced, or a handler body it reads while it passes.
        Produced { body: BoxBody },
    }
}

impl<B> IdempotentBody<B> {
    pub(crate) fn handler(body: B) -> Self {
        Self {
            kind: Kind::Handler { body },
        }
    }

    pub(crate) fn produced(body: BoxBody) -> Self {
        Self {
            kind: Kind::Produced { body },
        }
    }
}

impl<B> MessageBody for IdempotentBody<B>
where
    B: MessageBody,
{
    type Error = Box<dyn StdError>;

    fn size(&self) -> BodySize {
        match &self.kind {
            Kind::Handler { body } => body.size(),
            Kind::Produced { body } => body.size(),
        }
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        match self.project().kind.project() {
            KindProjection::Handler { body } => body
                .poll_next(cx)
                .map(|chunk| chunk.map(|result| result.map_err(Into::into))),
            KindProjection::Produced { body } => Pin::new(body).poll_next(cx),
        }
    }

    /// The bytes of a body that holds them whole, so that a layer outside (Actix boxing a
    /// resource's response, an app layer over a route layer) sees a complete body, not a
    /// stream.
    fn try_into_bytes(self) -> Result<Bytes, Self> {
        match self.kind {
            Kind::Handler { body } => body.try_into_bytes().map_err(Self::handler),
            Kind::Produced { body } => body.try_into_bytes().map_err(Self::produced),
        }
    }
}
