//! OpenAPI documentation of protected routes (feature `utoipa`): the `Idempotency-Key`
//! header parameter, the problem responses and the replay headers, added to a
//! utoipa-generated spec from what `#[idempotent]` says about each route.

use std::borrow::Cow;

use utoipa::Modify;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{Operation, Parameter, ParameterBuilder, ParameterIn, PathItem};
use utoipa::openapi::response::Response;
use utoipa::openapi::schema::{ObjectBuilder, SchemaType, Type};
use utoipa::openapi::{Components, ContentBuilder, OpenApi, RefOr, Required, Schema};

use crate::key::MAX_KEY_LENGTH;
use crate::problem_type::ProblemType;
use crate::protected_route::ProtectedRoute;

/// The name of the RFC 9457 problem schema added to the spec's components.
///
/// # Examples
///
/// ```
/// use idempotency_actix::PROBLEM_SCHEMA;
///
/// // Problem responses refer to it as `#/components/schemas/IdempotencyProblem`.
/// assert_eq!(PROBLEM_SCHEMA, "IdempotencyProblem");
/// ```
pub const PROBLEM_SCHEMA: &str = "IdempotencyProblem";

/// The syntax of a key, as a regular expression (in the common subset of ECMA-262, which
/// OpenAPI names, and Rust's `regex`): the bare form (visible ASCII but `"`, `,` and `;`,
/// which end a bare key) or the IETF draft's sf-string form (printable ASCII in quotes, `\"`
/// and `\\` escaped, not spaces alone), which RFC 8941 parameters may follow (`"abc";v=1`,
/// accepted and ignored; not after a bare key). Every value it matches whose key is 1 to 255
/// characters long is accepted, and every value it does not match is refused.
///
/// # Examples
///
/// ```
/// use idempotency_actix::KEY_PATTERN;
///
/// let pattern = regex_lite::Regex::new(KEY_PATTERN)?;
/// assert!(pattern.is_match("8e03978e-40d5-43e8-bc93-6894a57f9324"));
/// assert!(pattern.is_match(r#""order 1";v=1"#));
/// assert!(!pattern.is_match("order;v=1")); // parameters need the quoted form
/// assert!(!pattern.is_match("k1, k2"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub const KEY_PATTERN: &str = concat!(
    r#"^(?:[!#-+\x2D-:<-~]+|"(?: *(?:[!#-\[\]-~]|\\["\\]))+ *""#,
    // Parameters (RFC 8941 §3.1.2): `;`, spaces, a lowercase name, and an optional value.
    r#"(?:; *[a-z*][a-z0-9_.*\x2D]*(?:=(?:"#,
    // The value: a string, a boolean, a byte sequence, a token, an integer or a decimal.
    r#""(?:[ !#-\[\]-~]|\\["\\])*"|\?[01]|:[A-Za-z0-9+/=]*:"#,
    r#"|[A-Za-z*][!#-'*+\x2D-:A-Z^-z|~]*|-?[0-9]{1,15}|-?[0-9]{1,12}\.[0-9]{1,3}"#,
    r#"))?)*)$"#,
);

/// A [`utoipa::Modify`] that documents protected routes in a utoipa-generated spec.
///
/// For each [`ProtectedRoute`] (`<handler>::IDEMPOTENCY`, put there by `#[idempotent]`),
/// the operations whose `operationId` is the handler's name (utoipa's default) at one of
/// its `(method, path)` pairs (the spec's path may carry a scope's prefix: `/api/orders` for
/// `/orders`, whole segments only, never `/preorders`; a segment's regex is left out, as
/// utoipa does: `/orders/{id}` for `/orders/{id:\d+}`), or else the operation at each of
/// those pairs exactly, gets what follows. A route at an empty path or `/` (a scope's own
/// route, `#[post("")]`) is looked for at that path alone, as under a prefix it could be
/// any operation of that name: describe it with its whole path
/// ([`ProtectedRoute::new`]) to have it documented. An
/// operation of another handler with the same function name (`comments::create` beside
/// `orders::create`), or of a method the middleware never protects (`GET`), is left alone.
/// Each operation documented gets:
///
/// * the `Idempotency-Key` header parameter, required if the route requires a key, with
///   its syntax ([`KEY_PATTERN`]: the bare form, or the quoted form with optional
///   parameters) and the longest value that can hold a key of 255 characters (512: quoted,
///   every character escaped; parameters count against it);
/// * the problem responses 400, 409 (with `Retry-After`), 413, 422, 500 (the handler
///   panicked, its key released; or no `Idempotency` is configured) and 503 (with
///   `Retry-After`), `application/problem+json` with the [`PROBLEM_SCHEMA`] schema (RFC
///   9457: `type`, `title`, `status`, `detail`), each described with the `type` of every
///   [`IdempotencyError`](crate::IdempotencyError) the middleware answers with that status;
/// * the `Idempotent-Replayed` and `Idempotent-Body-Omitted` headers on the responses the
///   operation already documents (a replay repeats them); one given by reference to the
///   spec's shared responses (`#/components/responses/…`) is written out in the operation
///   with them, the shared one left as the operations that refer to it have it.
///
/// Operations already documented are left as they are: a parameter of the same name is not
/// added twice, and a response the handler documents for one of these statuses keeps its
/// description and gains the problem content.
///
/// # Examples
///
/// One line per spec, listing the protected handlers:
///
/// ```
/// use actix_web::{HttpResponse, post};
/// use idempotency_actix::{IdempotencyOpenApi, idempotent};
/// use utoipa::OpenApi;
///
/// #[idempotent(required)]
/// #[utoipa::path(post, path = "/payments", responses((status = 200, description = "Paid")))]
/// #[post("/payments")]
/// async fn pay() -> HttpResponse {
///     HttpResponse::Ok().finish()
/// }
///
/// const IDEMPOTENCY: IdempotencyOpenApi = IdempotencyOpenApi::new(&[pay::IDEMPOTENCY]);
///
/// #[derive(OpenApi)]
/// #[openapi(paths(pay), modifiers(&IDEMPOTENCY))]
/// struct ApiDoc;
///
/// let spec = ApiDoc::openapi();
/// let operation = spec.paths.paths["/payments"].post.as_ref().unwrap();
/// let key = &operation.parameters.as_ref().unwrap()[0];
/// assert_eq!(key.name, "Idempotency-Key");
/// assert!(operation.responses.responses.contains_key("409"));
/// ```
#[derive(Debug, Clone)]
pub struct IdempotencyOpenApi {
    routes: Cow<'static, [ProtectedRoute]>,
    header: &'static str,
    keys_required: bool,
    max_key_length: usize,
}

impl IdempotencyOpenApi {
    /// Documents `routes`.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyOpenApi, ProtectedRoute};
    /// # use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    /// # use utoipa::openapi::{OpenApi, OpenApiBuilder, PathsBuilder};
    /// # fn spec() -> OpenApi {
    /// #     let refund = OperationBuilder::new().operation_id(Some("refund")).build();
    /// #     let item = PathItem::new(HttpMethod::Post, refund);
    /// #     let paths = PathsBuilder::new().path("/refunds", item);
    /// #     OpenApiBuilder::new().paths(paths).build()
    /// # }
    ///
    /// const REFUNDS: ProtectedRoute = ProtectedRoute::new("refund", &[("post", "/refunds")]);
    /// const IDEMPOTENCY: IdempotencyOpenApi = IdempotencyOpenApi::new(&[REFUNDS]);
    ///
    /// let mut spec = spec(); // what `#[derive(utoipa::OpenApi)]` generates
    /// IDEMPOTENCY.apply(&mut spec);
    /// let operation = spec.paths.paths["/refunds"].post.as_ref().ok_or("no operation")?;
    /// let key = &operation.parameters.as_ref().ok_or("no parameters")?[0];
    /// assert_eq!(key.name, "Idempotency-Key");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn new(routes: &'static [ProtectedRoute]) -> Self {
        Self {
            routes: Cow::Borrowed(routes),
            header: "Idempotency-Key",
            keys_required: false,
            max_key_length: MAX_KEY_LENGTH,
        }
    }

    /// Documents routes known only at run time.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyOpenApi, ProtectedRoute};
    /// # use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    /// # use utoipa::openapi::{OpenApi, OpenApiBuilder, PathsBuilder};
    /// # fn spec() -> OpenApi {
    /// #     let refund = OperationBuilder::new().operation_id(Some("refund")).build();
    /// #     let item = PathItem::new(HttpMethod::Post, refund);
    /// #     let paths = PathsBuilder::new().path("/refunds", item);
    /// #     OpenApiBuilder::new().paths(paths).build()
    /// # }
    ///
    /// const REFUNDS: ProtectedRoute = ProtectedRoute::new("refund", &[("post", "/refunds")]);
    /// const PAYOUTS: ProtectedRoute = ProtectedRoute::new("payout", &[("post", "/payouts")]);
    /// let enabled = ["refund"]; // read from the app's configuration
    /// let routes = [REFUNDS, PAYOUTS]
    ///     .into_iter()
    ///     .filter(|route| enabled.contains(&route.handler()));
    ///
    /// let mut spec = spec();
    /// IdempotencyOpenApi::from_routes(routes).apply(&mut spec);
    /// let operation = spec.paths.paths["/refunds"].post.as_ref().ok_or("no operation")?;
    /// let key = &operation.parameters.as_ref().ok_or("no parameters")?[0];
    /// assert_eq!(key.name, "Idempotency-Key");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_routes(routes: impl IntoIterator<Item = ProtectedRoute>) -> Self {
        Self {
            routes: routes.into_iter().collect(),
            ..Self::new(&[])
        }
    }

    /// The key header's name, if the app sets another one with
    /// [`Idempotency::header`](crate::Idempotency::header).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyOpenApi, ProtectedRoute};
    /// # use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    /// # use utoipa::openapi::{OpenApi, OpenApiBuilder, PathsBuilder};
    /// # fn spec() -> OpenApi {
    /// #     let refund = OperationBuilder::new().operation_id(Some("refund")).build();
    /// #     let item = PathItem::new(HttpMethod::Post, refund);
    /// #     let paths = PathsBuilder::new().path("/refunds", item);
    /// #     OpenApiBuilder::new().paths(paths).build()
    /// # }
    ///
    /// const REFUNDS: ProtectedRoute = ProtectedRoute::new("refund", &[("post", "/refunds")]);
    /// // For an app with `Idempotency::header("X-Request-Key")`:
    /// let idempotency = IdempotencyOpenApi::new(&[REFUNDS]).header("X-Request-Key");
    ///
    /// let mut spec = spec();
    /// idempotency.apply(&mut spec);
    /// let operation = spec.paths.paths["/refunds"].post.as_ref().ok_or("no operation")?;
    /// let key = &operation.parameters.as_ref().ok_or("no parameters")?[0];
    /// assert_eq!(key.name, "X-Request-Key");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub const fn header(mut self, name: &'static str) -> Self {
        self.header = name;
        self
    }

    /// Documents the key as required on every route but those tagged
    /// `#[idempotent(optional)]` ([`ProtectedRoute::optional`]), for an app that calls
    /// [`Idempotency::policy`](crate::Idempotency::policy) with
    /// [`IdempotencyPolicy::required`](crate::IdempotencyPolicy::required).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyOpenApi, ProtectedRoute};
    /// use utoipa::openapi::Required;
    /// # use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    /// # use utoipa::openapi::{OpenApi, OpenApiBuilder, PathsBuilder};
    /// # fn spec() -> OpenApi {
    /// #     let refund = OperationBuilder::new().operation_id(Some("refund")).build();
    /// #     let item = PathItem::new(HttpMethod::Post, refund);
    /// #     let paths = PathsBuilder::new().path("/refunds", item);
    /// #     OpenApiBuilder::new().paths(paths).build()
    /// # }
    ///
    /// const REFUNDS: ProtectedRoute = ProtectedRoute::new("refund", &[("post", "/refunds")]);
    /// const IDEMPOTENCY: IdempotencyOpenApi = IdempotencyOpenApi::new(&[REFUNDS]).keys_required();
    ///
    /// let mut spec = spec();
    /// IDEMPOTENCY.apply(&mut spec);
    /// let operation = spec.paths.paths["/refunds"].post.as_ref().ok_or("no operation")?;
    /// let key = &operation.parameters.as_ref().ok_or("no parameters")?[0];
    /// assert!(matches!(key.required, Required::True));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub const fn keys_required(mut self) -> Self {
        self.keys_required = true;
        self
    }

    /// The most characters a key may have, if the app takes longer keys than
    /// [`MAX_KEY_LENGTH`](crate::MAX_KEY_LENGTH) with
    /// [`Idempotency::max_key_length`](crate::Idempotency::max_key_length): the key
    /// parameter's description and `maxLength` follow it.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyOpenApi, ProtectedRoute};
    /// use utoipa::openapi::{RefOr, Schema};
    /// # use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    /// # use utoipa::openapi::{OpenApi, OpenApiBuilder, PathsBuilder};
    /// # fn spec() -> OpenApi {
    /// #     let refund = OperationBuilder::new().operation_id(Some("refund")).build();
    /// #     let item = PathItem::new(HttpMethod::Post, refund);
    /// #     let paths = PathsBuilder::new().path("/refunds", item);
    /// #     OpenApiBuilder::new().paths(paths).build()
    /// # }
    ///
    /// const REFUNDS: ProtectedRoute = ProtectedRoute::new("refund", &[("post", "/refunds")]);
    /// // For an app with `Idempotency::max_key_length(512)`:
    /// let idempotency = IdempotencyOpenApi::new(&[REFUNDS]).max_key_length(512);
    ///
    /// let mut spec = spec();
    /// idempotency.apply(&mut spec);
    /// let operation = spec.paths.paths["/refunds"].post.as_ref().ok_or("no operation")?;
    /// let key = &operation.parameters.as_ref().ok_or("no parameters")?[0];
    /// let Some(RefOr::T(Schema::Object(schema))) = &key.schema else { return Err("no schema".into()) };
    /// // The header's value: quoted, with every character escaped.
    /// assert_eq!(schema.max_length, Some(2 * 512 + 2));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub const fn max_key_length(mut self, characters: usize) -> Self {
        self.max_key_length = characters;
        self
    }

    /// Documents the routes in `openapi` (what [`Modify::modify`] does).
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::{IdempotencyOpenApi, PROBLEM_SCHEMA, ProtectedRoute};
    /// # use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    /// # use utoipa::openapi::{OpenApi, OpenApiBuilder, PathsBuilder};
    /// # fn spec() -> OpenApi {
    /// #     let refund = OperationBuilder::new().operation_id(Some("refund")).build();
    /// #     let item = PathItem::new(HttpMethod::Post, refund);
    /// #     let paths = PathsBuilder::new().path("/refunds", item);
    /// #     OpenApiBuilder::new().paths(paths).build()
    /// # }
    ///
    /// const REFUNDS: ProtectedRoute = ProtectedRoute::new("refund", &[("post", "/refunds")]);
    ///
    /// let mut spec = spec();
    /// IdempotencyOpenApi::new(&[REFUNDS]).apply(&mut spec);
    /// let operation = spec.paths.paths["/refunds"].post.as_ref().ok_or("no operation")?;
    /// assert!(operation.responses.responses.contains_key("409"));
    /// let components = spec.components.as_ref().ok_or("no components")?;
    /// assert!(components.schemas.contains_key(PROBLEM_SCHEMA));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply(&self, openapi: &mut OpenApi) {
        let components = openapi.components.get_or_insert_with(Components::new);
        components
            .schemas
            .entry(PROBLEM_SCHEMA.to_owned())
            .or_insert_with(problem_schema);
        let shared = components.responses.clone();
        for route in self.routes.iter() {
            let required = route.requires_key() || (self.keys_required && !route.is_optional());
            let mut found = false;
            for (path, item) in &mut openapi.paths.paths {
                for method in PROTECTED_METHODS {
                    let Some(operation) = operation_for(item, method) else {
                        continue;
                    };
                    if operation.operation_id.as_deref() == Some(route.handler())
                        && routed_at(route, method, path)
                    {
                        write_out_shared_responses(operation, &shared);
                        document_key(operation, self.header, required, self.max_key_length);
                        found = true;
                    }
                }
            }
            if found {
                continue;
            }
            for (method, path) in route.routes() {
                let operation = openapi
                    .paths
                    .paths
                    .get_mut(&*spec_path(path))
                    .and_then(|item| operation_for(item, method));
                if let Some(operation) = operation {
                    write_out_shared_responses(operation, &shared);
                    document_key(operation, self.header, required, self.max_key_length);
                }
            }
        }
    }
}

impl Modify for IdempotencyOpenApi {
    fn modify(&self, openapi: &mut OpenApi) {
        self.apply(openapi);
    }
}

/// Documents one operation: the key header parameter `header` (required or not), the
/// problem responses, and the replay headers on the responses it already has.
///
/// The problem responses refer to `#/components/schemas/IdempotencyProblem`
/// ([`PROBLEM_SCHEMA`]); [`IdempotencyOpenApi`] adds it to the spec, or add
/// [`problem_schema`] yourself.
///
/// # Examples
///
/// ```
/// use idempotency_actix::document_operation;
/// use utoipa::openapi::path::Operation;
///
/// let mut operation = Operation::new();
/// document_operation(&mut operation, "Idempotency-Key", true);
/// assert!(operation.responses.responses.contains_key("422"));
/// ```
pub fn document_operation(operation: &mut Operation, header: &str, required: bool) {
    document_key(operation, header, required, MAX_KEY_LENGTH);
}

/// [`document_operation`], for keys of at most `max_key_length` characters.
fn document_key(operation: &mut Operation, header: &str, required: bool, max_key_length: usize) {
    for response in operation.responses.responses.values_mut() {
        if let RefOr::T(response) = response {
            add_replay_headers(response);
        }
    }
    let parameters = operation.parameters.get_or_insert_with(Vec::new);
    if !parameters
        .iter()
        .any(|parameter| parameter.name.eq_ignore_ascii_case(header))
    {
        parameters.push(key_parameter(header, required, max_key_length));
    }
    for problem in PROBLEMS {
        let response = operation
            .responses
            .responses
            .entry(problem.status.to_owned())
            .or_insert_with(|| RefOr::T(Response::new(problem.description())));
        if let RefOr::T(response) = response {
            add_problem(response, &problem);
        }
    }
}

/// The RFC 9457 problem document the middleware answers with: `type` (a tag URI naming the
/// problem), `title`, `status` and `detail`, all present.
///
/// # Examples
///
/// ```
/// use idempotency_actix::{PROBLEM_SCHEMA, document_operation, problem_schema};
/// use utoipa::openapi::path::Operation;
/// use utoipa::openapi::{Components, RefOr, Schema};
///
/// // Documenting one operation by hand, the schema it refers to goes with it:
/// let mut operation = Operation::new();
/// document_operation(&mut operation, "Idempotency-Key", false);
/// let mut components = Components::new();
/// components.schemas.insert(PROBLEM_SCHEMA.to_owned(), problem_schema());
///
/// let RefOr::T(Schema::Object(problem)) = problem_schema() else { panic!("an object") };
/// for field in ["type", "title", "status", "detail"] {
///     assert!(problem.properties.contains_key(field));
/// }
/// ```
pub fn problem_schema() -> RefOr<Schema> {
    let string = |description: &str| {
        ObjectBuilder::new()
            .schema_type(SchemaType::Type(Type::String))
            .description(Some(description))
    };
    ObjectBuilder::new()
        .schema_type(SchemaType::Type(Type::Object))
        .description(Some(
            "An RFC 9457 problem document (application/problem+json).",
        ))
        .property(
            "type",
            string("A URI naming the problem, e.g. tag:idempotency-actix,2026:in-flight."),
        )
        .property("title", string("A short summary of the problem."))
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(SchemaType::Type(Type::Integer))
                .description(Some("The HTTP status code.")),
        )
        .property("detail", string("What happened to this request."))
        .required("type")
        .required("title")
        .required("status")
        .required("detail")
        .into()
}

/// One status of problem response the middleware may answer.
struct Problem {
    status: &'static str,
    /// What it means, in words; [`Problem::description`] adds the problem types.
    summary: &'static str,
    retry_after: bool,
}

impl Problem {
    /// The summary, then the `type` of every problem the middleware answers with this
    /// status, from the table of [`ProblemType`] that the responses are made from.
    fn description(&self) -> String {
        let types: Vec<String> = ProblemType::ALL
            .iter()
            .filter(|kind| kind.status().as_str() == self.status)
            .map(|kind| format!("`{}`", kind.uri()))
            .collect();
        format!("{} Problem types: {}.", self.summary, types.join(", "))
    }
}

const PROBLEMS: [Problem; 6] = [
    Problem {
        status: "400",
        summary: "The Idempotency-Key header is malformed or repeated, or missing where the \
                  route requires it; or, for a request with a key: its scope (whose key it \
                  is, e.g. a tenant header) is missing, its body could not be read, or it asks \
                  to upgrade its connection (WebSocket) or open a tunnel (CONNECT), which \
                  cannot be made idempotent.",
        retry_after: false,
    },
    Problem {
        status: "409",
        summary: "A request with this Idempotency-Key is still being processed; retry \
                  after Retry-After seconds.",
        retry_after: true,
    },
    Problem {
        status: "413",
        summary: "The body of a request with an Idempotency-Key is over the limit.",
        retry_after: false,
    },
    Problem {
        status: "422",
        summary: "This Idempotency-Key was used before with a different request.",
        retry_after: false,
    },
    Problem {
        status: "500",
        summary: "The handler panicked: the Idempotency-Key was released, and a retry with \
                  the same key runs the request again. Or the server's idempotency layer is \
                  not configured (a deployment error; the handler did not run).",
        retry_after: false,
    },
    Problem {
        status: "503",
        summary: "The idempotency store is unavailable, or the server is busy or \
                  stopping; the request was not processed, or, where a transactional \
                  route's commit failed, its outcome is unknown (the detail says which). \
                  Retry after Retry-After seconds, with the same key if it had one.",
        retry_after: true,
    },
];

fn add_problem(response: &mut Response, problem: &Problem) {
    response
        .content
        .entry("application/problem+json".to_owned())
        .or_insert_with(|| {
            ContentBuilder::new()
                .schema(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
                    PROBLEM_SCHEMA,
                ))))
                .build()
        });
    if problem.retry_after {
        response
            .headers
            .entry("Retry-After".to_owned())
            .or_insert_with(|| {
                HeaderBuilder::new()
                    .schema(
                        ObjectBuilder::new()
                            .schema_type(SchemaType::Type(Type::Integer))
                            .minimum(Some(1)),
                    )
                    .description(Some("Seconds to wait before retrying with the same key."))
                    .build()
            });
    }
}

/// Writes out in `operation` the responses it gives by reference to the spec's shared ones
/// (`#/components/responses/…`, as utoipa's `response = Type` writes them), so that the
/// replay headers go on them: added to a shared response, they would also be documented
/// for the unprotected operations that refer to it.
fn write_out_shared_responses(
    operation: &mut Operation,
    shared: &std::collections::BTreeMap<String, RefOr<Response>>,
) {
    for response in operation.responses.responses.values_mut() {
        let RefOr::Ref(reference) = response else {
            continue;
        };
        let name = reference
            .ref_location
            .strip_prefix("#/components/responses/");
        if let Some(RefOr::T(found)) = name.and_then(|name| shared.get(name)) {
            *response = RefOr::T(found.clone());
        }
    }
}

fn add_replay_headers(response: &mut Response) {
    let flag = |description: &str| {
        HeaderBuilder::new()
            .schema(
                ObjectBuilder::new()
                    .schema_type(SchemaType::Type(Type::String))
                    .enum_values(Some(["true"])),
            )
            .description(Some(description))
            .build()
    };
    response
        .headers
        .entry(REPLAYED_HEADER_NAME.to_owned()).or_insert_with(|| {
        flag("`true` when this response is the stored response of an earlier request with the same Idempotency-Key, replayed without running the handler again.")
    });
    response
        .headers
        .entry(BODY_OMITTED_HEADER_NAME.to_owned())
        .or_insert_with(|| {
            flag("`true` on a replay whose body was too large to store: the status and headers are replayed, the body is empty.")
        });
}

/// The replay headers as documented (their canonical capitalisation).
const REPLAYED_HEADER_NAME: &str = "Idempotent-Replayed";
const BODY_OMITTED_HEADER_NAME: &str = "Idempotent-Body-Omitted";

fn key_parameter(header: &str, required: bool, max_key_length: usize) -> Parameter {
    ParameterBuilder::new()
        .name(header)
        .parameter_in(ParameterIn::Header)
        .required(if required {
            Required::True
        } else {
            Required::False
        })
        .description(Some(format!(
            "A key chosen by the client (a random UUID is best) that makes retries of this \
             request safe: the first request with a key runs, every retry with the same key \
             and the same request gets the stored response back. The IETF draft's \
             sf-string form (`\"abc\"`), which RFC 8941 parameters may follow and are \
             ignored (`\"abc\";v=1`), or the bare form (`abc`); 1 to {max_key_length} \
             printable ASCII characters. A key belongs to one request: sent again with \
             another method, path, query or body it gets 422."
        )))
        .schema(Some(
            ObjectBuilder::new()
                .schema_type(SchemaType::Type(Type::String))
                .min_length(Some(1))
                // The header's value, not the key: a key of 255 characters is 257 with its
                // quotes, and each escape adds one more.
                .max_length(Some(max_header_value_length(max_key_length)))
                .pattern(Some(KEY_PATTERN)),
        ))
        .build()
}

/// The longest header value that can hold a key of `max_key_length` characters: the quoted
/// form with every character escaped.
const fn max_header_value_length(max_key_length: usize) -> usize {
    max_key_length.saturating_mul(2).saturating_add(2)
}

/// The methods the middleware protects, as [`operation_for`] names them.
const PROTECTED_METHODS: [&str; 4] = ["post", "put", "patch", "delete"];

/// Whether `route` is routed at `method` on the spec's `path`: one of its pairs has that
/// method and a path that `path` is, or ends with whole segments (a scope's prefix may come
/// before it).
fn routed_at(route: &ProtectedRoute, method: &str, path: &str) -> bool {
    route.routes().iter().any(|(routed, at)| {
        routed.eq_ignore_ascii_case(method) && ends_with_segments(path, &spec_path(at))
    })
}

/// Whether the spec's `path` is `at`, or `at` under a prefix that ends where a segment
/// starts (`/api/orders` for `/orders` or `orders`, never `/preorders`). An empty `at` or
/// `/` (a scope's own route, `#[post("")]`) is only itself: under some prefix it would be
/// every path, the operations of other handlers of the same name included.
fn ends_with_segments(path: &str, at: &str) -> bool {
    if path == at {
        return true;
    }
    if at.is_empty() || at == "/" {
        return false;
    }
    path.strip_suffix(at)
        .is_some_and(|prefix| at.starts_with('/') || prefix.ends_with('/'))
}

/// An Actix path as a spec writes it: a segment's regex left out (`/orders/{id:\d+}` is
/// `/orders/{id}`), as utoipa does.
fn spec_path(path: &str) -> Cow<'_, str> {
    if !path.contains(':') {
        return Cow::Borrowed(path);
    }
    let mut written = String::with_capacity(path.len());
    let mut depth = 0_usize;
    let mut in_regex = false;
    for c in path.chars() {
        match c {
            '{' => {
                depth += 1;
                if !in_regex {
                    written.push(c);
                }
            }
            '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    in_regex = false;
                    written.push(c);
                } else if !in_regex {
                    written.push(c);
                }
            }
            ':' if depth == 1 && !in_regex => in_regex = true,
            _ if in_regex => {}
            _ => written.push(c),
        }
    }
    Cow::Owned(written)
}

/// The operation of `item` for `method` (in any case: a route described by hand may say
/// `"POST"`), if it is one the middleware protects.
fn operation_for<'a>(item: &'a mut PathItem, method: &str) -> Option<&'a mut Operation> {
    match method.to_ascii_lowercase().as_str() {
        "post" => item.post.as_mut(),
        "put" => item.put.as_mut(),
        "patch" => item.patch.as_mut(),
        "delete" => item.delete.as_mut(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
    use utoipa::openapi::{OpenApiBuilder, PathsBuilder};

    use super::*;

    const ORDERS: ProtectedRoute = ProtectedRoute::new("create", &[("post", "/orders")]);

    fn operation(id: &str) -> Operation {
        OperationBuilder::new().operation_id(Some(id)).build()
    }

    /// Whether the key parameter of the `POST` at `path` is documented as required.
    fn key_required(spec: &OpenApi, path: &str) -> Option<bool> {
        let parameters = spec.paths.paths[path].post.as_ref()?.parameters.as_ref()?;
        let parameter = parameters.iter().find(|p| p.name == "Idempotency-Key")?;
        Some(parameter.required == utoipa::openapi::Required::True)
    }

    fn documented(spec: &OpenApi, path: &str, method: HttpMethod) -> bool {
        let item = &spec.paths.paths[path];
        let operation = match method {
            HttpMethod::Post => item.post.as_ref(),
            HttpMethod::Get => item.get.as_ref(),
            _ => None,
        };
        operation
            .and_then(|operation| operation.parameters.as_ref())
            .is_some_and(|parameters| parameters.iter().any(|p| p.name == "Idempotency-Key"))
    }

    /// Whether [`KEY_PATTERN`] matches `value` exactly when the parser accepts it.
    fn pattern_agrees(value: &str) -> bool {
        let pattern = regex_lite::Regex::new(KEY_PATTERN).unwrap();
        pattern.is_match(value) == crate::IdempotencyKey::parse(value.as_bytes()).is_ok()
    }

    /// Runs `values` through [`pattern_agrees`], 4096 cases from a fixed seed.
    fn assert_pattern_agrees_on(values: impl proptest::strategy::Strategy<Value = String>) {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, RngSeed, TestRunner};

        let config = Config {
            cases: 4096,
            rng_seed: RngSeed::Fixed(0x0a91_2026),
            failure_persistence: None,
            ..Config::default()
        };
        TestRunner::new(config)
            .run(&values, |value| {
                prop_assert!(pattern_agrees(&value), "{:?}", value);
                Ok(())
            })
            .unwrap();
    }

    /// The documented syntax and the parser agree on every short value: a client generated
    /// from the spec sends no key the middleware refuses, and refuses none it accepts.
    /// `"   "` matched and was refused (an empty key), before the pattern required more
    /// than spaces in quotes (helper review).
    #[test]
    fn the_key_pattern_accepts_exactly_what_the_parser_accepts() {
        use proptest::prelude::*;

        for value in [
            "abc",
            "\"abc\"",
            "\" a \"",
            "\"a\\\"b\"",
            "\"   \"",
            "\"\"",
            "a b",
            "a;b",
            "a,b",
            "\"a",
            "\"a\"b",
            "\"a\\b\"",
        ] {
            assert!(pattern_agrees(value), "{value:?}");
        }
        // Printable ASCII, bare or in quotes; no leading or trailing whitespace, which HTTP
        // strips from a header value.
        assert_pattern_agrees_on(prop_oneof![
            "[!-~]([ -~]{0,6}[!-~])?",
            "\"[ -~]{0,8}\"",
            "\"[ -~]{0,4}\";[ -~]{0,6}[!-~]",
        ]);
    }

    /// RFC 8941 parameters after a quoted key, which the middleware accepts and ignores,
    /// match the pattern, and malformed ones do not: `"abc";p=1` did not match (helper
    /// review), so a client validating against the spec refused a key the middleware takes.
    #[test]
    fn the_key_pattern_takes_the_parameters_the_parser_takes() {
        let pattern = regex_lite::Regex::new(KEY_PATTERN).unwrap();
        for value in [
            r#""abc";p=1"#,
            r#""abc";p"#,
            r#""abc"; p=1;q"#,
            r#""abc";v="x \" y";n=-1.5;t=tok/en:x;b=:aGk=:;f=?1;*s-t.u_v*=*w"#,
            r#""abc";n=123456789012345;d=123456789012.123"#,
        ] {
            assert!(pattern.is_match(value), "{value:?}");
            assert!(pattern_agrees(value), "{value:?}");
        }
        for value in [
            "abc;p=1",
            r#""abc";"#,
            r#""abc";p="#,
            r#""abc" ;p=1"#,
            r#""abc";P=1"#,
            r#""abc";1p"#,
            r#""abc";p=1.2345"#,
            r#""abc";p=1."#,
            r#""abc";p=1234567890123456"#,
            r#""abc";p=1234567890123.5"#,
            r#""abc";p=?2"#,
            r#""abc";p=:aGk="#,
            r#""abc";p="x"#,
            r#""abc";p=a"b"#,
            r#""abc";p=1,"b""#,
        ] {
            assert!(!pattern.is_match(value), "{value:?}");
            assert!(pattern_agrees(value), "{value:?}");
        }
        // Near-misses of every kind of value: names, spaces, signs, digits, separators.
        assert_pattern_agrees_on(
            "\"[a-z]{1,3}\"(;[ ]{0,1}[a-z*A][a-z0-9_.*-]{0,2}(=(\"[ -~]{0,3}\"?|\\?[0-2]\
             |:[A-Za-z0-9+/=]{0,3}:?|[A-Za-z*][!-~]{0,3}|-?[0-9]{0,16}(\\.[0-9]{0,4})?))?){1,3}",
        );
    }

    #[test]
    fn only_the_handlers_own_operations_are_documented() {
        let mut spec = OpenApiBuilder::new()
            .paths(
                PathsBuilder::new()
                    .path(
                        "/api/orders",
                        PathItem::new(HttpMethod::Post, operation("create")),
                    )
                    // Another module's handler of the same name, and a safe method.
                    .path(
                        "/comments",
                        PathItem::new(HttpMethod::Post, operation("create")),
                    )
                    .path(
                        "/orders/export",
                        PathItem::new(HttpMethod::Get, operation("create")),
                    ),
            )
            .build();
        IdempotencyOpenApi::new(&[ORDERS]).apply(&mut spec);
        assert!(
            documented(&spec, "/api/orders", HttpMethod::Post),
            "under a scope's prefix"
        );
        assert!(!documented(&spec, "/comments", HttpMethod::Post));
        assert!(!documented(&spec, "/orders/export", HttpMethod::Get));
    }

    /// A response given by reference to the spec's shared responses (utoipa's `response =
    /// Type`) gets the replay headers too, written out in the protected operation; the
    /// shared response, which an unprotected operation refers to as well, is left as it was
    /// (helper review: referenced responses got no `Idempotent-Replayed`).
    #[test]
    fn a_shared_response_is_written_out_with_the_replay_headers() {
        use utoipa::openapi::{ComponentsBuilder, Ref, ResponsesBuilder};

        let created = || {
            ResponsesBuilder::new()
                .response("201", Ref::from_response_name("OrderCreated"))
                .build()
        };
        let mut protected = operation("create");
        protected.responses = created();
        let mut unprotected = operation("list_created");
        unprotected.responses = created();
        let mut spec = OpenApiBuilder::new()
            .paths(
                PathsBuilder::new()
                    .path("/orders", PathItem::new(HttpMethod::Post, protected))
                    .path("/imports", PathItem::new(HttpMethod::Post, unprotected)),
            )
            .components(Some(
                ComponentsBuilder::new()
                    .response("OrderCreated", Response::new("Created"))
                    .build(),
            ))
            .build();
        IdempotencyOpenApi::new(&[ORDERS]).apply(&mut spec);
        let replay_header = |response: &RefOr<Response>| match response {
            RefOr::T(response) => response.headers.contains_key("Idempotent-Replayed"),
            RefOr::Ref(_) => false,
        };
        let post = |path: &str| spec.paths.paths[path].post.as_ref().unwrap();
        assert!(replay_header(&post("/orders").responses.responses["201"]));
        assert!(matches!(
            post("/imports").responses.responses["201"],
            RefOr::Ref(_)
        ));
        let shared = &spec.components.as_ref().unwrap().responses["OrderCreated"];
        assert!(!replay_header(shared), "the shared response was changed");
    }

    /// A route's path matches the end of a spec's path by whole segments only, and a
    /// scope's own route (an empty path, or `/`) only its own path: an empty path used to
    /// match every path, so every operation named `create` got the key and the problems
    /// (helper review).
    #[test]
    fn a_route_path_matches_whole_segments_and_an_empty_one_only_itself() {
        const SCOPE_OWN: ProtectedRoute =
            ProtectedRoute::new("create", &[("post", ""), ("put", "/")]);
        const BARE: ProtectedRoute = ProtectedRoute::new("amend", &[("post", "orders")]);
        let post = |id| PathItem::new(HttpMethod::Post, operation(id));
        let mut spec = OpenApiBuilder::new()
            .paths(
                PathsBuilder::new()
                    .path("/comments", post("create"))
                    .path(
                        "/tags/",
                        PathItem::new(HttpMethod::Put, operation("create")),
                    )
                    .path("/preorders", post("amend"))
                    .path("/api/orders", post("amend")),
            )
            .build();
        IdempotencyOpenApi::new(&[SCOPE_OWN, BARE]).apply(&mut spec);
        assert!(!documented(&spec, "/comments", HttpMethod::Post));
        let tags = spec.paths.paths["/tags/"].put.as_ref().unwrap();
        assert!(
            tags.parameters.is_none(),
            "the PUT at /tags/ was documented"
        );
        assert!(!documented(&spec, "/preorders", HttpMethod::Post));
        assert!(documented(&spec, "/api/orders", HttpMethod::Post));
    }

    /// A route described by hand with its method as HTTP writes it (`"POST"`) is documented
    /// like one in lower case: it was silently left out of the spec, by operation id and by
    /// path alike.
    #[test]
    fn a_method_in_upper_case_is_documented_too() {
        const REFUNDS: ProtectedRoute = ProtectedRoute::new("refund", &[("POST", "/refunds")]);
        const PAYOUTS: ProtectedRoute =
            ProtectedRoute::new("payout", &[("Post", "/payouts")]).required();
        let mut spec = OpenApiBuilder::new()
            .paths(
                PathsBuilder::new()
                    .path(
                        "/api/refunds",
                        PathItem::new(HttpMethod::Post, operation("refund")),
                    )
                    // An operationId of the user's own: found by its path alone.
                    .path(
                        "/payouts",
                        PathItem::new(HttpMethod::Post, operation("send_payout")),
                    ),
            )
            .build();
        IdempotencyOpenApi::new(&[REFUNDS, PAYOUTS]).apply(&mut spec);
        assert!(documented(&spec, "/api/refunds", HttpMethod::Post));
        assert_eq!(key_required(&spec, "/payouts"), Some(true));
    }

    /// utoipa writes Actix's `{id:\\d+}` as `{id}` (and so do users, by hand).
    #[test]
    fn a_route_whose_path_segment_has_a_regex_is_documented() {
        const AMEND: ProtectedRoute =
            ProtectedRoute::new("amend", &[("post", "/orders/{id:\\d+}")]);
        const REFUND: ProtectedRoute =
            ProtectedRoute::new("refund", &[("post", "/refunds/{id:[0-9]{3}}/{kind}")]);
        let mut spec = OpenApiBuilder::new()
            .paths(
                PathsBuilder::new()
                    .path(
                        "/api/orders/{id}",
                        PathItem::new(HttpMethod::Post, operation("amend")),
                    )
                    // An operationId of the user's own: found by its path alone.
                    .path(
                        "/refunds/{id}/{kind}",
                        PathItem::new(HttpMethod::Post, operation("refund_by_id")),
                    ),
            )
            .build();
        IdempotencyOpenApi::new(&[AMEND, REFUND]).apply(&mut spec);
        assert!(documented(&spec, "/api/orders/{id}", HttpMethod::Post));
        assert!(documented(&spec, "/refunds/{id}/{kind}", HttpMethod::Post));
    }

    #[test]
    fn an_optional_route_keeps_its_key_optional_where_the_app_requires_keys() {
        const ROUTES: [ProtectedRoute; 3] = [
            ProtectedRoute::new("create", &[("post", "/orders")]),
            ProtectedRoute::new("hook", &[("post", "/webhooks")]).optional(),
            ProtectedRoute::new("pay", &[("post", "/payments")]).required(),
        ];
        let spec = || {
            OpenApiBuilder::new()
                .paths(
                    PathsBuilder::new()
                        .path(
                            "/orders",
                            PathItem::new(HttpMethod::Post, operation("create")),
                        )
                        .path(
                            "/webhooks",
                            PathItem::new(HttpMethod::Post, operation("hook")),
                        )
                        .path(
                            "/payments",
                            PathItem::new(HttpMethod::Post, operation("pay")),
                        ),
                )
                .build()
        };
        let mut app_requires = spec();
        IdempotencyOpenApi::new(&ROUTES)
            .keys_required()
            .apply(&mut app_requires);
        assert_eq!(key_required(&app_requires, "/orders"), Some(true));
        assert_eq!(key_required(&app_requires, "/webhooks"), Some(false));
        assert_eq!(key_required(&app_requires, "/payments"), Some(true));

        let mut app_default = spec();
        IdempotencyOpenApi::new(&ROUTES).apply(&mut app_default);
        assert_eq!(key_required(&app_default, "/orders"), Some(false));
        assert_eq!(key_required(&app_default, "/webhooks"), Some(false));
        assert_eq!(key_required(&app_default, "/payments"), Some(true));
    }

    /// One [`IdempotencyError`](crate::IdempotencyError) of each kind.
    fn every_error() -> Vec<crate::IdempotencyError> {
        use std::time::Duration;

        use crate::IdempotencyError as E;

        let retry_after = Duration::from_secs(1);
        let errors = vec![
            E::MissingKey,
            E::InvalidKey(crate::KeyError::Empty),
            E::MissingScope,
            E::RequestBodyTooLarge { limit: 1 },
            E::RequestBodyUnreadable(actix_web::error::PayloadError::Incomplete(None)),
            E::UpgradeRequested,
            E::InFlight { retry_after },
            E::FingerprintMismatch,
            E::StoreUnavailable {
                source: crate::StoreError::Timeout(retry_after),
                retry_after,
            },
            E::CommitUnconfirmed {
                source: crate::StoreError::Timeout(retry_after),
                retry_after,
                recorded: true,
            },
            E::TransactionUnavailable {
                source: crate::StoreError::Timeout(retry_after),
                retry_after,
            },
            E::Overloaded { retry_after },
            E::ShuttingDown { retry_after },
            E::HandlerPanicked,
            E::NotConfigured,
        ];
        // A new variant does not compile here until it is listed above.
        for error in &errors {
            match error {
                E::MissingKey
                | E::InvalidKey(_)
                | E::MissingScope
                | E::RequestBodyTooLarge { .. }
                | E::RequestBodyUnreadable(_)
                | E::UpgradeRequested
                | E::InFlight { .. }
                | E::FingerprintMismatch
                | E::StoreUnavailable { .. }
                | E::CommitUnconfirmed { .. }
                | E::TransactionUnavailable { .. }
                | E::Overloaded { .. }
                | E::ShuttingDown { .. }
                | E::HandlerPanicked
                | E::NotConfigured => {}
            }
        }
        errors
    }

    /// Every problem the middleware answers with is named, by its `type`, in the description
    /// of its status, which has the problem content, and `Retry-After` where the problem
    /// has it. The 400 named only the key's problems (not a missing scope, an unreadable
    /// body or `upgrade-requested`), the 500 only the handler's panic (not `not-configured`).
    #[test]
    fn every_problem_is_documented_under_its_status() {
        use actix_web::ResponseError;

        let mut operation = Operation::new();
        document_operation(&mut operation, "Idempotency-Key", false);
        for error in every_error() {
            let response = error.error_response();
            let status = response.status();
            let retry_after = response.headers().contains_key("retry-after");
            let body = actix_web::body::MessageBody::try_into_bytes(response.into_body()).unwrap();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let problem_type = problem["type"].as_str().unwrap();
            let Some(RefOr::T(documented)) = operation.responses.responses.get(status.as_str())
            else {
                panic!("{problem_type}: no response documented for {status}");
            };
            assert!(
                documented
                    .description
                    .contains(&format!("`{problem_type}`")),
                "{problem_type} is not in the description of {status}: {:?}",
                documented.description
            );
            assert!(
                documented.content.contains_key("application/problem+json"),
                "{status}"
            );
            assert_eq!(
                documented.headers.contains_key("Retry-After"),
                retry_after,
                "{problem_type}: Retry-After"
            );
        }
    }

    #[test]
    fn a_quoted_key_of_the_longest_length_fits_the_schema() {
        let longest = 2 + MAX_KEY_LENGTH;
        let parameter = key_parameter("Idempotency-Key", true, MAX_KEY_LENGTH);
        let Some(RefOr::T(Schema::Object(schema))) = parameter.schema else {
            panic!("an object schema");
        };
        assert_eq!(schema.max_length, Some(2 * MAX_KEY_LENGTH + 2));
        assert!(longest <= 2 * MAX_KEY_LENGTH + 2);
    }
}
