//! The route's description for API documentation: `<handler>::IDEMPOTENCY`, a
//! `ProtectedRoute` holding the handler's name, its unsafe methods and paths, and whether
//! a key is required or optional whatever the app says (what the `utoipa` feature of the
//! runtime crate documents).

use proc_macro2::{TokenStream, TokenTree};
use quote::{ToTokens, quote};
use syn::{Attribute, ItemFn, LitStr, Meta};

use crate::args::Arguments;
use crate::expand::{METHOD_ATTRIBUTES, SAFE_METHODS, flatten, is_namesake};

/// `impl <handler> { const IDEMPOTENCY: ProtectedRoute = ...; }` for the struct that the
/// Actix route attribute turns the handler into.
pub(crate) fn protected_route(arguments: &Arguments, handler: &ItemFn) -> TokenStream {
    let private = quote!(::idempotency_actix::__private);
    let name = &handler.sig.ident;
    let vis = &handler.vis;
    let handler_name = LitStr::new(&name.to_string(), name.span());
    let routes = handler
        .attrs
        .iter()
        .filter(|attr| !is_namesake(attr, &handler.attrs))
        .flat_map(routes_of)
        .map(|(method, path)| {
            let method = LitStr::new(&method, proc_macro2::Span::call_site());
            quote!((#method, #path))
        });
    let required = if arguments.required {
        Some(quote!(.required()))
    } else {
        arguments.optional.then(|| quote!(.optional()))
    };
    quote! {
        impl #name {
            /// What `#[idempotent]` says about this route, for API documentation.
            #[allow(dead_code)]
            #vis const IDEMPOTENCY: #private::ProtectedRoute =
                #private::ProtectedRoute::new(#handler_name, &[#(#routes),*]) #required;
        }
    }
}

/// The `(method, path)` pairs a route attribute registers, safe methods left out.
fn routes_of(attr: &Attribute) -> Vec<(String, TokenStream)> {
    let Some(name) = attr.path().segments.last().map(|s| s.ident.to_string()) else {
        return Vec::new();
    };
    let Meta::List(list) = &attr.meta else {
        return Vec::new();
    };
    let methods = match name.as_str() {
        "route" => route_methods(attr),
        method if METHOD_ATTRIBUTES.contains(&method) => vec![method.to_owned()],
        _ => return Vec::new(),
    };
    let path: TokenStream = list
        .tokens
        .clone()
        .into_iter()
        .take_while(|tree| !matches!(tree, TokenTree::Punct(comma) if comma.as_char() == ','))
        .collect();
    methods
        .into_iter()
        .filter(|method| !SAFE_METHODS.contains(&method.as_str()))
        .map(|method| (method, path.clone()))
        .collect()
}

/// The methods a `#[route(.., method = "..")]` names, in lower case.
pub(crate) fn route_methods(attr: &Attribute) -> Vec<String> {
    let Meta::List(list) = &attr.meta else {
        return Vec::new();
    };
    let tokens: Vec<TokenTree> = flatten(list.tokens.clone());
    tokens
        .windows(3)
        .filter_map(|window| match window {
            [
                TokenTree::Ident(key),
                TokenTree::Punct(eq),
                TokenTree::Literal(value),
            ] if key == "method" && eq.as_char() == '=' => {
                syn::parse2::<LitStr>(value.to_token_stream())
                    .ok()
                    .map(|method| method.value().to_ascii_lowercase())
            }
            _ => None,
        })
        .collect()
}
