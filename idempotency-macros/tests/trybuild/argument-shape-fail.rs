use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl)]
#[post("/a")]
async fn missing_value() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(lease("30s"))]
#[post("/b")]
async fn call_syntax() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent("24h")]
#[post("/c")]
async fn positional() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "1h" required)]
#[post("/d")]
async fn missing_comma() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(missing_value)
        .service(call_syntax)
        .service(positional)
        .service(missing_comma);
}
