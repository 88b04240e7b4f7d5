//! `Idempotency::drain`, and a client that leaves while its request gives back the key it
//! found free: the release goes on to its end without the client, the drain waits for it,
//! and the retry finds the key free (503 `shutting-down` again, never 409 for a lease).
//! Real sockets, an in-process server on a memory store whose releases are slow.
//!
//! One test in a binary of its own: a drain is for the whole process and for good.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpServer};
use idempotency_actix::{Idempotency, KeyScope};
use idempotency_actix_tests::{FaultyStore, GatedRoutes, Reply, reset};

#[actix_rt::test]
async fn a_key_given_back_while_draining_is_released_though_its_client_left() {
    // A release takes half a second to reach the store, as on a slow Redis.
    let store = FaultyStore {
        release_delay: Duration::from_millis(500),
        ..FaultyStore::default()
    };
    let routes = GatedRoutes::default();
    let quick_runs = routes.quick_runs.clone();
    let server = {
        let store = store.clone();
        HttpServer::new(move || {
            App::new()
                .wrap(Idempotency::new(store.clone()).scope(KeyScope::global()))
                .configure(routes.configure())
        })
        .workers(1)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .unwrap()
    };
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    let server = actix_rt::spawn(server);

    // Nothing is in progress yet: the drain starts and ends at once.
    assert_eq!(Idempotency::drain(Duration::from_secs(30)).await, 0);
    // A new key: found free while draining, so given back; its client resets the connection
    // while the release is on its way.
    let mut socket = std::net::TcpStream::connect(addr).unwrap();
    write!(
        socket,
        "POST /quick HTTP/1.1\r\nHost: test\r\nIdempotency-Key: left\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    store.releases.wait_for(1).await;
    reset(socket);

    // The drain waits for the release, which goes on without the client...
    assert_eq!(Idempotency::drain(Duration::from_secs(30)).await, 0);
    // ...so the key is free: its retry is given back too, not told to wait for a run that
    // does not exist.
    let client = awc::Client::default();
    let retry = client
        .post(format!("http://{addr}/quick"))
        .insert_header(("idempotency-key", "left"))
        .send()
        .await
        .unwrap();
    let retry = Reply::read(retry).await.unwrap();
    assert_eq!(retry.status, StatusCode::SERVICE_UNAVAILABLE, "{retry:?}");
    assert_eq!(
        retry.json()["type"],
        "tag:idempotency-actix,2026:shutting-down"
    );
    assert_eq!(quick_runs.get(), 0, "a handler ran while draining");

    handle.stop(true).await;
    server.await.unwrap().unwrap();
}
