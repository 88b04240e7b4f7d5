//! The arguments of `#[idempotent(...)]`: parsed by hand so that every mistake becomes an
//! error on the token that caused it, naming the arguments that are allowed.

use proc_macro2::TokenTree;
use syn::parse::{Parse, ParseStream};
use syn::{Expr, ExprLit, Lit, LitStr, Path, Token};

use crate::duration::{DurationError, parse_millis};

/// Appended to every argument error, so the fix is in the message.
pub(crate) const ALLOWED: &str = "#[idempotent] accepts: ttl = \"<duration>\", \
     lease = \"<duration>\", required, optional, store_errors, release_errors, \
     max_request_body = <bytes>, \
     max_stored_body = <bytes>, wait_for_completion = \"<duration>\", transactional";

/// A route's policy as written in the attribute; unset fields keep the App's defaults.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Arguments {
    /// `ttl = "<duration>"`, in milliseconds.
    pub(crate) ttl: Option<u64>,
    /// `lease = "<duration>"`, in milliseconds.
    pub(crate) lease: Option<u64>,
    /// `required`.
    pub(crate) required: bool,
    /// `optional`: not required, whatever the App says.
    pub(crate) optional: bool,
    /// `store_errors`.
    pub(crate) store_errors: bool,
    /// `release_errors`: errors not stored, whatever the App says.
    pub(crate) release_errors: bool,
    /// `max_request_body = <bytes>`.
    pub(crate) max_request_body: Option<u64>,
    /// `max_stored_body = <bytes>`.
    pub(crate) max_stored_body: Option<u64>,
    /// `wait_for_completion = "<duration>"`, in milliseconds.
    pub(crate) wait_for_completion: Option<u64>,
    /// `transactional`.
    pub(crate) transactional: bool,
}

/// The arguments the attribute knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Ttl,
    Lease,
    Required,
    Optional,
    StoreErrors,
    ReleaseErrors,
    MaxRequestBody,
    MaxStoredBody,
    WaitForCompletion,
    Transactional,
}

impl Key {
    fn from_path(path: &Path) -> Option<Self> {
        let ident = path.get_ident()?;
        Some(match ident.to_string().as_str() {
            "ttl" => Self::Ttl,
            "lease" => Self::Lease,
            "required" => Self::Required,
            "optional" => Self::Optional,
            "store_errors" => Self::StoreErrors,
            "release_errors" => Self::ReleaseErrors,
            "max_request_body" => Self::MaxRequestBody,
            "max_stored_body" => Self::MaxStoredBody,
            "wait_for_completion" => Self::WaitForCompletion,
            "transactional" => Self::Transactional,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Self::Ttl => "ttl",
            Self::Lease => "lease",
            Self::Required => "required",
            Self::Optional => "optional",
            Self::StoreErrors => "store_errors",
            Self::ReleaseErrors => "release_errors",
            Self::MaxRequestBody => "max_request_body",
            Self::MaxStoredBody => "max_stored_body",
            Self::WaitForCompletion => "wait_for_completion",
            Self::Transactional => "transactional",
        }
    }

    /// How the argument is written, for "write it like this" hints.
    fn example(self) -> &'static str {
        match self {
            Self::Ttl => "ttl = \"24h\"",
            Self::Lease => "lease = \"30s\"",
            Self::Required => "required",
            Self::Optional => "optional",
            Self::StoreErrors => "store_errors",
            Self::ReleaseErrors => "release_errors",
            Self::MaxRequestBody => "max_request_body = 1048576",
            Self::MaxStoredBody => "max_stored_body = 65536",
            Self::WaitForCompletion => "wait_for_completion = \"5s\"",
            Self::Transactional => "transactional",
        }
    }
}

/// One argument as written, before its value is checked.
struct Written {
    key: Path,
    value: Value,
}

/// What follows an argument's name.
enum Value {
    /// Nothing: a flag.
    None,
    /// `= <expr>`.
    Assigned(Expr),
    /// `=` and nothing after it.
    Missing,
    /// `(...)`: never valid, kept to point at it.
    Parenthesized(TokenTree),
}

/// The argument list as written: only the syntax is checked here.
pub(crate) struct ArgumentList(Vec<Written>);

impl Parse for ArgumentList {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut written = Vec::new();
        while !input.is_empty() {
            let key = input.call(Path::parse_mod_style).map_err(|error| {
                syn::Error::new(
                    error.span(),
                    format!("expected an argument name; {ALLOWED}"),
                )
            })?;
            let value = if input.peek(Token![=]) {
                input.parse::<Token![=]>()?;
                if input.is_empty() || input.peek(Token![,]) {
                    Value::Missing
                } else {
                    Value::Assigned(input.parse().map_err(|error| {
                        syn::Error::new(error.span(), format!("{error}; {ALLOWED}"))
                    })?)
                }
            } else if input.peek(syn::token::Paren) {
                Value::Parenthesized(input.parse()?)
            } else {
                Value::None
            };
            written.push(Written { key, value });
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>().map_err(|error| {
                syn::Error::new(
                    error.span(),
                    format!("expected `,` between arguments; {ALLOWED}"),
                )
            })?;
        }
        Ok(Self(written))
    }
}

impl TryFrom<ArgumentList> for Arguments {
    type Error = syn::Error;

    /// Checks every argument and reports every mistake at once.
    fn try_from(list: ArgumentList) -> syn::Result<Self> {
        let mut arguments = Self::default();
        let mut seen: Vec<Key> = Vec::new();
        let mut errors: Option<syn::Error> = None;
        for Written { key: path, value } in list.0 {
            let outcome = match Key::from_path(&path) {
                None => Err(syn::Error::new_spanned(
                    &path,
                    format!("unknown argument `{}`; {ALLOWED}", path_text(&path)),
                )),
                Some(key) if seen.contains(&key) => Err(syn::Error::new_spanned(
                    &path,
                    format!("duplicate argument `{}`; {ALLOWED}", key.name()),
                )),
                Some(key) => {
                    seen.push(key);
                    arguments.set(key, &path, value)
                }
            };
            if let Err(error) = outcome {
                match &mut errors {
                    Some(errors) => errors.combine(error),
                    None => errors = Some(error),
                }
            }
        }
        match errors {
            Some(errors) => Err(errors),
            None => Ok(arguments),
        }
    }
}

impl Arguments {
    fn set(&mut self, key: Key, path: &Path, value: Value) -> syn::Result<()> {
        let expr = match value {
            Value::Parenthesized(group) => {
                return Err(syn::Error::new_spanned(
                    group,
                    format!("write `{}`; {ALLOWED}", key.example()),
                ));
            }
            Value::Missing => {
                return Err(syn::Error::new_spanned(
                    path,
                    format!(
                        "`{} =` needs a value: write `{}`; {ALLOWED}",
                        key.name(),
                        key.example()
                    ),
                ));
            }
            Value::None => None,
            Value::Assigned(expr) => Some(unwrap_groups(expr)),
        };
        match (key, expr) {
            (Key::Required, None) if self.optional => Err(contradiction(path, "optional")),
            (Key::Optional, None) if self.required => Err(contradiction(path, "required")),
            (Key::StoreErrors, None) if self.release_errors => {
                Err(contradiction(path, "release_errors"))
            }
            (Key::ReleaseErrors, None) if self.store_errors => {
                Err(contradiction(path, "store_errors"))
            }
            (Key::Required, None) => {
                self.required = true;
                Ok(())
            }
            (Key::Optional, None) => {
                self.optional = true;
                Ok(())
            }
            (Key::StoreErrors, None) => {
                self.store_errors = true;
                Ok(())
            }
            (Key::ReleaseErrors, None) => {
                self.release_errors = true;
                Ok(())
            }
            (Key::Transactional, None) => {
                self.transactional = true;
                Ok(())
            }
            (
                Key::Required
                | Key::Optional
                | Key::StoreErrors
                | Key::ReleaseErrors
                | Key::Transactional,
                Some(expr),
            ) => Err(syn::Error::new_spanned(
                expr,
                format!(
                    "`{name}` is a flag and takes no value: write `{name}`; {ALLOWED}",
                    name = key.name()
                ),
            )),
            (_, None) => Err(syn::Error::new_spanned(
                path,
                format!(
                    "`{}` needs a value: write `{}`; {ALLOWED}",
                    key.name(),
                    key.example()
                ),
            )),
            (Key::Ttl, Some(expr)) => {
                self.ttl = Some(duration(key, &expr)?);
                Ok(())
            }
            (Key::Lease, Some(expr)) => {
                let lease = duration(key, &expr)?;
                if lease < MIN_LEASE_MILLIS {
                    return Err(syn::Error::new_spanned(
                        expr,
                        format!(
                            "`lease` must be at least 500ms: it is renewed every third of it while \
                             the handler runs, and a shorter one can lapse before a renewal lands \
                             and let a duplicate run the handler; {ALLOWED}"
                        ),
                    ));
                }
                self.lease = Some(lease);
                Ok(())
            }
            (Key::WaitForCompletion, Some(expr)) => {
                self.wait_for_completion = Some(duration(key, &expr)?);
                Ok(())
            }
            (Key::MaxRequestBody, Some(expr)) => {
                self.max_request_body = Some(bytes(key, &expr)?);
                Ok(())
            }
            (Key::MaxStoredBody, Some(expr)) => {
                self.max_stored_body = Some(bytes(key, &expr)?);
                Ok(())
            }
        }
    }
}

/// The error of a flag written beside its opposite.
fn contradiction(path: &Path, opposite: &str) -> syn::Error {
    syn::Error::new_spanned(
        path,
        format!(
            "`{}` contradicts `{opposite}`: write one of them; {ALLOWED}",
            path_text(path)
        ),
    )
}

/// A duration argument's value in milliseconds.
/// The shortest `lease`, in milliseconds: `idempotency_actix::MIN_LEASE`, which
/// `IdempotencyPolicy::lease` also checks (at start, with a panic).
const MIN_LEASE_MILLIS: u64 = 500;

fn duration(key: Key, expr: &Expr) -> syn::Result<u64> {
    let name = key.name();
    let literal = match expr {
        Expr::Lit(ExprLit {
            lit: Lit::Str(literal),
            ..
        }) => literal,
        // `ttl = 30s` lexes as the integer 30 with suffix `s`: say how to write it.
        Expr::Lit(ExprLit {
            lit: Lit::Int(literal),
            ..
        }) if !literal.suffix().is_empty() => {
            return Err(syn::Error::new_spanned(
                literal,
                format!("`{name}` takes a string: write `{name} = \"{literal}\"`; {ALLOWED}"),
            ));
        }
        _ => {
            return Err(syn::Error::new_spanned(
                expr,
                format!(
                    "`{name}` takes a duration string such as \"30s\", \"15m\", \"24h\" or \"7d\"; {ALLOWED}"
                ),
            ));
        }
    };
    parse_millis(&literal.value()).map_err(|error| duration_error(name, literal, &error))
}

fn duration_error(name: &str, literal: &LitStr, error: &DurationError) -> syn::Error {
    let text = literal.value();
    let message = match error {
        DurationError::Syntax => format!(
            "`{name}` = {text:?} is not a duration: write a number and a unit (ms, s, m, h, d), \
             e.g. \"30s\", \"15m\", \"24h\", \"7d\" or \"1h 30m\"; {ALLOWED}"
        ),
        DurationError::Zero => {
            format!("`{name}` = {text:?} is zero: it must be longer than that; {ALLOWED}")
        }
        DurationError::TooLong => {
            format!("`{name}` = {text:?} is longer than the maximum of 365 days; {ALLOWED}")
        }
    };
    syn::Error::new_spanned(literal, message)
}

/// A byte-count argument's value.
fn bytes(key: Key, expr: &Expr) -> syn::Result<u64> {
    let name = key.name();
    let wrong_type = || {
        syn::Error::new_spanned(
            expr,
            format!(
                "`{name}` takes a number of bytes: write e.g. `{}`; {ALLOWED}",
                key.example()
            ),
        )
    };
    let Expr::Lit(ExprLit {
        lit: Lit::Int(literal),
        ..
    }) = expr
    else {
        return Err(wrong_type());
    };
    if !matches!(literal.suffix(), "" | "usize") {
        return Err(wrong_type());
    }
    literal.base10_parse::<u64>().map_err(|_| {
        syn::Error::new_spanned(
            literal,
            format!("`{name}` = {literal} is too large; {ALLOWED}"),
        )
    })
}

/// Literals that reach us through `macro_rules!` arrive in invisible groups.
fn unwrap_groups(expr: Expr) -> Expr {
    match expr {
        Expr::Group(group) => unwrap_groups(*group.expr),
        other => other,
    }
}

fn path_text(path: &Path) -> String {
    path.segments
        .iter()
        .map(|segment| segment.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}

#[cfg(test)]
mod tests {
    use super::{ArgumentList, Arguments};

    fn parse(tokens: proc_macro2::TokenStream) -> syn::Result<Arguments> {
        syn::parse2::<ArgumentList>(tokens).and_then(Arguments::try_from)
    }

    fn error(tokens: proc_macro2::TokenStream) -> String {
        match parse(tokens) {
            Ok(arguments) => panic!("accepted: {arguments:?}"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn nothing_means_the_app_defaults() {
        assert_eq!(parse(quote::quote!()).ok(), Some(Arguments::default()));
    }

    #[test]
    fn reads_every_argument() {
        let arguments = parse(quote::quote!(
            ttl = "1h",
            lease = "10s",
            required,
            store_errors,
            max_request_body = 4096,
            max_stored_body = 1_024usize,
            wait_for_completion = "2s",
            transactional,
        ));
        assert_eq!(
            arguments.ok(),
            Some(Arguments {
                ttl: Some(3_600_000),
                lease: Some(10_000),
                required: true,
                optional: false,
                store_errors: true,
                release_errors: false,
                max_request_body: Some(4096),
                max_stored_body: Some(1024),
                wait_for_completion: Some(2_000),
                transactional: true,
            })
        );
    }

    #[test]
    fn the_opposites_of_the_flags_undo_the_app_s_and_contradict_them() {
        assert_eq!(
            parse(quote::quote!(optional, release_errors)).ok(),
            Some(Arguments {
                optional: true,
                release_errors: true,
                ..Arguments::default()
            })
        );
        for (tokens, expected) in [
            (
                quote::quote!(required, optional),
                "`optional` contradicts `required`",
            ),
            (
                quote::quote!(optional, required),
                "`required` contradicts `optional`",
            ),
            (
                quote::quote!(store_errors, release_errors),
                "`release_errors` contradicts `store_errors`",
            ),
        ] {
            let message = error(tokens.clone());
            assert!(message.contains(expected), "{tokens}: {message}");
        }
    }

    #[test]
    fn every_error_names_the_allowed_arguments() {
        for tokens in [
            quote::quote!(tll = "1h"),
            quote::quote!(ttl = "1h", ttl = "2h"),
            quote::quote!(ttl = "soon"),
            quote::quote!(ttl = "0s"),
            quote::quote!(lease = "366d"),
            quote::quote!(ttl = 5),
            quote::quote!(ttl = 30s),
            quote::quote!(ttl),
            quote::quote!(ttl("1h")),
            quote::quote!(required = "yes"),
            quote::quote!(store_errors = true),
            quote::quote!(transactional = true),
            quote::quote!(optional = false),
            quote::quote!(required, optional),
            quote::quote!(release_errors, store_errors),
            quote::quote!(max_stored_body = "1MiB"),
            quote::quote!(max_request_body = 10u8),
            quote::quote!(max_request_body = -1),
            quote::quote!(max_request_body = 99999999999999999999999),
            quote::quote!("24h"),
            quote::quote!(ttl = "1h" lease = "1s"),
            quote::quote!(a::b),
            quote::quote!(ttl =),
            quote::quote!(ttl = , required),
            quote::quote!(max_stored_body = struct),
        ] {
            let message = error(tokens.clone());
            assert!(
                message.contains("#[idempotent] accepts: ttl"),
                "{tokens}: {message}"
            );
        }
    }

    #[test]
    fn reports_every_mistake_at_once() {
        let error = parse(quote::quote!(tll = "1h", required = "yes")).err();
        assert_eq!(error.map(|error| error.into_iter().count()), Some(2));
    }

    #[test]
    fn suggests_quoting_a_bare_duration() {
        assert!(error(quote::quote!(ttl = 30s)).contains("write `ttl = \"30s\"`"));
    }
}
