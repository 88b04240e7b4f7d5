//! `Idempotency::drain` on an app that fails closed (the default): a new key whose `begin`
//! fails while the process drains gets the 503 of a failed store, with `Connection: close`
//! as the drain's own 503 has, so that the retry opens a connection, which a load balancer
//! sends to an instance that is not stopping.
//!
//! One test in a binary of its own: a drain is for the whole process and for good.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::Ordering;
use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{FailMode, Idempotency};
use idempotency_actix_tests::{FaultyStore, GatedRoutes, post_quick};

#[actix_web::test]
async fn a_store_failure_while_draining_closes_the_connection() {
    let store = FaultyStore::default();
    let routes = GatedRoutes::default();
    let runs = routes.quick_runs.clone();
    let server = routes.serve_on(&store, FailMode::Closed);
    let post = |key| post_quick(&server, key);

    // Before the drain a failed store's 503 keeps the connection.
    store.unavailable_begins.store(1, Ordering::SeqCst);
    let before = post("before").await;
    assert_eq!(before.status, StatusCode::SERVICE_UNAVAILABLE, "{before:?}");
    assert_eq!(before.header("connection"), None, "{before:?}");

    assert_eq!(Idempotency::drain(Duration::from_secs(10)).await, 0);

    store.unavailable_begins.store(1, Ordering::SeqCst);
    let refused = post("new").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{refused:?}"
    );
    assert_eq!(
        refused.json()["type"],
        "tag:idempotency-actix,2026:store-unavailable"
    );
    assert_eq!(refused.header("connection"), Some("close"), "{refused:?}");
    assert_eq!(runs.get(), 0);
}
