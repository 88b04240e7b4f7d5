//! Fingerprinting a request (method, path, query, a digest of the body, chosen headers) and
//! deriving its storage key, for bodies from empty to 1 MiB.

use actix_web::http::Method;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idempotency_actix::{Fingerprint, IdempotencyKey, StorageKey};
use std::hint::black_box;

fn fingerprinting(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    for size in [0usize, 32, 1024, 64 * 1024, 1024 * 1024] {
        let body = vec![b'x'; size];
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("body bytes", size), &body, |b, body| {
            b.iter(|| {
                Fingerprint::compute(
                    black_box(&Method::POST),
                    black_box("/orders"),
                    black_box("source=app"),
                    black_box(body),
                    [],
                )
            });
        });
    }
    let body = br#"{"item":"book","qty":1}"#.to_vec();
    let headers = [
        ("x-tenant", b"acme".as_slice()),
        ("content-type", b"application/json".as_slice()),
    ];
    group.bench_function("with two headers", |b| {
        b.iter(|| {
            Fingerprint::compute(
                black_box(&Method::POST),
                black_box("/orders"),
                black_box(""),
                black_box(&body),
                black_box(headers),
            )
        });
    });
    group.finish();

    let key = IdempotencyKey::parse(b"8e03978e-40d5-43e8-bc93-6894a57f9324").expect("a valid key");
    c.bench_function("storage key", |b| {
        b.iter(|| StorageKey::new(black_box("idempotency:"), black_box(b"tenant-7"), &key));
    });
}

criterion_group!(benches, fingerprinting);
criterion_main!(benches);
