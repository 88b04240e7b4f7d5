//! [`ProtectedRoute`]: what `#[idempotent]` tells about the route it protects, for
//! documentation (the OpenAPI support of the `utoipa` feature reads it).

/// A protected route as its documentation needs it: the handler's name, its methods and
/// paths, and whether it requires a key, leaves that to the app, or lets requests without
/// one through whatever the app says (`#[idempotent(optional)]`).
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
/// assert!(!REFUNDS.is_optional());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProtectedRoute {
    handler: &'static str,
    routes: &'static [(&'static str, &'static str)],
    required: Option<bool>,
}

impl ProtectedRoute {
    /// The route of `handler` (its function name, which utoipa uses as the operation id)
    /// at each `(method, path)` of `routes` (methods in any case, paths as Actix writes
    /// them, e.g. `("post", "/orders/{id}")`); whether a key is required is the app's
    /// policy.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ProtectedRoute;
    ///
    /// const ORDERS: ProtectedRoute =
    ///     ProtectedRoute::new("create_order", &[("post", "/orders"), ("put", "/orders/{id}")]);
    /// assert_eq!(ORDERS.routes().len(), 2);
    /// assert!(!ORDERS.requires_key() && !ORDERS.is_optional()); // the app's policy decides
    /// ```
    pub const fn new(
        handler: &'static str,
        routes: &'static [(&'static str, &'static str)],
    ) -> Self {
        Self {
            handler,
            routes,
            required: None,
        }
    }

    /// The same route, refusing requests without a key (`#[idempotent(required)]`).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ProtectedRoute;
    ///
    /// const PAYMENTS: ProtectedRoute =
    ///     ProtectedRoute::new("pay", &[("post", "/payments")]).required();
    /// assert!(PAYMENTS.requires_key());
    /// ```
    #[must_use]
    pub const fn required(mut self) -> Self {
        self.required = Some(true);
        self
    }

    /// The same route, letting requests without a key through even under an app policy
    /// that requires one (`#[idempotent(optional)]`).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::{HttpResponse, post};
    /// use idempotency_actix::idempotent;
    ///
    /// #[idempotent(optional)]
    /// #[post("/webhooks")]
    /// async fn webhook() -> HttpResponse {
    ///     HttpResponse::Ok().finish()
    /// }
    ///
    /// assert!(webhook::IDEMPOTENCY.is_optional());
    /// assert!(!webhook::IDEMPOTENCY.requires_key());
    /// ```
    #[must_use]
    pub const fn optional(mut self) -> Self {
        self.required = Some(false);
        self
    }

    /// The handler's function name.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ProtectedRoute;
    ///
    /// assert_eq!(ProtectedRoute::new("refund", &[("post", "/refunds")]).handler(), "refund");
    /// ```
    pub const fn handler(&self) -> &'static str {
        self.handler
    }

    /// The `(method, path)` pairs the handler is routed at.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ProtectedRoute;
    ///
    /// let route = ProtectedRoute::new("refund", &[("post", "/refunds/{id}")]);
    /// assert_eq!(route.routes(), &[("post", "/refunds/{id}")]);
    /// ```
    pub const fn routes(&self) -> &'static [(&'static str, &'static str)] {
        self.routes
    }

    /// Whether a request without a key is refused with 400, whatever the app says.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ProtectedRoute;
    ///
    /// let route = ProtectedRoute::new("pay", &[("post", "/payments")]);
    /// assert!(!route.requires_key());
    /// assert!(route.required().requires_key());
    /// ```
    pub const fn requires_key(&self) -> bool {
        matches!(self.required, Some(true))
    }

    /// Whether a request without a key is let through, whatever the app says.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::ProtectedRoute;
    ///
    /// let route = ProtectedRoute::new("webhook", &[("post", "/webhooks")]);
    /// assert!(!route.is_optional());
    /// assert!(route.optional().is_optional());
    /// ```
    pub const fn is_optional(&self) -> bool {
        matches!(self.required, Some(false))
    }
}
