//! Encoding and decoding a stored response (the record codec: copying the body, or sharing
//! the buffer it came in), for a typical JSON answer and for larger bodies, and generating a
//! lease token.

use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::web::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idempotency_actix::{LeaseToken, StoredResponse};
use std::hint::black_box;

fn response(body_len: usize) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/json"),
            ),
            (
                HeaderName::from_static("location"),
                HeaderValue::from_static("/orders/8e03978e-40d5-43e8-bc93-6894a57f9324"),
            ),
        ],
        body: Some(Bytes::from(vec![b'x'; body_len])),
    }
}

fn record_codec(c: &mut Criterion) {
    let mut group = c.benchmark_group("record");
    for size in [100usize, 4 * 1024, 256 * 1024] {
        let response = response(size);
        let encoded = response.encode();
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(
            BenchmarkId::new("encode", size),
            &response,
            |b, response| {
                b.iter(|| black_box(response).encode());
            },
        );
        group.bench_with_input(BenchmarkId::new("decode", size), &encoded, |b, encoded| {
            b.iter(|| StoredResponse::decode(black_box(encoded)));
        });
        let shared = Bytes::from(encoded);
        group.bench_with_input(
            BenchmarkId::new("decode shared", size),
            &shared,
            |b, shared| {
                b.iter(|| StoredResponse::decode_shared(black_box(shared).clone()));
            },
        );
    }
    group.finish();

    c.bench_function("lease token", |b| b.iter(LeaseToken::generate));
}

criterion_group!(benches, record_codec);
criterion_main!(benches);
