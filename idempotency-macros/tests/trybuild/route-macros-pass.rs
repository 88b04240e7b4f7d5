use actix_web::middleware::{DefaultHeaders, Logger};
use actix_web::{App, HttpResponse, delete, get, patch, post, put, route};
use idempotency_actix::{Idempotency, idempotent};

#[idempotent]
#[post("/a")]
async fn on_post() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "1h")]
#[put("/a")]
async fn on_put() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "1h")]
#[patch("/a")]
async fn on_patch() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(ttl = "1h")]
#[delete("/a")]
async fn on_delete() -> HttpResponse {
    HttpResponse::Ok().finish()
}

// A safe method next to an unsafe one: the GET passes through the route layer untouched.
#[idempotent]
#[actix_web::routes]
#[get("/both")]
#[post("/both")]
async fn get_and_post() -> HttpResponse {
    HttpResponse::Ok().finish()
}

// A path that reaches the route attribute through `macro_rules!` (an invisible group).
macro_rules! tagged_handler {
    ($name:ident, $path:literal, $other:expr) => {
        #[idempotent(required)]
        #[post($path)]
        async fn $name() -> HttpResponse {
            HttpResponse::Ok().finish()
        }

        #[idempotent]
        #[put($other)]
        async fn with_expr_path() -> HttpResponse {
            HttpResponse::Ok().finish()
        }
    };
}
tagged_handler!(from_a_macro, "/generated", "/generated");

#[idempotent(required)]
#[actix_web::post("/qualified")]
async fn qualified() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[idempotent(required)]
#[route("/many", method = "POST", method = "PATCH", method = "PUT")]
async fn many_methods() -> HttpResponse {
    HttpResponse::Ok().finish()
}

// The route's own options stay, trailing comma included; our layer is added to its `wrap`s.
#[idempotent(ttl = "15m")]
#[post(
    "/options",
    name = "with_options",
    wrap = "Logger::default()",
    wrap = "DefaultHeaders::new().add((\"x-version\", \"1\"))"
)]
async fn with_options() -> HttpResponse {
    HttpResponse::Ok().finish()
}

// Other attributes in between are kept.
#[idempotent]
#[allow(clippy::unused_async)]
#[post("/allowed")]
#[doc = "Documented handler."]
async fn with_other_attributes() -> HttpResponse {
    HttpResponse::Ok().finish()
}

fn main() {
    let _app = App::new()
        .wrap(Idempotency::memory())
        .service(on_post)
        .service(on_put)
        .service(on_patch)
        .service(on_delete)
        .service(get_and_post)
        .service(from_a_macro)
        .service(with_expr_path)
        .service(qualified)
        .service(many_methods)
        .service(with_options)
        .service(with_other_attributes);
}
