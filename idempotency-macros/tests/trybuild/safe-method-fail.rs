use actix_web::{App, HttpResponse, get, route};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(required)]
#[get("/orders")]
async fn list_orders() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent]
#[route("/orders", method = "HEAD", method = "OPTIONS")]
async fn probe_orders() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(list_orders)
        .service(probe_orders);
}
