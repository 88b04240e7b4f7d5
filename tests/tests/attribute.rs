//! `#[idempotent(...)]` on real servers over real sockets, with the Redis store at `REDIS_URL`
//! (default 127.0.0.1:6379): every argument reaches the route, in every route macro, inside
//! scopes, next to untagged routes, and the App's defaults apply where the route is silent.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::{Method, StatusCode};
use actix_web::middleware::Next;
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse, delete, get, patch, post, route, routes};
use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, RedisPool, idempotent};
use idempotency_actix_tests::{
    Reply, RunCounter, keys_under, redis_connection, redis_pool, unique_prefix,
};
use serde_json::json;

/// A fresh response body per run: a replay is recognisable by carrying an earlier run's.
fn ran(runs: &RunCounter) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::Created().json(json!({ "seq": seq, "run": uuid::Uuid::new_v4().to_string() }))
}

#[idempotent]
#[post("/orders")]
async fn bare(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

#[idempotent(ttl = "90s")]
#[post("/short")]
async fn short_ttl(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

#[idempotent(ttl = "1h")]
#[post("/long")]
async fn long_ttl(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

#[idempotent(required)]
#[post("/payments")]
async fn required(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

// A handler whose path reaches the route attribute through `macro_rules!`.
macro_rules! generated_handler {
    ($name:ident, $path:literal) => {
        #[idempotent(required)]
        #[post($path)]
        async fn $name(runs: web::Data<RunCounter>) -> HttpResponse {
            ran(&runs)
        }
    };
}
generated_handler!(generated, "/generated");

#[idempotent]
#[patch("/patched")]
async fn patched(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

#[idempotent]
#[delete("/deleted")]
async fn deleted(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

#[idempotent(wait_for_completion = "10s")]
#[post("/waiting")]
async fn waiting(runs: web::Data<RunCounter>) -> HttpResponse {
    let response = ran(&runs);
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    response
}

#[get("/items")]
async fn list_items(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

#[idempotent]
#[post("/items")]
async fn create_item(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

#[idempotent(ttl = "2m")]
#[routes]
#[post("/profile")]
#[put("/profile")]
async fn profile(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

#[idempotent(ttl = "3m")]
#[route("/documents", method = "POST", method = "PATCH")]
async fn document(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

// A tunnel: Actix's HTTP/1 decoder reads the body of a `CONNECT` that declares none (no
// chunked body, no `Content-Length` above 0) until the connection ends.
#[idempotent]
#[route("/tunnel", method = "CONNECT")]
async fn tunnel(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

/// Opened by a test once it has looked at the in-flight record of [`slow`].
#[derive(Clone, Default)]
struct Gate(RunCounter);

#[idempotent(lease = "5s")]
#[post("/slow")]
async fn slow(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    let response = ran(&runs);
    // Bounded, so a failing test cannot hang here.
    for _ in 0..1000 {
        if gate.0.get() > 0 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    response
}

/// [`slow`] without a policy of its own.
#[idempotent]
#[post("/gated")]
async fn gated(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    let response = ran(&runs);
    // Bounded, so a failing test cannot hang here.
    for _ in 0..1000 {
        if gate.0.get() > 0 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    response
}

#[idempotent(store_errors)]
#[post("/stored-errors")]
async fn stored_error(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::NotFound().json(json!({ "seq": seq }))
}

#[idempotent]
#[post("/released-errors")]
async fn released_error(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::NotFound().json(json!({ "seq": seq }))
}

#[idempotent(optional, release_errors)]
#[post("/lenient")]
async fn lenient(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::NotFound().json(json!({ "seq": seq }))
}

#[idempotent(max_request_body = 16)]
#[post("/small-requests")]
async fn small_requests(runs: web::Data<RunCounter>, body: Bytes) -> HttpResponse {
    runs.record();
    HttpResponse::Ok().body(body)
}

#[idempotent(max_stored_body = 32)]
#[post("/small-storage")]
async fn small_storage(runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    HttpResponse::Ok().body(vec![b'x'; 64])
}

/// How many requests the route's own `wrap` saw.
#[derive(Clone, Default)]
struct WrapperCalls(RunCounter);

async fn count_calls(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    if let Some(calls) = req.app_data::<web::Data<WrapperCalls>>() {
        calls.0.record();
    }
    next.call(req).await
}

#[idempotent]
#[post("/wrapped", wrap = "actix_web::middleware::from_fn(count_calls)")]
async fn wrapped(runs: web::Data<RunCounter>) -> HttpResponse {
    ran(&runs)
}

/// Attribute-based scopes: Actix's `#[scope]` rewrites the route path, we add the layer.
#[actix_web::scope("/v2")]
mod v2 {
    use super::*;

    #[idempotent(ttl = "4m")]
    #[post("/orders")]
    pub(super) async fn create(runs: web::Data<RunCounter>) -> HttpResponse {
        ran(&runs)
    }
}

/// What handlers and the routes' own layers report to a test; clones share the counts.
#[derive(Clone, Default)]
struct Probes {
    runs: RunCounter,
    wrapper_calls: WrapperCalls,
    gate: Gate,
}

impl Probes {
    fn register(&self, config: &mut web::ServiceConfig) {
        config
            .app_data(web::Data::new(self.runs.clone()))
            .app_data(web::Data::new(self.wrapper_calls.clone()))
            .app_data(web::Data::new(self.gate.clone()));
    }
}

/// A test server on Redis under its own key prefix, with fresh probes.
struct Harness {
    server: actix_test::TestServer,
    runs: RunCounter,
    wrapper_calls: WrapperCalls,
    gate: Gate,
    prefix: String,
    redis: redis::aio::MultiplexedConnection,
}

impl Harness {
    /// A server whose App is wrapped in `Idempotency::redis(..)` (adjusted by `configure`)
    /// and registers `services`.
    async fn start(
        test: &str,
        configure: fn(Idempotency) -> Idempotency,
        services: fn(&mut web::ServiceConfig),
    ) -> Self {
        // The pool is made out here and cloned into each worker's App; the `Idempotency`
        // holds `Rc`s, so each worker builds its own.
        let pool: RedisPool = redis_pool().await;
        let (probes, prefix) = (Probes::default(), unique_prefix(test));
        let server = {
            let (probes, prefix) = (probes.clone(), prefix.clone());
            actix_test::start(move || {
                let probes = probes.clone();
                App::new()
                    .configure(move |config| probes.register(config))
                    .wrap(configure(
                        Idempotency::redis(pool.clone()).key_prefix(prefix.clone()),
                    ))
                    .configure(services)
            })
        };
        Self::new(server, probes, prefix).await
    }

    /// A server whose App has no `Idempotency` at all.
    async fn start_without_idempotency(test: &str, services: fn(&mut web::ServiceConfig)) -> Self {
        let probes = Probes::default();
        let server = {
            let probes = probes.clone();
            actix_test::start(move || {
                let probes = probes.clone();
                App::new()
                    .configure(move |config| probes.register(config))
                    .configure(services)
            })
        };
        Self::new(server, probes, unique_prefix(test)).await
    }

    async fn new(server: actix_test::TestServer, probes: Probes, prefix: String) -> Self {
        Self {
            server,
            runs: probes.runs,
            wrapper_calls: probes.wrapper_calls,
            gate: probes.gate,
            prefix,
            redis: redis_connection().await,
        }
    }

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
        Reply::read(request.send_body(body).await.unwrap())
            .await
            .unwrap()
    }

    async fn post(&self, path: &str, key: Option<&str>) -> Reply {
        self.send(Method::POST, path, key, "{}").await
    }

    /// The Redis keys this test's server wrote.
    async fn keys(&mut self) -> Vec<String> {
        keys_under(&mut self.redis, &self.prefix).await
    }

    /// The one key this test's server wrote since `before`, and its PTTL in milliseconds.
    async fn new_key_pttl(&mut self, before: &[String]) -> i64 {
        let new: Vec<String> = self
            .keys()
            .await
            .into_iter()
            .filter(|key| !before.contains(key))
            .collect();
        assert_eq!(new.len(), 1, "expected one new record, found {new:?}");
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&new[0])
            .query_async(&mut self.redis)
            .await
            .unwrap();
        pttl
    }
}

/// A key unique to this run, so reruns never meet earlier records.
fn key() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Asserts that `second` is a replay of `first`: marked as one, with the same status,
/// content type and body bytes.
fn assert_replay_of(first: &Reply, second: &Reply) {
    assert!(
        !first.is_replay(),
        "the first request was answered as a replay"
    );
    assert!(second.is_replay(), "no Idempotent-Replayed on the retry");
    assert_eq!(first.status, second.status);
    assert_eq!(first.header("content-type"), second.header("content-type"));
    assert_eq!(first.body, second.body);
}

fn assert_pttl_within(pttl: i64, ttl: Duration) {
    let ttl = i64::try_from(ttl.as_millis()).unwrap();
    assert!(
        pttl > ttl - 5_000 && pttl <= ttl,
        "PTTL {pttl} ms is not the route's ttl of {ttl} ms"
    );
}

#[actix_web::test]
async fn ttl_argument_is_the_pttl_redis_holds_after_commit() {
    let mut h = Harness::start(
        "attr_ttl",
        |i| i,
        |c| {
            c.service(short_ttl);
        },
    )
    .await;
    let reply = h.post("/short", Some(&key())).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let pttl = h.new_key_pttl(&[]).await;
    assert_pttl_within(pttl, Duration::from_secs(90));
}

#[actix_web::test]
async fn bare_attribute_uses_the_app_defaults() {
    let mut h = Harness::start(
        "attr_bare",
        |i| i.policy(IdempotencyPolicy::default().ttl(Duration::from_secs(120))),
        |c| {
            c.service(bare);
        },
    )
    .await;
    let key = key();
    let first = h.post("/orders", Some(&key)).await;
    let second = h.post("/orders", Some(&key)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replay_of(&first, &second);
    assert_eq!(h.runs.get(), 1);
    let pttl = h.new_key_pttl(&[]).await;
    assert_pttl_within(pttl, Duration::from_secs(120));
}

#[actix_web::test]
async fn two_tagged_routes_keep_their_own_ttls() {
    let mut h = Harness::start(
        "attr_two_ttls",
        |i| i,
        |c| {
            c.service(short_ttl).service(long_ttl);
        },
    )
    .await;
    h.post("/short", Some(&key())).await;
    let short = h.new_key_pttl(&[]).await;
    let before = h.keys().await;
    h.post("/long", Some(&key())).await;
    let long = h.new_key_pttl(&before).await;
    assert_pttl_within(short, Duration::from_secs(90));
    assert_pttl_within(long, Duration::from_secs(3600));
    assert_eq!(h.runs.get(), 2);
}

#[actix_web::test]
async fn required_refuses_a_request_without_key() {
    let mut h = Harness::start(
        "attr_required",
        |i| i,
        |c| {
            c.service(required);
        },
    )
    .await;
    let refused = h.post("/payments", None).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(refused.json()["status"], 400);
    assert_eq!(h.runs.get(), 0);
    assert!(h.keys().await.is_empty());

    let accepted = h.post("/payments", Some(&key())).await;
    assert_eq!(accepted.status, StatusCode::CREATED);
    assert_eq!(h.runs.get(), 1);
}

#[actix_web::test]
async fn tagged_handler_inside_a_scope_is_protected() {
    let mut h = Harness::start(
        "attr_scope",
        |i| i,
        |c| {
            c.service(web::scope("/api").service(bare));
        },
    )
    .await;
    let key = key();
    let first = h.post("/api/orders", Some(&key)).await;
    let second = h.post("/api/orders", Some(&key)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replay_of(&first, &second);
    assert_eq!(h.runs.get(), 1);
    assert_eq!(h.keys().await.len(), 1);
}

#[actix_web::test]
async fn tagged_handler_in_a_scope_module_is_protected() {
    let mut h = Harness::start(
        "attr_scope_module",
        |i| i,
        |c| {
            c.service(v2::create);
        },
    )
    .await;
    let key = key();
    let first = h.post("/v2/orders", Some(&key)).await;
    let second = h.post("/v2/orders", Some(&key)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replay_of(&first, &second);
    assert_eq!(h.runs.get(), 1);
    let pttl = h.new_key_pttl(&[]).await;
    assert_pttl_within(pttl, Duration::from_secs(240));
}

#[actix_web::test]
async fn only_the_tagged_method_on_a_path_is_protected() {
    let mut h = Harness::start(
        "attr_get_post",
        |i| i,
        |c| {
            c.service(list_items).service(create_item);
        },
    )
    .await;
    let key = key();
    let first_get = h.send(Method::GET, "/items", Some(&key), "").await;
    let second_get = h.send(Method::GET, "/items", Some(&key), "").await;
    assert_eq!(first_get.status, StatusCode::CREATED);
    assert!(!second_get.is_replay());
    assert_ne!(first_get.body, second_get.body);
    assert_eq!(h.runs.get(), 2);
    assert!(h.keys().await.is_empty(), "GET wrote to the store");

    let first_post = h.post("/items", Some(&key)).await;
    let second_post = h.post("/items", Some(&key)).await;
    assert_replay_of(&first_post, &second_post);
    assert_eq!(h.runs.get(), 3);
    assert_eq!(h.keys().await.len(), 1);
}

#[actix_web::test]
async fn routes_protects_every_method_it_lists() {
    let mut h = Harness::start(
        "attr_routes",
        |i| i,
        |c| {
            c.service(profile);
        },
    )
    .await;
    for method in [Method::POST, Method::PUT] {
        let key = key();
        let before = h.keys().await;
        let first = h.send(method.clone(), "/profile", Some(&key), "{}").await;
        let second = h.send(method.clone(), "/profile", Some(&key), "{}").await;
        assert_eq!(first.status, StatusCode::CREATED, "{method}");
        assert_replay_of(&first, &second);
        let pttl = h.new_key_pttl(&before).await;
        assert_pttl_within(pttl, Duration::from_secs(120));
    }
    assert_eq!(h.runs.get(), 2);
}

#[actix_web::test]
async fn route_protects_every_method_it_lists() {
    let mut h = Harness::start(
        "attr_route",
        |i| i,
        |c| {
            c.service(document);
        },
    )
    .await;
    for method in [Method::POST, Method::PATCH] {
        let key = key();
        let before = h.keys().await;
        let first = h.send(method.clone(), "/documents", Some(&key), "{}").await;
        let second = h.send(method.clone(), "/documents", Some(&key), "{}").await;
        assert_eq!(first.status, StatusCode::CREATED, "{method}");
        assert_replay_of(&first, &second);
        let pttl = h.new_key_pttl(&before).await;
        assert_pttl_within(pttl, Duration::from_secs(180));
    }
    assert_eq!(h.runs.get(), 2);
}

#[actix_web::test]
async fn tagged_route_without_idempotency_on_the_app_answers_500() {
    let h = Harness::start_without_idempotency("attr_unconfigured", |c| {
        c.service(bare);
    })
    .await;
    let reply = h.post("/orders", Some(&key())).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(reply.json()["status"], 500);
    assert_eq!(h.runs.get(), 0);
}

#[actix_web::test]
async fn a_wrap_written_on_the_route_stays_and_sees_replays_too() {
    let h = Harness::start(
        "attr_wrap",
        |i| i,
        |c| {
            c.service(wrapped);
        },
    )
    .await;
    let key = key();
    let first = h.post("/wrapped", Some(&key)).await;
    let second = h.post("/wrapped", Some(&key)).await;
    assert_replay_of(&first, &second);
    assert_eq!(h.runs.get(), 1);
    // The user's layer is outside ours: it sees every request, replays included.
    assert_eq!(h.wrapper_calls.0.get(), 2);
}

#[actix_web::test]
async fn lease_argument_is_the_pttl_of_an_in_flight_record() {
    let mut h = Harness::start(
        "attr_lease",
        |i| i,
        |c| {
            c.service(slow);
        },
    )
    .await;
    let key = key();
    let running = h.post("/slow", Some(&key));
    let probe = async {
        h.runs.wait_for(1).await;
        let mut redis = redis_connection().await;
        let keys = keys_under(&mut redis, &h.prefix).await;
        assert_eq!(keys.len(), 1);
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&keys[0])
            .query_async(&mut redis)
            .await
            .unwrap();
        h.gate.0.record();
        pttl
    };
    let (reply, pttl) = futures_util::future::join(running, probe).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    // The App's default lease is 30 s; renewals bring it back up to 5 s.
    assert!(
        pttl > 0 && pttl <= 5_000,
        "in-flight PTTL {pttl} ms, lease is 5 s"
    );
    // After commit the App's default ttl (24 h) applies.
    let pttl = h.new_key_pttl(&[]).await;
    assert_pttl_within(pttl, Duration::from_secs(24 * 3600));
}

#[actix_web::test]
async fn store_errors_replays_error_responses() {
    let h = Harness::start(
        "attr_store_errors",
        |i| i,
        |c| {
            c.service(stored_error).service(released_error);
        },
    )
    .await;
    let key_stored = key();
    let first = h.post("/stored-errors", Some(&key_stored)).await;
    let second = h.post("/stored-errors", Some(&key_stored)).await;
    assert_eq!(first.status, StatusCode::NOT_FOUND);
    assert_replay_of(&first, &second);
    assert_eq!(h.runs.get(), 1);

    let key_released = key();
    let first = h.post("/released-errors", Some(&key_released)).await;
    let second = h.post("/released-errors", Some(&key_released)).await;
    assert_eq!(
        (first.status, second.status),
        (StatusCode::NOT_FOUND, StatusCode::NOT_FOUND)
    );
    assert!(!second.is_replay());
    assert_eq!(h.runs.get(), 3);
}

#[actix_web::test]
async fn max_request_body_refuses_larger_keyed_bodies() {
    let h = Harness::start(
        "attr_max_request",
        |i| i,
        |c| {
            c.service(small_requests);
        },
    )
    .await;
    let refused = h
        .send(
            Method::POST,
            "/small-requests",
            Some(&key()),
            "seventeen bytes!!",
        )
        .await;
    assert_eq!(refused.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(h.runs.get(), 0);
    let accepted = h
        .send(
            Method::POST,
            "/small-requests",
            Some(&key()),
            "sixteen bytes!!!",
        )
        .await;
    assert_eq!(accepted.status, StatusCode::OK);
    assert_eq!(accepted.body, Bytes::from_static(b"sixteen bytes!!!"));
    assert_eq!(h.runs.get(), 1);
}

#[actix_web::test]
async fn max_stored_body_keeps_the_record_without_its_body() {
    let h = Harness::start(
        "attr_max_stored",
        |i| i,
        |c| {
            c.service(small_storage);
        },
    )
    .await;
    let key = key();
    let first = h.post("/small-storage", Some(&key)).await;
    let second = h.post("/small-storage", Some(&key)).await;
    assert_eq!(first.body.len(), 64);
    assert_eq!(second.status, StatusCode::OK);
    assert!(second.is_replay());
    assert_eq!(second.header("idempotent-body-omitted"), Some("true"));
    assert!(second.body.is_empty());
    assert_eq!(h.runs.get(), 1);
}

#[actix_web::test]
async fn the_route_policy_overrides_an_app_that_protects_the_method_too() {
    let mut h = Harness::start(
        "attr_both_layers",
        |i| {
            i.protect_methods([Method::POST])
                .policy(IdempotencyPolicy::default().ttl(Duration::from_secs(3600)))
        },
        |c| {
            c.service(short_ttl).service(required);
        },
    )
    .await;
    let key = key();
    let first = h.post("/short", Some(&key)).await;
    let second = h.post("/short", Some(&key)).await;
    assert_replay_of(&first, &second);
    assert_eq!(h.runs.get(), 1);
    let pttl = h.new_key_pttl(&[]).await;
    assert_pttl_within(pttl, Duration::from_secs(90));

    let refused = h.post("/payments", None).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(h.runs.get(), 1);
}

/// A scope whose routes share a policy (`web::scope(..).wrap(IdempotentRoute::with_policy(..))`)
/// and a bare `#[idempotent]` route in it: the route keeps the scope's ttl, whether or not the
/// App also protects the method. With `protect_methods`, the route's empty policy replaced the
/// scope's in the App's lock, so the record was kept for the App's 24 h instead of a week: a
/// retry on the second day ran the handler again.
#[actix_web::test]
async fn a_bare_tagged_route_keeps_its_scope_s_ttl_when_the_app_protects_the_method_too() {
    fn weekly(config: &mut web::ServiceConfig) {
        let week = Duration::from_secs(7 * 24 * 60 * 60);
        config.service(
            web::scope("/weekly")
                .wrap(IdempotentRoute::with_policy(
                    IdempotencyPolicy::default().ttl(week),
                ))
                .service(bare),
        );
    }
    for (test, configure) in [
        (
            "attr_scope_policy",
            (|i| i) as fn(Idempotency) -> Idempotency,
        ),
        ("attr_scope_policy_app", |i| {
            i.protect_methods([Method::POST])
        }),
    ] {
        let mut h = Harness::start(test, configure, weekly).await;
        let key = key();
        let first = h.post("/weekly/orders", Some(&key)).await;
        let retry = h.post("/weekly/orders", Some(&key)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{test}");
        assert_replay_of(&first, &retry);
        assert_eq!(h.runs.get(), 1, "{test}");
        let pttl = h.new_key_pttl(&[]).await;
        assert_pttl_within(pttl, Duration::from_secs(7 * 24 * 60 * 60));
    }
}

/// The same scope policy with a larger request-body limit than the App's: a bare tagged route
/// in it keeps the scope's limit. The route layer applied the App's limit to the lock the
/// scope's layer took, and refused a body the scope allowed with 413.
#[actix_web::test]
async fn a_bare_tagged_route_keeps_its_scope_s_request_body_limit() {
    fn uploads(config: &mut web::ServiceConfig) {
        config.service(
            web::scope("/uploads")
                .wrap(IdempotentRoute::with_policy(
                    IdempotencyPolicy::default().max_request_body(64),
                ))
                .service(bare),
        );
    }
    let h = Harness::start(
        "attr_scope_body_limit",
        |i| i.policy(IdempotencyPolicy::default().max_request_body(16)),
        uploads,
    )
    .await;
    let body = "a body of 32 bytes, 16 too many.";
    let key = key();
    let first = h
        .send(Method::POST, "/uploads/orders", Some(&key), body)
        .await;
    let retry = h
        .send(Method::POST, "/uploads/orders", Some(&key), body)
        .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_replay_of(&first, &retry);
    assert_eq!(h.runs.get(), 1);
}

/// And a scope policy with a longer lease than the App's (a slow payment provider): the
/// in-flight record of a bare tagged route in it is held for the scope's lease, not cut to the
/// App's 30 s by the route layer.
#[actix_web::test]
async fn a_bare_tagged_route_keeps_its_scope_s_lease() {
    fn slow_provider(config: &mut web::ServiceConfig) {
        config.service(
            web::scope("/provider")
                .wrap(IdempotentRoute::with_policy(
                    IdempotencyPolicy::default().lease(Duration::from_secs(120)),
                ))
                .service(gated),
        );
    }
    let mut h = Harness::start("attr_scope_lease", |i| i, slow_provider).await;
    let key = key();
    let running = h.post("/provider/gated", Some(&key));
    let probe = async {
        h.runs.wait_for(1).await;
        let mut redis = redis_connection().await;
        let keys = keys_under(&mut redis, &h.prefix).await;
        let pttl: i64 = redis::cmd("PTTL")
            .arg(keys.first().expect("the in-flight record"))
            .query_async(&mut redis)
            .await
            .expect("its PTTL");
        h.gate.0.record();
        pttl
    };
    let (reply, pttl) = futures_util::future::join(running, probe).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(
        pttl > 30_000 && pttl <= 120_000,
        "in-flight PTTL {pttl} ms, the scope's lease is 120 s"
    );
    assert_eq!(h.keys().await.len(), 1);
}

#[actix_web::test]
async fn a_handler_generated_by_macro_rules_is_protected() {
    let h = Harness::start(
        "attr_generated",
        |i| i,
        |c| {
            c.service(generated);
        },
    )
    .await;
    assert_eq!(
        h.post("/generated", None).await.status,
        StatusCode::BAD_REQUEST
    );
    let key = key();
    let first = h.post("/generated", Some(&key)).await;
    let retry = h.post("/generated", Some(&key)).await;
    assert_replay_of(&first, &retry);
    assert_eq!(h.runs.get(), 1);
}

#[actix_web::test]
async fn patch_and_delete_routes_are_protected() {
    let h = Harness::start(
        "attr_patch_delete",
        |i| i,
        |c| {
            c.service(patched).service(deleted);
        },
    )
    .await;
    for (method, path) in [(Method::PATCH, "/patched"), (Method::DELETE, "/deleted")] {
        let key = key();
        let first = h.send(method.clone(), path, Some(&key), "{}").await;
        let retry = h.send(method, path, Some(&key), "{}").await;
        assert_replay_of(&first, &retry);
    }
    assert_eq!(h.runs.get(), 2);
}

#[actix_web::test]
async fn wait_for_completion_argument_replays_instead_of_409() {
    let h = Harness::start(
        "attr_wait",
        |i| i,
        |c| {
            c.service(waiting);
        },
    )
    .await;
    let key = key();
    let (first, waited) = futures_util::future::join(h.post("/waiting", Some(&key)), async {
        h.runs.wait_for(1).await;
        h.post("/waiting", Some(&key)).await
    })
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_replay_of(&first, &waited);
    assert_eq!(h.runs.get(), 1);
}

#[actix_web::test]
async fn optional_and_release_errors_undo_an_app_policy_that_requires_keys_and_stores_errors() {
    let h = Harness::start(
        "attr_opposites",
        |i| i.policy(IdempotencyPolicy::default().required().store_errors()),
        |c| {
            c.service(lenient).service(released_error);
        },
    )
    .await;
    // The App's policy holds where the route says nothing.
    let refused = h.post("/released-errors", None).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{refused:?}");
    let stored_key = key();
    let stored = h.post("/released-errors", Some(&stored_key)).await;
    assert_replay_of(
        &stored,
        &h.post("/released-errors", Some(&stored_key)).await,
    );
    assert_eq!(h.runs.get(), 1);

    // `optional`: served without a key.
    let keyless = h.post("/lenient", None).await;
    assert_eq!(keyless.status, StatusCode::NOT_FOUND, "{keyless:?}");
    assert_eq!(h.runs.get(), 2);
    // `release_errors`: the 404 is not stored, so the retry runs again.
    let key = key();
    let first = h.post("/lenient", Some(&key)).await;
    let retry = h.post("/lenient", Some(&key)).await;
    assert_eq!(first.status, StatusCode::NOT_FOUND);
    assert!(!retry.is_replay(), "{retry:?}");
    assert_ne!(first.body, retry.body);
    assert_eq!(h.runs.get(), 4);
}

/// Sends `CONNECT /tunnel` (with `key`, if any) declaring no body, keeps its side of the
/// connection open, and returns what arrived within 5 s.
fn connect_to_the_tunnel(h: &Harness, key: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(h.server.addr()).expect("the test server");
    socket
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("a read timeout");
    let key = key
        .map(|key| format!("Idempotency-Key: {key}\r\n"))
        .unwrap_or_default();
    write!(
        socket,
        "CONNECT /tunnel HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{key}\r\n"
    )
    .expect("the request is sent");
    let mut received = Vec::new();
    let mut buffer = [0; 4096];
    // Until the server closes the connection or 5 s pass without a byte.
    while let Ok(read @ 1..) = socket.read(&mut buffer) {
        received.extend_from_slice(&buffer[..read]);
    }
    String::from_utf8_lossy(&received).into_owned()
}

/// A `CONNECT` on a tagged route that declares no body: Actix reads its body until the
/// connection ends, as it does for `Upgrade: websocket`. Without a key the handler answers
/// at once; with one, the middleware waited for that body to take the fingerprint, so the
/// client got no answer while it waited (DESIGN §7: bad input gets a clear error). It is
/// refused at once, as a keyed upgrade is: 400 `upgrade-requested`, handler not run.
#[actix_web::test]
async fn a_keyed_connect_without_a_body_is_answered_while_its_client_waits() {
    let h = Harness::start(
        "attr_connect",
        |i| i,
        |c| {
            c.service(tunnel);
        },
    )
    .await;
    let keyless = connect_to_the_tunnel(&h, None);
    assert!(keyless.starts_with("HTTP/1.1 201 "), "{keyless:?}");
    let keyed = connect_to_the_tunnel(&h, Some(&key()));
    assert!(
        keyed.starts_with("HTTP/1.1 400 "),
        "no answer within 5 s to a keyed CONNECT the same request without a key gets at \
         once: {keyed:?}"
    );
    assert!(
        keyed.contains("application/problem+json")
            && keyed.contains("tag:idempotency-actix,2026:upgrade-requested"),
        "{keyed:?}"
    );
    assert_eq!(h.runs.get(), 1, "only the keyless one ran");
}
