use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[post("/orders")]
#[idempotent(ttl = "24h")]
async fn create_order() -> HttpResponse {
    HttpResponse::Created().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(create_order);
}
