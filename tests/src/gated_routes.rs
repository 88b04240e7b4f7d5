//! [`gated_routes`]: a slow protected route that waits at a [`Gate`] and a quick one, for
//! the tests that hold keyed work in progress (caps on a worker's work, draining it).

use actix_web::{HttpResponse, web};
use idempotency_actix::IdempotentRoute;

use crate::{Gate, RunCounter};

async fn work(runs: web::Data<RunCounter>, gate: web::Data<Gate>) -> HttpResponse {
    let seq = runs.record();
    gate.wait().await;
    HttpResponse::Created().body(format!("work {seq}"))
}

async fn quick() -> HttpResponse {
    HttpResponse::Created().body("quick")
}

/// `POST /work`, which counts its run in `runs`, waits at `gate` and answers 201 `work N`
/// (N the count after its run), and `POST /quick`, which answers 201 `quick` at once; both
/// protected with [`IdempotentRoute`], for an app wrapped in an `Idempotency`.
pub fn gated_routes(runs: &RunCounter, gate: &Gate) -> impl FnOnce(&mut web::ServiceConfig) {
    let (runs, gate) = (runs.clone(), gate.clone());
    move |config| {
        config
            .app_data(web::Data::new(runs))
            .app_data(web::Data::new(gate))
            .service(
                web::resource("/work")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(work)),
            )
            .service(
                web::resource("/quick")
                    .wrap(IdempotentRoute::new())
                    .route(web::post().to(quick)),
            );
    }
}
