//! The expansion: add the route's `IdempotentRoute` as a `wrap = "..."` option to the Actix
//! route attributes below `#[idempotent]`.
//!
//! Actix's route macros (`#[post("/path", wrap = "<expr>")]`, `#[route(...)]`, the method
//! attributes under `#[routes]`) register a resource middleware for each `wrap` they are
//! given. `#[idempotent]` expands before them when it is written above them, so it can add
//! one. Written below, it lands on the handler fn that the route macro has already moved
//! into its generated service, where no route attribute is left to extend: that is the
//! order error.

use proc_macro2::{Literal, Span, TokenStream, TokenTree};
use quote::quote;
use syn::{Attribute, ItemFn, LitStr, Meta};

use crate::args::{ArgumentList, Arguments};
use crate::describe::{protected_route, route_methods};

/// The error for a handler without a route attribute below `#[idempotent]`.
pub(crate) const ORDER_ERROR: &str = "#[idempotent] must be placed above the route attribute \
     (#[post(..)], #[route(..)], #[routes]); for routes registered by hand, wrap the resource \
     in idempotency_actix::IdempotentRoute";

/// Actix's single-method route attributes, by the last segment of their path.
pub(crate) const METHOD_ATTRIBUTES: [&str; 10] = [
    "get", "post", "put", "patch", "delete", "head", "options", "trace", "connect", "query",
];

/// Expands `#[idempotent(args)] item`; on any error, the item unchanged plus the errors.
pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let arguments = syn::parse2::<ArgumentList>(args).and_then(Arguments::try_from);
    let handler = syn::parse2::<ItemFn>(item.clone()).map_err(|_| {
        syn::Error::new(
            Span::call_site(),
            format!("#[idempotent] goes on an Actix Web handler fn; {ORDER_ERROR}"),
        )
    });
    let expanded = match (arguments, handler) {
        (Ok(arguments), Ok(mut handler)) => check_transaction(&arguments, &handler)
            .and_then(|()| attach(&arguments, &mut handler.attrs))
            .map(|()| {
                let description = protected_route(&arguments, &handler);
                quote!(#handler #description)
            }),
        (Err(mut errors), Ok(mut handler)) => {
            // Report a misplaced attribute too, so both are fixed in one go.
            if let Err(error) = attach(&Arguments::default(), &mut handler.attrs) {
                errors.combine(error);
            }
            Err(errors)
        }
        (Ok(_), Err(error)) => Err(error),
        (Err(mut errors), Err(error)) => {
            errors.combine(error);
            Err(errors)
        }
    };
    expanded.unwrap_or_else(|errors| {
        let errors = errors.to_compile_error();
        quote!(#item #errors)
    })
}

/// The extractor only transactional routes provide, by a segment of its type path.
const TRANSACTION_EXTRACTOR: &str = "IdempotentTransaction";

/// A handler that takes an `IdempotentTransaction` must be `transactional`: anywhere else
/// the extractor has no transaction to hand over. Also where the type is wrapped
/// (`Option<IdempotentTransaction>`, a `Result`, a tuple of extractors): Actix turns the
/// extractor's refusal into `None` or an `Err` there, and the handler would run without a
/// transaction.
fn check_transaction(arguments: &Arguments, handler: &ItemFn) -> syn::Result<()> {
    if arguments.transactional {
        return Ok(());
    }
    match handler.sig.inputs.iter().find_map(|input| match input {
        syn::FnArg::Typed(argument) if names_transaction(&argument.ty) => Some(&argument.ty),
        _ => None,
    }) {
        Some(ty) => Err(syn::Error::new_spanned(
            ty,
            "this handler takes an IdempotentTransaction, which only transactional routes \
             have: write #[idempotent(transactional)]",
        )),
        None => Ok(()),
    }
}

/// Whether `ty` is the transaction extractor, by a segment of its path, or holds it as a
/// type argument, a tuple's element or behind a reference.
fn names_transaction(ty: &syn::Type) -> bool {
    match ty {
        syn::Type::Path(path) => path.path.segments.iter().any(|segment| {
            segment.ident == TRANSACTION_EXTRACTOR
                || matches!(&segment.arguments, syn::PathArguments::AngleBracketed(arguments)
                if arguments.args.iter().any(|argument| {
                    matches!(argument, syn::GenericArgument::Type(ty) if names_transaction(ty))
                }))
        }),
        syn::Type::Tuple(tuple) => tuple.elems.iter().any(names_transaction),
        syn::Type::Reference(reference) => names_transaction(&reference.elem),
        syn::Type::Paren(inner) => names_transaction(&inner.elem),
        syn::Type::Group(inner) => names_transaction(&inner.elem),
        _ => false,
    }
}

/// Methods the runtime never protects (safe, so idempotent by definition), in lower case:
/// the runtime's `SAFE_METHODS`, which a unit test checks this list against (a proc-macro
/// crate cannot take a constant from the crate that depends on it).
pub(crate) const SAFE_METHODS: [&str; 5] = ["get", "head", "options", "trace", "query"];

/// The error for a handler whose every route is a safe method.
const SAFE_ONLY_ERROR: &str = "#[idempotent] has no effect on GET, HEAD, OPTIONS, TRACE and \
     QUERY routes: they are safe, idempotent by definition, and never protected; put it on a \
     POST, PUT, PATCH or DELETE route";

/// The name of `attr` (the last segment of its path) if it is named like an Actix route
/// attribute (`route` or a method attribute).
fn route_like_name(attr: &Attribute) -> Option<String> {
    let name = attr.path().segments.last()?.ident.to_string();
    (name == "route" || METHOD_ATTRIBUTES.contains(&name.as_str())).then_some(name)
}

/// Whether `attr`'s arguments start with a path: a literal, or a `macro_rules!` fragment
/// in an invisible group (Actix's route attributes all start so).
fn starts_with_a_path(attr: &Attribute) -> bool {
    let Meta::List(list) = &attr.meta else {
        return false;
    };
    match list.tokens.clone().into_iter().next() {
        Some(TokenTree::Literal(_)) => true,
        Some(TokenTree::Group(group)) => group.delimiter() == proc_macro2::Delimiter::None,
        _ => false,
    }
}

/// Whether `attr`, one of `attrs`, is left alone as another crate's attribute that shares
/// a route attribute's name (fastrace's `#[trace]`, `#[trace(name = "..")]`): it has no
/// path, while a route attribute beside it has one. Alone, such an attribute is taken for a
/// route attribute written without its path, and reported so.
pub(crate) fn is_namesake(attr: &Attribute, attrs: &[Attribute]) -> bool {
    route_like_name(attr).is_some()
        && !starts_with_a_path(attr)
        && attrs
            .iter()
            .any(|other| route_like_name(other).is_some() && starts_with_a_path(other))
}

/// Adds the route layer to every route attribute in `attrs`.
fn attach(arguments: &Arguments, attrs: &mut [Attribute]) -> syn::Result<()> {
    let layer = LitStr::new(&route_layer(arguments).to_string(), Span::call_site());
    let mut routed = false;
    let mut protects_an_unsafe_method = false;
    let namesakes: Vec<bool> = attrs.iter().map(|attr| is_namesake(attr, attrs)).collect();
    for (attr, namesake) in attrs.iter_mut().zip(namesakes) {
        let Some(name) = attr
            .path()
            .segments
            .last()
            .map(|segment| segment.ident.to_string())
        else {
            continue;
        };
        if namesake {
            continue;
        }
        match name.as_str() {
            // `#[routes]` takes no arguments; the method attributes under it get the layer.
            "routes" => {}
            "route" => {
                add_wrap(attr, &layer)?;
                routed = true;
                protects_an_unsafe_method |= route_has_an_unsafe_method(attr);
            }
            method if METHOD_ATTRIBUTES.contains(&method) => {
                add_wrap(attr, &layer)?;
                routed = true;
                protects_an_unsafe_method |= !SAFE_METHODS.contains(&method);
            }
            "idempotent" => {
                return Err(syn::Error::new_spanned(
                    attr,
                    "#[idempotent] is given twice on this handler; put all the arguments in one",
                ));
            }
            _ => {}
        }
    }
    match (routed, protects_an_unsafe_method) {
        (true, true) => Ok(()),
        (true, false) => Err(syn::Error::new(Span::call_site(), SAFE_ONLY_ERROR)),
        (false, _) => Err(syn::Error::new(Span::call_site(), ORDER_ERROR)),
    }
}

/// Whether a `#[route(.., method = "..")]` names a method that is not safe (or names none,
/// which Actix does not accept; it reports that itself).
fn route_has_an_unsafe_method(attr: &Attribute) -> bool {
    let methods = route_methods(attr);
    methods.is_empty()
        || methods
            .iter()
            .any(|method| !SAFE_METHODS.contains(&method.as_str()))
}

/// The tokens with invisible groups (from `macro_rules!` fragments) opened up.
pub(crate) fn flatten(tokens: TokenStream) -> Vec<TokenTree> {
    tokens
        .into_iter()
        .flat_map(|tree| match tree {
            TokenTree::Group(group) if group.delimiter() == proc_macro2::Delimiter::None => {
                flatten(group.stream())
            }
            other => vec![other],
        })
        .collect()
}

/// The expression of the route's layer, named by absolute paths through the runtime
/// crate's `__private` module.
fn route_layer(arguments: &Arguments) -> TokenStream {
    let private = quote!(::idempotency_actix::__private);
    if *arguments == Arguments::default() {
        return quote!(#private::IdempotentRoute::new());
    }
    let Arguments {
        ttl,
        lease,
        required,
        optional,
        store_errors,
        release_errors,
        max_request_body,
        max_stored_body,
        wait_for_completion,
        transactional,
    } = arguments;
    let millis = |value: u64| quote!(#private::Duration::from_millis(#value));
    let bytes = |value: u64| Literal::u64_unsuffixed(value);
    let mut policy = quote!(#private::IdempotencyPolicy::default());
    if let Some(ttl) = ttl {
        let ttl = millis(*ttl);
        policy.extend(quote!(.ttl(#ttl)));
    }
    if let Some(lease) = lease {
        let lease = millis(*lease);
        policy.extend(quote!(.lease(#lease)));
    }
    if *required {
        policy.extend(quote!(.required()));
    }
    if *optional {
        policy.extend(quote!(.optional()));
    }
    if *store_errors {
        policy.extend(quote!(.store_errors()));
    }
    if *release_errors {
        policy.extend(quote!(.release_errors()));
    }
    if let Some(limit) = max_request_body {
        let limit = bytes(*limit);
        policy.extend(quote!(.max_request_body(#limit)));
    }
    if let Some(limit) = max_stored_body {
        let limit = bytes(*limit);
        policy.extend(quote!(.max_stored_body(#limit)));
    }
    if let Some(bound) = wait_for_completion {
        let bound = millis(*bound);
        policy.extend(quote!(.wait_for_completion(#bound)));
    }
    if *transactional {
        // Through the runtime crate, which knows whether it was built with `postgres`.
        policy = quote!(#private::transactional!(#policy));
    }
    quote!(#private::IdempotentRoute::with_policy(#policy))
}

/// Inserts `wrap = "<layer>"` right after the route's path, so the layer is the first
/// `wrap` Actix applies: the innermost, closest to the handler. A `wrap` the user wrote
/// stays, outside ours (an auth layer still refuses before any store traffic; a compression
/// layer compresses replays like fresh responses).
///
/// The path is everything before the first top-level comma, whatever its tokens: a literal,
/// or a `macro_rules!` fragment in an invisible group. An attribute without a path is an
/// error, never a route left unprotected.
fn add_wrap(attr: &mut Attribute, layer: &LitStr) -> syn::Result<()> {
    let Meta::List(list) = &mut attr.meta else {
        return Err(syn::Error::new_spanned(
            &*attr,
            "#[idempotent] found a route attribute without a path; write it as #[post(\"/path\")]",
        ));
    };
    let mut tokens = list.tokens.clone().into_iter();
    let path: TokenStream = tokens
        .by_ref()
        .take_while(|tree| !matches!(tree, TokenTree::Punct(comma) if comma.as_char() == ','))
        .collect();
    if path.is_empty() {
        return Err(syn::Error::new_spanned(
            &*attr,
            "#[idempotent] found a route attribute without a path; write it as #[post(\"/path\")]",
        ));
    }
    let rest: TokenStream = tokens.collect();
    let wrap = quote!(wrap = #layer);
    list.tokens = if rest.is_empty() {
        quote!(#path, #wrap)
    } else {
        quote!(#path, #wrap, #rest)
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use super::idempotent;

    fn expand(args: proc_macro2::TokenStream, item: proc_macro2::TokenStream) -> String {
        idempotent(args, item).to_string()
    }

    #[test]
    fn adds_the_layer_in_front_of_existing_options() {
        let expanded = expand(
            quote!(ttl = "90s", required),
            quote!(
                #[post("/orders", name = "orders", wrap = "Logger::default()")]
                async fn create() -> HttpResponse {
                    HttpResponse::Ok().finish()
                }
            ),
        );
        let expected = quote!(
            #[post(
                "/orders",
                wrap = ":: idempotency_actix :: __private :: IdempotentRoute :: with_policy (:: idempotency_actix :: __private :: IdempotencyPolicy :: default () . ttl (:: idempotency_actix :: __private :: Duration :: from_millis (90000u64)) . required ())",
                name = "orders",
                wrap = "Logger::default()"
            )]
        )
        .to_string();
        assert!(expanded.starts_with(&expected), "{expanded}");
    }

    /// `Option<IdempotentTransaction>` compiled without `transactional`, and the handler
    /// ran without a transaction (Actix's `Option` extractor turns the refusal into `None`);
    /// so did a `Result` or a tuple holding it (helper review).
    #[test]
    fn a_wrapped_transaction_extractor_needs_transactional_too() {
        for argument in [
            quote!(transaction: IdempotentTransaction),
            quote!(transaction: Option<IdempotentTransaction>),
            quote!(transaction: Result<idempotency_actix::IdempotentTransaction, Error>),
            quote!((transaction, body): (IdempotentTransaction, Bytes)),
        ] {
            let expanded = expand(
                quote!(),
                quote!(
                    #[post("/ledger")]
                    async fn book(#argument) -> HttpResponse {
                        HttpResponse::Created().finish()
                    }
                ),
            );
            assert!(
                expanded.contains("write #[idempotent(transactional)]"),
                "{argument}: {expanded}"
            );
        }
        let plain = expand(
            quote!(),
            quote!(
                #[post("/orders")]
                async fn create(body: Option<web::Json<Order>>) -> HttpResponse {
                    HttpResponse::Created().finish()
                }
            ),
        );
        assert!(!plain.contains("compile_error"), "{plain}");
    }

    #[test]
    fn bare_attribute_uses_the_app_defaults() {
        let expanded = expand(
            quote!(),
            quote!(
                #[actix_web::put("/profile")]
                async fn update() -> HttpResponse {
                    HttpResponse::Ok().finish()
                }
            ),
        );
        assert!(
            expanded.contains(
                "wrap = \":: idempotency_actix :: __private :: IdempotentRoute :: new ()\""
            ),
            "{expanded}"
        );
    }

    #[test]
    fn every_method_under_routes_gets_the_layer() {
        let expanded = expand(
            quote!(),
            quote!(
                #[routes]
                #[post("/a")]
                #[put("/b")]
                #[get("/c")]
                async fn handler() -> HttpResponse {
                    HttpResponse::Ok().finish()
                }
            ),
        );
        assert_eq!(
            expanded.matches("IdempotentRoute :: new").count(),
            3,
            "{expanded}"
        );
    }

    #[test]
    fn byte_limits_are_unsuffixed() {
        let expanded = expand(
            quote!(max_request_body = 10, max_stored_body = 20usize),
            quote!(
                #[route("/x", method = "POST")]
                async fn handler() -> HttpResponse {
                    HttpResponse::Ok().finish()
                }
            ),
        );
        assert!(
            expanded.contains(". max_request_body (10) . max_stored_body (20)"),
            "{expanded}"
        );
    }

    #[test]
    fn the_route_is_described_for_documentation() {
        let expanded = expand(
            quote!(required),
            quote!(
                #[routes]
                #[post("/a")]
                #[get("/a")]
                #[route("/b", method = "PUT", method = "HEAD")]
                pub async fn handler() -> HttpResponse {
                    HttpResponse::Ok().finish()
                }
            ),
        );
        let expected = "pub const IDEMPOTENCY : :: idempotency_actix :: __private :: \
            ProtectedRoute = :: idempotency_actix :: __private :: ProtectedRoute :: new \
            (\"handler\" , & [(\"post\" , \"/a\") , (\"put\" , \"/b\")]) . required () ;";
        assert!(expanded.contains("impl handler"), "{expanded}");
        assert!(expanded.contains(expected), "{expanded}");
    }

    #[test]
    fn an_optional_route_is_described_as_optional() {
        let expanded = expand(
            quote!(optional),
            quote!(
                #[post("/hooks")]
                async fn hook() -> HttpResponse {
                    HttpResponse::Ok().finish()
                }
            ),
        );
        let expected =
            "ProtectedRoute :: new (\"hook\" , & [(\"post\" , \"/hooks\")]) . optional () ;";
        assert!(expanded.contains(expected), "{expanded}");
    }

    /// fastrace's `#[trace]` (and any attribute named like a route attribute without a
    /// path) beside a route attribute is another crate's: it is left as written.
    #[test]
    fn an_attribute_that_only_shares_a_method_name_is_left_alone() {
        for trace in [
            quote!(#[trace]),
            quote!(#[fastrace::trace]),
            quote!(#[fastrace::trace(name = "create")]),
        ] {
            let expanded = expand(
                quote!(),
                quote!(
                    #[post("/orders")]
                    #trace
                    async fn create() -> HttpResponse {
                        HttpResponse::Ok().finish()
                    }
                ),
            );
            assert!(!expanded.contains("compile_error"), "{trace}: {expanded}");
            assert!(expanded.contains(&trace.to_string()), "{trace}: {expanded}");
            assert_eq!(
                expanded.matches("IdempotentRoute :: new").count(),
                1,
                "{trace}: {expanded}"
            );
        }
    }

    #[test]
    fn a_handler_without_route_attribute_is_an_order_error() {
        let expanded = expand(
            quote!(ttl = "1h"),
            quote!(
                async fn handler() -> HttpResponse {
                    HttpResponse::Ok().finish()
                }
            ),
        );
        assert!(
            expanded.contains("must be placed above the route attribute"),
            "{expanded}"
        );
        assert!(expanded.contains("async fn handler"), "{expanded}");
    }

    /// The methods the attribute refuses as safe are exactly those the runtime passes
    /// through: `QUERY` was protected by both, where it should have been by neither.
    #[test]
    fn the_safe_methods_are_the_runtimes() {
        let runtime: Vec<String> = idempotency_actix::__private::SAFE_METHODS
            .iter()
            .map(|method| method.to_ascii_lowercase())
            .collect();
        assert_eq!(super::SAFE_METHODS.as_slice(), runtime.as_slice());
        for method in super::SAFE_METHODS {
            assert!(
                super::SAFE_ONLY_ERROR.contains(&method.to_ascii_uppercase()),
                "{method}"
            );
        }
    }

    #[test]
    fn a_handler_with_only_a_query_route_is_refused() {
        for route in [
            quote!(#[query("/search")]),
            quote!(#[route("/search", method = "QUERY", method = "GET")]),
        ] {
            let expanded = expand(
                quote!(),
                quote!(
                    #route
                    async fn search() -> HttpResponse {
                        HttpResponse::Ok().finish()
                    }
                ),
            );
            assert!(expanded.contains("has no effect"), "{route}: {expanded}");
        }
    }

    #[test]
    fn argument_errors_keep_the_item_unchanged() {
        let item = quote!(
            #[post("/x")]
            async fn handler() -> HttpResponse {
                HttpResponse::Ok().finish()
            }
        );
        let expanded = expand(quote!(ttl = "0s"), item.clone());
        assert!(expanded.starts_with(&item.to_string()), "{expanded}");
        assert!(expanded.contains("compile_error"), "{expanded}");
    }
}
