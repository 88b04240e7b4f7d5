//! [`post_twice`]: a keyed `POST /orders` sent twice, over a socket, to an app on an
//! `Idempotency`.

use actix_web::http::{Method, StatusCode};
use actix_web::{App, HttpResponse, web};
use idempotency_actix::{Idempotency, KeyScope};

use crate::{Reply, RunCounter};

/// What a keyed `POST /orders` gets from an app on the `Idempotency` that `idempotency`
/// makes (on the worker's thread: it is not `Send`; one worker, on a loopback port), sent
/// twice with one key: the first status, the retry's, whether the retry was a replay
/// (`Idempotent-Replayed: true`), and how many times the handler ran.
pub async fn post_twice(
    idempotency: impl Fn() -> Idempotency + Clone + Send + 'static,
) -> (StatusCode, StatusCode, bool, usize) {
    let runs = RunCounter::default();
    let counted = runs.clone();
    let server = actix_test::start_with(actix_test::config().workers(1), move || {
        let counted = counted.clone();
        App::new()
            .wrap(
                idempotency()
                    .scope(KeyScope::global())
                    .protect_methods([Method::POST]),
            )
            .route(
                "/orders",
                web::post().to(move || {
                    counted.record();
                    async { HttpResponse::Created().body("made") }
                }),
            )
    });
    let send = || async {
        let response = server
            .post("/orders")
            .insert_header(("Idempotency-Key", "order-1"))
            .send()
            .await
            .expect("an answer");
        Reply::read(response).await.expect("the whole response")
    };
    let first = send().await;
    let retry = send().await;
    (first.status, retry.status, retry.is_replay(), runs.get())
}
