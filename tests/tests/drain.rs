//! `Idempotency::drain` before a stop: no handler runs for a new key any more (a 503
//! problem, `shutting-down`, with `Retry-After` and `Connection: close`), while replays and
//! 409s are answered as ever and requests without a key are served; the wait ends only once
//! the keyed work in progress, that of a client who left included, has finished and
//! committed; a drain that times out says how much was left. Real sockets, an in-process
//! server on the in-memory store.
//!
//! One test in a binary of its own: a drain is for the whole process and for good.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpServer};
use idempotency_actix::{Idempotency, Inspector, KeyScope, MemoryStore, RecordState};
use idempotency_actix_tests::{GatedRoutes, RawExchange, Reply};

async fn post(client: &awc::Client, addr: std::net::SocketAddr, key: Option<&str>) -> Reply {
    let mut request = client.post(format!("http://{addr}/quick"));
    if let Some(key) = key {
        request = request.insert_header(("idempotency-key", key));
    }
    Reply::read(request.send().await.unwrap()).await.unwrap()
}

#[actix_rt::test]
async fn drain_runs_no_new_handler_replays_as_ever_and_waits_for_work_whose_client_left() {
    let store = MemoryStore::new();
    let routes = GatedRoutes::default();
    let (runs, quick_runs, gate) = (
        routes.work_runs.clone(),
        routes.quick_runs.clone(),
        routes.gate.clone(),
    );
    let server = {
        let store = store.clone();
        HttpServer::new(move || {
            App::new()
                .wrap(Idempotency::new(store.clone()).scope(KeyScope::global()))
                .configure(routes.configure())
        })
        .workers(1)
        // A client that hangs up is noticed while its handler runs.
        .h1_allow_half_closed(false)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .unwrap()
    };
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    let server = actix_rt::spawn(server);
    let client = awc::Client::default();

    // A completed key, replayed during the drain.
    let done = post(&client, addr, Some("done")).await;
    assert_eq!(done.status, StatusCode::CREATED);
    // A slow keyed request whose client hangs up while its handler runs.
    let hung_up = RawExchange::post(addr, "/work", &[("Idempotency-Key", "left")]);
    runs.wait_for(1).await;
    drop(hung_up);

    assert!(!Idempotency::is_draining());
    let draining = actix_rt::spawn(Idempotency::drain(Duration::from_secs(30)));
    // Until it starts, keyed requests still run.
    let mut refused = None;
    for attempt in 0..500 {
        let key = format!("probe-{attempt}");
        let reply = post(&client, addr, Some(&key)).await;
        if reply.status != StatusCode::CREATED {
            refused = Some((key, reply));
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    let (refused_key, refused) = refused.expect("keyed requests were never refused");
    // `done` and the probes answered 201 before it: the refused one did not run.
    let quick_runs_before_the_drain = quick_runs.get();
    assert_eq!(
        quick_runs_before_the_drain,
        1 + refused_key["probe-".len()..].parse::<usize>().unwrap(),
        "a refused request ran its handler"
    );
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        refused.json()["type"],
        "tag:idempotency-actix,2026:shutting-down"
    );
    // So that the retry opens a connection, which a load balancer sends elsewhere.
    assert_eq!(refused.header("connection"), Some("close"), "{refused:?}");
    assert!(Idempotency::is_draining());
    // The refused key was given back: its retry, elsewhere or after the stop, runs.
    let record = Inspector::new(store.clone())
        .lookup(b"", &refused_key)
        .await
        .unwrap();
    assert!(record.is_none(), "{record:?}");
    // A completed key is still replayed.
    let replay = post(&client, addr, Some("done")).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.is_replay(), "{replay:?}");
    // A retry of the request that is still running gets the usual 409; no second run.
    let retry = Reply::read(
        client
            .post(format!("http://{addr}/work"))
            .insert_header(("idempotency-key", "left"))
            .send()
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    // Requests without a key are served as before.
    let keyless = post(&client, addr, None).await;
    assert_eq!(keyless.status, StatusCode::CREATED);
    assert_eq!(keyless.body, "quick");

    // A bounded drain gives up while the handler waits at the gate, and says so.
    assert_eq!(Idempotency::drain(Duration::from_millis(100)).await, 1);
    assert!(!draining.is_finished(), "drained while a handler ran");

    gate.open();
    let left = actix_rt::time::timeout(Duration::from_secs(30), draining)
        .await
        .expect("the drain did not end once the handler finished")
        .unwrap();
    assert_eq!(left, 0);
    assert_eq!(runs.get(), 1, "the request whose client left ran once");
    assert_eq!(
        quick_runs.get(),
        quick_runs_before_the_drain + 1,
        "during the drain only the keyless request ran"
    );
    // The run of the client who left was committed for its retry.
    let record = Inspector::new(store)
        .lookup_with_body(b"", "left")
        .await
        .unwrap()
        .expect("no record of the request whose client left");
    assert_eq!(record.state, RecordState::Completed);
    assert_eq!(record.status, Some(StatusCode::CREATED));
    assert_eq!(record.body.as_deref(), Some(&b"work 1"[..]));

    handle.stop(true).await;
    server.await.unwrap().unwrap();
}
