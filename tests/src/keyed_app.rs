//! [`KeyedApp`]: a test server whose protected `POST /orders` counts its runs per
//! idempotency key, for the tests that move slots or kill nodes under traffic and must
//! show that no key ran twice and no record was lost.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{App, HttpRequest, HttpResponse, web};
use idempotency_actix::{Idempotency, IdempotentRoute};

use crate::Reply;

/// How many times the handler ran for each key; clones share the counts (two app
/// instances can share one to show that a key ran once across both).
#[derive(Debug, Clone, Default)]
pub struct RunsByKey(Arc<Mutex<HashMap<String, usize>>>);

impl RunsByKey {
    fn record(&self, key: &str) {
        *self.lock().entry(key.to_owned()).or_default() += 1;
    }

    /// How many times the handler ran for `key`.
    pub fn of(&self, key: &str) -> usize {
        self.lock().get(key).copied().unwrap_or(0)
    }

    /// The keys whose handler ran more than once, with their counts.
    pub fn ran_twice(&self) -> Vec<(String, usize)> {
        self.lock()
            .iter()
            .filter(|(_, runs)| **runs > 1)
            .map(|(key, runs)| (key.clone(), *runs))
            .collect()
    }

    /// How many runs in all.
    pub fn total(&self) -> usize {
        self.lock().values().sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// An app with one protected route, `POST /orders`: counts the run under the request's
/// `Idempotency-Key`, then answers 201 with a body unique to the run.
pub struct KeyedApp {
    server: actix_test::TestServer,
}

/// What creating one key took: the 201 (or replay) that answered it, and the refusals on
/// the way.
#[derive(Debug)]
pub struct Created {
    /// The answer with status 201 (first run or replay).
    pub reply: Reply,
    /// 503 answers before it.
    pub unavailable: usize,
    /// 409 answers before it.
    pub conflicts: usize,
}

impl KeyedApp {
    /// Starts the app with `idempotency` (called once per worker) and `runs`.
    pub fn start(
        idempotency: impl Fn() -> Idempotency + Clone + Send + 'static,
        runs: RunsByKey,
    ) -> Self {
        let server = actix_test::start(move || {
            App::new()
                .app_data(web::Data::new(runs.clone()))
                .wrap(idempotency())
                .service(
                    web::resource("/orders")
                        .wrap(IdempotentRoute::new())
                        .route(web::post().to(create)),
                )
        });
        Self { server }
    }

    /// Sends `POST /orders` with `key`; `None` when no answer came (a connection error or
    /// the client's timeout).
    pub async fn post(&self, key: &str) -> Option<Reply> {
        let sent = self
            .server
            .post("/orders")
            .timeout(Duration::from_secs(10))
            .insert_header(("idempotency-key", key))
            .send_body(format!(r#"{{"key":"{key}"}}"#))
            .await
            .ok()?;
        Reply::read(sent).await.ok()
    }

    /// Posts `key` until it gets a 201 (a first run or a replay), pausing 50 ms after a
    /// 503, a 409 or no answer, at most `attempts` times; `None` if it never got one.
    ///
    /// # Panics
    ///
    /// On any other status: the contract allows none here.
    pub async fn create(&self, key: &str, attempts: usize) -> Option<Created> {
        let (mut unavailable, mut conflicts) = (0, 0);
        for _ in 0..attempts {
            match self.post(key).await {
                Some(reply) if reply.status == StatusCode::CREATED => {
                    return Some(Created {
                        reply,
                        unavailable,
                        conflicts,
                    });
                }
                Some(reply) if reply.status == StatusCode::SERVICE_UNAVAILABLE => {
                    unavailable += 1;
                }
                Some(reply) if reply.status == StatusCode::CONFLICT => conflicts += 1,
                Some(reply) => panic!(
                    "key {key}: unexpected {} {:?}",
                    reply.status,
                    String::from_utf8_lossy(&reply.body)
                ),
                None => unavailable += 1,
            }
            actix_rt::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}

async fn create(runs: web::Data<RunsByKey>, request: HttpRequest) -> HttpResponse {
    let key = request
        .headers()
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    runs.record(&key);
    HttpResponse::Created().json(serde_json::json!({
        "key": key,
        "run": uuid::Uuid::new_v4().to_string(),
    }))
}
