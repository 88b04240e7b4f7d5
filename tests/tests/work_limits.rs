//! Issue 13 item 3: each worker caps its keyed work. Clients that send slow keyed requests
//! and hang up cannot pile up unbounded detached handlers, commits retried in the background
//! cannot pile up with their responses, and a worker at its in-flight cap answers new keyed
//! requests with 503 and `Retry-After` at once; nothing that already started is dropped, and
//! service resumes when the work drains. Real sockets, a private `redis-server` (or the
//! memory store with its commits failing).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpServer};
use idempotency_actix::{Idempotency, KeyScope, RedisStore};
use idempotency_actix_tests::{FaultyStore, GatedRoutes, PrivateRedis, RawExchange, Reply};

/// A one-worker server for `/work` and `/quick`, with `limits` on its `Idempotency`.
///
/// It does not allow half-closed connections, so a client that hangs up is noticed while
/// its handler runs (with Actix's default, only when the response is written).
struct Served {
    addr: std::net::SocketAddr,
    handle: actix_web::dev::ServerHandle,
    client: awc::Client,
}

fn start(
    redis: &PrivateRedis,
    routes: &GatedRoutes,
    limits: fn(Idempotency) -> Idempotency,
) -> Served {
    let pool = RedisStore::pool(&redis.url()).unwrap();
    start_on(routes, move || limits(Idempotency::redis(pool.clone())))
}

/// [`start`] on the `Idempotency` that `idempotency` builds (with a global key scope).
fn start_on(
    routes: &GatedRoutes,
    idempotency: impl Fn() -> Idempotency + Clone + Send + 'static,
) -> Served {
    let routes = routes.clone();
    let server = HttpServer::new(move || {
        App::new()
            .wrap(idempotency().scope(KeyScope::global()))
            .configure(routes.configure())
    })
    .workers(1)
    .h1_allow_half_closed(false)
    .bind(("127.0.0.1", 0))
    .unwrap();
    let addr = server.addrs()[0];
    let server = server.run();
    let handle = server.handle();
    actix_rt::spawn(server);
    Served {
        addr,
        handle,
        client: awc::Client::default(),
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        drop(self.handle.stop(false));
    }
}

async fn post(server: &Served, path: &str, key: Option<&str>) -> Reply {
    let mut request = server.client.post(format!("http://{}{path}", server.addr));
    if let Some(key) = key {
        request = request.insert_header(("idempotency-key", key));
    }
    Reply::read(request.send().await.unwrap()).await.unwrap()
}

fn assert_overloaded(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    assert_eq!(reply.header("retry-after"), Some("1"));
    assert_eq!(
        reply.json()["type"],
        "tag:idempotency-actix,2026:overloaded"
    );
}

/// Sends `key` to `path` until it is neither 409 (its first request still running) nor 503
/// (the worker still busy), at most 500 times.
async fn once_settled(server: &Served, path: &str, key: &str) -> Reply {
    for _ in 0..500 {
        let reply = post(server, path, Some(key)).await;
        if ![StatusCode::CONFLICT, StatusCode::SERVICE_UNAVAILABLE].contains(&reply.status) {
            return reply;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{key} stayed in flight");
}

#[actix_rt::test]
async fn clients_that_hang_up_cannot_pile_up_detached_work() {
    let redis = PrivateRedis::start().await;
    let routes = GatedRoutes::default();
    let (runs, gate) = (&routes.work_runs, &routes.gate);
    let server = start(&redis, &routes, |i| i.max_detached(2));

    // Two slow keyed requests whose clients hang up while the handlers run.
    let hung_up: Vec<RawExchange> = ["gone-1", "gone-2"]
        .iter()
        .map(|key| RawExchange::post(server.addr, "/work", &[("Idempotency-Key", key)]))
        .collect();
    runs.wait_for(2).await;
    drop(hung_up);

    // Once the worker noticed, new keyed requests are refused at once instead of piling up.
    let mut refused = None;
    for attempt in 0..500 {
        let reply = post(&server, "/quick", Some(&format!("probe-{attempt}"))).await;
        if reply.status != StatusCode::CREATED {
            refused = Some((attempt, reply));
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    let (served, refused) = refused.expect("the detached cap never applied");
    assert_overloaded(&refused);
    assert_overloaded(&post(&server, "/quick", Some("another")).await);
    assert_eq!(
        routes.quick_runs.get(),
        served,
        "a refused request ran its handler"
    );
    // Requests without a key are not protected work and still run.
    assert_eq!(
        post(&server, "/quick", None).await.status,
        StatusCode::CREATED
    );

    // The detached handlers were never dropped: they finish, commit, and service resumes.
    gate.open();
    for key in ["gone-1", "gone-2"] {
        let retry = once_settled(&server, "/work", key).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}");
        assert!(retry.is_replay(), "{key} was not committed: {retry:?}");
    }
    assert_eq!(runs.get(), 2);
    let resumed = once_settled(&server, "/quick", "after").await;
    assert_eq!(resumed.status, StatusCode::CREATED, "{resumed:?}");
    assert_eq!(
        routes.quick_runs.get(),
        served + 2,
        "the keyless one and `after`"
    );
}

#[actix_rt::test]
async fn a_worker_at_its_in_flight_cap_answers_503_at_once() {
    let redis = PrivateRedis::start().await;
    let routes = GatedRoutes::default();
    let (runs, gate) = (&routes.work_runs, &routes.gate);
    let server = start(&redis, &routes, |i| i.max_in_flight(2));

    let mut running: Vec<RawExchange> = ["busy-1", "busy-2"]
        .iter()
        .map(|key| RawExchange::post(server.addr, "/work", &[("Idempotency-Key", key)]))
        .collect();
    runs.wait_for(2).await;

    assert_overloaded(&post(&server, "/quick", Some("third")).await);
    assert_eq!(
        routes.quick_runs.get(),
        0,
        "a refused request ran its handler"
    );
    assert_eq!(
        post(&server, "/quick", None).await.status,
        StatusCode::CREATED
    );

    // Nothing that started is dropped: both answer, and the next keyed request runs.
    gate.open();
    for exchange in &mut running {
        assert_eq!(exchange.read_head().status, 201);
    }
    drop(running);
    let next = once_settled(&server, "/quick", "third").await;
    assert_eq!(next.status, StatusCode::CREATED, "{next:?}");
    assert!(!next.is_replay(), "a refused request was never stored");
    assert_eq!(runs.get(), 2);
    assert_eq!(routes.quick_runs.get(), 2, "the keyless one and `third`");
}

/// A keyed request takes its slot once its body has arrived: clients that stall their
/// uploads (a slow network, or someone trying to exhaust the cap) leave the worker's keyed
/// work to everyone else, and are served when their bodies arrive.
#[actix_rt::test]
async fn stalled_uploads_leave_the_keyed_work_cap_to_others() {
    use std::io::Write;

    let redis = PrivateRedis::start().await;
    let routes = GatedRoutes::default();
    let server = start(&redis, &routes, |i| i.max_in_flight(2));

    // Three keyed uploads, more than the cap, each stopped 7 bytes short of its body.
    let mut stalled: Vec<RawExchange> = (0..3)
        .map(|n| {
            let key = format!("stalled-{n}");
            RawExchange::post_partial(
                server.addr,
                "/quick",
                &[("Idempotency-Key", &key), ("Content-Length", "10")],
                b"{\"n\"",
            )
        })
        .collect();

    // For half a second, while the worker has long read the stalled requests' heads, other
    // clients' keyed requests are served.
    for attempt in 0..50 {
        let reply = post(&server, "/quick", Some(&format!("other-{attempt}"))).await;
        assert_eq!(
            reply.status,
            StatusCode::CREATED,
            "attempt {attempt}: {reply:?}"
        );
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(routes.quick_runs.get(), 50);

    // The stalled uploads go on where they stopped and are served.
    for exchange in &mut stalled {
        exchange.stream().write_all(b":1}   ").unwrap();
        assert_eq!(exchange.read_head().status, 201);
    }
    assert_eq!(routes.quick_runs.get(), 53);
}

/// A commit that fails is retried in the background while the client already has its
/// response; each such retry holds that response. They count as detached work, so a store
/// that takes `begin`s but fails every commit fills the detached cap and new keys get 503,
/// instead of the worker running handlers and piling up their unstored responses.
#[actix_rt::test]
async fn commits_retried_in_the_background_count_as_detached_work() {
    let store = FaultyStore {
        failed_commits: std::sync::Arc::new(u32::MAX.into()),
        ..FaultyStore::default()
    };
    let routes = GatedRoutes::default();
    let server = start_on(&routes, {
        let store = store.clone();
        move || Idempotency::new(store.clone()).max_detached(2)
    });

    // Each client gets its response although its commit failed.
    for key in ["first", "second"] {
        let reply = post(&server, "/quick", Some(key)).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{key}: {reply:?}");
        assert!(!reply.is_replay(), "{key}: {reply:?}");
    }
    assert_eq!(routes.quick_runs.get(), 2);

    // Their commits, still retried, fill the cap: a new key is refused before it runs.
    assert_overloaded(&post(&server, "/quick", Some("third")).await);
    assert_eq!(
        routes.quick_runs.get(),
        2,
        "a refused request ran its handler"
    );

    // Once commits land again the retries are replayed and new keys run.
    store
        .failed_commits
        .store(0, std::sync::atomic::Ordering::SeqCst);
    for key in ["first", "second"] {
        let retry = once_settled(&server, "/quick", key).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{key}: {retry:?}");
        assert!(retry.is_replay(), "{key} was never committed: {retry:?}");
        assert_eq!(retry.body, "quick");
    }
    let third = once_settled(&server, "/quick", "third").await;
    assert_eq!(third.status, StatusCode::CREATED, "{third:?}");
    assert!(!third.is_replay(), "{third:?}");
    assert_eq!(routes.quick_runs.get(), 3, "no handler ran twice");
}
