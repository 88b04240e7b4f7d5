use actix_web::{App, HttpResponse, routes};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl = "2h", required)]
#[routes]
#[post("/profile")]
#[put("/profile")]
#[patch("/profile/{id}", wrap = "actix_web::middleware::Logger::default()")]
async fn profile() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent]
#[routes]
#[get("/settings")]
#[post("/settings")]
async fn settings() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(profile)
        .service(settings);
}
