//! [`ProtectedRoute`]: what `#[idempotent]` tells about the route it protects, for
//! documentation (the OpenAPI support of the `utoipa` feature reads it).

/// A protected route as its documentation needs it: the handler's name, its methods and
/// paths, and whether it requires a key.
///
/// `#[idempotent]` puts one on the handler as `<handler>::IDEMPOTENCY`, so a spec can be
/// documented from the attribute itself, never from a hand-copied list. For a route
/// registered by hand with [`IdempotentRoute`](crate::IdempotentRoute), build one with
/// [`ProtectedRoute::new`].
///
/// # Examples
///
/// ```
/// use actix_web::{HttpResponse, post};
/// use idempotency_actix::{ProtectedRoute, idempotent};
///
/// #[idempotent(required)]
/// #[post("/payments")]
/// async fn pay() -> HttpResponse {
///     HttpResponse::Ok().finish()
/// }
///
/// assert_eq!(pay::IDEMPOTENCY.handler(), "pay");
/// assert_eq!(pay::IDEMPOTENCY.routes(), &[("post", "/payments")]);
/// assert!(pay::IDEMPOTENCY.requires_key());
///
/// // The same for a route registered by hand:
/// const REFUNDS: ProtectedRoute = ProtectedRoute::new("refund", &[("post", "/refunds")]);
/// assert!(!REFUNDS.requires_key());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProtectedRoute {
    handler: &'static str,
    routes: &'static [(&'static str, &'static str)],
    required: bool,
}

impl ProtectedRoute {
    /// The route of `handler` (its function name, which utoipa uses as the operation id)
    /// at each `(method, path)` of `routes` (methods in lower case, paths as Actix writes
    /// them, e.g. `("post", "/orders/{id}")`); a key is optional.
    pub const fn new(
        handler: &'static str,
        routes: &'static [(&'static str, &'static str)],
    ) -> Self {
        Self {
            handler,
            routes,
            required: false,
        }
    }

    /// The same route, refusing requests without a key (`#[idempotent(required)]`).
    #[must_use]
    pub const fn required(mut self) -> Self {
        self.required = true;
        self
    }

    /// The handler's function name.
    pub const fn handler(&self) -> &'static str {
        self.handler
    }

    /// The `(method, path)` pairs the handler is routed at.
    pub const fn routes(&self) -> &'static [(&'static str, &'static str)] {
        self.routes
    }

    /// Whether a request without a key is refused with 400.
    pub const fn requires_key(&self) -> bool {
        self.required
    }
}
