//! When a lease runs, against answers that come late but within the store timeout: the
//! store starts a lease when it runs the step, which may be long before its answer arrives,
//! so the engine counts it from the send; and renewals end when the record completes. A
//! file of its own: the lost-record count (`Idempotency::lost_records`) is for the whole
//! process, and `cargo test` runs a file's tests in one.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::dev::{HttpServiceFactory, Service, ServiceResponse};
use actix_web::error::InternalError;
use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{App, HttpResponse};
use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute, KeyScope};
use idempotency_actix_tests::{FaultyStore, RunCounter};

/// A server whose `/orders` runs `handler` under a `lease`, on `store` (2 s store timeout).
fn start(
    store: FaultyStore,
    lease: Duration,
    runs: &RunCounter,
    handler: fn(
        web::Data<RunCounter>,
    ) -> futures_util::future::LocalBoxFuture<'static, HttpResponse>,
) -> actix_test::TestServer {
    start_with_timeout(store, Duration::from_secs(2), lease, runs, handler)
}

/// [`start`] with a store timeout of `store_timeout`.
fn start_with_timeout(
    store: FaultyStore,
    store_timeout: Duration,
    lease: Duration,
    runs: &RunCounter,
    handler: fn(
        web::Data<RunCounter>,
    ) -> futures_util::future::LocalBoxFuture<'static, HttpResponse>,
) -> actix_test::TestServer {
    serve(store, store_timeout, runs, move || {
        web::resource("/orders")
            .wrap(IdempotentRoute::with_policy(
                IdempotencyPolicy::default().lease(lease),
            ))
            .route(web::post().to(handler))
    })
}

/// A server of the resource that `resource` builds, on `store` with a store timeout of
/// `store_timeout`, its handlers counting their runs in `runs`.
fn serve<R: HttpServiceFactory + 'static>(
    store: FaultyStore,
    store_timeout: Duration,
    runs: &RunCounter,
    resource: impl Fn() -> R + Clone + Send + 'static,
) -> actix_test::TestServer {
    serve_configured(store, runs, resource, move |idempotency| {
        idempotency.store_timeout(store_timeout)
    })
}

/// [`serve`] with the app's `Idempotency` (on `store`, one global key scope) as `configure`
/// makes it.
fn serve_configured<R: HttpServiceFactory + 'static>(
    store: FaultyStore,
    runs: &RunCounter,
    resource: impl Fn() -> R + Clone + Send + 'static,
    configure: impl Fn(Idempotency) -> Idempotency + Clone + Send + 'static,
) -> actix_test::TestServer {
    let runs = runs.clone();
    actix_test::start(move || {
        App::new()
            .app_data(web::Data::new(runs.clone()))
            .wrap(configure(
                Idempotency::new(store.clone()).scope(KeyScope::global()),
            ))
            .service(resource())
    })
}

async fn post(server: &actix_test::TestServer, key: &str) -> (StatusCode, Bytes) {
    let mut response = server
        .post("/orders")
        .timeout(Duration::from_secs(30))
        .insert_header(("idempotency-key", key))
        .send_body("{}")
        .await
        .unwrap();
    (response.status(), response.body().await.unwrap())
}

/// A run of 6 s under a lease of 4.5 s (above twice the 2 s store timeout plus 100 ms, so no
/// warning): the `begin` ran at once but its answer came 1.9 s later, and every renewal
/// takes 1.5 s to reach the store. Counted from the answer, the first renewal went out at
/// about 3.5 s and landed at 5 s, after the record had expired at 4.5 s, and a duplicate at
/// 4.7 s ran the handler a second time (helper review). Counted from the send, it goes out
/// once the `begin` answered, at about 2 s, and lands at 3.5 s.
#[actix_web::test]
async fn a_lease_counts_from_the_begin_that_started_it_not_from_its_answer() {
    let store = FaultyStore {
        begin_reply_delay: Duration::from_millis(1_900),
        renew_delay: Duration::from_millis(1_500),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let server = start(store, Duration::from_millis(4_500), &runs, |runs| {
        Box::pin(async move {
            let seq = runs.record();
            actix_rt::time::sleep(Duration::from_secs(6)).await;
            HttpResponse::Created().body(format!("run {seq}"))
        })
    });
    let (first, duplicate) = futures_util::future::join(post(&server, "k"), async {
        actix_rt::time::sleep(Duration::from_millis(4_700)).await;
        post(&server, "k").await
    })
    .await;
    assert_eq!(first, (StatusCode::CREATED, Bytes::from("run 1")));
    assert_eq!(duplicate.0, StatusCode::CONFLICT, "{duplicate:?}");
    assert_eq!(runs.get(), 1);
}

/// A streamed body whose commit answers 1.3 s after the store completed the record, under a
/// 3 s lease: a renewal due meanwhile found the record completed by this very commit and
/// reported it lost (an error in the log, and `lost_records` counted it) though the retry
/// replays it (helper review). Renewals now end once the body is whole.
#[actix_web::test]
async fn a_streamed_response_s_own_commit_is_not_reported_as_a_lost_record() {
    let store = FaultyStore {
        commit_reply_delay: Duration::from_millis(1_300),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let server = start(store, Duration::from_secs(3), &runs, |runs| {
        Box::pin(async move {
            let seq = runs.record();
            let chunk = async move {
                actix_rt::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, actix_web::Error>(Bytes::from(format!("run {seq}")))
            };
            HttpResponse::Ok().streaming(futures_util::stream::once(chunk))
        })
    });
    let lost_before = Idempotency::lost_records();
    let first = post(&server, "k").await;
    assert_eq!(first, (StatusCode::OK, Bytes::from("run 1")));
    let retry = post(&server, "k").await;
    assert_eq!(retry, first);
    assert_eq!(runs.get(), 1);
    assert_eq!(Idempotency::lost_records(), lost_before, "reported lost");
}

/// Every renewal takes 1.5 s to reach the store and the commit 1.9 s, under a 4.5 s lease
/// (no warning) and a 2 s store timeout; the response is whole at 2.9 s, while a renewal
/// sent at about 1.5 s is still on its way. Dropped with the renewals when the handler
/// returned (or the body was whole), that renewal never landed, the lease ran out at 4.5 s
/// while the commit was on its way (it lands at 4.8 s), and a duplicate at 4.65 s ran the
/// handler a second time (helper review). Renewals now run on tasks of their own, and go on
/// until the commit answers.
async fn a_renewal_on_its_way_when_the_response_is_whole_still_lands(streamed: bool) {
    let store = FaultyStore {
        renew_delay: Duration::from_millis(1_500),
        commit_delay: Duration::from_millis(1_900),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let handler: fn(
        web::Data<RunCounter>,
    ) -> futures_util::future::LocalBoxFuture<'static, HttpResponse> = if streamed {
        |runs| {
            Box::pin(async move {
                let seq = runs.record();
                let chunk = async move {
                    actix_rt::time::sleep(Duration::from_millis(2_900)).await;
                    Ok::<_, actix_web::Error>(Bytes::from(format!("run {seq}")))
                };
                HttpResponse::Ok().streaming(futures_util::stream::once(chunk))
            })
        }
    } else {
        |runs| {
            Box::pin(async move {
                let seq = runs.record();
                actix_rt::time::sleep(Duration::from_millis(2_900)).await;
                HttpResponse::Ok().body(format!("run {seq}"))
            })
        }
    };
    let server = start(store, Duration::from_millis(4_500), &runs, handler);
    let (first, duplicate) = futures_util::future::join(post(&server, "k"), async {
        actix_rt::time::sleep(Duration::from_millis(4_650)).await;
        post(&server, "k").await
    })
    .await;
    assert_eq!(first, (StatusCode::OK, Bytes::from("run 1")));
    assert_eq!(duplicate.0, StatusCode::CONFLICT, "{duplicate:?}");
    assert_eq!(runs.get(), 1);
}

/// The app's layer claims the request (`protect_methods`) under a lease of 900 ms, the
/// route layer changes it to 6 s, and a middleware between the two layers takes
/// 400 ms (the store timeout is 300 ms, so neither lease warns). The renewal due at about
/// 300 ms, with the app's lease, is given up by the store timeout and lands 2.5 s after it
/// was sent; the route layer renewed with its 6 s meanwhile. Renewed on the 6 s lease's
/// schedule (every 2 s), the lock was last renewed at about 2.3 s when the late renewal set
/// the record's expiry to 900 ms from 2.8 s, and a duplicate at 4 s ran the handler a
/// second time (helper review). A lock is now renewed on the schedule of the shortest lease
/// any of its renewals was sent with, since such a renewal may land at any time.
#[actix_web::test]
async fn a_late_renewal_with_a_shorter_lease_than_the_routes_cannot_let_a_duplicate_in() {
    let store = FaultyStore {
        late_renewals: std::sync::Arc::new(1.into()),
        late_by: Duration::from_millis(2_500),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let server = serve_configured(
        store,
        &runs,
        || {
            web::resource("/orders")
                .wrap(IdempotentRoute::with_policy(
                    IdempotencyPolicy::default().lease(Duration::from_secs(6)),
                ))
                .wrap(actix_web::middleware::from_fn(
                    |request, next: actix_web::middleware::Next<_>| async move {
                        actix_rt::time::sleep(Duration::from_millis(400)).await;
                        next.call(request).await
                    },
                ))
                .route(web::post().to(|runs: web::Data<RunCounter>| async move {
                    let seq = runs.record();
                    actix_rt::time::sleep(Duration::from_secs(5)).await;
                    HttpResponse::Created().body(format!("run {seq}"))
                }))
        },
        // The app's layer claims the request (before routing) with its lease; the route
        // layer then changes that lease.
        |idempotency| {
            idempotency
                .store_timeout(Duration::from_millis(300))
                .protect_methods([actix_web::http::Method::POST])
                .policy(IdempotencyPolicy::default().lease(Duration::from_millis(900)))
        },
    );
    let (first, duplicate) = futures_util::future::join(post(&server, "k"), async {
        actix_rt::time::sleep(Duration::from_secs(4)).await;
        post(&server, "k").await
    })
    .await;
    assert_eq!(first, (StatusCode::CREATED, Bytes::from("run 1")));
    assert_eq!(duplicate.0, StatusCode::CONFLICT, "{duplicate:?}");
    assert_eq!(runs.get(), 1);
}

#[actix_web::test]
async fn a_renewal_on_its_way_when_the_handler_returns_still_lands() {
    a_renewal_on_its_way_when_the_response_is_whole_still_lands(false).await;
}

#[actix_web::test]
async fn a_renewal_on_its_way_when_the_streamed_body_is_whole_still_lands() {
    a_renewal_on_its_way_when_the_response_is_whole_still_lands(true).await;
}

/// A response that a layer inside the route's turns into an error once the handler returned
/// (a card declined after the handler reserved the order, say, on a route that stores
/// errors), under a short lease of 2.1 s (under twice the 2 s store timeout plus 100 ms: the
/// crate warns about it) and a commit that takes 1.9 s: the commit of such a stored error ran
/// without renewals, as the commit of a response does not, so the lease, last renewed at about
/// 2.8 s, ran out at about 4.9 s while the commit was on its way (it lands at 5.2 s), and a
/// duplicate at 5.1 s ran the handler a second time (helper review).
#[actix_web::test]
async fn a_stored_error_of_an_inner_layer_keeps_its_lease_while_it_commits() {
    let store = FaultyStore {
        commit_delay: Duration::from_millis(1_900),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let server = serve(store, Duration::from_secs(2), &runs, || {
        web::resource("/orders")
            // Inside the route's layer: the handler's response becomes a stored error.
            .wrap_fn(|req, service| {
                let response = service.call(req);
                async move {
                    let run = response.await?.headers().get("x-run").cloned().unwrap();
                    let declined = HttpResponse::PaymentRequired()
                        .body(format!("run {}", run.to_str().unwrap()));
                    let error = InternalError::from_response("card declined", declined);
                    Err::<ServiceResponse, _>(error.into())
                }
            })
            .wrap(IdempotentRoute::with_policy(
                IdempotencyPolicy::default()
                    .lease(Duration::from_millis(2_100))
                    .store_errors(),
            ))
            .route(web::post().to(|runs: web::Data<RunCounter>| async move {
                let seq = runs.record();
                actix_rt::time::sleep(Duration::from_millis(3_300)).await;
                HttpResponse::Ok()
                    .insert_header(("x-run", seq.to_string()))
                    .finish()
            }))
    });
    let (first, duplicate) = futures_util::future::join(post(&server, "k"), async {
        actix_rt::time::sleep(Duration::from_millis(5_100)).await;
        post(&server, "k").await
    })
    .await;
    assert_eq!(first, (StatusCode::PAYMENT_REQUIRED, Bytes::from("run 1")));
    assert!(
        duplicate.0 == StatusCode::CONFLICT || duplicate == first,
        "{duplicate:?}"
    );
    assert_eq!(runs.get(), 1);
}

/// A commit that keeps failing, each attempt answering only after 0.98 s, under a 1 s store
/// timeout and a 2.15 s lease (above twice the timeout plus 100 ms, so no warning), with
/// renewals that take 0.98 s to reach the store. The commit was retried in the background
/// with a renewal before each attempt, one after the other: a renewal, an attempt, and the
/// pause before the next (growing to a third of the lease) came to more than the lease, so
/// the lease ran out between two renewals, some seven seconds in, and a retry in that gap
/// ran the handler a second time (helper review). The lease is now renewed on its own
/// schedule while the commit is retried, as while the handler runs.
#[actix_web::test]
async fn a_commit_retried_in_the_background_keeps_its_lease_on_schedule() {
    let store = FaultyStore {
        renew_delay: Duration::from_millis(980),
        commit_delay: Duration::from_millis(980),
        failed_commits: std::sync::Arc::new(u32::MAX.into()),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let server = start_with_timeout(
        store,
        Duration::from_secs(1),
        Duration::from_millis(2_150),
        &runs,
        |runs| {
            Box::pin(async move {
                let seq = runs.record();
                HttpResponse::Created().body(format!("run {seq}"))
            })
        },
    );
    let first = post(&server, "k").await;
    assert_eq!(first, (StatusCode::CREATED, Bytes::from("run 1")));
    // Retries while the commit is retried in the background: each must find the key held.
    let until = std::time::Instant::now() + Duration::from_secs(16);
    while std::time::Instant::now() < until {
        let retry = post(&server, "k").await;
        assert_eq!(retry.0, StatusCode::CONFLICT, "{retry:?}");
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(runs.get(), 1);
}

/// A commit that failed, then was retried in the background and answered that it wrote,
/// while the store kept the request's in-flight record: on Redis Cluster, a primary paused
/// past the cluster's node timeout, woken after its replica took over, takes the commits
/// queued for it before it learns it was demoted, and loses them with the demotion (seen in
/// `redis8_cluster_chaos.rs`, 1 run in 8 under load). The key answered 409 for the rest of
/// its 20 s lease, and the next retry ran the handler a second time. A commit that landed
/// in the background is now looked at again a second later (a renewal, which succeeds only
/// on the request's in-flight record), and committed again where it was lost.
#[actix_web::test]
async fn a_background_commit_that_landed_and_was_lost_is_committed_again() {
    let store = FaultyStore {
        failed_commits: std::sync::Arc::new(1.into()),
        lost_commits: std::sync::Arc::new(1.into()),
        ..FaultyStore::default()
    };
    let runs = RunCounter::default();
    let server = start(store, Duration::from_secs(20), &runs, |runs| {
        Box::pin(async move {
            let seq = runs.record();
            HttpResponse::Created().body(format!("run {seq}"))
        })
    });
    let first = post(&server, "k").await;
    assert_eq!(first, (StatusCode::CREATED, Bytes::from("run 1")));
    // 409 while the commit is retried and looked at again; its replay within 5 s.
    let until = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let retry = post(&server, "k").await;
        if retry == first {
            break;
        }
        assert_eq!(retry.0, StatusCode::CONFLICT, "{retry:?}");
        assert!(
            std::time::Instant::now() < until,
            "still 409 5 s after the first response: its commit was taken as landed"
        );
        actix_rt::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(runs.get(), 1);
}
