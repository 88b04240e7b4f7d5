use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(transactional)]
#[post("/ledger")]
async fn book() -> HttpResponse {
    HttpResponse::Created().finish()
}

fn main() {
    let _app = App::new().wrap(Idempotency::memory()).service(book);
}
