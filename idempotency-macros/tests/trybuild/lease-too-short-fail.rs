use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

// Renewed every third of it, a lease of a few milliseconds lapses before its first renewal.
#[idempotent(lease = "5ms")]
#[post("/payments")]
async fn short_lease() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new().wrap(Idempotency::memory()).service(short_lease);
}
