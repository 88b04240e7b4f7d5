//! `#[idempotent(transactional)]` in a crate built without the `postgres` feature: a compile
//! error that says the feature is needed (`tests/without_postgres/*-fail.rs` against their
//! committed `.stderr`; regenerate with `TRYBUILD=overwrite` and review the diff).
//!
//! Only in that build: `cargo test -p idempotency-actix --no-default-features --test
//! without_postgres` (CI checks that the attribute fails there, its message aside, with a
//! `compile_fail` doctest, `TransactionalNeedsPostgres` in `lib.rs`). The attribute's other cases are in `idempotency-macros/tests/trybuild/`,
//! whose crate builds this one with `postgres`, as `cargo test --workspace` does.

#![cfg(not(feature = "postgres"))]

#[test]
fn transactional_needs_the_postgres_feature() {
    trybuild::TestCases::new().compile_fail("tests/without_postgres/*-fail.rs");
}
