//! The demo: `cargo run --example demo`.
//!
//! Starts the reference app (see `idempotency_actix_examples::reference_app`) in this process
//! on a free loopback port, on the in-memory store (on Redis when `REDIS_URL` is set, its keys
//! under `IDEMPOTENCY_PREFIX`, default `idempotency:`, as the reference server's), sends a
//! scripted sequence of requests and prints what happened:
//!
//! 1. a first request with a key runs the handler;
//! 2. its retry is replayed: same body, `Idempotent-Replayed: true`, handler not run;
//! 3. a duplicate sent while the first is still running gets 409 with `Retry-After`;
//! 4. the same key with another body gets 422;
//! 5. a request without a key on a route that requires one gets 400;
//! 6. the side-effect counters (`GET /stats`) show how often each handler really ran.
//!
//! Exits 0 when every step behaved as expected, 1 otherwise (a `REDIS_URL` that is not a
//! Redis URL included: a failure to start, as for the reference server), and 2 when a
//! variable is invalid (`REDIS_URL` or `IDEMPOTENCY_PREFIX` not in UTF-8), as the
//! reference server's configuration is.

use std::process::ExitCode;
use std::time::Duration;

use actix_web::http::header::HeaderMap;
use actix_web::http::{Method, StatusCode};
use actix_web::web::Bytes;
use idempotency_actix_examples::reference_app::{self, ServerConfig, Stats};
use serde_json::{Value, json};

/// One request and its answer.
struct Exchange {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Exchange {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }
}

/// The response headers worth showing in the transcript.
const SHOWN_HEADERS: [&str; 6] = [
    "content-type",
    "location",
    "set-cookie",
    "retry-after",
    "idempotent-replayed",
    "idempotent-body-omitted",
];

struct Demo {
    client: awc::Client,
    base: String,
    failures: Vec<String>,
}

impl Demo {
    fn heading(&self, title: &str) {
        println!("\n== {title}");
    }

    /// Prints the request, sends it, prints the answer.
    async fn send(
        &mut self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> Option<Exchange> {
        print_request(&method, path, key, body);
        let exchange = self.send_quietly(method, path, key, body).await;
        if let Some(exchange) = &exchange {
            print_response(exchange);
        }
        exchange
    }

    async fn send_quietly(
        &mut self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> Option<Exchange> {
        let result = exchange(&self.client, &self.base, method.clone(), path, key, body).await;
        match result {
            Ok(exchange) => Some(exchange),
            Err(error) => {
                self.check(false, &format!("{method} {path} failed: {error}"));
                None
            }
        }
    }

    /// Records and prints whether an expectation held.
    fn check(&mut self, held: bool, expectation: &str) {
        if held {
            println!("   ok: {expectation}");
        } else {
            println!("   FAILED: {expectation}");
            self.failures.push(expectation.to_owned());
        }
    }
}

/// Sends one request; the client is separate from `Demo` so that concurrent requests can
/// run on their own tasks.
async fn exchange(
    client: &awc::Client,
    base: &str,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> Result<Exchange, String> {
    let mut request = client.request(method, format!("{base}{path}"));
    if let Some(key) = key {
        request = request.insert_header(("Idempotency-Key", key));
    }
    let sent = match body {
        Some(body) => request.send_json(body).await,
        None => request.send().await,
    };
    let mut response = sent.map_err(|error| error.to_string())?;
    let body = response.body().await.map_err(|error| error.to_string())?;
    Ok(Exchange {
        status: response.status(),
        headers: response.headers().clone(),
        body,
    })
}

fn print_request(method: &Method, path: &str, key: Option<&str>, body: Option<&Value>) {
    println!("   > {method} {path}");
    if let Some(key) = key {
        println!("     Idempotency-Key: {key}");
    }
    if let Some(body) = body {
        println!("     {body}");
    }
}

fn print_response(exchange: &Exchange) {
    println!("   < {}", exchange.status);
    for name in SHOWN_HEADERS {
        if let Some(value) = exchange.header(name) {
            println!("     {name}: {value}");
        }
    }
    if !exchange.body.is_empty() {
        println!("     {}", String::from_utf8_lossy(&exchange.body));
    }
}

/// A fresh key in the IETF draft's sf-string form.
fn new_key() -> String {
    format!("\"{}\"", uuid::Uuid::new_v4())
}

async fn script(demo: &mut Demo) {
    let book = json!({ "item": "book", "qty": 1 });
    let first_key = new_key();

    demo.heading("1. A first request with a key runs the handler");
    let first = demo
        .send(Method::POST, "/orders", Some(&first_key), Some(&book))
        .await;
    let first_body = first.as_ref().map(|first| first.body.clone());
    if let Some(first) = &first {
        demo.check(
            first.status == StatusCode::CREATED && !first.replayed(),
            &format!("201, executed (order seq {})", first.json()["seq"]),
        );
    }

    demo.heading("2. A retry with the same key is replayed, not run again");
    if let Some(retry) = demo
        .send(Method::POST, "/orders", Some(&first_key), Some(&book))
        .await
    {
        demo.check(
            retry.status == StatusCode::CREATED
                && retry.replayed()
                && Some(&retry.body) == first_body.as_ref(),
            "201 with the same body, byte for byte, and Idempotent-Replayed: true",
        );
        demo.check(
            retry.header("set-cookie").is_none(),
            "Set-Cookie is not replayed",
        );
    }

    demo.heading("3. A duplicate while the first is still running gets 409");
    let slow_key = new_key();
    let lamp = json!({ "item": "lamp", "qty": 2 });
    let path = "/orders?delay_ms=1000";
    println!("   (the first request's handler takes 1 s)");
    print_request(&Method::POST, path, Some(&slow_key), Some(&lamp));
    let slow = {
        let (client, base) = (demo.client.clone(), demo.base.clone());
        let (key, body) = (slow_key.clone(), lamp.clone());
        actix_web::rt::spawn(async move {
            exchange(&client, &base, Method::POST, path, Some(&key), Some(&body)).await
        })
    };
    actix_web::rt::time::sleep(Duration::from_millis(250)).await;
    println!("   (250 ms later, the same request again)");
    if let Some(duplicate) = demo
        .send(Method::POST, path, Some(&slow_key), Some(&lamp))
        .await
    {
        demo.check(
            duplicate.status == StatusCode::CONFLICT && duplicate.header("retry-after").is_some(),
            "409 with Retry-After: the handler is not run a second time",
        );
    }
    println!("   (the first request finishes)");
    match slow.await {
        Ok(Ok(slow)) => {
            print_response(&slow);
            demo.check(
                slow.status == StatusCode::CREATED && !slow.replayed(),
                "the first request completes with 201",
            );
        }
        Ok(Err(error)) => demo.check(false, &format!("the slow request failed: {error}")),
        Err(error) => demo.check(false, &format!("the slow request's task failed: {error}")),
    }

    demo.heading("4. The same key with another body gets 422");
    let more_books = json!({ "item": "book", "qty": 5 });
    if let Some(reused) = demo
        .send(Method::POST, "/orders", Some(&first_key), Some(&more_books))
        .await
    {
        demo.check(
            reused.status == StatusCode::UNPROCESSABLE_ENTITY,
            "422 problem: a key belongs to one request",
        );
    }

    demo.heading("5. No key on a route that requires one gets 400");
    let payment = json!({ "amount": 1000, "currency": "EUR" });
    if let Some(missing) = demo
        .send(Method::POST, "/payments", None, Some(&payment))
        .await
    {
        demo.check(
            missing.status == StatusCode::BAD_REQUEST,
            "400 problem: POST /payments is #[idempotent(ttl = \"2s\", required)]",
        );
    }
    println!("   (with a key it runs)");
    if let Some(paid) = demo
        .send(Method::POST, "/payments", Some(&new_key()), Some(&payment))
        .await
    {
        demo.check(paid.status == StatusCode::OK, "200, executed");
    }

    demo.heading("6. How often the handlers really ran");
    if let Some(stats) = demo.send(Method::GET, "/stats", None, None).await {
        let stats: Option<Stats> = serde_json::from_slice(&stats.body).ok();
        let expected = Stats {
            orders: 2,
            payments: 1,
            ..Stats::default()
        };
        demo.check(
            stats == Some(expected),
            "5 requests to POST /orders ran its handler twice; 2 to POST /payments ran it once",
        );
    }
}

#[actix_web::main]
async fn main() -> ExitCode {
    // Only REDIS_URL and IDEMPOTENCY_PREFIX are taken from the environment: the demo picks
    // its own port and workers.
    let lookup = |name: &str| {
        ["REDIS_URL", "IDEMPOTENCY_PREFIX"]
            .contains(&name)
            .then(|| std::env::var_os(name))
            .flatten()
    };
    let config = match ServerConfig::from_lookup(lookup) {
        Ok(config) => ServerConfig {
            bind: "127.0.0.1:0".to_owned(),
            workers: std::num::NonZeroUsize::new(2),
            ..config
        },
        Err(error) => {
            eprintln!("demo: {error}");
            return ExitCode::from(2);
        }
    };
    let running = match reference_app::start(&config).await {
        Ok(running) => running,
        Err(error) => {
            eprintln!("demo: {error}");
            return ExitCode::FAILURE;
        }
    };
    let Some(addr) = running.addrs.first().copied() else {
        eprintln!("demo: the server is bound to no address");
        return ExitCode::FAILURE;
    };
    let handle = running.server.handle();
    actix_web::rt::spawn(running.server);

    println!("idempotency-actix demo");
    println!("reference app on http://{addr}: {}", running.summary);
    if config.redis_url.is_none() {
        println!("(set REDIS_URL=redis://127.0.0.1:6379 to run it on Redis)");
    }
    let mut demo = Demo {
        client: awc::Client::builder()
            .timeout(Duration::from_secs(10))
            .finish(),
        base: format!("http://{addr}"),
        failures: Vec::new(),
    };
    script(&mut demo).await;
    handle.stop(true).await;

    if demo.failures.is_empty() {
        println!("\nEvery step behaved as expected.");
        ExitCode::SUCCESS
    } else {
        println!(
            "\n{} step(s) did not behave as expected:",
            demo.failures.len()
        );
        for failure in &demo.failures {
            println!("  - {failure}");
        }
        ExitCode::FAILURE
    }
}
