//! tmp
mod body;
mod engine;
mod error;
mod fingerprint;
mod key;
mod middleware;
mod policy;
mod record;
mod replay;
mod scope;
mod store;

pub use body::IdempotentBody;
pub use engine::FailMode;
pub use error::IdempotencyError;
pub use fingerprint::{Fingerprint, FingerprintParts};
pub use idempotency_macros::idempotent;
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LENGTH};
pub use middleware::{
    Idempotency, IdempotencyFuture, IdempotencyMiddleware, IdempotentRoute,
    IdempotentRouteMiddleware,
};
pub use policy::{
    DEFAULT_LEASE, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_STORED_BODY, DEFAULT_TTL, Policy,
    RoutePolicy,
};
pub use record::{RECORD_VERSION, RecordError, StoredResponse};
pub use replay::{BODY_OMITTED_HEADER, REPLAYED_HEADER, ReplayedHeaders};
pub use scope::{KeyScope, StorageKey};
pub use store::{BeginOutcome, IdempotencyStore, LeaseToken, MemoryStore, StoreError};
#[cfg(feature = "redis")]
pub use store::{RedisPool, RedisStore};

/// What `#[idempotent]`'s generated code calls. Not public API: may change in any release.
#[doc(hidden)]
pub mod __private {
    pub use crate::middleware::IdempotentRoute;
    pub use crate::policy::RoutePolicy;
    pub use ::core::time::Duration;
}
