//! The reference server on PostgreSQL (`DATABASE_URL`) as a real process: crashes at every
//! point of a transactional request (`std::process::abort` through `X-Crash`), a crash on a
//! plain route, the `/ledger` routes (also beside `IDEMPOTENCY_METHODS` without POST), and
//! the store variables that exclude each other.
//!
//! Each test runs its servers on a database of its own on the server at `DATABASE_URL`
//! (default postgres://postgres@127.0.0.1:5432/postgres).

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use actix_web::http::StatusCode;
use idempotency_actix_tests::{ReferenceServer, Reply, TestDatabase};
use serde_json::json;

fn client() -> awc::Client {
    awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish()
}

fn start(database: &TestDatabase) -> ReferenceServer {
    ReferenceServer::start(&[("DATABASE_URL", database.url())])
}

/// `POST /ledger` with `amount`, a key, and `X-Crash` if given; `None` when the connection
/// broke instead of an answer (the server aborted).
async fn book(
    server: &ReferenceServer,
    key: &str,
    amount: i64,
    crash: Option<&str>,
) -> Option<Reply> {
    let mut request = client()
        .post(server.url("/ledger"))
        .insert_header(("idempotency-key", key));
    if let Some(point) = crash {
        request = request.insert_header(("x-crash", point));
    }
    let response = request.send_json(&json!({ "amount": amount })).await.ok()?;
    Reply::read(response).await.ok()
}

/// The retry after a restart. The database rolls back the transaction of a connection that
/// died as soon as it notices; a retry that comes first gets 409, so retry those for a while.
async fn retry_until_not_in_flight(server: &ReferenceServer, key: &str, amount: i64) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = book(server, key, amount, None).await.unwrap();
        if reply.status != StatusCode::CONFLICT || Instant::now() > deadline {
            return reply;
        }
        actix_rt::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn ledger_rows(server: &ReferenceServer) -> i64 {
    let response = client().get(server.url("/ledger")).send().await.unwrap();
    let reply = Reply::read(response).await.unwrap();
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    reply.json()["rows"].as_i64().unwrap()
}

fn assert_aborted(server: &mut ReferenceServer) {
    let status = server
        .wait_for_exit()
        .expect("the server exits after X-Crash");
    assert!(!status.success(), "{status:?}");
    assert!(server.stderr().contains("X-Crash"), "{}", server.stderr());
}

#[actix_web::test]
async fn a_crash_before_the_commit_leaves_nothing_and_the_retry_runs_once() {
    let database = TestDatabase::create().await;
    let mut server = start(&database);
    assert!(
        book(&server, "crash-before", 40, Some("before_commit"))
            .await
            .is_none()
    );
    assert_aborted(&mut server);

    let server = start(&database);
    assert_eq!(ledger_rows(&server).await, 0);
    let retry = retry_until_not_in_flight(&server, "crash-before", 40).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.is_replay());
    assert_eq!(retry.json()["amount"], 40);
    assert_eq!(ledger_rows(&server).await, 1);
    // And from then on it is replayed.
    let again = book(&server, "crash-before", 40, None).await.unwrap();
    assert!(again.is_replay());
    assert_eq!(again.body, retry.body);
    assert_eq!(ledger_rows(&server).await, 1);
}

#[actix_web::test]
async fn a_crash_after_the_commit_is_replayed_on_retry() {
    let database = TestDatabase::create().await;
    let mut server = start(&database);
    assert!(
        book(&server, "crash-after", 7, Some("after_commit"))
            .await
            .is_none()
    );
    assert_aborted(&mut server);

    let server = start(&database);
    assert_eq!(ledger_rows(&server).await, 1);
    let retry = book(&server, "crash-after", 7, None).await.unwrap();
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.json()["amount"], 7);
    assert_eq!(retry.json()["seq"], 1);
    assert_eq!(ledger_rows(&server).await, 1);
}

#[actix_web::test]
async fn a_crash_on_a_plain_route_leaves_a_record_in_flight_until_its_lease_ends() {
    let database = TestDatabase::create().await;
    let mut server = start(&database);
    let order = json!({ "item": "book", "qty": 1 });
    let request = client()
        .post(server.url("/orders?delay_ms=5000"))
        .insert_header(("idempotency-key", "plain-crash"))
        .send_json(&order);
    let running = actix_rt::spawn(request);
    // The record is in flight once its row is committed (the handler then sleeps).
    let connection = database.connection().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows: i64 = connection
            .query_one(
                "SELECT count(*) FROM idempotency_records WHERE state = 'i'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if rows == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "no in-flight record appeared");
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    server.kill();
    assert!(running.await.unwrap().is_err());

    // The record is durable: after a restart the key is still in flight...
    let server = start(&database);
    let send = || {
        client()
            .post(server.url("/orders?delay_ms=5000"))
            .insert_header(("idempotency-key", "plain-crash"))
            .send_json(&order)
    };
    let blocked = Reply::read(send().await.unwrap()).await.unwrap();
    assert_eq!(blocked.status, StatusCode::CONFLICT);
    // ...for at most its lease (30 s by default) from the last renewal...
    let left: f64 = connection
        .query_one(
            "SELECT extract(epoch FROM expires_at - now())::float8 FROM idempotency_records",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(left <= 30.0, "{left} s left");
    // ...and when it has passed (moved back here instead of waiting), the retry runs.
    connection
        .batch_execute("UPDATE idempotency_records SET expires_at = now() - interval '1 second'")
        .await
        .unwrap();
    let retry = Reply::read(send().await.unwrap()).await.unwrap();
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
    assert!(!retry.is_replay());
}

#[actix_web::test]
async fn every_reference_route_works_on_postgres() {
    let database = TestDatabase::create().await;
    let server = start(&database);
    let order = json!({ "item": "lamp", "qty": 2 });
    let send = || {
        client()
            .post(server.url("/orders"))
            .insert_header(("idempotency-key", "route-check"))
            .send_json(&order)
    };
    let first = Reply::read(send().await.unwrap()).await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = Reply::read(send().await.unwrap()).await.unwrap();
    assert!(retry.is_replay());
    assert_eq!(retry.body, first.body);
    let payment = client()
        .post(server.url("/payments"))
        .send_json(&json!({}))
        .await
        .unwrap();
    assert_eq!(payment.status(), StatusCode::BAD_REQUEST);
    // A keyless ledger entry commits too.
    let keyless = client()
        .post(server.url("/ledger"))
        .send_json(&json!({ "amount": 1 }))
        .await
        .unwrap();
    assert_eq!(keyless.status(), StatusCode::CREATED);
    assert_eq!(ledger_rows(&server).await, 1);
}

#[actix_web::test]
async fn ledger_routes_exist_only_with_a_database() {
    let server = ReferenceServer::start(&[]);
    let post = client()
        .post(server.url("/ledger"))
        .send_json(&json!({ "amount": 1 }))
        .await
        .unwrap();
    assert_eq!(post.status(), StatusCode::NOT_FOUND);
    let get = client().get(server.url("/ledger")).send().await.unwrap();
    assert_eq!(get.status(), StatusCode::NOT_FOUND);
}

#[actix_web::test]
async fn the_baseline_books_the_same_rows() {
    let database = TestDatabase::create().await;
    let server =
        ReferenceServer::start(&[("DATABASE_URL", database.url()), ("IDEMPOTENCY", "off")]);
    let first = book(&server, "ignored", 5, None).await.unwrap();
    let second = book(&server, "ignored", 5, None).await.unwrap();
    assert_eq!(
        (first.status, second.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(ledger_rows(&server).await, 2);
}

/// Only POST conflicts with the transactional `POST /ledger` (the refusal of POST is in
/// `e2e_reference_server.rs`); the other methods protect untagged routes beside it.
#[actix_web::test]
async fn idempotency_methods_without_post_leave_the_ledger_transactional() {
    let database = TestDatabase::create().await;
    let server = ReferenceServer::start(&[
        ("DATABASE_URL", database.url()),
        ("IDEMPOTENCY_METHODS", "PUT,PATCH,DELETE"),
    ]);
    let booked = book(&server, "methods", 3, None).await.unwrap();
    assert_eq!(booked.status, StatusCode::CREATED, "{booked:?}");
    let retry = book(&server, "methods", 3, None).await.unwrap();
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, booked.body);
    assert_eq!(ledger_rows(&server).await, 1);
}

#[test]
fn two_store_variables_are_an_invalid_configuration() {
    for other in ["REDIS_URL", "REDIS_CLUSTER_URLS"] {
        let output = ReferenceServer::command()
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1/postgres")
            .env(other, "redis://127.0.0.1:6379")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{other}: {stderr}");
        assert!(stderr.contains(other), "{stderr}");
        assert!(stderr.contains("DATABASE_URL"), "{stderr}");
        assert!(output.stdout.is_empty());
    }
}

#[test]
fn a_database_that_cannot_be_used_stops_the_start_and_says_why() {
    let admin = idempotency_actix_tests::postgres_admin_url();
    let (server, _) = admin.rsplit_once('/').unwrap();
    let missing = format!(
        "{server}/idempotency_actix_missing_{}",
        uuid::Uuid::new_v4().simple()
    );
    let output = ReferenceServer::command()
        .env("DATABASE_URL", &missing)
        .env("BIND", "127.0.0.1:0")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("DATABASE_URL"), "{stderr}");
    assert!(stderr.contains("does not exist"), "{stderr}");
    assert!(output.stdout.is_empty());
}

/// Instances started at once on a fresh database each create table `ledger` where it is
/// missing: the one that lost the race to create it stopped at start ("duplicate key value
/// violates unique constraint"), as it would for any two instances of a deploy.
#[actix_web::test]
async fn instances_started_at_once_on_a_fresh_database_all_start() {
    let database = TestDatabase::create().await;
    // A session that creates the table without committing: both instances find it missing
    // and wait behind this transaction, so they create it at the same moment once it rolls
    // back.
    let holder = database.connection().await;
    holder
        .batch_execute(
            "BEGIN; CREATE TABLE ledger (
                 entry_id   bigserial   PRIMARY KEY,
                 amount     bigint      NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await
        .expect("create the table without committing");
    let mut children: Vec<std::process::Child> = (0..2)
        .map(|_| {
            ReferenceServer::command()
                .env("DATABASE_URL", database.url())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("start a reference server")
        })
        .collect();
    // Both wait for the holder's transaction (at most 10 s, so nothing hangs).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = holder
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
                &[],
            )
            .await
            .expect("count the waiting sessions")
            .get(0);
        if waiting >= 2 || Instant::now() > deadline {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
    holder.batch_execute("ROLLBACK").await.expect("roll back");
    // Each one's first line on stdout, or what it wrote on stderr (at most 30 s each).
    let started: Vec<Result<String, String>> = children
        .iter_mut()
        .map(|child| {
            let stdout = child.stdout.take().expect("stdout is piped");
            let (line_tx, line_rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut line = String::new();
                let _ =
                    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line);
                let _ = line_tx.send(line);
            });
            let line = line_rx
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_default();
            if line.starts_with("listening on http://") {
                return Ok(line);
            }
            let _ = child.kill();
            let _ = child.wait();
            let mut stderr = String::new();
            let _ = std::io::Read::read_to_string(
                &mut child.stderr.take().expect("stderr is piped"),
                &mut stderr,
            );
            Err(stderr)
        })
        .collect();
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
    for outcome in started {
        assert!(outcome.is_ok(), "an instance did not start: {outcome:?}");
    }
}
