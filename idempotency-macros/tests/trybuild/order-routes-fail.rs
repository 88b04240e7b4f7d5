use actix_web::{App, HttpResponse, routes};
use idempotency_actix::{Idempotency, idempotent};

#[routes]
#[idempotent]
#[post("/profile")]
#[put("/profile")]
async fn profile() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new().wrap(Idempotency::memory()).service(profile);
}
