//! [`IdempotencyError`]: every way a protected request is refused, and its problem response.

use std::time::Duration;

use actix_web::error::PayloadError;
use actix_web::http::StatusCode;
use actix_web::http::header::{self, HeaderValue};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

use crate::key::KeyError;
use crate::problem_type::ProblemType;
use crate::store::StoreError;

/// Why the middleware answered instead of the handler (or alongside it).
///
/// Each variant maps to an RFC 9457 `application/problem+json` response with `type`,
/// `title`, `status` and `detail`. The `type` is a tag URI that names the variant, e.g.
/// `tag:idempotency-actix,2026:in-flight`, stable across versions.
///
/// # Examples
///
/// ```
/// use actix_web::ResponseError;
/// use idempotency_actix::IdempotencyError;
///
/// let response = IdempotencyError::FingerprintMismatch.error_response();
/// assert_eq!(response.status(), 422);
/// assert_eq!(response.headers().get("content-type").unwrap(), "application/problem+json");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotencyError {
    /// The route requires an `Idempotency-Key` and the request had none. 400.
    #[error("this endpoint requires an Idempotency-Key header")]
    MissingKey,
    /// The key header is malformed or repeated. 400.
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    /// The scope of a keyed request (see [`KeyScope`](crate::KeyScope)) cannot be determined:
    /// its header is missing or repeated, or its function returned `None`. 400.
    #[error("the request does not say whose idempotency key this is (the scope is missing)")]
    MissingScope,
    /// The request body of a keyed request is over the limit. 413; the handler did not run.
    #[error("the request body is larger than {limit} bytes, the most a keyed request may send")]
    RequestBodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The request body could not be read (the client sent a broken body or went away). 400;
    /// the source says what went wrong.
    #[error("the request body could not be read")]
    RequestBodyUnreadable(#[source] PayloadError),
    /// A keyed request asks to upgrade its connection (`Upgrade: websocket`) or to open a
    /// tunnel (a `CONNECT` that declares no body): Actix reads the body of such a request
    /// until the connection ends, so it has no end to fingerprint, and the client would
    /// wait for an answer that never came. 400 at once; the handler did not run. Send it
    /// without a key.
    #[error(
        "a request that asks to upgrade its connection (Upgrade: websocket) or to open a tunnel (CONNECT) cannot be made idempotent: its body has no end; send it without an idempotency key"
    )]
    UpgradeRequested,
    /// A request with this key is still being processed. 409 with `Retry-After`.
    #[error("a request with this idempotency key is still being processed")]
    InFlight {
        /// What `Retry-After` advises.
        retry_after: Duration,
    },
    /// The key was used before with another request (method, path, query or body). 422.
    #[error("this idempotency key was already used with a different request")]
    FingerprintMismatch,
    /// The store failed or timed out before a keyed request's handler ran, and the
    /// middleware fails closed: the request was not processed. 503 with `Retry-After`,
    /// telling the client to retry later with the same key; the client sees no detail of the
    /// store error.
    #[error("the idempotency store is unavailable: {source}")]
    StoreUnavailable {
        /// What the store reported.
        #[source]
        source: StoreError,
        /// What `Retry-After` advises.
        retry_after: Duration,
    },
    /// A transactional route's transaction did not confirm its `COMMIT` (the store failed or
    /// timed out while committing), so whether the handler's writes committed is unknown.
    /// 503 with `Retry-After` in place of the handler's response, with the problem type of
    /// [`StoreUnavailable`](Self::StoreUnavailable) (`store-unavailable`); the client sees no
    /// detail of the store error.
    ///
    /// Where the request's record was to commit with those writes (`recorded`: a keyed
    /// request that claimed its key), the client is told to retry with the same key, which
    /// gets the replay if they committed and runs the request again if not. Otherwise (a
    /// request without a key, or one whose claim failed on an app that fails open) nothing
    /// records the outcome, and the client is told only that it is unknown and that a retry
    /// may process the request again.
    #[error(
        "the commit of the request's transaction was not confirmed, so its outcome is unknown: {source}"
    )]
    CommitUnconfirmed {
        /// What the store reported.
        #[source]
        source: StoreError,
        /// What `Retry-After` advises.
        retry_after: Duration,
        /// Whether the request's record was committed together with the handler's writes,
        /// so that a retry with the same key finds out what happened.
        recorded: bool,
    },
    /// A transactional route's request that has no record (it has no key, or its claim
    /// failed on an app that fails open) got no transaction: the store failed or timed out
    /// before its handler ran, so the request was not processed. 503 with `Retry-After`,
    /// with the problem type of [`StoreUnavailable`](Self::StoreUnavailable)
    /// (`store-unavailable`), telling the client to retry later (no key is mentioned: the
    /// request may have none); the client sees no detail of the store error.
    #[error("no transaction could be opened for the request: {source}")]
    TransactionUnavailable {
        /// What the store reported.
        #[source]
        source: StoreError,
        /// What `Retry-After` advises.
        retry_after: Duration,
    },
    /// The worker already runs as much keyed work as it may (see
    /// [`Idempotency::max_in_flight`](crate::Idempotency::max_in_flight) and
    /// [`Idempotency::max_detached`](crate::Idempotency::max_detached)). 503 with
    /// `Retry-After`; the handler did not run.
    #[error("the server is busy with other requests; retry later with the same key")]
    Overloaded {
        /// What `Retry-After` advises.
        retry_after: Duration,
    },
    /// The process is stopping and runs no handler for a new key (see
    /// [`Idempotency::drain`](crate::Idempotency::drain)). 503 with `Retry-After` and
    /// `Connection: close`; the handler did not run, and the key is free for the retry.
    #[error("the server is stopping; retry with the same key")]
    ShuttingDown {
        /// What `Retry-After` advises.
        retry_after: Duration,
    },
    /// The handler panicked. 500; the key was released, so a retry runs the handler again.
    #[error("the handler panicked")]
    HandlerPanicked,
    /// A route-level layer found no `Idempotency` above it. 500.
    #[error(
        "idempotency is not configured: wrap the App in Idempotency::redis(..), Idempotency::memory() or Idempotency::new(..)"
    )]
    NotConfigured,
}

/// `Retry-After` in whole seconds, rounded up (advising 1.5 s as 1 would invite a retry that
/// comes too early), and never 0, which invites a hot loop.
fn retry_after_seconds(delay: Duration) -> u64 {
    let rounded_up = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
    rounded_up.max(1)
}

/// The RFC 9457 problem document.
#[derive(Serialize)]
struct Problem<'a> {
    r#type: &'a str,
    title: &'a str,
    status: u16,
    detail: String,
}

impl IdempotencyError {
    /// The kind of problem, whose table gives the `type`, `title` and status.
    fn problem_type(&self) -> ProblemType {
        match self {
            Self::MissingKey => ProblemType::MissingKey,
            Self::InvalidKey(_) => ProblemType::InvalidKey,
            Self::MissingScope => ProblemType::MissingScope,
            Self::RequestBodyTooLarge { .. } => ProblemType::BodyTooLarge,
            Self::RequestBodyUnreadable(_) => ProblemType::BodyUnreadable,
            Self::UpgradeRequested => ProblemType::UpgradeRequested,
            Self::InFlight { .. } => ProblemType::InFlight,
            Self::FingerprintMismatch => ProblemType::KeyReused,
            Self::StoreUnavailable { .. }
            | Self::CommitUnconfirmed { .. }
            | Self::TransactionUnavailable { .. } => ProblemType::StoreUnavailable,
            Self::Overloaded { .. } => ProblemType::Overloaded,
            Self::ShuttingDown { .. } => ProblemType::ShuttingDown,
            Self::HandlerPanicked => ProblemType::HandlerPanicked,
            Self::NotConfigured => ProblemType::NotConfigured,
        }
    }

    /// What the client is told; store errors stay in the log.
    fn client_detail(&self) -> String {
        match self {
            Self::StoreUnavailable { .. } => {
                "the request was not processed because the idempotency store is unavailable; retry later with the same key".to_owned()
            }
            Self::CommitUnconfirmed { recorded: true, .. } => {
                "the idempotency store failed while the request was being committed, so its outcome is unknown; retry later with the same key: a completed request is replayed, an incomplete one runs again".to_owned()
            }
            Self::CommitUnconfirmed {
                recorded: false, ..
            } => {
                "the idempotency store failed while the request was being committed, so its outcome is unknown; nothing records it, so a retry may process the request again".to_owned()
            }
            Self::TransactionUnavailable { .. } => {
                "the request was not processed because the idempotency store is unavailable; retry later".to_owned()
            }
            Self::NotConfigured => "the server is misconfigured".to_owned(),
            other => other.to_string(),
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InFlight { retry_after }
            | Self::StoreUnavailable { retry_after, .. }
            | Self::CommitUnconfirmed { retry_after, .. }
            | Self::TransactionUnavailable { retry_after, .. }
            | Self::Overloaded { retry_after }
            | Self::ShuttingDown { retry_after } => Some(*retry_after),
            _ => None,
        }
    }
}

impl ResponseError for IdempotencyError {
    fn status_code(&self) -> StatusCode {
        self.problem_type().status()
    }

    fn error_response(&self) -> HttpResponse {
        let status = self.status_code();
        let kind = self.problem_type();
        let problem_type = kind.uri();
        let problem = Problem {
            r#type: &problem_type,
            title: kind.title(),
            status: status.as_u16(),
            detail: self.client_detail(),
        };
        let mut response = HttpResponse::build(status);
        response.insert_header((
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        ));
        if let Some(retry_after) = self.retry_after() {
            response.insert_header((header::RETRY_AFTER, retry_after_seconds(retry_after)));
        }
        if matches!(self, Self::ShuttingDown { .. }) {
            // So that the retry opens a connection, which a load balancer sends elsewhere.
            response.force_close();
        }
        // Serializing a struct of strings and an integer cannot fail.
        response.body(serde_json::to_vec(&problem).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_body_keeps_its_source() {
        let error = IdempotencyError::RequestBodyUnreadable(PayloadError::Incomplete(None));
        assert!(std::error::Error::source(&error).is_some());
        assert_eq!(error.status_code(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let seconds = |millis| retry_after_seconds(Duration::from_millis(millis));
        assert_eq!(seconds(1500), 2);
        assert_eq!(seconds(1000), 1);
        assert_eq!(seconds(1001), 2);
        assert_eq!(seconds(1), 1);
        let error = IdempotencyError::InFlight {
            retry_after: Duration::from_millis(1500),
        };
        let response = error.error_response();
        assert_eq!(response.headers().get(header::RETRY_AFTER).unwrap(), "2");
    }
}
