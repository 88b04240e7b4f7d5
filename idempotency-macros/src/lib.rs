//! The `#[idempotent(...)]` attribute of `idempotency-actix`; use it through
//! `idempotency_actix::idempotent`.
//!
//! The attribute checks its arguments at compile time and adds the route-level layer
//! (`idempotency_actix::IdempotentRoute`) to the Actix Web route attribute below it as a
//! `wrap = "..."` option. Generated code names the runtime crate by absolute path
//! (`::idempotency_actix::__private`).

mod args;
mod describe;
mod duration;
mod expand;

use proc_macro::TokenStream;

/// Makes an Actix Web route run its handler at most once per `Idempotency-Key`, with its own
/// policy.
///
/// The first request with a key runs the handler and stores its response; every retry with
/// the same key and the same request (method, path, query, body) gets that response back,
/// status, headers and body, plus `Idempotent-Replayed: true`, without running the handler.
/// The store and the defaults come from the nearest `Idempotency` layer above the route
/// (on the `App` or an enclosing scope); the attribute's arguments override those defaults
/// for this route only. (If the `Idempotency` also protects this route's method with
/// `protect_methods`, it takes the request before routing: `wait_for_completion`, a
/// `max_request_body` larger than the App's and `optional` under an App policy that
/// requires a key are then the App's, and a `transactional` route answers 500, as its
/// claim would be made outside its transaction; every other argument still applies. An
/// `Idempotency` on a scope under an App `Idempotency` that claims the method so would be
/// passed over: the route answers 500 too, and the log says what to change.)
///
/// ```
/// use actix_web::{App, HttpResponse, post, web};
/// use idempotency_actix::{Idempotency, idempotent};
///
/// #[idempotent(ttl = "24h", required)]
/// #[post("/orders")]
/// async fn create_order(order: web::Bytes) -> HttpResponse {
///     HttpResponse::Created().body(order)
/// }
///
/// let app = App::new()
///     .wrap(Idempotency::memory()) // or Idempotency::redis(pool)
///     .service(create_order);
/// ```
///
/// # Arguments
///
/// Every argument is optional; a bare `#[idempotent]` keeps all of the App's defaults. Each
/// argument is the option of the same name of `IdempotencyPolicy`, the one policy type that
/// also sets the App's defaults (`Idempotency::policy`).
///
/// | argument | effect on this route | App default |
/// |---|---|---|
/// | `ttl = "<duration>"` | how long a completed response is replayed: the TTL the store holds after commit | 24 h (`Idempotency::policy`) |
/// | `lease = "<duration>"` | how long an in-flight record holds the key without renewal; renewed every third of it while the handler runs, so it bounds how soon a crashed instance's key frees up; at least 500 ms | 30 s (`Idempotency::policy`) |
/// | `required` | a request without a key is refused with a 400 problem | off (`Idempotency::policy`) |
/// | `optional` | a request without a key is let through unprotected, even where the App's policy is `required` (the opposite of `required`); not where the App's `protect_methods` covers the method, nor under an `IdempotentRoute` on an enclosing scope whose policy requires a key, as those layers decide before the route's own layer runs | — |
/// | `store_errors` | responses with status >= 400 are stored and replayed too, instead of releasing the key so that a retry runs again | off (`Idempotency::policy`) |
/// | `release_errors` | responses with status >= 400 release the key, even where the App's policy stores errors (the opposite of `store_errors`) | — |
/// | `max_request_body = <bytes>` | the largest body a keyed request may send; larger is a 413 problem and the handler does not run | 1 MiB (`Idempotency::policy`) |
/// | `wait_for_completion = "<duration>"` | a retry that finds the key in flight waits up to this long for the first request to finish and replays its response, instead of a 409 problem at once | off (`Idempotency::policy`) |
/// | `max_stored_body = <bytes>` | the largest response body that is stored; a larger one is sent whole, and its record completes without a body (a retry gets the status and headers, an empty body and `Idempotent-Body-Omitted: true`) | 1 MiB (`Idempotency::policy`) |
/// | `transactional` | the record is claimed inside a PostgreSQL transaction that the handler writes through (`IdempotentTransaction`); its writes and the stored response commit together, or neither does. Needs the `postgres` feature (without it, a compile error says so) and `Idempotency::postgres(store)`. A handler that takes `IdempotentTransaction` without it is a compile error (the attribute reads the type's name: through an alias or a renamed import, every request answers 500 instead, and the handler does not run). The method must not be in the App's `protect_methods` | off |
///
/// A duration is a string of a number and a unit, `ms`, `s`, `m`, `h` or `d`: `"500ms"`,
/// `"30s"`, `"15m"`, `"24h"`, `"7d"`, or several of them, `"1h 30m"`. It must be more than
/// zero and at most 365 days. A byte count is an integer literal (`65_536`). Mistakes are
/// compile errors on the token at fault that list the arguments: an unknown or repeated
/// argument, a duration that does not parse or is out of range, a value of the wrong type
/// (`ttl = 5`, `ttl = 30s`, `required = "yes"`, `max_stored_body = "1MiB"`).
///
/// ```
/// use actix_web::{App, HttpResponse, post};
/// use idempotency_actix::{Idempotency, idempotent};
///
/// #[idempotent(
///     ttl = "7d",
///     lease = "1m",
///     required,
///     store_errors,
///     max_request_body = 65_536,
///     max_stored_body = 262_144,
///     wait_for_completion = "5s",
/// )]
/// #[post("/payments")]
/// async fn create_payment() -> HttpResponse {
///     HttpResponse::Created().finish()
/// }
///
/// let app = App::new().wrap(Idempotency::memory()).service(create_payment);
/// ```
///
/// # Placement
///
/// Write `#[idempotent]` **above** the route attribute: `#[post(..)]`, `#[put(..)]`,
/// `#[patch(..)]`, `#[delete(..)]`, any other method attribute, `#[route(.., method = ..)]`
/// or `#[routes]`. It adds the route layer to that attribute as a `wrap = ".."` option, so
/// it must expand first. Below the route attribute, or on a function without one, it is a
/// compile error that says so:
///
/// ```compile_fail
/// use actix_web::{HttpResponse, post};
/// use idempotency_actix::idempotent;
///
/// #[post("/orders")]
/// #[idempotent] // error: #[idempotent] must be placed above the route attribute (..)
/// async fn create_order() -> HttpResponse {
///     HttpResponse::Created().finish()
/// }
/// ```
///
/// - Above `#[routes]`, every method attribute under it gets the policy; above
///   `#[route(..)]`, every method it lists.
/// - A `wrap = ".."` already on the route attribute is kept and runs outside the
///   idempotency layer: it sees every request, replays included, and an authentication
///   layer there refuses before the store is touched.
/// - Routes inside `web::scope(..)`, or in a module under Actix's `#[scope(..)]`, are
///   protected the same way.
/// - `GET`, `HEAD`, `OPTIONS`, `TRACE` and `QUERY` requests pass through untouched, so a
///   `#[routes]` handler may also answer `GET`. On a handler with only such methods
///   (`#[query(..)]` included), `#[idempotent]` is a compile error rather than a silent
///   no-op.
/// - Without an `Idempotency` on the App or an enclosing scope, the route answers 500 and
///   logs that `.wrap(Idempotency::…)` is missing.
/// - The code it adds names the runtime crate by its own name, `::idempotency_actix`. A
///   crate that renames the dependency (`idem = { package = "idempotency-actix", .. }`)
///   gets "could not find `idempotency_actix`" on every `#[idempotent]` unless its root
///   also holds `extern crate idem as idempotency_actix;`.
///
/// ```
/// use actix_web::{App, HttpResponse, routes, web};
/// use idempotency_actix::{Idempotency, idempotent};
///
/// #[idempotent(ttl = "1h")]
/// #[routes]
/// #[post("/profile")]
/// #[put("/profile")]
/// async fn save_profile(profile: web::Bytes) -> HttpResponse {
///     HttpResponse::Ok().body(profile)
/// }
///
/// let app = App::new()
///     .wrap(Idempotency::memory())
///     .service(web::scope("/api").service(save_profile));
/// ```
///
/// # Routes registered by hand
///
/// A route registered with `web::resource(..).route(..)` gets the same policy from
/// `idempotency_actix::IdempotentRoute::with_policy`, the layer the attribute attaches, and
/// an `IdempotencyPolicy` with one method per argument:
///
/// ```
/// use std::time::Duration;
/// use actix_web::{App, HttpResponse, web};
/// use idempotency_actix::{Idempotency, IdempotencyPolicy, IdempotentRoute};
///
/// async fn charge() -> HttpResponse {
///     HttpResponse::Ok().finish()
/// }
///
/// let policy = IdempotencyPolicy::default()
///     .ttl(Duration::from_secs(24 * 60 * 60))
///     .required();
/// let app = App::new().wrap(Idempotency::memory()).service(
///     web::resource("/charges")
///         .wrap(IdempotentRoute::with_policy(policy))
///         .route(web::post().to(charge)),
/// );
/// ```
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
