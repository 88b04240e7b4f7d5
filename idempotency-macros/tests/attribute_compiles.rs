//! What `#[idempotent(...)]` accepts: each module writes the attribute one way, beside the
//! route attributes it works with, and its test builds the app that serves those handlers.
//! A case that stops compiling fails the test build; what the attribute refuses, with its
//! exact errors, is in `trybuild.rs`.
//!
//! Ordinary tests rather than trybuild `pass` cases: a single `pass` case makes trybuild
//! build and link every dependency of its crate (`cargo build`), where `compile_fail` cases
//! alone only check them (`cargo check`). These compile in the workspace's own test build,
//! with the units it builds anyway.

use actix_web::{App, HttpResponse};
use idempotency_actix::{Idempotency, idempotent};

/// The attribute without arguments, and with an empty list.
mod bare {
    use super::*;
    use actix_web::post;

    #[idempotent]
    #[post("/orders")]
    async fn create_order() -> HttpResponse {
        HttpResponse::Created().finish()
    }

    #[idempotent()]
    #[post("/carts")]
    async fn create_cart() -> HttpResponse {
        HttpResponse::Created().finish()
    }

    #[test]
    fn builds_an_app() {
        let _app = App::new()
            .wrap(Idempotency::memory())
            .service(create_order)
            .service(create_cart);
    }
}

/// Every argument, durations in each form, and arguments that arrive through a declarative
/// macro.
mod arguments {
    use super::*;
    use actix_web::post;

    #[rustfmt::skip] // the trailing comma in the arguments is part of the case
    #[idempotent(
        ttl = "7d",
        lease = "1m",
        required,
        store_errors,
        max_request_body = 65_536,
        max_stored_body = 1048576usize,
        wait_for_completion = "5s",
    )]
    #[post("/everything")]
    async fn everything() -> HttpResponse {
        HttpResponse::Ok().finish()
    }

    #[idempotent(ttl = "30s", lease = "500ms")]
    #[post("/seconds")]
    async fn seconds() -> HttpResponse {
        HttpResponse::Ok().finish()
    }

    #[idempotent(ttl = "1h 30m", lease = "15m")]
    #[post("/groups")]
    async fn groups() -> HttpResponse {
        HttpResponse::Ok().finish()
    }

    #[idempotent(ttl = "365d", max_stored_body = 0)]
    #[post("/limits")]
    async fn limits() -> HttpResponse {
        HttpResponse::Ok().finish()
    }

    macro_rules! tagged {
        ($name:ident, $path:literal, $ttl:literal) => {
            #[idempotent(ttl = $ttl, required)]
            #[post($path)]
            async fn $name() -> HttpResponse {
                HttpResponse::Ok().finish()
            }
        };
    }

    tagged!(from_macro, "/from-macro", "24h");

    #[test]
    fn builds_an_app() {
        let _app = App::new()
            .wrap(Idempotency::memory())
            .service(everything)
            .service(seconds)
            .service(groups)
            .service(limits)
            .service(from_macro);
    }
}

/// Each of Actix's route attributes, with their own options and other attributes kept.
mod route_macros {
    use super::*;
    use actix_web::middleware::{DefaultHeaders, Logger};
    use actix_web::{delete, patch, post, put, route};

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

    #[test]
    fn builds_an_app() {
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
}

/// Actix's `#[routes]`: one handler under several route attributes.
mod routes {
    use super::*;
    use actix_web::routes;

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

    #[test]
    fn builds_an_app() {
        let _app = App::new()
            .wrap(Idempotency::memory())
            .service(profile)
            .service(settings);
    }
}

/// Handlers in scopes: `web::scope` around them, and Actix's `#[scope]` module attribute.
mod scopes {
    use super::*;
    use actix_web::{post, web};

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
        pub(super) async fn create_order() -> HttpResponse {
            HttpResponse::Created().finish()
        }
    }

    #[test]
    fn builds_an_app() {
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
}

/// A transactional route, which takes its transaction as an argument.
mod transactional {
    use super::*;
    use actix_web::post;
    use idempotency_actix::{IdempotentTransaction, PostgresStore};

    #[idempotent(transactional, ttl = "1h")]
    #[post("/ledger")]
    async fn book(transaction: IdempotentTransaction) -> HttpResponse {
        drop(transaction);
        HttpResponse::Created().finish()
    }

    #[test]
    fn builds_an_app() {
        let _ = |store: PostgresStore| App::new().wrap(Idempotency::postgres(store)).service(book);
    }
}
