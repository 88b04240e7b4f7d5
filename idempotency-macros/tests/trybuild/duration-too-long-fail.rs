use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl = "366d")]
#[post("/orders")]
async fn over_a_year() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(lease = "9000h")]
#[post("/payments")]
async fn long_lease() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(over_a_year)
        .service(long_lease);
}
