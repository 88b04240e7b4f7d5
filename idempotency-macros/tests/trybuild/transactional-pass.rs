use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, IdempotentTransaction, PostgresStore, idempotent};

#[idempotent(transactional, ttl = "1h")]
#[post("/ledger")]
async fn book(transaction: IdempotentTransaction) -> HttpResponse {
    drop(transaction);
    HttpResponse::Created().finish()
}

fn main() {
    let _ = |store: PostgresStore| App::new().wrap(Idempotency::postgres(store)).service(book);
}
