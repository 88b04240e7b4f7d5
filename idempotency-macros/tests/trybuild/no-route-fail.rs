use actix_web::{App, HttpResponse, web};
use idempotency_actix::{Idempotency, idempotent};

// Registered by hand below: the attribute has no route attribute to attach to.
#[idempotent(required)]
async fn charge() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(web::resource("/charges").route(web::post().to(charge)));
}
