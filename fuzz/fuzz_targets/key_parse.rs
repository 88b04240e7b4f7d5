//! Key parsing survives any header value, and what it accepts is a valid key.
#![no_main]

use idempotency_actix::{IdempotencyKey, MAX_KEY_LENGTH};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|value: &[u8]| {
    if let Ok(key) = IdempotencyKey::parse(value) {
        assert!(!key.as_str().is_empty() && key.as_str().len() <= MAX_KEY_LENGTH);
        assert!(key.as_str().bytes().all(|b| (0x20..0x7f).contains(&b)));
    }
});
