//! The reference app's handlers and [`Counters`], registered with `#[idempotent]` when the
//! middleware is on and by hand, unprotected, when it is off.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::http::header::{LOCATION, SET_COOKIE};
use actix_web::{HttpResponse, web};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The largest body `POST /large?bytes=N` answers (64 MiB); larger asks get 400.
pub const MAX_LARGE_BYTES: usize = 64 * 1024 * 1024;

/// How many times each handler ran; one instance is shared by all workers.
#[derive(Debug, Default)]
pub struct Counters {
    orders: AtomicU64,
    payments: AtomicU64,
    flaky: AtomicU64,
    profile: AtomicU64,
    large: AtomicU64,
    untagged: AtomicU64,
}

/// Counts one run on `counter`; the count after it.
fn count(counter: &AtomicU64) -> u64 {
    counter.fetch_add(1, Ordering::SeqCst) + 1
}

impl Counters {
    /// The counts now: what `GET /stats` answers.
    pub fn snapshot(&self) -> Stats {
        let get = |counter: &AtomicU64| counter.load(Ordering::SeqCst);
        Stats {
            orders: get(&self.orders),
            payments: get(&self.payments),
            flaky: get(&self.flaky),
            profile: get(&self.profile),
            large: get(&self.large),
            untagged: get(&self.untagged),
        }
    }
}

/// The body of `GET /stats`: how many times each handler ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// `POST /orders`.
    pub orders: u64,
    /// `POST /payments`.
    pub payments: u64,
    /// `POST /flaky`.
    pub flaky: u64,
    /// `PUT /profile`.
    pub profile: u64,
    /// `POST /large`.
    pub large: u64,
    /// `POST /untagged`.
    pub untagged: u64,
}

/// The body of `POST /orders`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewOrder {
    /// What is ordered.
    pub item: String,
    /// How many.
    pub qty: i64,
}

#[derive(Debug, Deserialize)]
pub(super) struct OrderQuery {
    delay_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
pub(super) struct FlakyQuery {
    status: Option<u16>,
    panic: Option<u8>,
}

#[derive(Debug, Deserialize)]
pub(super) struct LargeQuery {
    bytes: Option<usize>,
}

/// The routes with `#[idempotent]`, for an app wrapped in `Idempotency`.
pub(super) fn protected(config: &mut web::ServiceConfig) {
    config
        .service(tagged::create_order)
        .service(tagged::create_payment)
        .service(tagged::flaky)
        .service(tagged::update_profile)
        .service(tagged::large)
        .service(tagged::untagged)
        .service(tagged::stats);
}

/// The same routes without any idempotency: the baseline (`IDEMPOTENCY=off`).
pub(super) fn unprotected(config: &mut web::ServiceConfig) {
    config
        .route("/orders", web::post().to(handlers::create_order))
        .route("/payments", web::post().to(handlers::create_payment))
        .route("/flaky", web::post().to(handlers::flaky))
        .route("/profile", web::put().to(handlers::update_profile))
        .route("/large", web::post().to(handlers::large))
        .route("/untagged", web::post().to(handlers::untagged))
        .route("/stats", web::get().to(handlers::stats));
}

/// The routes as a user of the crate writes them: each tagged handler calls the plain one,
/// which the unprotected app registers by hand (a route carrying `#[idempotent]` needs the
/// `Idempotency` middleware above it).
mod tagged {
    use actix_web::{HttpResponse, get, post, put, web};
    use idempotency_actix::idempotent;

    use super::{Counters, FlakyQuery, LargeQuery, NewOrder, OrderQuery, handlers};

    #[idempotent]
    #[post("/orders")]
    pub(super) async fn create_order(
        counters: web::Data<Counters>,
        query: web::Query<OrderQuery>,
        order: web::Json<NewOrder>,
    ) -> HttpResponse {
        handlers::create_order(counters, query, order).await
    }

    #[idempotent(ttl = "2s", required)]
    #[post("/payments")]
    pub(super) async fn create_payment(
        counters: web::Data<Counters>,
        payment: web::Json<serde_json::Value>,
    ) -> HttpResponse {
        handlers::create_payment(counters, payment).await
    }

    #[idempotent]
    #[post("/flaky")]
    pub(super) async fn flaky(
        counters: web::Data<Counters>,
        query: web::Query<FlakyQuery>,
    ) -> HttpResponse {
        handlers::flaky(counters, query).await
    }

    #[idempotent]
    #[put("/profile")]
    pub(super) async fn update_profile(counters: web::Data<Counters>) -> HttpResponse {
        handlers::update_profile(counters).await
    }

    #[idempotent]
    #[post("/large")]
    pub(super) async fn large(
        counters: web::Data<Counters>,
        query: web::Query<LargeQuery>,
    ) -> HttpResponse {
        handlers::large(counters, query).await
    }

    #[post("/untagged")]
    pub(super) async fn untagged(counters: web::Data<Counters>) -> HttpResponse {
        handlers::untagged(counters).await
    }

    #[get("/stats")]
    pub(super) async fn stats(counters: web::Data<Counters>) -> HttpResponse {
        handlers::stats(counters).await
    }
}

/// The handlers themselves, free of any idempotency concern.
mod handlers {
    use super::*;

    pub(super) async fn create_order(
        counters: web::Data<Counters>,
        query: web::Query<OrderQuery>,
        order: web::Json<NewOrder>,
    ) -> HttpResponse {
        let seq = count(&counters.orders);
        if let Some(delay) = query.delay_ms {
            actix_web::rt::time::sleep(Duration::from_millis(delay)).await;
        }
        let id = uuid::Uuid::new_v4();
        let NewOrder { item, qty } = order.into_inner();
        HttpResponse::Created()
            .insert_header((LOCATION, format!("/orders/{id}")))
            .insert_header((SET_COOKIE, "session=new; Path=/"))
            .json(json!({ "id": id.to_string(), "item": item, "qty": qty, "seq": seq }))
    }

    pub(super) async fn create_payment(
        counters: web::Data<Counters>,
        _payment: web::Json<serde_json::Value>,
    ) -> HttpResponse {
        let seq = count(&counters.payments);
        HttpResponse::Ok()
            .json(json!({ "payment_id": uuid::Uuid::new_v4().to_string(), "seq": seq }))
    }

    pub(super) async fn flaky(
        counters: web::Data<Counters>,
        query: web::Query<FlakyQuery>,
    ) -> HttpResponse {
        let Ok(status) = StatusCode::from_u16(query.status.unwrap_or(200)) else {
            return HttpResponse::BadRequest().body("status must be an HTTP status, 100 to 999");
        };
        let seq = count(&counters.flaky);
        if query.panic == Some(1) {
            panic!("POST /flaky?panic=1: the handler panics on request");
        }
        HttpResponse::build(status).json(json!({ "seq": seq, "status": status.as_u16() }))
    }

    pub(super) async fn update_profile(counters: web::Data<Counters>) -> HttpResponse {
        let seq = count(&counters.profile);
        HttpResponse::Ok().json(json!({ "seq": seq }))
    }

    /// `bytes` bytes: byte `i` is `b'a' + i % 26`, so a client can check every one.
    pub(super) async fn large(
        counters: web::Data<Counters>,
        query: web::Query<LargeQuery>,
    ) -> HttpResponse {
        let bytes = query.bytes.unwrap_or(0);
        if bytes > MAX_LARGE_BYTES {
            return HttpResponse::BadRequest()
                .body(format!("bytes must be at most {MAX_LARGE_BYTES}"));
        }
        count(&counters.large);
        let body: Vec<u8> = (b'a'..=b'z').cycle().take(bytes).collect();
        HttpResponse::Ok()
            .content_type("application/octet-stream")
            .body(body)
    }

    pub(super) async fn untagged(counters: web::Data<Counters>) -> HttpResponse {
        let seq = count(&counters.untagged);
        HttpResponse::Ok().json(json!({ "seq": seq }))
    }

    pub(super) async fn stats(counters: web::Data<Counters>) -> HttpResponse {
        HttpResponse::Ok().json(counters.snapshot())
    }
}
