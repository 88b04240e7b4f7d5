//! Compile-time behaviour of `#[idempotent(...)]`: what compiles
//! (`tests/trybuild/*-pass.rs`, which also run) and the exact errors of what does not
//! (`tests/trybuild/*-fail.rs` against their committed `.stderr`). Regenerate those with
//! `TRYBUILD=overwrite` and review the diff.
//!
//! Here rather than in the end-to-end test crate: trybuild compiles every dependency of the
//! crate it runs in once more, and this crate has few (181 s against 417 s for the same
//! cases, measured on one machine).

#[test]
fn idempotent_attribute() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/trybuild/*-pass.rs");
    cases.compile_fail("tests/trybuild/*-fail.rs");
}
