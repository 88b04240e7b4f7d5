//! The routes of the reference app that exist only with `DATABASE_URL`: `POST /ledger`, a
//! transactional route that inserts one row into table `ledger` through the request's
//! transaction, and `GET /ledger`, the number of committed rows. `X-Crash` makes the process
//! abort at a chosen point, for the crash tests.

use std::sync::atomic::{AtomicU64, Ordering};

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::http::header::HeaderMap;
use actix_web::middleware::Next;
use actix_web::{HttpResponse, web};
use idempotency_actix::PostgresPool;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::plain_text;

/// The table the ledger routes write, created at start if missing.
pub const LEDGER_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS ledger (
    entry_id   bigserial   PRIMARY KEY,
    amount     bigint      NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)";

/// The request header that makes `POST /ledger` abort the process (a header, so a retry
/// without it has the same fingerprint).
pub const CRASH_HEADER: &str = "x-crash";

/// The body of `POST /ledger`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NewEntry {
    /// The amount to book.
    pub amount: i64,
}

/// The answer of `POST /ledger` (fields in the order they are sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LedgerEntry {
    /// The amount booked.
    pub amount: i64,
    /// The inserted row's id.
    pub entry_id: i64,
    /// How many times the handler ran in this process, this run included.
    pub seq: u64,
}

/// The answer of `GET /ledger`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LedgerRows {
    /// The committed rows of table `ledger`.
    pub rows: i64,
}

/// How many times the `POST /ledger` handler ran in this process: its `seq`.
#[derive(Debug, Default)]
pub struct LedgerRuns(AtomicU64);

/// Where `X-Crash` aborts the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CrashPoint {
    /// After the handler's insert, before the transaction commits.
    BeforeCommit,
    /// After the commit, before the response is written.
    AfterCommit,
}

fn crash_point(headers: &HeaderMap) -> Option<CrashPoint> {
    match headers.get(CRASH_HEADER)?.as_bytes() {
        b"before_commit" => Some(CrashPoint::BeforeCommit),
        b"after_commit" => Some(CrashPoint::AfterCommit),
        _ => None,
    }
}

/// Serializes [`create_ledger`] across instances: `CREATE TABLE IF NOT EXISTS` run by two
/// at once can still collide (one fails on the catalog's unique index).
const LEDGER_LOCK: i64 = 7_291_604_383_712_561_408;

/// Creates the `ledger` table if it is missing, on a connection of its own: a pool that
/// cannot connect says only that it timed out, where a connection says why. Safe to run
/// from several instances at once (under an advisory lock, READ COMMITTED so that the check
/// after the lock sees what the instance before did).
///
/// # Errors
///
/// When the database cannot be reached within 2 s, or refuses (with the server's words).
pub(super) async fn create_ledger(pool: &PostgresPool) -> Result<(), String> {
    let connection = actix_web::rt::time::timeout(
        std::time::Duration::from_secs(2),
        pool.dedicated_connection(),
    )
    .await
    .map_err(|_| "no connection within 2 s".to_owned())?
    .map_err(|error| with_causes(&error))?;
    connection
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock({LEDGER_LOCK}); \
             {LEDGER_SCHEMA}; COMMIT"
        ))
        .await
        .map_err(|error| with_causes(&error))
}

/// `error` and its sources, `: `-separated (tokio-postgres keeps the server's words in the
/// source of a "db error").
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message = format!("{message}: {cause}");
        source = cause.source();
    }
    message
}

/// Inserts the entry through `client` (inside a transaction) and answers 201; aborts the
/// process right after the insert when the request asks for `X-Crash: before_commit`.
async fn book(
    client: &tokio_postgres::Client,
    runs: &LedgerRuns,
    headers: &HeaderMap,
    entry: NewEntry,
) -> HttpResponse {
    let seq = runs.0.fetch_add(1, Ordering::SeqCst) + 1;
    let inserted = client
        .query_one(
            "INSERT INTO ledger (amount) VALUES ($1) RETURNING entry_id",
            &[&entry.amount],
        )
        .await;
    let entry_id: i64 = match inserted {
        Ok(row) => row.get(0),
        Err(error) => {
            return plain_text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("insert failed: {error}"),
            );
        }
    };
    if crash_point(headers) == Some(CrashPoint::BeforeCommit) {
        eprintln!("reference_server: X-Crash: before_commit; aborting");
        std::process::abort();
    }
    HttpResponse::Created().json(LedgerEntry {
        amount: entry.amount,
        entry_id,
        seq,
    })
}

/// `X-Crash: after_commit`: aborts once the response has passed the idempotency layer
/// inside (which committed it) and before it is written. Registered as the route's own
/// `wrap`, outside the idempotency layer.
pub(super) async fn crash_after_commit(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let crash = crash_point(req.headers()) == Some(CrashPoint::AfterCommit);
    let response = next.call(req).await?;
    if crash {
        eprintln!("reference_server: X-Crash: after_commit; aborting");
        std::process::abort();
    }
    Ok(response)
}

/// `GET /ledger`: the number of committed rows.
#[utoipa::path(
    get,
    path = "/ledger",
    tag = "reference",
    responses(
        (status = 200, description = "The committed rows.", body = LedgerRows),
        (status = 503, description = "The database cannot be reached.", body = String, content_type = "text/plain"),
    ),
)]
pub(super) async fn count_rows(pool: web::Data<PostgresPool>) -> HttpResponse {
    let counted = async {
        let connection = pool.get().await.map_err(|error| error.to_string())?;
        let row = connection
            .query_one("SELECT count(*) FROM ledger", &[])
            .await
            .map_err(|error| error.to_string())?;
        Ok::<i64, String>(row.get(0))
    };
    match counted.await {
        Ok(rows) => HttpResponse::Ok().json(LedgerRows { rows }),
        Err(error) => plain_text(StatusCode::SERVICE_UNAVAILABLE, error),
    }
}

/// The ledger routes under `Idempotency::postgres`: `POST /ledger` is transactional.
pub(super) fn protected(config: &mut web::ServiceConfig) {
    config
        .service(tagged::create_entry)
        .route("/ledger", web::get().to(count_rows));
}

/// The same routes without any idempotency (`IDEMPOTENCY=off`): the handler opens, and
/// commits, a transaction of its own, so the baseline does the same database work.
pub(super) fn unprotected(config: &mut web::ServiceConfig) {
    config.service(
        web::resource("/ledger")
            .wrap(actix_web::middleware::from_fn(crash_after_commit))
            .route(web::post().to(create_entry_unprotected))
            .route(web::get().to(count_rows)),
    );
}

pub(super) mod tagged {
    use actix_web::{HttpRequest, HttpResponse, post, web};
    use idempotency_actix::{IdempotentTransaction, idempotent};

    use super::{LedgerEntry, LedgerRuns, NewEntry, book};

    /// Books an entry in the request's transaction. (`X-Crash`, a crash-test hook that
    /// aborts the process, is left out of the spec on purpose.)
    #[idempotent(transactional)]
    #[utoipa::path(
        post,
        path = "/ledger",
        tag = "reference",
        request_body = NewEntry,
        responses(
            (status = 201, description = "Booked.", body = LedgerEntry),
            (status = 400, description = "The body is not an entry.", body = String, content_type = "text/plain"),
            (status = 413, description = "A body over Actix's JSON limit (2 MiB) without a key; with a key, over the middleware's limit (1 MiB), a problem.", body = String, content_type = "text/plain"),
            (status = 500, description = "The insert failed.", body = String, content_type = "text/plain"),
        ),
    )]
    #[post(
        "/ledger",
        wrap = "actix_web::middleware::from_fn(super::crash_after_commit)"
    )]
    pub(crate) async fn create_entry(
        transaction: IdempotentTransaction,
        runs: web::Data<LedgerRuns>,
        req: HttpRequest,
        entry: web::Json<NewEntry>,
    ) -> HttpResponse {
        book(&transaction, &runs, req.headers(), entry.into_inner()).await
    }
}

async fn create_entry_unprotected(
    pool: web::Data<PostgresPool>,
    runs: web::Data<LedgerRuns>,
    req: actix_web::HttpRequest,
    entry: web::Json<NewEntry>,
) -> HttpResponse {
    let connection = match pool.get().await {
        Ok(connection) => connection,
        Err(error) => return plain_text(StatusCode::SERVICE_UNAVAILABLE, error.to_string()),
    };
    if let Err(error) = connection.batch_execute("BEGIN").await {
        return plain_text(StatusCode::SERVICE_UNAVAILABLE, error.to_string());
    }
    let response = book(&connection, &runs, req.headers(), entry.into_inner()).await;
    let end = if response.status().is_success() {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    match connection.batch_execute(end).await {
        Ok(()) => response,
        Err(error) => plain_text(StatusCode::SERVICE_UNAVAILABLE, error.to_string()),
    }
}
