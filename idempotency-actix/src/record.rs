//! [`StoredResponse`] and its compact, versioned binary encoding.
//!
//! Layout of version 1 (all integers big-endian):
//!
//! ```text
//! u8  version (= 1)
//! u16 status
//! u8  flags            bit 0: the body was stored
//! u16 header count
//!     per header: u16 name length, name, u32 value length, value
//! ... body bytes, raw, to the end
//! ```
//!
//! The body is stored as raw bytes (no base64), so a record is its body plus a few dozen
//! bytes of header.

use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::web::Bytes;

/// The version byte written first in every encoded record.
///
/// # Examples
///
/// ```
/// use actix_web::http::StatusCode;
/// use idempotency_actix::{RECORD_VERSION, StoredResponse};
///
/// let record = StoredResponse::new(StatusCode::OK, Vec::new(), None).encode();
/// assert_eq!(record[0], RECORD_VERSION);
/// ```
pub const RECORD_VERSION: u8 = 1;

const FLAG_BODY_STORED: u8 = 1;

/// A completed response as stores keep it: what a replay sends back.
///
/// # Examples
///
/// ```
/// use actix_web::http::{StatusCode, header::{HeaderName, HeaderValue}};
/// use actix_web::web::Bytes;
/// use idempotency_actix::StoredResponse;
///
/// let response = StoredResponse::new(
///     StatusCode::CREATED,
///     vec![(HeaderName::from_static("location"), HeaderValue::from_static("/orders/7"))],
///     Some(Bytes::from_static(b"{\"id\":7}")),
/// );
/// let bytes = response.encode();
/// assert_eq!(StoredResponse::decode(&bytes)?, response);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredResponse {
    /// The handler's status code.
    pub status: StatusCode,
    /// The headers that are replayed, in the order the handler set them.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body; `None` when it was larger than the maximum stored body, in which case a
    /// replay answers the stored status and headers with an empty body and
    /// `Idempotent-Body-Omitted: true`.
    pub body: Option<Bytes>,
}

/// Why bytes in a store could not be decoded as a [`StoredResponse`].
///
/// # Examples
///
/// ```
/// use actix_web::http::StatusCode;
/// use idempotency_actix::{RECORD_VERSION, RecordError, StoredResponse};
///
/// let bytes = StoredResponse::new(StatusCode::OK, Vec::new(), None).encode();
/// assert_eq!(StoredResponse::decode(&bytes[..2]), Err(RecordError::Truncated));
/// let mut newer = bytes.clone();
/// newer[0] = RECORD_VERSION + 1;
/// assert_eq!(StoredResponse::decode(&newer), Err(RecordError::UnsupportedVersion(2)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The record was written by a version of this crate that this one does not read.
    #[error("record version {0} is not supported (this version reads {RECORD_VERSION})")]
    UnsupportedVersion(u8),
    /// The record ends before its fields do.
    #[error("record is truncated")]
    Truncated,
    /// A field holds a value that is not valid (status code, header name or value).
    #[error("record holds an invalid {0}")]
    Invalid(&'static str),
    /// The store holds a value of another kind under the record's key: on Redis, a key of
    /// another type (a hash, a list…), written by another program under the prefix or by a
    /// development build from before records were one string. Never taken for a free key.
    #[error("the key holds a value of another type, not a record")]
    OtherType,
}

impl StoredResponse {
    /// A stored response: what a replay answers (`body: None` when it was not stored).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::StatusCode;
    /// use idempotency_actix::StoredResponse;
    ///
    /// // A response whose body was over the stored-body limit:
    /// let response = StoredResponse::new(StatusCode::OK, Vec::new(), None);
    /// assert_eq!(response.status, StatusCode::OK);
    /// assert!(response.headers.is_empty() && response.body.is_none());
    /// ```
    pub fn new(
        status: StatusCode,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Option<Bytes>,
    ) -> Self {
        Self {
            status,
            headers,
            body,
        }
    }

    /// Encodes the response in the current record version.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::StatusCode;
    /// use idempotency_actix::{RECORD_VERSION, StoredResponse};
    ///
    /// let bytes = StoredResponse::new(StatusCode::NO_CONTENT, Vec::new(), None).encode();
    /// // The version, the status (204), the flags (no body stored), the header count (0):
    /// assert_eq!(bytes, [RECORD_VERSION, 0, 204, 0, 0, 0]);
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut out);
        out
    }

    /// At least the length of [`encode`](Self::encode)'s bytes, to reserve room for them.
    pub(crate) fn encoded_len(&self) -> usize {
        let headers_len: usize = self
            .headers
            .iter()
            .map(|(name, value)| 6 + name.as_str().len() + value.len())
            .sum();
        6 + headers_len + self.body.as_deref().map_or(0, <[u8]>::len)
    }

    /// Appends what [`encode`](Self::encode) returns to `out` (a record that holds the
    /// encoded response after a header of its own is written in one buffer).
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        let body = self.body.as_deref().unwrap_or_default();
        out.push(RECORD_VERSION);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        out.push(if self.body.is_some() {
            FLAG_BODY_STORED
        } else {
            0
        });
        // Header counts and sizes are far below these bounds (actix limits header sizes);
        // headers that would not fit are dropped rather than corrupting the record.
        let headers = || {
            self.headers
                .iter()
                .filter(|(name, value)| {
                    u16::try_from(name.as_str().len()).is_ok() && u32::try_from(value.len()).is_ok()
                })
                .take(usize::from(u16::MAX))
        };
        out.extend_from_slice(&(headers().count() as u16).to_be_bytes());
        for (name, value) in headers() {
            out.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(body);
    }

    /// Decodes a record; never panics, whatever the input.
    ///
    /// # Errors
    ///
    /// A [`RecordError`] when the bytes are not a record this version can read.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::StatusCode;
    /// use actix_web::web::Bytes;
    /// use idempotency_actix::StoredResponse;
    ///
    /// let body = Some(Bytes::from_static(b"{}"));
    /// let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), body);
    /// assert_eq!(StoredResponse::decode(&response.encode())?, response);
    /// assert!(StoredResponse::decode(b"").is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn decode(bytes: &[u8]) -> Result<Self, RecordError> {
        let (mut response, body) = Self::decode_head(bytes)?;
        response.body = body.map(|start| Bytes::copy_from_slice(&bytes[start..]));
        Ok(response)
    }

    /// Decodes a record whose bytes are already shared: the body is a slice of `bytes`, not
    /// a copy (a large body costs nothing to decode). Never panics, whatever the input.
    ///
    /// # Errors
    ///
    /// A [`RecordError`] when the bytes are not a record this version can read.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::StatusCode;
    /// use actix_web::web::Bytes;
    /// use idempotency_actix::StoredResponse;
    ///
    /// let response = StoredResponse::new(StatusCode::OK, Vec::new(), Some(Bytes::from(vec![7; 4096])));
    /// let shared = Bytes::from(response.encode());
    /// assert_eq!(StoredResponse::decode_shared(shared)?, response);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn decode_shared(bytes: Bytes) -> Result<Self, RecordError> {
        let (mut response, body) = Self::decode_head(&bytes)?;
        response.body = body.map(|start| bytes.slice(start..));
        Ok(response)
    }

    /// Decodes everything but the body, and says where the body starts, if it was stored.
    fn decode_head(bytes: &[u8]) -> Result<(Self, Option<usize>), RecordError> {
        let mut reader = Reader(bytes);
        let version = reader.u8()?;
        if version != RECORD_VERSION {
            return Err(RecordError::UnsupportedVersion(version));
        }
        let status =
            StatusCode::from_u16(reader.u16()?).map_err(|_| RecordError::Invalid("status code"))?;
        let flags = reader.u8()?;
        let count = reader.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count).min(64));
        for _ in 0..count {
            let name_len = usize::from(reader.u16()?);
            let name = header_name(reader.take(name_len)?)?;
            let value_len = usize::try_from(reader.u32()?)
                .map_err(|_| RecordError::Invalid("header length"))?;
            let value = HeaderValue::from_bytes(reader.take(value_len)?)
                .map_err(|_| RecordError::Invalid("header value"))?;
            headers.push((name, value));
        }
        let body_start = bytes.len() - reader.0.len();
        let response = Self {
            status,
            headers,
            body: None,
        };
        Ok((
            response,
            (flags & FLAG_BODY_STORED != 0).then_some(body_start),
        ))
    }
}

/// The header name stored as `bytes`. The names most responses carry are matched first:
/// `HeaderName::from_bytes` checks and lowercases byte by byte, several hundred
/// instructions per name on every replay.
fn header_name(bytes: &[u8]) -> Result<HeaderName, RecordError> {
    use actix_web::http::header;
    let known = match bytes {
        b"content-type" => header::CONTENT_TYPE,
        b"location" => header::LOCATION,
        b"content-encoding" => header::CONTENT_ENCODING,
        b"content-language" => header::CONTENT_LANGUAGE,
        b"cache-control" => header::CACHE_CONTROL,
        b"etag" => header::ETAG,
        b"last-modified" => header::LAST_MODIFIED,
        b"vary" => header::VARY,
        b"link" => header::LINK,
        _ => {
            return HeaderName::from_bytes(bytes).map_err(|_| RecordError::Invalid("header name"));
        }
    };
    Ok(known)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], RecordError> {
        if self.0.len() < len {
            return Err(RecordError::Truncated);
        }
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], RecordError> {
        let mut array = [0; N];
        array.copy_from_slice(self.take(N)?);
        Ok(array)
    }

    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, RecordError> {
        self.array().map(u16::from_be_bytes)
    }

    fn u32(&mut self) -> Result<u32, RecordError> {
        self.array().map(u32::from_be_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    HeaderName::from_static("location"),
                    HeaderValue::from_static("/orders/1"),
                ),
                (
                    HeaderName::from_static("x-multi"),
                    HeaderValue::from_static("a"),
                ),
                (
                    HeaderName::from_static("x-multi"),
                    HeaderValue::from_static("b"),
                ),
            ],
            body: Some(Bytes::from_static(b"\x00\xffbinary body")),
        }
    }

    #[test]
    fn round_trips_headers_in_order_and_raw_body() {
        let response = sample();
        assert_eq!(StoredResponse::decode(&response.encode()), Ok(response));
    }

    #[test]
    fn header_names_decode_as_header_name_from_bytes_reads_them() {
        for name in [
            "content-type",
            "location",
            "content-encoding",
            "content-language",
            "cache-control",
            "etag",
            "last-modified",
            "vary",
            "link",
            "x-request-id",
            "Content-Type",
            "LOCATION",
        ] {
            let expected = HeaderName::from_bytes(name.as_bytes()).unwrap();
            assert_eq!(header_name(name.as_bytes()), Ok(expected), "{name}");
        }
        for invalid in ["", "bad name", "line\nbreak"] {
            assert_eq!(
                header_name(invalid.as_bytes()),
                Err(RecordError::Invalid("header name")),
                "{invalid:?}"
            );
        }
    }

    #[test]
    fn a_shared_decode_reads_what_a_copying_decode_reads() {
        let bytes = sample().encode();
        for len in 0..=bytes.len() {
            assert_eq!(
                StoredResponse::decode_shared(Bytes::copy_from_slice(&bytes[..len])),
                StoredResponse::decode(&bytes[..len])
            );
        }
    }

    #[test]
    fn body_is_stored_raw_without_inflation() {
        let mut response = sample();
        response.body = Some(Bytes::from(vec![7u8; 10_000]));
        let encoded = response.encode();
        assert!(encoded.len() < 10_000 + 100, "{} bytes", encoded.len());
    }

    #[test]
    fn an_omitted_body_differs_from_an_empty_body() {
        let mut omitted = sample();
        omitted.body = None;
        let mut empty = sample();
        empty.body = Some(Bytes::new());
        assert_eq!(StoredResponse::decode(&omitted.encode()), Ok(omitted));
        assert_eq!(StoredResponse::decode(&empty.encode()), Ok(empty));
    }

    #[test]
    fn unknown_versions_are_reported_not_misread() {
        let mut bytes = sample().encode();
        bytes[0] = 2;
        assert_eq!(
            StoredResponse::decode(&bytes),
            Err(RecordError::UnsupportedVersion(2))
        );
    }

    #[test]
    fn every_truncation_is_an_error_or_a_shorter_body() {
        let bytes = sample().encode();
        for len in 0..bytes.len() {
            // Must never panic; a cut inside the body still decodes (shorter body).
            let _ = StoredResponse::decode(&bytes[..len]);
        }
        assert_eq!(
            StoredResponse::decode(&bytes[..3]),
            Err(RecordError::Truncated)
        );
    }

    #[test]
    fn invalid_fields_are_errors() {
        assert_eq!(
            StoredResponse::decode(&[1, 0, 5, 0, 0, 0]),
            Err(RecordError::Invalid("status code"))
        );
        assert_eq!(
            StoredResponse::decode(&[1, 0, 200, 0, 0, 1, 0, 1, b' ', 0, 0, 0, 0]),
            Err(RecordError::Invalid("header name"))
        );
    }
}
