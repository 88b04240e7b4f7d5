//! The HTTP contract of DESIGN §5, row by row, against real Actix servers on real sockets.
//!
//! Every test runs three times: on the in-memory store (`memory::…`), on Redis (`redis::…`,
//! the server at `REDIS_URL`, default 127.0.0.1:6379), each under its own key prefix, on
//! Redis Cluster (`redis_cluster::…`, a local 6-node cluster this test binary starts), and on
//! PostgreSQL (`postgres::…`, the server at `DATABASE_URL`, default 127.0.0.1:5432), each
//! in a database of its own.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::dev::Service;
use actix_web::http::{Method, StatusCode, header::HeaderValue};
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpRequest, HttpResponse};
use futures_util::stream;
use idempotency_actix::{
    Idempotency, IdempotencyPolicy, IdempotentRoute, KeyScope, MemoryStore, PostgresStore,
    RedisClusterClient, RedisPool,
};
use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::{Reply, RunCounter, TestDatabase, redis_pool, unique_prefix};

/// Which store a test server uses; cheap to clone into each worker's app factory.
#[derive(Clone)]
enum Backend {
    Memory(MemoryStore),
    Redis(RedisPool),
    Postgres(PostgresStore),
    RedisCluster(Box<RedisClusterClient>),
}

impl Backend {
    // Each comes with the database it lives in, if any, which the test keeps until it ends.
    async fn memory() -> (Self, Option<TestDatabase>) {
        (Self::Memory(MemoryStore::new()), None)
    }

    async fn redis() -> (Self, Option<TestDatabase>) {
        (Self::Redis(redis_pool().await), None)
    }

    async fn postgres() -> (Self, Option<TestDatabase>) {
        let database = TestDatabase::create().await;
        (Self::Postgres(database.store().await), Some(database))
    }

    async fn redis_cluster() -> (Self, Option<TestDatabase>) {
        (
            Self::RedisCluster(Box::new(RedisCluster::shared().client())),
            None,
        )
    }

    fn idempotency(&self, prefix: &str) -> Idempotency {
        let idempotency = match self {
            Self::Memory(store) => Idempotency::new(store.clone()),
            Self::Redis(pool) => Idempotency::redis(pool.clone()),
            Self::Postgres(store) => Idempotency::postgres(store.clone()),
            Self::RedisCluster(client) => Idempotency::redis_cluster((**client).clone()),
        };
        idempotency.key_prefix(prefix)
    }
}

#[derive(serde::Deserialize)]
struct Knobs {
    delay_ms: Option<u64>,
    status: Option<u16>,
    bytes: Option<usize>,
}

/// A handler that counts its runs and answers 201 with a body unique to the run.
async fn create(
    runs: web::Data<RunCounter>,
    knobs: web::Query<Knobs>,
    body: Bytes,
) -> HttpResponse {
    let seq = runs.record();
    if let Some(delay) = knobs.delay_ms {
        actix_rt::time::sleep(Duration::from_millis(delay)).await;
    }
    let status = StatusCode::from_u16(knobs.status.unwrap_or(201)).unwrap();
    HttpResponse::build(status)
        .insert_header(("location", format!("/orders/{seq}")))
        .insert_header(("set-cookie", "session=new; Path=/"))
        .insert_header(("x-run-id", uuid::Uuid::new_v4().to_string()))
        .json(serde_json::json!({
            "seq": seq,
            "id": uuid::Uuid::new_v4().to_string(),
            "echo": String::from_utf8_lossy(&body),
        }))
}

async fn panics(runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    panic!("handler panicked on purpose");
}

/// Answers `bytes` bytes as a stream of 1 KiB chunks (no Content-Length).
async fn large(runs: web::Data<RunCounter>, knobs: web::Query<Knobs>) -> HttpResponse {
    runs.record();
    let size = knobs.bytes.unwrap_or(0);
    let chunks = (0..size).step_by(1024).map(move |start| {
        let len = (size - start).min(1024);
        Ok::<_, actix_web::Error>(Bytes::from(vec![b'x'; len]))
    });
    HttpResponse::Ok()
        .content_type("application/octet-stream")
        .streaming(stream::iter(chunks))
}

/// Answers `bytes` bytes as one sized body.
async fn large_sized(runs: web::Data<RunCounter>, knobs: web::Query<Knobs>) -> HttpResponse {
    runs.record();
    HttpResponse::Ok().body(vec![b'y'; knobs.bytes.unwrap_or(0)])
}

/// `hello hello hello hello`, gzipped (28 bytes).
const GZIPPED_HELLOS: &[u8] = &[
    31, 139, 8, 0, 0, 0, 0, 0, 2, 3, 203, 72, 205, 201, 201, 87, 200, 64, 39, 1, 227, 81, 61, 141,
    23, 0, 0, 0,
];

/// Answers a body it encoded itself (a precompressed file, say): `Content-Encoding: gzip`.
async fn precompressed(runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    HttpResponse::Ok()
        .insert_header(("content-encoding", "gzip"))
        .content_type("text/plain")
        .body(GZIPPED_HELLOS)
}

async fn plain(runs: web::Data<RunCounter>, req: HttpRequest) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::Ok().json(serde_json::json!({ "seq": seq, "method": req.method().as_str() }))
}

struct Harness {
    server: actix_test::TestServer,
    runs: RunCounter,
    prefix: String,
}

/// Starts a server with the test routes under `idempotency` (configured by `configure`).
fn start(backend: Backend, test: &str, configure: fn(Idempotency) -> Idempotency) -> Harness {
    let runs = RunCounter::default();
    let prefix = unique_prefix(test);
    let server = {
        let runs = runs.clone();
        let prefix = prefix.clone();
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(configure(backend.idempotency(&prefix)))
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(create))
                        .route(web::get().to(plain))
                        .route(web::query().to(plain)),
                )
                .service(
                    web::resource("/required")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().required(),
                        ))
                        .route(web::post().to(create)),
                )
                .service(
                    web::resource("/limited")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default()
                                .max_request_body(1024)
                                .max_stored_body(4096),
                        ))
                        .route(web::post().to(create)),
                )
                .service(
                    web::resource("/stored-errors")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().store_errors(),
                        ))
                        .route(web::post().to(create)),
                )
                .service(
                    // A layer under the middleware that fails after the handler ran (a
                    // receipt that could not be signed, say).
                    web::resource("/stored-errors-after-the-handler")
                        .wrap_fn(|req, service| {
                            let handled = service.call(req);
                            async move {
                                handled.await?;
                                Err::<actix_web::dev::ServiceResponse, _>(
                                    actix_web::error::ErrorBadGateway("receipt not signed"),
                                )
                            }
                        })
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().store_errors(),
                        ))
                        .route(web::post().to(create)),
                )
                .service(
                    // A layer under the middleware whose error carries a response of its
                    // own, which `InternalError` hands out once (a card declined after the
                    // handler reserved the order, say).
                    web::resource("/stored-error-with-its-own-response")
                        .wrap_fn(|req, service| {
                            let handled = service.call(req);
                            async move {
                                handled.await?;
                                let declined = HttpResponse::PaymentRequired()
                                    .insert_header(("x-decline-code", "card_declined"))
                                    .body("card declined");
                                Err::<actix_web::dev::ServiceResponse, _>(
                                    actix_web::error::InternalError::from_response(
                                        "card declined",
                                        declined,
                                    )
                                    .into(),
                                )
                            }
                        })
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().store_errors(),
                        ))
                        .route(web::post().to(create)),
                )
                .service(
                    web::resource("/panic")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(panics)),
                )
                .service(
                    // A layer under the middleware that panics in `call` itself, before it
                    // returns a future, when the request asks it to.
                    web::resource("/panic-in-call")
                        .wrap_fn(|req, service| {
                            if req.headers().contains_key("x-panic-in-call") {
                                panic!("a layer panicked in call on purpose");
                            }
                            service.call(req)
                        })
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(create)),
                )
                .service(
                    web::resource("/large")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().max_stored_body(4096),
                        ))
                        .route(web::post().to(large)),
                )
                .service(
                    web::resource("/large-sized")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().max_stored_body(4096),
                        ))
                        .route(web::post().to(large_sized)),
                )
                .service(
                    web::resource("/precompressed")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().max_stored_body(16),
                        ))
                        .route(web::post().to(precompressed)),
                )
                .service(web::resource("/untagged").route(web::post().to(plain)))
        })
    };
    Harness {
        server,
        runs,
        prefix,
    }
}

trait ProblemAssertion {
    /// Asserts an RFC 9457 problem with `status`, and returns its `type`.
    fn assert_problem(&self, status: u16) -> String;
}

impl ProblemAssertion for Reply {
    fn assert_problem(&self, status: u16) -> String {
        assert_eq!(self.status.as_u16(), status, "body: {:?}", self.body);
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let problem = self.json();
        assert_eq!(problem["status"], status);
        assert!(problem["title"].is_string(), "{problem}");
        assert!(problem["detail"].is_string(), "{problem}");
        problem["type"].as_str().unwrap().to_owned()
    }
}

impl Harness {
    async fn send(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: &'static str,
    ) -> Reply {
        let mut request = self.server.request(method, self.server.url(path));
        if let Some(key) = key {
            request = request.insert_header(("idempotency-key", key));
        }
        self.finish(request.send_body(body)).await
    }

    async fn post(&self, path: &str, key: Option<&str>, body: &'static str) -> Reply {
        self.send(Method::POST, path, key, body).await
    }

    async fn post_with_key_bytes(&self, path: &str, key: HeaderValue) -> Reply {
        let request = self
            .server
            .post(path)
            .insert_header(("idempotency-key", key));
        self.finish(request.send_body("{}")).await
    }

    async fn finish(&self, sent: awc::SendClientRequest) -> Reply {
        Reply::read(sent.await.unwrap()).await.unwrap()
    }

    fn key(&self, name: &str) -> String {
        // Keys unique per test run, so the memory and Redis runs never share records.
        format!("{}{name}", self.prefix.replace(':', "-"))
    }
}

async fn no_key_runs_the_handler_unprotected(backend: Backend) {
    let h = start(backend, "no_key", |i| i);
    let first = h.post("/orders", None, "{}").await;
    let second = h.post("/orders", None, "{}").await;
    assert_eq!(
        (first.status, second.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!second.is_replay());
    assert_eq!(h.runs.get(), 2);
}

async fn no_key_on_a_required_route_is_400(backend: Backend) {
    let h = start(backend, "required", |i| i);
    let reply = h.post("/required", None, "{}").await;
    assert_eq!(
        reply.assert_problem(400),
        "tag:idempotency-actix,2026:missing-key"
    );
    assert_eq!(h.runs.get(), 0);
}

async fn an_app_wide_required_key_is_400(backend: Backend) {
    let h = start(backend, "app_required", |i| {
        i.policy(IdempotencyPolicy::default().required())
    });
    h.post("/orders", None, "{}").await.assert_problem(400);
    assert_eq!(h.runs.get(), 0);
}

async fn malformed_keys_are_400(backend: Backend) {
    let h = start(backend, "malformed", |i| i);
    let too_long = "k".repeat(256);
    let bad_values: Vec<HeaderValue> = vec![
        HeaderValue::from_static(""),
        HeaderValue::from_str(&too_long).unwrap(),
        HeaderValue::from_bytes(b"tab\there").unwrap(),
        HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        HeaderValue::from_static("\"unbalanced"),
        HeaderValue::from_static("stray\"quote"),
        HeaderValue::from_static("\"bad\\escape\""),
        HeaderValue::from_static("\"trailing\"x"),
        HeaderValue::from_static("k1, k2"),
        HeaderValue::from_static("\"k1\", \"k2\""),
        HeaderValue::from_static("k1;BAD=1"),
        HeaderValue::from_static("\"k1\";BAD=1"),
        // Parameters need a quoted key: `order;a` is not silently the key `order`.
        HeaderValue::from_static("order;a"),
        HeaderValue::from_static("\"   \""),
    ];
    for value in bad_values {
        let reply = h.post_with_key_bytes("/orders", value.clone()).await;
        assert_eq!(
            reply.assert_problem(400),
            "tag:idempotency-actix,2026:invalid-key",
            "{value:?}"
        );
    }
    // A repeated header.
    let request = h
        .server
        .post("/orders")
        .append_header(("idempotency-key", "a"))
        .append_header(("idempotency-key", "a"));
    h.finish(request.send_body("{}")).await.assert_problem(400);
    assert_eq!(h.runs.get(), 0);
}

/// An app that takes longer keys (`Idempotency::max_key_length`) protects them as any other,
/// and refuses one over its own limit with a detail that names it.
async fn an_app_may_take_longer_keys(backend: Backend) {
    let h = start(backend, "long_keys", |i| i.max_key_length(512));
    let key = h.key("long-");
    let long = format!("{key}{}", "k".repeat(512 - key.len()));
    let first = h.post("/orders", Some(&long), "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = h.post("/orders", Some(&long), "{}").await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    assert_eq!(h.runs.get(), 1);

    let over = format!("{long}k");
    let reply = h.post("/orders", Some(&over), "{}").await;
    assert_eq!(
        reply.assert_problem(400),
        "tag:idempotency-actix,2026:invalid-key"
    );
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("513") && detail.contains("512"), "{detail}");
    assert_eq!(h.runs.get(), 1);
}

/// A bare key with a space (`order 1`) is refused with a detail that says what is wrong
/// and how to send it (quoted), never that a space is not printable ASCII; quoted, the same
/// key is taken.
async fn a_key_with_a_space_is_told_to_quote_it(backend: Backend) {
    let h = start(backend, "space", |i| i);
    let key = h.key("order 1");
    let reply = h.post("/orders", Some(&key), "{}").await;
    assert_eq!(
        reply.assert_problem(400),
        "tag:idempotency-actix,2026:invalid-key"
    );
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(!detail.contains("not printable"), "{detail}");
    assert!(
        detail.contains("space") && detail.contains("quote"),
        "{detail}"
    );
    assert_eq!(h.runs.get(), 0);

    let quoted = format!("\"{key}\"");
    let first = h.post("/orders", Some(&quoted), "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = h.post("/orders", Some(&quoted), "{}").await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(h.runs.get(), 1);
}

async fn a_retry_replays_byte_identical_without_running(backend: Backend) {
    let h = start(backend, "replay", |i| i);
    let key = h.key("order");
    let first = h.post("/orders", Some(&key), r#"{"item":"book"}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.is_replay());
    assert_eq!(first.header("set-cookie"), Some("session=new; Path=/"));
    assert_eq!(first.json()["echo"], r#"{"item":"book"}"#);

    for _ in 0..3 {
        let retry = h.post("/orders", Some(&key), r#"{"item":"book"}"#).await;
        assert_eq!(retry.status, StatusCode::CREATED);
        assert!(retry.is_replay());
        assert_eq!(retry.body, first.body, "byte-identical body");
        for name in ["location", "content-type", "x-run-id"] {
            assert_eq!(retry.header(name), first.header(name), "{name}");
        }
        assert_eq!(
            retry.header("set-cookie"),
            None,
            "cookies are never replayed"
        );
    }
    assert_eq!(h.runs.get(), 1);
}

async fn quoted_and_bare_keys_are_the_same_key(backend: Backend) {
    let h = start(backend, "quoted", |i| i);
    let key = h.key("q");
    let first = h.post("/orders", Some(&key), "{}").await;
    let quoted = format!("\"{key}\"");
    let retry = h.post("/orders", Some(&quoted), "{}").await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    // RFC 8941 parameters after a quoted key are ignored.
    let with_parameter = format!("\"{key}\";v=1");
    let retry = h.post("/orders", Some(&with_parameter), "{}").await;
    assert!(retry.is_replay(), "{with_parameter}");
    assert_eq!(retry.body, first.body);
    assert_eq!(h.runs.get(), 1);
}

async fn another_request_with_the_same_key_is_422(backend: Backend) {
    let h = start(backend, "mismatch", |i| i);
    let key = h.key("k");
    h.post("/orders", Some(&key), r#"{"qty":1}"#).await;
    let other_body = h.post("/orders", Some(&key), r#"{"qty":2}"#).await;
    assert_eq!(
        other_body.assert_problem(422),
        "tag:idempotency-actix,2026:key-reused"
    );
    let other_query = h.post("/orders?x=1", Some(&key), r#"{"qty":1}"#).await;
    other_query.assert_problem(422);
    let other_method = h
        .send(Method::PUT, "/orders", Some(&key), r#"{"qty":1}"#)
        .await;
    // The route layer wraps the whole resource, so it sees the PUT (which the resource
    // would answer 405) and refuses the reused key first.
    other_method.assert_problem(422);
    assert_eq!(h.runs.get(), 1);
}

async fn a_retry_while_in_flight_is_409_then_replays(backend: Backend) {
    let h = start(backend, "in_flight", |i| i);
    let key = h.key("slow");
    let (first, second) =
        futures_util::future::join(h.post("/orders?delay_ms=600", Some(&key), "{}"), async {
            h.runs.wait_for(1).await;
            h.post("/orders?delay_ms=600", Some(&key), "{}").await
        })
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        second.assert_problem(409),
        "tag:idempotency-actix,2026:in-flight"
    );
    assert_eq!(second.header("retry-after"), Some("1"));
    let after = h.post("/orders?delay_ms=600", Some(&key), "{}").await;
    assert!(after.is_replay());
    assert_eq!(after.body, first.body);
    assert_eq!(h.runs.get(), 1);
}

async fn fifty_concurrent_duplicates_run_the_handler_once(backend: Backend) {
    let h = start(backend, "fifty", |i| i);
    let key = h.key("dup");
    let replies = futures_util::future::join_all(
        (0..50).map(|_| h.post("/orders?delay_ms=400", Some(&key), r#"{"item":"x"}"#)),
    )
    .await;
    assert_eq!(h.runs.get(), 1, "the handler ran exactly once");
    let created: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .collect();
    assert!(!created.is_empty());
    for reply in &replies {
        assert!(
            reply.status == StatusCode::CREATED || reply.status == StatusCode::CONFLICT,
            "unexpected {}",
            reply.status
        );
    }
    for reply in &created {
        assert_eq!(reply.body, created[0].body, "every 201 body is identical");
    }
    let retry = h
        .post("/orders?delay_ms=400", Some(&key), r#"{"item":"x"}"#)
        .await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, created[0].body);
    assert_eq!(h.runs.get(), 1);
}

async fn error_responses_release_the_key(backend: Backend) {
    let h = start(backend, "errors", |i| i);
    let key = h.key("e");
    for expected_runs in 1..=2 {
        let reply = h.post("/orders?status=500", Some(&key), "{}").await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!reply.is_replay());
        assert_eq!(h.runs.get(), expected_runs);
    }
    let client_error = h.post("/orders?status=400", Some(&h.key("e4")), "{}").await;
    assert_eq!(client_error.status, StatusCode::BAD_REQUEST);
    let again = h.post("/orders?status=400", Some(&h.key("e4")), "{}").await;
    assert!(!again.is_replay());
    assert_eq!(h.runs.get(), 4);
}

async fn a_route_can_store_error_responses(backend: Backend) {
    let h = start(backend, "store_errors", |i| i);
    let key = h.key("e");
    let first = h.post("/stored-errors?status=409", Some(&key), "{}").await;
    let retry = h.post("/stored-errors?status=409", Some(&key), "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    assert_eq!(h.runs.get(), 1);
}

async fn a_route_that_stores_errors_stores_an_inner_layers_error(backend: Backend) {
    let h = start(backend, "store_inner_errors", |i| i);
    let key = h.key("e");
    let first = h
        .post("/stored-errors-after-the-handler", Some(&key), "{}")
        .await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    let retry = h
        .post("/stored-errors-after-the-handler", Some(&key), "{}")
        .await;
    assert_eq!(retry.status, StatusCode::BAD_GATEWAY);
    assert!(retry.is_replay(), "the handler ran again: {retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!(h.runs.get(), 1);
}

async fn an_inner_layers_error_reaches_its_client_as_it_is_replayed(backend: Backend) {
    let h = start(backend, "store_inner_error_response", |i| i);
    let key = h.key("e");
    let path = "/stored-error-with-its-own-response";
    let first = h.post(path, Some(&key), "{}").await;
    assert_eq!(first.status, StatusCode::PAYMENT_REQUIRED, "{first:?}");
    assert_eq!(first.header("x-decline-code"), Some("card_declined"));
    assert_eq!(first.body, "card declined");
    let retry = h.post(path, Some(&key), "{}").await;
    assert!(retry.is_replay(), "the handler ran again: {retry:?}");
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.header("x-decline-code"), Some("card_declined"));
    assert_eq!(retry.body, first.body);
    assert_eq!(h.runs.get(), 1);
}

async fn a_panicking_handler_is_500_and_releases_the_key(backend: Backend) {
    let h = start(backend, "panic", |i| i);
    let key = h.key("p");
    let first = h.post("/panic", Some(&key), "{}").await;
    assert_eq!(
        first.assert_problem(500),
        "tag:idempotency-actix,2026:handler-panicked"
    );
    let second = h.post("/panic", Some(&key), "{}").await;
    second.assert_problem(500);
    assert_eq!(h.runs.get(), 2, "released: the retry ran the handler again");
    // The worker survived: other requests are still served.
    assert_eq!(
        h.post("/orders", None, "{}").await.status,
        StatusCode::CREATED
    );
}

async fn a_layer_panicking_in_call_is_500_and_releases_the_key(backend: Backend) {
    let h = start(backend, "panic_in_call", |i| i);
    let key = h.key("c");
    let request = h
        .server
        .post("/panic-in-call")
        .insert_header(("idempotency-key", key.clone()))
        .insert_header(("x-panic-in-call", "1"));
    let first = h.finish(request.send_body("{}")).await;
    assert_eq!(
        first.assert_problem(500),
        "tag:idempotency-actix,2026:handler-panicked"
    );
    // Released: the retry runs (the header is not part of the fingerprint), no 409.
    let retry = h.post("/panic-in-call", Some(&key), "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.is_replay());
    assert_eq!(h.runs.get(), 1);
}

async fn an_oversized_request_body_is_413_without_running(backend: Backend) {
    let h = start(backend, "too_large", |i| i);
    let big: &'static str = Box::leak("a".repeat(2048).into_boxed_str());
    let reply = h.post("/limited", Some(&h.key("big")), big).await;
    assert_eq!(
        reply.assert_problem(413),
        "tag:idempotency-actix,2026:body-too-large"
    );
    // Streamed without Content-Length: the limit holds while reading.
    let chunks =
        stream::iter((0..4).map(|_| Ok::<_, actix_web::Error>(Bytes::from(vec![b'a'; 600]))));
    let request = h
        .server
        .post("/limited")
        .insert_header(("idempotency-key", h.key("streamed")));
    h.finish(request.send_stream(chunks))
        .await
        .assert_problem(413);
    assert_eq!(h.runs.get(), 0);
    // At the limit it runs.
    let fits: &'static str = Box::leak("a".repeat(1024).into_boxed_str());
    assert_eq!(
        h.post("/limited", Some(&h.key("fits")), fits).await.status,
        StatusCode::CREATED
    );
    assert_eq!(h.runs.get(), 1);
}

async fn a_body_sent_in_chunks_is_the_same_request(backend: Backend) {
    let h = start(backend, "chunks", |i| i);
    let key = h.key("chunked");
    let body = r#"{"item":"book","qty":1}"#;
    let in_chunks = |parts: [&'static str; 3]| {
        stream::iter(
            parts.map(|part| Ok::<_, actix_web::Error>(Bytes::from_static(part.as_bytes()))),
        )
    };
    // Sent chunked, in three pieces: the handler reads the whole body.
    let request = h
        .server
        .post("/orders")
        .insert_header(("idempotency-key", key.clone()));
    let first = h
        .finish(request.send_stream(in_chunks([r#"{"item":"#, r#""book","#, r#""qty":1}"#])))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.json()["echo"], body);
    // The same bytes in one piece are the same request: a replay.
    let retry = h.post("/orders", Some(&key), body).await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    // Other bytes in pieces are another request: 422.
    let request = h
        .server
        .post("/orders")
        .insert_header(("idempotency-key", key.clone()));
    h.finish(request.send_stream(in_chunks([r#"{"item":"#, r#""book","#, r#""qty":2}"#])))
        .await
        .assert_problem(422);
    assert_eq!(h.runs.get(), 1);
}

async fn an_oversized_response_is_sent_whole_and_never_rerun(backend: Backend) {
    let h = start(backend, "large_response", |i| i);
    for path in ["/large?bytes=100000", "/large-sized?bytes=100000"] {
        let key = h.key(path);
        let runs_before = h.runs.get();
        let first = h.post(path, Some(&key), "").await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(
            first.body.len(),
            100_000,
            "{path}: the client got every byte"
        );
        let retry = h.post(path, Some(&key), "").await;
        assert_eq!(retry.status, StatusCode::OK);
        assert!(retry.is_replay());
        assert_eq!(retry.header("idempotent-body-omitted"), Some("true"));
        assert!(retry.body.is_empty());
        assert_eq!(h.runs.get(), runs_before + 1, "{path}: not re-run");
    }
    // A body the handler encoded itself, over the limit: the replay's empty body is no
    // gzip stream, so it comes without `Content-Encoding`, and a client that decodes
    // reads it (awc decodes gzip, as browsers do).
    let key = h.key("precompressed");
    let first = h.post("/precompressed", Some(&key), "").await;
    assert_eq!(first.body, "hello hello hello hello");
    let retry = h.post("/precompressed", Some(&key), "").await;
    assert!(retry.is_replay());
    assert_eq!(retry.header("idempotent-body-omitted"), Some("true"));
    assert_eq!(retry.header("content-encoding"), None);
    assert_eq!(retry.header("content-type"), Some("text/plain"));
    assert!(retry.body.is_empty());
    // Under the limit the stream is stored and replayed whole.
    let key = h.key("small");
    let first = h.post("/large?bytes=3000", Some(&key), "").await;
    let retry = h.post("/large?bytes=3000", Some(&key), "").await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.body.len(), 3000);
}

async fn safe_methods_and_untagged_routes_are_untouched(backend: Backend) {
    let h = start(backend, "untouched", |i| i);
    let key = h.key("g");
    for _ in 0..2 {
        let reply = h.send(Method::GET, "/orders", Some(&key), "").await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(!reply.is_replay());
        let untagged = h.post("/untagged", Some(&key), "{}").await;
        assert!(!untagged.is_replay());
    }
    assert_eq!(h.runs.get(), 4);
}

/// `QUERY` (safe and idempotent by its IETF draft, like `GET`, but with a body) is never
/// protected, on a tagged route and where the App's `protect_methods` names it: two keyed
/// queries with different bodies both run, neither is replayed nor refused as a reused key.
/// Both were protected like a `POST`: the second was a 422.
async fn query_is_untouched_like_get(backend: Backend) {
    type Configure = fn(Idempotency) -> Idempotency;
    let configurations: [(&str, Configure); 2] = [
        ("query-route", |i| i),
        ("query-app", |i| {
            i.protect_methods([Method::POST, Method::from_bytes(b"QUERY").unwrap()])
        }),
    ];
    for (test, configure) in configurations {
        let h = start(backend.clone(), test, configure);
        let key = h.key("q");
        for body in [r#"{"status":"open"}"#, r#"{"status":"paid"}"#] {
            let query = Method::from_bytes(b"QUERY").unwrap();
            let reply = h.send(query, "/orders", Some(&key), body).await;
            assert_eq!(reply.status, StatusCode::OK, "{test}: {:?}", reply.body);
            assert!(!reply.is_replay(), "{test}");
            assert_eq!(reply.json()["method"], "QUERY", "{test}");
        }
        assert_eq!(h.runs.get(), 2, "{test}: both queries ran");
    }
}

async fn protect_methods_covers_untagged_routes(backend: Backend) {
    let h = start(backend, "methods", |i| i.protect_methods([Method::POST]));
    let key = h.key("u");
    let first = h.post("/untagged", Some(&key), "{}").await;
    let retry = h.post("/untagged", Some(&key), "{}").await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    // A tagged route under an app that also protects POST is processed once.
    let key = h.key("both");
    let first = h.post("/orders", Some(&key), "{}").await;
    let retry = h.post("/orders", Some(&key), "{}").await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    // The route's `required` still holds when the app took the request first.
    h.post("/required", None, "{}").await.assert_problem(400);
    assert_eq!(h.runs.get(), 2);
}

async fn scopes_keep_principals_apart(backend: Backend) {
    let h = start(backend, "scopes", |i| {
        i.scope(KeyScope::header("x-tenant").unwrap())
    });
    let key = h.key("shared");
    let send = |tenant: &'static str| {
        let request = h
            .server
            .post("/orders")
            .insert_header(("idempotency-key", key.clone()))
            .insert_header(("x-tenant", tenant));
        h.finish(request.send_body("{}"))
    };
    let a = send("a").await;
    let b = send("b").await;
    assert!(
        !a.is_replay() && !b.is_replay(),
        "another tenant's record is never replayed"
    );
    assert_ne!(a.body, b.body);
    let a_again = send("a").await;
    assert!(a_again.is_replay());
    assert_eq!(a_again.body, a.body);
    // Without a tenant, or with an empty one, the request cannot be scoped: refused, never
    // put in a shared space.
    let request = h
        .server
        .post("/orders")
        .insert_header(("idempotency-key", key.clone()));
    let unscoped = h.finish(request.send_body("{}")).await;
    assert_eq!(
        unscoped.assert_problem(400),
        "tag:idempotency-actix,2026:missing-scope"
    );
    let empty = send("").await;
    assert_eq!(
        empty.assert_problem(400),
        "tag:idempotency-actix,2026:missing-scope"
    );
    // Keyless requests need no scope.
    assert_eq!(
        h.post("/orders", None, "{}").await.status,
        StatusCode::CREATED
    );
    assert_eq!(h.runs.get(), 3);
}

macro_rules! contract_suite {
    ($backend:ident; $($test:ident),* $(,)?) => {
        mod $backend {
            $(
                #[actix_web::test]
                async fn $test() {
                    let (backend, _database) = super::Backend::$backend().await;
                    super::$test(backend).await;
                }
            )*
        }
    };
}

macro_rules! every_backend {
    ($($test:ident),* $(,)?) => {
        contract_suite!(memory; $($test),*);
        contract_suite!(redis; $($test),*);
        contract_suite!(postgres; $($test),*);
        contract_suite!(redis_cluster; $($test),*);
    };
}

every_backend!(
    no_key_runs_the_handler_unprotected,
    no_key_on_a_required_route_is_400,
    an_app_wide_required_key_is_400,
    malformed_keys_are_400,
    an_app_may_take_longer_keys,
    a_key_with_a_space_is_told_to_quote_it,
    a_retry_replays_byte_identical_without_running,
    quoted_and_bare_keys_are_the_same_key,
    another_request_with_the_same_key_is_422,
    a_retry_while_in_flight_is_409_then_replays,
    fifty_concurrent_duplicates_run_the_handler_once,
    error_responses_release_the_key,
    a_route_can_store_error_responses,
    a_route_that_stores_errors_stores_an_inner_layers_error,
    an_inner_layers_error_reaches_its_client_as_it_is_replayed,
    a_panicking_handler_is_500_and_releases_the_key,
    a_layer_panicking_in_call_is_500_and_releases_the_key,
    an_oversized_request_body_is_413_without_running,
    a_body_sent_in_chunks_is_the_same_request,
    an_oversized_response_is_sent_whole_and_never_rerun,
    safe_methods_and_untagged_routes_are_untouched,
    query_is_untouched_like_get,
    protect_methods_covers_untagged_routes,
    scopes_keep_principals_apart,
);
