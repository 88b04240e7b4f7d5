//! What Redis holds after a commit, how the layers combine, and what clients see when the
//! store fails: real servers, real Redis (`REDIS_URL`, default 127.0.0.1:6379).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse};
use idempotency_actix::{
    BeginOutcome, FailMode, Fingerprint, Idempotency, IdempotencyPolicy, IdempotencyStore,
    IdempotentRoute, Inspector, LeaseToken, MemoryStore, RedisStore, StorageKey, StoreError,
    StoredResponse,
};
use idempotency_actix_tests::{
    FaultyStore, RunCounter, keys_under, redis_connection, redis_pool, unique_prefix,
};

async fn create(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::Created()
        .json(serde_json::json!({ "seq": seq, "id": uuid::Uuid::new_v4().to_string() }))
}

async fn slow_create(runs: web::Data<RunCounter>) -> HttpResponse {
    let response = create(runs).await;
    actix_rt::time::sleep(Duration::from_millis(600)).await;
    response
}

async fn send(
    server: &actix_test::TestServer,
    method: Method,
    path: &str,
    key: Option<&str>,
) -> (StatusCode, actix_web::http::header::HeaderMap, Bytes) {
    let mut request = server.request(method, server.url(path));
    if let Some(key) = key {
        request = request.insert_header(("idempotency-key", key));
    }
    let mut response = request.send_body("{\"item\":\"x\"}").await.unwrap();
    let body = response.body().await.unwrap();
    (response.status(), response.headers().clone(), body)
}

/// A server on the shared Redis under a prefix of its own, with an `Idempotency` adjusted by
/// `configure` on the App and `services`; returns it with its prefix and handler runs.
async fn start_on_redis(
    test: &str,
    configure: fn(Idempotency) -> Idempotency,
    services: fn(&mut web::ServiceConfig),
) -> (actix_test::TestServer, String, RunCounter) {
    let pool = redis_pool().await;
    let prefix = unique_prefix(test);
    let runs = RunCounter::default();
    let server = {
        let (prefix, runs) = (prefix.clone(), runs.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(configure(
                    Idempotency::redis(pool.clone()).key_prefix(prefix.clone()),
                ))
                .configure(services)
        })
    };
    (server, prefix, runs)
}

async fn pttl(key: &str) -> i64 {
    let mut connection = redis_connection().await;
    redis::cmd("PTTL")
        .arg(key)
        .query_async(&mut connection)
        .await
        .unwrap()
}

#[actix_web::test]
async fn redis_holds_the_ttl_and_never_the_raw_key() {
    let (server, prefix, runs) = start_on_redis(
        "pttl",
        |i| i,
        |c| {
            c.service(
                web::resource("/default")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(create)),
            )
            .service(
                web::resource("/short")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().ttl(Duration::from_secs(90)),
                    ))
                    .route(web::post().to(create)),
            );
        },
    )
    .await;
    let raw_key = format!("raw-key-{}", uuid::Uuid::new_v4());
    let (status, _, _) = send(&server, Method::POST, "/default", Some(&raw_key)).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, _) = send(&server, Method::POST, "/short", Some("short-key")).await;
    assert_eq!(status, StatusCode::CREATED);

    let mut connection = redis_connection().await;
    let keys = keys_under(&mut connection, &prefix).await;
    assert_eq!(keys.len(), 2, "{keys:?}");
    let mut ttls = Vec::new();
    for key in &keys {
        assert!(
            !key.contains(&raw_key) && !key.contains("short-key"),
            "raw key in {key}"
        );
        let digest = key.strip_prefix(&prefix).unwrap();
        assert_eq!(digest.len(), 64);
        assert!(digest.chars().all(|c| c.is_ascii_hexdigit()));
        ttls.push(pttl(key).await);
    }
    ttls.sort();
    assert!(
        (85_000..=90_000).contains(&ttls[0]),
        "route ttl 90 s, PTTL {}",
        ttls[0]
    );
    let day = 24 * 60 * 60 * 1000;
    assert!(
        (day - 10_000..=day).contains(&ttls[1]),
        "default ttl 24 h, PTTL {}",
        ttls[1]
    );
    assert_eq!(runs.get(), 2);
}

#[actix_web::test]
async fn app_and_route_layers_together_process_once_with_the_route_ttl() {
    let (server, prefix, runs) = start_on_redis(
        "both_layers",
        |i| i.protect_methods([Method::POST]),
        |c| {
            c.service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().ttl(Duration::from_secs(90)),
                    ))
                    .route(web::post().to(create)),
            )
            .service(
                web::resource("/small")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().max_request_body(8),
                    ))
                    .route(web::post().to(create)),
            )
            .service(
                web::resource("/short-lease")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().lease(Duration::from_secs(5)),
                    ))
                    .route(web::post().to(slow_create)),
            );
        },
    )
    .await;
    // The route's smaller body limit holds although the app layer read the body first.
    let (status, _, _) = send(&server, Method::POST, "/small", Some("big")).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(runs.get(), 0);

    // The route's lease replaces the app's (30 s) while the handler runs.
    let (reply, lease) = futures_util::future::join(
        send(&server, Method::POST, "/short-lease", Some("lease")),
        async {
            runs.wait_for(1).await;
            let mut connection = redis_connection().await;
            let keys = keys_under(&mut connection, &prefix).await;
            assert_eq!(keys.len(), 1, "{keys:?}");
            pttl(&keys[0]).await
        },
    )
    .await;
    assert_eq!(reply.0, StatusCode::CREATED);
    assert!(
        (1..=5_000).contains(&lease),
        "the route's 5 s lease applies: {lease}"
    );
    let mut connection = redis_connection().await;
    for key in keys_under(&mut connection, &prefix).await {
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut connection)
            .await
            .unwrap();
    }
    let runs_before = runs.get();

    let (_, _, first) = send(&server, Method::POST, "/orders", Some("k")).await;
    let (_, headers, retry) = send(&server, Method::POST, "/orders", Some("k")).await;
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(retry, first);
    assert_eq!(runs.get(), runs_before + 1);
    let keys = keys_under(&mut connection, &prefix).await;
    assert_eq!(keys.len(), 1, "one record, not one per layer: {keys:?}");
    let ttl = pttl(&keys[0]).await;
    assert!(
        (85_000..=90_000).contains(&ttl),
        "the route's ttl applies: {ttl}"
    );
}

#[actix_web::test]
async fn idempotency_works_on_a_scope_and_on_a_resource() {
    let store = MemoryStore::new();
    let runs = RunCounter::default();
    let server = {
        let (store, runs) = (store.clone(), runs.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .service(
                    web::scope("/scoped")
                        .wrap(Idempotency::new(store.clone()).protect_methods([Method::POST]))
                        .route("/orders", web::post().to(create)),
                )
                .service(
                    web::resource("/resource")
                        .wrap(Idempotency::new(store.clone()).protect_methods([Method::POST]))
                        .route(web::post().to(create)),
                )
                .route("/outside", web::post().to(create))
        })
    };
    for path in ["/scoped/orders", "/resource"] {
        let (_, _, first) = send(&server, Method::POST, path, Some(path)).await;
        let (_, headers, retry) = send(&server, Method::POST, path, Some(path)).await;
        assert_eq!(
            headers.get("idempotent-replayed").unwrap(),
            "true",
            "{path}"
        );
        assert_eq!(retry, first);
    }
    let (_, headers, _) = send(&server, Method::POST, "/outside", Some("o")).await;
    assert!(headers.get("idempotent-replayed").is_none());
    send(&server, Method::POST, "/outside", Some("o")).await;
    assert_eq!(runs.get(), 4);
}

/// An `Idempotency` on a scope under an App `Idempotency` whose `protect_methods` claims the
/// same method before routing would be passed over (its store, shared by every instance,
/// or its key scope, per user, never used), so a request it would protect, on a tagged
/// route or by its own `protect_methods`, is refused as a configuration error, and no
/// handler runs. A route the nearer `Idempotency` leaves alone stays the App's.
#[actix_web::test]
async fn a_scope_idempotency_passed_over_by_the_app_claim_is_500_not_ignored() {
    let runs = RunCounter::default();
    let (outer, inner) = (MemoryStore::new(), MemoryStore::new());
    let server = {
        let (outer, inner, runs) = (outer.clone(), inner.clone(), runs.clone());
        actix_test::start(move || {
            let global = idempotency_actix::KeyScope::global;
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(
                    Idempotency::new(outer.clone())
                        .scope(global())
                        .protect_methods([Method::POST]),
                )
                .service(
                    web::scope("/tagged")
                        .wrap(Idempotency::new(inner.clone()).scope(global()))
                        .service(
                            web::resource("/orders")
                                .wrap(IdempotentRoute::new())
                                .route(web::post().to(create)),
                        )
                        .route("/untagged", web::post().to(create)),
                )
                .service(
                    web::scope("/protecting")
                        .wrap(
                            Idempotency::new(inner.clone())
                                .scope(global())
                                .protect_methods([Method::POST]),
                        )
                        .route("/orders", web::post().to(create)),
                )
        })
    };
    for path in ["/tagged/orders", "/protecting/orders"] {
        for key in [Some("k"), Some("k"), None] {
            assert_not_configured(send(&server, Method::POST, path, key).await);
        }
    }
    assert_eq!(runs.get(), 0);
    // The scope's untagged route is left to the App's claim, as without the scope's layer.
    let (status, _, first) = send(&server, Method::POST, "/tagged/untagged", Some("u")).await;
    assert_eq!(status, StatusCode::CREATED);
    let (_, headers, retry) = send(&server, Method::POST, "/tagged/untagged", Some("u")).await;
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(retry, first);
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_route_layer_without_idempotency_on_the_app_is_500() {
    let runs = RunCounter::default();
    let server = {
        let runs = runs.clone();
        actix_test::start(move || {
            App::new().app_data(web::Data::new(runs.clone())).service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(create)),
            )
        })
    };
    assert_not_configured(send(&server, Method::POST, "/orders", Some("k")).await);
    assert_eq!(runs.get(), 0);
}

/// Asserts that `reply` is the 500 problem of a misconfigured app.
fn assert_not_configured(
    (status, headers, body): (StatusCode, actix_web::http::header::HeaderMap, Bytes),
) {
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{body:?}");
    assert_eq!(
        headers.get("content-type").unwrap(),
        "application/problem+json"
    );
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], "tag:idempotency-actix,2026:not-configured");
}

/// A store whose every operation fails, as an unreachable Redis does.
#[derive(Clone)]
struct BrokenStore;

impl IdempotencyStore for BrokenStore {
    async fn begin(
        &self,
        _: &StorageKey,
        _: &Fingerprint,
        _: &LeaseToken,
        _: Duration,
    ) -> Result<BeginOutcome, StoreError> {
        Err(StoreError::Protocol("broken on purpose".into()))
    }
    async fn renew(&self, _: &StorageKey, _: &LeaseToken, _: Duration) -> Result<bool, StoreError> {
        Err(StoreError::Protocol("broken on purpose".into()))
    }
    async fn commit(
        &self,
        _: &StorageKey,
        _: &Fingerprint,
        _: &LeaseToken,
        _: &StoredResponse,
        _: Duration,
    ) -> Result<bool, StoreError> {
        Err(StoreError::Protocol("broken on purpose".into()))
    }
    async fn release(&self, _: &StorageKey, _: &LeaseToken) -> Result<bool, StoreError> {
        Err(StoreError::Protocol("broken on purpose".into()))
    }
}

/// Starts `/orders` (tagged) and `/orders` GET on an app built by `idempotency`.
fn start_with(
    runs: &RunCounter,
    idempotency: impl Fn() -> Idempotency + Clone + Send + 'static,
) -> actix_test::TestServer {
    let runs = runs.clone();
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .wrap(idempotency())
            .service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(create))
                    .route(web::get().to(create)),
            )
    })
}

fn assert_503(status: StatusCode, headers: &actix_web::http::header::HeaderMap, body: &[u8]) {
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers.get("retry-after").unwrap(), "1");
    let problem: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(
        problem["type"],
        "tag:idempotency-actix,2026:store-unavailable"
    );
    assert!(
        !problem["detail"]
            .as_str()
            .unwrap()
            .contains("broken on purpose"),
        "store detail leaked"
    );
}

#[actix_web::test]
async fn a_failing_store_is_503_fail_closed_and_runs_unprotected_fail_open() {
    let runs = RunCounter::default();
    let closed = start_with(&runs, || Idempotency::new(BrokenStore));
    let (status, headers, body) = send(&closed, Method::POST, "/orders", Some("k")).await;
    assert_503(status, &headers, &body);
    assert_eq!(runs.get(), 0, "fail-closed: the handler did not run");
    // Unprotected requests never touch the store, so they still work.
    assert_eq!(
        send(&closed, Method::GET, "/orders", Some("k")).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        send(&closed, Method::POST, "/orders", None).await.0,
        StatusCode::CREATED
    );
    assert_eq!(runs.get(), 2);

    let open = start_with(&runs, || {
        Idempotency::new(BrokenStore).on_store_error(FailMode::Open)
    });
    let (status, headers, _) = send(&open, Method::POST, "/orders", Some("k")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(runs.get(), 3, "fail-open: the handler ran");
}

#[actix_web::test]
async fn an_unreachable_redis_is_503_and_a_slow_store_times_out() {
    let runs = RunCounter::default();
    // Nothing listens on port 1: every connection is refused at once.
    let dead_pool = RedisStore::pool("redis://127.0.0.1:1").unwrap();
    let unreachable = start_with(&runs, move || Idempotency::redis(dead_pool.clone()));
    let (status, headers, body) = send(&unreachable, Method::POST, "/orders", Some("k")).await;
    assert_503(status, &headers, &body);

    // The `begin` answers after 2 s, well within the client's own timeout (5 s): waited for,
    // it would acquire and the handler would run (201). The 503 shows the store timeout
    // (200 ms) cut it short.
    let slow = FaultyStore {
        delay: Duration::from_secs(2),
        ..FaultyStore::default()
    };
    let server = start_with(&runs, move || {
        Idempotency::new(slow.clone()).store_timeout(Duration::from_millis(200))
    });
    let (status, headers, body) = send(&server, Method::POST, "/orders", Some("k")).await;
    assert_503(status, &headers, &body);
    assert_eq!(runs.get(), 0);
}

/// Answers 201 with an empty body.
async fn create_empty(runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    HttpResponse::Created().finish()
}

/// An empty body under both layers: Actix never polls a body that declares itself empty,
/// and the route layer's response reaches the app layer boxed. Its record is still
/// committed before the response is sent, so a retry sent as soon as the response arrived
/// gets the replay, not 409. (The commit used to start when Actix dropped the unread body,
/// after the response had gone out.)
#[actix_web::test]
async fn an_empty_response_under_both_layers_is_committed_before_it_is_sent() {
    let runs = RunCounter::default();
    let store = FaultyStore {
        commit_delay: Duration::from_millis(300),
        ..FaultyStore::default()
    };
    let server = {
        let runs = runs.clone();
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(Idempotency::new(store.clone()).protect_methods([Method::POST]))
                .service(
                    web::resource("/empty")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(create_empty)),
                )
        })
    };
    let (status, headers, body) = send(&server, Method::POST, "/empty", Some("k")).await;
    assert_eq!((status, body.len()), (StatusCode::CREATED, 0));
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, body) = send(&server, Method::POST, "/empty", Some("k")).await;
    assert_eq!(
        (status, body.len()),
        (StatusCode::CREATED, 0),
        "{headers:?}"
    );
    assert_eq!(headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(runs.get(), 1);
}

async fn pause_then_continue(
    req: actix_web::dev::ServiceRequest,
    next: actix_web::middleware::Next<impl actix_web::body::MessageBody>,
) -> Result<actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>, actix_web::Error> {
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    next.call(req).await
}

async fn very_slow_create(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    actix_rt::time::sleep(Duration::from_millis(2000)).await;
    HttpResponse::Created().json(serde_json::json!({ "seq": seq }))
}

#[actix_web::test]
async fn a_shorter_route_lease_is_renewed_in_time_under_an_app_layer() {
    let pool = redis_pool().await;
    let prefix = unique_prefix("route_lease");
    let runs = RunCounter::default();
    let server = {
        let (pool, prefix, runs) = (pool.clone(), prefix.clone(), runs.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                // Runs after the app layer took the request, before routing: the app's
                // renewal timer is already running with its own (longer) lease.
                .wrap(actix_web::middleware::from_fn(pause_then_continue))
                .wrap(
                    Idempotency::redis(pool.clone())
                        .key_prefix(prefix.clone())
                        .protect_methods([Method::POST])
                        .policy(IdempotencyPolicy::default().lease(Duration::from_secs(3))),
                )
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(Duration::from_millis(600)),
                        ))
                        .route(web::post().to(very_slow_create)),
                )
        })
    };
    let (first, duplicate) =
        futures_util::future::join(send(&server, Method::POST, "/orders", Some("k")), async {
            // Over two route leases after the route was reached.
            actix_rt::time::sleep(Duration::from_millis(1700)).await;
            send(&server, Method::POST, "/orders", Some("k")).await
        })
        .await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(duplicate.0, StatusCode::CONFLICT);
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_longer_route_lease_that_fails_to_apply_is_applied_at_the_next_renewal() {
    let store = MemoryStore::builder().build();
    let runs = RunCounter::default();
    let server = {
        let (store, runs) = (store.clone(), runs.clone());
        actix_test::start(move || {
            let store = FaultyStore {
                inner: store.clone(),
                failed_renewals: std::sync::Arc::new(1.into()),
                ..FaultyStore::default()
            };
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(
                    Idempotency::new(store)
                        .protect_methods([Method::POST])
                        .policy(IdempotencyPolicy::default().lease(Duration::from_secs(1))),
                )
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(Duration::from_secs(60)),
                        ))
                        .route(web::post().to(very_slow_create)),
                )
        })
    };
    // The route's renewal to 60 s fails, so the record still expires 1 s after `begin`,
    // while the handler runs for 2 s: the duplicate comes after that second, and the record
    // it meets has the route's lease (the app's 1 s, renewed, would have a second at most).
    let (first, (duplicate, lease_left)) =
        futures_util::future::join(send(&server, Method::POST, "/orders", Some("k")), async {
            actix_rt::time::sleep(Duration::from_millis(1500)).await;
            let lease_left = Inspector::new(store.clone())
                .lookup(b"", "k")
                .await
                .unwrap()
                .expect("the record in flight")
                .expires_in
                .expect("its expiry");
            (
                send(&server, Method::POST, "/orders", Some("k")).await,
                lease_left,
            )
        })
        .await;
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(duplicate.0, StatusCode::CONFLICT, "the duplicate ran");
    assert!(lease_left > Duration::from_secs(30), "{lease_left:?} left");
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_route_refusal_under_an_app_layer_that_stores_errors_is_not_stored() {
    let runs = RunCounter::default();
    let server = {
        let runs = runs.clone();
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(
                    Idempotency::new(MemoryStore::new())
                        .protect_methods([Method::POST])
                        .policy(IdempotencyPolicy::default().store_errors()),
                )
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().max_request_body(4),
                        ))
                        .route(web::post().to(create)),
                )
        })
    };
    // The route refuses the body over its limit (413) while the app layer holds the key:
    // the handler did not run, so nothing is stored and the key stays free.
    let too_large = || {
        server
            .post("/orders")
            .insert_header(("idempotency-key", "k"))
            .send_body("0123456789")
    };
    let refused = too_large().await.unwrap();
    assert_eq!(refused.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let again = too_large().await.unwrap();
    assert_eq!(again.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        again.headers().get("idempotent-replayed").is_none(),
        "the refusal was replayed"
    );
    assert_eq!(runs.get(), 0);
}

/// The route's smaller body limit applies also where the app layer fails open with no
/// token to run under (a store that refused the `begin`, or could not be reached): 413, and
/// the handler does not run, as when the `begin` timed out or the route layer claims the
/// request itself. It ran the handler on the whole body.
#[actix_web::test]
async fn a_route_body_limit_holds_when_the_app_layer_fails_open_without_a_lock() {
    let runs = RunCounter::default();
    let server = {
        let runs = runs.clone();
        actix_test::start(move || {
            let store = FaultyStore {
                refused_begins: std::sync::Arc::new(u32::MAX.into()),
                ..FaultyStore::default()
            };
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(
                    Idempotency::new(store)
                        .protect_methods([Method::POST])
                        .on_store_error(FailMode::Open),
                )
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().max_request_body(4),
                        ))
                        .route(web::post().to(create)),
                )
        })
    };
    let (status, _, body) = send(&server, Method::POST, "/orders", Some("k")).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body:?}");
    assert_eq!(runs.get(), 0);
    // A body within the limit runs, unprotected, as failing open does.
    let mut within = server
        .post("/orders")
        .insert_header(("idempotency-key", "k"))
        .send_body("{}")
        .await
        .unwrap();
    assert_eq!(
        within.status(),
        StatusCode::CREATED,
        "{:?}",
        within.body().await
    );
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_record_of_another_version_is_never_taken_over() {
    let (server, prefix, runs) = start_on_redis(
        "other_version",
        |i| i,
        |c| {
            c.service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(create)),
            );
        },
    )
    .await;
    // An instance of a future version holds this key (as `send` will ask for it): a record
    // of format 99, whose header (format, state, fingerprint, token) has the layout of
    // every format, followed by whatever that format adds.
    let key = idempotency_actix::IdempotencyKey::parse(b"rolling").unwrap();
    let storage_key = StorageKey::new(&prefix, b"", &key);
    let fingerprint = Fingerprint::compute(&Method::POST, "/orders", "", b"{\"item\":\"x\"}", []);
    let token = b"another-instance";
    let mut record = vec![99, b'i'];
    record.extend_from_slice(fingerprint.as_bytes());
    record.push(token.len() as u8);
    record.extend_from_slice(token);
    record.extend_from_slice(b"fields of a later format");
    let mut connection = redis_connection().await;
    let _: () = redis::cmd("SET")
        .arg(storage_key.as_str())
        .arg(&record)
        .arg("PX")
        .arg(30_000)
        .query_async(&mut connection)
        .await
        .unwrap();
    let (status, _, _) = send(&server, Method::POST, "/orders", Some("rolling")).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(
        runs.get(),
        0,
        "another version's in-flight record is in flight"
    );

    // Completed by that version: its response cannot be read here, so 503, never a rerun.
    record[1] = b'c';
    let _: () = redis::cmd("SET")
        .arg(storage_key.as_str())
        .arg(&record)
        .arg("PX")
        .arg(30_000)
        .query_async(&mut connection)
        .await
        .unwrap();
    let (status, _, _) = send(&server, Method::POST, "/orders", Some("rolling")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);

    // A record in the hash format of earlier development builds: unreadable, 503, never a
    // second run.
    let old = idempotency_actix::IdempotencyKey::parse(b"hash-format").unwrap();
    let old_key = StorageKey::new(&prefix, b"", &old);
    let _: () = redis::cmd("HSET")
        .arg(old_key.as_str())
        .arg("v")
        .arg("1")
        .arg("s")
        .arg("c")
        .query_async(&mut connection)
        .await
        .unwrap();
    let _: () = redis::cmd("PEXPIRE")
        .arg(old_key.as_str())
        .arg(30_000)
        .query_async(&mut connection)
        .await
        .unwrap();
    let (status, _, _) = send(&server, Method::POST, "/orders", Some("hash-format")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        runs.get(),
        0,
        "no record of another format is ever taken over"
    );
}

/// 4 KiB of JSON-ish text, which gzip shrinks.
async fn compressible(runs: web::Data<RunCounter>) -> HttpResponse {
    let seq = runs.record();
    HttpResponse::Created()
        .content_type("application/json")
        .body(format!(
            "{{\"seq\":{seq},\"pad\":\"{}\"}}",
            "a".repeat(4096)
        ))
}

/// `Compress` wrapped after `Idempotency` (so it runs outside it) compresses each answer for
/// its own client: the record holds the identity body, and a retry from a client that does
/// not accept gzip gets it plain, whichever layer processed the request.
#[actix_web::test]
async fn compress_wrapped_after_idempotency_encodes_each_replay_for_its_client() {
    for app_layer_processes in [false, true] {
        let runs = RunCounter::default();
        let (pool, prefix) = (redis_pool().await, unique_prefix("compress"));
        let server = {
            let runs = runs.clone();
            actix_test::start(move || {
                let mut idempotency = Idempotency::redis(pool.clone())
                    .key_prefix(prefix.clone())
                    .scope(idempotency_actix::KeyScope::global());
                if app_layer_processes {
                    idempotency = idempotency.protect_methods([Method::POST]);
                }
                App::new()
                    .app_data(web::Data::new(runs.clone()))
                    .wrap(idempotency)
                    .wrap(actix_web::middleware::Compress::default())
                    .service(
                        web::resource("/report")
                            .wrap(IdempotentRoute::new())
                            .route(web::post().to(compressible)),
                    )
            })
        };
        let send = |encoding: &'static str| {
            server
                .post("/report")
                .no_decompress()
                .insert_header(("idempotency-key", "report"))
                .insert_header(("accept-encoding", encoding))
                .send()
        };

        let mut gzipped = send("gzip").await.unwrap();
        assert_eq!(gzipped.status(), StatusCode::CREATED);
        assert_eq!(gzipped.headers().get("content-encoding").unwrap(), "gzip");
        let gzipped = gzipped.body().await.unwrap();

        let mut plain = send("identity").await.unwrap();
        assert_eq!(plain.status(), StatusCode::CREATED);
        assert_eq!(plain.headers().get("idempotent-replayed").unwrap(), "true");
        assert_eq!(plain.headers().get("content-encoding"), None);
        let plain = plain.body().await.unwrap();
        assert!(
            plain.starts_with(b"{\"seq\":1,"),
            "{app_layer_processes}: {plain:?}"
        );
        assert_eq!(plain.len(), 4096 + 18);
        assert!(gzipped.len() < plain.len() / 4);
        assert_eq!(runs.get(), 1, "{app_layer_processes}");
    }
}
