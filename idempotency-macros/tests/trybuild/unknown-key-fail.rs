use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(tll = "24h")]
#[post("/orders")]
async fn misspelled() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(required, statuses = "2xx")]
#[post("/payments")]
async fn unsupported() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(misspelled)
        .service(unsupported);
}
