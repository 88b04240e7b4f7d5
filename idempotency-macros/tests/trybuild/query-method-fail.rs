use actix_web::{App, HttpResponse, query, route};
use idempotency_actix::{Idempotency, idempotent};

// `QUERY` is safe (the IETF draft "The HTTP QUERY Method"), like `GET`: never protected.
#[idempotent(required)]
#[query("/orders/search")]
async fn search_orders(filter: String) -> HttpResponse {
    HttpResponse::Ok().body(filter)
}

#[idempotent]
#[route("/orders/export", method = "QUERY", method = "GET")]
async fn export_orders() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(search_orders)
        .service(export_orders);
}
