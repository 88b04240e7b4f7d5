//! Record decoding survives any bytes a store could hand back, and what it decodes
//! encodes to a record that decodes to the same response.
#![no_main]

use idempotency_actix::StoredResponse;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(response) = StoredResponse::decode(bytes) {
        assert_eq!(StoredResponse::decode(&response.encode()).as_ref(), Ok(&response));
    }
});
