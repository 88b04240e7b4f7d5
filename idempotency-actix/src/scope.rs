//! [`KeyScope`] and [`StorageKey`]: whose key it is, and the name a record is stored under.

use std::rc::Rc;
use std::sync::LazyLock;

use actix_web::dev::ServiceRequest;
use actix_web::http::header::HeaderName;
use blake3::hazmat::ContextKey;

use crate::gathered_hasher::GatheredHasher;
use crate::key::IdempotencyKey;

/// Decides whose key a request's key is: the tenant, user or API client it belongs to.
///
/// Records are stored under a digest of (scope, key), so two principals that send the same
/// key (and even the same body) never see each other's responses. Choose one with
/// [`Idempotency::scope`](crate::Idempotency::scope): an app that never does has one key
/// space for all callers (any caller can replay another's response by guessing its key, or
/// squat a key before its owner uses it) and logs a warning at start;
/// [`KeyScope::global`] chooses that on purpose.
///
/// Scope by the *authenticated principal*, the identity your authentication established:
///
/// * a user id that an authentication middleware verified and stored in the request's
///   extensions (the example below), or that an extractor reads;
/// * the subject of a verified token (a JWT's `sub`, an API key's owner), or a header that
///   a trusted gateway sets after authentication ([`KeyScope::header`]).
///
/// Do not scope by the raw `Authorization` value: a token refreshed between two retries
/// would put the retry in another key space and run the handler twice.
///
/// A keyed request whose scope cannot be determined (the header is missing, the function
/// returns `None`) is refused with a 400 problem, never stored in a shared key space: a
/// scope that silently fell back to "everyone" would hand one principal's response to
/// another. Return `Some(String::new())` for requests that may share the global space.
///
/// Like [`Idempotency`](crate::Idempotency), a `KeyScope` is built per worker inside the
/// `HttpServer::new` closure: it is not `Send` (it may hold an `Rc`), so one built in
/// `main` and moved into the closure does not compile.
///
/// An app-level [`Idempotency`](crate::Idempotency) runs after the middleware registered
/// after it on the `App` (Actix runs the last `wrap` first): a scope function that reads
/// what an authentication middleware stores needs that middleware wrapped *after*
/// `Idempotency` (so it runs first), or the route-level `#[idempotent]`, which runs after
/// every App middleware.
///
/// # Examples
///
/// ```
/// use actix_web::HttpMessage;
/// use idempotency_actix::{Idempotency, KeyScope};
///
/// // By the user id an authentication middleware verified and stored:
/// #[derive(Clone)]
/// struct UserId(u64);
/// let by_user = Idempotency::memory().scope(KeyScope::from_fn(|req| {
///     req.extensions().get::<UserId>().map(|user| user.0.to_string())
/// }));
///
/// // By a header the gateway sets after authentication:
/// let by_header = Idempotency::memory().scope(KeyScope::header("x-tenant-id")?);
///
/// // One key space for all callers, on purpose (no warning):
/// let shared = Idempotency::memory().scope(KeyScope::global());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct KeyScope(ScopeSource);

#[derive(Clone, Default)]
enum ScopeSource {
    #[default]
    Global,
    Header(HeaderName),
    Function(ScopeFn),
}

type ScopeFn = Rc<dyn Fn(&ServiceRequest) -> Option<String>>;

impl KeyScope {
    /// One key space for all callers of the app: what an app that chose no scope gets, but
    /// chosen on purpose (no warning at start). Fit for apps whose callers are one trusted
    /// party, or where keys are unguessable and a shared space is acceptable.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, KeyScope};
    ///
    /// // One trusted caller (a back office): one key space on purpose, and no warning at start.
    /// let app = App::new().wrap(Idempotency::memory().scope(KeyScope::global()));
    /// ```
    pub fn global() -> Self {
        Self(ScopeSource::Global)
    }

    /// Scopes keys by the value of a request header (a [`HeaderName`], or a string checked
    /// to be one) that a trusted gateway sets after authentication. A keyed request whose
    /// header is missing, repeated or empty is refused with 400.
    ///
    /// # Errors
    ///
    /// When `name` is not a valid header name.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, KeyScope, MemoryStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let idempotency = Idempotency::new(store.clone()).scope(KeyScope::header("x-tenant-id")?);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Ok))).await;
    /// for tenant in ["acme", "globex"] {
    ///     let request = test::TestRequest::post().insert_header(("Idempotency-Key", "k"));
    ///     let request = request.insert_header(("x-tenant-id", tenant));
    ///     test::call_service(&app, request.to_request()).await;
    /// }
    /// assert_eq!(store.len(), 2); // the same key, one record per tenant
    /// assert!(KeyScope::header("x tenant").is_err());
    /// # Ok(())
    /// # }
    /// ```
    pub fn header<N: TryInto<HeaderName>>(name: N) -> Result<Self, N::Error> {
        Ok(Self(ScopeSource::Header(name.try_into()?)))
    }

    /// Scopes keys by what `scope_of` returns for the request.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpMessage, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, KeyScope, MemoryStore};
    ///
    /// #[derive(Clone)]
    /// struct UserId(u64);
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let by_user = KeyScope::from_fn(|req| {
    ///     req.extensions().get::<UserId>().map(|user| user.0.to_string())
    /// });
    /// let idempotency = Idempotency::new(MemoryStore::new()).scope(by_user);
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(HttpResponse::Ok))).await;
    /// let request =
    ///     || test::TestRequest::post().insert_header(("Idempotency-Key", "k")).to_request();
    /// let signed_in = request();
    /// signed_in.extensions_mut().insert(UserId(7)); // as an authentication middleware would
    /// assert_eq!(test::call_service(&app, signed_in).await.status(), 200);
    /// // No user, no scope: refused.
    /// assert_eq!(test::call_service(&app, request()).await.status(), 400);
    /// # });
    /// ```
    pub fn from_fn(scope_of: impl Fn(&ServiceRequest) -> Option<String> + 'static) -> Self {
        Self(ScopeSource::Function(Rc::new(scope_of)))
    }

    /// The scope value of `req`, or `None` when it cannot be determined.
    pub(crate) fn of(&self, req: &ServiceRequest) -> Option<Vec<u8>> {
        match &self.0 {
            ScopeSource::Global => Some(Vec::new()),
            ScopeSource::Header(name) => {
                let mut values = req.headers().get_all(name);
                let value = values.next()?;
                // A repeated scope header is ambiguous, and an empty one names no principal
                // (its scope would be the global one's): refuse them like a missing one.
                let value = value.as_bytes();
                (values.next().is_none() && !value.trim_ascii().is_empty()).then(|| value.to_vec())
            }
            ScopeSource::Function(scope_of) => scope_of(req).map(String::into_bytes),
        }
    }
}

impl std::fmt::Debug for KeyScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            ScopeSource::Global => f.write_str("KeyScope::Global"),
            ScopeSource::Header(name) => write!(f, "KeyScope::Header({name})"),
            ScopeSource::Function(_) => f.write_str("KeyScope::Function"),
        }
    }
}

/// The key of the context every storage key is derived in (blake3 key-derivation mode with
/// this crate's context), hashed once per process.
static STORAGE_KEY_CONTEXT: LazyLock<ContextKey> =
    LazyLock::new(|| blake3::hazmat::hash_derive_key_context("idempotency-actix storage key v1"));

/// The two lowercase hex digits of every byte.
const HEX_PAIRS: [[u8; 2]; 256] = {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut pairs = [[0; 2]; 256];
    let mut byte = 0;
    while byte < 256 {
        pairs[byte] = [DIGITS[byte >> 4], DIGITS[byte & 15]];
        byte += 1;
    }
    pairs
};

/// The name a record is stored under: a configurable prefix and the hex blake3 digest of
/// (scope, key). The raw key never reaches the store.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{IdempotencyKey, StorageKey};
///
/// let key = IdempotencyKey::parse(b"order-1")?;
/// let tenant_a = StorageKey::new("idem:", b"tenant-a", &key);
/// let tenant_b = StorageKey::new("idem:", b"tenant-b", &key);
/// assert_ne!(tenant_a, tenant_b);
/// assert!(tenant_a.as_str().starts_with("idem:"));
/// assert!(!tenant_a.as_str().contains("order-1"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StorageKey(String);

impl StorageKey {
    /// The storage key of `key` in `scope`, under `prefix`.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyKey, StorageKey};
    ///
    /// let bare = StorageKey::new("idempotency:", b"", &IdempotencyKey::parse(b"order-1")?);
    /// let quoted = StorageKey::new("idempotency:", b"", &IdempotencyKey::parse(br#""order-1""#)?);
    /// assert_eq!(bare, quoted); // one key, one record
    /// assert_eq!(bare.as_str().len(), "idempotency:".len() + 64);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(prefix: &str, scope: &[u8], key: &IdempotencyKey) -> Self {
        let mut hasher = GatheredHasher::new(&STORAGE_KEY_CONTEXT);
        hasher.push(&(scope.len() as u64).to_le_bytes());
        hasher.push(scope);
        hasher.push(key.as_str().as_bytes());
        let digest = blake3::Hash::from_bytes(hasher.finalize());
        let mut name = String::with_capacity(prefix.len() + 64);
        name.push_str(prefix);
        // Two digits per byte from a table, then one copy into the name: `Hash::to_hex`
        // builds an `ArrayString` digit by digit, twice the instructions.
        let mut hex = [0; 64];
        for (pair, &byte) in hex.chunks_exact_mut(2).zip(digest.as_bytes()) {
            pair.copy_from_slice(&HEX_PAIRS[usize::from(byte)]);
        }
        match std::str::from_utf8(&hex) {
            Ok(hex) => name.push_str(hex),
            // Never taken (the table holds ASCII digits); blake3's own encoding if it were.
            Err(_) => name.push_str(digest.to_hex().as_str()),
        }
        Self(name)
    }

    /// The full name, prefix included.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyKey, StorageKey};
    ///
    /// let key = StorageKey::new("shop:", b"tenant-a", &IdempotencyKey::parse(b"order-1")?);
    /// let digest = key.as_str().strip_prefix("shop:").ok_or("no prefix")?;
    /// assert!(digest.len() == 64 && digest.bytes().all(|digit| digit.is_ascii_hexdigit()));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Records outlive deploys: a storage key computed by this version must be the one every
/// later version computes, or a retry after a deploy would miss its record and run again. The
/// name of a known key is pinned here.
#[cfg(test)]
mod stability {
    use super::*;

    #[test]
    fn the_name_of_a_known_key_never_changes() {
        let key = IdempotencyKey::parse(b"order-1").unwrap();
        assert_eq!(
            StorageKey::new("idem:", b"tenant-a", &key).as_str(),
            "idem:3a0ab394903fa4e1fc114668b2dff3b63e4c8d43d4945c68933d75f8607df4c6"
        );
    }
}
