//! A bounded soak (about 20 s): mixed traffic with many duplicate keys while Redis is
//! stalled and its connections are killed, against a private `redis-server`.
//!
//! Checks: no key ran its handler twice, every answer is 201, 409 or 503 (some 201), no
//! request hung (each client gives up after 10 s, which fails the test), and no record stayed
//! in flight after the run. Its figures, throughput and worst latency among them, are
//! printed, not asserted (`cargo test --test soak -- --nocapture`).

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix_web::{App, HttpRequest, HttpResponse, web};
use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, RedisStore};
use idempotency_actix_tests::{PrivateRedis, keys_under, unique_prefix};

const RUN_FOR: Duration = Duration::from_secs(20);
const CLIENTS: usize = 12;
/// Each second brings this many fresh keys, so new keys keep meeting the faults.
const KEYS_PER_SECOND: u64 = 100;
const STORE_TIMEOUT: Duration = Duration::from_millis(300);
const LEASE: Duration = Duration::from_secs(2);
const MAX_HANDLER_TIME: Duration = Duration::from_millis(40);
const FAULT_EVERY: Duration = Duration::from_millis(1500);

/// Handler runs per idempotency key.
type RunsPerKey = Arc<Mutex<HashMap<String, u32>>>;

async fn charge(runs: web::Data<RunsPerKey>, req: HttpRequest) -> HttpResponse {
    let key = req
        .headers()
        .get("idempotency-key")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let delay = key.bytes().map(u64::from).sum::<u64>() % MAX_HANDLER_TIME.as_millis() as u64;
    *runs.lock().unwrap().entry(key).or_default() += 1;
    actix_rt::time::sleep(Duration::from_millis(delay)).await;
    HttpResponse::Created().json(serde_json::json!({ "charge": uuid::Uuid::new_v4().to_string() }))
}

/// A small deterministic generator, so every run sends the same traffic.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

#[derive(Default)]
struct Tally {
    requests: u64,
    by_status: HashMap<u16, u64>,
    replays: u64,
    worst: Duration,
}

async fn client_loop(url: String, seed: u64, started: Instant, until: Instant) -> Tally {
    let client = awc::Client::builder()
        .timeout(Duration::from_secs(10))
        .finish();
    let mut random = Lcg(seed);
    let mut tally = Tally::default();
    while Instant::now() < until {
        let second = started.elapsed().as_secs();
        let key = format!("charge-{second}-{}", random.next() % KEYS_PER_SECOND);
        let started = Instant::now();
        let mut response = client
            .post(&url)
            .insert_header(("idempotency-key", key.as_str()))
            .send_body(format!("{{\"key\":\"{key}\"}}"))
            .await
            .unwrap_or_else(|error| panic!("request for {key} failed or hung: {error}"));
        let _ = response.body().await.unwrap();
        let elapsed = started.elapsed();
        tally.requests += 1;
        tally.worst = tally.worst.max(elapsed);
        *tally
            .by_status
            .entry(response.status().as_u16())
            .or_default() += 1;
        if response.headers().contains_key("idempotent-replayed") {
            tally.replays += 1;
        }
    }
    tally
}

async fn inject_faults(redis_url: String, until: Instant) -> Vec<&'static str> {
    let faults: [(&str, &[&str]); 3] = [
        ("CLIENT PAUSE 400", &["CLIENT", "PAUSE", "400", "ALL"]),
        ("DEBUG SLEEP 0.4", &["DEBUG", "SLEEP", "0.4"]),
        (
            "CLIENT KILL TYPE normal",
            &["CLIENT", "KILL", "TYPE", "normal"],
        ),
    ];
    let mut injected = Vec::new();
    let mut next = 0;
    loop {
        actix_rt::time::sleep(FAULT_EVERY).await;
        if Instant::now() + Duration::from_millis(500) > until {
            return injected;
        }
        let (name, command) = faults[next % faults.len()];
        next += 1;
        let client = redis::Client::open(redis_url.as_str()).unwrap();
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();
        let mut cmd = redis::cmd(command[0]);
        for arg in &command[1..] {
            cmd.arg(*arg);
        }
        let injection: redis::RedisResult<redis::Value> = cmd.query_async(&mut connection).await;
        // CLIENT KILL also kills this connection: its reply may never come. Any other fault
        // that Redis refused did not happen, and is not counted as injected.
        assert!(
            name.starts_with("CLIENT KILL") || injection.is_ok(),
            "{name} was not injected: {injection:?}"
        );
        injected.push(name);
    }
}

#[actix_web::test]
async fn soak_with_duplicates_and_redis_faults() {
    let redis = PrivateRedis::start().await;
    let prefix = unique_prefix("soak");
    let runs: RunsPerKey = Arc::default();
    let server = {
        let pool = RedisStore::pool(&redis.url()).unwrap();
        let (prefix, runs) = (prefix.clone(), runs.clone());
        actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(
                    Idempotency::redis(pool.clone())
                        .key_prefix(prefix.clone())
                        .store_timeout(STORE_TIMEOUT)
                        .policy(IdempotencyPolicy::default().lease(LEASE)),
                )
                .service(
                    web::resource("/charges")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(charge)),
                )
        })
    };

    let started = Instant::now();
    let until = started + RUN_FOR;
    let url = server.url("/charges");
    let clients = futures_util::future::join_all(
        (0..CLIENTS).map(|i| client_loop(url.clone(), 17 + i as u64, started, until)),
    );
    let (tallies, faults) =
        futures_util::future::join(clients, inject_faults(redis.url(), until)).await;

    // Background commits finish and abandoned leases expire.
    actix_rt::time::sleep(LEASE + Duration::from_millis(500)).await;

    let mut total = Tally::default();
    for tally in tallies {
        total.requests += tally.requests;
        total.replays += tally.replays;
        total.worst = total.worst.max(tally.worst);
        for (status, count) in tally.by_status {
            *total.by_status.entry(status).or_default() += count;
        }
    }
    let runs: HashMap<String, u32> = runs.lock().unwrap().clone();
    let max_runs = runs.values().copied().max().unwrap_or(0);
    let twice: Vec<_> = runs.iter().filter(|(_, runs)| **runs > 1).collect();

    let mut connection = redis.connection().await;
    let mut in_flight = 0;
    for key in keys_under(&mut connection, &prefix).await {
        // The record's second byte is its state (`i` in flight, `c` completed).
        let state: Vec<u8> = redis::cmd("GETRANGE")
            .arg(&key)
            .arg(1)
            .arg(1)
            .query_async(&mut connection)
            .await
            .unwrap();
        if state == b"i" {
            in_flight += 1;
        }
    }

    eprintln!(
        "soak: {} requests over {:?} by {CLIENTS} clients, {KEYS_PER_SECOND} new keys a second; {} keys executed, \
         {} replays; statuses {:?}; {} faults injected ({:?}); handler runs per key: max {max_runs}; \
         worst latency {:?}; records left in flight: {in_flight}",
        total.requests,
        RUN_FOR,
        runs.len(),
        total.replays,
        total.by_status,
        faults.len(),
        faults,
        total.worst,
    );

    assert!(twice.is_empty(), "keys whose handler ran twice: {twice:?}");
    assert_eq!(max_runs, 1);
    assert!(faults.len() >= 9, "faults injected: {faults:?}");
    for status in total.by_status.keys() {
        assert!(
            [201, 409, 503].contains(status),
            "unexpected status {status}: {:?}",
            total.by_status
        );
    }
    assert!(total.by_status.get(&201).copied().unwrap_or(0) > 0);
    assert_eq!(in_flight, 0, "records left in flight after the run");
}
