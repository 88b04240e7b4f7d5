use actix_web::{App, HttpResponse, post, web};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent(ttl = "1h")]
#[post("/orders")]
async fn create_order() -> HttpResponse {
    HttpResponse::Created().finish()
}

// Actix's `#[scope]` prefixes the paths of the route attributes in the module.
#[actix_web::scope("/v2")]
mod v2 {
    use super::*;

    #[idempotent(required)]
    #[post("/orders")]
    pub async fn create_order() -> HttpResponse {
        HttpResponse::Created().finish()
    }
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(web::scope("/api").service(create_order))
        .service(v2::create_order);
    // The App-level layer may also sit on the scope.
    let _app = App::new().service(
        web::scope("/api")
            .wrap(Idempotency::memory())
            .service(create_order),
    );
}
