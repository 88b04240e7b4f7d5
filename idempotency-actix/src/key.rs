//! [`IdempotencyKey`]: parsing the `Idempotency-Key` header value.

use actix_web::http::header::{HeaderMap, HeaderName};

/// The longest key accepted, in characters (after removing sf-string quoting).
pub const MAX_KEY_LENGTH: usize = 255;

/// A validated idempotency key taken from a request header.
///
/// Two syntaxes are accepted and mean the same key:
///
/// * the RFC 8941 sf-string form that draft-ietf-httpapi-idempotency-key-header
///   specifies: `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, with `\"` and `\\` as the only
///   escapes;
/// * the bare form most clients send: `8e03978e-40d5-43e8-bc93-6894a57f9324`.
///
/// So `abc` and `"abc"` are the same key. A key is 1 to [`MAX_KEY_LENGTH`] characters of
/// printable ASCII (a space is allowed only inside the quoted form).
///
/// # Examples
///
/// ```
/// use idempotency_actix::IdempotencyKey;
///
/// let bare = IdempotencyKey::parse(b"order-1234").unwrap();
/// let quoted = IdempotencyKey::parse(br#""order-1234""#).unwrap();
/// assert_eq!(bare, quoted);
/// assert_eq!(bare.as_str(), "order-1234");
///
/// assert!(IdempotencyKey::parse(b"").is_err());
/// assert!(IdempotencyKey::parse(br#""unbalanced"#).is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why an `Idempotency-Key` header was rejected. Each variant becomes a 400 problem response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header was present but held no key.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LENGTH`] characters.
    #[error(
        "the idempotency key is {length} characters long; at most {MAX_KEY_LENGTH} are allowed"
    )]
    TooLong {
        /// The length of the rejected key.
        length: usize,
    },
    /// A byte outside printable ASCII (a control character, DEL, or a non-ASCII byte).
    #[error("the idempotency key contains a byte that is not printable ASCII (0x{byte:02x})")]
    InvalidByte {
        /// The offending byte.
        byte: u8,
    },
    /// A quoted key without its closing quote, or a stray quote in a bare key.
    #[error("the idempotency key has an unbalanced quote")]
    UnbalancedQuote,
    /// A backslash in a quoted key that escapes something other than `"` or `\`.
    #[error("the idempotency key has an invalid escape; only \\\" and \\\\ are allowed")]
    InvalidEscape,
    /// Characters after the closing quote of a quoted key.
    #[error("the idempotency key has characters after its closing quote")]
    TrailingCharacters,
    /// The header appeared more than once.
    #[error("the idempotency key header appears more than once")]
    Repeated,
}

impl IdempotencyKey {
    /// Parses a header value in the sf-string or the bare form.
    ///
    /// # Errors
    ///
    /// Returns a [`KeyError`] that says what is wrong with the value.
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        let value = value.trim_ascii();
        let key = match value.split_first() {
            None => return Err(KeyError::Empty),
            Some((b'"', quoted)) => parse_sf_string(quoted)?,
            Some(_) => parse_bare(value)?,
        };
        let length = key.len();
        if length == 0 {
            return Err(KeyError::Empty);
        }
        if length > MAX_KEY_LENGTH {
            return Err(KeyError::TooLong { length });
        }
        Ok(Self(key))
    }

    /// Finds and parses the key in `headers` under `name`.
    ///
    /// Returns `Ok(None)` when the header is absent.
    ///
    /// # Errors
    ///
    /// [`KeyError::Repeated`] when the header appears more than once, otherwise what
    /// [`IdempotencyKey::parse`] reports.
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
    /// use idempotency_actix::{IdempotencyKey, KeyError};
    ///
    /// let name = HeaderName::from_static("idempotency-key");
    /// let mut headers = HeaderMap::new();
    /// assert_eq!(IdempotencyKey::from_headers(&headers, &name), Ok(None));
    ///
    /// headers.append(name.clone(), HeaderValue::from_static("a"));
    /// assert!(IdempotencyKey::from_headers(&headers, &name).unwrap().is_some());
    ///
    /// headers.append(name.clone(), HeaderValue::from_static("b"));
    /// assert_eq!(IdempotencyKey::from_headers(&headers, &name), Err(KeyError::Repeated));
    /// ```
    pub fn from_headers(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(name);
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse(first.as_bytes()).map(Some)
    }

    /// The key, without sf-string quoting or escapes.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Keys may be secrets of the client's (Stripe tells clients to use random UUIDs, some use
/// business ids); `Debug` never prints the value, so a stray `{:?}` cannot leak it into logs.
impl std::fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IdempotencyKey(<{} chars>)", self.0.len())
    }
}

/// Parses what follows the opening quote of an RFC 8941 §3.3.3 sf-string.
fn parse_sf_string(rest: &[u8]) -> Result<String, KeyError> {
    let mut key = String::with_capacity(rest.len());
    let mut bytes = rest.iter().copied();
    while let Some(byte) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some(escaped @ (b'"' | b'\\')) => key.push(char::from(escaped)),
                Some(_) => return Err(KeyError::InvalidEscape),
                None => return Err(KeyError::UnbalancedQuote),
            },
            b'"' => {
                return match bytes.next() {
                    None => Ok(key),
                    Some(_) => Err(KeyError::TrailingCharacters),
                };
            }
            0x20..=0x7e => key.push(char::from(byte)),
            _ => return Err(KeyError::InvalidByte { byte }),
        }
    }
    Err(KeyError::UnbalancedQuote)
}

/// Parses the bare form: visible ASCII (0x21..=0x7e) without quotes.
fn parse_bare(value: &[u8]) -> Result<String, KeyError> {
    for &byte in value {
        match byte {
            b'"' => return Err(KeyError::UnbalancedQuote),
            0x21..=0x7e => {}
            _ => return Err(KeyError::InvalidByte { byte }),
        }
    }
    // Every byte was checked to be ASCII above.
    Ok(value.iter().map(|&byte| char::from(byte)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::http::header::HeaderValue;

    fn parse(value: &[u8]) -> Result<String, KeyError> {
        IdempotencyKey::parse(value).map(|key| key.as_str().to_owned())
    }

    #[test]
    fn bare_and_quoted_forms_are_the_same_key() {
        assert_eq!(parse(b"abc"), Ok("abc".to_owned()));
        assert_eq!(parse(b"\"abc\""), Ok("abc".to_owned()));
        assert_eq!(
            IdempotencyKey::parse(b"abc").unwrap(),
            IdempotencyKey::parse(b"\"abc\"").unwrap()
        );
    }

    #[test]
    fn a_uuid_key_is_accepted_in_both_forms() {
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(parse(uuid.as_bytes()), Ok(uuid.to_owned()));
        assert_eq!(parse(format!("\"{uuid}\"").as_bytes()), Ok(uuid.to_owned()));
    }

    #[test]
    fn quoted_form_unescapes_quote_and_backslash() {
        assert_eq!(parse(br#""a\"b\\c""#), Ok(r#"a"b\c"#.to_owned()));
        assert_eq!(parse(b"\"with space\""), Ok("with space".to_owned()));
    }

    #[test]
    fn surrounding_whitespace_is_ignored() {
        assert_eq!(parse(b"  abc \t"), Ok("abc".to_owned()));
    }

    #[test]
    fn empty_values_are_rejected() {
        assert_eq!(parse(b""), Err(KeyError::Empty));
        assert_eq!(parse(b"   "), Err(KeyError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
    }

    #[test]
    fn the_length_limit_is_255_characters() {
        let longest = "k".repeat(255);
        assert_eq!(parse(longest.as_bytes()), Ok(longest.clone()));
        assert_eq!(
            parse("k".repeat(256).as_bytes()),
            Err(KeyError::TooLong { length: 256 })
        );
        // Quoting does not count towards the length, escapes count once.
        assert!(parse(format!("\"{longest}\"").as_bytes()).is_ok());
        assert_eq!(
            parse(format!("\"{}\"", "\\\\".repeat(256)).as_bytes()),
            Err(KeyError::TooLong { length: 256 })
        );
    }

    #[test]
    fn control_characters_are_rejected() {
        assert_eq!(parse(b"ab\x00c"), Err(KeyError::InvalidByte { byte: 0 }));
        assert_eq!(parse(b"ab\x1bc"), Err(KeyError::InvalidByte { byte: 0x1b }));
        assert_eq!(parse(b"ab\x7fc"), Err(KeyError::InvalidByte { byte: 0x7f }));
        assert_eq!(
            parse(b"\"a\tb\""),
            Err(KeyError::InvalidByte { byte: b'\t' })
        );
        assert_eq!(parse(b"a b"), Err(KeyError::InvalidByte { byte: b' ' }));
    }

    #[test]
    fn non_ascii_bytes_are_rejected() {
        assert_eq!(
            parse("clé".as_bytes()),
            Err(KeyError::InvalidByte { byte: 0xc3 })
        );
        assert_eq!(
            parse(b"\"\xff\""),
            Err(KeyError::InvalidByte { byte: 0xff })
        );
    }

    #[test]
    fn unbalanced_quotes_are_rejected() {
        assert_eq!(parse(b"\"abc"), Err(KeyError::UnbalancedQuote));
        assert_eq!(parse(b"abc\""), Err(KeyError::UnbalancedQuote));
        assert_eq!(parse(b"a\"bc"), Err(KeyError::UnbalancedQuote));
        assert_eq!(parse(b"\""), Err(KeyError::UnbalancedQuote));
        assert_eq!(parse(b"\"abc\\\""), Err(KeyError::UnbalancedQuote));
        assert_eq!(parse(b"\"abc\\"), Err(KeyError::UnbalancedQuote));
    }

    #[test]
    fn bad_escapes_are_rejected() {
        assert_eq!(parse(br#""a\nb""#), Err(KeyError::InvalidEscape));
        assert_eq!(parse(br#""\u0041""#), Err(KeyError::InvalidEscape));
    }

    #[test]
    fn characters_after_the_closing_quote_are_rejected() {
        assert_eq!(parse(br#""abc"def"#), Err(KeyError::TrailingCharacters));
        assert_eq!(parse(br#""a";b"#), Err(KeyError::TrailingCharacters));
    }

    #[test]
    fn a_repeated_header_is_rejected() {
        let name = HeaderName::from_static("idempotency-key");
        let mut headers = HeaderMap::new();
        headers.append(name.clone(), HeaderValue::from_static("same"));
        headers.append(name.clone(), HeaderValue::from_static("same"));
        assert_eq!(
            IdempotencyKey::from_headers(&headers, &name),
            Err(KeyError::Repeated)
        );
    }

    #[test]
    fn debug_output_never_shows_the_key() {
        let key = IdempotencyKey::parse(b"secret-value").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
    }
}
