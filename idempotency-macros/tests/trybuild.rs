//! Compile-time errors of `#[idempotent(...)]`: what does not compile, against the exact
//! errors committed beside each case (`tests/trybuild/*-fail.rs` and their `.stderr`).
//! Regenerate those with `TRYBUILD=overwrite` and review the diff. What the attribute
//! accepts is in `attribute_compiles.rs`: with `compile_fail` cases only, trybuild checks
//! its crate's dependencies (`cargo check`) instead of building them.
//!
//! Here rather than in the end-to-end test crate: trybuild compiles every dependency of the
//! crate it runs in once more, and this crate has few (181 s against 417 s for the same
//! cases, measured on one machine).

#[test]
fn idempotent_attribute_errors() {
    trybuild::TestCases::new().compile_fail("tests/trybuild/*-fail.rs");
}
