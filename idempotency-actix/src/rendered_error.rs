//! [`RenderedError`]: an error of the inner service, rendered once, that the client gets as
//! the record stored it.

use std::cell::RefCell;
use std::fmt;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::http::StatusCode;
use actix_web::http::header::HeaderMap;
use actix_web::web::Bytes;
use actix_web::{HttpResponse, ResponseError};

/// An error of a layer inside the middleware whose response is stored (`store_errors`, or a
/// status under 400), carrying the response it was rendered as.
///
/// Rendering an error is not always repeatable: `InternalError::from_response` hands its
/// response out once (a second rendering is a bare 500), and an error may render a trace id
/// or a time. The record is made from one rendering, so the client gets that same one:
/// the status, every header and the body bytes, as often as Actix asks. A body that is not
/// in memory is handed out once, and a later rendering falls back to the error's own.
/// `Display` and `Debug` are the error's own, for logs.
pub(crate) struct RenderedError {
    error: actix_web::Error,
    status: StatusCode,
    headers: HeaderMap,
    body: RenderedBody,
}

enum RenderedBody {
    Bytes(Bytes),
    Once(RefCell<Option<BoxBody>>),
}

impl RenderedError {
    /// `error` as `rendered`, a response of its `error_response`; also returns the body's
    /// bytes where they are in memory (what the record stores).
    pub(crate) fn new(error: actix_web::Error, rendered: HttpResponse) -> (Self, Option<Bytes>) {
        let status = rendered.status();
        let headers = rendered.headers().clone();
        let (body, bytes) = match rendered.into_body().try_into_bytes() {
            Ok(bytes) => (RenderedBody::Bytes(bytes.clone()), Some(bytes)),
            Err(body) => (RenderedBody::Once(RefCell::new(Some(body))), None),
        };
        let error = Self {
            error,
            status,
            headers,
            body,
        };
        (error, bytes)
    }
}

impl ResponseError for RenderedError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let body = match &self.body {
            RenderedBody::Bytes(bytes) => BoxBody::new(bytes.clone()),
            RenderedBody::Once(body) => match body.borrow_mut().take() {
                Some(body) => body,
                None => return self.error.error_response(),
            },
        };
        let mut response = HttpResponse::with_body(self.status, body);
        *response.headers_mut() = self.headers.clone();
        response
    }
}

impl fmt::Display for RenderedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl fmt::Debug for RenderedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.error, f)
    }
}

#[cfg(test)]
mod tests {
    use actix_web::error::InternalError;

    use super::*;

    #[test]
    fn an_error_that_renders_once_renders_as_stored_every_time() {
        let declined = HttpResponse::PaymentRequired()
            .insert_header(("x-decline-code", "card_declined"))
            .body("card declined");
        let error: actix_web::Error = InternalError::from_response("declined", declined).into();
        let rendered = error.error_response();
        let (error, stored) = RenderedError::new(error, rendered);
        assert_eq!(stored.as_deref(), Some(&b"card declined"[..]));
        for _ in 0..2 {
            let response = error.error_response();
            assert_eq!(response.status(), StatusCode::PAYMENT_REQUIRED);
            assert_eq!(
                response.headers().get("x-decline-code").unwrap(),
                "card_declined"
            );
            let body = response.into_body().try_into_bytes().ok();
            assert_eq!(body.as_deref(), Some(&b"card declined"[..]));
        }
        assert_eq!(error.to_string(), "declined");
    }
}
