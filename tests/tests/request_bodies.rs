//! Keyed requests whose bodies do not arrive in one piece: cut short (a `Content-Length`
//! larger than what arrives), a chunked body whose client resets the connection before its
//! end, a body that trickles in while a duplicate with the whole body is served, and a
//! client that waits for `100 Continue` before it sends its body. None of them runs the
//! handler without its whole body, none leaves its key held, and each retry is answered as
//! the contract says (DESIGN §5, §7). Real sockets, an in-process server on a memory store.

#![allow(clippy::unwrap_used)]

use std::io::Write;

use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse};
use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, KeyScope, MemoryStore};
use idempotency_actix_tests::{RawExchange, RawHead, Reply, RunCounter, reset};

/// The most body `/echo` takes.
const LIMIT: usize = 64;

async fn echo(runs: web::Data<RunCounter>, body: Bytes) -> HttpResponse {
    let run = runs.record();
    let mut answer = format!("run {run}: ").into_bytes();
    answer.extend_from_slice(&body);
    HttpResponse::Created().body(answer)
}

fn start(runs: &RunCounter) -> actix_test::TestServer {
    let runs = runs.clone();
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .wrap(Idempotency::new(MemoryStore::new()).scope(KeyScope::global()))
            .service(
                web::resource("/echo")
                    .wrap(IdempotentRoute::with_policy(
                        IdempotencyPolicy::default().max_request_body(LIMIT),
                    ))
                    .route(web::post().to(echo)),
            )
    })
}

/// `POST /echo` with `key` and `body`, in one piece, read whole.
async fn post(server: &actix_test::TestServer, key: &str, body: &'static [u8]) -> Reply {
    let request = server
        .post("/echo")
        .insert_header(("idempotency-key", key.to_owned()));
    Reply::read(request.send_body(body).await.unwrap())
        .await
        .unwrap()
}

/// The body of `exchange`'s response, up to the end of the connection (the requests ask
/// for `Connection: close`), as text.
fn rest_of(exchange: &mut RawExchange) -> String {
    String::from_utf8_lossy(&exchange.read_to_end()).into_owned()
}

/// A body that stops short of its `Content-Length` when its client closes its sending side
/// (the client still reads): a clear 400 (`body-unreadable`), no run, and the key is left
/// free, so the retry with the whole body runs once and its own retry is the replay.
#[actix_rt::test]
async fn a_body_cut_short_is_400_runs_nothing_and_leaves_the_key_free() {
    let runs = RunCounter::default();
    let server = start(&runs);

    let mut cut = RawExchange::post_partial(
        server.addr(),
        "/echo",
        &[("Idempotency-Key", "cut"), ("Content-Length", "10")],
        b"0123",
    );
    cut.stream().shutdown(std::net::Shutdown::Write).unwrap();
    let head = cut.read_head();
    assert_eq!(head.status, 400, "{head:?}");
    assert_eq!(
        head.header("content-type"),
        Some("application/problem+json")
    );
    let problem = rest_of(&mut cut);
    assert!(
        problem.contains("tag:idempotency-actix,2026:body-unreadable"),
        "{problem:?}"
    );
    assert_eq!(runs.get(), 0, "the handler ran without its whole body");

    let whole = post(&server, "cut", b"0123456789").await;
    assert_eq!(whole.status, StatusCode::CREATED, "{whole:?}");
    assert!(!whole.is_replay());
    assert_eq!(whole.body, "run 1: 0123456789");
    let retry = post(&server, "cut", b"0123456789").await;
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.body, whole.body);
    assert_eq!(runs.get(), 1);
}

/// A chunked body whose client resets the connection after its last data chunk but before
/// the chunk that ends it: the request never had its whole body, so it ran nothing and
/// holds nothing; the same request sent whole afterwards runs once.
#[actix_rt::test]
async fn a_chunked_body_cut_by_a_reset_runs_nothing_and_leaves_the_key_free() {
    let runs = RunCounter::default();
    let server = start(&runs);

    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(
        socket,
        "POST /echo HTTP/1.1\r\nHost: test\r\nIdempotency-Key: chunked\r\n\
         Transfer-Encoding: chunked\r\n\r\n5\r\n01234\r\n5\r\n56789\r\n"
    )
    .unwrap();
    socket.flush().unwrap();
    reset(socket);

    // Whether the server saw the reset before this request or not, the key is not held:
    // 201 from a run of its own, never 409 or a replay of a run nobody saw.
    let whole = post(&server, "chunked", b"0123456789").await;
    assert_eq!(whole.status, StatusCode::CREATED, "{whole:?}");
    assert!(!whole.is_replay(), "{whole:?}");
    assert_eq!(whole.body, "run 1: 0123456789");
    assert_eq!(runs.get(), 1);
}

/// A body that trickles in while a duplicate that sent its whole body at once is served:
/// the duplicate runs; the trickled request, once its body is in, is the replay of that run
/// (the same bytes are the same request), never a second run.
#[actix_rt::test]
async fn a_trickled_body_whose_duplicate_ran_meanwhile_gets_the_replay() {
    let runs = RunCounter::default();
    let server = start(&runs);

    let mut trickled = RawExchange::post_partial(
        server.addr(),
        "/echo",
        &[("Idempotency-Key", "trickled"), ("Content-Length", "10")],
        b"01",
    );
    let whole = post(&server, "trickled", b"0123456789").await;
    assert_eq!(whole.status, StatusCode::CREATED, "{whole:?}");
    assert_eq!(runs.get(), 1);
    for byte in b"23456789" {
        trickled.stream().write_all(&[*byte]).unwrap();
        trickled.stream().flush().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let head = trickled.read_head();
    assert_eq!(head.status, 201, "{head:?}");
    assert_eq!(head.header("idempotent-replayed"), Some("true"), "{head:?}");
    assert_eq!(rest_of(&mut trickled), "run 1: 0123456789");
    assert_eq!(runs.get(), 1);
}

/// Reads the final response head of `exchange`, past a `100 Continue` if one comes first.
fn final_head(exchange: &mut RawExchange) -> (bool, RawHead) {
    let head = exchange.read_head();
    if head.status == 100 {
        (true, exchange.read_head())
    } else {
        (false, head)
    }
}

/// A client that sends `Expect: 100-continue` and its body only once told to: it is told
/// to, its request runs once, and its retry (sent the same way) is the replay. One that
/// declares a body over the limit gets 413 and runs nothing.
#[actix_rt::test]
async fn a_client_waiting_for_100_continue_runs_once_and_gets_the_replay() {
    let runs = RunCounter::default();
    let server = start(&runs);
    let expecting = |key: &str, length: usize| {
        let length = length.to_string();
        RawExchange::post_partial(
            server.addr(),
            "/echo",
            &[
                ("Idempotency-Key", key),
                ("Content-Length", &length),
                ("Expect", "100-continue"),
            ],
            b"",
        )
    };

    let mut replies = Vec::new();
    for _ in 0..2 {
        let mut exchange = expecting("expects", 10);
        let head = exchange.read_head();
        assert_eq!(head.status, 100, "{head:?}");
        exchange.stream().write_all(b"0123456789").unwrap();
        let head = exchange.read_head();
        assert_eq!(head.status, 201, "{head:?}");
        replies.push((head, rest_of(&mut exchange)));
    }
    assert_eq!(replies[0].0.header("idempotent-replayed"), None);
    assert_eq!(replies[0].1, "run 1: 0123456789");
    assert_eq!(
        replies[1].0.header("idempotent-replayed"),
        Some("true"),
        "{:?}",
        replies[1].0
    );
    assert_eq!(replies[1].1, replies[0].1);

    // Over the limit: refused on the declared length, whether or not the client was told to
    // go on (it does not send the body either way).
    let mut oversized = expecting("oversized", LIMIT + 1);
    let (_continued, head) = final_head(&mut oversized);
    assert_eq!(head.status, 413, "{head:?}");
    assert_eq!(runs.get(), 1);
}
