//! [`ReplayedHeaders`]: which response headers are stored and replayed, and how a replay is
//! answered.

use actix_web::HttpResponse;
use actix_web::http::header::{CONNECTION, HeaderMap, HeaderName, HeaderValue};

use crate::record::StoredResponse;

/// The header every replayed response carries: `Idempotent-Replayed: true`.
///
/// # Examples
///
/// ```
/// use actix_web::http::header::HeaderName;
/// use idempotency_actix::REPLAYED_HEADER;
///
/// assert_eq!(HeaderName::from_static(REPLAYED_HEADER), "idempotent-replayed");
/// ```
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The header a replay carries when the original body was too large to store:
/// `Idempotent-Body-Omitted: true` (the status and headers are the original's, the body is
/// empty).
///
/// # Examples
///
/// ```
/// use actix_web::http::header::HeaderName;
/// use idempotency_actix::BODY_OMITTED_HEADER;
///
/// assert_eq!(HeaderName::from_static(BODY_OMITTED_HEADER), "idempotent-body-omitted");
/// ```
pub const BODY_OMITTED_HEADER: &str = "idempotent-body-omitted";

/// The two header names above, built at compile time: `HeaderName::from_static` called at
/// run time checks its argument every time.
const REPLAYED: HeaderName = HeaderName::from_static(REPLAYED_HEADER);
const BODY_OMITTED: HeaderName = HeaderName::from_static(BODY_OMITTED_HEADER);
const TRUE: HeaderValue = HeaderValue::from_static("true");

/// Whether `name` is a header that is never stored or replayed: cookies (a session minted
/// for the first request must not be handed out again), `Date` (the replay gets its own),
/// hop-by-hop headers, and the framing headers the server recomputes.
///
/// One `match` on the (lowercase) name: comparing it with a list of `HeaderName`s cost about
/// a hundred instructions per stored header, as custom names compare byte by byte.
fn is_never_replayed(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "set-cookie"
            | "date"
            | "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "content-length"
    )
}

/// Which response headers a replay repeats.
///
/// By default every header except `Set-Cookie`, `Date`, the hop-by-hop headers
/// (`Connection`, `Keep-Alive`, `Proxy-Connection`, `Proxy-Authenticate`, `TE`, `Trailer`,
/// `Transfer-Encoding`, `Upgrade`, and any header the response's `Connection` names) and
/// `Content-Length` (recomputed from the stored body).
/// `Content-Encoding` is kept: it describes the stored bytes. A replay of a record stored
/// without its body (it was over the stored-body limit, or broke off) leaves out the
/// headers that describe the body's bytes (`Content-Encoding`, `Content-Range`,
/// `Content-MD5`, `Content-Digest`, `Repr-Digest`, `Digest`), which its empty body would
/// contradict. [`ReplayedHeaders::only`]
/// narrows this to an allow-list; the headers above are never replayed even when listed.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{Idempotency, ReplayedHeaders};
///
/// let idempotency = Idempotency::memory()
///     .replayed_headers(ReplayedHeaders::only(["location", "content-type"]).unwrap());
/// ```
#[derive(Debug, Clone, Default)]
pub struct ReplayedHeaders {
    allow_list: Option<Vec<HeaderName>>,
}

impl ReplayedHeaders {
    /// Every header but the ones never replayed (the default).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{App, HttpResponse, http::Method, test, web};
    /// use idempotency_actix::{Idempotency, MemoryStore, ReplayedHeaders};
    ///
    /// # actix_web::rt::System::new().block_on(async {
    /// let headers = ReplayedHeaders::all();
    /// let idempotency = Idempotency::new(MemoryStore::new()).replayed_headers(headers);
    /// let handler = || async {
    ///     HttpResponse::Created()
    ///         .insert_header(("location", "/orders/7"))
    ///         .insert_header(("set-cookie", "s=1"))
    ///         .finish()
    /// };
    /// let app = App::new().wrap(idempotency.protect_methods([Method::POST]));
    /// let app = test::init_service(app.route("/", web::post().to(handler))).await;
    /// let request =
    ///     || test::TestRequest::post().insert_header(("Idempotency-Key", "k")).to_request();
    /// test::call_service(&app, request()).await;
    /// let replay = test::call_service(&app, request()).await;
    /// assert_eq!(replay.headers().get("location").unwrap(), "/orders/7");
    /// assert!(replay.headers().get("set-cookie").is_none()); // never replayed
    /// # });
    /// ```
    pub fn all() -> Self {
        Self::default()
    }

    /// Only the listed headers (and never the ones never replayed): [`HeaderName`]s, or
    /// strings checked to be header names.
    ///
    /// # Errors
    ///
    /// When a name is not a valid header name.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ReplayedHeaders;
    ///
    /// assert!(ReplayedHeaders::only(["location", "content-type"]).is_ok());
    /// assert!(ReplayedHeaders::only(["not a header"]).is_err());
    /// ```
    pub fn only<I>(names: I) -> Result<Self, <I::Item as TryInto<HeaderName>>::Error>
    where
        I: IntoIterator,
        I::Item: TryInto<HeaderName>,
    {
        let names = names
            .into_iter()
            .map(TryInto::try_into)
            .collect::<Result<_, _>>()?;
        Ok(Self {
            allow_list: Some(names),
        })
    }

    fn is_replayed(&self, name: &HeaderName) -> bool {
        !is_never_replayed(name)
            && self
                .allow_list
                .as_ref()
                .is_none_or(|allowed| allowed.contains(name))
    }

    /// The headers of `headers` that are stored, in order: neither those never replayed nor
    /// those the response's `Connection` header names, which are hop-by-hop too (RFC 9110
    /// §7.6.1).
    pub(crate) fn select(&self, headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
        let connection_options = headers.get_all(CONNECTION);
        let named_by_connection = |name: &HeaderName| {
            connection_options.clone().any(|value| {
                value.as_bytes().split(|&byte| byte == b',').any(|option| {
                    option
                        .trim_ascii()
                        .eq_ignore_ascii_case(name.as_str().as_bytes())
                })
            })
        };
        headers
            .iter()
            .filter(|(name, _)| self.is_replayed(name) && !named_by_connection(name))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect()
    }
}

/// Whether `name` describes the bytes of the body it came with: a replay without its body
/// leaves it out, as it would not hold for the empty body sent instead (an empty body is no
/// gzip stream, so a client that decodes `Content-Encoding: gzip` fails to read it).
fn describes_the_body_bytes(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "content-encoding"
            | "content-range"
            | "content-md5"
            | "content-digest"
            | "repr-digest"
            | "digest"
    )
}

/// The response a replay sends: the stored status, headers and body, plus
/// `Idempotent-Replayed: true`. A record completed without its body is replayed with an
/// empty body, `Idempotent-Body-Omitted: true`, and its headers but those that describe
/// the body's bytes.
pub(crate) fn replay_response(stored: StoredResponse) -> HttpResponse {
    let mut response = HttpResponse::with_body(stored.status, ());
    let headers = response.headers_mut();
    let omitted = stored.body.is_none();
    for (name, value) in stored.headers {
        if !(omitted && describes_the_body_bytes(&name)) {
            headers.append(name, value);
        }
    }
    headers.insert(REPLAYED, TRUE);
    if omitted {
        headers.insert(BODY_OMITTED, TRUE);
    }
    response
        .set_body(stored.body.unwrap_or_default())
        .map_into_boxed_body()
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header;

    /// A header map of `pairs`, in order, repeated names appended.
    fn header_map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for &(name, value) in pairs {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        headers
    }

    fn headers() -> HeaderMap {
        header_map(&[
            ("location", "/orders/1"),
            ("set-cookie", "session=new"),
            ("date", "Sun, 29 Nov 2026 00:00:00 GMT"),
            ("content-type", "application/json"),
            ("connection", "close"),
            ("transfer-encoding", "chunked"),
            ("content-length", "3"),
        ])
    }

    fn names(selected: Vec<(HeaderName, HeaderValue)>) -> Vec<String> {
        let mut names: Vec<_> = selected.into_iter().map(|(n, _)| n.to_string()).collect();
        names.sort();
        names
    }

    #[test]
    fn by_default_all_but_cookies_dates_and_framing_are_replayed() {
        assert_eq!(
            names(ReplayedHeaders::all().select(&headers())),
            ["content-type", "location"]
        );
    }

    #[test]
    fn no_hop_by_hop_or_framing_header_is_ever_replayed() {
        let never = [
            header::SET_COOKIE,
            header::DATE,
            header::CONNECTION,
            HeaderName::from_static("keep-alive"),
            HeaderName::from_static("proxy-connection"),
            header::PROXY_AUTHENTICATE,
            header::TE,
            header::TRAILER,
            header::TRANSFER_ENCODING,
            header::UPGRADE,
            header::CONTENT_LENGTH,
        ];
        let mut headers = HeaderMap::new();
        for name in never
            .iter()
            .chain([&header::LOCATION, &header::CONTENT_TYPE])
        {
            headers.append(name.clone(), HeaderValue::from_static("x"));
        }
        let listed = ReplayedHeaders::only(never.iter().chain([&header::LOCATION])).unwrap();
        assert_eq!(
            names(ReplayedHeaders::all().select(&headers)),
            ["content-type", "location"]
        );
        assert_eq!(names(listed.select(&headers)), ["location"]);
    }

    #[test]
    fn headers_the_connection_header_names_are_hop_by_hop() {
        let headers = header_map(&[
            ("connection", "keep-alive, X-Hop"),
            ("connection", "x-other"),
            ("x-hop", "secret"),
            ("x-other", "1"),
            ("x-kept", "2"),
            ("location", "/orders/1"),
        ]);
        assert_eq!(
            names(ReplayedHeaders::all().select(&headers)),
            ["location", "x-kept"]
        );
        let listed = ReplayedHeaders::only(["x-hop", "location"]).unwrap();
        assert_eq!(names(listed.select(&headers)), ["location"]);
    }

    #[test]
    fn an_allow_list_narrows_but_never_reopens() {
        let only = ReplayedHeaders::only(["location", "set-cookie"]).unwrap();
        assert!(ReplayedHeaders::only(["location", "bad name"]).is_err());
        assert_eq!(names(only.select(&headers())), ["location"]);
    }
}
