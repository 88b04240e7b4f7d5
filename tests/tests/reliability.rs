//! DESIGN §7 under failure: leases, waiting for completion, client disconnects, Redis
//! stopped, restarted, stalled (`DEBUG SLEEP`, `CLIENT PAUSE`), a pool with every slot held, and
//! graceful shutdown. Tests that stop or stall Redis use a private `redis-server`.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse, HttpServer};
use idempotency_actix::{
    BeginOutcome, FailMode, Fingerprint, Idempotency, IdempotencyPolicy, IdempotencyStore,
    IdempotentRoute, KeyScope, LeaseToken, RedisPool, RedisStore, StorageKey, StoreError,
    StoredResponse,
};
use idempotency_actix_tests::{
    FaultyStore, Gate, GatedRoutes, PrivateRedis, RawExchange, RunCounter, redis_pool, reset,
    unique_prefix,
};

#[derive(serde::Deserialize)]
struct Delay {
    delay_ms: Option<u64>,
}

async fn create(runs: web::Data<RunCounter>, delay: web::Query<Delay>) -> HttpResponse {
    let seq = runs.record();
    actix_rt::time::sleep(Duration::from_millis(delay.delay_ms.unwrap_or(0))).await;
    HttpResponse::Created().json(serde_json::json!({
        "seq": seq,
        "id": uuid::Uuid::new_v4().to_string(),
    }))
}

/// An app with `/orders` under `route`, on `pool`, configured by `configure`.
#[derive(Clone)]
struct Setup {
    pool: RedisPool,
    prefix: String,
    runs: RunCounter,
    route: fn() -> IdempotentRoute,
    configure: fn(Idempotency) -> Idempotency,
    /// When set, the store's `begin`s are counted here.
    begins: Option<RunCounter>,
}

impl Setup {
    fn app(
        self,
    ) -> App<
        impl actix_web::dev::ServiceFactory<
            actix_web::dev::ServiceRequest,
            Config = (),
            Response = actix_web::dev::ServiceResponse<impl actix_web::body::MessageBody>,
            Error = actix_web::Error,
            InitError = (),
        >,
    > {
        let idempotency = match &self.begins {
            Some(begins) => Idempotency::new(WatchedStore::counting(
                RedisStore::new(self.pool.clone()),
                begins.clone(),
            )),
            None => Idempotency::redis(self.pool.clone()),
        };
        App::new()
            .app_data(web::Data::new(self.runs.clone()))
            .wrap((self.configure)(
                idempotency.key_prefix(self.prefix.clone()),
            ))
            .service(
                web::resource("/orders")
                    .wrap((self.route)())
                    .route(web::post().to(create)),
            )
            .service(
                web::resource("/stream")
                    .wrap((self.route)())
                    .route(web::post().to(slow_stream)),
            )
            .service(
                web::resource("/broken")
                    .wrap((self.route)())
                    .route(web::post().to(broken_stream)),
            )
    }
}

/// Answers 200 at once, but the body's only chunk comes after `delay_ms`.
async fn slow_stream(runs: web::Data<RunCounter>, delay: web::Query<Delay>) -> HttpResponse {
    let seq = runs.record();
    let delay = Duration::from_millis(delay.delay_ms.unwrap_or(0));
    HttpResponse::Ok().streaming(futures_util::stream::once(async move {
        actix_rt::time::sleep(delay).await;
        Ok::<_, actix_web::Error>(Bytes::from(format!("run {seq}")))
    }))
}

/// Answers 200, but its body fails after the first chunk (the side effect happened).
async fn broken_stream(runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    let chunks: [Result<Bytes, actix_web::Error>; 2] = [
        Ok(Bytes::from_static(b"part")),
        Err(actix_web::error::ErrorInternalServerError(
            "the stream broke",
        )),
    ];
    HttpResponse::Ok().streaming(futures_util::stream::iter(chunks))
}

fn app_factory(
    pool: RedisPool,
    prefix: String,
    runs: RunCounter,
    route: fn() -> IdempotentRoute,
    configure: fn(Idempotency) -> Idempotency,
) -> Setup {
    Setup {
        pool,
        prefix,
        runs,
        route,
        configure,
        begins: None,
    }
}

fn serve(setup: Setup) -> actix_test::TestServer {
    actix_test::start(move || setup.clone().app())
}

/// A server on `redis` under a prefix of `test`'s, with `configure` applied to its
/// `Idempotency`, and its handler runs.
fn served_on(
    redis: &PrivateRedis,
    test: &str,
    configure: fn(Idempotency) -> Idempotency,
) -> (actix_test::TestServer, RunCounter) {
    let runs = RunCounter::default();
    let server = serve(app_factory(
        RedisStore::pool(&redis.url()).unwrap(),
        unique_prefix(test),
        runs.clone(),
        IdempotentRoute::new,
        configure,
    ));
    (server, runs)
}

/// [`served_on`] a Redis of its own (to stop and restart).
async fn on_a_private_redis(
    test: &str,
    configure: fn(Idempotency) -> Idempotency,
) -> (PrivateRedis, RunCounter, actix_test::TestServer) {
    let redis = PrivateRedis::start().await;
    let (server, runs) = served_on(&redis, test, configure);
    (redis, runs, server)
}

/// Posts `key` to `url` until the answer is not 409 (the key's run still going, or its
/// commit on its way), 20 ms apart: the first other answer.
///
/// # Panics
///
/// After 10 s of 409s: a test never hangs.
async fn post_past_409(client: &awc::Client, url: &str, key: &str) -> Reply {
    for _ in 0..500 {
        let reply = post(client, url, key).await;
        if reply.status != StatusCode::CONFLICT {
            return reply;
        }
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{url} answered 409 for 10 s");
}

struct Reply {
    status: StatusCode,
    replayed: bool,
    retry_after: Option<String>,
    body: Bytes,
}

async fn post(client: &awc::Client, url: &str, key: &str) -> Reply {
    let mut response = client
        .post(url)
        .insert_header(("idempotency-key", key))
        .send_body("{}")
        .await
        .unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    let retry_after = header("retry-after");
    let status = response.status();
    let body = response.body().await.unwrap();
    Reply {
        status,
        replayed,
        retry_after,
        body,
    }
}

#[actix_web::test]
async fn a_handler_slower_than_its_lease_is_never_duplicated() {
    let runs = RunCounter::default();
    let server = serve(app_factory(
        redis_pool().await,
        unique_prefix("lease"),
        runs.clone(),
        || {
            IdempotentRoute::with_policy(
                IdempotencyPolicy::default().lease(Duration::from_millis(900)),
            )
        },
        |i| i,
    ));
    let client = awc::Client::default();
    let url = server.url("/orders?delay_ms=3000");
    let (first, duplicate) = futures_util::future::join(post(&client, &url, "slow"), async {
        // Over two leases after the start: without renewal the key would be free again.
        actix_rt::time::sleep(Duration::from_millis(2200)).await;
        post(&client, &url, "slow").await
    })
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    let retry = post(&client, &url, "slow").await;
    assert!(retry.replayed);
    assert_eq!(retry.body, first.body);
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_streamed_response_slower_than_its_lease_is_never_duplicated() {
    let runs = RunCounter::default();
    let server = serve(app_factory(
        redis_pool().await,
        unique_prefix("slow_stream"),
        runs.clone(),
        || {
            IdempotentRoute::with_policy(
                IdempotencyPolicy::default().lease(Duration::from_millis(900)),
            )
        },
        |i| i,
    ));
    let client = awc::Client::default();
    let url = server.url("/stream?delay_ms=3000");
    let (first, duplicate) = futures_util::future::join(post(&client, &url, "s"), async {
        // The handler returned at once; its body is still being read, over two leases on.
        actix_rt::time::sleep(Duration::from_millis(2200)).await;
        post(&client, &url, "s").await
    })
    .await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, "run 1");
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    let retry = post(&client, &url, "s").await;
    assert!(retry.replayed);
    assert_eq!(retry.body, "run 1");
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_body_that_fails_after_the_handler_ran_is_never_run_again() {
    let runs = RunCounter::default();
    let server = serve(app_factory(
        redis_pool().await,
        unique_prefix("broken_body"),
        runs.clone(),
        IdempotentRoute::new,
        |i| i,
    ));
    let client = awc::Client::default();
    let url = server.url("/broken");
    // The client sees a broken response: the chunk produced before the failure, then the
    // connection closes without the chunked encoding's last chunk (awc would accept such an
    // end at a chunk boundary, so the wire is read as it is).
    let mut first = RawExchange::post(server.addr(), "/broken", &[("Idempotency-Key", "b")]);
    assert_eq!(first.read_head().status, 200);
    assert_eq!(first.read_to_end(), b"4\r\npart\r\n");
    // ...and its retry learns the outcome without charging again: the status and headers,
    // without a body.
    let retry = client
        .post(&url)
        .insert_header(("idempotency-key", "b"))
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::OK);
    assert_eq!(retry.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(
        retry.headers().get("idempotent-body-omitted").unwrap(),
        "true"
    );
    assert_eq!(runs.get(), 1);
}

/// A first request to `/orders?delay_ms=…` on the shared Redis, with `route` and `configure`
/// (the test's own prefix), and a retry with its key sent once the first one's handler
/// runs: both replies, how many times the handler ran, and how many `begin`s the store got.
async fn a_retry_while_the_first_runs(
    test: &str,
    delay_ms: u64,
    route: fn() -> IdempotentRoute,
    configure: fn(Idempotency) -> Idempotency,
) -> (Reply, Reply, usize, usize) {
    let (runs, begins) = (RunCounter::default(), RunCounter::default());
    let server = serve(Setup {
        begins: Some(begins.clone()),
        ..app_factory(
            redis_pool().await,
            unique_prefix(test),
            runs.clone(),
            route,
            configure,
        )
    });
    let client = awc::Client::default();
    let url = server.url(&format!("/orders?delay_ms={delay_ms}"));
    let (first, retry) = futures_util::future::join(post(&client, &url, "w"), async {
        runs.wait_for(1).await;
        post(&client, &url, "w").await
    })
    .await;
    (first, retry, runs.get(), begins.get())
}

/// With waiting for completion (5 s) allowed by `route` or `configure`, a retry sent while
/// the first request runs waits for it and gets its response; the handler runs once.
async fn a_retry_waits_and_gets_the_replay(
    test: &str,
    route: fn() -> IdempotentRoute,
    configure: fn(Idempotency) -> Idempotency,
) {
    let (first, waiting, runs, _) = a_retry_while_the_first_runs(test, 600, route, configure).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(waiting.status, StatusCode::CREATED);
    assert!(waiting.replayed, "the waiting retry got the first response");
    assert_eq!(waiting.body, first.body);
    assert_eq!(runs, 1);
}

/// Waiting for completion, up to 5 s.
fn waiting_5_s() -> IdempotencyPolicy {
    IdempotencyPolicy::default().wait_for_completion(Duration::from_secs(5))
}

#[actix_web::test]
async fn a_retry_can_wait_for_the_first_request_and_replay_it() {
    a_retry_waits_and_gets_the_replay(
        "wait",
        || IdempotentRoute::with_policy(waiting_5_s()),
        |i| i,
    )
    .await;
}

#[actix_web::test]
async fn a_retry_can_wait_under_the_app_default_and_replay_it() {
    a_retry_waits_and_gets_the_replay("wait_app", IdempotentRoute::new, |i| {
        i.policy(waiting_5_s())
    })
    .await;
}

#[actix_web::test]
async fn waiting_is_bounded_then_409() {
    let (first, waiting, runs, begins) =
        a_retry_while_the_first_runs("wait_bound", 1500, IdempotentRoute::new, |i| {
            i.policy(IdempotencyPolicy::default().wait_for_completion(Duration::from_millis(500)))
        })
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(waiting.status, StatusCode::CONFLICT);
    assert_eq!(waiting.retry_after.as_deref(), Some("1"));
    assert_eq!(runs, 1);
    // The first request's `begin`, then the retry's: it asked again while it waited (a
    // retry that did not wait asks once).
    assert!(begins >= 3, "the retry did not wait: {begins} begins");
}

#[actix_web::test]
async fn a_waiting_retry_asks_once_more_at_its_bound() {
    // The retry asks after 20, 40, 80, 160, then 250 ms pauses: at about 800 ms, then not a
    // whole pause later but at its bound (1 s), by when the first request (850 ms) is done.
    let (first, waiting, runs, _) =
        a_retry_while_the_first_runs("wait_to_bound", 850, IdempotentRoute::new, |i| {
            i.policy(IdempotencyPolicy::default().wait_for_completion(Duration::from_secs(1)))
        })
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        waiting.status,
        StatusCode::CREATED,
        "the retry gave up early"
    );
    assert!(waiting.replayed);
    assert_eq!(runs, 1);
}

/// A retry that waits for its key's run on an app that fails open, whose next `begin` fails
/// (a store timeout) while the first request still runs: it knows that the first holds the
/// key, so it gets the 409 it would have had without waiting. It used to run the handler
/// unprotected beside the first (a second charge).
#[actix_web::test]
async fn a_waiting_retry_does_not_fail_open_beside_the_first_request() {
    let store = FaultyStore::default();
    let routes = GatedRoutes::default();
    let (runs, gate) = (routes.work_runs.clone(), routes.gate.clone());
    let server = actix_test::start({
        let store = store.clone();
        move || {
            let waiting = IdempotencyPolicy::default().wait_for_completion(Duration::from_secs(10));
            App::new()
                .wrap(
                    Idempotency::new(store.clone())
                        .on_store_error(FailMode::Open)
                        .policy(waiting)
                        .scope(KeyScope::global()),
                )
                .configure(routes.configure())
        }
    });
    let client = awc::Client::default();
    let url = server.url("/work");
    let first = post(&client, &url, "k");
    let retry = async {
        runs.wait_for(1).await;
        post(&client, &url, "k").await
    };
    let store_fails = async {
        // The first request's `begin`, then the retry's, which finds the key in flight: the
        // retry's next one fails. The first request goes on once it has.
        store.begins.wait_for(2).await;
        store
            .failed_begins
            .store(1, std::sync::atomic::Ordering::SeqCst);
        store.begins.wait_for(3).await;
        gate.open();
    };
    let (first, retry, ()) = futures_util::future::join3(first, retry, store_fails).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "work 1");
    assert_eq!(retry.status, StatusCode::CONFLICT, "{:?}", retry.body);
    assert_eq!(retry.retry_after.as_deref(), Some("1"));
    assert_eq!(
        runs.get(),
        1,
        "the waiting retry ran the handler beside the first"
    );
    let later = post(&client, &url, "k").await;
    assert!(later.replayed);
    assert_eq!(later.body, "work 1");
    assert_eq!(runs.get(), 1);
}

/// A server on `store` whose next `begin` lands late, with a route (`/work`, open) whose ttl
/// (1 s) is shorter than its lease (30 s), failing closed; and the route's run counter.
fn short_ttl_server_with_a_late_begin(store: &FaultyStore) -> (actix_test::TestServer, RunCounter) {
    store
        .late_begins
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let routes = GatedRoutes::default();
    routes.gate.open();
    let runs = routes.work_runs.clone();
    let server = actix_test::start({
        let store = store.clone();
        move || {
            let policy = IdempotencyPolicy::default()
                .ttl(Duration::from_secs(1))
                .lease(Duration::from_secs(30));
            App::new()
                .wrap(
                    Idempotency::new(store.clone())
                        .policy(policy)
                        .scope(KeyScope::global()),
                )
                .configure(routes.configure())
        }
    });
    (server, runs)
}

/// A release that fails (the store unreachable, or slower than its timeout, for a moment) is
/// sent again in the background: once the store answers, the key is free, and a retry runs
/// the handler again. The key used to answer 409 for the rest of its lease (30 s) after the
/// store was back.
#[actix_web::test]
async fn a_failed_release_is_sent_again_so_that_a_retry_runs_once_the_store_answers() {
    let store = FaultyStore::default();
    store
        .lost_releases
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let runs = RunCounter::default();
    let server = actix_test::start({
        let (store, runs) = (store.clone(), runs.clone());
        move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(Idempotency::new(store.clone()).store_timeout(Duration::from_millis(500)))
                .service(web::resource("/fails").wrap(IdempotentRoute::new()).route(
                    web::post().to(|runs: web::Data<RunCounter>| async move {
                        runs.record();
                        HttpResponse::InternalServerError().body("failed")
                    }),
                ))
        }
    });
    let client = awc::Client::default();
    let url = server.url("/fails");
    let first = post(&client, &url, "release-lost").await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    // Its release was lost; the one sent again lands.
    for _ in 0..200 {
        if store.releases.get() >= 2 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        store.releases.get() >= 2,
        "the lost release was not sent again within 2 s"
    );
    let retry = post(&client, &url, "release-lost").await;
    assert_eq!(
        retry.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{:?}",
        retry.body
    );
    assert_eq!(runs.get(), 2);
}

/// A `begin` that timed out and lands later, after its request gave its token up (a store
/// timeout; the marker of the abandoned token refuses it), on a route whose ttl (1 s) is
/// shorter than its lease (30 s): landing 1.5 s later it finds the marker still there and
/// writes nothing, so the retry runs the handler. It used to find the marker gone (kept
/// for the ttl) and lock the key for a lease with no handler running: 409 for 30 s.
#[actix_web::test]
async fn a_late_begin_on_a_route_with_a_ttl_shorter_than_its_lease_locks_nothing() {
    let store = FaultyStore {
        late_by: Duration::from_millis(1_500),
        ..FaultyStore::default()
    };
    let (server, runs) = short_ttl_server_with_a_late_begin(&store);
    let client = awc::Client::default();
    let url = server.url("/work");
    let first = post(&client, &url, "late").await;
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        first.body
    );
    store.late_landed.wait_for(1).await;
    let retry = post(&client, &url, "late").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(runs.get(), 1);
}

/// The same where a retry completes the key before the first request's abandon lands: the
/// abandon finds the completed record (ttl 1 s) and keeps it for the lease, as it would
/// have kept the marker, so the late `begin` (2 s later) finds it, and a retry after that
/// gets the replay. The record used to keep its 1 s, the late `begin` found the key free
/// and locked it for a lease with no handler running: 409 for 30 s.
#[actix_web::test]
async fn a_late_begin_after_a_retry_completed_the_key_locks_nothing_on_a_short_ttl() {
    let store = FaultyStore {
        late_by: Duration::from_millis(2_000),
        abandon_delay: Duration::from_millis(500),
        ..FaultyStore::default()
    };
    let (server, runs) = short_ttl_server_with_a_late_begin(&store);
    let client = awc::Client::default();
    let url = server.url("/work");
    let first = post(&client, &url, "late");
    let retry = async {
        // Sent once the first `begin` has timed out, before its abandon lands.
        store.begins.wait_for(1).await;
        actix_rt::time::sleep(Duration::from_millis(50)).await;
        post(&client, &url, "late").await
    };
    let (first, retry) = futures_util::future::join(first, retry).await;
    assert_eq!(
        first.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        first.body
    );
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(!retry.replayed);
    // The abandon lands (0.5 s), the record's own ttl ends (1 s), the late `begin` lands
    // (2 s).
    store.abandons.wait_for(1).await;
    store.late_landed.wait_for(1).await;
    let later = post(&client, &url, "late").await;
    assert_eq!(later.status, StatusCode::CREATED, "{:?}", later.body);
    assert!(later.replayed, "the record was not kept: {:?}", later.body);
    assert_eq!(later.body, retry.body);
    assert_eq!(runs.get(), 1);
}

/// The same on an app that fails open, for a retry that waited for its key's run: its next
/// `begin` times out (and lands 3.5 s later), so it answers 409 and gives its token up in
/// the background; the first request then fails (500) and releases the key, and the
/// abandon's marker, written on the free key, must still be there when the late `begin`
/// lands. It was kept for the ttl (1 s) on that path, and the key was locked for a lease.
#[actix_web::test]
async fn a_late_begin_of_a_retry_that_waited_locks_nothing_on_a_short_ttl() {
    let store = FaultyStore {
        late_by: Duration::from_millis(3_500),
        ..FaultyStore::default()
    };
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server =
        actix_test::start({
            let (store, runs, gate) = (store.clone(), runs.clone(), gate.clone());
            move || {
                let (runs, gate) = (runs.clone(), gate.clone());
                let policy = IdempotencyPolicy::default()
                    .ttl(Duration::from_secs(1))
                    .lease(Duration::from_secs(30))
                    .wait_for_completion(Duration::from_secs(2));
                App::new()
                    .wrap(
                        Idempotency::new(store.clone())
                            .on_store_error(FailMode::Open)
                            .policy(policy)
                            .scope(KeyScope::global()),
                    )
                    .service(web::resource("/work").wrap(IdempotentRoute::new()).route(
                        web::post().to(move || {
                            let (runs, gate) = (runs.clone(), gate.clone());
                            async move {
                                if runs.record() == 1 {
                                    gate.wait().await;
                                    return HttpResponse::InternalServerError().body("failed");
                                }
                                HttpResponse::Created().body("done")
                            }
                        }),
                    ))
            }
        });
    let client = awc::Client::default();
    let url = server.url("/work");
    let first = post(&client, &url, "k");
    let retry_then_release = async {
        runs.wait_for(1).await;
        let retry = async {
            store.begins.wait_for(2).await;
            store
                .late_begins
                .store(1, std::sync::atomic::Ordering::SeqCst);
        };
        let (waited, ()) = futures_util::future::join(post(&client, &url, "k"), retry).await;
        gate.open();
        waited
    };
    let (first, waited) = futures_util::future::join(first, retry_then_release).await;
    assert_eq!(waited.status, StatusCode::CONFLICT, "{:?}", waited.body);
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    store.late_landed.wait_for(1).await;
    let later = post(&client, &url, "k").await;
    assert_eq!(later.status, StatusCode::CREATED, "{:?}", later.body);
    assert_eq!(runs.get(), 2);
}

/// A `begin` that timed out (503) and lands late, after its token's abandon and after a
/// retry took the key over the abandon's marker and failed (500: the key released): the
/// release puts the marker back, so the late `begin` writes nothing and the next retry runs
/// the handler. The release used to leave the key empty, the late `begin` locked it for a
/// lease with no handler running, and that retry got 409 (for 30 s).
#[actix_web::test]
async fn a_late_begin_after_a_retry_took_the_key_and_failed_locks_nothing() {
    let store = FaultyStore {
        late_by: Duration::from_millis(1_500),
        ..FaultyStore::default()
    };
    store
        .late_begins
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let (runs, gate) = (RunCounter::default(), Gate::default());
    gate.open();
    let server = charging(&store, &runs, &gate, |idempotency| idempotency);
    let client = awc::Client::default();
    let url = server.url("/charge");
    let first = post(&client, &url, "k").await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    store.abandons.wait_for(1).await;
    let failed = post(&client, &url, "k").await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    store.late_landed.wait_for(1).await;
    let retry = post(&client, &url, "k").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(retry.body, "run 2");
    assert_eq!(runs.get(), 2);
}

/// A faulty memory store whose first `begin` lands but does not answer (a store timeout).
fn first_begin_lands_unanswered() -> FaultyStore {
    let store = FaultyStore::default();
    store
        .landed_failed_begins
        .store(1, std::sync::atomic::Ordering::SeqCst);
    store
}

/// An app that fails open, whose first `begin` landed but did not answer (a store timeout,
/// the store healthy again at once): the handler runs unprotected under the token that
/// `begin` sent. A duplicate during the run meets that `begin`'s in-flight record and gets
/// 409, and once the run is done a retry gets its replay. The token used to be abandoned at
/// once, so the duplicate ran the handler beside the first (a second charge), and a retry
/// after the response ran it again.
#[actix_web::test]
async fn fail_open_after_a_begin_that_landed_runs_the_handler_once() {
    use futures_util::future::{Either, select};
    let store = first_begin_lands_unanswered();
    let routes = GatedRoutes::default();
    let (runs, gate) = (routes.work_runs.clone(), routes.gate.clone());
    let server = actix_test::start({
        let store = store.clone();
        move || {
            App::new()
                .wrap(
                    Idempotency::new(store.clone())
                        .on_store_error(FailMode::Open)
                        .scope(KeyScope::global()),
                )
                .configure(routes.configure())
        }
    });
    let client = awc::Client::default();
    let url = server.url("/work");
    let first = post(&client, &url, "k");
    let duplicate = async {
        runs.wait_for(1).await;
        // Room for an abandon of the first `begin`'s token (sent 50 ms after it failed) to
        // land, as it did before the fix.
        actix_rt::time::sleep(Duration::from_millis(300)).await;
        let duplicate = std::pin::pin!(post(&client, &url, "k"));
        let second_run = std::pin::pin!(runs.wait_for(2));
        let duplicate = match select(duplicate, second_run).await {
            Either::Left((reply, _)) => reply,
            Either::Right(((), duplicate)) => {
                gate.open();
                duplicate.await
            }
        };
        gate.open();
        duplicate
    };
    let (first, duplicate) = futures_util::future::join(first, duplicate).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body, "work 1");
    assert_eq!(
        duplicate.status,
        StatusCode::CONFLICT,
        "the duplicate ran the handler beside the fail-open run: {:?}",
        duplicate.body
    );
    // The run's response is committed right after it went out: until then, 409.
    let retry = post_past_409(&client, &url, "k").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(retry.replayed, "the retry ran the handler again");
    assert_eq!(retry.body, "work 1");
    assert_eq!(runs.get(), 1);
}

/// An app that fails open, whose `begin` landed but did not answer: the client resets the
/// connection while the handler runs under that `begin`'s token. The run goes on to its
/// end, as a keyed run does, and its response is committed, so the retry gets the replay.
/// The run used to be dropped with the request's future, cut short, and the retry ran the
/// handler again.
#[actix_web::test]
async fn a_fail_open_run_whose_client_left_runs_to_its_end_and_is_replayed() {
    let store = first_begin_lands_unanswered();
    let routes = GatedRoutes::default();
    let (runs, gate) = (routes.work_runs.clone(), routes.gate.clone());
    let server = actix_test::start({
        let store = store.clone();
        move || {
            App::new()
                .wrap(
                    Idempotency::new(store.clone())
                        .on_store_error(FailMode::Open)
                        .scope(KeyScope::global()),
                )
                .configure(routes.configure())
        }
    });
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(
        socket,
        "POST /work HTTP/1.1\r\nHost: test\r\nIdempotency-Key: gone\r\n\
         Content-Length: 2\r\n\r\n{{}}"
    )
    .unwrap();
    runs.wait_for(1).await;
    reset(socket);
    // Room for Actix to see the reset and drop the request's future before the run ends.
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    gate.open();

    let client = awc::Client::default();
    let url = server.url("/work");
    // The run's response is committed right after it ends: until then, 409.
    let retry = post_past_409(&client, &url, "gone").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert!(
        retry.replayed,
        "the retry ran the handler again: {:?}",
        retry.body
    );
    assert_eq!(retry.body, "work 1");
    assert_eq!(runs.get(), 1);
}

/// Fails its first run (500, once the test opens the gate) and answers 201 `run N` after
/// 300 ms on every later one.
async fn fails_first(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    let seq = runs.record();
    if seq == 1 {
        gate.wait().await;
        return HttpResponse::InternalServerError().body("run 1 failed");
    }
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    HttpResponse::Created().body(format!("run {seq}"))
}

/// An app on `store` (global key scope, configured by `configure`) whose `POST /charge`
/// runs [`fails_first`] with `runs` and `gate`.
fn charging(
    store: &FaultyStore,
    runs: &RunCounter,
    gate: &Gate,
    configure: fn(Idempotency) -> Idempotency,
) -> actix_test::TestServer {
    let (store, runs, gate) = (store.clone(), runs.clone(), gate.clone());
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .app_data(web::Data::new(gate.clone()))
            .wrap(configure(
                Idempotency::new(store.clone()).scope(KeyScope::global()),
            ))
            .service(
                web::resource("/charge")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(fails_first)),
            )
    })
}

/// Three retries wait for the first request's run, which answers 500 and so releases the
/// key (DESIGN §5: the next try may run): one of them takes the key and runs the handler,
/// the other two wait for that run and replay it. Never two runs at once.
#[actix_web::test]
async fn a_key_released_while_retries_wait_runs_for_one_of_them() {
    let store = FaultyStore::default();
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = charging(&store, &runs, &gate, |idempotency| {
        idempotency
            .policy(IdempotencyPolicy::default().wait_for_completion(Duration::from_secs(10)))
    });
    let client = awc::Client::default();
    let url = server.url("/charge");
    let first = post(&client, &url, "k");
    let retries = async {
        runs.wait_for(1).await;
        futures_util::future::join3(
            post(&client, &url, "k"),
            post(&client, &url, "k"),
            post(&client, &url, "k"),
        )
        .await
    };
    let fail_first = async {
        // The first request's `begin` and one of each retry, which found the key in flight.
        store.begins.wait_for(4).await;
        gate.open();
    };
    let (first, (a, b, c), ()) = futures_util::future::join3(first, retries, fail_first).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    let retries = [a, b, c];
    for retry in &retries {
        assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
        assert_eq!(retry.body, "run 2");
    }
    let replayed = retries.iter().filter(|retry| retry.replayed).count();
    assert_eq!(replayed, 2, "one retry ran, the others replayed its run");
    assert_eq!(runs.get(), 2);
}

/// Posts key `k` to `url`, which answers 500, and again as soon as that arrives: the retry.
async fn retried_right_after_a_500(url: &str) -> Reply {
    let client = awc::Client::default();
    let first = post(&client, url, "k").await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    post(&client, url, "k").await
}

/// An app that fails open, whose `begin` landed but did not answer: the handler runs under
/// that `begin`'s token and answers 500, so its key is given back, and a retry sent as soon
/// as the 500 arrives runs the handler again (DESIGN §5), as after a 500 whose `begin`
/// answered. The token used to be abandoned only in the background, 50 ms after the
/// response went out: the retry got 409 "still being processed" with nothing running.
#[actix_web::test]
async fn a_retry_right_after_a_fail_open_run_that_answered_500_runs_the_handler() {
    let store = first_begin_lands_unanswered();
    let (runs, gate) = (RunCounter::default(), Gate::default());
    gate.open();
    let server = charging(&store, &runs, &gate, |idempotency| {
        idempotency.on_store_error(FailMode::Open)
    });
    let retry = retried_right_after_a_500(&server.url("/charge")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(retry.body, "run 2");
    assert_eq!(runs.get(), 2);
}

/// How a client leaves while its handler runs.
#[derive(Clone, Copy, Debug)]
enum Leaving {
    /// It closes the connection (FIN): Actix lets the request's future run to its end.
    Closes,
    /// It resets the connection (RST): Actix drops the request's future, so the handler's
    /// run goes on on a task of its own.
    Resets,
}

/// A client sends a keyed request to a slow handler and leaves while it runs: the run
/// finishes and commits, so its retry gets the replay and the handler ran once.
async fn a_client_that_leaves_gets_the_replay_on_retry(leaving: Leaving) {
    let runs = RunCounter::default();
    let server = serve(app_factory(
        redis_pool().await,
        unique_prefix(&format!("leaving-{leaving:?}")),
        runs.clone(),
        IdempotentRoute::new,
        |i| i,
    ));
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(
        socket,
        "POST /orders?delay_ms=600 HTTP/1.1\r\nHost: test\r\nIdempotency-Key: gone\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
    )
    .unwrap();
    runs.wait_for(1).await;
    match leaving {
        Leaving::Closes => {
            socket.shutdown(std::net::Shutdown::Both).unwrap();
            drop(socket);
        }
        Leaving::Resets => reset(socket),
    }

    // The handler keeps running after the disconnect, and commits: until then, 409.
    let client = awc::Client::default();
    let retry = post_past_409(&client, &server.url("/orders?delay_ms=600"), "gone").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed,
        "the disconnected request's response was committed"
    );
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_client_that_disconnects_gets_the_replay_on_retry() {
    a_client_that_leaves_gets_the_replay_on_retry(Leaving::Closes).await;
}

#[actix_web::test]
async fn a_client_that_resets_the_connection_gets_the_replay_on_retry() {
    a_client_that_leaves_gets_the_replay_on_retry(Leaving::Resets).await;
}

/// A server on a memory store of its own, with one route: `handler` at `path`, protected
/// under `policy`, its runs counted by `runs`.
fn on_memory<F, Args>(
    runs: &RunCounter,
    path: &'static str,
    policy: IdempotencyPolicy,
    handler: F,
) -> actix_test::TestServer
where
    F: actix_web::Handler<Args> + Send + Sync,
    Args: actix_web::FromRequest + 'static,
    F::Output: actix_web::Responder + 'static,
{
    let runs = runs.clone();
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .wrap(Idempotency::new(idempotency_actix::MemoryStore::new()).scope(KeyScope::global()))
            .service(
                web::resource(path)
                    .wrap(IdempotentRoute::with_policy(policy.clone()))
                    .route(web::post().to(handler.clone())),
            )
    })
}

/// A body whose `size` panics from its second call on: the first is Actix's, as the
/// handler's response is built (inside the handler's own catch), the second the
/// middleware's, after the handler ran.
struct SizePanicsOnSecondCall(std::cell::Cell<u32>);

impl actix_web::body::MessageBody for SizePanicsOnSecondCall {
    type Error = std::convert::Infallible;

    fn size(&self) -> actix_web::body::BodySize {
        let calls = self.0.get() + 1;
        self.0.set(calls);
        assert!(calls < 2, "a response body's size panicked on purpose");
        actix_web::body::BodySize::Stream
    }

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Bytes, Self::Error>>> {
        std::task::Poll::Ready(None)
    }
}

async fn slow_with_a_panicking_body(
    runs: web::Data<RunCounter>,
) -> HttpResponse<SizePanicsOnSecondCall> {
    runs.record();
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    HttpResponse::Ok()
        .message_body(SizePanicsOnSecondCall(std::cell::Cell::new(0)))
        .unwrap()
}

#[actix_web::test]
async fn a_run_whose_client_left_and_that_panics_after_the_handler_releases_the_key() {
    let runs = RunCounter::default();
    let server = on_memory(
        &runs,
        "/panicky",
        IdempotencyPolicy::default(),
        slow_with_a_panicking_body,
    );
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(
        socket,
        "POST /panicky HTTP/1.1\r\nHost: test\r\nIdempotency-Key: gone\r\n\
         Content-Length: 2\r\n\r\n{{}}"
    )
    .unwrap();
    runs.wait_for(1).await;
    reset(socket);

    // The run goes on without its client and panics once the handler is done: nothing was
    // committed, so the key is released, as when the client stays (not locked for a lease).
    actix_rt::time::sleep(Duration::from_millis(600)).await;
    let client = awc::Client::default();
    let retry = post(&client, &server.url("/panicky"), "gone").await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(runs.get(), 2);
}

/// An app that fails open, on a store whose first `begin` lands but does not answer, whose
/// `POST /panicky` runs [`slow_with_a_panicking_body`] with `runs`.
fn panicking_after_an_unanswered_begin(runs: &RunCounter) -> actix_test::TestServer {
    let (runs, store) = (runs.clone(), first_begin_lands_unanswered());
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .wrap(
                Idempotency::new(store.clone())
                    .on_store_error(FailMode::Open)
                    .scope(KeyScope::global()),
            )
            .service(
                web::resource("/panicky")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(slow_with_a_panicking_body)),
            )
    })
}

/// The same, on an app that fails open after a `begin` that landed but did not answer: the
/// run under that `begin`'s token goes on without its client and panics once the handler is
/// done. Its token is abandoned, as when the client stays, so the retry is not locked out
/// (409) for a lease by a record no one renews, commits or gives back.
#[actix_web::test]
async fn a_fail_open_run_whose_client_left_and_that_panics_after_the_handler_frees_the_key() {
    let runs = RunCounter::default();
    let server = panicking_after_an_unanswered_begin(&runs);
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(
        socket,
        "POST /panicky HTTP/1.1\r\nHost: test\r\nIdempotency-Key: gone\r\n\
         Content-Length: 2\r\n\r\n{{}}"
    )
    .unwrap();
    runs.wait_for(1).await;
    reset(socket);

    // The run ends 300 ms in and its token is abandoned in the background: retry while the
    // key is locked, for 5 s at most (locked for its whole 30 s lease without the fix).
    let client = awc::Client::default();
    let mut retry = post(&client, &server.url("/panicky"), "gone").await;
    for _ in 0..50 {
        if retry.status != StatusCode::CONFLICT {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(100)).await;
        retry = post(&client, &server.url("/panicky"), "gone").await;
    }
    assert_ne!(
        retry.status,
        StatusCode::CONFLICT,
        "the key stayed locked by the panicked fail-open run"
    );
    assert_eq!(runs.get(), 2);
}

/// The same, with the client there: the run under the unanswered `begin`'s token panics
/// once the handler is done and the client gets 500; a retry sent as soon as it arrives is
/// not refused with 409 "still being processed" (nothing runs), but runs the handler again,
/// as after a panic whose `begin` answered. The token used to be abandoned only 50 ms
/// after the 500 went out.
#[actix_web::test]
async fn a_retry_right_after_a_fail_open_run_that_panicked_after_the_handler_runs_it_again() {
    let runs = RunCounter::default();
    let server = panicking_after_an_unanswered_begin(&runs);
    let retry = retried_right_after_a_500(&server.url("/panicky")).await;
    assert_ne!(retry.status, StatusCode::CONFLICT, "{:?}", retry.body);
    assert_eq!(runs.get(), 2);
}

/// A streamed body (one chunk, then its end) whose `Drop` panics, as a body that checks an
/// invariant as it is dropped may.
struct DropPanics {
    sent: bool,
}

impl actix_web::body::MessageBody for DropPanics {
    type Error = std::convert::Infallible;

    fn size(&self) -> actix_web::body::BodySize {
        actix_web::body::BodySize::Stream
    }

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Bytes, Self::Error>>> {
        let sent = std::mem::replace(&mut self.get_mut().sent, true);
        std::task::Poll::Ready((!sent).then(|| Ok(Bytes::from_static(b"receipt"))))
    }
}

impl Drop for DropPanics {
    fn drop(&mut self) {
        assert!(
            std::thread::panicking(),
            "a response body's drop panicked on purpose"
        );
    }
}

async fn streamed_with_a_panicking_drop(runs: web::Data<RunCounter>) -> HttpResponse<DropPanics> {
    runs.record();
    HttpResponse::Ok()
        .message_body(DropPanics { sent: false })
        .unwrap()
}

/// A streamed body whose `Drop` panics once it has ended: the panic is caught as one in its
/// `poll_next` is, the record completes and its retries are replayed. It used to unwind out
/// of the body into Actix, and the record waited for an end that never came: each task
/// that read on for it spawned the next as it was dropped, renewing the lease, so the key
/// answered 409 for as long as the process ran (its worker busy), and the process aborted
/// with a stack overflow at its stop.
#[actix_web::test]
async fn a_streamed_body_whose_drop_panics_completes_its_record() {
    let runs = RunCounter::default();
    let lease = IdempotencyPolicy::default().lease(Duration::from_millis(500));
    let server = on_memory(&runs, "/drop-panics", lease, streamed_with_a_panicking_drop);
    let first = || RawExchange::post(server.addr(), "/drop-panics", &[("Idempotency-Key", "d")]);
    let sent = first().read_to_end();

    // Retried for up to 2 s, well past the 500 ms lease: the record is complete, not in
    // flight (nor free for a second run).
    let mut retry = first().read_to_end();
    for _ in 0..200 {
        if !retry.starts_with(b"HTTP/1.1 409") {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
        retry = first().read_to_end();
    }
    let retry = String::from_utf8_lossy(&retry);
    assert!(retry.starts_with("HTTP/1.1 200 OK\r\n"), "{retry}");
    assert!(retry.contains("idempotent-replayed: true\r\n"), "{retry}");
    assert!(retry.ends_with("\r\n\r\nreceipt"), "{retry}");
    assert_eq!(runs.get(), 1);
    // The first client had the whole body, its last chunk included.
    let sent = String::from_utf8_lossy(&sent);
    assert!(
        sent.ends_with("\r\n\r\n7\r\nreceipt\r\n0\r\n\r\n"),
        "{sent}"
    );
}

#[actix_web::test]
async fn redis_stopped_is_503_fail_closed_and_the_app_recovers_when_it_returns() {
    let (mut redis, runs, server) =
        on_a_private_redis("stopped", |i| i.store_timeout(Duration::from_millis(500))).await;
    let client = awc::Client::default();
    let url = server.url("/orders");
    assert_eq!(
        post(&client, &url, "before").await.status,
        StatusCode::CREATED
    );

    // The client's own timeout (5 s) bounds the wait: an answer is a 503, never a hang.
    redis.stop();
    let down = post(&client, &url, "during").await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(down.retry_after.as_deref(), Some("1"));
    assert_eq!(runs.get(), 1, "fail-closed: the handler did not run");

    // Back (empty): the same app serves again, without a restart.
    redis.restart().await;
    let back = post(&client, &url, "after").await;
    assert_eq!(back.status, StatusCode::CREATED);
    let retry = post(&client, &url, "after").await;
    assert!(retry.replayed);
    assert_eq!(runs.get(), 2);
}

#[actix_web::test]
async fn redis_stopped_runs_unprotected_fail_open() {
    let (mut redis, runs, server) = on_a_private_redis("fail_open", |i| {
        i.store_timeout(Duration::from_millis(500))
            .on_store_error(FailMode::Open)
    })
    .await;
    redis.stop();
    let client = awc::Client::default();
    let reply = post(&client, &server.url("/orders"), "open").await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert!(!reply.replayed);
    assert_eq!(runs.get(), 1);
}

/// While no connection to Redis can be had, a keyed request's `begin` never leaves the
/// process: it holds nothing, so nothing is abandoned for it (failing closed) and no
/// fail-open run goes on under its token. Each such request used to leave a task retrying
/// an abandon for a lease (thousands a second in an outage, as the refusals take
/// microseconds), and those wrote a marker per request once Redis was back.
#[actix_web::test]
async fn requests_refused_while_redis_is_down_leave_it_nothing_to_write_when_it_returns() {
    let closed: fn(Idempotency) -> Idempotency = |i| i.store_timeout(Duration::from_millis(500));
    let open: fn(Idempotency) -> Idempotency = |i| {
        i.store_timeout(Duration::from_millis(500))
            .on_store_error(FailMode::Open)
    };
    for (configure, answered) in [
        (closed, StatusCode::SERVICE_UNAVAILABLE),
        (open, StatusCode::CREATED),
    ] {
        let (mut redis, runs, server) = on_a_private_redis("down_nothing_sent", configure).await;
        let client = awc::Client::default();
        let url = server.url("/orders");
        assert_eq!(
            post(&client, &url, "before").await.status,
            StatusCode::CREATED
        );

        redis.stop();
        for n in 0..10 {
            let reply = post(&client, &url, &format!("down-{n}")).await;
            assert_eq!(reply.status, answered);
        }
        let ran_while_down = runs.get() - 1;

        // Back, empty (it keeps nothing on disk). An abandon retries at most a second apart:
        // after 2.5 s every one still pending has landed.
        redis.restart().await;
        actix_rt::time::sleep(Duration::from_millis(2500)).await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut redis.connection().await)
            .await
            .unwrap();
        // The first request may have been written to the socket before the connection knew
        // Redis had gone (then it may have landed, and its token is rightly abandoned): one
        // marker at most, where every request left one before.
        assert!(keys.len() <= 1, "written after the outage: {keys:?}");
        assert_eq!(
            ran_while_down,
            if answered == StatusCode::CREATED {
                10
            } else {
                0
            }
        );
        // And the app serves again.
        assert_eq!(
            post(&client, &url, "after").await.status,
            StatusCode::CREATED
        );
    }
}

#[actix_web::test]
async fn redis_restarted_mid_request_still_delivers_the_response() {
    let (mut redis, runs, server) = on_a_private_redis("restart_mid", |i| {
        i.store_timeout(Duration::from_millis(500))
    })
    .await;
    let client = awc::Client::default();
    let url = server.url("/orders?delay_ms=800");
    let (reply, ()) = futures_util::future::join(post(&client, &url, "mid"), async {
        runs.wait_for(1).await;
        redis.restart().await;
    })
    .await;
    // The record vanished with the restart; the commit is refused, the response is not lost.
    assert_eq!(reply.status, StatusCode::CREATED);
    let body: serde_json::Value = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(body["seq"], 1);
    // The app kept working through the restart.
    assert_eq!(
        post(&client, &server.url("/orders"), "next").await.status,
        StatusCode::CREATED
    );
}

/// Sends `command` to the Redis at `url` from a connection of its own; its reply.
async fn run_command(url: String, command: &[&str]) -> redis::RedisResult<redis::Value> {
    let client = redis::Client::open(url)?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    let mut cmd = redis::cmd(command[0]);
    for arg in &command[1..] {
        cmd.arg(*arg);
    }
    cmd.query_async(&mut connection).await
}

/// Sends a command to `redis` from its own connection, without waiting for the reply.
fn stall(redis: &PrivateRedis, command: &'static [&'static str]) {
    let url = redis.url();
    actix_rt::spawn(async move {
        let _ = run_command(url, command).await;
    });
}

/// Waits until `redis` holds a command of a client that a pause stopped (`CLIENT LIST` shows
/// that client blocked, flag `b`).
///
/// # Panics
///
/// After 10 s without one.
async fn wait_until_a_command_is_held(redis: &PrivateRedis) {
    let mut connection = redis.connection().await;
    for _ in 0..1_000 {
        let clients: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut connection)
            .await
            .unwrap();
        let blocked = clients.lines().any(|client| {
            client
                .split(' ')
                .filter_map(|field| field.strip_prefix("flags="))
                .any(|flags| flags.contains('b'))
        });
        if blocked {
            return;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("Redis held no command in 10 s");
}

/// `/orders` on `redis`, configured by `configure`, after a first request that opened the
/// store's connection: the server, its URL and the handler's runs.
async fn warmed_up(
    redis: &PrivateRedis,
    test: &str,
    configure: fn(Idempotency) -> Idempotency,
) -> (actix_test::TestServer, String, RunCounter) {
    let (server, runs) = served_on(redis, test, configure);
    let url = server.url("/orders");
    assert_eq!(
        post(&awc::Client::default(), &url, "warm").await.status,
        StatusCode::CREATED
    );
    (server, url, runs)
}

/// A stall of Redis (2 s) far longer than the store timeout (300 ms) is a 503. The stall
/// ends well within the client's own timeout (5 s): a request that waited it out would get
/// 201, so the 503 alone shows that the store timeout cut it short, and the client's timeout
/// bounds a hang.
async fn assert_stall_is_bounded(command: &'static [&'static str], test: &str) {
    let redis = PrivateRedis::start().await;
    let (_server, url, runs) = warmed_up(&redis, test, |i| {
        i.store_timeout(Duration::from_millis(300))
    })
    .await;
    let client = awc::Client::default();

    stall(&redis, command);
    // Time for the stalling command to reach Redis, even on a loaded machine (one that came
    // later would let the request through: 201, and the test fails).
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    let stalled = post(&client, &url, "stalled").await;
    assert_eq!(
        stalled.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{command:?}"
    );
    assert_eq!(runs.get(), 1);

    // After the stall (2 s) the app serves again by itself.
    actix_rt::time::sleep(Duration::from_millis(2000)).await;
    // The `begin` that timed out ran when Redis woke up; the engine released that orphan
    // lock in the background, so the client's retry with the same key runs now instead of
    // meeting 409 for a whole lease.
    let retried = post(&client, &url, "stalled").await;
    assert_eq!(retried.status, StatusCode::CREATED, "{command:?}");
    assert!(!retried.replayed);
    assert_eq!(runs.get(), 2);
}

#[actix_web::test]
async fn debug_sleep_is_503_within_the_store_timeout() {
    assert_stall_is_bounded(&["DEBUG", "SLEEP", "2"], "debug_sleep").await;
}

#[actix_web::test]
async fn client_pause_is_503_within_the_store_timeout() {
    assert_stall_is_bounded(&["CLIENT", "PAUSE", "2000", "ALL"], "client_pause").await;
}

#[actix_web::test]
async fn a_stall_shorter_than_the_store_timeout_is_waited_out() {
    // The store timeout is the one bound on a Redis reply: redis-rs's own default (500 ms)
    // must not cut a longer one short and answer 503 while Redis would still answer in time.
    let redis = PrivateRedis::start().await;
    let (_server, url, runs) = warmed_up(&redis, "stall_within_timeout", |i| {
        i.store_timeout(Duration::from_secs(5))
    })
    .await;
    let client = awc::Client::default();

    // Writes pause, so the request's `begin` waits in Redis (which still answers CLIENT LIST
    // and CLIENT UNPAUSE); once it is seen waiting, it waits 1 s more, twice redis-rs's
    // default bound, before the pause ends.
    run_command(redis.url(), &["CLIENT", "PAUSE", "30000", "WRITE"])
        .await
        .unwrap();
    let waiting = actix_rt::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { post(&client, &url, "waited").await }
    });
    wait_until_a_command_is_held(&redis).await;
    actix_rt::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        runs.get(),
        1,
        "the handler ran before its `begin` was answered"
    );
    run_command(redis.url(), &["CLIENT", "UNPAUSE"])
        .await
        .unwrap();
    let waited = waiting.await.unwrap();
    assert_eq!(waited.status, StatusCode::CREATED);
    assert_eq!(runs.get(), 2);
    let replayed = post(&client, &url, "waited").await;
    assert!(replayed.replayed);
    assert_eq!(runs.get(), 2);
}

#[actix_web::test]
async fn the_store_never_waits_for_a_pool_slot() {
    // The store shares one multiplexed connection per worker instead of checking one out per
    // command: an app that holds every slot of the pool does not starve it.
    let redis = PrivateRedis::start().await;
    let pool: RedisPool = bb8::Pool::builder()
        .max_size(1)
        .test_on_check_out(false)
        .build(bb8_redis::RedisConnectionManager::new(redis.url()).unwrap())
        .await
        .unwrap()
        .into();
    let runs = RunCounter::default();
    let server = serve(app_factory(
        pool.clone(),
        unique_prefix("exhausted"),
        runs.clone(),
        IdempotentRoute::new,
        |i| i.store_timeout(Duration::from_millis(300)),
    ));
    let client = awc::Client::default();
    let url = server.url("/orders");
    let held = pool.get().await.unwrap();
    assert_eq!(post(&client, &url, "fed").await.status, StatusCode::CREATED);
    let replay = post(&client, &url, "fed").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed);
    drop(held);
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn graceful_shutdown_lets_in_flight_requests_finish_and_commit() {
    let pool = redis_pool().await;
    let prefix = unique_prefix("shutdown");
    let runs = RunCounter::default();
    let factory = app_factory(
        pool.clone(),
        prefix.clone(),
        runs.clone(),
        IdempotentRoute::new,
        |i| i,
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let setup = factory.clone();
    let server = HttpServer::new(move || setup.clone().app())
        .workers(1)
        .shutdown_timeout(10)
        .disable_signals()
        .listen(listener)
        .unwrap()
        .run();
    let handle = server.handle();
    let running = actix_rt::spawn(server);

    let client = awc::Client::default();
    let url = format!("http://{addr}/orders?delay_ms=800");
    let (reply, ()) = futures_util::future::join(post(&client, &url, "stopping"), async {
        runs.wait_for(1).await;
        handle.stop(true).await;
    })
    .await;
    assert_eq!(
        reply.status,
        StatusCode::CREATED,
        "the in-flight request finished"
    );
    running.await.unwrap().unwrap();

    // Another instance on the same Redis replays it: the commit happened before shutdown.
    let next = serve(factory);
    let retry = post(&client, &next.url("/orders?delay_ms=800"), "stopping").await;
    assert!(retry.replayed);
    assert_eq!(retry.body, reply.body);
    assert_eq!(runs.get(), 1);
}

/// A store that counts its `begin`s (once each has landed) and `abandon`s, and whose
/// `begin`s land only once its gate is open, even when the caller gave up waiting: a
/// `begin` that timed out and runs late, after the engine abandoned its token.
#[derive(Clone)]
struct WatchedStore<S> {
    inner: S,
    gate: Gate,
    abandons: RunCounter,
    landed: RunCounter,
}

impl<S> WatchedStore<S> {
    /// `inner` with its gate open: every `begin` lands at once and is counted in `begins`.
    fn counting(inner: S, begins: RunCounter) -> Self {
        let gate = Gate::default();
        gate.open();
        Self {
            inner,
            gate,
            abandons: RunCounter::default(),
            landed: begins,
        }
    }
}

impl<S: IdempotencyStore + Clone> IdempotencyStore for WatchedStore<S> {
    async fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<BeginOutcome, StoreError> {
        let (store, gate, landed) = (self.inner.clone(), self.gate.clone(), self.landed.clone());
        let (key, fingerprint, token) = (key.clone(), *fingerprint, *token);
        // On a task of its own: it lands even if the caller stops waiting.
        actix_rt::spawn(async move {
            gate.wait().await;
            let begun = store.begin(&key, &fingerprint, &token, lease).await;
            landed.record();
            begun
        })
        .await
        .unwrap()
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew(key, token, lease).await
    }

    async fn commit(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        self.inner
            .commit(key, fingerprint, token, response, ttl)
            .await
    }

    async fn release(&self, key: &StorageKey, token: &LeaseToken) -> Result<bool, StoreError> {
        self.inner.release(key, token).await
    }

    async fn abandon(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        remember_for: Duration,
    ) -> Result<bool, StoreError> {
        let abandoned = self.inner.abandon(key, token, remember_for).await;
        self.abandons.record();
        abandoned
    }
}

/// A `begin` times out (503); the engine abandons its token; only then does the `begin`
/// land. The retry that follows runs at once: never a 409, and the handler runs once.
async fn a_begin_that_lands_after_it_was_abandoned_never_blocks_the_key(
    inner: impl IdempotencyStore + Clone + Send,
) {
    let runs = RunCounter::default();
    let store = WatchedStore {
        inner,
        gate: Gate::default(),
        abandons: RunCounter::default(),
        landed: RunCounter::default(),
    };
    let prefix = unique_prefix("late-begin");
    let server = {
        let (runs, store) = (runs.clone(), store.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(
                    Idempotency::new(store.clone())
                        .key_prefix(&prefix)
                        .store_timeout(Duration::from_millis(200))
                        .scope(KeyScope::global()),
                )
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(Duration::from_secs(120)),
                        ))
                        .route(web::post().to(create)),
                )
        })
    };
    let client = awc::Client::default();
    let url = server.url("/orders");

    let timed_out = post(&client, &url, "late").await;
    assert_eq!(timed_out.status, StatusCode::SERVICE_UNAVAILABLE);
    // The engine abandons the token first; only then does the `begin` land.
    store.abandons.wait_for(1).await;
    store.gate.open();
    store.landed.wait_for(1).await;

    let retry = post(&client, &url, "late").await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the late begin blocked the key"
    );
    assert_eq!(runs.get(), 1);
    let replay = post(&client, &url, "late").await;
    assert!(replay.replayed);
    assert_eq!(replay.body, retry.body);
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_begin_that_lands_after_it_was_abandoned_never_blocks_the_key_in_memory() {
    a_begin_that_lands_after_it_was_abandoned_never_blocks_the_key(
        idempotency_actix::MemoryStore::new(),
    )
    .await;
}

#[actix_web::test]
async fn a_begin_that_lands_after_it_was_abandoned_never_blocks_the_key_on_redis() {
    a_begin_that_lands_after_it_was_abandoned_never_blocks_the_key(RedisStore::new(
        redis_pool().await,
    ))
    .await;
}

async fn panics() -> HttpResponse {
    panic!("a handler panicked on purpose");
}

/// Failing open where the store refused the `begin` (full: nothing written, no token to run
/// under), the handler still runs as every keyed request's run does: a panic is answered
/// with the 500 `handler-panicked` problem, not a dropped connection, and a client that
/// resets its connection does not cut the handler short (it used to be called bare, outside
/// both).
#[actix_web::test]
async fn failing_open_on_a_full_store_answers_a_panic_and_outlasts_its_client() {
    let (started, finished) = (RunCounter::default(), RunCounter::default());
    // Full for every `begin` of the test.
    let full = FaultyStore::default();
    full.refused_begins
        .store(u32::MAX, std::sync::atomic::Ordering::SeqCst);
    let server = {
        let (started, finished) = (started.clone(), finished.clone());
        actix_test::start(move || {
            let (started, finished) = (started.clone(), finished.clone());
            App::new()
                .wrap(
                    Idempotency::new(full.clone())
                        .scope(KeyScope::global())
                        .on_store_error(FailMode::Open)
                        .protect_methods([actix_web::http::Method::POST]),
                )
                .route("/panics", web::post().to(panics))
                .route(
                    "/slow",
                    web::post().to(move || {
                        started.record();
                        let finished = finished.clone();
                        async move {
                            actix_rt::time::sleep(Duration::from_millis(300)).await;
                            finished.record();
                            HttpResponse::Created().finish()
                        }
                    }),
                )
        })
    };

    let mut panicked = awc::Client::default()
        .post(server.url("/panics"))
        .insert_header(("idempotency-key", "panics"))
        .send_body("{}")
        .await
        .expect("an answer, not a dropped connection");
    assert_eq!(panicked.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let problem: serde_json::Value =
        serde_json::from_slice(&panicked.body().await.unwrap()).unwrap();
    assert_eq!(
        problem["type"],
        "tag:idempotency-actix,2026:handler-panicked"
    );

    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(
        socket,
        "POST /slow HTTP/1.1\r\nHost: test\r\nIdempotency-Key: leaves\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
    )
    .unwrap();
    started.wait_for(1).await;
    reset(socket);
    // Cut short when its client left, it would never finish (a panic after 10 s).
    finished.wait_for(1).await;
}
