//! [`GatedRoutes`]: a slow protected route that waits at a [`Gate`] and a quick one, for the
//! tests that hold keyed work in progress (caps on a worker's work, draining it).

use actix_web::{App, HttpResponse, web};
use idempotency_actix::{FailMode, Idempotency, IdempotentRoute, KeyScope};

use crate::{FaultyStore, Gate, Reply, RunCounter};

/// `POST /work`, which counts its run in [`work_runs`](Self::work_runs), waits at
/// [`gate`](Self::gate) and answers 201 `work N` (N the count after its run), and
/// `POST /quick`, which counts its run in [`quick_runs`](Self::quick_runs) and answers 201
/// `quick` at once; both protected with [`IdempotentRoute`], for an app wrapped in an
/// `Idempotency`. Clones share the counts and the gate.
#[derive(Debug, Clone, Default)]
pub struct GatedRoutes {
    /// Runs of `POST /work`.
    pub work_runs: RunCounter,
    /// Runs of `POST /quick`.
    pub quick_runs: RunCounter,
    /// Where `POST /work` handlers wait.
    pub gate: Gate,
}

#[derive(Clone)]
struct WorkRuns(RunCounter);

#[derive(Clone)]
struct QuickRuns(RunCounter);

async fn work(runs: web::Data<WorkRuns>, gate: web::Data<Gate>) -> HttpResponse {
    let seq = runs.0.record();
    gate.wait().await;
    HttpResponse::Created().body(format!("work {seq}"))
}

async fn quick(runs: web::Data<QuickRuns>) -> HttpResponse {
    runs.0.record();
    HttpResponse::Created().body("quick")
}

impl GatedRoutes {
    /// The two routes, for `App::configure`.
    pub fn configure(&self) -> impl FnOnce(&mut web::ServiceConfig) {
        let routes = self.clone();
        move |config| {
            config
                .app_data(web::Data::new(WorkRuns(routes.work_runs)))
                .app_data(web::Data::new(QuickRuns(routes.quick_runs)))
                .app_data(web::Data::new(routes.gate))
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

    /// A test server of the two routes behind `Idempotency::new(store)` failing as
    /// `fail_mode` says, its keys shared by every caller.
    pub fn serve_on(&self, store: &FaultyStore, fail_mode: FailMode) -> actix_test::TestServer {
        let (routes, store) = (self.clone(), store.clone());
        actix_test::start(move || {
            App::new()
                .wrap(
                    Idempotency::new(store.clone())
                        .on_store_error(fail_mode)
                        .scope(KeyScope::global()),
                )
                .configure(routes.clone().configure())
        })
    }
}

/// `POST /quick` of [`GatedRoutes::serve_on`]'s `server` with `key`.
///
/// # Panics
///
/// When the request or its body fails.
pub async fn post_quick(server: &actix_test::TestServer, key: &str) -> Reply {
    let request = server
        .post("/quick")
        .insert_header(("idempotency-key", key));
    let response = request.send().await.expect("the server answers");
    Reply::read(response).await.expect("the body arrives whole")
}
