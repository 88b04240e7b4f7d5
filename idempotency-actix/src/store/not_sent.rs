//! [`NotSent`]: the mark of a store error whose operation never left this process.

use std::error::Error;
use std::fmt;
use std::future::Future;

use super::{StoreError, deadline};

/// The source of a [`StoreError::Unavailable`] whose operation was never sent: no connection
/// could be had for it (the server refused or reset the attempt, its credentials were
/// refused, or a server lacking the store's functions was not used), so it changed nothing
/// in the store. A `begin` that failed so holds no key and left no token that could still
/// land: the engine neither abandons it nor runs a fail-open handler under it. Without the
/// mark, every keyed request of an outage, refused in microseconds, left a task retrying an
/// abandon for a lease (thousands a second), which wrote a marker per request once the
/// server was back.
///
/// Displayed as the error it marks, whose source is its source.
#[derive(Debug)]
pub(crate) struct NotSent(Box<dyn Error + Send + Sync>);

impl NotSent {
    /// The error it marks.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn inner(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl fmt::Display for NotSent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl Error for NotSent {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

impl StoreError {
    /// `self` marked as the error of an operation that was never sent (see [`NotSent`]): an
    /// [`Unavailable`](StoreError::Unavailable); any other error is left as it is, and
    /// counts as one that may have reached the store.
    #[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
    pub(crate) fn not_sent(self) -> Self {
        match self {
            Self::Unavailable(source) if !source.is::<NotSent>() => {
                Self::Unavailable(Box::new(NotSent(source)))
            }
            other => other,
        }
    }

    /// Whether the operation that failed with `self` was never sent (see [`NotSent`]).
    pub(crate) fn was_not_sent(&self) -> bool {
        matches!(self, Self::Unavailable(source) if source.is::<NotSent>())
    }

    /// Whether a `begin` that failed with `self` certainly wrote nothing, so that it holds
    /// no key and has no token to abandon or run under: the store refused it (a full
    /// store), it found a record this version cannot read (an `abandon` there could write a
    /// marker over those bytes and free the key), or it was never sent.
    pub(crate) fn wrote_nothing(&self) -> bool {
        matches!(self, Self::Refused(_) | Self::Corrupt(_)) || self.was_not_sent()
    }

    /// The source of an [`Unavailable`](StoreError::Unavailable) error, whether or not it
    /// is marked [`NotSent`].
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn unavailable_source(&self) -> Option<&(dyn Error + Send + Sync + 'static)> {
        match self {
            Self::Unavailable(source) => Some(match source.downcast_ref::<NotSent>() {
                Some(marked) => marked.inner(),
                None => &**source,
            }),
            _ => None,
        }
    }
}

/// A connection from `opening`, made before an operation is sent on it: its error is marked
/// as never sent, as the operation has not been, also when no connection is made by the
/// deadline of the store operation being polled (a server that takes connections and says
/// nothing, a pool whose connections are all in use), where it gives up at that deadline
/// rather than be dropped by the engine's own bound, which could not tell.
#[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
pub(crate) async fn unsent_by_the_deadline<C>(
    opening: impl Future<Output = Result<C, StoreError>>,
) -> Result<C, StoreError> {
    let opened = match deadline::current() {
        Some(deadline) => {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            actix_rt::time::timeout(left, opening)
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::Unavailable(
                        "no connection to the store was made within the store timeout".into(),
                    ))
                })
        }
        None => opening.await,
    };
    opened.map_err(StoreError::not_sent)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_keeps_the_message_and_the_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let marked = StoreError::Unavailable(Box::new(io)).not_sent();
        assert!(marked.was_not_sent());
        assert_eq!(marked.to_string(), "store unavailable: refused");
        assert!(
            marked
                .unavailable_source()
                .is_some_and(|source| source.is::<std::io::Error>())
        );
        // Marked once, however often it is marked.
        assert!(marked.not_sent().was_not_sent());
        // Only an unavailable store's error is marked: a timeout may have reached it.
        let timeout = StoreError::Timeout(std::time::Duration::from_secs(1)).not_sent();
        assert!(!timeout.was_not_sent());
        assert!(!StoreError::Unavailable("down".into()).was_not_sent());
    }
}
