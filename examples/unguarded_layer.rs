//! The load benchmark's comparator (`BENCH_MODES=unguarded`): the design of the simplest
//! idempotency layers, around the reference server's own handlers on the same framework, so
//! that one run shows what this crate's guarantees cost. **Not safe to use**: it is what
//! DESIGN §10 calls the best peer, a layer that neither fingerprints nor locks in flight.
//!
//! On a keyed request it sends `GET <prefix><key>` and replays what it finds (status,
//! headers, body; `Idempotent-Replayed: true`); else it runs the handler, then stores the
//! response with `SET <prefix><key> <response> NX EX 86400` before answering. One redis-rs
//! multiplexed connection per worker, opened on that worker's thread at its first keyed
//! request. What it gives up, each of which this crate keeps: two concurrent requests with
//! one key both run the handler (no lock in flight, no 409); a retry with another body gets
//! the first body's response (no fingerprint, no 422); a response stored late or twice is
//! never fenced; a handler that fails or panics is stored as it answered (or not at all);
//! a store error leaves the request unprotected (no fail-closed 503).
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6379 BIND=127.0.0.1:8081 cargo run --release \
//!     -p idempotency-actix-examples --example unguarded_layer
//! ```
//!
//! Environment, as the reference server's: `BIND` [`127.0.0.1:8080`], `REDIS_URL` [required],
//! `WORKERS` [one per core], `IDEMPOTENCY_PREFIX` [`unguarded:`]. It prints
//! `listening on http://ADDR` once it accepts connections, as the reference server does.

use std::cell::RefCell;

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::{Next, from_fn};
use actix_web::web::{Bytes, BytesMut};
use actix_web::{App, HttpResponse, HttpServer, web};
use idempotency_actix_examples::reference_app::{self, Counters};
use redis::aio::MultiplexedConnection;

/// The same allocator as the reference server's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long a stored response is kept: the crate's default TTL.
const TTL_SECONDS: u64 = 86_400;

/// The server-wide settings each worker's layer reads.
struct Settings {
    client: redis::Client,
    prefix: String,
}

thread_local! {
    /// This worker's connection, opened at its first keyed request.
    static CONNECTION: RefCell<Option<MultiplexedConnection>> = const { RefCell::new(None) };
}

/// This worker's connection, opened on its thread (so that its driver runs there too).
async fn connection(client: &redis::Client) -> redis::RedisResult<MultiplexedConnection> {
    if let Some(connection) = CONNECTION.with_borrow(Clone::clone) {
        return Ok(connection);
    }
    let connection = client.get_multiplexed_async_connection().await?;
    CONNECTION.set(Some(connection.clone()));
    Ok(connection)
}

/// The layer: replay what `GET` finds, else run and `SET … NX EX`.
async fn unguarded(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let Some(key) = req.headers().get("idempotency-key").cloned() else {
        return Ok(next.call(req).await?.map_into_boxed_body());
    };
    let settings = req
        .app_data::<web::Data<Settings>>()
        .cloned()
        .ok_or_else(|| actix_web::error::ErrorInternalServerError("no settings"))?;
    let mut storage_key = settings.prefix.clone().into_bytes();
    storage_key.extend_from_slice(key.as_bytes());
    let unavailable = |error: redis::RedisError| actix_web::error::ErrorServiceUnavailable(error);
    let mut redis = connection(&settings.client).await.map_err(unavailable)?;
    let found: Option<Vec<u8>> = redis::cmd("GET")
        .arg(&storage_key)
        .query_async(&mut redis)
        .await
        .map_err(unavailable)?;
    if let Some(stored) = found {
        let response = decode(&stored)
            .ok_or_else(|| actix_web::error::ErrorInternalServerError("unreadable record"))?;
        return Ok(req.into_response(response));
    }
    let response = next.call(req).await?;
    let (request, response) = response.into_parts();
    let (head, body) = response.into_parts();
    let body = actix_web::body::to_bytes(body)
        .await
        .map_err(|_| actix_web::error::ErrorInternalServerError("unreadable body"))?;
    let stored = encode(&head, &body);
    let _: redis::RedisResult<()> = redis::cmd("SET")
        .arg(&storage_key)
        .arg(stored.as_ref())
        .arg("NX")
        .arg("EX")
        .arg(TTL_SECONDS)
        .query_async(&mut redis)
        .await;
    Ok(ServiceResponse::new(
        request,
        head.set_body(body).map_into_boxed_body(),
    ))
}

/// A response as stored: status, header count, then each header's name and value, each
/// with its length as two bytes, then the body.
fn encode(head: &HttpResponse<()>, body: &Bytes) -> Bytes {
    let mut stored = BytesMut::with_capacity(64 + body.len());
    stored.extend_from_slice(&head.status().as_u16().to_be_bytes());
    let headers = head.headers();
    stored.extend_from_slice(&(headers.len() as u16).to_be_bytes());
    for (name, value) in headers {
        for part in [name.as_str().as_bytes(), value.as_bytes()] {
            stored.extend_from_slice(&(part.len() as u16).to_be_bytes());
            stored.extend_from_slice(part);
        }
    }
    stored.extend_from_slice(body);
    stored.freeze()
}

/// The response `stored` holds, marked as a replay.
fn decode(mut stored: &[u8]) -> Option<HttpResponse> {
    fn take<'a>(stored: &mut &'a [u8], count: usize) -> Option<&'a [u8]> {
        let (taken, rest) = stored.split_at_checked(count)?;
        *stored = rest;
        Some(taken)
    }
    fn length(stored: &mut &[u8]) -> Option<usize> {
        take(stored, 2).map(|bytes| usize::from(u16::from_be_bytes([bytes[0], bytes[1]])))
    }
    let status = StatusCode::from_u16(length(&mut stored)? as u16).ok()?;
    let mut response = HttpResponse::new(status);
    for _ in 0..length(&mut stored)? {
        let name = length(&mut stored)?;
        let name = HeaderName::from_bytes(take(&mut stored, name)?).ok()?;
        let value = length(&mut stored)?;
        let value = HeaderValue::from_bytes(take(&mut stored, value)?).ok()?;
        response.headers_mut().append(name, value);
    }
    response.headers_mut().insert(
        HeaderName::from_static("idempotent-replayed"),
        HeaderValue::from_static("true"),
    );
    Some(response.set_body(BoxBody::new(Bytes::copy_from_slice(stored))))
}

fn main() -> std::io::Result<()> {
    let variable = |name: &str| std::env::var(name).ok().filter(|value| !value.is_empty());
    let bind = variable("BIND").unwrap_or_else(|| "127.0.0.1:8080".to_owned());
    let url = variable("REDIS_URL")
        .ok_or_else(|| std::io::Error::other("unguarded_layer: REDIS_URL is required"))?;
    let client = redis::Client::open(url).map_err(std::io::Error::other)?;
    let prefix = variable("IDEMPOTENCY_PREFIX").unwrap_or_else(|| "unguarded:".to_owned());
    let workers = variable("WORKERS")
        .map(|workers| workers.parse::<usize>().map_err(std::io::Error::other))
        .transpose()?;
    let settings = web::Data::new(Settings { client, prefix });
    let counters = web::Data::new(Counters::default());
    actix_web::rt::System::new().block_on(async move {
        let mut server = HttpServer::new(move || {
            App::new()
                .app_data(settings.clone())
                .app_data(counters.clone())
                .wrap(from_fn(unguarded))
                .configure(reference_app::unprotected_routes)
        });
        if let Some(workers) = workers {
            server = server.workers(workers);
        }
        let server = server.bind(&bind)?;
        for addr in server.addrs() {
            println!("listening on http://{addr}");
        }
        server.run().await
    })
}
