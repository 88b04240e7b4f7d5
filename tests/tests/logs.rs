//! What the middleware logs (DESIGN §9, issues 3 and 5): a route layer without an App-level
//! `Idempotency` says what to add, fail-open warns, key values never reach the log, a
//! transaction taken on a route that is not transactional names the fix, and an app that
//! chose no key scope, or a lease that a renewal may outlast, is warned once per process.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use actix_web::dev::{HttpServiceFactory, Service};
use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, web};
use idempotency_actix::{
    FailMode, Idempotency, IdempotentRoute, Inspector, KeyScope, MemoryStore, RecordState,
    RedisStore,
};

/// Everything every test in this binary logged, at every level.
fn log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&log);
        tracing_subscriber::fmt()
            .with_max_level(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_ansi(false)
            .with_writer(move || LogWriter(Arc::clone(&sink)))
            .init();
        log
    })
    .clone()
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn logged() -> String {
    String::from_utf8_lossy(&log().lock().unwrap()).into_owned()
}

async fn create() -> HttpResponse {
    HttpResponse::Created().body("created")
}

/// A server whose app keeps keys in a memory store of one global scope, around the resource
/// `make` builds (for each worker).
fn memory_server<R>(make: impl Fn() -> R + Send + Clone + 'static) -> actix_test::TestServer
where
    R: HttpServiceFactory + 'static,
{
    actix_test::start(move || {
        App::new()
            .wrap(Idempotency::new(MemoryStore::new()).scope(KeyScope::global()))
            .service(make())
    })
}

/// Asserts that the event whose message holds `marker` was logged inside the span of a
/// request to `route`.
fn assert_logged_in_request_span(marker: &str, route: &str) {
    let logged = logged();
    let event = logged
        .lines()
        .find(|line| line.contains(marker))
        .unwrap_or_else(|| panic!("no event {marker:?} was logged: {logged}"));
    assert!(
        event.contains(&format!("idempotency{{http.route=\"{route}\"}}")),
        "the event is outside the span of the request to {route}: {event}"
    );
}

async fn post(server: &actix_test::TestServer, path: &str, key: &str) -> StatusCode {
    server
        .post(path)
        .insert_header(("idempotency-key", key))
        .send_body("{}")
        .await
        .unwrap()
        .status()
}

#[actix_web::test]
async fn a_route_layer_without_app_state_logs_what_is_missing() {
    log();
    let server = actix_test::start(|| {
        App::new().service(
            web::resource("/unconfigured")
                .wrap(IdempotentRoute::new())
                .route(web::post().to(create)),
        )
    });
    assert_eq!(
        post(&server, "/unconfigured", "k").await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let logged = logged();
    let line = logged
        .lines()
        .find(|line| line.contains("/unconfigured"))
        .unwrap_or_else(|| panic!("nothing logged for the route: {logged}"));
    assert!(line.contains("ERROR"), "{line}");
    assert!(
        line.contains("add .wrap(Idempotency::redis(pool))"),
        "{line}"
    );
}

#[actix_web::test]
async fn fail_open_runs_the_handler_and_warns() {
    log();
    let server = actix_test::start(|| {
        // Nothing listens on port 1: the store fails at once.
        let pool = RedisStore::pool("redis://127.0.0.1:1").unwrap();
        App::new()
            .wrap(
                Idempotency::redis(pool)
                    .on_store_error(FailMode::Open)
                    .scope(KeyScope::global()),
            )
            .service(
                web::resource("/open")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(create)),
            )
    });
    assert_eq!(post(&server, "/open", "k").await, StatusCode::CREATED);
    let logged = logged();
    assert!(
        logged
            .lines()
            .any(|line| line.contains("WARN") && line.contains("unprotected (fail-open)")),
        "no fail-open warning in: {logged}"
    );
}

/// A store that is down fails every new key's `begin`: each is answered (503 failing
/// closed, the handler unprotected failing open) and counted in the metrics, but the log
/// says so once per 10 s per worker, with how many it left out since, rather than a line per
/// request that a flood of keys would turn into a flood of lines.
#[actix_web::test]
async fn a_store_that_is_down_is_logged_once_per_interval_not_per_request() {
    log();
    for (mode, route, status, level) in [
        (
            FailMode::Closed,
            "/down-closed",
            StatusCode::SERVICE_UNAVAILABLE,
            "ERROR",
        ),
        (FailMode::Open, "/down-open", StatusCode::CREATED, "WARN"),
    ] {
        let server = actix_test::start_with(actix_test::config().workers(1), move || {
            // Nothing listens on port 1: the store fails at once.
            let pool = RedisStore::pool("redis://127.0.0.1:1").unwrap();
            App::new()
                .wrap(
                    Idempotency::redis(pool)
                        .on_store_error(mode)
                        .scope(KeyScope::global()),
                )
                .service(
                    web::resource(route)
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(create)),
                )
        });
        for n in 0..12 {
            assert_eq!(post(&server, route, &format!("down-{n}")).await, status);
        }
        let span = format!("idempotency{{http.route=\"{route}\"}}");
        let logged = logged();
        let lines: Vec<&str> = logged
            .lines()
            .filter(|line| line.contains(&span) && line.contains("idempotency store failed"))
            .collect();
        assert_eq!(lines.len(), 1, "{mode:?}: {lines:#?}");
        assert!(lines[0].contains(level), "{mode:?}: {}", lines[0]);
        assert!(lines[0].contains("unlogged=0"), "{mode:?}: {}", lines[0]);
    }
}

/// A transactional route whose database is down: each keyless request gets its 503 (no
/// transaction to run in), and the error is logged once per interval with the other store
/// failures, not once per request (which it was: an outage wrote a line per request).
#[actix_web::test]
async fn a_transactional_route_whose_database_is_down_is_logged_once_per_interval() {
    log();
    let route = "/ledger-down";
    let server = actix_test::start_with(actix_test::config().workers(1), move || {
        // Nothing listens on port 1.
        let pool =
            idempotency_actix::PostgresStore::pool("postgres://postgres@127.0.0.1:1/none").unwrap();
        App::new()
            .wrap(
                Idempotency::postgres(idempotency_actix::PostgresStore::new(pool))
                    .scope(KeyScope::global())
                    .store_timeout(std::time::Duration::from_millis(300)),
            )
            .service(
                web::resource(route)
                    .wrap(IdempotentRoute::with_policy(
                        idempotency_actix::IdempotencyPolicy::default().transactional(),
                    ))
                    .route(web::post().to(takes_a_transaction)),
            )
    });
    for _ in 0..6 {
        let answer = server.post(route).send_body("{}").await.unwrap();
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    }
    let span = format!("idempotency{{http.route=\"{route}\"}}");
    let logged = logged();
    let lines: Vec<&str> = logged
        .lines()
        .filter(|line| {
            line.contains(&span) && line.contains("no transaction for a transactional route")
        })
        .collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");
}

/// A fail-open run after a `begin` that landed but did not answer has its response committed
/// in the background, which is logged at INFO. The README says events name the storage key at
/// DEBUG level only: that event named it, so a log at INFO carried one per such run.
#[actix_web::test]
async fn the_commit_of_a_fail_open_run_is_logged_without_the_storage_key() {
    log();
    let store = idempotency_actix_tests::FaultyStore::default();
    store
        .landed_failed_begins
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let server = actix_test::start({
        let store = store.clone();
        move || {
            App::new()
                .wrap(
                    Idempotency::new(store.clone())
                        .on_store_error(FailMode::Open)
                        .scope(KeyScope::global()),
                )
                .service(
                    web::resource("/landed")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(create)),
                )
        }
    });
    let key = "fail-open-landed-h88";
    assert_eq!(post(&server, "/landed", key).await, StatusCode::CREATED);
    let inspector = Inspector::new(store.inner.clone());
    let storage_key = inspector.storage_key(b"", key).expect("a valid key");
    let marker = "the response of a fail-open run is stored";
    let mut committed = None;
    for _ in 0..500 {
        let record = inspector
            .lookup(b"", key)
            .await
            .expect("the memory store answers");
        if record.is_some_and(|record| record.state == RecordState::Completed)
            && logged().contains(marker)
        {
            committed = Some(());
            break;
        }
        actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    committed.expect("the fail-open run's response was not committed and logged in 5 s");
    let logged = logged();
    let leaked: Vec<&str> = logged
        .lines()
        .filter(|line| line.contains(storage_key.as_str()))
        .filter(|line| !line.contains("DEBUG") && !line.contains("TRACE"))
        .collect();
    assert!(
        leaked.is_empty(),
        "the storage key was logged above DEBUG: {leaked:?}"
    );
}

#[actix_web::test]
async fn key_values_never_reach_the_log() {
    log();
    let server = memory_server(|| {
        web::resource("/secret")
            .wrap(IdempotentRoute::new())
            .route(web::post().to(create))
    });
    let secret = "customer-4711-card-ending-0042";
    assert_eq!(post(&server, "/secret", secret).await, StatusCode::CREATED);
    assert_eq!(post(&server, "/secret", secret).await, StatusCode::CREATED);
    let logged = logged();
    // This test's own events were logged (other tests of the binary replay too).
    let span = "idempotency{http.route=\"/secret\"}";
    assert!(
        logged
            .lines()
            .any(|line| line.contains("idempotency: replayed") && line.contains(span)),
        "no replay of /secret was logged: {logged}"
    );
    assert!(
        !logged.contains(secret),
        "the key value leaked into the log"
    );
}

async fn takes_a_transaction(
    _transaction: idempotency_actix::IdempotentTransaction,
) -> HttpResponse {
    HttpResponse::Created().finish()
}

#[actix_web::test]
async fn a_transaction_on_a_route_that_is_not_transactional_logs_the_fix() {
    log();
    let server = memory_server(|| {
        web::resource("/not-transactional")
            .wrap(IdempotentRoute::new())
            .route(web::post().to(takes_a_transaction))
    });
    assert_eq!(
        post(&server, "/not-transactional", "k").await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    let logged = logged();
    // Every event of the request carries the route in its span; the error names the fix.
    let line = logged
        .lines()
        .find(|line| line.contains("/not-transactional") && line.contains("ERROR"))
        .unwrap_or_else(|| panic!("no error logged for the route: {logged}"));
    assert!(line.contains("#[idempotent(transactional)]"), "{line}");
    assert!(line.contains("Idempotency::postgres(store)"), "{line}");
}

/// The warning an app that chose no key scope logs.
const SHARED_KEYS_WARNING: &str =
    "no key scope chosen, so idempotency keys are shared by all callers";

fn shared_keys_warnings() -> usize {
    logged()
        .lines()
        .filter(|line| line.contains(SHARED_KEYS_WARNING))
        .inspect(|line| assert!(line.contains("WARN"), "{line}"))
        .count()
}

/// Every other test of this binary chooses a scope, so this one alone decides whether the
/// process-wide warning appears.
#[actix_web::test]
async fn an_app_without_a_key_scope_warns_once_per_process() {
    log();
    let routes = |config: &mut web::ServiceConfig| {
        config.service(
            web::resource("/shared")
                .wrap(IdempotentRoute::new())
                .route(web::post().to(create)),
        );
    };
    let chosen = actix_test::start_with(actix_test::config().workers(2), move || {
        App::new()
            .wrap(Idempotency::new(MemoryStore::new()).scope(KeyScope::global()))
            .configure(routes)
    });
    assert_eq!(post(&chosen, "/shared", "a").await, StatusCode::CREATED);
    assert_eq!(
        shared_keys_warnings(),
        0,
        "an explicit global scope is a choice"
    );

    // Two servers of two workers each, and several requests: still one warning.
    let unchosen = || {
        actix_test::start_with(actix_test::config().workers(2), move || {
            App::new()
                .wrap(Idempotency::new(MemoryStore::new()))
                .configure(routes)
        })
    };
    let servers = [unchosen(), unchosen()];
    for (n, server) in servers.iter().enumerate() {
        for key in ["a", "b", "c"] {
            let key = format!("{n}-{key}");
            assert_eq!(post(server, "/shared", &key).await, StatusCode::CREATED);
        }
    }
    assert_eq!(shared_keys_warnings(), 1, "{}", logged());
}

#[actix_web::test]
async fn each_protected_request_has_a_span_with_route_outcome_and_status() {
    log();
    let server = memory_server(|| {
        web::resource("/spans/{id}")
            .wrap(IdempotentRoute::new())
            .route(web::post().to(create))
    });
    let secret = "span-key-5e1f0c";
    assert_eq!(post(&server, "/spans/7", secret).await, StatusCode::CREATED);
    assert_eq!(post(&server, "/spans/7", secret).await, StatusCode::CREATED);
    let logged = logged();
    let finished: Vec<&str> = logged
        .lines()
        .filter(|line| line.contains("request finished") && line.contains("/spans/{id}"))
        .collect();
    assert!(
        finished
            .iter()
            .any(|line| line.contains("outcome=\"executed\"")
                && line.contains("http.response.status_code=201")),
        "no span of the first request in: {logged}"
    );
    assert!(
        finished
            .iter()
            .any(|line| line.contains("outcome=\"replayed\"")
                && line.contains("http.response.status_code=201")),
        "no span of the replay in: {logged}"
    );
    assert!(
        !logged.contains("/spans/7"),
        "the raw path is not the route"
    );
    assert!(
        !logged.contains(secret),
        "the key value leaked into the log"
    );
}

async fn create_and_log() -> HttpResponse {
    tracing::info!("handler-event-3c9a: order created");
    HttpResponse::Created().body("created")
}

#[actix_web::test]
async fn a_handler_run_under_a_lock_logs_inside_the_request_span() {
    log();
    let server = memory_server(|| {
        web::resource("/spanned")
            .wrap(IdempotentRoute::new())
            .route(web::post().to(create_and_log))
    });
    assert_eq!(
        post(&server, "/spanned", "spanned-key").await,
        StatusCode::CREATED
    );
    assert_logged_in_request_span("handler-event-3c9a", "/spanned");
}

#[actix_web::test]
async fn a_keyless_request_calls_its_route_s_inner_layers_in_the_request_span() {
    log();
    let server = memory_server(|| {
        web::resource("/keyless-spanned")
            // Inside the route's layer; logs when it is called, before any future
            // of its is polled.
            .wrap_fn(|req, service| {
                tracing::info!("inner-layer-event-8b41: called");
                service.call(req)
            })
            .wrap(IdempotentRoute::new())
            .route(web::post().to(create))
    });
    let response = server
        .post("/keyless-spanned")
        .send_body("{}")
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_logged_in_request_span("inner-layer-event-8b41", "/keyless-spanned");
}

#[actix_web::test]
async fn a_lease_a_renewal_may_outlast_is_a_warning() {
    log();
    // A 1 s lease against the default store timeout (2 s): a renewal sent at a third of
    // the lease may land after it.
    let server = memory_server(|| {
        web::resource("/short-lease")
            .wrap(IdempotentRoute::with_policy(
                idempotency_actix::IdempotencyPolicy::default()
                    .lease(std::time::Duration::from_secs(1)),
            ))
            .route(web::post().to(create))
    });
    assert_eq!(
        post(&server, "/short-lease", "k").await,
        StatusCode::CREATED
    );
    let logged = logged();
    let line = logged
        .lines()
        .find(|line| line.contains("a lease of at most twice the store timeout"))
        .unwrap_or_else(|| panic!("no warning of the short lease: {logged}"));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("store_timeout_ms=2000"), "{line}");
}

/// A store that fails renewals for a while (down, or slower than the store timeout): each
/// failed renewal is retried at the next tick, and every one was a warning, about ten a
/// second per running request, for as long as the store stayed down. The first failure of
/// a run is the warning; the others are at debug level, and the renewal that ends the run
/// says how many failed.
#[actix_web::test]
async fn a_run_of_failed_renewals_is_one_warning() {
    log();
    let store = idempotency_actix_tests::FaultyStore {
        failed_renewals: Arc::new(std::sync::atomic::AtomicU32::new(5)),
        ..Default::default()
    };
    let server = idempotency_actix_tests::FloodServer::start(
        move || {
            Idempotency::new(store.clone())
                .scope(KeyScope::global())
                .policy(
                    idempotency_actix::IdempotencyPolicy::default()
                        .lease(std::time::Duration::from_secs(6)),
                )
        },
        64,
    );
    let first = server
        .start_slow("renewals-failing")
        .await
        .expect("the slow handler runs");
    let mut renewed = None;
    for _ in 0..500 {
        renewed = logged()
            .lines()
            .find(|line| line.contains("lease renewed after failed renewals"))
            .map(str::to_owned);
        if renewed.is_some() {
            break;
        }
        actix_rt::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let renewed = renewed.expect("a renewal succeeded after the failed ones within 10 s");
    server.gate.open();
    assert_eq!(
        first.await.expect("the slow request").status,
        StatusCode::CREATED
    );
    assert!(renewed.contains("INFO"), "{renewed}");
    assert!(renewed.contains("failures=5"), "{renewed}");
    let logged = logged();
    let warnings: Vec<_> = logged
        .lines()
        .filter(|line| line.contains("lease renewal failed; will retry"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning for the run: {warnings:#?}");
    assert!(warnings[0].contains("WARN"), "{}", warnings[0]);
    let again = logged
        .lines()
        .filter(|line| line.contains("lease renewal failed again"))
        .collect::<Vec<_>>();
    assert_eq!(again.len(), 4, "the other four at debug level: {again:#?}");
    assert!(
        again.iter().all(|line| line.contains("DEBUG")),
        "{again:#?}"
    );
}

#[actix_web::test]
async fn a_lost_in_flight_record_is_an_error_without_the_key() {
    log();
    let redis = idempotency_actix_tests::PrivateRedis::start().await;
    let pool = RedisStore::pool(&redis.url()).unwrap();
    let server = idempotency_actix_tests::FloodServer::start(
        move || {
            Idempotency::redis(pool.clone())
                .scope(KeyScope::global())
                .policy(
                    idempotency_actix::IdempotencyPolicy::default()
                        .lease(std::time::Duration::from_secs(1)),
                )
        },
        64,
    );
    let secret = "customer-4711-lost-record";
    let first = server.start_slow(secret).await.unwrap();
    // As an eviction would: the in-flight record vanishes while its handler runs.
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut redis.connection().await)
        .await
        .unwrap();
    let mut line = None;
    for _ in 0..500 {
        line = logged()
            .lines()
            .find(|line| line.contains("in-flight record lost"))
            .map(str::to_owned);
        if line.is_some() {
            break;
        }
        actix_rt::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let line = line.expect("the renewal noticed the lost record within 10 s");
    server.gate.open();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert!(line.contains("ERROR"), "{line}");
    assert!(line.contains(r#"noticed_by="renewal""#), "{line}");
    assert!(
        !line.contains("key="),
        "no storage key at error level: {line}"
    );
    assert!(
        !logged().contains(secret),
        "the key value leaked into the log"
    );
}

async fn panics() -> HttpResponse {
    panic!("a handler panicked on purpose for the log test");
}

#[actix_web::test]
async fn a_handler_s_panic_is_an_error_in_the_request_span_without_the_storage_key() {
    log();
    let server = memory_server(|| {
        web::resource("/panics-logged")
            .wrap(IdempotentRoute::new())
            .route(web::post().to(panics))
    });
    assert_eq!(
        post(&server, "/panics-logged", "panic-log-1").await,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_logged_in_request_span("handler panicked; key released", "/panics-logged");
    let logged = logged();
    let line = logged
        .lines()
        .find(|line| line.contains("handler panicked; key released"))
        .unwrap();
    assert!(line.contains("ERROR"), "{line}");
    assert!(
        !line.contains("key="),
        "no storage key at error level: {line}"
    );
}
