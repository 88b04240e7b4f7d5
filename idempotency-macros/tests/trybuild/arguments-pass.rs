use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(
    ttl = "7d",
    lease = "1m",
    required,
    store_errors,
    max_request_body = 65_536,
    max_stored_body = 1048576usize,
    wait_for_completion = "5s",
)]
#[post("/everything")]
async fn everything() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "30s", lease = "500ms")]
#[post("/seconds")]
async fn seconds() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "1h 30m", lease = "15m")]
#[post("/groups")]
async fn groups() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "365d", max_stored_body = 0)]
#[post("/limits")]
async fn limits() -> HttpResponse {
    HttpResponse::Ok().finish()
}

/// Arguments that arrive through a declarative macro.
macro_rules! tagged {
    ($name:ident, $path:literal, $ttl:literal) => {
        #[idempotent(ttl = $ttl, required)]
        #[post($path)]
        async fn $name() -> HttpResponse {
            HttpResponse::Ok().finish()
        }
    };
}

tagged!(from_macro, "/from-macro", "24h");

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(everything)
        .service(seconds)
        .service(groups)
        .service(limits)
        .service(from_macro);
}
