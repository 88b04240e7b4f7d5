use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl = "1h", required, ttl = "2h")]
#[post("/orders")]
async fn twice_ttl() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(required, required)]
#[post("/payments")]
async fn twice_required() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(twice_ttl)
        .service(twice_required);
}
