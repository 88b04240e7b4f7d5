//! The store's own connection (a pool from `RedisStore::pool` with a `redis://` or Unix-socket
//! URL) logs in and selects the database the URL names, and refuses to run handlers when it
//! cannot.

#![allow(clippy::unwrap_used)]

use actix_web::{App, HttpResponse, web};
use idempotency_actix::{Idempotency, IdempotentRoute, RedisStore};
use idempotency_actix_tests::{
    PrivateRedis, RunCounter, TemporaryDirectory, keys_under, unique_prefix,
};

fn start(url: &str, prefix: String, runs: RunCounter) -> actix_test::TestServer {
    let pool = RedisStore::pool(url).unwrap();
    actix_test::start(move || {
        let runs = runs.clone();
        App::new()
            .wrap(Idempotency::redis(pool.clone()).key_prefix(prefix.clone()))
            .service(
                web::resource("/orders")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(move || {
                        let run = runs.record();
                        async move { HttpResponse::Created().body(format!("order {run}")) }
                    })),
            )
    })
}

async fn post(server: &actix_test::TestServer, key: &str) -> (u16, String, bool) {
    let mut response = server
        .post("/orders")
        .insert_header(("idempotency-key", key))
        .send_body("{}")
        .await
        .unwrap();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.body().await.unwrap();
    (
        response.status().as_u16(),
        String::from_utf8(body.to_vec()).unwrap(),
        replayed,
    )
}

/// A private Redis with user `alice` (password `s3cret`) beside the default user.
async fn redis_with_a_user() -> PrivateRedis {
    PrivateRedis::start_with_args(&["--user", "alice", "on", ">s3cret", "~*", "&*", "+@all"]).await
}

#[actix_web::test]
async fn a_url_with_a_user_and_a_database_keeps_records_there() {
    let redis = redis_with_a_user().await;
    let prefix = unique_prefix("own-connection-db");
    let runs = RunCounter::default();
    let url = format!("redis://alice:s3cret@127.0.0.1:{}/3", redis.port());
    let server = start(&url, prefix.clone(), runs.clone());

    assert_eq!(post(&server, "k").await, (201, "order 1".to_owned(), false));
    assert_eq!(post(&server, "k").await, (201, "order 1".to_owned(), true));
    assert_eq!(runs.get(), 1);

    let mut connection = redis.connection().await;
    assert!(
        keys_under(&mut connection, &prefix).await.is_empty(),
        "nothing in db 0"
    );
    let clients = records_and_clients_in(&mut connection, 3, &prefix).await;
    assert!(
        clients
            .lines()
            .any(|client| client.contains(" db=3 ") && client.contains(" user=alice ")),
        "the store is logged in as alice on db 3:\n{clients}"
    );
}

/// Selects database `db` on `connection`, checks that it holds the one record under
/// `prefix`, and returns the server's `CLIENT LIST`.
async fn records_and_clients_in(
    connection: &mut redis::aio::MultiplexedConnection,
    db: i64,
    prefix: &str,
) -> String {
    redis::cmd("SELECT")
        .arg(db)
        .exec_async(connection)
        .await
        .unwrap();
    assert_eq!(
        keys_under(connection, prefix).await.len(),
        1,
        "the record is in db {db}"
    );
    redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(connection)
        .await
        .unwrap()
}

#[actix_web::test]
async fn a_wrong_password_answers_503_and_runs_no_handler() {
    let redis = redis_with_a_user().await;
    let runs = RunCounter::default();
    let url = format!("redis://alice:wrong@127.0.0.1:{}", redis.port());
    let server = start(&url, unique_prefix("own-connection-auth"), runs.clone());

    let (status, _, _) = post(&server, "k").await;
    assert_eq!(status, 503);
    assert_eq!(runs.get(), 0);
}

/// A `unix://` URL: the store connects over the server's Unix socket (with its own
/// connection, as for `redis://`), logs in as the user the URL's `user` and `pass` name,
/// selects its `db`, and records and replays as over TCP.
#[cfg(unix)]
#[actix_web::test]
async fn a_unix_socket_url_keeps_records_on_that_server() {
    // Declared first, so removed last: after the server has stopped.
    let directory = TemporaryDirectory::new("own-connection");
    let socket = directory.path().join("redis.sock");
    let socket_arg = socket.to_str().unwrap();
    let redis = PrivateRedis::start_with_args(&[
        "--unixsocket",
        socket_arg,
        "--unixsocketperm",
        "700",
        "--user",
        "alice",
        "on",
        ">s3cret",
        "~*",
        "&*",
        "+@all",
    ])
    .await;
    let prefix = unique_prefix("own-connection-unix");
    let runs = RunCounter::default();
    let server = start(
        &format!("unix://{socket_arg}?db=2&user=alice&pass=s3cret"),
        prefix.clone(),
        runs.clone(),
    );

    assert_eq!(post(&server, "k").await, (201, "order 1".to_owned(), false));
    assert_eq!(post(&server, "k").await, (201, "order 1".to_owned(), true));
    assert_eq!(runs.get(), 1);

    let mut connection = redis.connection().await;
    let clients = records_and_clients_in(&mut connection, 2, &prefix).await;
    assert!(
        clients
            .lines()
            .any(|client| client.contains(&format!(" addr={socket_arg}:"))
                && client.contains(" db=2 ")
                && client.contains(" user=alice ")),
        "the store is connected over the socket, as alice, on db 2:\n{clients}"
    );
}
