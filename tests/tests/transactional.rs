//! Transactional routes over real sockets on real PostgreSQL (issue 12): the handler writes
//! through `IdempotentTransaction`, and its writes commit together with the stored response
//! or not at all; duplicates get 409 at once; misuse is a clear error. Each test runs in a
//! database of its own on the server at `DATABASE_URL` (default 127.0.0.1:5432).

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, post, web};
use futures_util::StreamExt;
use idempotency_actix::{
    FailMode, Idempotency, IdempotencyKey, IdempotencyPolicy, IdempotencyStore, IdempotentRoute,
    IdempotentTransaction, LeaseToken, MemoryStore, PostgresStore, StorageKey, idempotent,
};
use idempotency_actix_tests::{Reply, RunCounter, TestDatabase};

/// Holds a handler until the test lets it go (at most 10 s, so nothing hangs).
#[derive(Clone, Default)]
struct Gate(Arc<AtomicBool>);

impl Gate {
    fn open(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    async fn pass(&self) {
        for _ in 0..1_000 {
            if self.0.load(Ordering::SeqCst) {
                return;
            }
            actix_rt::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[derive(serde::Deserialize)]
struct Knobs {
    status: Option<u16>,
    panic: Option<u8>,
    hold: Option<u8>,
    poison: Option<u8>,
}

/// Inserts one ledger row through the request's transaction, then answers `status`
/// (default 201), panics, or first waits at the gate.
async fn book(
    transaction: &IdempotentTransaction,
    runs: &RunCounter,
    gate: &Gate,
    knobs: &Knobs,
) -> HttpResponse {
    let seq = runs.record();
    let row = transaction
        .query_one(
            "INSERT INTO ledger (amount) VALUES (1) RETURNING entry_id",
            &[],
        )
        .await
        .unwrap();
    let entry_id: i64 = row.get(0);
    if knobs.hold == Some(1) {
        gate.pass().await;
    }
    if knobs.panic == Some(1) {
        panic!("the handler panics after its insert");
    }
    if knobs.poison == Some(1) {
        // A failed statement whose error the handler ignores: the transaction is aborted.
        let _ = transaction.execute("SELECT 1 / 0", &[]).await;
    }
    HttpResponse::build(StatusCode::from_u16(knobs.status.unwrap_or(201)).unwrap())
        .json(serde_json::json!({ "entry_id": entry_id, "seq": seq }))
}

#[idempotent(transactional)]
#[post("/ledger")]
async fn by_attribute(
    transaction: IdempotentTransaction,
    runs: web::Data<RunCounter>,
    gate: web::Data<Gate>,
    knobs: web::Query<Knobs>,
) -> HttpResponse {
    book(&transaction, &runs, &gate, &knobs).await
}

async fn by_hand(
    transaction: IdempotentTransaction,
    runs: web::Data<RunCounter>,
    gate: web::Data<Gate>,
    knobs: web::Query<Knobs>,
) -> HttpResponse {
    book(&transaction, &runs, &gate, &knobs).await
}

/// Inserts one ledger row, then answers 201 with a body that sends one chunk and then
/// nothing, ever (an idle stream).
async fn stalls(transaction: IdempotentTransaction, runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    transaction
        .execute("INSERT INTO ledger (amount) VALUES (1)", &[])
        .await
        .unwrap();
    let chunks = futures_util::stream::iter([Ok::<_, actix_web::Error>(web::Bytes::from_static(
        b"{\"progress\":1}\n",
    ))])
    .chain(futures_util::stream::pending());
    HttpResponse::Created().streaming(chunks)
}

#[derive(serde::Deserialize)]
struct Framing {
    /// 1: a body of unknown size on a response sent without chunking
    /// (`HttpResponseBuilder::no_chunking`) instead of a `SizedStream`; the client is told
    /// the same `Content-Length` either way.
    unchunked: Option<u8>,
}

/// 201 with `0123456789` as a body the client is told is `declared` bytes long, as
/// `framing` says.
fn declaring(declared: u64, framing: &Framing) -> HttpResponse {
    let chunks = futures_util::stream::iter([Ok::<_, actix_web::Error>(web::Bytes::from_static(
        b"0123456789",
    ))]);
    if framing.unchunked == Some(1) {
        HttpResponse::Created()
            .no_chunking(declared)
            .body(actix_web::body::BodyStream::new(chunks))
    } else {
        HttpResponse::Created().body(actix_web::body::SizedStream::new(declared, chunks))
    }
}

/// The size a route's body declares (see [`declaring`]): 100 on the route whose body ends
/// short of it (a proxied or file body cut short), 4 where it runs past it (a wrong length
/// given to `SizedStream` or `no_chunking`), 10 where it is the whole body.
#[derive(Clone, Copy)]
struct Declared(u64);

/// Inserts one ledger row, then answers 201 with `0123456789` as a body that declares the
/// route's [`Declared`] size.
async fn declares(
    transaction: IdempotentTransaction,
    runs: web::Data<RunCounter>,
    declared: web::Data<Declared>,
    framing: web::Query<Framing>,
) -> HttpResponse {
    runs.record();
    transaction
        .execute("INSERT INTO ledger (amount) VALUES (1)", &[])
        .await
        .expect("the insert");
    declaring(declared.0, &framing)
}

/// A plain (not transactional) route: counts its run and answers 201.
async fn plain(runs: web::Data<RunCounter>) -> HttpResponse {
    HttpResponse::Created().json(serde_json::json!({ "seq": runs.record() }))
}

#[derive(serde::Deserialize)]
struct SearchPath {
    /// `local` (`SET LOCAL`, for the transaction) or `session` (`SET`, which the pooled
    /// connection keeps after the commit).
    scope: String,
}

/// A schema-per-tenant handler: sets `search_path` to the tenant's schema, as such apps do,
/// and inserts one row into the tenant's ledger through the request's transaction.
async fn in_tenant_schema(
    transaction: IdempotentTransaction,
    runs: web::Data<RunCounter>,
    search_path: web::Query<SearchPath>,
) -> HttpResponse {
    let seq = runs.record();
    let set = match search_path.scope.as_str() {
        "local" => "SET LOCAL search_path TO tenant_a",
        _ => "SET search_path TO tenant_a",
    };
    transaction.batch_execute(set).await.unwrap();
    let row = transaction
        .query_one(
            "INSERT INTO ledger (amount) VALUES (1) RETURNING entry_id",
            &[],
        )
        .await
        .unwrap();
    let entry_id: i64 = row.get(0);
    HttpResponse::Created().json(serde_json::json!({ "entry_id": entry_id, "seq": seq }))
}

/// The database's TCP keepalive settings for the request's transaction, and how long data
/// it sent may stay unacknowledged, as it reports them.
async fn keepalives(transaction: IdempotentTransaction) -> HttpResponse {
    let mut settings = serde_json::Map::new();
    for name in [
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "user_timeout",
    ] {
        let row = transaction
            .query_one(&format!("SHOW tcp_{name}"), &[])
            .await
            .unwrap();
        settings.insert(name.to_owned(), row.get::<_, String>(0).into());
    }
    HttpResponse::Ok().json(settings)
}

struct Harness {
    server: actix_test::TestServer,
    database: TestDatabase,
    runs: RunCounter,
    gate: Gate,
}

const LEDGER: &str = "CREATE TABLE ledger (entry_id bigserial PRIMARY KEY, amount bigint NOT NULL)";

/// A server with the transactional routes on a store whose pool has `connections`.
async fn start(connections: u32) -> Harness {
    start_failing(connections, FailMode::Closed).await
}

/// As [`start`], answering a store error as `fail_mode` says.
async fn start_failing(connections: u32, fail_mode: FailMode) -> Harness {
    start_on(connections, fail_mode, None).await
}

/// Sets `setting` (`name = value`) for the sessions that `admin`'s database opens from now.
async fn set_for_new_sessions(admin: &tokio_postgres::Client, setting: &str) {
    let name: String = admin
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    admin
        .batch_execute(&format!("ALTER DATABASE \"{name}\" SET {setting}"))
        .await
        .unwrap();
}

/// As [`start_failing`], on a database that sets `setting` (`name = value`) for its
/// sessions, as a managed PostgreSQL's parameter group does.
async fn start_on(connections: u32, fail_mode: FailMode, setting: Option<&str>) -> Harness {
    let database = TestDatabase::create().await;
    let admin = database.connection().await;
    admin.batch_execute(LEDGER).await.unwrap();
    if let Some(setting) = setting {
        set_for_new_sessions(&admin, setting).await;
    }
    let store = PostgresStore::new(pool(&database, connections));
    store.migrate().await.unwrap();
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = serve(store, fail_mode, &runs, &gate);
    Harness {
        server,
        database,
        runs,
        gate,
    }
}

/// A database of its own with the handlers' `ledger` table.
async fn ledger_database() -> TestDatabase {
    let database = TestDatabase::create().await;
    database
        .connection()
        .await
        .batch_execute(LEDGER)
        .await
        .expect("the ledger table");
    database
}

/// As [`start`], on a store that never ran `migrate()`: the table was made by another
/// instance's (or by a DBA), and this store finds it when it needs it.
async fn start_without_migrate(connections: u32) -> Harness {
    let database = ledger_database().await;
    let other = PostgresStore::new(PostgresStore::pool(database.url()).unwrap());
    other.migrate().await.unwrap();
    let store = PostgresStore::new(pool(&database, connections));
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = serve(store, FailMode::Closed, &runs, &gate);
    Harness {
        server,
        database,
        runs,
        gate,
    }
}

/// A pool of `connections` on `database`, which waits 2 s for a connection.
fn pool(database: &TestDatabase, connections: u32) -> idempotency_actix::PostgresPool {
    let manager = bb8_postgres::PostgresConnectionManager::new_from_stringlike(
        database.url(),
        tokio_postgres::NoTls,
    )
    .unwrap();
    bb8::Pool::builder()
        .max_size(connections)
        .test_on_check_out(false)
        .connection_timeout(Duration::from_secs(2))
        .build_unchecked(manager)
}

/// A server with the transactional routes on `store`, counting runs in `runs` and holding
/// handlers at `gate`.
fn serve(
    store: PostgresStore,
    fail_mode: FailMode,
    runs: &RunCounter,
    gate: &Gate,
) -> actix_test::TestServer {
    let (runs, gate) = (runs.clone(), gate.clone());
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .app_data(web::Data::new(gate.clone()))
            .wrap(Idempotency::postgres(store.clone()).on_store_error(fail_mode))
            .service(by_attribute)
            .service(
                web::resource("/ledger-by-hand")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().transactional(),
                    ))
                    .route(web::post().to(by_hand)),
            )
            .service(
                web::resource("/ledger-waits")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default()
                            .transactional()
                            .wait_for_completion(Duration::from_secs(10)),
                    ))
                    .route(web::post().to(by_hand)),
            )
            .service(
                web::resource("/ledger-stalls")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default()
                            .transactional()
                            .lease(Duration::from_secs(1)),
                    ))
                    .route(web::post().to(stalls)),
            )
            .service(
                web::resource("/ledger-cut-short")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().transactional(),
                    ))
                    .app_data(web::Data::new(Declared(100)))
                    .route(web::post().to(declares)),
            )
            .service(
                web::resource("/ledger-over-the-limit")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default()
                            .transactional()
                            .max_stored_body(8),
                    ))
                    .app_data(web::Data::new(Declared(10)))
                    .route(web::post().to(declares)),
            )
            .service(
                web::resource("/ledger-runs-past")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().transactional(),
                    ))
                    .app_data(web::Data::new(Declared(4)))
                    .route(web::post().to(declares)),
            )
            .service(
                web::resource("/keepalives")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default()
                            .transactional()
                            .lease(Duration::from_secs(60)),
                    ))
                    .route(web::post().to(keepalives)),
            )
            .service(
                web::resource("/tenant-ledger")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().transactional(),
                    ))
                    .route(web::post().to(in_tenant_schema)),
            )
            .service(
                web::resource("/plain")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(plain)),
            )
            .service(
                web::resource("/not-transactional")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(by_hand)),
            )
    })
}

impl Harness {
    async fn post(&self, path: &str, key: Option<&str>) -> Reply {
        let mut request = self.server.post(path);
        if let Some(key) = key {
            request = request.insert_header(("idempotency-key", key));
        }
        Reply::read(request.send().await.unwrap()).await.unwrap()
    }

    /// Posts to `path` with `key` on a task of its own, for a request that waits at the gate.
    fn spawn_post(
        &self,
        path: &str,
        key: &str,
    ) -> actix_rt::task::JoinHandle<Result<Reply, awc::error::PayloadError>> {
        let request = self
            .server
            .post(path)
            .insert_header(("idempotency-key", key.to_owned()));
        actix_rt::spawn(async move { Reply::read(request.send().await.unwrap()).await })
    }

    async fn count(&self, sql: &str) -> i64 {
        self.database
            .connection()
            .await
            .query_one(sql, &[])
            .await
            .unwrap()
            .get(0)
    }

    /// Makes every record expired and holds their rows in a transaction of the returned
    /// connection (until it sends `COMMIT`): a claim that would take one over waits for it.
    async fn lapse_and_hold_the_records(&self) -> tokio_postgres::Client {
        let writer = self.database.connection().await;
        writer
            .batch_execute(
                "UPDATE idempotency_records SET expires_at = now() - interval '1 second';
                 BEGIN; SELECT 1 FROM idempotency_records FOR UPDATE",
            )
            .await
            .unwrap();
        writer
    }

    /// Retries `key` on `path`: a replay (201) of the record kept without its body, the
    /// handler having run `ran` times in all and its write committed as often.
    async fn assert_replayed_without_body(&self, path: &str, key: &str, ran: i64) {
        let retry = self.post(path, Some(key)).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{path}: {retry:?}");
        assert!(retry.is_replay(), "{path}: {retry:?}");
        assert_eq!(
            retry.header("idempotent-body-omitted"),
            Some("true"),
            "{path}: {retry:?}"
        );
        assert_eq!(retry.body, "", "{path}: {retry:?}");
        assert_eq!(self.runs.get() as i64, ran, "{path}");
        assert_eq!(
            self.ledger_rows().await,
            ran,
            "{path}: the handler's write committed once"
        );
    }

    async fn ledger_rows(&self) -> i64 {
        self.count("SELECT count(*) FROM ledger").await
    }

    async fn records(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_records").await
    }

    /// Ends every other session on the test database, as a restart or a failover ends the
    /// pool's connections, and waits until the server has let them go.
    async fn end_the_other_sessions(&self) -> i64 {
        let others = "FROM pg_stat_activity \
                      WHERE datname = current_database() AND pid <> pg_backend_pid()";
        let ended = self
            .count(&format!(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) {others}) ended"
            ))
            .await;
        for _ in 0..500 {
            if self.count(&format!("SELECT count(*) {others}")).await == 0 {
                break;
            }
            actix_rt::time::sleep(Duration::from_millis(10)).await;
        }
        ended
    }
}

#[actix_web::test]
async fn the_write_and_the_record_commit_together_and_a_retry_replays() {
    let h = start(4).await;
    let first = h.post("/ledger", Some("k")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.is_replay());
    // Both committed before the response arrived.
    assert_eq!(h.ledger_rows().await, 1);
    assert_eq!(
        h.count("SELECT count(*) FROM idempotency_records WHERE state = 'c'")
            .await,
        1
    );
    let retry = h.post("/ledger", Some("k")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    assert_eq!(h.ledger_rows().await, 1);
    assert_eq!(h.runs.get(), 1);
}

#[actix_web::test]
async fn the_builder_option_makes_a_route_transactional() {
    let h = start(4).await;
    let first = h.post("/ledger-by-hand", Some("k")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = h.post("/ledger-by-hand", Some("k")).await;
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    assert_eq!((h.ledger_rows().await, h.runs.get()), (1, 1));
}

#[actix_web::test]
async fn an_error_response_rolls_back_and_frees_the_key() {
    let h = start(4).await;
    let failed = h.post("/ledger?status=500", Some("k")).await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!((h.ledger_rows().await, h.records().await), (0, 0));
    // Nothing stored: the retry runs the handler again.
    let retry = h.post("/ledger?status=500", Some("k")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!retry.is_replay());
    assert_eq!(h.runs.get(), 2);
    assert_eq!(h.ledger_rows().await, 0);
}

#[actix_web::test]
async fn a_panic_rolls_back_and_frees_the_key() {
    let h = start(4).await;
    let panicked = h.post("/ledger?panic=1", Some("k")).await;
    assert_eq!(panicked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        panicked.json()["type"],
        "tag:idempotency-actix,2026:handler-panicked"
    );
    assert_eq!((h.ledger_rows().await, h.records().await), (0, 0));
    let retry = h.post("/ledger?panic=1", Some("k")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(h.runs.get(), 2);
    assert_eq!(h.ledger_rows().await, 0);
}

#[actix_web::test]
async fn a_transaction_that_cannot_commit_is_503_and_leaves_nothing() {
    let h = start(4).await;
    let refused = h.post("/ledger?poison=1", Some("k")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        refused.json()["type"],
        "tag:idempotency-actix,2026:store-unavailable"
    );
    assert!(refused.header("retry-after").is_some());
    // Neither the handler's insert nor a record: the retry runs again.
    assert_eq!((h.ledger_rows().await, h.records().await), (0, 0));
    let retry = h.post("/ledger", Some("k")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!((h.runs.get(), h.ledger_rows().await), (2, 1));
}

/// What a client is told when the commit fails (its outcome unknown, as after a connection
/// that dies during `COMMIT`): with a key, to retry with it, as the record commits together
/// with the handler's writes; without one, that the outcome is unknown and nothing records
/// it. (Both were told "the request was not processed … retry later with the same key",
/// which is false where the commit's outcome is unknown, and for a request without a key.
/// And the request without a key, whose transaction a failed statement had aborted, got the
/// handler's 201 although its insert was rolled back: PostgreSQL answers `COMMIT` of an
/// aborted transaction with a rollback, not an error.)
#[actix_web::test]
async fn a_commit_that_fails_tells_the_client_its_outcome_is_unknown() {
    let h = start(4).await;
    let keyed = h.post("/ledger?poison=1", Some("k")).await;
    assert_eq!(keyed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        keyed.json()["type"],
        "tag:idempotency-actix,2026:store-unavailable"
    );
    assert_eq!(
        keyed.json()["detail"],
        "the idempotency store failed while the request was being committed, so its outcome \
         is unknown; retry later with the same key: a completed request is replayed, an \
         incomplete one runs again"
    );
    let keyless = h.post("/ledger?poison=1", None).await;
    assert_eq!(keyless.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(keyless.header("retry-after").is_some());
    assert_eq!(
        keyless.json()["type"],
        "tag:idempotency-actix,2026:store-unavailable"
    );
    assert_eq!(
        keyless.json()["detail"],
        "the idempotency store failed while the request was being committed, so its outcome \
         is unknown; nothing records it, so a retry may process the request again"
    );
    assert_eq!((h.runs.get(), h.ledger_rows().await), (2, 0));
}

/// A database that cannot be reached: a keyed request is told to retry with its key, one
/// without a key (whose transaction could not be opened) to retry, with no key mentioned.
/// (Both were told to "retry later with the same key".)
#[actix_web::test]
async fn an_unreachable_database_tells_a_request_without_a_key_to_retry_without_one() {
    // Nothing listens on port 1: every connection is refused.
    let store =
        PostgresStore::new(PostgresStore::pool("postgres://postgres@127.0.0.1:1/none").unwrap());
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = serve(store, FailMode::Closed, &runs, &gate);
    let send = |key: Option<&str>| {
        let mut request = server.post("/ledger");
        if let Some(key) = key {
            request = request.insert_header(("idempotency-key", key.to_owned()));
        }
        async move { Reply::read(request.send().await.unwrap()).await.unwrap() }
    };
    let keyed = send(Some("k")).await;
    assert_eq!(keyed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        keyed.json()["detail"],
        "the request was not processed because the idempotency store is unavailable; retry \
         later with the same key"
    );
    let keyless = send(None).await;
    assert_eq!(keyless.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(keyless.header("retry-after").is_some());
    assert_eq!(
        keyless.json()["type"],
        "tag:idempotency-actix,2026:store-unavailable"
    );
    assert_eq!(
        keyless.json()["detail"],
        "the request was not processed because the idempotency store is unavailable; retry \
         later"
    );
    assert_eq!(runs.get(), 0);
}

#[actix_web::test]
async fn a_duplicate_in_flight_gets_409_at_once_without_holding_a_connection() {
    // Two connections: the first request's transaction holds one for as long as it runs.
    let h = start(2).await;
    let first = h.spawn_post("/ledger?hold=1", "k");
    // The handler has inserted its row and waits at the gate, inside its transaction.
    h.runs.wait_for(1).await;
    for _ in 0..8 {
        let duplicate = h.post("/ledger?hold=1", Some("k")).await;
        assert_eq!(duplicate.status, StatusCode::CONFLICT);
        assert_eq!(
            duplicate.json()["type"],
            "tag:idempotency-actix,2026:in-flight"
        );
        assert!(duplicate.header("retry-after").is_some());
    }
    // Another key still gets the one connection left, and runs.
    let other = h.post("/ledger", Some("other")).await;
    assert_eq!(other.status, StatusCode::CREATED);
    // All of that while the first was still held at the gate.
    assert!(!first.is_finished());
    h.gate.open();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = h.post("/ledger?hold=1", Some("k")).await;
    assert!(replay.is_replay());
    assert_eq!(replay.body, first.body);
    assert_eq!((h.runs.get(), h.ledger_rows().await), (2, 2));
}

/// A key whose earlier claim was abandoned (its client left before `begin` answered)
/// holds a marker row. A transaction takes the marker over and runs its handler; until it
/// commits, other statements still see the marker. A duplicate then is in flight: 409, and
/// on a fail-open app still 409, never a second run (it used to be taken for a store error
/// after four reads: 503, or with fail-open a second run of the handler).
#[actix_web::test]
async fn a_duplicate_of_a_claim_that_took_over_an_abandoned_marker_gets_409() {
    for fail_mode in [FailMode::Closed, FailMode::Open] {
        let h = start_failing(4, fail_mode).await;
        let store = PostgresStore::new(PostgresStore::pool(h.database.url()).unwrap());
        let key = StorageKey::new("idempotency:", b"", &IdempotencyKey::parse(b"k").unwrap());
        let abandoned = LeaseToken::generate();
        assert!(
            store
                .abandon(&key, &abandoned, Duration::from_secs(60))
                .await
                .unwrap()
        );
        let first = h.spawn_post("/ledger?hold=1", "k");
        h.runs.wait_for(1).await;
        for path in ["/ledger?hold=1", "/not-transactional"] {
            let duplicate = h.post(path, Some("k")).await;
            assert_eq!(
                duplicate.status,
                StatusCode::CONFLICT,
                "{fail_mode:?} {path}: {duplicate:?}"
            );
            assert_eq!(
                duplicate.json()["type"],
                "tag:idempotency-actix,2026:in-flight"
            );
        }
        assert!(!first.is_finished());
        h.gate.open();
        let first = first.await.unwrap().unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        let replay = h.post("/ledger?hold=1", Some("k")).await;
        assert!(replay.is_replay(), "{fail_mode:?}: {replay:?}");
        assert_eq!(replay.body, first.body);
        assert_eq!(
            (h.runs.get(), h.ledger_rows().await),
            (1, 1),
            "{fail_mode:?}"
        );
    }
}

#[actix_web::test]
async fn a_duplicate_can_wait_for_the_commit_and_replay_it() {
    let h = start(4).await;
    let send = || h.spawn_post("/ledger-waits?hold=1", "k");
    let first = send();
    h.runs.wait_for(1).await;
    let duplicate = send();
    // The duplicate waits (polling the committed state) while the first holds its
    // transaction open at the gate.
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    assert!(!duplicate.is_finished());
    h.gate.open();
    let first = first.await.unwrap().unwrap();
    let duplicate = duplicate.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(duplicate.is_replay(), "{duplicate:?}");
    assert_eq!(duplicate.body, first.body);
    assert_eq!((h.runs.get(), h.ledger_rows().await), (1, 1));
}

/// DESIGN §7 on a transactional route: a client that resets the connection while its
/// handler holds the transaction open does not cut the run short. The run goes on without
/// it, the handler's write and its response commit together, and the retry is the replay:
/// one row, one run, never a rolled-back write the client could not learn about.
#[actix_web::test]
async fn a_client_that_leaves_mid_handler_gets_the_replay_of_the_committed_run() {
    use std::io::Write;

    let h = start(4).await;
    let mut socket = std::net::TcpStream::connect(h.server.addr()).unwrap();
    write!(
        socket,
        "POST /ledger?hold=1 HTTP/1.1\r\nHost: test\r\nIdempotency-Key: left\r\n\
         Content-Length: 0\r\n\r\n"
    )
    .unwrap();
    h.runs.wait_for(1).await;
    idempotency_actix_tests::reset(socket);
    h.gate.open();

    let mut retry = None;
    for _ in 0..500 {
        let reply = h.post("/ledger?hold=1", Some("left")).await;
        if reply.status != StatusCode::CONFLICT {
            retry = Some(reply);
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = retry.expect("the key stayed in flight");
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.json()["seq"], 1);
    assert_eq!((h.runs.get(), h.ledger_rows().await), (1, 1));
}

#[actix_web::test]
async fn a_request_without_a_key_gets_a_transaction_too() {
    let h = start(4).await;
    assert_eq!(h.post("/ledger", None).await.status, StatusCode::CREATED);
    assert_eq!(
        h.post("/ledger?status=500", None).await.status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    // The success committed, the error rolled back; no record either way.
    assert_eq!((h.ledger_rows().await, h.records().await), (1, 0));
    assert_eq!(h.runs.get(), 2);
}

#[actix_web::test]
async fn the_extractor_on_a_route_that_is_not_transactional_is_a_500() {
    let h = start(4).await;
    let refused = h.post("/not-transactional", Some("k")).await;
    assert_eq!(refused.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        refused.json()["type"],
        "tag:idempotency-actix,2026:not-configured"
    );
    assert_eq!((h.runs.get(), h.ledger_rows().await), (0, 0));
}

#[actix_web::test]
async fn a_transactional_route_on_another_store_is_refused() {
    let runs = RunCounter::default();
    let server = {
        let runs = runs.clone();
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .app_data(web::Data::new(Gate::default()))
                .wrap(Idempotency::new(MemoryStore::new()))
                .service(by_attribute)
        })
    };
    let request = server
        .post("/ledger")
        .insert_header(("idempotency-key", "k"));
    let refused = Reply::read(request.send().await.unwrap()).await.unwrap();
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.get(), 0);
}

/// Inspection (issue 11): a transactional claim lives inside its transaction, so it shows
/// as in flight and cannot be deleted, even by force; once committed it is a completed
/// record like any other, and deleting it lets the key run again.
#[actix_web::test]
async fn inspection_sees_a_transactional_claim_in_flight_and_cannot_delete_it() {
    use idempotency_actix::{Deletion, Inspector, RecordState};

    let h = start(4).await;
    let store = PostgresStore::new(PostgresStore::pool(h.database.url()).unwrap());
    let inspector = Inspector::new(store);
    let first = h.post("/ledger?hold=1", Some("k"));
    let look = async {
        h.runs.wait_for(1).await;
        let found = inspector.lookup(b"", "k").await.unwrap().unwrap();
        assert_eq!(found.state, RecordState::InFlight);
        let deleted = inspector.force_delete(b"", "k").await.unwrap();
        assert_eq!(deleted, Deletion::InFlight);
        h.gate.open();
    };
    let (first, ()) = futures_util::future::join(first, look).await;
    assert_eq!(first.status, StatusCode::CREATED);

    let found = inspector.lookup(b"", "k").await.unwrap().unwrap();
    assert_eq!(found.state, RecordState::Completed);
    assert_eq!(found.status, Some(StatusCode::CREATED));
    assert_eq!(inspector.delete(b"", "k").await.unwrap(), Deletion::Deleted);
    let again = h.post("/ledger", Some("k")).await;
    assert_eq!(
        (again.status, again.is_replay()),
        (StatusCode::CREATED, false)
    );
    assert_eq!(h.runs.get(), 2);
}

#[actix_web::test]
async fn a_body_that_stalls_before_the_commit_is_cut_after_a_lease_and_its_write_commits() {
    let h = start(2).await;
    // Nothing leaves before the commit, and the body never ends: after a lease (1 s) with
    // nothing from it, the record completes without a body and the transaction commits.
    // The client gets the head and the chunk read, or, as Actix closes the connection on a
    // body that fails, nothing: either way the request ends, where it used to wait for good
    // (here until the client's 5 s timeout).
    let first = h
        .server
        .post("/ledger-stalls")
        .insert_header(("idempotency-key", "stalls"))
        .send()
        .await;
    match first {
        Ok(response) => assert_eq!(response.status(), StatusCode::CREATED),
        Err(error) => assert!(
            !matches!(error, awc::error::SendRequestError::Timeout),
            "the request was left waiting: {error}"
        ),
    }
    let retry = h.post("/ledger-stalls", Some("stalls")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.is_replay());
    assert_eq!(retry.header("idempotent-body-omitted"), Some("true"));
    assert_eq!(h.runs.get(), 1);
    assert_eq!(h.ledger_rows().await, 1, "the handler's write committed");
}

/// A body that ends before its declared size is a response cut short, as on a plain
/// route: the client never gets it as a complete response (Actix closes the connection,
/// after the head with the declared length and the 10 bytes, or before anything when they
/// are not written yet), and the record completes without a body, so that the retry is told
/// the body is not stored. The transaction sent the 10 bytes read as a complete response of
/// 10 bytes, and stored them so: client and retry both took a truncated body for the whole
/// one (helper review).
#[actix_web::test]
async fn a_body_that_ends_before_its_declared_size_is_not_taken_for_the_whole_body() {
    let h = start(2).await;
    // As a `SizedStream`, and as a body of unknown size sent without chunking, whose
    // `Content-Length` Actix writes as the handler set it.
    for (ran, path) in [
        (1_i64, "/ledger-cut-short"),
        (2, "/ledger-cut-short?unchunked=1"),
    ] {
        let key = format!("cut{path}");
        let mut first = idempotency_actix_tests::RawExchange::post(
            h.server.addr(),
            path,
            &[("Idempotency-Key", &key)],
        );
        let sent = String::from_utf8(first.read_to_end()).expect("an HTTP/1.1 response");
        if !sent.is_empty() {
            let (head, body) = sent.split_once("\r\n\r\n").expect("a whole head");
            assert!(head.starts_with("HTTP/1.1 201"), "{path}: {head}");
            assert!(
                head.to_ascii_lowercase().contains("content-length: 100"),
                "{path}: sent as complete: {sent:?}"
            );
            assert_eq!(body, "0123456789", "{path}: {sent:?}");
        }

        h.assert_replayed_without_body(path, &key, ran).await;
    }
}

/// A body that runs past its declared size is sent and stored as that size, as on a plain
/// route (Actix writes no more than the size declared): the client gets the 4 bytes
/// declared, and the retry the same 4. The transaction sent all 10 bytes read, with a
/// `Content-Length` of 10 the handler never declared, and stored them so (helper review);
/// so it did still for a body of unknown size sent without chunking.
#[actix_web::test]
async fn a_body_that_runs_past_its_declared_size_is_sent_and_stored_as_that_size() {
    let h = start(2).await;
    for (ran, path) in [
        (1_i64, "/ledger-runs-past"),
        (2, "/ledger-runs-past?unchunked=1"),
    ] {
        let key = format!("past{path}");
        let first = h.post(path, Some(&key)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{path}: {first:?}");
        assert_eq!(
            first.header("content-length"),
            Some("4"),
            "{path}: {first:?}"
        );
        assert_eq!(first.body, "0123", "{path}: {first:?}");

        let retry = h.post(path, Some(&key)).await;
        assert!(retry.is_replay(), "{path}: {retry:?}");
        assert_eq!(
            retry.header("content-length"),
            Some("4"),
            "{path}: {retry:?}"
        );
        assert_eq!(retry.body, first.body, "{path}");
        assert_eq!(h.runs.get() as i64, ran, "{path}");
        assert_eq!(
            h.ledger_rows().await,
            ran,
            "{path}: the handler's write committed once"
        );
    }
}

/// A body of known size over the route's stored-body limit is sent whole and its record
/// kept without it, in one chunk too: the transaction took a body whose one chunk reached its
/// declared size for the whole body, before asking whether it fit, and stored all of it
/// (helper review). Framed as a `SizedStream` the engine saw the size before the handler's
/// body was read; without chunking, only its head says it.
#[actix_web::test]
async fn a_body_of_known_size_over_the_limit_is_sent_whole_and_not_stored() {
    let h = start(2).await;
    for (ran, path) in [
        (1_i64, "/ledger-over-the-limit"),
        (2, "/ledger-over-the-limit?unchunked=1"),
    ] {
        let key = format!("over{path}");
        let first = h.post(path, Some(&key)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{path}: {first:?}");
        assert_eq!(first.body, "0123456789", "{path}: {first:?}");

        h.assert_replayed_without_body(path, &key, ran).await;
    }
}

/// What the claim's session asks of the database, as the handler's own connection reads it
/// (`SHOW`): a host that dies without closing its connection would otherwise hold its key
/// until the operating system's keepalive (two hours and more) told the database. That the
/// server then acts on it is PostgreSQL's and the kernel's (no test here can silence a
/// loopback peer's TCP acknowledgements).
#[actix_web::test]
async fn a_claims_session_asks_the_database_to_drop_a_silent_client_within_its_lease() {
    let harness = start(2).await;
    let reply = harness.post("/keepalives", Some("watched")).await;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    // A reply of the server's on its way when the host died is retransmitted instead, and
    // no keepalive is sent meanwhile: the session (and the key) lasted about 15 minutes.
    assert_eq!(
        reply.json(),
        serde_json::json!({
            "keepalives_idle": "20",
            "keepalives_interval": "10",
            "keepalives_count": "3",
            "user_timeout": "50000",
        }),
        "a 60 s lease: silent for 20 s, then 3 probes 10 s apart; unacknowledged for 50 s"
    );
}

/// A database that ends sessions idle in a transaction (`idle_in_transaction_session_timeout`,
/// common on managed PostgreSQL) leaves a claim's transaction alone while its handler is away
/// from the database (calling a payment provider, say): a duplicate still gets 409, and the
/// handler runs once. (The server used to end the session at the timeout, rolling back the
/// claim with its advisory lock: the duplicate ran the handler a second time while the first
/// still ran, and the first got 503.)
#[actix_web::test]
async fn a_duplicate_gets_409_while_the_handler_idles_past_the_databases_timeout() {
    let h = start_on(
        4,
        FailMode::Closed,
        Some("idle_in_transaction_session_timeout = '1s'"),
    )
    .await;
    let first = h.spawn_post("/ledger?hold=1", "k");
    h.runs.wait_for(1).await;
    // Past the timeout, the handler waiting at the gate and its transaction idle.
    actix_rt::time::sleep(Duration::from_millis(1_500)).await;
    // Not held, so that a second run would answer at once.
    let duplicate = h.post("/ledger", Some("k")).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    assert!(!first.is_finished());
    h.gate.open();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = h.post("/ledger?hold=1", Some("k")).await;
    assert!(replay.is_replay(), "{replay:?}");
    assert_eq!((h.runs.get(), h.ledger_rows().await), (1, 1));
}

/// The transaction of a request without a key is left alone, as a claim's is, by a database
/// that ends sessions idle in a transaction: its handler, away from the database past the
/// timeout (calling a payment provider, say), answers 201 and its write commits. (The
/// server ended the session: the write was rolled back and the client got 503, after the
/// provider was called.)
#[actix_web::test]
async fn a_request_without_a_key_idles_past_the_databases_timeout_and_commits() {
    let h = start_on(
        4,
        FailMode::Closed,
        Some("idle_in_transaction_session_timeout = '1s'"),
    )
    .await;
    let request = h.server.post("/ledger?hold=1");
    let first = actix_rt::spawn(async move { Reply::read(request.send().await.unwrap()).await });
    h.runs.wait_for(1).await;
    // Past the timeout, the handler waiting at the gate and its transaction idle.
    actix_rt::time::sleep(Duration::from_millis(1_500)).await;
    h.gate.open();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!((h.runs.get(), h.ledger_rows().await), (1, 1));
}

/// After the server ended the pool's sessions (a restart, a failover), the pool still holds
/// the closed connections: a transactional claim, the transaction of a request without a key
/// and a plain route's steps each pass over them to a live one and are served. (A
/// transactional request used to answer 503 for each closed connection it met; any request,
/// when it met two.)
#[actix_web::test]
async fn requests_after_the_server_ended_the_pools_sessions_are_served() {
    let h = start(8).await;
    // Several connections in the pool: requests held at once.
    let held: Vec<_> = (0..4)
        .map(|n| h.spawn_post("/ledger?hold=1", &format!("before-{n}")))
        .collect();
    h.runs.wait_for(4).await;
    h.gate.open();
    for reply in held {
        assert_eq!(reply.await.unwrap().unwrap().status, StatusCode::CREATED);
    }
    let ended = h.end_the_other_sessions().await;
    assert!(ended >= 4, "{ended} sessions ended");
    let keyed = h.post("/ledger", Some("after")).await;
    assert_eq!(keyed.status, StatusCode::CREATED, "{keyed:?}");
    let keyless = h.post("/ledger", None).await;
    assert_eq!(keyless.status, StatusCode::CREATED, "{keyless:?}");
    let plain = h.post("/plain", Some("after-plain")).await;
    assert_eq!(plain.status, StatusCode::CREATED, "{plain:?}");
    assert_eq!((h.runs.get(), h.ledger_rows().await), (7, 6));
    let replay = h.post("/ledger", Some("after")).await;
    assert!(replay.is_replay(), "{replay:?}");
}

/// A transactional claim whose session the server ends while it runs (here while it waits
/// for the key's expired row, which another transaction holds) is sent again on a live
/// connection, and the request is served. (The claim met PostgreSQL's FATAL error before
/// its connection had read the end of the socket, so the connection was not seen as lost:
/// 503.)
#[actix_web::test]
async fn a_claim_whose_session_ends_while_it_runs_is_sent_again() {
    let h = start(4).await;
    assert_eq!(
        h.post("/ledger", Some("k")).await.status,
        StatusCode::CREATED
    );
    let writer = h.lapse_and_hold_the_records().await;
    let claim = h.spawn_post("/ledger", "k");
    let waiting = "FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let mut ended = 0;
    for _ in 0..500 {
        ended = h
            .count(&format!(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) {waiting}) ended"
            ))
            .await;
        if ended > 0 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ended, 1, "the claim waits for the row");
    writer.batch_execute("COMMIT").await.unwrap();
    let claimed = claim.await.unwrap().unwrap();
    assert_eq!(claimed.status, StatusCode::CREATED, "{claimed:?}");
    assert_eq!((h.runs.get(), h.ledger_rows().await), (2, 2));
}

/// A missing table (`migrate` never run, or the table dropped) is a store failure: 503 with
/// `Retry-After` on a plain and on a transactional route, never a panic, and no handler runs.
#[actix_web::test]
async fn a_missing_table_is_503_on_both_kinds_of_route() {
    let h = start(4).await;
    h.database
        .connection()
        .await
        .batch_execute("DROP TABLE idempotency_records")
        .await
        .unwrap();
    for path in ["/plain", "/ledger"] {
        let reply = h.post(path, Some("k")).await;
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{path}: {reply:?}"
        );
        assert!(reply.header("retry-after").is_some(), "{path}");
    }
    assert_eq!((h.runs.get(), h.ledger_rows().await), (0, 0));
}

/// A database whose default isolation is stricter than READ COMMITTED (as an app sets it
/// with `default_transaction_isolation` for its transactional routes to run serializable):
/// duplicates sent at once, on a plain route and on a transactional one that waits, get
/// the replay, and each key's handler runs once, on a fail-open app too. (A duplicate whose
/// `begin` or claim met the first request's record, committed after its snapshot, failed to
/// serialize: a store error, so a 503, and on a fail-open app a second run of the handler.)
#[actix_web::test]
async fn duplicates_run_once_under_a_stricter_default_isolation() {
    let keys = 10;
    for isolation in ["repeatable read", "serializable"] {
        let setting = format!("default_transaction_isolation = '{isolation}'");
        // Connections for every duplicate at once: none waits for one and times out.
        let h = start_on(40, FailMode::Open, Some(&setting)).await;
        for path in ["/plain", "/ledger-waits"] {
            for n in 0..keys {
                let key = format!("{path}-{n}");
                let duplicates: Vec<_> = (0..30).map(|_| h.spawn_post(path, &key)).collect();
                for duplicate in duplicates {
                    let reply = duplicate.await.unwrap().unwrap();
                    assert!(
                        [StatusCode::CREATED, StatusCode::CONFLICT].contains(&reply.status),
                        "{isolation} {path}: {reply:?}"
                    );
                }
            }
            let ran = if path == "/plain" { keys } else { 2 * keys };
            assert_eq!(h.runs.get(), ran, "{isolation} {path}: runs once per key");
        }
        assert_eq!(
            h.ledger_rows().await,
            i64::try_from(keys).unwrap(),
            "{isolation}"
        );
    }
}

/// The race of the test above, step by step, under `REPEATABLE READ` by default: a
/// duplicate's `begin` (plain route) or claim (transactional route) takes its snapshot, then
/// meets the key's row being written (here by hand, as another request's commit writes it)
/// and committed after that snapshot. It gets the replay, on a fail-open app too, and the
/// handler ran once. (It failed to serialize: a 503, and with fail-open a second run.)
#[actix_web::test]
async fn a_duplicate_that_meets_a_row_committed_after_its_snapshot_is_replayed() {
    let h = start_on(
        4,
        FailMode::Open,
        Some("default_transaction_isolation = 'repeatable read'"),
    )
    .await;
    for (n, path) in ["/plain", "/ledger"].into_iter().enumerate() {
        let first = h.post(path, Some(path)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{path}: {first:?}");
        // The record lapses, and a writer holds its row: the duplicate's statement, which
        // would take an expired row over, waits for it after taking its snapshot.
        let writer = h.lapse_and_hold_the_records().await;
        let duplicate = h.spawn_post(path, path);
        let waiting = "SELECT count(*) FROM pg_stat_activity \
                       WHERE datname = current_database() AND wait_event_type = 'Lock'";
        for _ in 0..500 {
            if h.count(waiting).await > 0 {
                break;
            }
            actix_rt::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(h.count(waiting).await, 1, "{path}: the duplicate waits");
        // The record is live again, committed after the duplicate's snapshot.
        writer
            .batch_execute(
                "UPDATE idempotency_records SET expires_at = now() + interval '1 hour'; COMMIT",
            )
            .await
            .unwrap();
        let duplicate = duplicate.await.unwrap().unwrap();
        assert!(duplicate.is_replay(), "{path}: {duplicate:?}");
        assert_eq!(duplicate.body, first.body, "{path}");
        assert_eq!(h.runs.get(), n + 1, "{path}: the handler ran once");
    }
    assert_eq!(h.ledger_rows().await, 1);
}

/// A store on which `migrate()` never ran (another instance, or a DBA, made the table) gets
/// its very first requests all at once, as many as its pool has connections, each holding
/// its connection (a transactional claim's transaction, held here while its handler waits
/// at the gate; a plain route's `begin`): every one is served, its handler runs once, and
/// its retry gets the replay. (The table was looked up on a second pooled connection: each
/// request held one and waited for another until the store timeout, 503, and on a pool of
/// one connection every request was refused, as none ever resolved the table.)
#[actix_web::test]
async fn a_first_burst_as_large_as_the_pool_is_served_where_migrate_did_not_run() {
    for path in ["/ledger", "/plain"] {
        for connections in [1, 4] {
            let h = start_without_migrate(connections).await;
            let keys: Vec<_> = (0..connections).map(|n| format!("k-{n}")).collect();
            let burst: Vec<_> = keys
                .iter()
                .map(|key| h.spawn_post(&format!("{path}?hold=1"), key))
                .collect();
            let ran = usize::try_from(connections).unwrap();
            // Until every handler runs (the transactional ones at the gate, all at once) or
            // a request is answered without (refused).
            for _ in 0..1_000 {
                if h.runs.get() == ran || burst.iter().any(|reply| reply.is_finished()) {
                    break;
                }
                actix_rt::time::sleep(Duration::from_millis(10)).await;
            }
            let all_at_once = h.runs.get() == ran;
            h.gate.open();
            let mut first = Vec::new();
            for reply in burst {
                let reply = reply.await.unwrap().unwrap();
                assert_eq!(
                    reply.status,
                    StatusCode::CREATED,
                    "{path}, {connections} connections: {reply:?}"
                );
                first.push(reply);
            }
            if path == "/ledger" {
                // Each in its own claim's transaction, the pool's every connection held.
                assert!(all_at_once, "every handler ran at once");
            }
            for (key, first) in keys.iter().zip(&first) {
                let retry = h.post(&format!("{path}?hold=1"), Some(key)).await;
                assert!(retry.is_replay(), "{path}: {retry:?}");
                assert_eq!(retry.body, first.body);
            }
            assert_eq!(h.runs.get(), ran, "{path}: each handler ran once");
            let rows = if path == "/ledger" { connections } else { 0 };
            assert_eq!(h.ledger_rows().await, i64::from(rows), "{path}");
        }
    }
}

/// Two instances that name one table differently (`idempotency_records`, and
/// `public.idempotency_records` as another service's configuration spells it) exclude each
/// other's transactional claims: a duplicate sent to the other instance while the first runs
/// gets 409 at once, and its retry the replay. (The keys' advisory locks were named after
/// the table's name as written: the duplicate's claim missed the first's lock and waited on
/// its uncommitted row until the store timeout, a 503.)
#[actix_web::test]
async fn instances_that_spell_the_table_differently_exclude_each_other() {
    let h = start(4).await;
    let store = PostgresStore::new(PostgresStore::pool(h.database.url()).unwrap())
        .table("public.idempotency_records")
        .unwrap();
    store.migrate().await.unwrap();
    let other = serve(store, FailMode::Closed, &h.runs, &h.gate);
    let send = |server: &actix_test::TestServer| {
        let request = server
            .post("/ledger?hold=1")
            .insert_header(("idempotency-key", "k"));
        async move { Reply::read(request.send().await.unwrap()).await.unwrap() }
    };
    let first = h.spawn_post("/ledger?hold=1", "k");
    h.runs.wait_for(1).await;
    let duplicate = send(&other).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    h.gate.open();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = send(&other).await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    assert_eq!((h.runs.get(), h.ledger_rows().await), (1, 1));
}

/// A handler that sets `search_path` (to its tenant's schema, say) inside the transaction it
/// shares with the store: its write and the record commit, and the retry replays. With
/// `scope` `session` the pool's one connection keeps that `search_path` for the requests
/// after, which are served as ever. (The store named its table without a schema: its
/// completion found no table, the transaction rolled back, and the client got a 503 after
/// the handler ran.)
async fn a_handler_that_sets_search_path_leaves_the_store_its_table(scope: &str) {
    let h = start(1).await;
    h.database
        .connection()
        .await
        .batch_execute(&format!(
            "CREATE SCHEMA tenant_a; {}",
            LEDGER.replace("ledger", "tenant_a.ledger")
        ))
        .await
        .unwrap();
    let path = format!("/tenant-ledger?scope={scope}");
    let first = h.post(&path, Some("k")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let retry = h.post(&path, Some("k")).await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, first.body);
    let plain = h.post("/plain", Some("p")).await;
    assert_eq!(plain.status, StatusCode::CREATED, "{plain:?}");
    assert!(h.post("/plain", Some("p")).await.is_replay());
    assert_eq!(h.runs.get(), 2);
    assert_eq!(h.count("SELECT count(*) FROM tenant_a.ledger").await, 1);
    assert_eq!(h.records().await, 2);
}

#[actix_web::test]
async fn a_handler_that_sets_search_path_for_its_transaction_leaves_the_store_its_table() {
    a_handler_that_sets_search_path_leaves_the_store_its_table("local").await;
}

#[actix_web::test]
async fn a_handler_that_sets_search_path_for_its_session_leaves_the_store_its_table() {
    a_handler_that_sets_search_path_leaves_the_store_its_table("session").await;
}

/// A database whose default isolation is `serializable`: transactional requests for
/// different keys at once all commit. (The claim read the key's index page and the
/// completion looked the key up again, each a predicate lock on that page; the claims of
/// other keys on the page wrote into it, and most of the transactions failed to serialize
/// at their commit: 503 after the handler ran, most of thirty at once on a young table.)
#[actix_web::test]
async fn transactions_of_different_keys_commit_side_by_side_under_serializable() {
    let h = start_on(
        40,
        FailMode::Closed,
        Some("default_transaction_isolation = 'serializable'"),
    )
    .await;
    let sent: Vec<_> = (0..30)
        .map(|n| h.spawn_post("/ledger", &format!("key-{n}")))
        .collect();
    for reply in sent {
        let reply = reply.await.unwrap().unwrap();
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
    }
    assert_eq!((h.runs.get(), h.ledger_rows().await), (30, 30));
    assert_eq!(h.records().await, 30);
}

/// A database made serializable after the store started (its sessions from then on are):
/// once a transaction has failed to serialize, requests for different keys at once commit
/// side by side again, without a restart.
#[actix_web::test]
async fn a_database_made_serializable_while_the_app_runs_is_served_without_a_restart() {
    let h = start(40).await;
    let admin = h.database.connection().await;
    set_for_new_sessions(&admin, "default_transaction_isolation = 'serializable'").await;
    let mut created = 0;
    let mut batches_all_created = 0;
    for batch in 0..3 {
        let sent: Vec<_> = (0..30)
            .map(|n| h.spawn_post("/ledger", &format!("key-{batch}-{n}")))
            .collect();
        let mut all = true;
        for reply in sent {
            let reply = reply.await.unwrap().unwrap();
            match reply.status {
                StatusCode::CREATED => created += 1,
                // Failed to serialize at the commit (503), or at the handler's own insert,
                // which it unwraps (500).
                status => {
                    assert!(
                        [
                            StatusCode::SERVICE_UNAVAILABLE,
                            StatusCode::INTERNAL_SERVER_ERROR
                        ]
                        .contains(&status),
                        "{reply:?}"
                    );
                    all = false;
                }
            }
        }
        batches_all_created += usize::from(all);
    }
    assert!(
        batches_all_created >= 2,
        "{batches_all_created} of 3 batches all created"
    );
    // Nothing of a request that failed is left.
    assert_eq!(h.ledger_rows().await, created);
    assert_eq!(h.records().await, created);
}

/// A worker stopped while its transactional handler held the request's transaction (a
/// server stopped without waiting, a worker restarted): its connection must not go back to
/// the pool, which the app's other workers share, inside that transaction. It went back
/// with the transaction open (its rollback was left to a task of the stopping runtime, which
/// never ran it): the next requests on that connection ran inside the dead request's
/// transaction, so a retry of its key got 409 from its uncommitted claim, and the rollback
/// that followed undid a plain route's committed record too, whose retry then ran its
/// handler again (helper review).
#[actix_web::test]
async fn a_stopped_workers_transaction_does_not_go_back_to_the_pool_open() {
    let database = ledger_database().await;
    // One connection, made here: on the test's runtime, which outlives the server's
    // workers, as a connection another worker made does.
    let pool = pool(&database, 1);
    drop(pool.get().await.expect("a pooled connection"));
    let store = PostgresStore::new(pool);
    store.migrate().await.expect("migrate");

    let (runs, gate) = (RunCounter::default(), Gate::default());
    let stopped = serve(store.clone(), FailMode::Closed, &runs, &gate);
    let held = stopped
        .post("/ledger?hold=1")
        .insert_header(("idempotency-key", "k"))
        .send();
    let held = actix_rt::spawn(held);
    runs.wait_for(1).await;
    stopped.stop().await;
    let _ = held.await;

    let (runs, gate) = (RunCounter::default(), Gate::default());
    gate.open();
    let server = serve(store, FailMode::Closed, &runs, &gate);
    let post = |path: &'static str, key: &'static str| {
        let request = server
            .post(path)
            .insert_header(("idempotency-key", key))
            .timeout(Duration::from_secs(10));
        async move {
            Reply::read(request.send().await.expect("an answer"))
                .await
                .expect("a body")
        }
    };
    let plain = post("/plain", "p").await;
    assert_eq!(plain.status, StatusCode::CREATED, "{plain:?}");
    let retry = post("/ledger?hold=1", "k").await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.is_replay(), "{retry:?}");
    let replay = post("/plain", "p").await;
    assert!(replay.is_replay(), "the plain route ran again: {replay:?}");
    assert_eq!(replay.body, plain.body);
    assert_eq!(runs.get(), 2, "p once, and the retry of k");
}
