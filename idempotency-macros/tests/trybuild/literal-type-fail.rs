use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl = 5)]
#[post("/a")]
async fn number_ttl() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = 30s)]
#[post("/b")]
async fn unquoted_ttl() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(required = "yes")]
#[post("/c")]
async fn string_flag() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(store_errors = true)]
#[post("/d")]
async fn bool_flag() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(max_stored_body = "1MiB")]
#[post("/e")]
async fn string_bytes() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(max_request_body = -1)]
#[post("/f")]
async fn negative_bytes() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(max_request_body = 1024u16)]
#[post("/g")]
async fn suffixed_bytes() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(number_ttl)
        .service(unquoted_ttl)
        .service(string_flag)
        .service(bool_flag)
        .service(string_bytes)
        .service(negative_bytes)
        .service(suffixed_bytes);
}
