use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl = "0s")]
#[post("/orders")]
async fn zero_ttl() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(lease = "0ms")]
#[post("/payments")]
async fn zero_lease() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(zero_ttl)
        .service(zero_lease);
}
