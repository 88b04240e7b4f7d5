use actix_web::{App, HttpResponse, post};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl = "tomorrow")]
#[post("/words")]
async fn words() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "24")]
#[post("/no-unit")]
async fn no_unit() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(lease = "1.5h")]
#[post("/fraction")]
async fn fraction() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "2w")]
#[post("/weeks")]
async fn weeks() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(words)
        .service(no_unit)
        .service(fraction)
        .service(weeks);
}
