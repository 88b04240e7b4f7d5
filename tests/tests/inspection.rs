//! Inspection (issue 11 item 4): look up and delete one record by (scope, key), on every
//! store. Each test runs once per backend (memory, Redis, PostgreSQL, Redis Cluster), like
//! the acceptance suite; the last one goes through a real app and shows what deleting a record
//! does for the next request. (That a transactional route's claim on PostgreSQL, which lives
//! inside its transaction, shows as in flight and cannot be deleted is tested in
//! `transactional.rs`.)

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::{Method, StatusCode, header::HeaderName, header::HeaderValue};
use actix_web::web::Bytes;
use actix_web::{App, HttpResponse, web};
use idempotency_actix::{
    BeginOutcome, Deletion, Fingerprint, Idempotency, IdempotencyStore, IdempotentRoute,
    InspectionError, Inspector, LeaseToken, RecordError, RecordState, StoreError, StoredResponse,
};
use idempotency_actix_tests::{Reply, RunCounter};

const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(600);

fn print() -> Fingerprint {
    Fingerprint::compute(&Method::POST, "/orders", "", b"{}", [])
}

fn response() -> StoredResponse {
    StoredResponse::new(
        StatusCode::CREATED,
        vec![(
            HeaderName::from_static("location"),
            HeaderValue::from_static("/orders/1"),
        )],
        Some(Bytes::from_static(b"{\"id\":1}")),
    )
}

/// Begins `key` in `scope` (and commits it when `complete`) the way the middleware does.
async fn record<S: IdempotencyStore>(
    inspector: &Inspector<S>,
    store: &S,
    scope: &[u8],
    key: &str,
    complete: bool,
) -> LeaseToken {
    let storage_key = inspector.storage_key(scope, key).unwrap();
    let token = LeaseToken::generate();
    let begun = store.begin(&storage_key, &print(), &token, LEASE).await;
    assert_eq!(begun.unwrap(), BeginOutcome::Acquired);
    if complete {
        let committed = store
            .commit(&storage_key, &print(), &token, &response(), TTL)
            .await;
        assert!(committed.unwrap());
    }
    token
}

async fn begin_again<S: IdempotencyStore>(
    inspector: &Inspector<S>,
    store: &S,
    key: &str,
) -> BeginOutcome {
    let storage_key = inspector.storage_key(b"", key).unwrap();
    let token = LeaseToken::generate();
    store
        .begin(&storage_key, &print(), &token, LEASE)
        .await
        .unwrap()
}

async fn a_missing_record_is_not_found<S: IdempotencyStore + Clone>(store: S, prefix: String) {
    let inspector = Inspector::new(store).key_prefix(prefix);
    assert_eq!(inspector.lookup(b"", "nothing").await.unwrap(), None);
    assert_eq!(
        inspector.delete(b"", "nothing").await.unwrap(),
        Deletion::NotFound
    );
    assert_eq!(
        inspector.force_delete(b"", "nothing").await.unwrap(),
        Deletion::NotFound
    );
}

async fn a_completed_record_shows_its_response_and_the_body_only_when_asked<
    S: IdempotencyStore + Clone,
>(
    store: S,
    prefix: String,
) {
    let inspector = Inspector::new(store.clone()).key_prefix(prefix);
    record(&inspector, &store, b"", "order-1", true).await;

    // Both forms of the key name the same record.
    let found = inspector.lookup(b"", "\"order-1\"").await.unwrap().unwrap();
    assert_eq!(found.state, RecordState::Completed);
    assert_eq!(found.status, Some(StatusCode::CREATED));
    assert_eq!(found.headers, response().headers);
    assert_eq!(found.body_size, Some(8));
    assert_eq!(found.body, None, "the body only when asked");
    let expires_in = found.expires_in.unwrap();
    assert!(expires_in <= TTL && expires_in > TTL - Duration::from_secs(60));

    let with_body = inspector.lookup_with_body(b"", "order-1").await.unwrap();
    assert_eq!(
        with_body.unwrap().body,
        Some(Bytes::from_static(b"{\"id\":1}"))
    );
}

async fn an_in_flight_record_is_deleted_only_when_forced<S: IdempotencyStore + Clone>(
    store: S,
    prefix: String,
) {
    let inspector = Inspector::new(store.clone()).key_prefix(prefix);
    record(&inspector, &store, b"", "running", false).await;

    let found = inspector.lookup(b"", "running").await.unwrap().unwrap();
    assert_eq!(found.state, RecordState::InFlight);
    assert_eq!((found.status, found.body_size), (None, None));
    assert!(found.expires_in.unwrap() <= LEASE);

    assert_eq!(
        inspector.delete(b"", "running").await.unwrap(),
        Deletion::InFlight
    );
    assert_eq!(
        begin_again(&inspector, &store, "running").await,
        BeginOutcome::InFlight,
        "a refused deletion changes nothing"
    );
    assert_eq!(
        inspector.force_delete(b"", "running").await.unwrap(),
        Deletion::Deleted
    );
    assert_eq!(inspector.lookup(b"", "running").await.unwrap(), None);
    assert_eq!(
        begin_again(&inspector, &store, "running").await,
        BeginOutcome::Acquired
    );
}

async fn deleting_a_completed_record_lets_the_key_run_again<S: IdempotencyStore + Clone>(
    store: S,
    prefix: String,
) {
    let inspector = Inspector::new(store.clone()).key_prefix(prefix);
    record(&inspector, &store, b"", "done", true).await;
    assert!(matches!(
        begin_again(&inspector, &store, "done").await,
        BeginOutcome::Completed(_)
    ));
    assert_eq!(
        inspector.delete(b"", "done").await.unwrap(),
        Deletion::Deleted
    );
    assert_eq!(inspector.lookup(b"", "done").await.unwrap(), None);
    assert_eq!(
        begin_again(&inspector, &store, "done").await,
        BeginOutcome::Acquired
    );
}

async fn scopes_are_kept_apart<S: IdempotencyStore + Clone>(store: S, prefix: String) {
    let inspector = Inspector::new(store.clone()).key_prefix(prefix);
    record(&inspector, &store, b"tenant-a", "shared", true).await;
    assert!(
        inspector
            .lookup(b"tenant-a", "shared")
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(inspector.lookup(b"tenant-b", "shared").await.unwrap(), None);
    assert_eq!(
        inspector.delete(b"tenant-b", "shared").await.unwrap(),
        Deletion::NotFound
    );
    assert!(
        inspector
            .lookup(b"tenant-a", "shared")
            .await
            .unwrap()
            .is_some()
    );
}

async fn an_invalid_key_is_an_error<S: IdempotencyStore + Clone>(store: S, prefix: String) {
    let inspector = Inspector::new(store).key_prefix(prefix);
    let error = inspector.lookup(b"", "\"unbalanced").await.unwrap_err();
    assert!(matches!(error, InspectionError::InvalidKey(_)), "{error}");
}

/// An app on `store` under `prefix` whose `POST /orders` answers 201 `run N`, counted in
/// `runs`.
fn orders_app<S: IdempotencyStore + Clone + Send>(
    store: S,
    prefix: String,
    runs: RunCounter,
) -> actix_test::TestServer {
    actix_test::start(move || {
        let runs = runs.clone();
        App::new()
            .wrap(Idempotency::new(store.clone()).key_prefix(prefix.clone()))
            .service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(move || {
                        let run = runs.record();
                        async move { HttpResponse::Created().body(format!("run {run}")) }
                    })),
            )
    })
}

/// `POST /orders` with the idempotency key `key`.
async fn send_order(server: &actix_test::TestServer, key: &str) -> Reply {
    let request = server
        .post("/orders")
        .insert_header(("idempotency-key", format!("\"{key}\"")));
    Reply::read(request.send_body("{}").await.unwrap())
        .await
        .unwrap()
}

/// Through a real app: a completed request is seen, and after its record is deleted the
/// same request runs the handler again.
async fn a_deleted_record_lets_the_app_run_the_handler_again<S: IdempotencyStore + Clone + Send>(
    store: S,
    prefix: String,
) {
    let runs = RunCounter::default();
    let server = orders_app(store.clone(), prefix.clone(), runs.clone());
    let send = || send_order(&server, "support-1");
    assert_eq!(send().await.body, "run 1");
    assert!(send().await.is_replay());

    let inspector = Inspector::new(store).key_prefix(prefix);
    let found = inspector.lookup_with_body(b"", "support-1").await.unwrap();
    let found = found.unwrap();
    assert_eq!(found.state, RecordState::Completed);
    assert_eq!(found.status, Some(StatusCode::CREATED));
    assert_eq!(found.body.as_deref(), Some(&b"run 1"[..]));

    assert_eq!(
        inspector.delete(b"", "support-1").await.unwrap(),
        Deletion::Deleted
    );
    let again = send().await;
    assert_eq!(
        (again.status, again.is_replay()),
        (StatusCode::CREATED, false)
    );
    assert_eq!(again.body, "run 2");
    assert_eq!(runs.get(), 2);
}

macro_rules! inspection_suite {
    ($backend:ident, $make_store:expr) => {
        mod $backend {
            inspection_suite!(@tests $make_store;
                a_missing_record_is_not_found,
                a_completed_record_shows_its_response_and_the_body_only_when_asked,
                an_in_flight_record_is_deleted_only_when_forced,
                deleting_a_completed_record_lets_the_key_run_again,
                scopes_are_kept_apart,
                an_invalid_key_is_an_error,
                a_deleted_record_lets_the_app_run_the_handler_again,
            );
        }
    };
    // A backend that needs a database of the test's own: `$make_store` gets it.
    ($backend:ident, database => $make_store:expr) => {
        mod $backend {
            inspection_suite!(@database $make_store;
                a_missing_record_is_not_found,
                a_completed_record_shows_its_response_and_the_body_only_when_asked,
                an_in_flight_record_is_deleted_only_when_forced,
                deleting_a_completed_record_lets_the_key_run_again,
                scopes_are_kept_apart,
                an_invalid_key_is_an_error,
                a_deleted_record_lets_the_app_run_the_handler_again,
            );
        }
    };
    (@database $make_store:expr; $($test:ident),* $(,)?) => {
        $(
            #[actix_web::test]
            async fn $test() {
                let prefix = idempotency_actix_tests::unique_prefix(stringify!($test));
                let database = idempotency_actix_tests::TestDatabase::create().await;
                super::$test($make_store(&database).await, prefix).await;
            }
        )*
    };
    (@tests $make_store:expr; $($test:ident),* $(,)?) => {
        $(
            #[actix_web::test]
            async fn $test() {
                let prefix = idempotency_actix_tests::unique_prefix(stringify!($test));
                super::$test($make_store, prefix).await;
            }
        )*
    };
}

inspection_suite!(memory, idempotency_actix::MemoryStore::new());
inspection_suite!(
    redis,
    idempotency_actix::RedisStore::new(idempotency_actix_tests::redis_pool().await)
);
inspection_suite!(
    postgres,
    database => idempotency_actix_tests::TestDatabase::store
);
inspection_suite!(
    redis_cluster,
    idempotency_actix::RedisClusterStore::new(
        idempotency_actix_tests::cluster::RedisCluster::shared().client()
    )
);

/// A Redis key of another type under the prefix, with no expiry (another program's), would
/// refuse every request with its key for good: a lookup and a plain deletion say what it
/// is, a forced deletion removes it, and the next request runs the handler.
#[actix_web::test]
async fn a_key_of_another_type_is_reported_and_removed_only_when_forced() {
    let (store, prefix) = (
        idempotency_actix::RedisStore::new(idempotency_actix_tests::redis_pool().await),
        idempotency_actix_tests::unique_prefix("inspect-other-type"),
    );
    let inspector = Inspector::new(store.clone()).key_prefix(prefix.clone());
    let storage_key = inspector.storage_key(b"", "support-2").unwrap();
    let mut connection = idempotency_actix_tests::redis_connection().await;
    let _: () = ::redis::cmd("HSET")
        .arg(storage_key.as_str())
        .arg("field")
        .arg("value")
        .query_async(&mut connection)
        .await
        .unwrap();

    let runs = RunCounter::default();
    let server = orders_app(store, prefix, runs.clone());
    let send = || send_order(&server, "support-2");
    assert_eq!(send().await.status, StatusCode::SERVICE_UNAVAILABLE);

    let other_type = |error: InspectionError| {
        matches!(
            error,
            InspectionError::Store(StoreError::Corrupt(RecordError::OtherType))
        )
    };
    let looked_up = inspector.lookup(b"", "support-2").await.unwrap_err();
    assert!(other_type(looked_up), "lookup");
    let deleted = inspector.delete(b"", "support-2").await.unwrap_err();
    assert!(other_type(deleted), "delete");
    assert_eq!(
        inspector.force_delete(b"", "support-2").await.unwrap(),
        Deletion::Deleted
    );
    let exists: u64 = ::redis::cmd("EXISTS")
        .arg(storage_key.as_str())
        .query_async(&mut connection)
        .await
        .unwrap();
    assert_eq!(exists, 0, "the key of another type is still there");

    let again = send().await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, "run 1");
    assert_eq!(runs.get(), 1);
}

/// A support user with only the rights README's "The Redis user's rights" names for an
/// Inspector (`EVAL`, and `GET`, `PTTL`, `GETRANGE`, `DEL` inside it) looks up and deletes,
/// forced, an in-flight record and a key of another type.
#[actix_web::test]
async fn a_support_user_with_the_listed_rights_force_deletes() {
    let redis = idempotency_actix_tests::PrivateRedis::start().await;
    let mut admin = redis.connection().await;
    let _: () = ::redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "support",
            "on",
            ">pw",
            "~*",
            "resetchannels",
            "-@all",
            "+eval",
            "+get",
            "+pttl",
            "+getrange",
            "+del",
            "+fcall",
            "+fcall_ro",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://support:pw@127.0.0.1:{}", redis.port());
    let support = Inspector::new(idempotency_actix::RedisStore::new(
        idempotency_actix::RedisStore::pool(&url).unwrap(),
    ));
    let store = idempotency_actix::RedisStore::new(
        idempotency_actix::RedisStore::pool(&redis.url()).unwrap(),
    );
    record(&Inspector::new(store.clone()), &store, b"", "stuck", false).await;
    let found = support.lookup(b"", "stuck").await.unwrap().unwrap();
    assert_eq!(found.state, RecordState::InFlight);
    assert_eq!(
        support.delete(b"", "stuck").await.unwrap(),
        Deletion::InFlight
    );
    assert_eq!(
        support.force_delete(b"", "stuck").await.unwrap(),
        Deletion::Deleted
    );

    let other = support.storage_key(b"", "other").unwrap();
    let _: () = ::redis::cmd("HSET")
        .arg(other.as_str())
        .arg("field")
        .arg("value")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(
        support.force_delete(b"", "other").await.unwrap(),
        Deletion::Deleted
    );
    assert_eq!(
        support.force_delete(b"", "other").await.unwrap(),
        Deletion::NotFound
    );
}

/// A store that does not answer fails a lookup or a deletion at the inspector's timeout
/// instead of hanging the support tool that called it (a private Redis, paused).
#[actix_web::test]
async fn a_store_that_does_not_answer_fails_at_the_timeout() {
    use idempotency_actix::{RedisStore, StoreError};

    let server = idempotency_actix_tests::PrivateRedis::start().await;
    let store = RedisStore::new(RedisStore::pool(&server.url()).unwrap());
    let inspector = Inspector::new(store).timeout(Duration::from_millis(300));
    // Answers while Redis does (and opens the store's connection).
    assert!(inspector.lookup(b"", "k").await.unwrap().is_none());
    let _: () = ::redis::cmd("CLIENT")
        .arg(&["PAUSE", "5000", "ALL"])
        .query_async(&mut server.connection().await)
        .await
        .unwrap();
    let looked = inspector.lookup(b"", "k").await;
    assert!(
        matches!(looked, Err(InspectionError::Store(StoreError::Timeout(limit))) if limit == Duration::from_millis(300)),
        "{looked:?}"
    );
    let deleted = inspector.force_delete(b"", "k").await;
    assert!(
        matches!(deleted, Err(InspectionError::Store(StoreError::Timeout(_)))),
        "{deleted:?}"
    );
}

/// A connection that goes silent (a firewall or NAT that drops the flow: nothing closes the
/// socket) is left for a new one, as the middleware's requests leave it, so that lookups
/// work again once the store is reachable. The inspector's own store (a clone has its own
/// connection) sent its commands with no deadline the connection knew of, so it never took
/// the connection for silent: every lookup failed at the timeout until the kernel gave the
/// socket up, about 15 minutes, or for good where the flow still took the bytes.
#[actix_web::test]
async fn an_inspector_leaves_a_connection_that_went_silent() {
    use idempotency_actix::{RedisStore, StoreError};
    use idempotency_actix_tests::{MovableAddress, PrivateRedis, unique_prefix};

    let server = PrivateRedis::start().await;
    let address = MovableAddress::to(server.port());
    let url = format!("redis://127.0.0.1:{}", address.port());
    let store = RedisStore::new(RedisStore::pool(&url).expect("a pool"));
    let inspector = Inspector::new(store)
        .key_prefix(unique_prefix("inspect-silent"))
        .timeout(Duration::from_millis(300));
    // Opens the store's connection.
    let looked = inspector.lookup(b"", "k").await.expect("a lookup");
    assert!(looked.is_none(), "{looked:?}");

    address.silence_open_connections();
    // Each attempt takes the timeout at most: 40 of them, 12 s, where the connection is
    // left about 2.3 s in.
    let mut failed = 0;
    loop {
        match inspector.lookup(b"", "k").await {
            Ok(looked) => {
                assert!(looked.is_none(), "{looked:?}");
                break;
            }
            Err(InspectionError::Store(StoreError::Timeout(_))) => failed += 1,
            Err(error) => panic!("a lookup failed otherwise: {error:?}"),
        }
        assert!(
            failed < 40,
            "the inspector kept its silent connection for 12 s"
        );
    }
    assert!(failed > 0, "the connection never went silent");
}
