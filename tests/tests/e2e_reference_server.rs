//! The reference server (DESIGN §11) as a real process, driven over HTTP: every route's
//! contract, concurrency on one instance and across two sharing one Redis, expiry, error
//! and panic release, oversized responses, `IDEMPOTENCY=off`, `IDEMPOTENCY_METHODS`, the
//! graceful stop on SIGTERM and SIGINT, the middleware's log on stderr, and invalid
//! configuration.
//!
//! Each test starts its own servers (see [`ReferenceServer`]) on the Redis at `REDIS_URL`
//! (default 127.0.0.1:6379) under a key prefix of its own (`IDEMPOTENCY_PREFIX`), and
//! counts handler runs with `GET /stats`. The tests named `on_redis_cluster_…` run the
//! essentials on a local 6-node Redis Cluster (`REDIS_CLUSTER_URLS`) that this test binary
//! starts.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use actix_web::http::{Method, StatusCode};
use actix_web::web::Bytes;
use futures_util::future::join_all;
use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::{
    RawExchange, ReferenceServer, Reply, keys_under, redis_connection, redis_url, reset,
    unique_prefix,
};
use serde_json::{Value, json};

/// Assertions on the reference server's answers.
trait ReplyAssertions {
    /// A fresh run of the handler: its status, not a replay.
    fn assert_executed(&self, status: StatusCode);
    /// A replay of `original`: same status and body, byte for byte, with the replay header.
    fn assert_replay_of(&self, original: &Reply);
    /// An RFC 9457 problem with `status`.
    fn assert_problem(&self, status: StatusCode);
}

impl ReplyAssertions for Reply {
    fn assert_executed(&self, status: StatusCode) {
        assert_eq!(self.status, status, "{self:?}");
        assert!(
            !self.is_replay(),
            "expected a fresh run, got a replay: {self:?}"
        );
    }

    fn assert_replay_of(&self, original: &Reply) {
        assert_eq!(self.status, original.status, "{self:?}");
        assert!(self.is_replay(), "expected a replay: {self:?}");
        assert_eq!(self.body, original.body);
    }

    fn assert_problem(&self, status: StatusCode) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(self.json()["status"], status.as_u16());
    }
}

fn client() -> awc::Client {
    awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish()
}

/// A fresh key, in the IETF draft's sf-string form.
fn new_key() -> String {
    format!("\"{}\"", uuid::Uuid::new_v4())
}

async fn request(
    client: &awc::Client,
    method: Method,
    url: &str,
    key: Option<&str>,
    body: Option<(&str, Bytes)>,
) -> Reply {
    let mut request = client.request(method.clone(), url);
    if let Some(key) = key {
        request = request.insert_header(("Idempotency-Key", key));
    }
    let sent = match body {
        Some((content_type, body)) => {
            request
                .insert_header(("content-type", content_type))
                .send_body(body)
                .await
        }
        None => request.send().await,
    };
    let response = sent.unwrap_or_else(|error| panic!("{method} {url}: {error}"));
    Reply::read(response)
        .await
        .unwrap_or_else(|error| panic!("{method} {url}: reading the body: {error}"))
}

async fn post(client: &awc::Client, url: &str, key: Option<&str>) -> Reply {
    request(client, Method::POST, url, key, None).await
}

async fn post_json(client: &awc::Client, url: &str, key: Option<&str>, body: &Value) -> Reply {
    let body = Bytes::from(serde_json::to_vec(body).unwrap());
    request(
        client,
        Method::POST,
        url,
        key,
        Some(("application/json", body)),
    )
    .await
}

/// `GET /stats`, checked to list exactly the six counters.
async fn stats(client: &awc::Client, server: &ReferenceServer) -> Value {
    let reply = request(client, Method::GET, &server.url("/stats"), None, None).await;
    assert_eq!(reply.status, StatusCode::OK);
    let stats = reply.json();
    let mut names: Vec<&str> = stats
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, count)| {
            assert!(count.is_u64(), "{name}: {count}");
            name.as_str()
        })
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "flaky", "large", "orders", "payments", "profile", "untagged"
        ]
    );
    stats
}

async fn count(client: &awc::Client, server: &ReferenceServer, counter: &str) -> u64 {
    stats(client, server).await[counter].as_u64().unwrap()
}

/// Waits (up to 5 s) until the first `POST /orders` of `server` has reached its handler:
/// its run is counted in `/stats`.
async fn handler_started(client: &awc::Client, server: &ReferenceServer) {
    let mut started = 0;
    for _ in 0..500 {
        started = count(client, server, "orders").await;
        if started == 1 {
            return;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(started, 1, "the handler never started");
}

/// A server on the test Redis under a prefix of its own, plus `env`.
async fn start_on_redis(test: &str, env: &[(&str, &str)]) -> (ReferenceServer, String) {
    start_on_redis_with_prefix(&unique_prefix(test), env).await
}

/// A server on the test Redis under `prefix`, plus `env`.
async fn start_on_redis_with_prefix(
    prefix: &str,
    env: &[(&str, &str)],
) -> (ReferenceServer, String) {
    redis_connection().await; // a clear message when Redis is down
    let url = redis_url();
    let mut vars = vec![("REDIS_URL", url.as_str()), ("IDEMPOTENCY_PREFIX", prefix)];
    vars.extend_from_slice(env);
    let server = ReferenceServer::start(&vars);
    (server, prefix.to_owned())
}

fn assert_uuid_v4(value: &Value) -> uuid::Uuid {
    let id = uuid::Uuid::parse_str(value.as_str().unwrap()).unwrap();
    assert_eq!(id.get_version_num(), 4, "{id}");
    id
}

/// The body `/large?bytes=N` answers: byte `i` is `b'a' + i % 26`.
fn large_body(bytes: usize) -> Vec<u8> {
    (b'a'..=b'z').cycle().take(bytes).collect()
}

#[actix_rt::test]
async fn every_route_answers_as_specified() {
    let (server, prefix) = start_on_redis("e2e-routes", &[]).await;
    let client = client();

    // POST /orders: 201, the order with a fresh id and the run's seq, Location, Set-Cookie.
    let key = new_key();
    let order = json!({ "item": "book", "qty": 3 });
    let created = post_json(&client, &server.url("/orders"), Some(&key), &order).await;
    created.assert_executed(StatusCode::CREATED);
    let body = created.json();
    let id = assert_uuid_v4(&body["id"]);
    assert_eq!(body["item"], "book");
    assert_eq!(body["qty"], 3);
    assert_eq!(body["seq"], 1);
    assert_eq!(body.as_object().unwrap().len(), 4, "{body}");
    assert_eq!(
        created.header("location"),
        Some(format!("/orders/{id}").as_str())
    );
    assert_eq!(created.header("set-cookie"), Some("session=new; Path=/"));
    assert_eq!(created.header("content-type"), Some("application/json"));

    // Its retry: the same answer, without the cookie, marked as a replay.
    let retry = post_json(&client, &server.url("/orders"), Some(&key), &order).await;
    retry.assert_replay_of(&created);
    assert_eq!(retry.header("location"), created.header("location"));
    assert_eq!(retry.header("set-cookie"), None);

    // Invalid JSON and a wrong shape: 400 from the extractor; the handler does not run.
    let broken = Bytes::from_static(br#"{"item": "book", "qty":"#);
    let reply = request(
        &client,
        Method::POST,
        &server.url("/orders"),
        Some(&new_key()),
        Some(("application/json", broken)),
    )
    .await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let wrong = json!({ "item": 1, "qty": "two" });
    let reply = post_json(&client, &server.url("/orders"), Some(&new_key()), &wrong).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(count(&client, &server, "orders").await, 1);

    // delay_ms: the handler sleeps that long.
    let started = Instant::now();
    let slow = post_json(
        &client,
        &server.url("/orders?delay_ms=300"),
        Some(&new_key()),
        &order,
    )
    .await;
    slow.assert_executed(StatusCode::CREATED);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(slow.json()["seq"], 2);

    // POST /payments: a key is required; 200 with a payment id.
    let payment = json!({ "amount": 1000, "currency": "EUR" });
    post_json(&client, &server.url("/payments"), None, &payment)
        .await
        .assert_problem(StatusCode::BAD_REQUEST);
    let key = new_key();
    let paid = post_json(&client, &server.url("/payments"), Some(&key), &payment).await;
    paid.assert_executed(StatusCode::OK);
    assert_uuid_v4(&paid.json()["payment_id"]);
    assert_eq!(paid.json()["seq"], 1);
    post_json(&client, &server.url("/payments"), Some(&key), &payment)
        .await
        .assert_replay_of(&paid);

    // POST /flaky: 200 by default.
    let flaky = post(&client, &server.url("/flaky"), Some(&new_key())).await;
    flaky.assert_executed(StatusCode::OK);
    assert_eq!(flaky.json(), json!({ "seq": 1, "status": 200 }));

    // PUT /profile: protected too.
    let key = new_key();
    let profile = request(
        &client,
        Method::PUT,
        &server.url("/profile"),
        Some(&key),
        None,
    )
    .await;
    profile.assert_executed(StatusCode::OK);
    assert_eq!(profile.json(), json!({ "seq": 1 }));
    request(
        &client,
        Method::PUT,
        &server.url("/profile"),
        Some(&key),
        None,
    )
    .await
    .assert_replay_of(&profile);

    // POST /large: N bytes of octet-stream, replayed byte for byte.
    let key = new_key();
    let large = post(&client, &server.url("/large?bytes=5000"), Some(&key)).await;
    large.assert_executed(StatusCode::OK);
    assert_eq!(
        large.header("content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(large.body, large_body(5000));
    post(&client, &server.url("/large?bytes=5000"), Some(&key))
        .await
        .assert_replay_of(&large);

    // POST /untagged: not protected by default, so a retry runs again.
    let key = new_key();
    let first = post(&client, &server.url("/untagged"), Some(&key)).await;
    first.assert_executed(StatusCode::OK);
    assert_eq!(first.json(), json!({ "seq": 1 }));
    let second = post(&client, &server.url("/untagged"), Some(&key)).await;
    second.assert_executed(StatusCode::OK);
    assert_eq!(second.json(), json!({ "seq": 2 }));

    // GET /stats: how often each handler ran.
    assert_eq!(
        stats(&client, &server).await,
        json!({ "orders": 2, "payments": 1, "flaky": 1, "profile": 1, "large": 1, "untagged": 2 })
    );

    // The records live under IDEMPOTENCY_PREFIX.
    let keys = keys_under(&mut redis_connection().await, &prefix).await;
    assert!(keys.len() >= 5, "{keys:?}");
}

#[actix_rt::test]
async fn a_hundred_concurrent_identical_orders_run_once() {
    let (server, _prefix) = start_on_redis("e2e-concurrent", &[]).await;
    let client = client();
    let before = count(&client, &server, "orders").await;

    let key = new_key();
    let order = json!({ "item": "chair", "qty": 4 });
    let url = server.url("/orders?delay_ms=500");
    let replies = join_all((0..100).map(|_| post_json(&client, &url, Some(&key), &order))).await;

    let executed: Vec<&Reply> = replies
        .iter()
        .filter(|reply| reply.status == StatusCode::CREATED && !reply.is_replay())
        .collect();
    assert_eq!(executed.len(), 1, "{replies:?}");
    for reply in &replies {
        match reply.status {
            StatusCode::CONFLICT => assert!(reply.header("retry-after").is_some()),
            StatusCode::CREATED if reply.is_replay() => reply.assert_replay_of(executed[0]),
            StatusCode::CREATED => {}
            _ => panic!("unexpected answer: {reply:?}"),
        }
    }
    assert_eq!(count(&client, &server, "orders").await, before + 1);

    post_json(&client, &url, Some(&key), &order)
        .await
        .assert_replay_of(executed[0]);
    assert_eq!(count(&client, &server, "orders").await, before + 1);
}

#[actix_rt::test]
async fn payments_run_again_once_their_two_second_ttl_expired() {
    let (server, _prefix) = start_on_redis("e2e-payments-ttl", &[]).await;
    let client = client();
    let key = new_key();
    let payment = json!({ "amount": 250 });
    let url = server.url("/payments");

    let first = post_json(&client, &url, Some(&key), &payment).await;
    first.assert_executed(StatusCode::OK);
    post_json(&client, &url, Some(&key), &payment)
        .await
        .assert_replay_of(&first);
    assert_eq!(count(&client, &server, "payments").await, 1);

    actix_rt::time::sleep(Duration::from_millis(2600)).await;
    let after_expiry = post_json(&client, &url, Some(&key), &payment).await;
    after_expiry.assert_executed(StatusCode::OK);
    assert_ne!(
        after_expiry.json()["payment_id"],
        first.json()["payment_id"]
    );
    assert_eq!(count(&client, &server, "payments").await, 2);
}

#[actix_rt::test]
async fn two_users_sending_the_same_key_and_body_each_run_the_handler() {
    let (server, _prefix) = start_on_redis("e2e-principals", &[]).await;
    let client = client();
    let key = new_key();
    let order = json!({ "item": "book", "qty": 1 });
    let send = |user: &'static str| {
        let request = client
            .post(server.url("/orders"))
            .insert_header(("Idempotency-Key", key.as_str()))
            .insert_header(("X-User", user));
        let order = order.clone();
        async move {
            Reply::read(request.send_json(&order).await.unwrap())
                .await
                .unwrap()
        }
    };

    let alice = send("alice").await;
    alice.assert_executed(StatusCode::CREATED);
    let bob = send("bob").await;
    bob.assert_executed(StatusCode::CREATED);
    assert_ne!(
        alice.json()["id"],
        bob.json()["id"],
        "bob got alice's order"
    );
    assert_ne!(alice.header("location"), bob.header("location"));
    // Names in UTF-8 are principals too, each their own.
    let (jose, josè) = (send("josé").await, send("josè").await);
    jose.assert_executed(StatusCode::CREATED);
    josè.assert_executed(StatusCode::CREATED);
    assert_ne!(jose.json()["id"], josè.json()["id"]);
    // Each user's retry replays their own response; an anonymous caller has keys of its own.
    send("alice").await.assert_replay_of(&alice);
    send("bob").await.assert_replay_of(&bob);
    send("josé").await.assert_replay_of(&jose);
    send("josè").await.assert_replay_of(&josè);
    post_json(&client, &server.url("/orders"), Some(&key), &order)
        .await
        .assert_executed(StatusCode::CREATED);
    assert_eq!(count(&client, &server, "orders").await, 5);
}

#[actix_rt::test]
async fn flaky_error_responses_are_not_stored() {
    let (server, _prefix) = start_on_redis("e2e-flaky-500", &[]).await;
    let client = client();
    let key = new_key();
    let url = server.url("/flaky?status=500");

    let first = post(&client, &url, Some(&key)).await;
    first.assert_executed(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(first.json(), json!({ "seq": 1, "status": 500 }));
    let retry = post(&client, &url, Some(&key)).await;
    retry.assert_executed(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(retry.json(), json!({ "seq": 2, "status": 500 }));
    assert_eq!(count(&client, &server, "flaky").await, 2);
}

#[actix_rt::test]
async fn flaky_success_statuses_are_stored() {
    let (server, _prefix) = start_on_redis("e2e-flaky-201", &[]).await;
    let client = client();
    let key = new_key();
    let url = server.url("/flaky?status=201");

    let first = post(&client, &url, Some(&key)).await;
    first.assert_executed(StatusCode::CREATED);
    assert_eq!(first.json(), json!({ "seq": 1, "status": 201 }));
    post(&client, &url, Some(&key))
        .await
        .assert_replay_of(&first);
    assert_eq!(count(&client, &server, "flaky").await, 1);
}

#[actix_rt::test]
async fn informational_statuses_pass_through_and_are_never_stored() {
    let (server, _prefix) = start_on_redis("e2e-flaky-1xx", &[]).await;
    let client = client();
    for status in [101, 103] {
        let key = new_key();
        let path = format!("/flaky?status={status}");
        for _ in 0..2 {
            // Plain Actix sends a handler's 1xx as it is; the middleware neither stores nor
            // replays it, so the head comes at once and each retry runs the handler.
            let head =
                RawExchange::post(server.addr(), &path, &[("Idempotency-Key", &key)]).read_head();
            assert_eq!(head.status, status, "{head:?}");
            assert_eq!(head.header("idempotent-replayed"), None, "{head:?}");
        }
    }
    assert_eq!(count(&client, &server, "flaky").await, 4);
}

#[actix_rt::test]
async fn no_content_and_not_modified_are_replayed_without_a_body() {
    let (server, _prefix) = start_on_redis("e2e-flaky-204", &[]).await;
    let client = client();
    for status in [204, 304] {
        let key = new_key();
        let path = format!("/flaky?status={status}");
        let exchanges = (0..2).map(|_| {
            let mut exchange =
                RawExchange::post(server.addr(), &path, &[("Idempotency-Key", &key)]);
            let head = exchange.read_head();
            (head, exchange.read_to_end())
        });
        let [(first, first_body), (replay, replay_body)] =
            <[_; 2]>::try_from(exchanges.collect::<Vec<_>>()).unwrap();
        assert_eq!(first.status, status);
        assert_eq!(first.header("idempotent-replayed"), None);
        assert_eq!(replay.status, status);
        assert_eq!(
            replay.header("idempotent-replayed"),
            Some("true"),
            "{replay:?}"
        );
        for head in [&first, &replay] {
            assert_eq!(head.header("content-length"), None, "{head:?}");
            assert_eq!(head.header("transfer-encoding"), None, "{head:?}");
            assert_eq!(head.header("content-type"), Some("application/json"));
        }
        assert_eq!(replay.header("idempotent-body-omitted"), None, "{replay:?}");
        assert_eq!(
            (first_body.as_slice(), replay_body.as_slice()),
            (&[][..], &[][..])
        );
    }
    assert_eq!(count(&client, &server, "flaky").await, 2);
}

#[actix_rt::test]
async fn a_panicking_handler_answers_500_and_releases_its_key() {
    let (server, _prefix) = start_on_redis("e2e-flaky-panic", &[]).await;
    let client = client();
    let key = new_key();
    let url = server.url("/flaky?panic=1");

    let first = post(&client, &url, Some(&key)).await;
    first.assert_executed(StatusCode::INTERNAL_SERVER_ERROR);
    let retry = post(&client, &url, Some(&key)).await;
    retry.assert_executed(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(count(&client, &server, "flaky").await, 2);

    // The server keeps serving.
    post(&client, &server.url("/flaky"), Some(&new_key()))
        .await
        .assert_executed(StatusCode::OK);
}

#[actix_rt::test]
async fn a_response_over_the_stored_limit_is_sent_whole_and_never_rerun() {
    let (server, _prefix) = start_on_redis("e2e-large", &[]).await;
    let client = client();
    let key = new_key();
    let bytes = 1024 * 1024 + 4096; // over the 1 MiB stored-body default
    let url = server.url(&format!("/large?bytes={bytes}"));

    let first = post(&client, &url, Some(&key)).await;
    first.assert_executed(StatusCode::OK);
    assert_eq!(first.body.len(), bytes);
    assert!(first.body == large_body(bytes), "the body's bytes differ");

    let retry = post(&client, &url, Some(&key)).await;
    assert_eq!(retry.status, StatusCode::OK);
    assert!(retry.is_replay(), "{retry:?}");
    assert_eq!(retry.header("idempotent-body-omitted"), Some("true"));
    assert!(retry.body.is_empty());
    assert_eq!(count(&client, &server, "large").await, 1);
}

#[actix_rt::test]
async fn idempotency_off_leaves_every_route_unprotected() {
    // The settings of the middleware are accepted (`off` alone switches it off) and
    // ignored, as the start-up line says.
    let env = [
        ("IDEMPOTENCY", "off"),
        ("IDEMPOTENCY_METHODS", "POST"),
        ("REPLAY_CACHE", "on"),
    ];
    let (server, prefix) = start_on_redis("e2e-off", &env).await;
    let summary = line_on_stderr(&server, "idempotency off").await;
    assert!(
        summary.ends_with("ignored: REPLAY_CACHE, IDEMPOTENCY_METHODS, IDEMPOTENCY_PREFIX"),
        "{summary}"
    );
    let client = client();
    let order = json!({ "item": "book", "qty": 1 });
    let payment = json!({ "amount": 1 });

    for _ in 0..2 {
        let key = new_key();
        for _ in 0..2 {
            let created = post_json(&client, &server.url("/orders"), Some(&key), &order).await;
            created.assert_executed(StatusCode::CREATED);
            post_json(&client, &server.url("/payments"), Some(&key), &payment)
                .await
                .assert_executed(StatusCode::OK);
            post(&client, &server.url("/flaky?status=201"), Some(&key))
                .await
                .assert_executed(StatusCode::CREATED);
            request(
                &client,
                Method::PUT,
                &server.url("/profile"),
                Some(&key),
                None,
            )
            .await
            .assert_executed(StatusCode::OK);
            post(&client, &server.url("/large?bytes=10"), Some(&key))
                .await
                .assert_executed(StatusCode::OK);
            post(&client, &server.url("/untagged"), Some(&key))
                .await
                .assert_executed(StatusCode::OK);
        }
    }
    // Not even a key is required.
    post_json(&client, &server.url("/payments"), None, &payment)
        .await
        .assert_executed(StatusCode::OK);

    assert_eq!(
        stats(&client, &server).await,
        json!({ "orders": 4, "payments": 5, "flaky": 4, "profile": 4, "large": 4, "untagged": 4 })
    );
    let keys = keys_under(&mut redis_connection().await, &prefix).await;
    assert!(keys.is_empty(), "nothing is stored: {keys:?}");
}

#[actix_rt::test]
async fn idempotency_methods_post_protects_untagged_routes() {
    let (server, _prefix) = start_on_redis("e2e-methods", &[("IDEMPOTENCY_METHODS", "POST")]).await;
    let client = client();
    let key = new_key();
    let url = server.url("/untagged");

    let first = post(&client, &url, Some(&key)).await;
    first.assert_executed(StatusCode::OK);
    post(&client, &url, Some(&key))
        .await
        .assert_replay_of(&first);
    assert_eq!(count(&client, &server, "untagged").await, 1);

    // Tagged routes keep their own policy: /payments still requires a key.
    post_json(&client, &server.url("/payments"), None, &json!({}))
        .await
        .assert_problem(StatusCode::BAD_REQUEST);
}

#[actix_rt::test]
async fn two_servers_sharing_redis_run_a_handler_once_in_total() {
    redis_connection().await;
    let prefix = unique_prefix("e2e-two-servers");
    let url = redis_url();
    let env = [("REDIS_URL", url.as_str()), ("IDEMPOTENCY_PREFIX", &prefix)];
    let servers = [ReferenceServer::start(&env), ReferenceServer::start(&env)];
    assert_ne!(servers[0].addr(), servers[1].addr());
    let client = client();

    let key = new_key();
    let order = json!({ "item": "desk", "qty": 1 });
    let urls = servers
        .each_ref()
        .map(|server| server.url("/orders?delay_ms=500"));
    let replies =
        join_all((0..50).map(|i| post_json(&client, &urls[i % 2], Some(&key), &order))).await;

    let executed: Vec<&Reply> = replies
        .iter()
        .filter(|reply| reply.status == StatusCode::CREATED && !reply.is_replay())
        .collect();
    assert_eq!(executed.len(), 1, "{replies:?}");
    for reply in &replies {
        match reply.status {
            StatusCode::CONFLICT => assert!(reply.header("retry-after").is_some(), "{reply:?}"),
            StatusCode::CREATED if reply.is_replay() => reply.assert_replay_of(executed[0]),
            StatusCode::CREATED => {}
            _ => panic!("unexpected answer: {reply:?}"),
        }
    }
    let ran =
        count(&client, &servers[0], "orders").await + count(&client, &servers[1], "orders").await;
    assert_eq!(ran, 1);

    // Either server replays it.
    for url in &urls {
        post_json(&client, url, Some(&key), &order)
            .await
            .assert_replay_of(executed[0]);
    }
}

#[actix_rt::test]
async fn without_redis_url_the_in_memory_store_protects_routes() {
    let server = ReferenceServer::start(&[]);
    let client = client();
    let key = new_key();
    let order = json!({ "item": "pen", "qty": 10 });

    let first = post_json(&client, &server.url("/orders"), Some(&key), &order).await;
    first.assert_executed(StatusCode::CREATED);
    post_json(&client, &server.url("/orders"), Some(&key), &order)
        .await
        .assert_replay_of(&first);
    assert_eq!(count(&client, &server, "orders").await, 1);
}

/// Sends `POST /flaky` with `Upgrade: websocket` (and `key`, if any) and an empty body,
/// keeps its side of the connection open, and returns what arrived within 5 s.
fn post_naming_an_upgrade(server: &ReferenceServer, key: Option<&str>) -> String {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let key = key
        .map(|key| format!("Idempotency-Key: {key}\r\n"))
        .unwrap_or_default();
    write!(
        socket,
        "POST /flaky HTTP/1.1\r\nHost: x\r\nConnection: close\r\nUpgrade: websocket\r\n\
         {key}Content-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut received = Vec::new();
    let mut buffer = [0; 4096];
    // Until the server closes the connection or 5 s pass without a byte.
    while let Ok(read @ 1..) = socket.read(&mut buffer) {
        received.extend_from_slice(&buffer[..read]);
    }
    String::from_utf8_lossy(&received).into_owned()
}

/// A POST or PUT naming `Upgrade: websocket` (which no WebSocket handshake is: that is a
/// GET) makes Actix read its body up to the end of the connection, whatever its
/// `Content-Length`. A handler that does not read the body answers it at once, as plain
/// Actix does without a key; with a key, the middleware waited for that body to take the
/// fingerprint, so the client got nothing until it closed its side (then a 400
/// `body-unreadable`; helper review). DESIGN §7: bad input gets a clear error, never a
/// held connection. It is now refused at once: 400 `upgrade-requested`, handler not run.
#[actix_rt::test]
async fn a_keyed_request_naming_an_upgrade_is_answered_while_its_client_waits() {
    let server = ReferenceServer::start(&[]);
    let client = client();
    let keyless = post_naming_an_upgrade(&server, None);
    assert!(keyless.starts_with("HTTP/1.1 200 "), "{keyless:?}");
    let keyed = post_naming_an_upgrade(&server, Some(&new_key()));
    assert!(
        keyed.starts_with("HTTP/1.1 400 "),
        "no answer within 5 s to a keyed request the same request without a key gets \
         at once: {keyed:?}"
    );
    assert!(
        keyed.contains("application/problem+json")
            && keyed.contains("tag:idempotency-actix,2026:upgrade-requested"),
        "{keyed:?}"
    );
    assert_eq!(
        count(&client, &server, "flaky").await,
        1,
        "only the keyless one ran"
    );
}

/// Waits up to 10 s until the Redis at `REDIS_URL` holds a record under `prefix`: a request
/// has taken its key and its handler runs.
async fn record_under(prefix: &str) {
    let mut redis = redis_connection().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while keys_under(&mut redis, prefix).await.is_empty() {
        assert!(Instant::now() < deadline, "no record under {prefix}");
        actix_rt::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `signal` to a server on the test Redis while its handler runs a keyed
/// `POST /orders?delay_ms={delay_ms}`, and checks the graceful stop: the request finishes
/// with 201 and its record is committed, the process exits 0, and a server started
/// afterwards on the same Redis replays the response without running the handler.
async fn assert_graceful_stop(signal: &str, delay_ms: u64) {
    // Bounds the wait, beyond the longest delay asked for.
    let client = awc::Client::builder()
        .timeout(Duration::from_millis(delay_ms) + Duration::from_secs(30))
        .finish();
    let order = json!({ "item": "clock", "qty": 1 });
    let (mut server, prefix) = start_on_redis(&format!("e2e-sig{signal}"), &[]).await;
    let key = new_key();
    let path = format!("/orders?delay_ms={delay_ms}");
    let url = server.url(&path);
    let (reply, ()) =
        futures_util::future::join(post_json(&client, &url, Some(&key), &order), async {
            record_under(&prefix).await;
            server.signal(signal);
        })
        .await;
    reply.assert_executed(StatusCode::CREATED);
    let status = server.wait_for_exit().expect("the server stops");
    assert_eq!(status.code(), Some(0), "SIG{signal}: {}", server.stderr());

    let (after, _) = start_on_redis_with_prefix(&prefix, &[]).await;
    post_json(&client, &after.url(&path), Some(&key), &order)
        .await
        .assert_replay_of(&reply);
    assert_eq!(count(&client, &after, "orders").await, 0);
}

/// SIGTERM, or SIGINT (Ctrl-C), while a protected request runs: the server stops gracefully
/// (Actix's own handling of SIGINT dropped the request).
#[actix_rt::test]
async fn a_signal_lets_the_running_request_finish_and_commit() {
    for signal in ["TERM", "INT"] {
        assert_graceful_stop(signal, 1500).await;
    }
}

/// A graceful stop waits for a handler that runs longer than Actix's default shutdown
/// timeout of 30 s (which dropped it): this test takes 32 s.
#[actix_rt::test]
async fn a_graceful_stop_waits_for_a_request_longer_than_thirty_seconds() {
    assert_graceful_stop("TERM", 32_000).await;
}

/// A keyed request whose client reset the connection while its handler ran, then SIGTERM:
/// Actix's stop does not wait for it (it has no connection left), the server does, so its
/// handler ends and its response is committed, and a server started afterwards replays it
/// without running the handler. (Exiting once Actix had stopped cut the handler short and
/// left the key locked: the retry got 409.)
#[actix_rt::test]
async fn a_graceful_stop_finishes_a_request_whose_client_left() {
    use std::io::Write;

    let order = json!({ "item": "lamp", "qty": 3 });
    let (mut server, prefix) = start_on_redis("e2e-sig-client-left", &[]).await;
    let key = new_key();
    let path = "/orders?delay_ms=2000";
    let mut socket = std::net::TcpStream::connect(server.addr()).unwrap();
    let body = order.to_string();
    write!(
        socket,
        "POST {path} HTTP/1.1\r\nHost: test\r\nIdempotency-Key: {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The client leaves once the handler runs, not while the `begin` is on its way: a
    // client gone then leaves no run to finish (the drain waits for the abandon of its
    // token instead, `drain_release.rs`). Under load the reply of a `begin` already in
    // Redis can come later than a reset.
    let client = client();
    handler_started(&client, &server).await;
    // Actix drops the request's future, and its run goes on on a task of its own.
    reset(socket);
    server.signal("TERM");
    let status = server.wait_for_exit().expect("the server stops");
    assert_eq!(status.code(), Some(0), "{}", server.stderr());

    let (after, _) = start_on_redis_with_prefix(&prefix, &[]).await;
    let retry = post_json(&client, &after.url(path), Some(&key), &order).await;
    let stopped = server.stderr();
    assert_eq!(retry.status, StatusCode::CREATED, "{retry:?}\n{stopped}");
    assert!(
        retry.is_replay(),
        "the run was not committed: {retry:?}\n{stopped}"
    );
    assert_eq!(retry.json()["item"], "lamp", "{retry:?}");
    assert_eq!(count(&client, &after, "orders").await, 0);
}

/// A second signal during the graceful stop stops the server at once, with the exit status
/// of a process killed by that signal; the request it dropped keeps its key locked.
#[actix_rt::test]
async fn a_second_signal_stops_at_once() {
    let client = client();
    let order = json!({ "item": "kettle", "qty": 1 });
    let (mut server, prefix) = start_on_redis("e2e-sig-twice", &[]).await;
    let key = new_key();
    // Long enough that only a forced stop ends it before the client's 30 s timeout.
    let path = "/orders?delay_ms=20000";
    let (reply, ()) = futures_util::future::join(
        client
            .post(server.url(path))
            .insert_header(("Idempotency-Key", key.as_str()))
            .send_json(&order),
        async {
            record_under(&prefix).await;
            server.signal("TERM");
            line_on_stderr(&server, "stopping once").await;
            server.signal("INT");
        },
    )
    .await;
    assert!(reply.is_err(), "the request was not dropped: {reply:?}");
    let status = server.wait_for_exit().expect("the server stops at once");
    assert_eq!(status.code(), Some(130), "{}", server.stderr());

    let (after, _) = start_on_redis_with_prefix(&prefix, &[]).await;
    post_json(&client, &after.url(path), Some(&key), &order)
        .await
        .assert_problem(StatusCode::CONFLICT);
}

/// A second signal while Actix's stop waits for a request still running (one without a key,
/// so the drain before it had nothing to wait for) stops the server at once too.
#[actix_rt::test]
async fn a_second_signal_during_actixs_stop_stops_at_once() {
    let client = client();
    let order = json!({ "item": "kettle", "qty": 1 });
    let (mut server, _prefix) = start_on_redis("e2e-sig-twice-unkeyed", &[]).await;
    let path = "/orders?delay_ms=20000";
    let (reply, ()) =
        futures_util::future::join(client.post(server.url(path)).send_json(&order), async {
            handler_started(&client, &server).await;
            server.signal("TERM");
            line_on_stderr(&server, "stopping once").await;
            server.signal("TERM");
        })
        .await;
    assert!(reply.is_err(), "the request was not dropped: {reply:?}");
    let status = server.wait_for_exit().expect("the server stops at once");
    assert_eq!(status.code(), Some(143), "{}", server.stderr());
}

/// Runs the reference server with `env` until it exits by itself, as it does when it refuses
/// its configuration or cannot start: its exit code and what it wrote on stderr. Panics when
/// it starts instead (still running after 30 s), printed on stdout, or panicked.
fn exit_of(env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut child = ReferenceServer::command()
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{env:?}: the server started instead of exiting");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{env:?}: {stderr}");
    assert!(output.stdout.is_empty(), "{env:?}: printed on stdout");
    (output.status.code(), stderr)
}

/// An invalid variable exits with status 2; a `REDIS_URL` that is no Redis URL is a failure
/// to start (status 1), as the module docs of the reference server say.
#[test]
fn invalid_configuration_is_refused_with_a_clear_message() {
    for (variable, value, exit_status) in [
        ("IDEMPOTENCY", "maybe", 2),
        ("IDEMPOTENCY_METHODS", "POST,FETCH", 2),
        ("WORKERS", "zero", 2),
        // Over Actix's 512, which would panic at start.
        ("WORKERS", "513", 2),
        ("REDIS_URL", "not a url", 1),
        ("BIND", "not-an-address", 2),
        ("BIND", "127.0.0.1:99999", 2),
        ("LOG_LEVEL", "loud", 2),
        ("LOG_LEVEL", "3", 2),
    ] {
        let (code, stderr) = exit_of(&[(variable, value)]);
        assert_eq!(code, Some(exit_status), "{variable}={value:?}: {stderr}");
        assert!(stderr.contains(variable), "{variable}={value:?}: {stderr}");
    }
}

/// A count with a sign is refused as a malformed number, as one in words is; an
/// `IDEMPOTENCY_METHODS` with an empty entry (`,`, a trailing or doubled comma) is refused
/// rather than read as fewer methods, or none: a typo must not turn protection off.
#[test]
fn a_signed_count_and_an_empty_method_entry_are_refused() {
    for (variable, value, expected) in [
        ("WORKERS", "abc", "a number of workers"),
        ("WORKERS", "+2", "a number of workers"),
        ("IDEMPOTENCY_METHODS", ",", "no empty entries"),
        ("IDEMPOTENCY_METHODS", "POST,", "no empty entries"),
        ("IDEMPOTENCY_METHODS", "POST,,PUT", "no empty entries"),
    ] {
        let (code, stderr) = exit_of(&[(variable, value)]);
        assert_eq!(code, Some(2), "{variable}={value:?}: {stderr}");
        let refusal = format!("invalid {variable}={value:?}: expected ");
        assert!(stderr.contains(&refusal), "{variable}={value:?}: {stderr}");
        assert!(stderr.contains(expected), "{variable}={value:?}: {stderr}");
    }
}

/// With `DATABASE_URL`, a key prefix longer than the table's index can key is refused at
/// start (status 2, before the server says it listens). It used to pass the configuration
/// and panic every worker as it built its app, after "listening on" was printed (status 1).
#[test]
fn a_key_prefix_too_long_for_the_database_is_refused_at_start() {
    let prefix = "p".repeat(idempotency_actix::PostgresStore::MAX_KEY_PREFIX_BYTES + 1);
    let (code, stderr) = exit_of(&[
        (
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ),
        ("IDEMPOTENCY_PREFIX", &prefix),
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("invalid IDEMPOTENCY_PREFIX="), "{stderr}");
    assert!(stderr.contains("at most 2628 bytes"), "{stderr}");
}

/// The in-memory store answers replays from the process already: a replay cache in front of
/// it would do nothing, so asking for one is refused.
#[test]
fn a_replay_cache_on_the_in_memory_store_is_refused() {
    let (code, stderr) = exit_of(&[("REPLAY_CACHE", "on")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("REPLAY_CACHE"), "{stderr}");
    assert!(stderr.contains("in-memory store"), "{stderr}");
}

/// A loopback port nothing listens on (bound, then closed again).
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Waits up to 10 s for a line with `text` on the server's stderr, and returns it.
async fn line_on_stderr(server: &ReferenceServer, text: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stderr = server.stderr();
        if let Some(line) = stderr.lines().find(|line| line.contains(text)) {
            return line.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "no {text:?} on stderr:\n{stderr}"
        );
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The middleware's log reaches stderr: its errors and warnings by default (here a store
/// that does not answer), its debug lines (each request's outcome) with `LOG_LEVEL=debug`.
#[actix_rt::test]
async fn the_middlewares_log_reaches_stderr() {
    let client = client();
    let order = json!({ "item": "book", "qty": 1 });
    let redis = format!("redis://127.0.0.1:{}", closed_port());
    for (env, status, text, level) in [
        (
            ("REDIS_URL", redis.as_str()),
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency store failed; answering 503",
            "ERROR",
        ),
        (
            ("LOG_LEVEL", "debug"),
            StatusCode::CREATED,
            "idempotency: executing",
            "DEBUG",
        ),
    ] {
        let server = ReferenceServer::start(&[env]);
        let reply = post_json(&client, &server.url("/orders"), Some(&new_key()), &order).await;
        assert_eq!(reply.status, status, "{reply:?}");
        let line = line_on_stderr(&server, text).await;
        assert!(line.contains(level), "{line}");
        if env.0 == "REDIS_URL" {
            // By default, lines below WARN (written before this one) are left out.
            assert!(!server.stderr().contains("DEBUG"), "{}", server.stderr());
            // The start-up check says why Redis does not answer (it said "Timed out in
            // bb8" before).
            let warning = line_on_stderr(&server, "warning: Redis at REDIS_URL").await;
            assert!(warning.contains("Connection refused"), "{warning}");
        }
    }
}

/// `POST /ledger` is transactional; an app-level layer protecting POST would claim it
/// outside its transaction and every `POST /ledger` would answer 500, so the combination is
/// refused as configuration (exit 2), before any connection to the database: this one does
/// not answer (a start failure, exit 1, if it were tried).
#[test]
fn idempotency_methods_with_post_and_a_database_url_are_refused() {
    let database_url = format!("postgres://postgres@127.0.0.1:{}/none", closed_port());
    for methods in ["POST", "patch,post"] {
        let (code, stderr) = exit_of(&[
            ("DATABASE_URL", &database_url),
            ("IDEMPOTENCY_METHODS", methods),
        ]);
        assert_eq!(code, Some(2), "{methods}: {stderr}");
        assert!(stderr.contains("IDEMPOTENCY_METHODS"), "{stderr}");
        assert!(stderr.contains("POST /ledger"), "{stderr}");
    }
}

#[test]
fn a_bind_address_in_use_is_a_failure_to_start() {
    let server = ReferenceServer::start(&[]);
    let (code, stderr) = exit_of(&[("BIND", &server.addr().to_string())]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("BIND"), "{stderr}");
}

/// A server on this test binary's Redis Cluster under a prefix of its own, plus `env`.
fn start_on_redis_cluster(test: &str, env: &[(&str, &str)]) -> (ReferenceServer, String) {
    let seeds = RedisCluster::shared().urls_env();
    let prefix = unique_prefix(test);
    let mut vars = vec![
        ("REDIS_CLUSTER_URLS", seeds.as_str()),
        ("IDEMPOTENCY_PREFIX", &prefix),
    ];
    vars.extend_from_slice(env);
    (ReferenceServer::start(&vars), prefix)
}

/// How many records the cluster holds under `prefix`, over all primaries.
fn records_in_cluster(prefix: &str) -> usize {
    RedisCluster::shared()
        .count_keys_by_primary(prefix)
        .values()
        .sum()
}

#[actix_rt::test]
async fn on_redis_cluster_replays_conflicts_mismatches_and_releases() {
    let (server, prefix) = start_on_redis_cluster("e2e-cluster", &[]);
    let client = client();
    let orders = server.url("/orders");

    // Replay, byte for byte.
    let key = new_key();
    let order = json!({ "item": "lamp", "qty": 2 });
    let created = post_json(&client, &orders, Some(&key), &order).await;
    created.assert_executed(StatusCode::CREATED);
    post_json(&client, &orders, Some(&key), &order)
        .await
        .assert_replay_of(&created);
    // Another body with the same key: 422.
    post_json(
        &client,
        &orders,
        Some(&key),
        &json!({ "item": "lamp", "qty": 3 }),
    )
    .await
    .assert_problem(StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(count(&client, &server, "orders").await, 1);

    // A retry while the first runs (its in-flight record written): 409 with Retry-After,
    // then the replay.
    let slow = server.url("/orders?delay_ms=800");
    let key = new_key();
    let records_before = records_in_cluster(&prefix);
    let (first, second) =
        futures_util::future::join(post_json(&client, &slow, Some(&key), &order), async {
            for _ in 0..500 {
                if records_in_cluster(&prefix) > records_before {
                    break;
                }
                actix_rt::time::sleep(Duration::from_millis(10)).await;
            }
            post_json(&client, &slow, Some(&key), &order).await
        })
        .await;
    first.assert_executed(StatusCode::CREATED);
    second.assert_problem(StatusCode::CONFLICT);
    assert!(second.header("retry-after").is_some());
    post_json(&client, &slow, Some(&key), &order)
        .await
        .assert_replay_of(&first);

    // Error responses and panics release the key: the retry runs again.
    let key = new_key();
    let failing = server.url("/flaky?status=500");
    post(&client, &failing, Some(&key))
        .await
        .assert_executed(StatusCode::INTERNAL_SERVER_ERROR);
    post(&client, &failing, Some(&key))
        .await
        .assert_executed(StatusCode::INTERNAL_SERVER_ERROR);
    let key = new_key();
    let panicking = server.url("/flaky?panic=1");
    post(&client, &panicking, Some(&key))
        .await
        .assert_executed(StatusCode::INTERNAL_SERVER_ERROR);
    post(&client, &panicking, Some(&key))
        .await
        .assert_executed(StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(count(&client, &server, "flaky").await, 4);
    assert_eq!(count(&client, &server, "orders").await, 2);
    // The two completed orders live in the cluster; released keys left nothing.
    assert_eq!(records_in_cluster(&prefix), 2);
}

#[actix_rt::test]
async fn on_redis_cluster_two_servers_with_replicated_writes_run_a_handler_once() {
    let seeds = RedisCluster::shared().urls_env();
    let prefix = unique_prefix("e2e-cluster-two");
    let env = [
        ("REDIS_CLUSTER_URLS", seeds.as_str()),
        ("IDEMPOTENCY_PREFIX", &prefix),
        ("IDEMPOTENCY_REPLICAS", "1"),
    ];
    let servers = [ReferenceServer::start(&env), ReferenceServer::start(&env)];
    let client = client();
    let order = json!({ "item": "shelf", "qty": 1 });
    let urls = servers
        .each_ref()
        .map(|server| server.url("/orders?delay_ms=300"));
    // Five keys, ten duplicates each, alternating between the servers, all at once.
    let keys: Vec<String> = (0..5).map(|_| new_key()).collect();
    let replies = join_all(
        keys.iter()
            .cycle()
            .take(50)
            .enumerate()
            .map(|(i, key)| post_json(&client, &urls[i % 2], Some(key), &order)),
    )
    .await;
    // Strict replicated writes refuse a lock the replica did not acknowledge in time: a 503
    // where nothing ran (allowed on a loaded machine; such a key runs on its retry below).
    assert!(
        replies.iter().all(|reply| matches!(
            reply.status,
            StatusCode::CREATED | StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE
        )),
        "{replies:?}"
    );
    let created = replies
        .iter()
        .filter(|reply| reply.status == StatusCode::CREATED)
        .count() as u64;
    let ran =
        count(&client, &servers[0], "orders").await + count(&client, &servers[1], "orders").await;
    assert_eq!(
        ran, created,
        "every run answered 201, none ran for a 409 or 503"
    );
    for key in &keys {
        // A commit the replica did not acknowledge in time is retried in the background
        // while the key stays locked (409): wait for it, bounded.
        let mut first = post_json(&client, &urls[0], Some(key), &order).await;
        for _ in 0..100 {
            if first.status != StatusCode::CONFLICT {
                break;
            }
            actix_rt::time::sleep(std::time::Duration::from_millis(100)).await;
            first = post_json(&client, &urls[0], Some(key), &order).await;
        }
        assert!(
            first.is_replay() || first.status == StatusCode::CREATED,
            "{first:?}"
        );
        post_json(&client, &urls[1], Some(key), &order)
            .await
            .assert_replay_of(&first);
    }
    let ran =
        count(&client, &servers[0], "orders").await + count(&client, &servers[1], "orders").await;
    assert_eq!(ran, 5, "each key ran once across both servers");
    assert_eq!(records_in_cluster(&prefix), 5);
}

#[test]
fn redis_url_and_redis_cluster_urls_together_are_refused() {
    let (code, stderr) = exit_of(&[
        ("REDIS_URL", "redis://127.0.0.1:6379"),
        ("REDIS_CLUSTER_URLS", "redis://127.0.0.1:7000"),
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("REDIS_CLUSTER_URLS"), "{stderr}");
}
