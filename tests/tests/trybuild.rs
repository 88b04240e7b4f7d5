//! Compile-time behaviour of `#[idempotent(...)]`: what compiles (`trybuild/*-pass.rs`, which
//! also run) and the exact errors of what does not (`trybuild/*-fail.rs` against their
//! committed `.stderr`). Regenerate those with `TRYBUILD=overwrite` and review the diff.

#[test]
fn idempotent_attribute() {
    let cases = trybuild::TestCases::new();
    cases.pass("trybuild/*-pass.rs");
    cases.compile_fail("trybuild/*-fail.rs");
}
