//! `Idempotency::drain` on an app that fails open (`FailMode::Open`): a new key whose `begin`
//! fails while the process drains is refused with 503 `shutting-down`, as one whose `begin`
//! succeeds is, instead of running the handler unprotected in a process about to stop
//! (cut short if its client leaves).
//!
//! One test in a binary of its own: a drain is for the whole process and for good.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::Ordering;
use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix::{FailMode, Idempotency};
use idempotency_actix_tests::{FaultyStore, GatedRoutes, post_quick};

#[actix_web::test]
async fn a_new_key_whose_begin_fails_while_draining_is_refused_not_run_unprotected() {
    let store = FaultyStore::default();
    let routes = GatedRoutes::default();
    let runs = routes.quick_runs.clone();
    let server = routes.serve_on(&store, FailMode::Open);
    let post = |key| post_quick(&server, key);

    let done = post("done").await;
    assert_eq!(done.status, StatusCode::CREATED, "{done:?}");
    // Nothing is in progress: the drain ends at once.
    assert_eq!(Idempotency::drain(Duration::from_secs(10)).await, 0);

    // The next `begin` fails as a store that times out does.
    store.failed_begins.store(1, Ordering::SeqCst);
    let refused = post("new").await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "the handler ran unprotected while the process drained: {refused:?}"
    );
    assert_eq!(
        refused.json()["type"],
        "tag:idempotency-actix,2026:shutting-down"
    );
    assert_eq!(runs.get(), 1);

    // Replays are answered as ever.
    let replay = post("done").await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert_eq!(replay.headers.get("idempotent-replayed").unwrap(), "true");
    assert_eq!(runs.get(), 1);
}
