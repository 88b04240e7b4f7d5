//! The store's table: its name as configured (checked to be plain identifiers), and the
//! table it resolves to in the database, found once and then named schema-qualified in
//! every statement and in the keys' advisory locks.
//!
//! An unqualified name is looked up through `search_path` once, when [`migrate`] runs (or,
//! without it, before the store's first statement), and the statements name the table with
//! its schema from then on: a handler of a transactional route that sets `search_path` in
//! the transaction it shares with the store (`SET LOCAL`), or for its session (`SET`, which
//! a pooled connection keeps), no longer makes the store's later statements miss the table
//! or hit another one of that name. The locks are named after the table's schema and name,
//! so instances that spell one table differently (`records` and `public.records`) exclude
//! each other's transactional claims.
//!
//! [`migrate`]: super::PostgresStore::migrate

use std::sync::OnceLock;

use tokio_postgres::types::{ToSql, Type};

use super::Statements;
use crate::store::StoreError;

/// A table name that is not a plain SQL identifier (or `schema.table` of two).
///
/// # Examples
///
/// ```
/// use idempotency_actix::{PostgresStore, TableNameError};
///
/// # #[actix_web::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::new(PostgresStore::pool("postgres://app@127.0.0.1/app")?);
/// let refused = store.table("records; DROP TABLE users").err().ok_or("accepted")?;
/// assert_eq!(refused, TableNameError("records; DROP TABLE users".to_owned()));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a table name: use letters, digits and underscores (not first), at most 63 \
     bytes, optionally qualified by a schema (`schema.table`)"
)]
pub struct TableNameError(pub String);

/// Whether `name` is an identifier that needs no quoting care: `[A-Za-z_][A-Za-z0-9_]*`,
/// at most 63 bytes (PostgreSQL's limit).
fn is_identifier(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z' | b'A'..=b'Z' | b'_'))
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && name.len() <= 63
}

/// `name` as a quoted SQL identifier, taken as written (case included); a schema found in
/// the catalog can hold any character, a quote doubled.
pub(super) fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The table of a store, shared by its clones: the name as configured, and the statements
/// of the table it resolves to once known.
pub(super) struct Table {
    /// The name as configured, for `Debug`.
    pub(super) configured: String,
    /// The schema, when the name gives one.
    schema: Option<String>,
    /// The table's own name.
    name: String,
    /// The name quoted as configured.
    quoted: String,
    /// The statements of the table the name resolved to.
    resolved: OnceLock<Statements>,
}

/// Where a configured name leads in one session: the table's schema and name (where it
/// exists; otherwise where `CREATE TABLE` would put it) and whether it exists.
pub(super) struct Resolution {
    /// `None` when the name has no schema and `search_path` names none that exists.
    pub(super) schema: Option<String>,
    pub(super) name: String,
    pub(super) exists: bool,
    /// The session's `transaction_isolation`.
    pub(super) isolation: String,
}

/// $1 the configured name quoted, $2 its schema (or NULL), $3 its table name. One row: the
/// schema and name of the table the name leads to (the first schema of `search_path` that
/// exists, for an unqualified name of no table: where `CREATE TABLE` creates it), whether
/// it exists, and the session's isolation (outside a transaction: its default). Reads the
/// catalogs only, which any role may.
pub(super) const RESOLVE: &str =
    "SELECT coalesce(n.nspname::text, $2, current_schema()::text), coalesce(c.relname::text, $3),
            c.oid IS NOT NULL, current_setting('transaction_isolation')
     FROM (SELECT to_regclass($1) AS oid) found
     LEFT JOIN pg_class c ON c.oid = found.oid
     LEFT JOIN pg_namespace n ON n.oid = c.relnamespace";

impl Table {
    /// The table `configured` names (`table` or `schema.table`), unresolved.
    pub(super) fn new(configured: &str) -> Result<Self, TableNameError> {
        let parts: Vec<&str> = configured.split('.').collect();
        if parts.len() > 2 || !parts.iter().all(|part| is_identifier(part)) {
            return Err(TableNameError(configured.to_owned()));
        }
        let (schema, name) = match parts.as_slice() {
            [schema, name] => (Some((*schema).to_owned()), (*name).to_owned()),
            _ => (None, configured.to_owned()),
        };
        let quoted = parts
            .iter()
            .map(|part| quote_identifier(part))
            .collect::<Vec<_>>()
            .join(".");
        Ok(Self {
            configured: configured.to_owned(),
            schema,
            name,
            quoted,
            resolved: OnceLock::new(),
        })
    }

    /// The parameters of [`RESOLVE`]: the name quoted as configured (as `to_regclass`
    /// takes it), its schema and its table name.
    pub(super) fn resolve_params(&self) -> [(&(dyn ToSql + Sync), Type); 3] {
        [
            (&self.quoted, Type::TEXT),
            (&self.schema, Type::TEXT),
            (&self.name, Type::TEXT),
        ]
    }

    /// The statements, once resolved.
    pub(super) fn statements(&self) -> Option<&Statements> {
        self.resolved.get()
    }

    /// Keeps `statements` as the table's (unless another caller resolved it first) and
    /// answers the table's.
    pub(super) fn settle(&self, statements: Statements) -> &Statements {
        self.resolved.get_or_init(|| statements)
    }
}

impl Resolution {
    /// Reads a row of [`RESOLVE`].
    pub(super) fn read(row: &tokio_postgres::Row) -> Result<Self, StoreError> {
        let unreadable = |error: tokio_postgres::Error| StoreError::Protocol(error.to_string());
        Ok(Self {
            schema: row.try_get(0).map_err(unreadable)?,
            name: row.try_get(1).map_err(unreadable)?,
            exists: row.try_get(2).map_err(unreadable)?,
            isolation: row.try_get(3).map_err(unreadable)?,
        })
    }

    /// The statements of the resolved table; `configured` names it in the error when no
    /// schema can hold it.
    pub(super) fn statements(&self, configured: &str) -> Result<Statements, StoreError> {
        let schema = self.schema.as_deref().ok_or_else(|| {
            StoreError::Unavailable(
                format!(
                    "the table {configured:?} names no schema and search_path names none that \
                     exists"
                )
                .into(),
            )
        })?;
        Ok(Statements::new(schema, &self.name))
    }
}

/// The namespace of a table's advisory locks: its schema and name, the schema left out when
/// it is `public`. Earlier releases took the name as configured: the locks of a table in
/// `public` configured without a schema (the default table, as most are) stay as they were,
/// so a rolling deploy mixes no two locks for it.
pub(super) fn lock_namespace(schema: &str, name: &str) -> String {
    if schema == "public" {
        name.to_owned()
    } else {
        format!("{schema}.{name}")
    }
}
