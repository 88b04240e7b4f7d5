//! Property tests with a fixed seed: key parsing and record decoding survive any input, and
//! what is valid round-trips. The cargo-fuzz targets in `fuzz/` explore the same functions
//! without a bound.

#![allow(clippy::unwrap_used)]

use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::web::Bytes;
use idempotency_actix::{IdempotencyKey, KeyError, MAX_KEY_LENGTH, StoredResponse};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

fn config() -> Config {
    Config {
        cases: 4096,
        rng_seed: RngSeed::Fixed(0x1de5_0000_2026),
        failure_persistence: None,
        ..Config::default()
    }
}

/// Bare keys: visible ASCII without quotes and the structured-field delimiters `,` and `;`.
fn bare_key() -> impl Strategy<Value = String> {
    proptest::string::string_regex(r#"[!#-+\x2d-:<-~]{1,255}"#).unwrap()
}

/// Any printable ASCII, spaces, quotes and backslashes included.
fn printable() -> impl Strategy<Value = String> {
    proptest::string::string_regex(r"[ -~]{1,255}").unwrap()
}

fn sf_string(content: &str) -> String {
    let mut quoted = String::from("\"");
    for c in content.chars() {
        if c == '"' || c == '\\' {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    quoted
}

fn stored_response() -> impl Strategy<Value = StoredResponse> {
    let header = (
        proptest::string::string_regex("[a-z][a-z0-9-]{0,30}").unwrap(),
        proptest::collection::vec(0x20u8..0x7f, 0..64),
    );
    (
        100u16..1000,
        proptest::collection::vec(header, 0..8),
        proptest::option::of(proptest::collection::vec(any::<u8>(), 0..2048)),
    )
        .prop_map(|(status, headers, body)| {
            StoredResponse::new(
                StatusCode::from_u16(status).unwrap(),
                headers
                    .into_iter()
                    .map(|(name, value)| {
                        (
                            HeaderName::try_from(name).unwrap(),
                            HeaderValue::from_bytes(&value).unwrap(),
                        )
                    })
                    .collect(),
                body.map(Bytes::from),
            )
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn key_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(key) = IdempotencyKey::parse(&bytes) {
            prop_assert!(!key.as_str().is_empty());
            prop_assert!(key.as_str().len() <= MAX_KEY_LENGTH);
            prop_assert!(key.as_str().bytes().all(|b| (0x20..0x7f).contains(&b)));
        }
    }

    #[test]
    fn bare_and_quoted_forms_are_one_key(key in bare_key()) {
        let bare = IdempotencyKey::parse(key.as_bytes()).unwrap();
        let quoted = IdempotencyKey::parse(sf_string(&key).as_bytes()).unwrap();
        prop_assert_eq!(bare.as_str(), key.as_str());
        prop_assert_eq!(bare, quoted);
    }

    #[test]
    fn parameters_after_a_quoted_key_are_ignored_and_after_a_bare_key_refused(
        key in bare_key(),
        name in "[a-z*][a-z0-9_.*-]{0,8}",
        value in 0u32..,
    ) {
        let plain = IdempotencyKey::parse(key.as_bytes()).unwrap();
        let parameters = format!(";{name}={value}; {name};b=?1");
        let quoted = format!("{}{parameters}", sf_string(&key));
        prop_assert_eq!(&IdempotencyKey::parse(quoted.as_bytes()).unwrap(), &plain);
        let bare = format!("{key}{parameters}");
        prop_assert_eq!(
            IdempotencyKey::parse(bare.as_bytes()),
            Err(KeyError::UnquotedParameters)
        );
    }

    #[test]
    fn a_list_is_never_one_key(first in bare_key(), second in printable()) {
        let list = format!("{first}, {}", sf_string(&second));
        prop_assert_eq!(IdempotencyKey::parse(list.as_bytes()), Err(KeyError::List));
    }

    #[test]
    fn any_printable_key_round_trips_through_an_sf_string(key in printable()) {
        let parsed = IdempotencyKey::parse(sf_string(&key).as_bytes());
        if key.bytes().all(|byte| byte == b' ') {
            // A key of spaces alone holds no key.
            prop_assert_eq!(parsed, Err(KeyError::Empty));
        } else {
            // Surrounding spaces are part of a quoted key.
            let parsed = parsed.unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }
    }

    #[test]
    fn record_decoding_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = StoredResponse::decode(&bytes);
    }

    #[test]
    fn records_round_trip(response in stored_response()) {
        prop_assert_eq!(StoredResponse::decode(&response.encode()).unwrap(), response);
    }

    #[test]
    fn damaged_records_never_panic(
        response in stored_response(),
        cut in any::<prop::sample::Index>(),
        flip in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let mut bytes = response.encode();
        let at = flip.index(bytes.len());
        bytes[at] ^= 1 << bit;
        let _ = StoredResponse::decode(&bytes);
        let _ = StoredResponse::decode(&bytes[..cut.index(bytes.len())]);
    }
}
