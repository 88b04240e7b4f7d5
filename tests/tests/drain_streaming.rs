//! `Idempotency::drain` and streamed responses whose clients left mid-stream: the rest of
//! such a body is read on a task of its own and committed, and the drain waits for that
//! (its record would otherwise be cut short by the stop, its key left locked for a lease
//! and its handler run again on retry); a rest that stalls ends its record without a body
//! after a lease, so the drain ends too. Real sockets, an in-process server on the
//! in-memory store.
//!
//! One test in a binary of its own: a drain is for the whole process and for good.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse, HttpServer};
use futures_util::StreamExt;
use idempotency_actix::{
    Idempotency, IdempotencyPolicy, IdempotentRoute, Inspector, KeyScope, MemoryStore, RecordState,
};
use idempotency_actix_tests::{Gate, RunCounter};

const FIRST: &[u8] = b"{\"progress\":50}\n";
const LAST: &[u8] = b"{\"progress\":100}\n";

/// `FIRST` at once, `LAST` once the gate is open, then the end.
async fn report(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    runs.record();
    let gate = gate.get_ref().clone();
    let last = futures_util::stream::once(async move {
        gate.wait().await;
        Bytes::from_static(LAST)
    });
    let chunks = futures_util::stream::iter([Bytes::from_static(FIRST)])
        .chain(last)
        .map(Ok::<_, actix_web::Error>);
    HttpResponse::Ok().streaming(chunks)
}

/// `FIRST`, then nothing, forever.
async fn stalled(runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    let chunks = futures_util::stream::iter([Bytes::from_static(FIRST)])
        .chain(futures_util::stream::pending())
        .map(Ok::<_, actix_web::Error>);
    HttpResponse::Ok().streaming(chunks)
}

/// Sends a keyed `POST path`, reads the response's first chunk and leaves.
async fn leave_after_the_first_chunk(client: &awc::Client, addr: std::net::SocketAddr, path: &str) {
    let mut response = client
        .post(format!("http://{addr}{path}"))
        .insert_header(("idempotency-key", path.trim_start_matches('/').to_owned()))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let first = actix_rt::time::timeout(Duration::from_secs(10), response.next())
        .await
        .expect("no first chunk")
        .expect("the body ended")
        .unwrap();
    assert_eq!(first, FIRST);
}

#[actix_rt::test]
async fn a_drain_waits_for_the_rest_of_a_stream_whose_client_left() {
    let store = MemoryStore::new();
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = {
        let (store, runs, gate) = (store.clone(), runs.clone(), gate.clone());
        HttpServer::new(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .app_data(web::Data::new(gate.clone()))
                .wrap(Idempotency::new(store.clone()).scope(KeyScope::global()))
                .service(
                    web::resource("/report")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(report)),
                )
                .service(
                    web::resource("/stalled")
                        .wrap(IdempotentRoute::with_policy(
                            IdempotencyPolicy::default().lease(Duration::from_secs(1)),
                        ))
                        .route(web::post().to(stalled)),
                )
        })
        .workers(1)
        // A client that hangs up is noticed at once, while its body waits.
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

    leave_after_the_first_chunk(&client, addr, "/report").await;
    leave_after_the_first_chunk(&client, addr, "/stalled").await;
    assert_eq!(runs.get(), 2);

    let draining = actix_rt::spawn(Idempotency::drain(Duration::from_secs(30)));
    // While the rest of `/report` waits at the gate, its record is not complete: a bounded
    // drain says so. (`/stalled` may have ended its record by now, after its 1 s lease.)
    let left = Idempotency::drain(Duration::from_millis(200)).await;
    assert!(left >= 1, "drained while a body was still to be recorded");
    assert!(
        !draining.is_finished(),
        "drained while a body was still to be recorded"
    );

    gate.open();
    let left = actix_rt::time::timeout(Duration::from_secs(30), draining)
        .await
        .expect("the drain did not end once the bodies ended")
        .unwrap();
    assert_eq!(left, 0);

    let inspector = Inspector::new(store);
    // The whole body, read without its client, is stored for the retry...
    let report = inspector
        .lookup_with_body(b"", "report")
        .await
        .unwrap()
        .expect("no record of the stream whose client left");
    assert_eq!(report.state, RecordState::Completed);
    assert_eq!(report.body.as_deref(), Some(&[FIRST, LAST].concat()[..]));
    // ...and the stalled one completed without a body, rather than hold the drain.
    let stalled = inspector
        .lookup_with_body(b"", "stalled")
        .await
        .unwrap()
        .expect("no record of the stalled stream");
    assert_eq!(stalled.state, RecordState::Completed);
    assert_eq!(stalled.body, None);
    assert_eq!(runs.get(), 2);

    handle.stop(true).await;
    server.await.unwrap().unwrap();
}
