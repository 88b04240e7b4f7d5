use actix_web::{HttpResponse, post};
use idempotency_actix::{IdempotentTransaction, idempotent};

#[idempotent(ttl = "1h")]
#[post("/ledger")]
async fn book(transaction: IdempotentTransaction) -> HttpResponse {
    drop(transaction);
    HttpResponse::Created().finish()
}

fn main() {}
