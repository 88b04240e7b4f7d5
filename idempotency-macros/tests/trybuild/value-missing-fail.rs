use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl = , required)]
#[post("/a")]
async fn value_missing_before_a_comma() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(required, lease =)]
#[post("/b")]
async fn value_missing_at_the_end() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(value_missing_before_a_comma)
        .service(value_missing_at_the_end);
}
