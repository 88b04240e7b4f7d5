//! The `#[idempotent(...)]` attribute of `idempotency-actix`; use it through
//! `idempotency_actix::idempotent`.

use proc_macro::TokenStream;

/// Placeholder until the attribute lands: returns the item unchanged.
#[proc_macro_attribute]
pub fn idempotent(_args: TokenStream, item: TokenStream) -> TokenStream {
    item
}
