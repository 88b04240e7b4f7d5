//! The reference app's handlers and [`Counters`], registered with `#[idempotent]` when the
//! middleware is on and by hand, unprotected, when it is off. Each tagged handler carries
//! its OpenAPI description (`#[utoipa::path]`), and the bodies are typed, so the spec served
//! at `GET /openapi.json` describes what the handlers really take and answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::http::header::{LOCATION, SET_COOKIE};
use actix_web::{HttpResponse, web};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

/// The largest body `POST /large?bytes=N` answers (64 MiB); larger asks get 400.
pub const MAX_LARGE_BYTES: usize = 64 * 1024 * 1024;

/// The longest sleep `POST /orders?delay_ms=N` takes (60 s); longer asks get 400.
pub const MAX_DELAY_MS: u64 = 60_000;

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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NewOrder {
    /// What is ordered.
    pub item: String,
    /// How many.
    pub qty: i64,
}

/// The answer of `POST /orders` (fields in the order they are sent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Order {
    /// A fresh v4 UUID.
    #[schema(format = "uuid")]
    pub id: String,
    /// What was ordered.
    pub item: String,
    /// How many.
    pub qty: i64,
    /// How many times the handler ran, this run included.
    pub seq: u64,
}

/// The answer of `POST /payments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Payment {
    /// A fresh v4 UUID.
    #[schema(format = "uuid")]
    pub payment_id: String,
    /// How many times the handler ran, this run included.
    pub seq: u64,
}

/// The answer of `POST /flaky`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FlakyAnswer {
    /// How many times the handler ran, this run included.
    pub seq: u64,
    /// The status asked for, which is the response's status.
    pub status: u16,
}

/// The answer of `PUT /profile` and `POST /untagged`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Seq {
    /// How many times the handler ran, this run included.
    pub seq: u64,
}

/// The query of `POST /orders`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct OrderQuery {
    /// Sleep this many milliseconds in the handler (at most 60 000).
    #[param(minimum = 0, maximum = 60_000)]
    delay_ms: Option<u64>,
}

/// The query of `POST /flaky`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct FlakyQuery {
    /// The status to answer (default 200). The server answers any of 100 to 999; the spec
    /// documents 200 to 599, the final statuses an HTTP client expects.
    #[param(minimum = 200, maximum = 599)]
    status: Option<u16>,
    /// `1`: the handler panics (a 500 problem under the middleware).
    #[param(minimum = 0, maximum = 1)]
    panic: Option<u8>,
}

/// The query of `POST /large`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(super) struct LargeQuery {
    /// How many bytes to answer (at most 64 MiB; default 0).
    #[param(minimum = 0, maximum = 67_108_864)]
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
        .service(tagged::stats)
        .service(super::metrics::scrape)
        .service(super::openapi::serve);
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
        .route("/stats", web::get().to(handlers::stats))
        .service(super::metrics::scrape)
        .service(super::openapi::serve);
}

/// The routes as a user of the crate writes them: each tagged handler calls the plain one,
/// which the unprotected app registers by hand (a route carrying `#[idempotent]` needs the
/// `Idempotency` middleware above it).
pub(super) mod tagged {
    use actix_web::{HttpResponse, get, post, put, web};
    use idempotency_actix::idempotent;

    use super::{
        Counters, FlakyAnswer, FlakyQuery, LargeQuery, NewOrder, Order, OrderQuery, Payment, Seq,
        Stats, handlers,
    };

    /// Creates an order.
    #[idempotent]
    #[utoipa::path(
        post,
        path = "/orders",
        tag = "reference",
        params(OrderQuery),
        request_body = NewOrder,
        responses(
            (status = 201, description = "The order was created.", body = Order, headers(
                ("Location" = String, description = "`/orders/<id>`"),
                ("Set-Cookie" = String, description = "`session=new; Path=/` (never replayed)"),
            )),
            (status = 400, description = "The body is not an order, or `delay_ms` is out of range.", body = String, content_type = "text/plain"),
            (status = 413, description = "A body over Actix's JSON limit (2 MiB) without a key; with a key, over the middleware's limit (1 MiB), a problem.", body = String, content_type = "text/plain"),
        ),
    )]
    #[post("/orders")]
    pub(crate) async fn create_order(
        counters: web::Data<Counters>,
        query: web::Query<OrderQuery>,
        order: web::Json<NewOrder>,
    ) -> HttpResponse {
        handlers::create_order(counters, query, order).await
    }

    /// Takes a payment; a key is required.
    #[idempotent(ttl = "2s", required)]
    #[utoipa::path(
        post,
        path = "/payments",
        tag = "reference",
        request_body(content = serde_json::Value, description = "Any JSON document."),
        responses(
            (status = 200, description = "The payment was taken.", body = Payment),
            (status = 400, description = "The body is not JSON.", body = String, content_type = "text/plain"),
        ),
    )]
    #[post("/payments")]
    pub(crate) async fn create_payment(
        counters: web::Data<Counters>,
        payment: web::Json<serde_json::Value>,
    ) -> HttpResponse {
        handlers::create_payment(counters, payment).await
    }

    /// Answers the status asked for, or panics.
    #[idempotent]
    #[utoipa::path(
        post,
        path = "/flaky",
        tag = "reference",
        params(FlakyQuery),
        // Any status can be asked for, so the statuses the middleware answers itself carry
        // this route's body too.
        responses(
            (status = 200, description = "The status asked for (200 by default).", body = FlakyAnswer),
            (status = 400, description = "The status asked for, or `status` out of range.", content(
                (FlakyAnswer = "application/json"), (String = "text/plain"))),
            (status = 409, description = "The status asked for.", body = FlakyAnswer),
            (status = 413, description = "The status asked for.", body = FlakyAnswer),
            (status = 422, description = "The status asked for.", body = FlakyAnswer),
            (status = 500, description = "The status asked for, or (`panic=1`) a 500 problem.", body = FlakyAnswer),
            (status = 503, description = "The status asked for.", body = FlakyAnswer),
            (status = "default", description = "The status asked for (200 to 599).", body = FlakyAnswer),
        ),
    )]
    #[post("/flaky")]
    pub(crate) async fn flaky(
        counters: web::Data<Counters>,
        query: web::Query<FlakyQuery>,
    ) -> HttpResponse {
        handlers::flaky(counters, query).await
    }

    /// Updates the profile (any body).
    #[idempotent]
    #[utoipa::path(
        put,
        path = "/profile",
        tag = "reference",
        responses((status = 200, description = "Updated.", body = Seq)),
    )]
    #[put("/profile")]
    pub(crate) async fn update_profile(counters: web::Data<Counters>) -> HttpResponse {
        handlers::update_profile(counters).await
    }

    /// Answers `bytes` bytes, `a` to `z` repeated.
    #[idempotent]
    #[utoipa::path(
        post,
        path = "/large",
        tag = "reference",
        params(LargeQuery),
        responses(
            (status = 200, description = "`bytes` bytes, `a` to `z` repeated.", body = Vec<u8>, content_type = "application/octet-stream"),
            (status = 400, description = "`bytes` is over 64 MiB.", body = String, content_type = "text/plain"),
        ),
    )]
    #[post("/large")]
    pub(crate) async fn large(
        counters: web::Data<Counters>,
        query: web::Query<LargeQuery>,
    ) -> HttpResponse {
        handlers::large(counters, query).await
    }

    /// Counts a run; protected only when `IDEMPOTENCY_METHODS` names `POST`.
    #[utoipa::path(
        post,
        path = "/untagged",
        tag = "reference",
        responses((status = 200, description = "Counted.", body = Seq)),
    )]
    #[post("/untagged")]
    pub(crate) async fn untagged(counters: web::Data<Counters>) -> HttpResponse {
        handlers::untagged(counters).await
    }

    /// How many times each handler ran.
    #[utoipa::path(
        get,
        path = "/stats",
        tag = "reference",
        responses((status = 200, description = "The counters.", body = Stats)),
    )]
    #[get("/stats")]
    pub(crate) async fn stats(counters: web::Data<Counters>) -> HttpResponse {
        handlers::stats(counters).await
    }
}

/// The handlers themselves, free of any idempotency concern.
mod handlers {
    use super::super::plain_text;
    use super::*;

    pub(super) async fn create_order(
        counters: web::Data<Counters>,
        query: web::Query<OrderQuery>,
        order: web::Json<NewOrder>,
    ) -> HttpResponse {
        let delay = query.delay_ms.unwrap_or(0);
        if delay > MAX_DELAY_MS {
            return plain_text(
                StatusCode::BAD_REQUEST,
                format!("delay_ms must be at most {MAX_DELAY_MS}"),
            );
        }
        let seq = count(&counters.orders);
        if delay > 0 {
            actix_web::rt::time::sleep(Duration::from_millis(delay)).await;
        }
        let id = uuid::Uuid::new_v4().to_string();
        let NewOrder { item, qty } = order.into_inner();
        HttpResponse::Created()
            .insert_header((LOCATION, format!("/orders/{id}")))
            .insert_header((SET_COOKIE, "session=new; Path=/"))
            .json(Order { id, item, qty, seq })
    }

    pub(super) async fn create_payment(
        counters: web::Data<Counters>,
        _payment: web::Json<serde_json::Value>,
    ) -> HttpResponse {
        let seq = count(&counters.payments);
        let payment_id = uuid::Uuid::new_v4().to_string();
        HttpResponse::Ok().json(Payment { payment_id, seq })
    }

    pub(super) async fn flaky(
        counters: web::Data<Counters>,
        query: web::Query<FlakyQuery>,
    ) -> HttpResponse {
        let Ok(status) = StatusCode::from_u16(query.status.unwrap_or(200)) else {
            return plain_text(
                StatusCode::BAD_REQUEST,
                "status must be an HTTP status, 100 to 999",
            );
        };
        let seq = count(&counters.flaky);
        if query.panic == Some(1) {
            panic!("POST /flaky?panic=1: the handler panics on request");
        }
        HttpResponse::build(status).json(FlakyAnswer {
            seq,
            status: status.as_u16(),
        })
    }

    pub(super) async fn update_profile(counters: web::Data<Counters>) -> HttpResponse {
        let seq = count(&counters.profile);
        HttpResponse::Ok().json(Seq { seq })
    }

    /// `bytes` bytes: byte `i` is `b'a' + i % 26`, so a client can check every one.
    pub(super) async fn large(
        counters: web::Data<Counters>,
        query: web::Query<LargeQuery>,
    ) -> HttpResponse {
        let bytes = query.bytes.unwrap_or(0);
        if bytes > MAX_LARGE_BYTES {
            return plain_text(
                StatusCode::BAD_REQUEST,
                format!("bytes must be at most {MAX_LARGE_BYTES}"),
            );
        }
        count(&counters.large);
        let body: Vec<u8> = (b'a'..=b'z').cycle().take(bytes).collect();
        HttpResponse::Ok()
            .content_type("application/octet-stream")
            .body(body)
    }

    pub(super) async fn untagged(counters: web::Data<Counters>) -> HttpResponse {
        let seq = count(&counters.untagged);
        HttpResponse::Ok().json(Seq { seq })
    }

    pub(super) async fn stats(counters: web::Data<Counters>) -> HttpResponse {
        HttpResponse::Ok().json(counters.snapshot())
    }
}
