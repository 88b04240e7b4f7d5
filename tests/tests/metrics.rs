//! The metrics (issue 11): each outcome moves `idempotency_requests_total` for its route
//! pattern, store operations are timed, the in-flight gauge comes back to zero, and
//! background retries are counted. A debugging recorder is installed for the test binary;
//! each test uses its own route patterns, and the tests take turns (a snapshot drains the
//! histograms).

#![allow(clippy::unwrap_used)]
// Each test holds its turn for its whole run on its own runtime thread: the lock only makes
// the other tests of this binary wait.
#![allow(clippy::await_holding_lock)]

use std::sync::OnceLock;
use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::{App, HttpResponse, web};
use idempotency_actix::{
    FailMode, Idempotency, IdempotencyPolicy, IdempotentRoute, MemoryStore, Outcome, PostgresStore,
    RedisStore,
};
use idempotency_actix_tests::{Gate, Reply, RunCounter, reset};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// Held by each test for its whole run.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().unwrap();
        snapshotter
    })
}

type Labels = Vec<(String, String)>;

/// Every counter and gauge now: (name, labels sorted, value). A snapshot reports counters
/// as increments since the last one, and gauges as their change since the last one (it
/// sets each to zero once read, and the middleware only increments and decrements them),
/// and drains histograms: counters and gauges are summed here.
fn metrics() -> Vec<(String, Labels, DebugValue)> {
    static TOTALS: std::sync::Mutex<Vec<(String, Labels, u64)>> = std::sync::Mutex::new(Vec::new());
    static GAUGES: std::sync::Mutex<Vec<(String, Labels, f64)>> = std::sync::Mutex::new(Vec::new());
    let mut totals = TOTALS.lock().unwrap();
    let mut gauges = GAUGES.lock().unwrap();
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let (_, key) = key.into_parts();
        let mut labels: Labels = key
            .labels()
            .map(|label| (label.key().to_owned(), label.value().to_owned()))
            .collect();
        labels.sort();
        let name = key.name().to_owned();
        match value {
            DebugValue::Counter(increment) => {
                let known = totals
                    .iter_mut()
                    .find(|(n, l, _)| *n == name && *l == labels);
                match known {
                    Some((_, _, total)) => *total += increment,
                    None => totals.push((name, labels, increment)),
                }
            }
            DebugValue::Gauge(change) => {
                let known = gauges
                    .iter_mut()
                    .find(|(n, l, _)| *n == name && *l == labels);
                match known {
                    Some((_, _, value)) => *value += change.into_inner(),
                    None => gauges.push((name, labels, change.into_inner())),
                }
            }
            DebugValue::Histogram(_) => {}
        }
    }
    totals
        .iter()
        .map(|(name, labels, total)| (name.clone(), labels.clone(), DebugValue::Counter(*total)))
        .chain(gauges.iter().map(|(name, labels, value)| {
            (
                name.clone(),
                labels.clone(),
                DebugValue::Gauge((*value).into()),
            )
        }))
        .collect()
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut labels: Vec<(String, String)> = pairs
        .iter()
        .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
        .collect();
    labels.sort();
    labels
}

/// `idempotency_requests_total{route, outcome}` now.
fn requests(route: &str, outcome: Outcome) -> u64 {
    let wanted = labels(&[("route", route), ("outcome", outcome.as_str())]);
    metrics()
        .into_iter()
        .find_map(|(name, labels, value)| match value {
            DebugValue::Counter(count)
                if name == "idempotency_requests_total" && labels == wanted =>
            {
                Some(count)
            }
            _ => None,
        })
        .unwrap_or(0)
}

/// Every outcome counted for `route`, outcome by outcome.
fn outcomes_of(route: &str) -> Vec<(String, u64)> {
    let mut outcomes: Vec<(String, u64)> = metrics()
        .into_iter()
        .filter_map(|(name, labels, value)| {
            let outcome = labels
                .iter()
                .find(|(key, _)| key == "outcome")
                .map(|(_, outcome)| outcome.clone())?;
            let on_route = labels
                .iter()
                .any(|(key, value)| key == "route" && value == route);
            match value {
                DebugValue::Counter(count) if name == "idempotency_requests_total" && on_route => {
                    Some((outcome, count))
                }
                _ => None,
            }
        })
        .collect();
    outcomes.sort();
    outcomes
}

fn gauge(name: &str, route: &str) -> Option<f64> {
    let wanted = labels(&[("route", route)]);
    metrics()
        .into_iter()
        .find_map(|(found, labels, value)| match value {
            DebugValue::Gauge(value) if found == name && labels == wanted => {
                Some(value.into_inner())
            }
            _ => None,
        })
}

fn counter(name: &str, pairs: &[(&str, &str)]) -> u64 {
    let wanted = labels(pairs);
    metrics()
        .into_iter()
        .find_map(|(found, labels, value)| match value {
            DebugValue::Counter(count) if found == name && labels == wanted => Some(count),
            _ => None,
        })
        .unwrap_or(0)
}

async fn send(
    server: &actix_test::TestServer,
    path: &str,
    key: Option<&str>,
    body: &'static str,
) -> Reply {
    let mut request = server.post(path);
    if let Some(key) = key {
        request = request.insert_header(("idempotency-key", key));
    }
    Reply::read(request.send_body(body).await.unwrap())
        .await
        .unwrap()
}

/// A resource at `pattern` that counts its runs, sleeping `?ms=N` first.
fn counted(
    pattern: &str,
    runs: RunCounter,
    route: IdempotentRoute,
) -> impl actix_web::dev::HttpServiceFactory + use<> {
    web::resource(pattern).wrap(route).route(web::post().to(
        move |query: web::Query<std::collections::HashMap<String, u64>>| {
            let runs = runs.clone();
            async move {
                runs.record();
                if let Some(ms) = query.get("ms") {
                    actix_rt::time::sleep(Duration::from_millis(*ms)).await;
                }
                HttpResponse::Created().body("made")
            }
        },
    ))
}

/// A [`counted`] resource: its pattern, and what makes its route layer.
type CountedResource = (&'static str, fn() -> IdempotentRoute);

/// A server whose app is the layer `idempotency` makes around [`counted`] resources, all
/// counting into `runs`.
fn start_counted(
    idempotency: fn() -> Idempotency,
    resources: &'static [CountedResource],
    runs: &RunCounter,
) -> actix_test::TestServer {
    let runs = runs.clone();
    actix_test::start(move || {
        resources
            .iter()
            .fold(App::new().wrap(idempotency()), |app, (pattern, route)| {
                app.service(counted(pattern, runs.clone(), route()))
            })
    })
}

/// A route layer that requires a key.
fn key_required() -> IdempotentRoute {
    IdempotentRoute::with_policy(IdempotencyPolicy::default().required())
}

#[actix_web::test]
async fn every_outcome_is_counted_once_under_its_route_pattern() {
    let _turn = one_at_a_time();
    snapshotter();
    let runs = RunCounter::default();
    let server = start_counted(
        || {
            Idempotency::new(MemoryStore::new())
                .policy(IdempotencyPolicy::default().max_request_body(16))
        },
        &[
            ("/m/orders/{id}", IdempotentRoute::new),
            ("/m/payments", key_required),
        ],
        &runs,
    );
    let route = "/m/orders/{id}";

    assert_eq!(
        send(&server, "/m/orders/1", Some("a"), "{}").await.status,
        201
    );
    assert_eq!(requests(route, Outcome::Executed), 1);

    let replay = send(&server, "/m/orders/1", Some("a"), "{}").await;
    assert!(replay.is_replay());
    assert_eq!(requests(route, Outcome::Replayed), 1);

    let reused = send(&server, "/m/orders/1", Some("a"), "{\"other\":1}").await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(requests(route, Outcome::Mismatch), 1);

    let invalid = send(&server, "/m/orders/2", Some("\"unbalanced"), "{}").await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST);
    assert_eq!(requests(route, Outcome::InvalidKey), 1);

    let large = send(&server, "/m/orders/3", Some("b"), "0123456789abcdefXYZ").await;
    assert_eq!(large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(requests(route, Outcome::TooLarge), 1);

    assert_eq!(send(&server, "/m/orders/4", None, "{}").await.status, 201);
    assert_eq!(requests(route, Outcome::NoKey), 1);

    let missing = send(&server, "/m/payments", None, "{}").await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(requests("/m/payments", Outcome::MissingKey), 1);

    // The first request holds the lock while a duplicate comes in.
    let slow = send(&server, "/m/orders/5?ms=600", Some("c"), "{}");
    let duplicate = async {
        runs.wait_for(3).await;
        assert_eq!(
            gauge("idempotency_requests_in_flight", route),
            Some(1.0),
            "the first request is under its lock"
        );
        send(&server, "/m/orders/5?ms=600", Some("c"), "{}").await
    };
    let (first, second) = futures_util::future::join(slow, duplicate).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(second.status, StatusCode::CONFLICT);
    assert_eq!(requests(route, Outcome::Conflict), 1);
    assert_eq!(gauge("idempotency_requests_in_flight", route), Some(0.0));

    assert_eq!(runs.get(), 3, "two runs under a lock, one keyless run");
    assert_eq!(
        outcomes_of(route),
        [
            ("conflict".to_owned(), 1),
            ("executed".to_owned(), 2),
            ("invalid_key".to_owned(), 1),
            ("mismatch".to_owned(), 1),
            ("no_key".to_owned(), 1),
            ("replayed".to_owned(), 1),
            ("too_large".to_owned(), 1),
        ],
        "each request counted once, under its pattern, never its raw path"
    );
    assert!(outcomes_of("/m/orders/1").is_empty());
}

/// Under an `Idempotency` that claims requests before routing (`protect_methods`), what a
/// route layer further in decides lands in the claiming layer's record: each request is
/// counted once, under its route's pattern.
#[actix_web::test]
async fn an_outcome_a_route_decides_under_an_app_claim_is_counted_once() {
    let _turn = one_at_a_time();
    snapshotter();
    let runs = RunCounter::default();
    let server = start_counted(
        || Idempotency::new(MemoryStore::new()).protect_methods([Method::POST]),
        &[
            ("/claimed/payments", key_required),
            ("/claimed/orders/{id}", IdempotentRoute::new),
        ],
        &runs,
    );

    let missing = send(&server, "/claimed/payments", None, "{}").await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        outcomes_of("/claimed/payments"),
        [("missing_key".to_owned(), 1)],
        "the route's refusal, not the app's `no_key`, and once"
    );

    let first = send(&server, "/claimed/orders/1", Some("k"), "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(&server, "/claimed/orders/1", Some("k"), "{}").await;
    assert!(replay.is_replay());
    assert_eq!(
        outcomes_of("/claimed/orders/{id}"),
        [("executed".to_owned(), 1), ("replayed".to_owned(), 1)]
    );
    assert_eq!(
        runs.get(),
        1,
        "the keyed request ran once; the refused one never"
    );
}

/// A layer keeps the patterns it found that were the path itself: requests to two such
/// paths and to another pattern's, in turn under one layer (on a scope), are each counted
/// under their own pattern.
#[actix_web::test]
async fn requests_to_three_patterns_in_turn_are_counted_under_each() {
    let _turn = one_at_a_time();
    snapshotter();
    let runs = RunCounter::default();
    let server = {
        let runs = runs.clone();
        actix_test::start(move || {
            let handler = |runs: RunCounter| {
                web::post().to(move || {
                    let runs = runs.clone();
                    async move {
                        runs.record();
                        HttpResponse::Created().body("made")
                    }
                })
            };
            let items = web::scope("/in-turn")
                .wrap(IdempotentRoute::new())
                .service(web::resource("/items/special").route(handler(runs.clone())))
                .service(web::resource("/other").route(handler(runs.clone())))
                .service(web::resource("/items/{id}").route(handler(runs.clone())));
            App::new()
                .wrap(Idempotency::new(MemoryStore::new()))
                .service(items)
        })
    };
    let send_to = |path: &'static str, key: Option<&'static str>| {
        let server = &server;
        async move {
            let reply = send(server, path, key, "{}").await;
            assert_eq!(reply.status, StatusCode::CREATED, "{path}: {reply:?}");
        }
    };

    for _ in 0..2 {
        send_to("/in-turn/items/special", None).await;
        send_to("/in-turn/other", None).await;
        send_to("/in-turn/items/7", None).await;
    }
    send_to("/in-turn/items/special", Some("s")).await;
    send_to("/in-turn/other", Some("o")).await;
    send_to("/in-turn/items/8", Some("d")).await;
    send_to("/in-turn/items/special", None).await;

    assert_eq!(
        outcomes_of("/in-turn/items/special"),
        [("executed".to_owned(), 1), ("no_key".to_owned(), 3)]
    );
    assert_eq!(
        outcomes_of("/in-turn/other"),
        [("executed".to_owned(), 1), ("no_key".to_owned(), 2)]
    );
    assert_eq!(
        outcomes_of("/in-turn/items/{id}"),
        [("executed".to_owned(), 1), ("no_key".to_owned(), 2)]
    );
    assert_eq!(runs.get(), 10);
}

/// Failures of a store that cannot be reached are counted by fail mode; their `begin`s
/// were never sent, so nothing is abandoned for them and no background retry is counted.
#[actix_web::test]
async fn store_failures_are_counted_by_fail_mode_and_leave_nothing_to_retry() {
    let _turn = one_at_a_time();
    snapshotter();
    let server = actix_test::start(|| {
        // Nothing listens on port 1: no connection can be had, so nothing is ever sent.
        let pool = RedisStore::pool("redis://127.0.0.1:1").unwrap();
        let closed = Idempotency::redis(pool.clone());
        let open = Idempotency::redis(pool).on_store_error(FailMode::Open);
        App::new()
            .service(web::scope("/closed").wrap(closed).service(counted(
                "/order",
                RunCounter::default(),
                IdempotentRoute::new(),
            )))
            .service(web::scope("/open").wrap(open).service(counted(
                "/order",
                RunCounter::default(),
                IdempotentRoute::new(),
            )))
    });
    let retries_before = release_retries();
    let closed = send(&server, "/closed/order", Some("k"), "{}").await;
    assert_eq!(closed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(requests("/closed/order", Outcome::StoreError), 1);
    let open = send(&server, "/open/order", Some("k"), "{}").await;
    assert_eq!(open.status, StatusCode::CREATED);
    assert_eq!(requests("/open/order", Outcome::FailOpen), 1);
    assert_no_release_retry_since(retries_before).await;
}

/// The same where the server takes the connection and never answers (a hung host behind a
/// live socket): no connection is made by the store timeout, the `begin` was never sent,
/// and nothing is abandoned for it. It used to be given up by the engine's own bound as a
/// timeout, which may have landed, and abandoned in the background for a lease.
#[actix_web::test]
async fn a_begin_that_found_no_connection_by_its_deadline_leaves_nothing_to_retry() {
    let _turn = one_at_a_time();
    snapshotter();
    // Listening, never accepting: the kernel completes the handshake, nothing answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("redis://{}", silent.local_addr().unwrap());
    let server = actix_test::start(move || {
        let pool = RedisStore::pool(&url).unwrap();
        App::new().service(
            web::scope("/silent")
                .wrap(Idempotency::redis(pool).store_timeout(Duration::from_millis(300)))
                .service(counted(
                    "/order",
                    RunCounter::default(),
                    IdempotentRoute::new(),
                )),
        )
    });
    let retries_before = release_retries();
    let reply = send(&server, "/silent/order", Some("k"), "{}").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(requests("/silent/order", Outcome::StoreError), 1);
    assert_no_release_retry_since(retries_before).await;
    drop(silent);
}

/// A transactional route's claim whose pool gives no connection (nothing listens) was never
/// sent either: nothing is abandoned for it. It was abandoned inline and then in the
/// background for a lease, competing for the pool with the requests.
#[actix_web::test]
async fn a_transactional_claim_that_found_no_connection_leaves_nothing_to_retry() {
    let _turn = one_at_a_time();
    snapshotter();
    let server = actix_test::start(|| {
        let pool = PostgresStore::pool("postgres://postgres@127.0.0.1:1/none").unwrap();
        let transactional = IdempotencyPolicy::default().transactional();
        App::new().service(
            web::scope("/tx")
                .wrap(
                    Idempotency::postgres(PostgresStore::new(pool))
                        .store_timeout(Duration::from_millis(300)),
                )
                .service(counted(
                    "/order",
                    RunCounter::default(),
                    IdempotentRoute::with_policy(transactional),
                )),
        )
    });
    let retries_before = release_retries();
    let reply = send(&server, "/tx/order", Some("k"), "{}").await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(requests("/tx/order", Outcome::StoreError), 1);
    assert_no_release_retry_since(retries_before).await;
}

/// A `begin` the store answered with an error may have written its lock: its token is
/// abandoned, and where that does not land at once, retried in the background, counted as
/// `release`.
#[actix_web::test]
async fn the_abandon_of_a_failed_begin_is_retried_in_the_background() {
    let _turn = one_at_a_time();
    snapshotter();
    let route = "/m/abandon-retried";
    let (server, _runs, _gate) = start_gated(route, || {
        Idempotency::new(idempotency_actix_tests::FaultyStore {
            unavailable_begins: std::sync::Arc::new(1.into()),
            // Longer than the store timeout: the abandon sent inline times out.
            abandon_delay: Duration::from_millis(400),
            ..Default::default()
        })
        .store_timeout(Duration::from_millis(200))
    });
    let retries_before = release_retries();
    assert_eq!(
        send(&server, route, Some("k"), "{}").await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    for _ in 0..500 {
        if release_retries() > retries_before {
            return;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no background retry was counted in 5 s");
}

/// Waits well past a background abandon's first retry (50 ms after a failure), then asserts
/// that no retry was counted since `before`.
async fn assert_no_release_retry_since(before: u64) {
    actix_rt::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(release_retries(), before, "a background retry was counted");
}

fn release_retries() -> u64 {
    counter(
        "idempotency_background_retries_total",
        &[("operation", "release")],
    )
}

#[actix_web::test]
async fn store_operations_are_timed_by_operation() {
    let _turn = one_at_a_time();
    let snapshotter = snapshotter();
    snapshotter.snapshot(); // drains what earlier tests timed
    let server = actix_test::start(|| {
        App::new()
            .wrap(Idempotency::new(MemoryStore::new()))
            .service(counted(
                "/timed",
                RunCounter::default(),
                IdempotentRoute::new(),
            ))
            .service(
                web::resource("/timed-error")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(|| async { HttpResponse::BadRequest().finish() })),
            )
    });
    assert_eq!(send(&server, "/timed", Some("t"), "{}").await.status, 201);
    assert_eq!(
        send(&server, "/timed-error", Some("u"), "{}").await.status,
        400
    );
    // A begin and a commit for the first request, a begin and a release for the second.
    let mut seen = std::collections::BTreeSet::new();
    for (key, unit, _, value) in snapshotter.snapshot().into_vec() {
        let (_, key) = key.into_parts();
        if key.name() != "idempotency_store_operation_duration_seconds" {
            continue;
        }
        assert_eq!(unit, Some(metrics::Unit::Seconds));
        let DebugValue::Histogram(samples) = value else {
            panic!("not a histogram: {value:?}");
        };
        let labels: Vec<(String, String)> = key
            .labels()
            .map(|label| (label.key().to_owned(), label.value().to_owned()))
            .collect();
        if !samples.is_empty() {
            assert!(
                labels.contains(&("result".to_owned(), "ok".to_owned())),
                "{labels:?}"
            );
            let operation = labels
                .iter()
                .find(|(name, _)| name == "operation")
                .map(|(_, operation)| operation.clone())
                .unwrap();
            // Each operation took some time: a zero is a duration that was not measured.
            assert!(
                samples.iter().all(|seconds| seconds.into_inner() > 0.0),
                "{operation}: {samples:?}"
            );
            seen.insert((operation, samples.len()));
        }
    }
    let expected: std::collections::BTreeSet<(String, usize)> =
        [("begin", 2), ("commit", 1), ("release", 1)]
            .into_iter()
            .map(|(operation, count)| (operation.to_owned(), count))
            .collect();
    assert_eq!(seen, expected);
}

#[actix_web::test]
async fn memory_store_evictions_are_counted() {
    let _turn = one_at_a_time();
    snapshotter();
    let evictions = || counter("idempotency_evictions_total", &[("source", "memory_store")]);
    let before = evictions();
    let store = MemoryStore::builder().max_bytes(64 * 1024).build();
    let server = actix_test::start({
        let store = store.clone();
        move || {
            App::new()
                .wrap(Idempotency::new(store.clone()))
                .service(counted(
                    "/evicting",
                    RunCounter::default(),
                    IdempotentRoute::new(),
                ))
        }
    });
    for i in 0..200 {
        let key = format!("key-{i}");
        assert_eq!(
            send(&server, "/evicting", Some(&key), "{}").await.status,
            201
        );
    }
    assert!(store.evictions() > 0, "the store is too large to evict");
    assert_eq!(evictions() - before, store.evictions());
}

#[actix_web::test]
async fn replay_cache_evictions_are_counted() {
    let _turn = one_at_a_time();
    snapshotter();
    let evictions = || counter("idempotency_evictions_total", &[("source", "replay_cache")]);
    let before = evictions();
    let pool = idempotency_actix_tests::redis_pool().await;
    let prefix = idempotency_actix_tests::unique_prefix("replay_cache_evictions");
    // Room for about four of the 1 KiB responses below.
    let cache = idempotency_actix::ReplayCache::with_max_bytes(5 * 1024);
    let server = actix_test::start(move || {
        App::new()
            .wrap(
                Idempotency::redis(pool.clone())
                    .key_prefix(prefix.clone())
                    .replay_cache(cache.clone()),
            )
            .service(
                web::resource("/cached")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(|| async { HttpResponse::Ok().body(vec![b'x'; 1024]) })),
            )
    });
    // Each key's first replay comes from Redis and fills the cache; forty of them overflow it.
    for round in 0..40 {
        let key = format!("cached-{round}");
        assert_eq!(send(&server, "/cached", Some(&key), "{}").await.status, 200);
        assert!(send(&server, "/cached", Some(&key), "{}").await.is_replay());
    }
    for _ in 0..500 {
        if evictions() > before {
            return;
        }
        // The cache evicts in its housekeeping, which later operations run.
        let key = format!("cached-{}", 40);
        send(&server, "/cached", Some(&key), "{}").await;
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no replay cache eviction was counted");
}

/// A server with one protected resource at `pattern`, under the `Idempotency` that
/// `idempotency` makes per worker, that counts its runs, then waits at the gate.
fn start_gated(
    pattern: &'static str,
    idempotency: fn() -> Idempotency,
) -> (actix_test::TestServer, RunCounter, Gate) {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = actix_test::start({
        let (runs, gate) = (runs.clone(), gate.clone());
        move || {
            let (runs, gate) = (runs.clone(), gate.clone());
            App::new().wrap(idempotency()).service(
                web::resource(pattern)
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(move || {
                        let (runs, gate) = (runs.clone(), gate.clone());
                        async move {
                            runs.record();
                            gate.wait().await;
                            HttpResponse::Created().body("made")
                        }
                    })),
            )
        }
    });
    (server, runs, gate)
}

#[actix_web::test]
async fn a_run_whose_client_left_is_counted_and_holds_the_in_flight_gauge() {
    let _turn = one_at_a_time();
    snapshotter();
    let route = "/m/left";
    let (server, runs, gate) = start_gated(route, || Idempotency::new(MemoryStore::new()));

    // The client gives up while the handler runs; Actix drops the request's future and the
    // run goes on by itself.
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    std::io::Write::write_all(
        &mut socket,
        b"POST /m/left HTTP/1.1\r\nHost: test\r\nIdempotency-Key: gone\r\n\
          Content-Length: 2\r\n\r\n{}",
    )
    .unwrap();
    runs.wait_for(1).await;
    reset(socket);
    let mut counted = 0;
    for _ in 0..500 {
        counted = requests(route, Outcome::Executed);
        if counted == 1 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        counted, 1,
        "the request is counted once its future is dropped"
    );
    assert_eq!(
        gauge("idempotency_requests_in_flight", route),
        Some(1.0),
        "its handler still runs under the lock"
    );

    gate.open();
    let mut retry = send(&server, route, Some("gone"), "{}").await;
    for _ in 0..500 {
        if retry.status != StatusCode::CONFLICT {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
        retry = send(&server, route, Some("gone"), "{}").await;
    }
    assert!(retry.is_replay(), "the run committed by itself");
    assert_eq!(gauge("idempotency_requests_in_flight", route), Some(0.0));
    assert_eq!(requests(route, Outcome::Executed), 1, "counted once");
    assert_eq!(runs.get(), 1);
}

/// Sends a keyed `POST route` (body `{}`) on a connection of its own, and resets the
/// connection once `left` has passed, as a client that gives up does.
async fn leave_after(server: &actix_test::TestServer, route: &str, key: &str, left: Duration) {
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    let request = format!(
        "POST {route} HTTP/1.1\r\nHost: test\r\nIdempotency-Key: {key}\r\n\
         Content-Length: 2\r\n\r\n{{}}"
    );
    std::io::Write::write_all(&mut socket, request.as_bytes()).unwrap();
    actix_rt::time::sleep(left).await;
    reset(socket);
}

/// The outcomes counted for `route` (see [`outcomes_of`]) once any is, within 5 s.
async fn first_counted(route: &str) -> Vec<(String, u64)> {
    for _ in 0..500 {
        let outcomes = outcomes_of(route);
        if !outcomes.is_empty() {
            return outcomes;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    Vec::new()
}

/// A client that leaves while its request's `begin` is on its way to the store: nothing was
/// decided for the request, and it went uncounted (every protected request is counted once);
/// it is counted as `client_gone`, and its handler never runs.
#[actix_web::test]
async fn a_request_whose_client_leaves_before_its_begin_answers_is_counted_as_gone() {
    let _turn = one_at_a_time();
    snapshotter();
    let route = "/m/gone-early";
    let (server, runs, _gate) = start_gated(route, || {
        Idempotency::new(idempotency_actix_tests::FaultyStore {
            delay: Duration::from_millis(800),
            ..Default::default()
        })
    });
    // Its `begin` waits 800 ms before it reaches the store; the client resets before.
    leave_after(&server, route, "early", Duration::from_millis(200)).await;
    assert_eq!(
        first_counted(route).await,
        vec![("client_gone".to_owned(), 1)],
        "counted once, as gone"
    );
    actix_rt::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        outcomes_of(route),
        vec![("client_gone".to_owned(), 1)],
        "and nothing else"
    );
    assert_eq!(runs.get(), 0, "its handler never ran");
}

/// A retry that waits for its key's run (`wait_for_completion`) and whose client leaves
/// between two `begin`s has nothing to abandon: both answered, neither created anything. It
/// used to start the background abandon of its token, which retried until the key was free
/// (a lease at most) and held a drain (`Idempotency::drain`) as long.
#[actix_web::test]
async fn a_waiting_retry_whose_client_leaves_abandons_nothing() {
    let _turn = one_at_a_time();
    snapshotter();
    let (server, runs, gate) = start_gated("/m/waits", || {
        let waiting = IdempotencyPolicy::default().wait_for_completion(Duration::from_secs(10));
        Idempotency::new(MemoryStore::new()).policy(waiting)
    });
    let abandons = || {
        counter(
            "idempotency_background_retries_total",
            &[("operation", "release")],
        )
    };
    let before = abandons();
    let first = send(&server, "/m/waits", Some("k"), "{}");
    let retry_leaves = async {
        runs.wait_for(1).await;
        let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
        std::io::Write::write_all(
            &mut socket,
            b"POST /m/waits HTTP/1.1\r\nHost: test\r\nIdempotency-Key: k\r\n\
              Content-Length: 2\r\n\r\n{}",
        )
        .unwrap();
        // The retry waits (the in-memory store answers each `begin` at once, so it is
        // between two of them whenever it is dropped), then its client resets.
        actix_rt::time::sleep(Duration::from_millis(200)).await;
        reset(socket);
        // A first background attempt comes 50 ms after the drop.
        actix_rt::time::sleep(Duration::from_millis(300)).await;
        gate.open();
    };
    let (first, ()) = futures_util::future::join(first, retry_leaves).await;
    assert_eq!(first.status, StatusCode::CREATED);
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        abandons() - before,
        0,
        "the waiting retry abandoned its token"
    );
    assert_eq!(runs.get(), 1);
}

/// A streamed response holds its key until its record is complete, at the end of the stream:
/// a duplicate meanwhile gets 409. The in-flight gauge counted it only until the head went
/// out, and showed 0 while the stream still ran under its lock.
#[actix_web::test]
async fn a_streamed_response_holds_the_in_flight_gauge_until_its_record_is_complete() {
    use actix_web::web::Bytes;
    use futures_util::StreamExt;

    let _turn = one_at_a_time();
    snapshotter();
    let route = "/m/streamed";
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server =
        actix_test::start({
            let (runs, gate) = (runs.clone(), gate.clone());
            move || {
                let (runs, gate) = (runs.clone(), gate.clone());
                App::new()
                    .wrap(Idempotency::new(MemoryStore::new()))
                    .service(web::resource(route).wrap(IdempotentRoute::new()).route(
                        web::post().to(move || {
                            runs.record();
                            let gate = gate.clone();
                            let last = futures_util::stream::once(async move {
                                gate.wait().await;
                                Bytes::from_static(b"last")
                            });
                            let chunks = futures_util::stream::iter([Bytes::from_static(b"first")])
                                .chain(last)
                                .map(Ok::<_, actix_web::Error>);
                            async move { HttpResponse::Ok().streaming(chunks) }
                        }),
                    ))
            }
        });
    let mut response = server
        .post(route)
        .insert_header(("idempotency-key", "streamed"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let first = actix_rt::time::timeout(Duration::from_secs(10), response.next())
        .await
        .expect("no first chunk")
        .unwrap()
        .unwrap();
    assert_eq!(first, "first");
    let duplicate = send(&server, route, Some("streamed"), "").await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "the key is held");
    assert_eq!(
        gauge("idempotency_requests_in_flight", route),
        Some(1.0),
        "the stream runs under its lock"
    );

    gate.open();
    let rest = actix_rt::time::timeout(Duration::from_secs(10), response.body())
        .await
        .expect("the stream did not end")
        .unwrap();
    assert_eq!(rest, "last");
    assert_eq!(gauge("idempotency_requests_in_flight", route), Some(0.0));
    assert!(send(&server, route, Some("streamed"), "").await.is_replay());
    assert_eq!(runs.get(), 1);
}

/// A `begin` the store answers with an error (fail closed): its token is abandoned before the
/// 503 goes out, and a client that left meanwhile was counted as `client_gone`, though the
/// request was refused for the store's failure; `store_error` missed it.
#[actix_web::test]
async fn a_store_error_whose_client_leaves_during_the_abandon_is_counted_as_a_store_error() {
    let _turn = one_at_a_time();
    snapshotter();
    let route = "/m/store-error-left";
    let (server, runs, _gate) = start_gated(route, || {
        Idempotency::new(idempotency_actix_tests::FaultyStore {
            unavailable_begins: std::sync::Arc::new(1.into()),
            abandon_delay: Duration::from_millis(800),
            ..Default::default()
        })
    });
    // Its `begin` fails at once; the abandon of its token takes 800 ms to reach the store.
    leave_after(&server, route, "left", Duration::from_millis(200)).await;
    assert_eq!(
        first_counted(route).await,
        vec![("store_error".to_owned(), 1)]
    );
    assert_eq!(runs.get(), 0);
}
