//! [`FloodServer`]: an in-process server for tests that push more keys than a store holds
//! while some requests stay in flight.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::{App, HttpResponse, web};
use idempotency_actix::{Idempotency, IdempotencyPolicy, RedisStore};

use crate::{Gate, PrivateRedis, Reply, RunCounter};

/// A server under one `Idempotency` (protecting `POST`) with three routes:
///
/// * `POST /orders`: 201 with a `Location` and a JSON body padded to `body_bytes`;
/// * `POST /slow`: counts its run, waits at [`gate`](Self::gate) (or until
///   [`release_slow_run`](Self::release_slow_run) lets its run through), then answers 201;
/// * `POST /fail`: counts its run and answers 500, which is not stored: its key is given
///   back (the Redis store's `release` function, on every server).
pub struct FloodServer {
    server: actix_test::TestServer,
    /// Runs of `/orders`.
    pub runs: RunCounter,
    /// Runs of `/slow`.
    pub slow_runs: RunCounter,
    /// Runs of `/fail`.
    pub failed_runs: RunCounter,
    /// Where `/slow` handlers wait.
    pub gate: Gate,
    /// The runs of `/slow` let through one by one, by their number (1 for the first).
    released: SlowReleases,
}

#[derive(Clone, Default)]
struct SlowReleases(Arc<Mutex<HashSet<usize>>>);

impl SlowReleases {
    fn contains(&self, run: usize) -> bool {
        self.0.lock().is_ok_and(|runs| runs.contains(&run))
    }
}

#[derive(Clone)]
struct SlowRuns(RunCounter);

#[derive(Clone)]
struct FailedRuns(RunCounter);

#[derive(Clone, Copy)]
struct BodyBytes(usize);

async fn create(runs: web::Data<RunCounter>, body_bytes: web::Data<BodyBytes>) -> HttpResponse {
    let seq = runs.record();
    let padding = "x".repeat(body_bytes.0);
    HttpResponse::Created()
        .insert_header(("location", format!("/orders/{seq}")))
        .json(serde_json::json!({ "seq": seq, "padding": padding }))
}

async fn slow_create(
    runs: web::Data<SlowRuns>,
    gate: web::Data<Gate>,
    released: web::Data<SlowReleases>,
) -> HttpResponse {
    let seq = runs.0.record();
    // 30 s at most, as at the gate, so a failing test never leaves a handler hanging.
    for _ in 0..3_000 {
        if gate.is_open() || released.contains(seq) {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    HttpResponse::Created().json(serde_json::json!({ "slow": seq }))
}

async fn fail(runs: web::Data<FailedRuns>) -> HttpResponse {
    let seq = runs.0.record();
    HttpResponse::InternalServerError().json(serde_json::json!({ "failed": seq }))
}

impl FloodServer {
    /// Starts one; `idempotency` makes each worker's middleware, `body_bytes` pads the
    /// bodies of `/orders`.
    pub fn start(
        idempotency: impl Fn() -> Idempotency + Clone + Send + 'static,
        body_bytes: usize,
    ) -> Self {
        let (runs, slow_runs, failed_runs, gate, released) = (
            RunCounter::default(),
            RunCounter::default(),
            RunCounter::default(),
            Gate::default(),
            SlowReleases::default(),
        );
        let server = {
            let (runs, slow_runs, failed_runs, gate, released) = (
                runs.clone(),
                slow_runs.clone(),
                failed_runs.clone(),
                gate.clone(),
                released.clone(),
            );
            actix_test::start(move || {
                App::new()
                    .app_data(web::Data::new(runs.clone()))
                    .app_data(web::Data::new(SlowRuns(slow_runs.clone())))
                    .app_data(web::Data::new(FailedRuns(failed_runs.clone())))
                    .app_data(web::Data::new(gate.clone()))
                    .app_data(web::Data::new(released.clone()))
                    .app_data(web::Data::new(BodyBytes(body_bytes)))
                    .wrap(idempotency().protect_methods([Method::POST]))
                    .route("/orders", web::post().to(create))
                    .route("/slow", web::post().to(slow_create))
                    .route("/fail", web::post().to(fail))
            })
        };
        Self {
            server,
            runs,
            slow_runs,
            failed_runs,
            gate,
            released,
        }
    }

    /// A server on `redis` (1 s leases) whose `/slow` request with key `evicted` is
    /// running when every key of `redis` is deleted, its in-flight record included (as Redis
    /// eviction under `allkeys-lru` would lose it); the handle answers once that run is
    /// released.
    ///
    /// # Panics
    ///
    /// When the server or Redis fails.
    pub async fn with_a_slow_run_losing_its_record(
        redis: &PrivateRedis,
    ) -> (Self, actix_rt::task::JoinHandle<Reply>) {
        let pool = RedisStore::pool(&redis.url()).expect("a pool for the private Redis");
        let server = Self::start(
            move || {
                Idempotency::redis(pool.clone())
                    .policy(IdempotencyPolicy::default().lease(Duration::from_secs(1)))
            },
            64,
        );
        let Ok(first) = server.start_slow("evicted").await else {
            panic!("the slow run of `evicted` was refused");
        };
        let _: () = redis::cmd("FLUSHALL")
            .query_async(&mut redis.connection().await)
            .await
            .expect("FLUSHALL on the private Redis");
        (server, first)
    }

    /// Lets the `/slow` handler of one run answer (`1` for the first run), while the others
    /// keep waiting at the gate.
    pub fn release_slow_run(&self, run: usize) {
        if let Ok(mut runs) = self.released.0.lock() {
            runs.insert(run);
        }
    }

    /// Posts `{}` to `path` with `key`.
    ///
    /// # Panics
    ///
    /// When the request fails or takes more than 60 s.
    pub async fn post(&self, path: &str, key: &str) -> Reply {
        let response = self
            .server
            .request(Method::POST, self.server.url(path))
            .insert_header(("idempotency-key", key))
            .timeout(Duration::from_secs(60))
            .send_body("{}")
            .await
            .unwrap_or_else(|error| panic!("POST {path} with {key}: {error}"));
        Reply::read(response)
            .await
            .unwrap_or_else(|error| panic!("POST {path} with {key}: {error}"))
    }

    /// Sends `count` new keys (`{name}-0`, `{name}-1`, …) to `/orders`, one after another;
    /// each must get 201 from a new run, and every 50th key the key sent 3 keys earlier is
    /// retried and must be replayed without a run. `after_each` runs after every key.
    ///
    /// # Panics
    ///
    /// When an answer is not what the contract promises, with that answer.
    pub async fn flood(&self, name: &str, count: usize, after_each: impl FnMut()) {
        self.flood_paced(name, count, None, after_each).await;
    }

    /// [`flood`](Self::flood) at no more than `keys_per_second` new keys a second, on a
    /// schedule kept from the first key (a slow answer does not slow the keys after it).
    ///
    /// # Panics
    ///
    /// As `flood`.
    pub async fn flood_at_most(&self, name: &str, count: usize, keys_per_second: u32) {
        self.flood_paced(name, count, Some(keys_per_second), || {})
            .await;
    }

    async fn flood_paced(
        &self,
        name: &str,
        count: usize,
        keys_per_second: Option<u32>,
        mut after_each: impl FnMut(),
    ) {
        let start = actix_rt::time::Instant::now();
        for i in 0..count {
            if let Some(rate) = keys_per_second {
                let sent = u32::try_from(i).unwrap_or(u32::MAX);
                actix_rt::time::sleep_until(start + Duration::from_secs(1) * sent / rate).await;
            }
            let runs_before = self.runs.get();
            let reply = self.post("/orders", &format!("{name}-{i}")).await;
            assert_eq!(reply.status, StatusCode::CREATED, "new key {i}: {reply:?}");
            assert!(!reply.is_replay());
            assert_eq!(self.runs.get(), runs_before + 1);
            if i % 50 == 49 {
                let recent = format!("{name}-{}", i - 3);
                let replay = self.post("/orders", &recent).await;
                assert!(replay.is_replay(), "{recent} is replayed: {replay:?}");
                assert_eq!(self.runs.get(), runs_before + 1, "{recent} ran again");
            }
            after_each();
        }
    }

    /// Sends a `/slow` request with `key` and waits until its handler runs (`Ok`: the
    /// request, answered once the gate opens) or until it is answered without running
    /// (`Err`: the refusal).
    ///
    /// # Panics
    ///
    /// When neither happens within 10 s.
    pub async fn start_slow(&self, key: &str) -> Result<actix_rt::task::JoinHandle<Reply>, Reply> {
        let runs_before = self.slow_runs.get();
        let request = self
            .server
            .request(Method::POST, self.server.url("/slow"))
            .insert_header(("idempotency-key", key))
            .timeout(Duration::from_secs(60));
        let key_name = key.to_owned();
        let reply = actix_rt::spawn(async move {
            let response = request
                .send_body("{}")
                .await
                .unwrap_or_else(|error| panic!("POST /slow with {key_name}: {error}"));
            Reply::read(response)
                .await
                .unwrap_or_else(|error| panic!("POST /slow with {key_name}: {error}"))
        });
        for _ in 0..1_000 {
            if self.slow_runs.get() > runs_before {
                return Ok(reply);
            }
            if reply.is_finished() {
                return Err(reply
                    .await
                    .unwrap_or_else(|error| panic!("POST /slow with {key}: {error}")));
            }
            actix_rt::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the /slow request with {key} neither ran nor was answered in 10 s");
    }
}
