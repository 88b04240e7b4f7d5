//! Lease renewals on the PostgreSQL store while its pool is saturated, by a retry storm of
//! duplicates whose `begin`s are slow writes or by transactions holding every pooled
//! connection: renewals must still reach the database, or leases lapse under running
//! handlers and duplicates run them a second time. Real HTTP, a database of the test's own on the server at `DATABASE_URL`
//! (default postgres://postgres@127.0.0.1:5432/postgres).

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use actix_web::{App, HttpRequest, HttpResponse, web};
use bb8_postgres::PostgresConnectionManager;
use idempotency_actix::{
    BeginOutcome, Fingerprint, Idempotency, IdempotencyKey, IdempotencyPolicy, IdempotencyStore,
    IdempotentRoute, IdempotentTransaction, LeaseToken, PostgresPool, PostgresStore, StorageKey,
};
use idempotency_actix_tests::{Gate, MovableAddress, Reply, RunCounter, TestDatabase};
use tokio_postgres::NoTls;

/// How many times the handler ran, by key.
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<HashMap<String, usize>>>);

impl Runs {
    /// Counts a run for the key `req` carries; which run of that key it is.
    fn record(&self, req: &HttpRequest) -> usize {
        let key = req
            .headers()
            .get("idempotency-key")
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        let mut runs = self.0.lock().unwrap();
        let count = runs.entry(key).or_default();
        *count += 1;
        *count
    }
}

/// Counts its run and holds the key for `hold`.
async fn create(
    runs: web::Data<Runs>,
    hold: web::Data<Duration>,
    req: HttpRequest,
) -> HttpResponse {
    runs.record(&req);
    actix_rt::time::sleep(**hold).await;
    HttpResponse::Created().finish()
}

/// A pool of 2 connections on `database`, as the store's own but smaller.
fn pool_of_two(database: &TestDatabase) -> PostgresPool {
    let manager = bb8_postgres::PostgresConnectionManager::new_from_stringlike(
        database.url(),
        tokio_postgres::NoTls,
    )
    .unwrap();
    bb8::Pool::builder()
        .max_size(2)
        .test_on_check_out(false)
        .build_unchecked(manager)
}

/// What a request answered: its status and whether it was a replay; `None` when the client
/// failed.
type Answer = Option<(StatusCode, bool)>;

#[actix_web::test]
async fn leases_are_renewed_while_begins_saturate_the_pool() {
    // The reviewer's measurement, which ran keys twice in every run before renewals left
    // the pool: 300 handlers holding their keys for 15 s with a 4.5 s lease (long enough
    // for no warning: more than twice the store timeout), a pool of 2, every write 5 ms
    // slower, and duplicates of every key sent in rounds of 300 meanwhile.
    let keys = 300;
    let lease = Duration::from_millis(4_500);
    let store_timeout = Duration::from_secs(2);
    let hold = Duration::from_secs(15);

    let database = TestDatabase::create().await;
    let store = PostgresStore::new(pool_of_two(&database));
    store.migrate().await.unwrap();
    database
        .connection()
        .await
        .batch_execute(
            "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep(0.005); RETURN NEW; END $$;
             CREATE TRIGGER slow BEFORE INSERT OR UPDATE ON idempotency_records
             FOR EACH ROW EXECUTE FUNCTION slow();",
        )
        .await
        .unwrap();

    let runs = Runs::default();
    let server = {
        let runs = runs.clone();
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .app_data(web::Data::new(hold))
                .wrap(
                    Idempotency::postgres(store.clone())
                        .store_timeout(store_timeout)
                        .max_in_flight(100_000)
                        .max_detached(100_000),
                )
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(lease),
                        ))
                        .route(web::post().to(create)),
                )
        })
    };
    let client = awc::Client::builder()
        .connector(awc::Connector::new().limit(0))
        .timeout(Duration::from_secs(60))
        .finish();
    let url = server.url("/orders");
    let post = |key: String| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let answer: Answer = match client
                .post(url)
                .insert_header(("idempotency-key", key.as_str()))
                .send_body("{}")
                .await
            {
                Ok(mut response) => {
                    let _ = response.body().await;
                    let replayed = response.headers().contains_key("idempotent-replayed");
                    Some((response.status(), replayed))
                }
                Err(_) => None,
            };
            answer
        }
    };
    let names: Vec<String> = (0..keys).map(|i| format!("k{i}")).collect();

    // Every key's first request, its handler holding the key.
    let firsts = actix_rt::spawn(futures_util::future::join_all(
        names.iter().cloned().map(&post),
    ));
    let started = Instant::now();
    while runs.0.lock().unwrap().len() < keys {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the first requests did not all run"
        );
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    // Meanwhile, duplicates of every key, round after round, until the handlers return.
    let until = started + hold;
    let mut duplicates: HashMap<Answer, usize> = HashMap::new();
    let mut rounds = 0;
    while Instant::now() < until {
        for answer in futures_util::future::join_all(names.iter().cloned().map(&post)).await {
            *duplicates.entry(answer).or_default() += 1;
        }
        rounds += 1;
    }
    let mut first_answers: HashMap<Answer, usize> = HashMap::new();
    for answer in firsts.await.unwrap() {
        *first_answers.entry(answer).or_default() += 1;
    }

    let runs = runs.0.lock().unwrap().clone();
    let twice = runs.values().filter(|&&n| n > 1).count();
    eprintln!(
        "rounds {rounds}, duplicates {duplicates:?}, firsts {first_answers:?}, keys run twice {twice}, elapsed {:?}",
        started.elapsed()
    );
    assert_eq!(twice, 0, "keys whose handler ran twice");
    assert_eq!(runs.len(), keys);
    assert_eq!(
        first_answers,
        HashMap::from([(Some((StatusCode::CREATED, false)), keys)])
    );
    // A duplicate waited (409), was refused while the store was slow (503), or replayed the
    // first run once it completed; never a run of its own.
    for answer in duplicates.keys() {
        assert!(
            matches!(
                answer,
                Some((
                    StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE,
                    false
                )) | Some((StatusCode::CREATED, true))
            ),
            "{answer:?}"
        );
    }
}

/// A plain route's handler: counts its run; the first holds its key until the gate opens.
async fn order(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    if runs.record() == 1 {
        gate.wait().await;
    }
    HttpResponse::Created().finish()
}

/// A transactional route's handler, holding its pooled connection until the gate opens.
async fn booking(
    _transaction: IdempotentTransaction,
    runs: web::Data<(RunCounter, Gate)>,
) -> HttpResponse {
    runs.0.record();
    runs.1.wait().await;
    HttpResponse::Created().finish()
}

/// The same starvation, made certain: transactions hold every pooled connection for longer
/// than a plain route's lease while its handler runs. The lease is still renewed, so a
/// duplicate sent once the pool is free again gets 409 instead of running the handler a
/// second time.
#[actix_web::test]
async fn a_lease_is_renewed_while_transactions_hold_the_whole_pool() {
    // A 3 s lease with a 1 s store timeout: more than twice the timeout, so no warning.
    let lease = Duration::from_secs(3);
    let database = TestDatabase::create().await;
    let store = PostgresStore::new(pool_of_two(&database));
    store.migrate().await.unwrap();
    let (orders, held) = (RunCounter::default(), Gate::default());
    let (bookings, booked) = (RunCounter::default(), Gate::default());
    let server = {
        let (orders, held) = (orders.clone(), held.clone());
        let bookings = (bookings.clone(), booked.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(orders.clone()))
                .app_data(web::Data::new(held.clone()))
                .app_data(web::Data::new(bookings.clone()))
                .wrap(Idempotency::postgres(store.clone()).store_timeout(Duration::from_secs(1)))
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(lease),
                        ))
                        .route(web::post().to(order)),
                )
                .service(
                    web::resource("/bookings")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().transactional(),
                        ))
                        .route(web::post().to(booking)),
                )
        })
    };
    // The test server's own client gives up after 5 s.
    let client = awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish();
    let post = |path: &str, key: &str| {
        let request = client
            .post(server.url(path))
            .insert_header(("idempotency-key", key.to_owned()));
        actix_rt::spawn(async move { Reply::read(request.send().await.unwrap()).await.unwrap() })
    };

    let first = post("/orders", "order");
    orders.wait_for(1).await;
    let transactions = [post("/bookings", "b1"), post("/bookings", "b2")];
    bookings.wait_for(2).await;
    // Both pooled connections are held for longer than the lease.
    actix_rt::time::sleep(lease + Duration::from_secs(1)).await;
    booked.open();
    for transaction in transactions {
        assert_eq!(transaction.await.unwrap().status, StatusCode::CREATED);
    }

    let duplicate = post("/orders", "order").await.unwrap();
    assert_eq!(orders.get(), 1, "the handler ran a second time");
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    held.open();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(orders.get(), 1);
}

/// A pool of 2 connections on `url`, as the store's own but smaller.
fn pool_of_two_on(url: &str) -> PostgresPool {
    let manager =
        bb8_postgres::PostgresConnectionManager::new_from_stringlike(url, tokio_postgres::NoTls)
            .unwrap();
    bb8::Pool::builder()
        .max_size(2)
        .test_on_check_out(false)
        .build_unchecked(manager)
}

/// A proxy of the test's own to `database`'s server, and the URL of `database` through it.
fn proxied(database: &TestDatabase) -> (MovableAddress, String) {
    let config: tokio_postgres::Config = database.url().parse().unwrap();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let proxy = MovableAddress::to(port);
    let url = format!(
        "postgres://{}@127.0.0.1:{}/{}",
        config.get_user().unwrap(),
        proxy.port(),
        config.get_dbname().unwrap()
    );
    (proxy, url)
}

/// An app on a PostgreSQL store whose `/orders` holds keys with a lease of its own.
struct OrdersApp {
    store: PostgresStore,
    lease: Duration,
    store_timeout: Duration,
}

impl OrdersApp {
    fn new(store: PostgresStore, lease: Duration, store_timeout: Duration) -> Self {
        Self {
            store,
            lease,
            store_timeout,
        }
    }

    /// Serves it, `/orders` answered by `handler`, with `runs` and `gate` as app data.
    fn serve<R, F, Args>(self, runs: R, gate: Gate, handler: F) -> actix_test::TestServer
    where
        R: Clone + Send + 'static,
        F: actix_web::Handler<Args> + Clone + Send,
        Args: actix_web::FromRequest + 'static,
        F::Output: actix_web::Responder + 'static,
    {
        let Self {
            store,
            lease,
            store_timeout,
        } = self;
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .app_data(web::Data::new(gate.clone()))
                .wrap(Idempotency::postgres(store.clone()).store_timeout(store_timeout))
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(lease),
                        ))
                        .route(web::post().to(handler.clone())),
                )
        })
    }
}

/// Two instances of one app on one database, the first reaching PostgreSQL through a proxy
/// of the test's own, the second directly; `/orders` holds its first run until `held` opens.
struct ProxiedPair {
    _database: TestDatabase,
    proxy: MovableAddress,
    /// The first instance's pool.
    pool: PostgresPool,
    first: actix_test::TestServer,
    second: actix_test::TestServer,
    orders: RunCounter,
    held: Gate,
    client: awc::Client,
}

impl ProxiedPair {
    async fn start(lease: Duration, store_timeout: Duration) -> Self {
        let database = TestDatabase::create().await;
        let (proxy, proxied_url) = proxied(&database);
        let direct = PostgresStore::new(pool_of_two(&database));
        direct.migrate().await.unwrap();
        let pool = pool_of_two_on(&proxied_url);
        let proxied = PostgresStore::new(pool.clone());
        let (orders, held) = (RunCounter::default(), Gate::default());
        let instance = |store| {
            let app = OrdersApp::new(store, lease, store_timeout);
            app.serve(orders.clone(), held.clone(), order)
        };
        let (first, second) = (instance(proxied), instance(direct));
        // The test server's own client gives up after 5 s.
        let client = awc::Client::builder()
            .timeout(Duration::from_secs(30))
            .finish();
        Self {
            _database: database,
            proxy,
            pool,
            first,
            second,
            orders,
            held,
            client,
        }
    }

    /// Posts `key` to `/orders` of `server` (one of the pair), answered on a task.
    fn post(
        &self,
        server: &actix_test::TestServer,
        key: &str,
    ) -> actix_rt::task::JoinHandle<Reply> {
        let request = self
            .client
            .post(server.url("/orders"))
            .insert_header(("idempotency-key", key.to_owned()));
        actix_rt::spawn(async move { Reply::read(request.send().await.unwrap()).await.unwrap() })
    }

    /// The lease outlived the trouble: a duplicate to the second instance gets 409 and runs
    /// nothing; once the gate opens, `first` (the held request) is answered 201.
    async fn assert_the_lease_held(&self, first: actix_rt::task::JoinHandle<Reply>) {
        let duplicate = self.post(&self.second, "order").await.unwrap();
        assert_eq!(self.orders.get(), 1, "the handler ran a second time");
        assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
        self.held.open();
        // Its commit may go over a silenced or hanging pool: the response still comes.
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    }
}

/// The renewal connection goes silent (a firewall or NAT dropping the flow: nothing is
/// answered, nothing looks closed) while a handler runs on one instance: its renewals time
/// out, and the next one must go over a new connection, or the lease lapses and another
/// instance runs the handler a second time. The first instance reaches PostgreSQL through a
/// proxy of the test's own, the second directly.
#[actix_web::test]
async fn a_renewal_connection_that_goes_silent_is_replaced() {
    // Renewals every 1.5 s, each given up after 500 ms.
    let lease = Duration::from_millis(4_500);
    let pair = ProxiedPair::start(lease, Duration::from_millis(500)).await;

    let first = pair.post(&pair.first, "order");
    pair.orders.wait_for(1).await;
    // A renewal has opened the renewal connection (a third of the lease in).
    actix_rt::time::sleep(Duration::from_secs(2)).await;
    pair.proxy.silence_open_connections();
    actix_rt::time::sleep(lease + Duration::from_millis(1_500)).await;

    pair.assert_the_lease_held(first).await;
    assert_eq!(pair.orders.get(), 1);
}

/// New connections to PostgreSQL hang (the server or a pooler in front of it no longer
/// finishes logins: an overloaded server's full listen backlog, a firewall's full connection
/// table) while the pool's open connections still work, with the default store timeout (2 s,
/// the renewal connection's connect timeout too), from before the request takes its lease:
/// the renewal connection never opens. A renewal that waited for it to open was given up by
/// the store timeout before it fell back to the pool (they come more than `REOPEN_AFTER`
/// apart, so each tried again): the lease lapsed and another instance ran the handler a
/// second time. Renewals on the pool, as before, keep it.
#[actix_web::test]
async fn renewals_reach_the_pool_while_new_connections_hang() {
    // Renewals every 1.5 s, each given up after 1.5 s (under the 2 s a connection may take
    // to open).
    let lease = Duration::from_millis(4_500);
    let pair = ProxiedPair::start(lease, Duration::from_millis(1_500)).await;
    // Takes connections into its backlog and never answers a login.
    let black_hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();

    // The pool's connections are open; new connections hang from now on, so the renewal
    // connection, opened when the request takes its lease, never opens.
    let (one, two) = futures_util::future::join(pair.pool.get(), pair.pool.get()).await;
    drop((one.unwrap(), two.unwrap()));
    pair.proxy.move_to(black_hole.local_addr().unwrap().port());
    let first = pair.post(&pair.first, "order");
    pair.orders.wait_for(1).await;
    actix_rt::time::sleep(lease + Duration::from_millis(1_500)).await;

    pair.assert_the_lease_held(first).await;
    drop(black_hole);
}

/// Counts its run and holds its key until the gate opens.
async fn held_order(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    runs.record();
    gate.wait().await;
    HttpResponse::Created().finish()
}

/// New connections to PostgreSQL are refused (a server or a role at its connection limit)
/// while the pool's open connections still work, and leases are renewed on two workers at
/// once (two instances of one app sharing one store, each on a worker thread of its own):
/// each worker tries to open its renewal connection at most once a second, and renews on
/// the pool meanwhile. The first renewal of one worker used to drop the other's entry,
/// which had no connection, and each worker's next renewal then tried again at once: a
/// connection attempt (a forked backend, on PostgreSQL) for nearly every renewal.
#[actix_web::test]
async fn refused_renewal_connections_are_tried_once_a_second_per_worker() {
    let lease = Duration::from_millis(600);
    let database = TestDatabase::create().await;
    let (proxy, proxied_url) = proxied(&database);
    PostgresStore::new(pool_of_two(&database))
        .migrate()
        .await
        .unwrap();
    let pool = pool_of_two_on(&proxied_url);
    // The pool's two connections open now; every connection opened later is refused.
    let (first, second) = futures_util::future::join(pool.get(), pool.get()).await;
    drop((first.unwrap(), second.unwrap()));
    let refuser = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let attempts = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    proxy.move_to(refuser.local_addr().unwrap().port());
    std::thread::spawn({
        let attempts = Arc::clone(&attempts);
        move || {
            for refused in refuser.incoming() {
                attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                drop(refused);
            }
        }
    });

    let store = PostgresStore::new(pool);
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let instance = || {
        let (store, runs, gate) = (store.clone(), runs.clone(), gate.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .app_data(web::Data::new(gate.clone()))
                .wrap(Idempotency::postgres(store.clone()))
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(lease),
                        ))
                        .route(web::post().to(held_order)),
                )
        })
    };
    let servers = [instance(), instance()];
    let client = awc::Client::builder()
        .connector(awc::Connector::new().limit(0))
        .timeout(Duration::from_secs(30))
        .finish();
    // Posts `key` to one of the two instances, answered on a task.
    let post = |index: usize, key: &'static str| {
        let request = client
            .post(servers[index % 2].url("/orders"))
            .insert_header(("idempotency-key", key));
        actix_rt::spawn(async move { Reply::read(request.send().await.unwrap()).await.unwrap() })
    };
    let held: Vec<_> = ["a", "b", "c", "d"]
        .into_iter()
        .enumerate()
        .map(|(index, key)| post(index, key))
        .collect();
    runs.wait_for(4).await;

    // Renewals every 200 ms for each of the four keys, for 3 s.
    let before = attempts.load(std::sync::atomic::Ordering::SeqCst);
    actix_rt::time::sleep(Duration::from_secs(3)).await;
    let tried = attempts.load(std::sync::atomic::Ordering::SeqCst) - before;
    // At most one attempt a second on each of the two workers, and one more each for the
    // moment the 3 s start in.
    assert!(
        tried <= 8,
        "{tried} renewal connections tried in 3 s on two workers"
    );
    // The leases held, on the pool.
    let duplicate = post(0, "a").await.unwrap();
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    gate.open();
    for reply in held {
        assert_eq!(reply.await.unwrap().status, StatusCode::CREATED);
    }
    assert_eq!(runs.get(), 4);
}

/// Counts its run by key; the first run of a key holds it until the gate opens.
async fn held_first_run(
    runs: web::Data<Runs>,
    gate: web::Data<Gate>,
    req: HttpRequest,
) -> HttpResponse {
    let run = runs.record(&req);
    if run == 1 {
        gate.wait().await;
    }
    HttpResponse::Created().finish()
}

/// Many leases held on one worker whose every `UPDATE` is slow, by an instance that reaches
/// PostgreSQL through a proxy of the test's own, its pool of two; a second instance reaches
/// it directly. The test can then take the first instance's pool and make its new
/// connections hang ([`cut_off`](Self::cut_off)): its renewals have only the renewal
/// connection open by then.
struct SlowLeases {
    _database: TestDatabase,
    proxy: MovableAddress,
    pool: PostgresPool,
    first: actix_test::TestServer,
    second: actix_test::TestServer,
    runs: Runs,
    gate: Gate,
    client: awc::Client,
    held: Vec<actix_rt::task::JoinHandle<Reply>>,
    keys: usize,
}

impl SlowLeases {
    /// `keys` requests to the first instance, each holding its key with `lease`, renewed
    /// within `store_timeout`; every `UPDATE` takes `write` longer. Returns once every
    /// handler runs.
    async fn start(keys: usize, write: Duration, lease: Duration, store_timeout: Duration) -> Self {
        let database = TestDatabase::create().await;
        let (proxy, proxied_url) = proxied(&database);
        let direct = PostgresStore::new(pool_of_two(&database));
        direct.migrate().await.unwrap();
        database
            .connection()
            .await
            .batch_execute(&format!(
                "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN PERFORM pg_sleep({}); RETURN NEW; END $$;
                 CREATE TRIGGER slow BEFORE UPDATE ON idempotency_records
                 FOR EACH ROW EXECUTE FUNCTION slow();",
                write.as_secs_f64()
            ))
            .await
            .unwrap();
        let pool = pool_of_two_on(&proxied_url);
        let (runs, gate) = (Runs::default(), Gate::default());
        let instance = |store| {
            let app = OrdersApp::new(store, lease, store_timeout);
            app.serve(runs.clone(), gate.clone(), held_first_run)
        };
        let (first, second) = (instance(PostgresStore::new(pool.clone())), instance(direct));
        let client = awc::Client::builder()
            .connector(awc::Connector::new().limit(0))
            .timeout(Duration::from_secs(30))
            .finish();
        let mut leases = Self {
            _database: database,
            proxy,
            pool,
            first,
            second,
            runs,
            gate,
            client,
            held: Vec::new(),
            keys,
        };
        leases.held = (0..keys)
            .map(|i| leases.post(&leases.first, format!("k{i}")))
            .collect();
        while leases.runs.0.lock().unwrap().len() < keys {
            actix_rt::time::sleep(Duration::from_millis(20)).await;
        }
        leases
    }

    /// Posts `key` to `/orders` of `server` (one of the two), answered on a task.
    fn post(
        &self,
        server: &actix_test::TestServer,
        key: String,
    ) -> actix_rt::task::JoinHandle<Reply> {
        let request = self
            .client
            .post(server.url("/orders"))
            .insert_header(("idempotency-key", key));
        actix_rt::spawn(async move { Reply::read(request.send().await.unwrap()).await.unwrap() })
    }

    /// Takes both connections of the first instance's pool, and makes the connections it
    /// opens from now on hang, until the returned value is dropped.
    async fn cut_off(&self) -> HeldPool {
        let mut held = self.hold_pool().await;
        let black_hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        self.proxy.move_to(black_hole.local_addr().unwrap().port());
        held._black_hole = Some(black_hole);
        held
    }

    /// Takes both connections of the first instance's pool, until the returned value is
    /// dropped.
    async fn hold_pool(&self) -> HeldPool {
        let (one, two) =
            futures_util::future::join(self.pool.get_owned(), self.pool.get_owned()).await;
        HeldPool {
            _pooled: [one.unwrap(), two.unwrap()],
            _black_hole: None,
        }
    }

    /// Every lease held: a duplicate of each key sent to the second instance gets 409 and
    /// runs nothing. Then, the first instance's pool back (`cut_off` dropped) and the gate
    /// open, every first request is answered 201.
    async fn assert_every_lease_held(self, cut_off: HeldPool) {
        let duplicates: Vec<_> = (0..self.keys)
            .map(|i| self.post(&self.second, format!("k{i}")))
            .collect();
        let mut statuses = Vec::new();
        for duplicate in duplicates {
            statuses.push(duplicate.await.unwrap().status);
        }
        let twice = self
            .runs
            .0
            .lock()
            .unwrap()
            .values()
            .filter(|&&n| n > 1)
            .count();
        assert_eq!(
            twice, 0,
            "keys whose handler ran twice; duplicates: {statuses:?}"
        );
        assert!(
            statuses
                .iter()
                .all(|&status| status == StatusCode::CONFLICT),
            "{statuses:?}"
        );
        drop(cut_off);
        self.gate.open();
        for reply in self.held {
            assert_eq!(reply.await.unwrap().status, StatusCode::CREATED);
        }
        assert_eq!(self.runs.0.lock().unwrap().len(), self.keys);
    }
}

/// The pool's connections, held by the test, and where new connections go meanwhile, if
/// they are cut off.
struct HeldPool {
    _pooled: [bb8::PooledConnection<'static, PostgresConnectionManager<NoTls>>; 2],
    _black_hole: Option<std::net::TcpListener>,
}

/// Renewals queue on the renewal connection for longer than the store timeout, well within
/// the lease: every `UPDATE` is slow and one worker renews many leases, one after another,
/// while the pool is held (by the test) and new connections hang. Each renewal is given up
/// by the store timeout but still lands. The connection still answers, so it is kept; a
/// renewal sent again while its lease's last one waits on it waits for that one instead of
/// queueing another `UPDATE`. Before, a renewal given up marked the connection as silent:
/// renewals went to the held pool and to replacement connections that never opened, the
/// sent ones kept piling up behind each other, and half the leases lapsed.
#[actix_web::test]
async fn renewals_slower_than_the_store_timeout_keep_their_leases() {
    // 20 leases renewed every second, each `UPDATE` 50 ms: a round of renewals takes 1 s
    // on the one connection, twice the store timeout, a third of the lease.
    let lease = Duration::from_secs(3);
    let leases = SlowLeases::start(
        20,
        Duration::from_millis(50),
        lease,
        Duration::from_millis(500),
    )
    .await;
    // The first renewals (a third of the lease in) have gone out.
    actix_rt::time::sleep(Duration::from_millis(1_500)).await;
    let cut_off = leases.cut_off().await;
    actix_rt::time::sleep(lease * 2).await;
    leases.assert_every_lease_held(cut_off).await;
}

/// The first renewals of a burst of new keys, while the pool is saturated (held by the
/// test) and the renewal connection takes 300 ms to open: each takes whichever comes
/// first, a pooled connection or the new connection, and lands. Sent to the pool alone while
/// the connection opened, they waited there their whole store timeout and were sent again
/// on the connection behind every other lease's, past their lease.
#[actix_web::test]
async fn first_renewals_take_the_renewal_connection_once_it_opens() {
    // 20 leases of 3 s, each `UPDATE` 50 ms (a round of 1 s on the one connection); the
    // store timeout (1.4 s) and the first renewal (1 s in) left no time for a round after a
    // renewal given up in the pool.
    let lease = Duration::from_secs(3);
    let leases = SlowLeases::start(
        20,
        Duration::from_millis(50),
        lease,
        Duration::from_millis(1_400),
    )
    .await;
    let held = leases.hold_pool().await;
    leases
        .proxy
        .delay_new_connections(Duration::from_millis(300));
    actix_rt::time::sleep(lease * 2).await;
    leases.assert_every_lease_held(held).await;
}

/// Renewals of one lease sent while one of them waits on the renewal connection wait for
/// its answer instead of each queueing an `UPDATE` of its own. The engine sends a renewal
/// again at every tick once one was given up by the store timeout: queued, each made the
/// queue, and the database's writes, grow the longer the queue was.
#[actix_web::test]
async fn renewals_of_a_lease_on_their_way_are_written_once() {
    let lease = Duration::from_secs(30);
    let database = TestDatabase::create().await;
    let store = PostgresStore::new(pool_of_two(&database));
    store.migrate().await.unwrap();
    let admin = database.connection().await;
    admin
        .batch_execute(
            "CREATE TABLE renewal_writes (at timestamptz);
             CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO renewal_writes VALUES (clock_timestamp());
             PERFORM pg_sleep(0.3); RETURN NEW; END $$;
             CREATE TRIGGER slow BEFORE UPDATE ON idempotency_records
             FOR EACH ROW EXECUTE FUNCTION slow();",
        )
        .await
        .unwrap();
    let key = StorageKey::new("pg:", b"", &IdempotencyKey::parse(b"lease").unwrap());
    let print = Fingerprint::compute(&actix_web::http::Method::POST, "/orders", "", b"{}", []);
    let token = LeaseToken::generate();
    let begun = store.begin(&key, &print, &token, lease).await.unwrap();
    assert_eq!(begun, BeginOutcome::Acquired);

    // Five at once, until the renewal connection (which the `begin` opened in the
    // background) takes them: renewals on pooled connections are written each.
    let mut writes = Vec::new();
    for _ in 0..10 {
        admin
            .batch_execute("DELETE FROM renewal_writes")
            .await
            .unwrap();
        let renewals = (0..5).map(|_| store.renew(&key, &token, lease));
        for renewed in futures_util::future::join_all(renewals).await {
            assert!(renewed.unwrap(), "the lease is held");
        }
        let written: i64 = admin
            .query_one("SELECT count(*) FROM renewal_writes", &[])
            .await
            .unwrap()
            .get(0);
        writes.push(written);
        if written == 1 {
            return;
        }
        actix_rt::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("five renewals of one lease at once wrote {writes:?} times in ten tries");
}
