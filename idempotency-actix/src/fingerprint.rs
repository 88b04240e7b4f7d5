//! [`Fingerprint`]: what makes two requests with one key "the same request".

use std::sync::LazyLock;

use actix_web::http::header::{HOST, HeaderName};
use actix_web::{
    dev::ServiceRequest,
    http::{Method, Version},
};
use blake3::hazmat::ContextKey;

use crate::gathered_hasher::GatheredHasher;

/// A blake3 digest of the parts of a request that a retry must repeat exactly.
///
/// By default it covers the method, the path, the query string and a blake3 digest of the
/// body as sent (a compressed body's bytes, not what they decode to: a retry must repeat
/// them); [`FingerprintParts::header`] adds request headers. A retry with the same key but a
/// different fingerprint is answered 422 (the draft's "key reused with another payload").
///
/// # Examples
///
/// ```
/// use actix_web::http::Method;
/// use idempotency_actix::Fingerprint;
///
/// let first = Fingerprint::compute(&Method::POST, "/orders", "", b"{\"qty\":1}", []);
/// let retry = Fingerprint::compute(&Method::POST, "/orders", "", b"{\"qty\":1}", []);
/// let other = Fingerprint::compute(&Method::POST, "/orders", "", b"{\"qty\":2}", []);
/// assert_eq!(first, retry);
/// assert_ne!(first, other);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Computes the fingerprint of a request from its parts; `headers` are (name, value)
    /// pairs that were chosen to be part of it (an absent header is an empty value).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::Method;
    /// use idempotency_actix::Fingerprint;
    ///
    /// let plain = Fingerprint::compute(&Method::POST, "/orders", "dry_run=1", b"{}", []);
    /// let version = [("api-version", &b"2"[..])];
    /// let versioned = Fingerprint::compute(&Method::POST, "/orders", "dry_run=1", b"{}", version);
    /// assert_ne!(plain, versioned);
    /// // Parts never run into each other: ("/a", "b") is not ("/ab", "").
    /// let split = Fingerprint::compute(&Method::POST, "/a", "b", b"", []);
    /// assert_ne!(split, Fingerprint::compute(&Method::POST, "/ab", "", b"", []));
    /// ```
    pub fn compute<'a>(
        method: &Method,
        path: &str,
        query: &str,
        body: &[u8],
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> Self {
        let mut fields = Fields::new();
        for part in [
            method.as_str().as_bytes(),
            path.as_bytes(),
            query.as_bytes(),
        ] {
            fields.push(part);
        }
        fields.push(blake3::hash(body).as_bytes());
        for (name, value) in headers {
            fields.push(name.as_bytes());
            fields.push(value);
        }
        Self(fields.finalize())
    }

    /// Rebuilds a fingerprint from the 32 bytes [`Fingerprint::as_bytes`] returned.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::Method;
    /// use idempotency_actix::Fingerprint;
    ///
    /// let fingerprint = Fingerprint::compute(&Method::PUT, "/orders/7", "", b"{}", []);
    /// let stored: [u8; 32] = *fingerprint.as_bytes();
    /// assert_eq!(Fingerprint::from_bytes(stored), fingerprint);
    /// ```
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 digest bytes, as stores keep them.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::Method;
    /// use idempotency_actix::Fingerprint;
    ///
    /// let fingerprint = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    /// let again = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    /// assert_eq!(fingerprint.as_bytes(), again.as_bytes());
    /// ```
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fingerprint(")?;
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "…)")
    }
}

/// The key of the context every fingerprint is derived in (blake3 key-derivation mode with
/// this crate's context; the same digest as `blake3::derive_key`, pinned by a test below),
/// hashed once per process.
static FINGERPRINT_CONTEXT: LazyLock<ContextKey> =
    LazyLock::new(|| blake3::hazmat::hash_derive_key_context("idempotency-actix fingerprint v1"));

/// The fields of a fingerprint, each after its length (8 bytes, little-endian), so that
/// the encoding is unambiguous: ("/a", "b") never equals ("/ab", "").
struct Fields(GatheredHasher);

impl Fields {
    fn new() -> Self {
        Self(GatheredHasher::new(&FINGERPRINT_CONTEXT))
    }

    fn push(&mut self, field: &[u8]) {
        self.0.push(&(field.len() as u64).to_le_bytes());
        self.0.push(field);
    }

    fn finalize(&mut self) -> [u8; 32] {
        self.0.finalize()
    }
}

/// Which parts of a request go into its [`Fingerprint`].
///
/// The default is method, path, query and body. Add headers whose value changes what the
/// handler does (say, `Accept-Language` or an API version header).
///
/// # Examples
///
/// ```
/// use idempotency_actix::{FingerprintParts, Idempotency};
///
/// let idempotency = Idempotency::memory()
///     .fingerprint(FingerprintParts::default().header("api-version").unwrap());
/// ```
#[derive(Debug, Clone, Default)]
pub struct FingerprintParts {
    headers: Vec<HeaderName>,
}

impl FingerprintParts {
    /// Also fingerprints the value of the header `name` (all its values, in order): a
    /// [`HeaderName`], or a string checked to be one.
    ///
    /// `host` is the request's authority, as Actix's own `guard::Host` reads it: on HTTP/2,
    /// which carries it in the request's URI (`:authority`) and usually sends no `Host`
    /// header, that authority (a `Host` header beside it is not read, as the guard does not
    /// read it); on HTTP/1, the `Host` header. So routes told apart by host (virtual hosts)
    /// answer a key reused on another host 422 over either protocol, and a retry over the
    /// other protocol is the same request.
    ///
    /// # Errors
    ///
    /// When `name` is not a valid header name.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::FingerprintParts;
    ///
    /// let parts = FingerprintParts::default().header("accept-language")?.header("api-version")?;
    /// assert!(FingerprintParts::default().header("not a header").is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn header<N: TryInto<HeaderName>>(mut self, name: N) -> Result<Self, N::Error> {
        self.headers.push(name.try_into()?);
        Ok(self)
    }

    /// The fingerprint of `req` whose body was `body`.
    pub(crate) fn of(&self, req: &ServiceRequest, body: &[u8]) -> Fingerprint {
        let values: Vec<(&str, Vec<u8>)> = self
            .headers
            .iter()
            .map(|name| {
                let authority = (*name == HOST && req.version() >= Version::HTTP_2)
                    .then(|| req.uri().authority())
                    .flatten();
                let joined = match authority {
                    Some(authority) => [authority.as_str().as_bytes(), b"\n"].concat(),
                    None => req
                        .headers()
                        .get_all(name)
                        .flat_map(|value| value.as_bytes().iter().copied().chain([b'\n']))
                        .collect(),
                };
                (name.as_str(), joined)
            })
            .collect();
        Fingerprint::compute(
            req.method(),
            req.path(),
            req.query_string(),
            body,
            values.iter().map(|(name, value)| (*name, value.as_slice())),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    #[test]
    fn every_default_part_changes_the_fingerprint() {
        let base = Fingerprint::compute(&Method::POST, "/a", "x=1", b"body", []);
        assert_ne!(
            base,
            Fingerprint::compute(&Method::PUT, "/a", "x=1", b"body", [])
        );
        assert_ne!(
            base,
            Fingerprint::compute(&Method::POST, "/b", "x=1", b"body", [])
        );
        assert_ne!(
            base,
            Fingerprint::compute(&Method::POST, "/a", "x=2", b"body", [])
        );
        assert_ne!(
            base,
            Fingerprint::compute(&Method::POST, "/a", "x=1", b"bodY", [])
        );
    }

    #[test]
    fn gathering_fields_leaves_the_digest_of_one_update_per_part() {
        let (long_path, long_value) = ("/p".repeat(200), vec![b'v'; 1000]);
        for (path, value) in [
            ("/orders", b"acme".as_slice()),
            (long_path.as_str(), b"acme".as_slice()),
            ("/orders", long_value.as_slice()),
        ] {
            let mut hasher = blake3::Hasher::new_derive_key("idempotency-actix fingerprint v1");
            let body = blake3::hash(b"body");
            for part in [
                b"POST",
                path.as_bytes(),
                b"x=1",
                body.as_bytes(),
                b"x-tenant",
                value,
            ] {
                hasher.update(&(part.len() as u64).to_le_bytes());
                hasher.update(part);
            }
            let computed =
                Fingerprint::compute(&Method::POST, path, "x=1", b"body", [("x-tenant", value)]);
            assert_eq!(computed.as_bytes(), hasher.finalize().as_bytes());
        }
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        assert_ne!(
            Fingerprint::compute(&Method::POST, "/ab", "", b"", []),
            Fingerprint::compute(&Method::POST, "/a", "b", b"", [])
        );
    }

    #[test]
    fn chosen_headers_are_part_of_the_fingerprint() {
        let parts = FingerprintParts::default().header("api-version").unwrap();
        let v1 = TestRequest::post()
            .uri("/a")
            .insert_header(("api-version", "1"))
            .to_srv_request();
        let v2 = TestRequest::post()
            .uri("/a")
            .insert_header(("api-version", "2"))
            .to_srv_request();
        let none = TestRequest::post().uri("/a").to_srv_request();
        assert_ne!(parts.of(&v1, b""), parts.of(&v2, b""));
        assert_ne!(parts.of(&v1, b""), parts.of(&none, b""));
        // Headers not chosen do not matter.
        assert_eq!(
            FingerprintParts::default().of(&v1, b""),
            FingerprintParts::default().of(&v2, b"")
        );
    }

    /// HTTP/2 carries the host in the URI (`:authority`), usually without a `Host` header,
    /// as Actix hands such a request over (and as its `guard::Host` reads it).
    #[test]
    fn the_host_is_the_authority_where_no_host_header_is_sent() {
        let parts = FingerprintParts::default().header("host").unwrap();
        let over_http2 = |authority: &str| {
            let req = TestRequest::post()
                .uri(&format!("http://{authority}/orders"))
                .version(actix_web::http::Version::HTTP_2)
                .to_srv_request();
            assert!(req.headers().get("host").is_none());
            parts.of(&req, b"{}")
        };
        let over_http1 = |host: &str| {
            let req = TestRequest::post()
                .uri("/orders")
                .insert_header(("host", host))
                .to_srv_request();
            parts.of(&req, b"{}")
        };
        assert_ne!(over_http2("a.example"), over_http2("b.example"));
        // A `Host` header beside the authority is not read, as `guard::Host` does not.
        let with_another_host = TestRequest::post()
            .uri("http://b.example/orders")
            .version(actix_web::http::Version::HTTP_2)
            .insert_header(("host", "a.example"))
            .to_srv_request();
        assert_eq!(parts.of(&with_another_host, b"{}"), over_http2("b.example"));
        assert_eq!(over_http2("a.example:8443"), over_http1("a.example:8443"));
        assert_ne!(over_http2("a.example"), over_http1("b.example"));
        // Without the part, hosts do not matter.
        let a = TestRequest::post()
            .uri("http://a.example/orders")
            .to_srv_request();
        let b = TestRequest::post()
            .uri("http://b.example/orders")
            .to_srv_request();
        assert_eq!(
            FingerprintParts::default().of(&a, b"{}"),
            FingerprintParts::default().of(&b, b"{}")
        );
    }
}

/// Fingerprints are stored next to records that outlive a deploy: a change of their value is
/// a change of the record format (every retry across the deploy would get 422), so the
/// digest of known parts is pinned here.
#[cfg(test)]
mod stability {
    use super::*;

    #[test]
    fn the_digest_of_known_parts_never_changes() {
        let fingerprint = Fingerprint::compute(
            &Method::POST,
            "/orders",
            "page=2",
            br#"{"item":"book","qty":1}"#,
            [("x-tenant", b"acme\n".as_slice())],
        );
        let hex: String = fingerprint
            .as_bytes()
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        assert_eq!(
            hex,
            "7af4f218e2e8ae49937a9817bcbbc4b56df523666604ff50af6f1d0e135beebd"
        );
    }
}
