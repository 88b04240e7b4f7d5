//! [`IdempotentBody`]: the body type of responses that pass through the middleware.

use std::error::Error as StdError;
use std::pin::Pin;
use std::task::{Context, Poll};

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::web::Bytes;
use pin_project_lite::pin_project;

pin_project! {
    /// The body of a response that went through idempotency middleware: the handler's own
    /// body untouched, a body the middleware made (replay or problem), or the handler's body
    /// after the middleware read a prefix of it while storing it.
    ///
    /// Handlers never see this type; it appears in the middleware's `Service` signature.
    #[project = IdempotentBodyProjection]
    pub enum IdempotentBody<B> {
        /// The handler's body, not read by the middleware.
        Handler {
            /// The handler's body.
            #[pin]
            body: B,
        },
        /// A body the middleware produced: a replay or a problem document.
        Produced {
            /// The body.
            body: BoxBody,
        },
        /// The handler's streaming body, of which `prefix` was already read.
        Resumed {
            /// What was read, sent first.
            prefix: Option<Bytes>,
            /// The unread remainder.
            rest: Pin<Box<B>>,
        },
        /// The handler's body failed after `prefix` was read; the error is sent after it.
        Failed {
            /// What was read before the error, sent first.
            prefix: Option<Bytes>,
            /// The handler body's error.
            error: Option<Box<dyn StdError>>,
        },
    }
}

impl<B> IdempotentBody<B> {
    pub(crate) fn handler(body: B) -> Self {
        Self::Handler { body }
    }

    pub(crate) fn produced(body: BoxBody) -> Self {
        Self::Produced { body }
    }
}

impl<B> MessageBody for IdempotentBody<B>
where
    B: MessageBody,
{
    type Error = Box<dyn StdError>;

    fn size(&self) -> BodySize {
        match self {
            Self::Handler { body } => body.size(),
            Self::Produced { body } => body.size(),
            Self::Resumed { .. } | Self::Failed { .. } => BodySize::Stream,
        }
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        match self.project() {
            IdempotentBodyProjection::Handler { body } => body
                .poll_next(cx)
                .map(|chunk| chunk.map(|r| r.map_err(Into::into))),
            IdempotentBodyProjection::Produced { body } => Pin::new(body).poll_next(cx),
            IdempotentBodyProjection::Resumed { prefix, rest } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(prefix))),
                None => rest
                    .as_mut()
                    .poll_next(cx)
                    .map(|chunk| chunk.map(|r| r.map_err(Into::into))),
            },
            IdempotentBodyProjection::Failed { prefix, error } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(prefix))),
                None => Poll::Ready(error.take().map(Err)),
            },
        }
    }
}
