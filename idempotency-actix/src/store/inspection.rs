//! What a store reports when one record is inspected or deleted by hand ([`RecordSnapshot`],
//! [`Deletion`]): the store side of [`Inspector`](crate::Inspector).

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::web::Bytes;

use crate::record::StoredResponse;

/// Whether a record's request is still running or its response is stored.
///
/// # Examples
///
/// ```
/// use actix_web::http::StatusCode;
/// use idempotency_actix::{RecordSnapshot, RecordState, StoredResponse};
///
/// let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), None);
/// let snapshot = RecordSnapshot::completed(response, None, false);
/// let what = match snapshot.state {
///     RecordState::InFlight => "running",
///     RecordState::Completed => "replayed to retries",
///     _ => "a state of a later version",
/// };
/// assert_eq!(what, "replayed to retries");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordState {
    /// A request holds the key under a lease; its handler may be running.
    InFlight,
    /// The response is stored and replayed to retries.
    Completed,
}

/// One record as it is now, for support and operations.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use idempotency_actix::{RecordSnapshot, RecordState};
///
/// let snapshot = RecordSnapshot::in_flight(Some(Duration::from_secs(30)));
/// assert_eq!(snapshot.state, RecordState::InFlight);
/// assert_eq!(snapshot.status, None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordSnapshot {
    /// In flight or completed.
    pub state: RecordState,
    /// How much longer the record is kept: the rest of the lease in flight, of the ttl once
    /// completed, or longer where an abandoned token found the completed record (the store
    /// then keeps it for at least the marker's lifetime, the route's lease where that is
    /// longer than its ttl: [`IdempotencyStore::abandon`](crate::IdempotencyStore::abandon)).
    /// `None` when the store cannot tell.
    pub expires_in: Option<Duration>,
    /// The stored status (completed records).
    pub status: Option<StatusCode>,
    /// The stored headers (completed records).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The stored body's size in bytes (completed records that stored a body).
    pub body_size: Option<usize>,
    /// The stored body itself, only when it was asked for.
    pub body: Option<Bytes>,
}

impl RecordSnapshot {
    /// An in-flight record that expires in `expires_in` unless renewed.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::{RecordSnapshot, RecordState};
    ///
    /// let snapshot = RecordSnapshot::in_flight(Some(Duration::from_secs(30)));
    /// assert_eq!(snapshot.state, RecordState::InFlight);
    /// assert_eq!(snapshot.expires_in, Some(Duration::from_secs(30)));
    /// assert!(snapshot.status.is_none() && snapshot.headers.is_empty());
    /// ```
    pub fn in_flight(expires_in: Option<Duration>) -> Self {
        Self {
            state: RecordState::InFlight,
            expires_in,
            status: None,
            headers: Vec::new(),
            body_size: None,
            body: None,
        }
    }

    /// A completed record holding `response`, with its body only if `with_body`.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::StatusCode;
    /// use actix_web::web::Bytes;
    /// use idempotency_actix::{RecordSnapshot, StoredResponse};
    ///
    /// let body = Some(Bytes::from_static(b"order 7"));
    /// let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), body);
    /// let without_body = RecordSnapshot::completed(response.clone(), None, false);
    /// assert_eq!(without_body.status, Some(StatusCode::CREATED));
    /// assert_eq!((without_body.body_size, without_body.body), (Some(7), None));
    /// let with_body = RecordSnapshot::completed(response, None, true);
    /// assert_eq!(with_body.body.as_deref(), Some(&b"order 7"[..]));
    /// ```
    pub fn completed(
        response: StoredResponse,
        expires_in: Option<Duration>,
        with_body: bool,
    ) -> Self {
        Self {
            state: RecordState::Completed,
            expires_in,
            status: Some(response.status),
            headers: response.headers,
            body_size: response.body.as_ref().map(Bytes::len),
            body: response.body.filter(|_| with_body),
        }
    }
}

/// What [`IdempotencyStore::delete`](crate::IdempotencyStore::delete) did.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{Deletion, Inspector, MemoryStore};
///
/// # #[actix_web::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let inspector = Inspector::new(MemoryStore::new());
/// let said = match inspector.delete(b"", "order-1").await? {
///     Deletion::Deleted => "the next request with this key runs the handler",
///     Deletion::NotFound => "no record: nothing to delete",
///     Deletion::InFlight => "still running: force_delete it if its request is dead",
///     _ => "an answer of a later version",
/// };
/// assert_eq!(said, "no record: nothing to delete");
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Deletion {
    /// The record is gone: the next request with the key runs the handler.
    Deleted,
    /// There was no record (or it had expired).
    NotFound,
    /// The record is in flight and the deletion was not forced: nothing was deleted.
    InFlight,
}
