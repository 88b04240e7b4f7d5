//! [`ProblemType`]: the kinds of problem the middleware answers with, each with its `type`,
//! `title` and status, in one table that the responses and the OpenAPI description share.

use actix_web::http::StatusCode;

/// What every problem `type` starts with; the rest names the problem (`in-flight`).
pub(crate) const PROBLEM_TYPE_PREFIX: &str = "tag:idempotency-actix,2026:";

/// Declares [`ProblemType`] with its table, so that [`ProblemType::ALL`] lists every kind.
macro_rules! problem_types {
    ($($variant:ident => ($slug:literal, $title:literal, $status:ident),)*) => {
        /// A kind of problem response, one per variant of
        /// [`IdempotencyError`](crate::IdempotencyError) (which maps onto it exhaustively).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(crate) enum ProblemType {
            $(
                #[doc = concat!("`", $slug, "`: ", $title, ".")]
                $variant,
            )*
        }

        impl ProblemType {
            /// Every kind, in the order of the table.
            // Only the OpenAPI description lists them all.
            #[cfg_attr(not(feature = "utoipa"), allow(dead_code))]
            pub(crate) const ALL: &[Self] = &[$(Self::$variant),*];

            /// The last part of the `type` URI, after [`PROBLEM_TYPE_PREFIX`].
            pub(crate) const fn slug(self) -> &'static str {
                match self {
                    $(Self::$variant => $slug,)*
                }
            }

            /// The problem's `title`.
            pub(crate) const fn title(self) -> &'static str {
                match self {
                    $(Self::$variant => $title,)*
                }
            }

            /// The response's status.
            pub(crate) const fn status(self) -> StatusCode {
                match self {
                    $(Self::$variant => StatusCode::$status,)*
                }
            }
        }
    };
}

problem_types! {
    MissingKey => ("missing-key", "Idempotency-Key required", BAD_REQUEST),
    InvalidKey => ("invalid-key", "Invalid Idempotency-Key", BAD_REQUEST),
    MissingScope => ("missing-scope", "Idempotency scope missing", BAD_REQUEST),
    BodyTooLarge => ("body-too-large", "Request body too large", PAYLOAD_TOO_LARGE),
    BodyUnreadable => ("body-unreadable", "Request body unreadable", BAD_REQUEST),
    UpgradeRequested => ("upgrade-requested", "Connection upgrade with a key", BAD_REQUEST),
    InFlight => ("in-flight", "Request in progress", CONFLICT),
    KeyReused => ("key-reused", "Idempotency-Key reused", UNPROCESSABLE_ENTITY),
    StoreUnavailable => ("store-unavailable", "Idempotency store unavailable", SERVICE_UNAVAILABLE),
    Overloaded => ("overloaded", "Server busy", SERVICE_UNAVAILABLE),
    ShuttingDown => ("shutting-down", "Server stopping", SERVICE_UNAVAILABLE),
    HandlerPanicked => ("handler-panicked", "Internal server error", INTERNAL_SERVER_ERROR),
    NotConfigured => ("not-configured", "Internal server error", INTERNAL_SERVER_ERROR),
}

impl ProblemType {
    /// The problem's `type`: a tag URI, `tag:idempotency-actix,2026:<slug>`.
    pub(crate) fn uri(self) -> String {
        format!("{PROBLEM_TYPE_PREFIX}{}", self.slug())
    }
}
