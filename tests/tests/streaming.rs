//! Issue 13 item 4: streamed responses are forwarded chunk by chunk while they are recorded,
//! committed before the response is complete, and an endless stream ends its record once it
//! outgrows the stored-body limit. Real sockets, the test Redis under a prefix of its own
//! (and, for a slow commit, a memory store whose commits are slow).

#![allow(clippy::unwrap_used)]

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::body::{BodySize, MessageBody, SizedStream};
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse};
use futures_util::{Stream, StreamExt};
use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, KeyScope, RedisStore};
use idempotency_actix_tests::{
    FaultyStore, Gate, RawExchange, RunCounter, redis_url, reset, unique_prefix,
};

const FIRST: &[u8] = b"{\"progress\":50}\n";
const LAST: &[u8] = b"{\"progress\":100}\n";

/// `FIRST` at once (then an empty chunk if `empty`), `LAST` once the gate is open.
fn progress(gate: Gate, empty: bool) -> impl Stream<Item = Result<Bytes, actix_web::Error>> {
    let empty = empty.then(Bytes::new);
    futures_util::stream::iter(std::iter::once(Bytes::from_static(FIRST)).chain(empty))
        .chain(futures_util::stream::once(async move {
            gate.wait().await;
            Bytes::from_static(LAST)
        }))
        .map(Ok)
}

#[derive(serde::Deserialize)]
struct Shape {
    sized: Option<u8>,
    empty: Option<u8>,
}

/// A body of unknown size that passes on every chunk of its stream, empty ones too (Actix's
/// `BodyStream` leaves those out; a body type of the app's own may not).
struct Unfiltered<S>(Pin<Box<S>>);

impl<S: Stream<Item = Result<Bytes, actix_web::Error>>> MessageBody for Unfiltered<S> {
    type Error = actix_web::Error;

    fn size(&self) -> BodySize {
        BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        self.get_mut().0.as_mut().poll_next(cx)
    }
}

async fn report(
    runs: web::Data<RunCounter>,
    gate: web::Data<Gate>,
    shape: web::Query<Shape>,
) -> HttpResponse {
    runs.record();
    let empty = shape.empty == Some(1);
    let stream = progress(gate.get_ref().clone(), empty);
    let mut response = HttpResponse::Ok();
    response.content_type("application/x-ndjson");
    if shape.sized == Some(1) {
        let length = (FIRST.len() + LAST.len()) as u64;
        response.body(SizedStream::new(length, stream))
    } else if empty {
        response.body(Unfiltered(Box::pin(stream)))
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

/// Declares `?declared=N` bytes and produces `DIGITS` (10 bytes), then ends: a proxied or
/// file body cut short (N > 10), or a wrong length given to `SizedStream` (N < 10).
async fn mis_sized(runs: web::Data<RunCounter>, declared: web::Query<Declared>) -> HttpResponse {
    runs.record();
    let chunks =
        futures_util::stream::iter([Ok::<_, actix_web::Error>(Bytes::from_static(DIGITS))]);
    HttpResponse::Ok().body(SizedStream::new(declared.declared, chunks))
}

/// As [`mis_sized`], but as a body of unknown size sent without chunking
/// (`HttpResponseBuilder::no_chunking`): Actix writes the handler's `Content-Length` as it
/// is and then the body as it comes, so the client reads that many bytes, as for a
/// `SizedStream`.
async fn unchunked(runs: web::Data<RunCounter>, declared: web::Query<Declared>) -> HttpResponse {
    runs.record();
    let chunks =
        futures_util::stream::iter([Ok::<_, actix_web::Error>(Bytes::from_static(DIGITS))]);
    HttpResponse::Ok()
        .no_chunking(declared.declared)
        .body(actix_web::body::BodyStream::new(chunks))
}

const DIGITS: &[u8] = b"0123456789";

#[derive(serde::Deserialize)]
struct Declared {
    declared: u64,
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

/// Waits at the gate, then answers `FIRST` and `LAST` as a stream: a client that leaves
/// while it waits leaves before the response (and its body) exists.
async fn late(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    runs.record();
    gate.wait().await;
    let chunks = futures_util::stream::iter([FIRST, LAST].map(Bytes::from_static))
        .map(Ok::<_, actix_web::Error>);
    HttpResponse::Ok()
        .content_type("application/x-ndjson")
        .streaming(chunks)
}

fn start(test: &str, runs: &RunCounter, gate: &Gate) -> actix_test::TestServer {
    start_with(test, runs, gate, |idempotency| idempotency)
}

/// [`start`], with `settings` applied to the app's `Idempotency`.
fn start_with(
    test: &str,
    runs: &RunCounter,
    gate: &Gate,
    settings: fn(Idempotency) -> Idempotency,
) -> actix_test::TestServer {
    let pool = RedisStore::pool(&redis_url()).unwrap();
    let prefix = unique_prefix(test);
    let (runs, gate) = (runs.clone(), gate.clone());
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .app_data(web::Data::new(gate.clone()))
            .wrap(settings(
                Idempotency::redis(pool.clone())
                    .key_prefix(prefix.clone())
                    .scope(KeyScope::global()),
            ))
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
                web::resource("/mis-sized")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(mis_sized)),
            )
            .service(
                web::resource("/late")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(late)),
            )
            .service(
                web::resource("/unchunked")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(unchunked)),
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

/// Actix ends a chunked response at an empty chunk: passed on, it would give the client the
/// body so far as complete, before the record is committed (a retry then gets 409), and the
/// replay would hold the rest too.
#[actix_rt::test]
async fn a_stream_with_an_empty_chunk_is_forwarded_whole() {
    first_chunk_arrives_before_the_last_is_produced("/progress?empty=1", "stream-empty-chunk")
        .await;
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
async fn a_stream_whose_record_is_complete_holds_no_share_of_the_keyed_work() {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start_with("stream-slot", &runs, &gate, |idempotency| {
        idempotency.max_in_flight(1)
    });
    let client = awc::Client::default();
    let keyed = |path: &str, key: &str| {
        client
            .post(server.url(path))
            .insert_header(("idempotency-key", key.to_owned()))
    };

    let mut feed = keyed("/endless", "feed").send().await.unwrap();
    let mut received = 0;
    while received <= 8192 {
        received += next_chunk(&mut feed).await.len();
    }
    // The feed's record is complete (without a body) and the feed still flows: with room
    // for one keyed request, the next one is served, as is the feed's replay.
    gate.open();
    let mut other = keyed("/progress", "other").send().await.unwrap();
    assert_eq!(other.status(), 200, "{:?}", other.headers());
    assert_eq!(other.body().await.unwrap(), [FIRST, LAST].concat());
    let replay = keyed("/endless", "feed").send().await.unwrap();
    assert_eq!(replay.status(), 200);
    assert_eq!(replay.headers().get("idempotent-replayed").unwrap(), "true");
    assert!(
        !next_chunk(&mut feed).await.is_empty(),
        "the feed still flows"
    );
    assert_eq!(runs.get(), 2);
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

/// The client resets the connection while the handler runs, before it has produced its
/// streamed response: the run goes on on a task of its own, where the response, which no
/// client will read, is dropped as soon as it is made. Its body is read there to its end and
/// committed, as the rest of a body whose client left mid-stream is, so the retry gets the
/// whole replay and the handler ran once.
#[actix_rt::test]
async fn a_stream_whose_client_left_before_it_was_made_is_read_to_its_end_and_committed() {
    use std::io::Write;

    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start("stream-left-early", &runs, &gate);
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(
        socket,
        "POST /late HTTP/1.1\r\nHost: test\r\nIdempotency-Key: early\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    runs.wait_for(1).await;
    reset(socket);
    gate.open();

    let client = awc::Client::default();
    let request = || {
        client
            .post(server.url("/late"))
            .insert_header(("idempotency-key", "early"))
    };
    let mut retry = once_not_in_flight(&request).await;
    assert_eq!(retry.status(), 200);
    assert_eq!(retry.headers().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(retry.headers().get("idempotent-body-omitted"), None);
    assert_eq!(retry.body().await.unwrap(), [FIRST, LAST].concat());
    assert_eq!(runs.get(), 1);
}

/// `FIRST` and `LAST` as a body of known size, both at once.
async fn sized_at_once(runs: web::Data<RunCounter>) -> HttpResponse {
    runs.record();
    let chunks = futures_util::stream::iter([FIRST, LAST].map(Bytes::from_static))
        .map(Ok::<_, actix_web::Error>);
    HttpResponse::Ok().body(SizedStream::new((FIRST.len() + LAST.len()) as u64, chunks))
}

/// The last chunk of a body of known size waits for the commit, which is slow (half a
/// second on the way to the store); the client, which has the first chunk, resets the
/// connection meanwhile. The commit under way when the body was dropped is finished on the
/// rest's task: the record holds the whole body, and the retry is its replay.
#[actix_rt::test]
async fn a_client_that_resets_while_the_last_chunk_waits_for_a_slow_commit_gets_the_replay() {
    let store = FaultyStore {
        commit_delay: Duration::from_millis(500),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let server = {
        let (store, runs) = (store.clone(), runs.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(Idempotency::new(store.clone()).scope(KeyScope::global()))
                .service(
                    web::resource("/sized")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(sized_at_once)),
                )
        })
    };
    let mut first = RawExchange::post(server.addr(), "/sized", &[("Idempotency-Key", "slow")]);
    let head = first.read_head();
    assert_eq!(head.status, 200, "{head:?}");
    // The first chunk arrives; the last waits for the commit.
    assert_eq!(first.read_some(), FIRST);
    reset(first.stream().try_clone().unwrap());
    drop(first);

    let client = awc::Client::default();
    let request = || {
        client
            .post(server.url("/sized"))
            .insert_header(("idempotency-key", "slow"))
    };
    let mut retry = once_not_in_flight(&request).await;
    assert_eq!(retry.status(), 200);
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

/// A body that ends before the size the client was told (`Content-Length: 100`, 10 bytes),
/// as a `SizedStream` or as a body of unknown size sent without chunking: the retry learns
/// that the handler ran and that its body is not stored, never gets the 10 bytes as a
/// whole body.
#[actix_rt::test]
async fn a_body_that_ends_before_its_declared_size_is_stored_without_a_body() {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start("stream-short", &runs, &gate);
    let client = awc::Client::default();
    for (ran, path) in [(1, "/mis-sized"), (2, "/unchunked")] {
        let key = format!("short{path}");
        let url = format!("{path}?declared=100");
        let request = || {
            client
                .post(server.url(&url))
                .insert_header(("idempotency-key", key.clone()))
        };

        // The client gets the head (`Content-Length: 100`) and 10 bytes, then the
        // connection closes. (Read off the socket: awc takes such a body as complete.)
        let mut first = RawExchange::post(server.addr(), &url, &[("Idempotency-Key", &key)]);
        let head = first.read_head();
        assert_eq!(head.status, 200, "{path}: {head:?}");
        assert_eq!(
            head.header("content-length"),
            Some("100"),
            "{path}: {head:?}"
        );
        assert_eq!(
            first.read_to_end(),
            b"0123456789",
            "{path}: the connection closes after the 10 bytes"
        );

        // The retry learns the outcome without running the handler again, and is told that
        // the body is not stored, rather than given the 10 bytes as if they were the whole
        // body.
        let mut retry = once_not_in_flight(&request).await;
        assert_eq!(retry.status(), 200, "{path}");
        assert_eq!(
            retry.headers().get("idempotent-replayed").unwrap(),
            "true",
            "{path}"
        );
        assert_eq!(
            retry
                .headers()
                .get("idempotent-body-omitted")
                .map(|v| v.to_str().unwrap()),
            Some("true"),
            "{path}: {:?}",
            retry.headers()
        );
        assert_eq!(retry.body().await.unwrap(), "", "{path}");
        assert_eq!(runs.get(), ran, "{path}");
    }
}

/// A body that runs past the size the client was told (`Content-Length: 4`, 10 bytes), as
/// a `SizedStream` or as a body of unknown size sent without chunking: the client reads 4
/// bytes, and the replay is those 4 bytes, as they were sent.
#[actix_rt::test]
async fn a_body_that_runs_past_its_declared_size_is_replayed_as_it_was_sent() {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start("stream-long", &runs, &gate);
    let client = awc::Client::default();
    for (ran, path) in [(1, "/mis-sized"), (2, "/unchunked")] {
        let key = format!("long{path}");
        let url = format!("{path}?declared=4");
        let request = || {
            client
                .post(server.url(&url))
                .insert_header(("idempotency-key", key.clone()))
        };

        let mut first = request().send().await.unwrap();
        assert_eq!(first.status(), 200, "{path}");
        let sent = first.body().await.unwrap();
        assert_eq!(sent, DIGITS[..4], "{path}");

        let mut replay = once_not_in_flight(&request).await;
        assert_eq!(replay.status(), 200, "{path}");
        assert_eq!(
            replay.headers().get("idempotent-replayed").unwrap(),
            "true",
            "{path}"
        );
        assert_eq!(
            replay.headers().get("content-length").unwrap(),
            "4",
            "{path}"
        );
        assert_eq!(replay.body().await.unwrap(), sent, "{path}");
        assert_eq!(runs.get(), ran, "{path}");
    }
}

/// The server stops (without waiting, or at the end of its shutdown timeout) while a keyed
/// streamed response is still recorded: its worker's runtime drops the response, and then the
/// task that reads the rest of the body. The client's response is cut and the process goes
/// on. Dropped, that task's body spawned its rest once more, which the stopping runtime
/// dropped at once, and so on until the stack overflowed: the process aborted (helper
/// review).
#[actix_rt::test]
async fn a_server_stopped_mid_stream_leaves_the_process_running() {
    let (runs, gate) = (RunCounter::default(), Gate::default());
    let server = start("stream-stopped", &runs, &gate);
    let client = awc::Client::default();
    let mut response = client
        .post(server.url("/progress"))
        .insert_header(("idempotency-key", "stopped"))
        .send()
        .await
        .expect("a response");
    assert_eq!(response.status(), 200);
    assert_eq!(next_chunk(&mut response).await, FIRST);
    server.stop().await;

    // The process is still here: the client's response ends, cut before `LAST`.
    let mut rest = Vec::new();
    while let Ok(Some(Ok(chunk))) =
        actix_rt::time::timeout(Duration::from_secs(10), response.next()).await
    {
        rest.extend_from_slice(&chunk);
    }
    assert!(rest.is_empty(), "the stream went on: {rest:?}");
    assert_eq!(runs.get(), 1);
}
