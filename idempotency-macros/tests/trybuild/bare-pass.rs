use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent]
#[post("/orders")]
async fn create_order() -> HttpResponse {
    HttpResponse::Created().finish()
}

#[idempotent()]
#[post("/carts")]
async fn create_cart() -> HttpResponse {
    HttpResponse::Created().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(create_order)
        .service(create_cart);
}
