//! Issue 13 item 4: streamed responses are forwarded chunk by chunk while they are recorded,
//! committed before the response is complete, and an endless stream ends its record once it
//! outgrows the stored-body limit. Real sockets, the test Redis under a prefix of its own.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::body::SizedStream;
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse};
use futures_util::{Stream, StreamExt};
use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, KeyScope, RedisStore};
use idempotency_actix_tests::{Gate, RunCounter, redis_url, unique_prefix};

const FIRST: &[u8] = b"{\"progress\":50}\n";
const LAST: &[u8] = b"{\"progress\":100}\n";

/// `FIRST` at once, `LAST` once the gate is open.
fn progress(gate: Gate) -> impl Stream<Item = Result<Bytes, actix_web::Error>> {
    futures_util::stream::iter([Bytes::from_static(FIRST)])
        .chain(futures_util::stream::once(async move {
            gate.wait().await;
            Bytes::from_static(LAST)
        }))
        .map(Ok)
}

#[derive(serde::Deserialize)]
struct Shape {
    sized: Option<u8>,
}

async fn report(
    runs: web::Data<RunCounter>,
    gate: web::Data<Gate>,
    shape: web::Query<Shape>,
) -> HttpResponse {
    runs.record();
    let stream = progress(gate.get_ref().clone());
    let mut response = HttpResponse::Ok();
    response.content_type("application/x-ndjson");
    if shape.sized == Some(1) {
        let length = (FIRST.len() + LAST.len()) as u64;
        response.body(SizedStream::new(length, stream))
    } else {
        response.streaming(stream)
    }
}

/// 512 bytes every millisecond, forever.
async fn endless(runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    let chunks = futures_util::stream::unfold((), |()| async {
        actix_rt::time::sleep(Duration::from_millis(1)).await;
        Some((Ok::<_, actix_web::Error>(Bytes::from(vec![b'x'; 512])), ()))
    });
    HttpResponse::Ok().streaming(chunks)
}

/// `FIRST`; once the gate is open, a chunk every 20 ms for 200 ms (so that Actix, writing
/// them, finds its client gone and drops the body); then nothing, forever.
async fn stalled(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    runs.record();
    let gate = gate.get_ref().clone();
    let after_the_gate =
        futures_util::stream::once(async move { gate.wait().await }).flat_map(|()| {
            futures_util::stream::unfold(0, |sent| async move {
                (sent < 10).then_some(())?;
                actix_rt::time::sleep(Duration::from_millis(20)).await;
                Some((Bytes::from_static(b"{}\n"), sent + 1))
            })
        });
    let chunks = futures_util::stream::iter([Bytes::from_static(FIRST)])
        .chain(after_the_gate)
        .chain(futures_util::stream::pending())
        .map(Ok::<_, actix_web::Error>);
    HttpResponse::Ok().streaming(chunks)
}

fn start(test: &str, runs: &RunCounter, gate: &Gate) -> actix_test::TestServer {
    let pool = RedisStore::pool(&redis_url()).unwrap();
    let prefix = unique_prefix(test);
    let (runs, gate) = (runs.clone(), gate.clone());
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .app_data(web::Data::new(gate.clone()))
            .wrap(
                Idempotency::redis(pool.clone())
                    .key_prefix(prefix.clone())
                    .scope(KeyScope::global()),
            )
            .service(
                web::resource("/progress")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(report)),
            )
            .service(
                web::resource("/endless")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().max_stored_body(4096),
                    ))
                    .route(web::post().to(endless)),
            )
            .service(
                web::resource("/stalled")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().lease(Duration::from_secs(1)),
                    ))
                    .route(web::post().to(stalled)),
            )
    })
}

/// The next chunk of `body`, or a panic if none comes within 10 s (never a hung test).
async fn next_chunk<S>(body: &mut S) -> Bytes
where
    S: Stream<Item = Result<Bytes, awc::error::PayloadError>> + Unpin,
{
    actix_rt::time::timeout(Duration::from_secs(10), body.next())
        .await
        .expect("no chunk arrived: the response is held back")
        .expect("the body ended early")
        .unwrap()
}

async fn first_chunk_arrives_before_the_last_is_produced(path: &str, test: &str) {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start(test, &runs, &gate);
    let client = awc::Client::default();
    let request = || {
        client
            .post(server.url(path))
            .insert_header(("idempotency-key", "report-1"))
    };

    let mut response = request().send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(next_chunk(&mut response).await, FIRST);
    gate.open();
    let mut body = Vec::from(FIRST);
    while let Some(chunk) = response.next().await {
        body.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(body, [FIRST, LAST].concat());

    // Committed before the response was complete: the retry is a replay at once, byte for
    // byte, with the original's headers.
    let mut replay = request().send().await.unwrap();
    assert_eq!(replay.status(), 200);
    assert_eq!(replay.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(
        replay.headers().get("content-type"),
        response.headers().get("content-type")
    );
    assert_eq!(replay.body().await.unwrap(), body);
    assert_eq!(runs.get(), 1);
}

#[actix_rt::test]
async fn a_stream_of_unknown_size_is_forwarded_as_it_is_produced() {
    first_chunk_arrives_before_the_last_is_produced("/progress", "stream-unsized").await;
}

#[actix_rt::test]
async fn a_stream_of_known_size_is_forwarded_as_it_is_produced() {
    first_chunk_arrives_before_the_last_is_produced("/progress?sized=1", "stream-sized").await;
}

#[actix_rt::test]
async fn an_endless_stream_completes_its_record_without_a_body_once_over_the_limit() {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start("stream-endless", &runs, &gate);
    let client = awc::Client::default();
    let request = || {
        client
            .post(server.url("/endless"))
            .insert_header(("idempotency-key", "feed"))
    };

    let mut feed = request().send().await.unwrap();
    let mut received = 0;
    while received <= 8192 {
        received += next_chunk(&mut feed).await.len();
    }
    // The stream goes on, but its record is complete: a retry learns the outcome and does
    // not run the handler again.
    let replay = request().send().await.unwrap();
    assert_eq!(replay.status(), 200);
    assert_eq!(replay.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(
        replay.headers().get("idempotent-body-omitted").unwrap(),
        "true"
    );
    assert!(
        !next_chunk(&mut feed).await.is_empty(),
        "the stream still flows"
    );
    assert_eq!(runs.get(), 1);
}

#[actix_rt::test]
async fn a_stream_whose_client_left_is_read_to_its_end_and_committed() {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start("stream-left", &runs, &gate);
    let client = awc::Client::default();
    let request = || {
        client
            .post(server.url("/progress"))
            .insert_header(("idempotency-key", "left"))
    };

    let mut response = request().send().await.unwrap();
    assert_eq!(next_chunk(&mut response).await, FIRST);
    drop(response);
    gate.open();

    let mut retry = once_not_in_flight(&request).await;
    assert_eq!(retry.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(retry.body().await.unwrap(), [FIRST, LAST].concat());
    assert_eq!(runs.get(), 1);
}

/// The first answer to `request` that is not 409, sending it every 10 ms; a panic if the
/// record is still in flight after 500 tries.
async fn once_not_in_flight(
    request: &dyn Fn() -> awc::ClientRequest,
) -> awc::ClientResponse<impl Stream<Item = Result<Bytes, awc::error::PayloadError>> + Unpin> {
    for _ in 0..500 {
        let retry = request().send().await.unwrap();
        if retry.status() != 409 {
            return retry;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the record stayed in flight");
}

#[actix_rt::test]
async fn a_stalled_stream_whose_client_left_completes_its_record_without_a_body() {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start("stream-stalled", &runs, &gate);
    let client = awc::Client::default();
    let request = || {
        client
            .post(server.url("/stalled"))
            .insert_header(("idempotency-key", "stalled"))
    };

    let mut response = request().send().await.unwrap();
    assert_eq!(next_chunk(&mut response).await, FIRST);
    drop(response);
    gate.open();

    // Nothing comes for a lease (1 s): the record completes without a body instead of
    // staying in flight, its lease renewed, for as long as the process runs.
    let retry = once_not_in_flight(&request).await;
    assert_eq!(retry.status(), 200);
    assert_eq!(retry.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(
        retry.headers().get("idempotent-body-omitted").unwrap(),
        "true"
    );
    assert_eq!(runs.get(), 1);
}
