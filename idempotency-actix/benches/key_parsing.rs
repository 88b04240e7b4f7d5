//! Parsing the `Idempotency-Key` header: the bare form, the sf-string form with escapes, a
//! key at the length limit, and the lookup in a request's header map.

use actix_web::http::header::{HeaderMap, HeaderName, HeaderValue};
use criterion::{Criterion, criterion_group, criterion_main};
use idempotency_actix::{IdempotencyKey, MAX_KEY_LENGTH};
use std::hint::black_box;

fn key_parsing(c: &mut Criterion) {
    let bare = b"8e03978e-40d5-43e8-bc93-6894a57f9324".to_vec();
    let quoted = br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#.to_vec();
    let escaped = br#""order \"42\" for \\ customer 7""#.to_vec();
    let longest = vec![b'k'; MAX_KEY_LENGTH];

    let mut group = c.benchmark_group("key_parsing");
    for (name, value) in [
        ("bare uuid", &bare),
        ("sf-string uuid", &quoted),
        ("sf-string with escapes", &escaped),
        ("255 characters", &longest),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| IdempotencyKey::parse(black_box(value)));
        });
    }

    let name = HeaderName::from_static("idempotency-key");
    let mut headers = HeaderMap::new();
    for (other, value) in [
        ("content-type", "application/json"),
        ("accept", "*/*"),
        ("user-agent", "bench"),
        ("host", "127.0.0.1:8080"),
    ] {
        headers.insert(
            HeaderName::from_static(other),
            HeaderValue::from_static(value),
        );
    }
    headers.insert(
        name.clone(),
        HeaderValue::from_bytes(&quoted).expect("a valid header value"),
    );
    group.bench_function("from a header map", |b| {
        b.iter(|| IdempotencyKey::from_headers(black_box(&headers), black_box(&name)));
    });
    group.finish();
}

criterion_group!(benches, key_parsing);
criterion_main!(benches);
