//! [`IdempotencyKey`]: parsing the `Idempotency-Key` header value.

use actix_web::http::header::{HeaderMap, HeaderName};

/// The longest key accepted by default, in characters (after removing sf-string quoting);
/// an app that takes longer keys says so with
/// [`Idempotency::max_key_length`](crate::Idempotency::max_key_length).
///
/// # Examples
///
/// ```
/// use idempotency_actix::{IdempotencyKey, MAX_KEY_LENGTH};
///
/// let longest = "k".repeat(MAX_KEY_LENGTH);
/// assert!(IdempotencyKey::parse(longest.as_bytes()).is_ok());
/// let quoted = format!("\"{longest}\""); // the quotes do not count
/// assert!(IdempotencyKey::parse(quoted.as_bytes()).is_ok());
/// assert!(IdempotencyKey::parse(format!("{longest}k").as_bytes()).is_err());
/// ```
pub const MAX_KEY_LENGTH: usize = 255;

/// A validated idempotency key taken from a request header.
///
/// The header is an RFC 8941 structured field whose value is one *item*: the key, optionally
/// followed by parameters. Two forms of the key are accepted and mean the same key:
///
/// * the sf-string form that draft-ietf-httpapi-idempotency-key-header specifies:
///   `"8e03978e-40d5-43e8-bc93-6894a57f9324"`, with `\"` and `\\` as the only escapes;
/// * the bare form most clients send: `8e03978e-40d5-43e8-bc93-6894a57f9324`, any visible
///   ASCII except `"`, `,` and `;`, taken literally as text (`42` is the key `42`, not a number).
///
/// So `abc` and `"abc"` are the same key. A key is 1 to [`MAX_KEY_LENGTH`] characters of
/// printable ASCII (a space is allowed only inside the quoted form), or as many as the app
/// allows ([`IdempotencyKey::parse_within`]).
///
/// Parameters after a quoted key (`"abc";v=1`) must follow RFC 8941's syntax and are ignored:
/// that is the key `abc`. After a bare key a `;` is refused with
/// [`KeyError::UnquotedParameters`]: `order;a` could be the key `order;a` or the key `order`
/// with a parameter, and taking either reading silently would give two keys one record (a
/// replay of another operation) or split one. A list (`k1, k2`, what a proxy makes of two
/// header lines) is refused with [`KeyError::List`], like a repeated header.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{IdempotencyKey, KeyError};
///
/// let bare = IdempotencyKey::parse(b"order-1234")?;
/// let quoted = IdempotencyKey::parse(br#""order-1234""#)?;
/// let with_parameter = IdempotencyKey::parse(br#""order-1234";v=1"#)?;
/// assert_eq!(bare, quoted);
/// assert_eq!(bare, with_parameter);
/// assert_eq!(bare.as_str(), "order-1234");
///
/// assert_eq!(
///     IdempotencyKey::parse(b"order-1234;v=1"),
///     Err(KeyError::UnquotedParameters)
/// );
/// assert!(IdempotencyKey::parse(b"").is_err());
/// assert!(IdempotencyKey::parse(br#""unbalanced"#).is_err());
/// assert_eq!(IdempotencyKey::parse(b"k1, k2"), Err(KeyError::List));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why an `Idempotency-Key` header was rejected. Each variant becomes a 400 problem response.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{IdempotencyKey, KeyError, MAX_KEY_LENGTH};
///
/// assert_eq!(IdempotencyKey::parse(b"  "), Err(KeyError::Empty));
/// let long = "k".repeat(MAX_KEY_LENGTH + 1);
/// assert_eq!(
///     IdempotencyKey::parse(long.as_bytes()),
///     Err(KeyError::TooLong { length: 256, limit: 255 })
/// );
/// assert_eq!(IdempotencyKey::parse(br#""a\n""#), Err(KeyError::InvalidEscape));
/// assert_eq!(IdempotencyKey::parse(br#""abc"x"#), Err(KeyError::TrailingCharacters));
/// assert_eq!(KeyError::Repeated.to_string(), "the idempotency key header appears more than once");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The header was present but held no key.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than the app allows ([`MAX_KEY_LENGTH`] characters unless it says
    /// otherwise).
    #[error("the idempotency key is {length} characters long; at most {limit} are allowed")]
    TooLong {
        /// The length of the rejected key.
        length: usize,
        /// The most characters a key may have.
        limit: usize,
    },
    /// A byte outside printable ASCII (a control character, DEL, or a non-ASCII byte).
    #[error("the idempotency key contains a byte that is not printable ASCII (0x{byte:02x})")]
    InvalidByte {
        /// The offending byte.
        byte: u8,
    },
    /// A space inside a bare key (`order 1`): only the quoted form (`"order 1"`) may hold
    /// one. (A space is printable ASCII, so this is not [`KeyError::InvalidByte`].)
    #[error(
        "the idempotency key contains a space, which only a quoted key may hold; send it \
         quoted (\"order 1\"), or without the space"
    )]
    UnquotedSpace,
    /// A quoted key without its closing quote, or a stray quote in a bare key.
    #[error("the idempotency key has an unbalanced quote")]
    UnbalancedQuote,
    /// A backslash in a quoted key that escapes something other than `"` or `\`.
    #[error("the idempotency key has an invalid escape; only \\\" and \\\\ are allowed")]
    InvalidEscape,
    /// Characters after the closing quote of a quoted key (or after its parameters).
    #[error("the idempotency key has characters after its closing quote")]
    TrailingCharacters,
    /// A parameter after the key that is not RFC 8941 parameter syntax (`;name` or
    /// `;name=value`, with a lowercase name and a string, token, number, byte sequence or
    /// boolean as value).
    #[error("the idempotency key has a malformed parameter")]
    InvalidParameter,
    /// A `;` after a bare key: parameters need the quoted form (`"abc";v=1`), as a bare
    /// `abc;v=1` could as well be the key `abc;v=1`.
    #[error(
        "the idempotency key is followed by ';' without quotes; send parameters after a \
         quoted key (\"abc\";v=1), or quote a key that contains ';'"
    )]
    UnquotedParameters,
    /// The header holds a list of keys (`k1, k2`), as when a proxy combines two header lines.
    #[error("the idempotency key header holds more than one key")]
    List,
    /// The header appeared more than once.
    #[error("the idempotency key header appears more than once")]
    Repeated,
}

impl IdempotencyKey {
    /// Parses a header value: an sf-string, then parameters, which are ignored; or a bare key
    /// of at most [`MAX_KEY_LENGTH`] characters.
    ///
    /// # Errors
    ///
    /// Returns a [`KeyError`] that says what is wrong with the value.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::IdempotencyKey;
    ///
    /// let key = IdempotencyKey::parse(br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#)?;
    /// assert_eq!(key.as_str(), "8e03978e-40d5-43e8-bc93-6894a57f9324");
    /// // Surrounding whitespace is not part of the key; `\"` and `\\` are the only escapes.
    /// assert_eq!(IdempotencyKey::parse(b" order-1 ")?.as_str(), "order-1");
    /// assert_eq!(IdempotencyKey::parse(br#""say \"hi\"""#)?.as_str(), r#"say "hi""#);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn parse(value: &[u8]) -> Result<Self, KeyError> {
        Self::parse_within(value, MAX_KEY_LENGTH)
    }

    /// [`IdempotencyKey::parse`], for a key of at most `max_length` characters (what
    /// [`Idempotency::max_key_length`](crate::Idempotency::max_key_length) sets).
    ///
    /// # Errors
    ///
    /// Returns a [`KeyError`] that says what is wrong with the value.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyKey, KeyError};
    ///
    /// let signed = "k".repeat(400);
    /// assert!(IdempotencyKey::parse_within(signed.as_bytes(), 512).is_ok());
    /// assert_eq!(
    ///     IdempotencyKey::parse_within(signed.as_bytes(), 300),
    ///     Err(KeyError::TooLong { length: 400, limit: 300 })
    /// );
    /// ```
    pub fn parse_within(value: &[u8], max_length: usize) -> Result<Self, KeyError> {
        let value = value.trim_ascii();
        let (key, rest) = match value.split_first() {
            None => return Err(KeyError::Empty),
            Some((b'"', quoted)) => parse_sf_string(quoted)?,
            Some(_) => match parse_bare(value)? {
                (_, [b';', ..]) => return Err(KeyError::UnquotedParameters),
                bare => bare,
            },
        };
        let after_parameters = skip_parameters(rest)?;
        if let Some(&first) = after_parameters.first() {
            return Err(match after_parameters.trim_ascii_start().first() {
                Some(b',') => KeyError::List,
                // A space (or tab) inside a bare key is what the client most likely meant.
                _ if value[0] != b'"' && rest.len() == after_parameters.len() => match first {
                    b' ' => KeyError::UnquotedSpace,
                    byte => KeyError::InvalidByte { byte },
                },
                _ => KeyError::TrailingCharacters,
            });
        }
        let length = key.len();
        // A quoted key of spaces alone (`"  "`) holds no key either.
        if key.bytes().all(|byte| byte == b' ') {
            return Err(KeyError::Empty);
        }
        if length > max_length {
            return Err(KeyError::TooLong {
                length,
                limit: max_length,
            });
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
    /// assert!(IdempotencyKey::from_headers(&headers, &name)?.is_some());
    ///
    /// headers.append(name.clone(), HeaderValue::from_static("b"));
    /// assert_eq!(IdempotencyKey::from_headers(&headers, &name), Err(KeyError::Repeated));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_headers(headers: &HeaderMap, name: &HeaderName) -> Result<Option<Self>, KeyError> {
        Self::from_headers_within(headers, name, MAX_KEY_LENGTH)
    }

    /// [`IdempotencyKey::from_headers`], for a key of at most `max_length` characters.
    pub(crate) fn from_headers_within(
        headers: &HeaderMap,
        name: &HeaderName,
        max_length: usize,
    ) -> Result<Option<Self>, KeyError> {
        let mut values = headers.get_all(name);
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(KeyError::Repeated);
        }
        Self::parse_within(first.as_bytes(), max_length).map(Some)
    }

    /// The key, without sf-string quoting or escapes.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::IdempotencyKey;
    ///
    /// let key = IdempotencyKey::parse(br#""a \\ b";v=1"#)?;
    /// assert_eq!(key.as_str(), r"a \ b");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
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

/// Parses what follows the opening quote of an RFC 8941 §3.3.3 sf-string; returns the string
/// and what follows its closing quote.
fn parse_sf_string(rest: &[u8]) -> Result<(String, &[u8]), KeyError> {
    let mut key = String::with_capacity(rest.len());
    let mut at = 0;
    while let Some(&byte) = rest.get(at) {
        at += 1;
        match byte {
            b'\\' => match rest.get(at) {
                Some(&escaped @ (b'"' | b'\\')) => {
                    key.push(char::from(escaped));
                    at += 1;
                }
                Some(_) => return Err(KeyError::InvalidEscape),
                None => return Err(KeyError::UnbalancedQuote),
            },
            b'"' => return Ok((key, &rest[at..])),
            0x20..=0x7e => key.push(char::from(byte)),
            _ => return Err(KeyError::InvalidByte { byte }),
        }
    }
    Err(KeyError::UnbalancedQuote)
}

/// Parses the bare form up to the first delimiter (`;`, `,`, a space or a tab): visible ASCII
/// (0x21..=0x7e) without quotes. Returns the key and what follows it.
///
/// One pass, one table lookup per byte: finding the delimiter and then checking the bytes
/// before it took two passes and a four-way comparison per byte.
fn parse_bare(value: &[u8]) -> Result<(String, &[u8]), KeyError> {
    let mut end = value.len();
    for (at, &byte) in value.iter().enumerate() {
        match BARE[usize::from(byte)] {
            Bare::Key => {}
            Bare::Delimiter => {
                end = at;
                break;
            }
            Bare::Quote => return Err(KeyError::UnbalancedQuote),
            Bare::Invalid => return Err(KeyError::InvalidByte { byte }),
        }
    }
    let (key, rest) = value.split_at(end);
    // Every byte was checked to be ASCII above, so this never fails; a copy checked in one
    // pass costs a fraction of pushing the bytes one `char` at a time.
    let key = std::str::from_utf8(key).map_err(|_| KeyError::InvalidByte { byte: key[0] })?;
    Ok((key.to_owned(), rest))
}

/// What a byte is in the bare form of a key.
#[derive(Clone, Copy)]
enum Bare {
    /// Part of the key: visible ASCII but `"` and the delimiters.
    Key,
    /// Ends the key: `;` (parameters), `,` (a list), a space or a tab.
    Delimiter,
    /// `"`, which only the quoted form may hold.
    Quote,
    /// Anything else: controls, DEL, bytes above 0x7f.
    Invalid,
}

/// [`Bare`] of every byte.
const BARE: [Bare; 256] = {
    let mut table = [Bare::Invalid; 256];
    let mut byte = 0x21;
    while byte <= 0x7e {
        table[byte] = Bare::Key;
        byte += 1;
    }
    table[b';' as usize] = Bare::Delimiter;
    table[b',' as usize] = Bare::Delimiter;
    table[b' ' as usize] = Bare::Delimiter;
    table[b'\t' as usize] = Bare::Delimiter;
    table[b'"' as usize] = Bare::Quote;
    table
};

/// Skips RFC 8941 §3.1.2 parameters (`*( ";" *SP key [ "=" bare-item ] )`), checking their
/// syntax; returns what follows them.
fn skip_parameters(mut rest: &[u8]) -> Result<&[u8], KeyError> {
    while let Some((b';', after)) = rest.split_first() {
        let after = skip_spaces(after);
        let name_end = match after.first() {
            Some(b'a'..=b'z' | b'*') => after
                .iter()
                .position(
                    |byte| !matches!(byte, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'),
                )
                .unwrap_or(after.len()),
            _ => return Err(KeyError::InvalidParameter),
        };
        rest = match after[name_end..].split_first() {
            Some((b'=', value)) => skip_bare_item(value)?,
            _ => &after[name_end..],
        };
    }
    Ok(rest)
}

/// Skips one RFC 8941 §3.3 bare item (integer, decimal, string, token, byte sequence or
/// boolean), checking its syntax; returns what follows it.
fn skip_bare_item(value: &[u8]) -> Result<&[u8], KeyError> {
    let invalid = KeyError::InvalidParameter;
    let run = |from: usize, allowed: fn(&u8) -> bool| {
        from + value[from..]
            .iter()
            .position(|byte| !allowed(byte))
            .unwrap_or(value.len() - from)
    };
    match value.first() {
        Some(b'"') => parse_sf_string(&value[1..])
            .map(|(_, rest)| rest)
            .map_err(|_| invalid),
        Some(b'?') => match value.get(1) {
            Some(b'0' | b'1') => Ok(&value[2..]),
            _ => Err(invalid),
        },
        Some(b':') => {
            let end = run(1, |byte| {
                byte.is_ascii_alphanumeric() || b"+/=".contains(byte)
            });
            match value.get(end) {
                Some(b':') => Ok(&value[end + 1..]),
                _ => Err(invalid),
            }
        }
        Some(byte) if byte.is_ascii_alphabetic() || *byte == b'*' => {
            Ok(&value[run(1, |byte| is_tchar(*byte) || b":/".contains(byte))..])
        }
        Some(b'-' | b'0'..=b'9') => {
            let sign = usize::from(value[0] == b'-');
            let integer_end = run(sign, u8::is_ascii_digit);
            let integer_digits = integer_end - sign;
            if value.get(integer_end) != Some(&b'.') {
                return match integer_digits {
                    1..=15 => Ok(&value[integer_end..]),
                    _ => Err(invalid),
                };
            }
            let fraction_end = run(integer_end + 1, u8::is_ascii_digit);
            match (integer_digits, fraction_end - integer_end - 1) {
                (1..=12, 1..=3) => Ok(&value[fraction_end..]),
                _ => Err(invalid),
            }
        }
        _ => Err(invalid),
    }
}

/// RFC 9110 `tchar`: the characters of a token.
fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

/// Skips the spaces (not tabs: RFC 8941 allows only spaces) after a parameter's `;`.
fn skip_spaces(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|&byte| byte != b' ')
        .unwrap_or(bytes.len());
    &bytes[start..]
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
        assert_eq!(parse(b"\"   \""), Err(KeyError::Empty));
    }

    #[test]
    fn the_length_limit_is_255_characters() {
        let longest = "k".repeat(255);
        assert_eq!(parse(longest.as_bytes()), Ok(longest.clone()));
        assert_eq!(
            parse("k".repeat(256).as_bytes()),
            Err(KeyError::TooLong {
                length: 256,
                limit: 255
            })
        );
        // Quoting does not count towards the length, escapes count once.
        assert!(parse(format!("\"{longest}\"").as_bytes()).is_ok());
        assert_eq!(
            parse(format!("\"{}\"", "\\\\".repeat(256)).as_bytes()),
            Err(KeyError::TooLong {
                length: 256,
                limit: 255
            })
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
    }

    #[test]
    fn a_space_in_a_bare_key_asks_for_quotes() {
        assert_eq!(parse(b"order 1"), Err(KeyError::UnquotedSpace));
        assert_eq!(parse(b"a b c"), Err(KeyError::UnquotedSpace));
        assert_eq!(parse(b"\"order 1\""), Ok("order 1".to_owned()));
        assert!(!KeyError::UnquotedSpace.to_string().contains("printable"));
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
        assert_eq!(parse(br#""a";b x"#), Err(KeyError::TrailingCharacters));
    }

    #[test]
    fn parameters_are_accepted_and_ignored() {
        for value in [
            r#""abc";v=1"#,
            r#""abc"; v=1;a;b=?0;c="x\"y";d=-1.25;e=:YWJj:;f=tok/en:1;*g=*"#,
            r#""abc";v"#,
        ] {
            assert_eq!(parse(value.as_bytes()), Ok("abc".to_owned()), "{value}");
        }
    }

    #[test]
    fn a_semicolon_after_a_bare_key_is_refused() {
        // `order;a` and `order;b` must not silently become one key `order`.
        for value in ["abc;v=1", "abc;v", "order;a", "a;b;c", "abc;", "abc;V=1"] {
            assert_eq!(
                parse(value.as_bytes()),
                Err(KeyError::UnquotedParameters),
                "{value}"
            );
        }
        assert_eq!(parse(br#""order;a""#), Ok("order;a".to_owned()));
    }

    #[test]
    fn malformed_parameters_are_rejected() {
        for value in [
            r#""abc";"#,
            r#""abc";V=1"#,
            r#""abc";v="#,
            r#""abc";v="x"#,
            r#""abc";v=?2"#,
            r#""abc";v=:YWJj"#,
            r#""abc";v=1234567890123456"#,
            r#""abc";v=1.2345"#,
            r#""abc";v=1."#,
            r#""abc";v=-"#,
            r#""abc";9=1"#,
        ] {
            assert_eq!(
                parse(value.as_bytes()),
                Err(KeyError::InvalidParameter),
                "{value}"
            );
        }
    }

    #[test]
    fn a_list_of_keys_is_rejected() {
        for value in [
            "k1, k2",
            "k1,k2",
            r#""k1", "k2""#,
            r#""k1";v=1, k2"#,
            "k1 ,k2",
            "k1,",
        ] {
            assert_eq!(parse(value.as_bytes()), Err(KeyError::List), "{value}");
        }
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
