//! The reference server's operability routes (issue 11), over HTTP against the real
//! process: `GET /openapi.json` is a valid OpenAPI 3.1 document of every route of DESIGN
//! §11 with the idempotency header and answers on the protected ones and real body shapes,
//! and `GET /metrics` shows the middleware's metrics in the Prometheus text format.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::StatusCode;
use idempotency_actix_tests::{ReferenceServer, Reply};
use serde_json::{Value, json};

fn client() -> awc::Client {
    awc::Client::builder()
        .timeout(Duration::from_secs(30))
        .finish()
}

async fn get(server: &ReferenceServer, path: &str) -> Reply {
    Reply::read(client().get(server.url(path)).send().await.unwrap())
        .await
        .unwrap()
}

async fn post_json(server: &ReferenceServer, path: &str, key: Option<&str>, body: &Value) -> Reply {
    let mut request = client().post(server.url(path));
    if let Some(key) = key {
        request = request.insert_header(("idempotency-key", key));
    }
    Reply::read(request.send_json(body).await.unwrap())
        .await
        .unwrap()
}

/// Every route of DESIGN §11 (without the PostgreSQL-only ledger), and whether
/// `#[idempotent]` protects it: `None` unprotected, `Some(required)`.
const ROUTES: [(&str, &str, Option<bool>); 9] = [
    ("post", "/orders", Some(false)),
    ("post", "/payments", Some(true)),
    ("post", "/flaky", Some(false)),
    ("put", "/profile", Some(false)),
    ("post", "/large", Some(false)),
    ("post", "/untagged", None),
    ("get", "/stats", None),
    ("get", "/metrics", None),
    ("get", "/openapi.json", None),
];

const PROBLEM_REF: &str = "#/components/schemas/IdempotencyProblem";

/// The served document, checked to be a valid OpenAPI 3.1 document whose references all
/// resolve.
async fn spec(server: &ReferenceServer) -> Value {
    let reply = get(server, "/openapi.json").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let text = std::str::from_utf8(&reply.body).unwrap();
    let parsed = oas3::from_json(text).unwrap_or_else(|error| panic!("not OpenAPI: {error}"));
    let version = parsed.validate_version().unwrap();
    assert_eq!((version.major, version.minor), (3, 1));
    for (path, method, operation) in parsed.operations() {
        let mut bodies: Vec<_> = operation
            .request_body
            .iter()
            .map(|body| body.resolve(&parsed).unwrap().content)
            .collect();
        for response in operation
            .responses
            .iter()
            .flat_map(|responses| responses.values())
        {
            bodies.push(response.resolve(&parsed).unwrap().content);
        }
        for content in bodies.iter().flat_map(|content| content.values()) {
            content
                .schema(&parsed)
                .unwrap_or_else(|error| panic!("{method} {path}: {error}"));
        }
    }
    reply.json()
}

fn operation<'a>(spec: &'a Value, method: &str, path: &str) -> &'a Value {
    let operation = &spec["paths"][path][method];
    assert!(operation.is_object(), "{method} {path} is not documented");
    operation
}

fn key_parameter(operation: &Value) -> Option<&Value> {
    operation["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|parameter| parameter["name"] == "Idempotency-Key")
}

#[actix_web::test]
async fn the_spec_documents_every_route_and_the_idempotency_contract() {
    let server = ReferenceServer::start(&[]);
    let spec = spec(&server).await;

    let documented: usize = spec["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|item| item.as_object().unwrap().len())
        .sum();
    assert_eq!(documented, ROUTES.len(), "exactly the routes of §11");

    for (method, path, protection) in ROUTES {
        let operation = operation(&spec, method, path);
        let Some(required) = protection else {
            assert!(
                key_parameter(operation).is_none(),
                "{method} {path} is not protected"
            );
            continue;
        };
        let key = key_parameter(operation).unwrap_or_else(|| panic!("{method} {path}: no key"));
        assert_eq!(key["in"], "header");
        assert_eq!(key["required"], required, "{method} {path}");
        assert_eq!(key["schema"]["type"], "string");
        // The longest value that holds a key of 255 characters: quoted, every one escaped.
        assert_eq!(key["schema"]["maxLength"], 512);
        assert_eq!(key["schema"]["minLength"], 1);
        assert_eq!(key["schema"]["pattern"], idempotency_actix::KEY_PATTERN);

        let responses = operation["responses"].as_object().unwrap();
        for status in ["400", "409", "413", "422", "500", "503"] {
            let problem = &responses[status]["content"]["application/problem+json"];
            assert_eq!(
                problem["schema"]["$ref"], PROBLEM_REF,
                "{method} {path} {status}"
            );
        }
        for status in ["409", "503"] {
            let retry_after = &responses[status]["headers"]["Retry-After"];
            assert_eq!(
                retry_after["schema"]["type"], "integer",
                "{method} {path} {status}"
            );
        }
        let success = responses
            .iter()
            .find(|(status, _)| status.starts_with('2'))
            .map(|(_, response)| response)
            .unwrap();
        assert_eq!(
            success["headers"]["Idempotent-Replayed"]["schema"]["enum"],
            json!(["true"]),
            "{method} {path}"
        );
    }

    let problem = &spec["components"]["schemas"]["IdempotencyProblem"];
    assert_eq!(
        problem["required"],
        json!(["type", "title", "status", "detail"])
    );
}

/// A keyless body over Actix's JSON limit is refused by Actix's extractor, as plain text,
/// and a keyed one over the middleware's limit with a problem: the spec documents both.
#[actix_web::test]
async fn a_body_over_the_limit_is_the_413_the_spec_documents() {
    let server = ReferenceServer::start(&[]);
    let spec = spec(&server).await;
    let huge = json!({ "item": "x".repeat(3 * 1024 * 1024), "qty": 1 });
    // (`/payments` requires a key: a keyless body never reaches its extractor.)
    for (path, key, content_type) in [
        ("/orders", None, "text/plain; charset=utf-8"),
        (
            "/orders",
            Some("over-the-limit"),
            "application/problem+json",
        ),
        (
            "/payments",
            Some("over-the-limit"),
            "application/problem+json",
        ),
    ] {
        let documented = operation(&spec, "post", path)["responses"]["413"]["content"]
            .as_object()
            .unwrap();
        let reply = post_json(&server, path, key, &huge).await;
        assert_eq!(
            reply.status,
            StatusCode::PAYLOAD_TOO_LARGE,
            "{path} {key:?}"
        );
        let answered = reply.header("content-type").unwrap();
        assert_eq!(answered, content_type, "{path} {key:?}");
        let media_type = answered.split(';').next().unwrap();
        assert!(
            documented.contains_key(media_type),
            "{path} {key:?}: {media_type} is not in {documented:?}"
        );
    }
}

/// A query out of range is refused by the handler with 400 in plain text, as the spec
/// documents it (and as Actix's extractors refuse a malformed one): never a body without a
/// `Content-Type`, which leaves a client, or a schema-driven fuzzer, to guess.
#[actix_web::test]
async fn the_handlers_own_400s_are_the_plain_text_the_spec_documents() {
    let server = ReferenceServer::start(&[]);
    let spec = spec(&server).await;
    let order = json!({"item": "book", "qty": 1});
    for (path, key) in [
        ("/orders?delay_ms=60001", None),
        ("/orders?delay_ms=60001", Some("\"delay-out-of-range\"")),
        ("/large?bytes=67108865", None),
        ("/flaky?status=1000", None),
        ("/flaky?status=99", Some("\"status-out-of-range\"")),
    ] {
        let reply = post_json(&server, path, key, &order).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{path} {key:?}");
        assert_eq!(
            reply.header("content-type"),
            Some("text/plain; charset=utf-8"),
            "{path} {key:?}: {:?}",
            reply.body
        );
        let route = path.split('?').next().unwrap();
        let documented = operation(&spec, "post", route)["responses"]["400"]["content"]
            .as_object()
            .unwrap();
        assert!(
            documented.contains_key("text/plain"),
            "{route}: {documented:?}"
        );
    }
    assert_eq!(
        get(&server, "/stats").await.json(),
        json!({"orders": 0, "payments": 0, "flaky": 0, "profile": 0, "large": 0, "untagged": 0}),
        "refused before the handlers counted a run"
    );
}

#[actix_web::test]
async fn the_documented_shapes_are_the_real_ones() {
    let server = ReferenceServer::start(&[]);
    let spec = spec(&server).await;
    let schema = |name: &str| spec["components"]["schemas"][name].clone();
    let properties = |schema: &Value| {
        let mut names: Vec<String> = schema["properties"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    };
    let keys = |value: &Value| {
        let mut names: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
        names.sort();
        names
    };

    let orders = operation(&spec, "post", "/orders");
    assert_eq!(
        orders["requestBody"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/NewOrder"
    );
    assert_eq!(properties(&schema("NewOrder")), ["item", "qty"]);
    let created = &orders["responses"]["201"];
    assert_eq!(
        created["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/Order"
    );
    assert!(created["headers"]["Location"].is_object());
    let key = format!("\"{}\"", uuid::Uuid::new_v4());
    let order = post_json(
        &server,
        "/orders",
        Some(&key),
        &json!({"item": "book", "qty": 1}),
    )
    .await;
    assert_eq!(order.status, StatusCode::CREATED);
    assert_eq!(keys(&order.json()), properties(&schema("Order")));

    let payment = post_json(&server, "/payments", None, &json!({})).await;
    assert_eq!(payment.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        payment.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(keys(&payment.json()), ["detail", "status", "title", "type"]);
    let key = format!("\"{}\"", uuid::Uuid::new_v4());
    let payment = post_json(&server, "/payments", Some(&key), &json!({"any": ["json"]})).await;
    assert_eq!(payment.status, StatusCode::OK);
    assert_eq!(keys(&payment.json()), properties(&schema("Payment")));

    let stats = get(&server, "/stats").await;
    let documented = &operation(&spec, "get", "/stats")["responses"]["200"];
    assert_eq!(
        documented["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/Stats"
    );
    assert_eq!(keys(&stats.json()), properties(&schema("Stats")));
}

#[actix_web::test]
async fn untagged_routes_are_documented_as_protected_when_their_method_is() {
    let server = ReferenceServer::start(&[("IDEMPOTENCY_METHODS", "POST")]);
    let spec = spec(&server).await;
    let key = key_parameter(operation(&spec, "post", "/untagged")).unwrap();
    assert_eq!(key["required"], false);

    let baseline = ReferenceServer::start(&[("IDEMPOTENCY", "off")]);
    let spec = self::spec(&baseline).await;
    assert!(key_parameter(operation(&spec, "post", "/orders")).is_none());
}

#[actix_web::test]
async fn metrics_are_served_in_the_prometheus_text_format() {
    let server = ReferenceServer::start(&[]);
    let key = format!("\"{}\"", uuid::Uuid::new_v4());
    let order = json!({"item": "lamp", "qty": 2});
    assert_eq!(
        post_json(&server, "/orders", Some(&key), &order)
            .await
            .status,
        201
    );
    assert!(
        post_json(&server, "/orders", Some(&key), &order)
            .await
            .is_replay()
    );
    let reused = post_json(
        &server,
        "/orders",
        Some(&key),
        &json!({"item": "x", "qty": 1}),
    )
    .await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);

    let reply = get(&server, "/metrics").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(
        reply
            .header("content-type")
            .unwrap()
            .starts_with("text/plain")
    );
    let text = std::str::from_utf8(&reply.body).unwrap();
    for line in [
        "# TYPE idempotency_requests_total counter",
        "idempotency_requests_total{route=\"/orders\",outcome=\"executed\"} 1",
        "idempotency_requests_total{route=\"/orders\",outcome=\"replayed\"} 1",
        "idempotency_requests_total{route=\"/orders\",outcome=\"mismatch\"} 1",
        "# TYPE idempotency_store_operation_duration_seconds histogram",
        "idempotency_store_operation_duration_seconds_count{operation=\"begin\",result=\"ok\"} 3",
        "idempotency_store_operation_duration_seconds_count{operation=\"commit\",result=\"ok\"} 1",
        "idempotency_requests_in_flight{route=\"/orders\"} 0",
    ] {
        assert!(
            text.lines().any(|found| found == line),
            "no {line:?} in:\n{text}"
        );
    }
    assert!(
        !text.contains(&key[1..37]),
        "the key never reaches the metrics"
    );
}

#[actix_web::test]
async fn the_ledger_routes_are_documented_with_a_database() {
    let database = idempotency_actix_tests::TestDatabase::create().await;
    let server = ReferenceServer::start(&[("DATABASE_URL", database.url())]);
    let spec = spec(&server).await;
    let create = operation(&spec, "post", "/ledger");
    assert_eq!(key_parameter(create).unwrap()["required"], false);
    assert_eq!(
        create["requestBody"]["content"]["application/json"]["schema"]["$ref"],
        "#/components/schemas/NewEntry"
    );
    let rows = operation(&spec, "get", "/ledger");
    assert!(key_parameter(rows).is_none());

    let key = format!("\"{}\"", uuid::Uuid::new_v4());
    let entry = post_json(&server, "/ledger", Some(&key), &json!({"amount": 5})).await;
    assert_eq!(entry.status, StatusCode::CREATED);
    let schema = &spec["components"]["schemas"]["LedgerEntry"]["properties"];
    let mut documented: Vec<&String> = schema.as_object().unwrap().keys().collect();
    documented.sort();
    let answer = entry.json();
    let mut answered: Vec<&String> = answer.as_object().unwrap().keys().collect();
    answered.sort();
    assert_eq!(answered, documented);

    let without = ReferenceServer::start(&[]);
    let spec = self::spec(&without).await;
    assert!(spec["paths"]["/ledger"].is_null(), "404 without a database");
}
