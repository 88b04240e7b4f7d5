//! [`PostgresStore`]: durable records, one row each, in a PostgreSQL table reached through a
//! bb8 pool of tokio-postgres connections; and the transactions of transactional routes.

use std::sync::Arc;
use std::time::Duration;

use bb8_postgres::PostgresConnectionManager;
use futures_util::future::Either;
use tokio_postgres::error::Severity;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{NoTls, Row};

use super::not_sent::unsent_by_the_deadline;
use super::{BeginOutcome, Deletion, IdempotencyStore, LeaseToken, RecordSnapshot, StoreError};
use crate::fingerprint::Fingerprint;
use crate::lost_record;
use crate::record::{RECORD_VERSION, StoredResponse};
use crate::scope::StorageKey;

mod client_config;
mod error;
mod isolation;
mod key_prefix;
mod renewals;
mod serialization;
mod table;

use error::{PostgresError, no_connection, shared_unavailable, unavailable};
use isolation::Isolation;
use renewals::{RenewalConnections, RenewalFailure, renewal_params};
use serialization::{again_while_unserializable, failed_to_serialize};
use table::{Resolution, Table, quote_identifier};

pub use table::TableNameError;

/// The pool type [`PostgresStore::new`] takes: bb8 over bb8-postgres, without TLS.
///
/// # Examples
///
/// ```
/// use bb8_postgres::PostgresConnectionManager;
/// use bb8_postgres::tokio_postgres::NoTls;
/// use idempotency_actix::{PostgresPool, PostgresStore};
///
/// # #[actix_web::main]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The usual way, with the store's settings; no connection is made yet:
/// let pool: PostgresPool = PostgresStore::pool("postgres://app@127.0.0.1/app")?;
/// // A pool of the app's own, larger for transactional routes:
/// let manager = PostgresConnectionManager::new_from_stringlike("host=127.0.0.1 user=app", NoTls)?;
/// let own: PostgresPool = bb8::Pool::builder().max_size(64).build_unchecked(manager);
/// let store = PostgresStore::new(own);
/// # Ok(())
/// # }
/// ```
pub type PostgresPool = bb8::Pool<PostgresConnectionManager<NoTls>>;

/// A connection taken from the pool for a whole request (a transactional route's
/// transaction).
pub(crate) type PostgresConnection =
    bb8::PooledConnection<'static, PostgresConnectionManager<NoTls>>;

/// The table [`PostgresStore::new`] uses unless [`PostgresStore::table`] names another.
///
/// # Examples
///
/// ```
/// use idempotency_actix::DEFAULT_TABLE;
///
/// assert_eq!(DEFAULT_TABLE, "idempotency_records");
/// ```
pub const DEFAULT_TABLE: &str = "idempotency_records";

/// How many expired rows one statement of [`PostgresStore::delete_expired`] deletes at
/// most, so the reaper never holds many row locks or writes a long transaction.
///
/// # Examples
///
/// ```
/// use idempotency_actix::EXPIRY_BATCH;
///
/// assert_eq!(EXPIRY_BATCH, 1_000);
/// ```
pub const EXPIRY_BATCH: i64 = 1_000;

/// Records in PostgreSQL: durable across restarts and failovers, in the database the app
/// already runs, and the store of [transactional routes](crate::IdempotentTransaction).
///
/// One row per record in one table (created by [`migrate`](Self::migrate)): `key` (the
/// storage key, primary key), `fingerprint` (32 bytes), `token` (the lease token of the
/// request that ran; for a marker, the abandoned tokens it remembers, separated by spaces),
/// `state` (`i` in flight, `c` completed, `a` the marker of abandoned tokens, see
/// [`IdempotencyStore::abandon`]), `version` (the record format),
/// `expires_at` (the lease while in flight, the TTL once completed; the database's clock
/// decides) and `response` (the encoded [`StoredResponse`]; for an in-flight row that took
/// the key over a marker, that marker, which its release puts back: see
/// [`IdempotencyStore::release`]). A row whose `expires_at` has
/// passed counts as absent: `begin` takes it over, and
/// [`delete_expired`](Self::delete_expired) deletes such rows in bounded batches off the
/// request path.
///
/// Round trips: `begin`, `commit`, `renew`, `release` and `abandon` are one statement each (`begin` is
/// one `INSERT … ON CONFLICT … DO UPDATE … WHERE <expired or ours>` that returns the row it
/// did not take), so a new key costs two round trips and a replay one. Only a commit that
/// finds its lease lost sends a second statement, which writes the completed row where the
/// key is free (see [`IdempotencyStore::commit`]; sent again a few times within 150 ms while
/// another statement holds the key's advisory lock). Statements are sent with their
/// parameter types (no separate prepare round trip). Where the sessions run `repeatable
/// read` or `serializable` (`default_transaction_isolation`), `begin` reads the record only
/// where it did not take the key, and a transactional route's completion updates its row by
/// `ctid`, so that transactions of different keys do not fail to serialize over the index
/// pages they share; under READ COMMITTED they keep the faster forms. The store reads the
/// isolation with its table, and follows a change it meets. `begin`, `abandon` and a
/// commit's rewrite of a lost record first try a transaction-scoped advisory lock on the key
/// without waiting: a transactional route holds it for the whole of its transaction, so a
/// duplicate never waits on that transaction's uncommitted row but reads the committed state
/// and answers at once (409 while in flight). The other statements change only a live row of
/// their own token, which a claim never holds, so they never wait on one either.
///
/// Lease renewals take no pooled connection: each thread that renews (each Actix worker)
/// opens one connection of the store's own for them with the pool's connection manager, on
/// first use and beyond the pool's `max_size`, and sends its renewals over it, pipelined, at
/// most one at a time per lease (a lease's renewal given up by the store timeout still
/// lands, and the next waits for its answer). So a pool saturated by `begin`s (a retry
/// storm, slow writes) does not keep renewals from the database until a lease lapses under
/// a running handler; while that connection opens (in the background) a renewal takes it or
/// a pooled connection, whichever comes first, and while it cannot be opened, a pooled one.
///
/// The pool built by [`PostgresStore::pool`] skips bb8's health check on checkout; a
/// connection that fails because the server went away is discarded and the statement retried
/// once on a live one, passing over the other closed connections the pool still holds (every
/// statement is safe to run twice); so are a transactional route's claim, the `BEGIN` of a
/// request without a key and the reaper's batch ([`delete_expired`](Self::delete_expired)).
///
/// # Examples
///
/// ```no_run
/// use actix_web::{App, HttpServer};
/// use idempotency_actix::{Idempotency, PostgresStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = PostgresStore::pool("postgres://postgres@127.0.0.1/app")?;
/// let store = PostgresStore::new(pool).table("idempotency_records")?;
/// store.migrate().await?;                               // once, at start
/// actix_web::rt::spawn(store.clone().expire_periodically(std::time::Duration::from_secs(60)));
/// HttpServer::new(move || App::new().wrap(Idempotency::postgres(store.clone())))
///     .bind("127.0.0.1:8080")?
///     .run()
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: PostgresPool,
    table: Arc<Table>,
    isolation: Arc<Isolation>,
    /// Where leases are renewed, outside the pool ([`renewals`]).
    renewals: Arc<RenewalConnections>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.table.configured)
            .finish_non_exhaustive()
    }
}

/// Whether `migrate` would change nothing for the table named by $1 (its schema and name,
/// quoted): the table is there, its check on the state allows 'a' (and none that refuses it
/// is left), and an index leads with `expires_at`. Only reads the catalogs, which any role
/// may.
const MIGRATED: &str = "SELECT EXISTS (SELECT 1 FROM pg_constraint
                        WHERE conrelid = to_regclass($1) AND contype = 'c'
                          AND pg_get_constraintdef(oid) LIKE '%state%'
                          AND pg_get_constraintdef(oid) LIKE '%''a''%')
            AND NOT EXISTS (SELECT 1 FROM pg_constraint
                            WHERE conrelid = to_regclass($1) AND contype = 'c'
                              AND pg_get_constraintdef(oid) LIKE '%state%'
                              AND pg_get_constraintdef(oid) NOT LIKE '%''a''%')
            AND EXISTS (SELECT 1 FROM pg_index i
                        JOIN pg_attribute a
                          ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                        WHERE i.indrelid = to_regclass($1)
                          AND a.attname = 'expires_at')";

/// The SQL of one table, built once the table's schema is known
/// ([`table`](self::table)).
struct Statements {
    /// The table's schema and name, the namespace of its keys' advisory locks.
    lock_namespace: String,
    /// The table as SQL: schema and name, each quoted.
    relation: String,
    migrate: String,
    begin: String,
    begin_strict: String,
    renew: String,
    commit: String,
    recreate: String,
    release: String,
    abandon: String,
    complete: String,
    complete_claimed_row: String,
    delete_expired: String,
    inspect: String,
    delete: String,
}

impl Statements {
    /// The statements of the table `name` in `schema` (as the catalog spells them), which
    /// name it schema-qualified, so that no `search_path` changes which table they use.
    fn new(schema: &str, name: &str) -> Self {
        let t = format!("{}.{}", quote_identifier(schema), quote_identifier(name));
        // The name inside a string literal, and a dollar quote that it does not contain, for
        // the body of the migration's `DO` block.
        let literal = t.replace('\'', "''");
        let mut tag = "$migrate$".to_owned();
        while t.contains(&tag) {
            tag.insert(1, '_');
        }
        // Whether no transaction holds the advisory lock whose id is parameter `$n`, looked
        // up in `pg_locks` rather than taken: taking it, however briefly, made a `begin` or
        // a transactional claim of the key at that moment answer 409.
        let lock_free = |n: u8| {
            format!(
                "SELECT NOT EXISTS (
                     SELECT 1 FROM pg_locks
                     WHERE locktype = 'advisory' AND granted AND objsubid = 1
                       AND database = (SELECT oid FROM pg_database
                                       WHERE datname = current_database())
                       AND classid = ((${n} >> 32) & 4294967295)::oid
                       AND objid = (${n} & 4294967295)::oid
                 ) AS held"
            )
        };
        let (lock_free_2, lock_free_3) = (lock_free(2), lock_free(3));
        let lock_timeout = MIGRATION_LOCK_TIMEOUT.as_millis();
        // An in-flight row written over another token's marker carries that marker in its
        // `response` (NULL in every other in-flight row, and read by no version for one):
        // the marker's expiry in milliseconds since the epoch, a space, its tokens. Its
        // release puts the marker back, its commit and abandon keep the marker's time.
        let carried_expiry = |response: &str| {
            format!(
                "to_timestamp(split_part(convert_from({response}, 'UTF8'), ' ', 1)::bigint / 1000.0)"
            )
        };
        let carried_tokens = |response: &str| {
            format!(
                "substr(convert_from({response}, 'UTF8'), strpos(convert_from({response}, 'UTF8'), ' ') + 1)"
            )
        };
        // The new expiry of a record completed from an in-flight row: its ttl, or the
        // marker's time where that is longer.
        let completed_expiry = format!(
            "greatest(clock_timestamp() + $4 * interval '1 millisecond',
                      CASE WHEN response IS NOT NULL THEN {} END)",
            carried_expiry("response")
        );
        // The lock and the claim of both `begin`s, the claim returning `returning` of the
        // row it acquired.
        let lock_and_claim = |returning: &str| {
            format!(
                "WITH lock AS MATERIALIZED (
                     SELECT pg_try_advisory_xact_lock($5) AS held
                 ), claimed AS (
                     INSERT INTO {t} AS r (key, fingerprint, token, state, version, expires_at)
                     SELECT $1, $2, $3, 'i', $6, clock_timestamp() + $4 * interval '1 millisecond'
                     FROM lock WHERE lock.held
                     ON CONFLICT (key) DO UPDATE
                     SET fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token, state = 'i',
                         version = EXCLUDED.version, expires_at = EXCLUDED.expires_at,
                         response = CASE
                             WHEN r.state = 'a' AND r.expires_at > clock_timestamp()
                             THEN convert_to((extract(epoch FROM r.expires_at) * 1000)::bigint
                                             || ' ' || r.token, 'UTF8')
                             WHEN r.state = 'i' AND r.token = EXCLUDED.token THEN r.response
                         END
                     WHERE r.expires_at <= clock_timestamp()
                        OR (r.state = 'i' AND r.token = EXCLUDED.token)
                        OR (r.state = 'a'
                            AND NOT EXCLUDED.token = ANY (string_to_array(r.token, ' ')))
                     RETURNING {returning}
                 )"
            )
        };
        // The completion of a transactional claim, of the in-flight row `row` picks out.
        let complete = |row: &str| {
            format!(
                "WITH done AS (
                     UPDATE {t} SET state = 'c', response = $3, expires_at = {completed_expiry}
                     WHERE {row} AND token = $2 AND state = 'i'
                     RETURNING 1
                 )
                 SELECT 1 / (SELECT count(*) FROM done)::int"
            )
        };
        Self {
            lock_namespace: table::lock_namespace(schema, name),
            relation: t.clone(),
            // Serialized by an advisory lock: `CREATE … IF NOT EXISTS` run by two instances
            // at once can still collide. READ COMMITTED whatever the sessions' default, so
            // that the checks after the lock see what the instance before did: under
            // REPEATABLE READ or SERIALIZABLE the transaction's snapshot, taken before the
            // lock, missed it, and each instance started at once added an expiry index.
            //
            // Each lock its DDL takes on the table is waited for at most
            // `MIGRATION_LOCK_TIMEOUT`: a table that exists is locked by every transaction that
            // wrote to it (a transactional route's running request), and every statement on
            // the table that comes after queues behind a DDL waiting for its lock. The lock
            // of another instance's migration is waited for as long as that one runs, which
            // is bounded by the same timeout and its DDL.
            migrate: format!(
                "BEGIN ISOLATION LEVEL READ COMMITTED;
                 SELECT pg_advisory_xact_lock(7291604383712561407);
                 SET LOCAL lock_timeout = {lock_timeout};
                 CREATE TABLE IF NOT EXISTS {t} (
                     key         text        PRIMARY KEY,
                     fingerprint bytea       NOT NULL,
                     token       text        NOT NULL,
                     state       \"char\"      NOT NULL CHECK (state IN ('i', 'c', 'a')),
                     version     smallint    NOT NULL,
                     expires_at  timestamptz NOT NULL,
                     response    bytea
                 );
                 DO {tag}
                 DECLARE old record;
                 BEGIN
                     -- Unless an index leads with `expires_at` (the one an earlier release
                     -- named `<table>_expires_at`, or one made by hand), one named by
                     -- PostgreSQL: a name made of the table's would be cut to 63 bytes, and
                     -- could be the table's own or another relation's, which `CREATE INDEX IF
                     -- NOT EXISTS` takes for the index and skips.
                     IF NOT EXISTS (SELECT 1 FROM pg_index i
                                    JOIN pg_attribute a
                                      ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                                    WHERE i.indrelid = '{literal}'::regclass
                                      AND a.attname = 'expires_at') THEN
                         CREATE INDEX ON {t} (expires_at);
                     END IF;
                     -- Tables of earlier 0.1 development builds allow only the states 'i' and 'c'; allow 'a' too.
                     FOR old IN SELECT conname FROM pg_constraint
                                WHERE conrelid = '{literal}'::regclass AND contype = 'c'
                                  AND pg_get_constraintdef(oid) LIKE '%state%'
                                  AND pg_get_constraintdef(oid) NOT LIKE '%''a''%'
                     LOOP
                         EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I',
                                        '{literal}'::regclass, old.conname);
                     END LOOP;
                     -- Their check, or the one a table made by hand lacks (the table then
                     -- counts as up to date, which a role that may not create anything needs
                     -- to call `migrate()` at start).
                     IF NOT EXISTS (SELECT 1 FROM pg_constraint
                                    WHERE conrelid = '{literal}'::regclass AND contype = 'c'
                                      AND pg_get_constraintdef(oid) LIKE '%state%'
                                      AND pg_get_constraintdef(oid) LIKE '%''a''%') THEN
                         ALTER TABLE {t} ADD CHECK (state IN ('i', 'c', 'a'));
                     END IF;
                 END {tag};
                 COMMIT;"
            ),
            // $1 key, $2 fingerprint, $3 token, $4 lease (ms), $5 lock id, $6 version.
            // One row always: whether the advisory lock was free, whether the record was
            // acquired (created, taken over from an expired row or another token's marker,
            // or already ours), and the live record otherwise. `claimed` sees the latest committed row (ON CONFLICT
            // waits for and re-reads it); the LEFT JOIN reads the statement's snapshot, which
            // can predate a row committed meanwhile: the caller then runs it again.
            begin: format!(
                "{}
                 SELECT lock.held, EXISTS (SELECT 1 FROM claimed) AS acquired,
                        r.state::text, r.fingerprint, r.response, r.token,
                        (extract(epoch FROM r.expires_at - clock_timestamp()) * 1000)::bigint
                 FROM lock LEFT JOIN {t} r
                   ON r.key = $1 AND r.expires_at > clock_timestamp()",
                lock_and_claim("1")
            ),
            // `begin` under a stricter isolation ([`isolation`]): the same parameters and
            // columns, then the acquired row's `ctid`, which a transactional claim's
            // completion updates, and the transaction's isolation. The live record is read
            // only when none was acquired (the `OFFSET 0` keeps the condition in front of
            // the scan): inside a SERIALIZABLE transaction a read of the key's index page is
            // a predicate lock on it, and the claims of other keys on that page made the
            // transaction fail to serialize at its commit.
            begin_strict: format!(
                "{}, taken AS MATERIALIZED (
                     SELECT (SELECT ctid::text FROM claimed) AS row
                 )
                 SELECT lock.held, taken.row IS NOT NULL,
                        r.state::text, r.fingerprint, r.response, r.token,
                        (extract(epoch FROM r.expires_at - clock_timestamp()) * 1000)::bigint,
                        taken.row, current_setting('transaction_isolation')
                 FROM lock CROSS JOIN taken LEFT JOIN LATERAL (
                     SELECT * FROM {t}
                     WHERE taken.row IS NULL AND key = $1 AND expires_at > clock_timestamp()
                     OFFSET 0
                 ) r ON true",
                lock_and_claim("ctid")
            ),
            // $1 key, $2 token, $3 lease (ms).
            renew: format!(
                "UPDATE {t} SET expires_at = clock_timestamp() + $3 * interval '1 millisecond'
                 WHERE key = $1 AND token = $2 AND state = 'i'
                   AND expires_at > clock_timestamp()
                 RETURNING true"
            ),
            // $1 key, $2 token, $3 response, $4 ttl (ms). True when this commit completed
            // the record or an earlier one with the same token did (idempotent). A record
            // that took the key over a marker is kept for the marker's time at least.
            commit: format!(
                "WITH done AS (
                     UPDATE {t} SET state = 'c', response = $3, expires_at = {completed_expiry}
                     WHERE key = $1 AND token = $2 AND state = 'i'
                       AND expires_at > clock_timestamp()
                     RETURNING 1
                 )
                 SELECT EXISTS (SELECT 1 FROM done)
                     OR EXISTS (SELECT 1 FROM {t} WHERE key = $1 AND token = $2 AND state = 'c'
                                AND expires_at > clock_timestamp())"
            ),
            // After a `commit` that answered false: $1 key, $2 token, $3 response, $4 ttl
            // (ms), $5 fingerprint, $6 lock id, $7 version. Writes the completed record where
            // the key is free: no row (it was deleted), an expired one (the in-flight row's
            // lease lapsed), or another token's marker (then kept for the marker's time at
            // least); true also when a resend finds it
            // completed by this token. Only under the key's advisory lock,
            // which a transactional claim holds; the second column says whether the lock was
            // free, so that a moment's holder is told from a key taken. A statement of its
            // own, so that the commit of every new key stays as short as it was (planned on
            // each run).
            recreate: format!(
                "WITH lock AS MATERIALIZED (
                     SELECT pg_try_advisory_xact_lock($6) AS held
                 ), anew AS (
                     INSERT INTO {t} AS r
                         (key, fingerprint, token, state, version, response, expires_at)
                     SELECT $1, $5, $2, 'c', $7, $3,
                            clock_timestamp() + $4 * interval '1 millisecond'
                     FROM lock WHERE lock.held
                     ON CONFLICT (key) DO UPDATE
                     SET fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token, state = 'c',
                         version = EXCLUDED.version, response = EXCLUDED.response,
                         expires_at = greatest(EXCLUDED.expires_at,
                             CASE WHEN r.state = 'a' AND r.expires_at > clock_timestamp()
                                  THEN r.expires_at END)
                     WHERE r.expires_at <= clock_timestamp()
                        OR (r.state = 'a'
                            AND NOT EXCLUDED.token = ANY (string_to_array(r.token, ' ')))
                     RETURNING 1
                 )
                 SELECT EXISTS (SELECT 1 FROM anew)
                     OR EXISTS (SELECT 1 FROM {t} WHERE key = $1 AND token = $2 AND state = 'c'
                                AND expires_at > clock_timestamp()),
                        lock.held
                 FROM lock"
            ),
            // $1 key, $2 token. An in-flight row that carries the marker it took the key over
            // becomes that marker again, until its expiry (one already passed is an expired
            // row, which counts as absent); any other is deleted.
            release: format!(
                "WITH marked AS (
                     UPDATE {t} SET state = 'a', fingerprint = ''::bytea,
                         token = {tokens}, expires_at = {expiry}, response = NULL
                     WHERE key = $1 AND token = $2 AND state = 'i'
                       AND expires_at > clock_timestamp() AND response IS NOT NULL
                     RETURNING true
                 ), deleted AS (
                     DELETE FROM {t}
                     WHERE key = $1 AND token = $2 AND state = 'i'
                       AND expires_at > clock_timestamp() AND response IS NULL
                     RETURNING true
                 )
                 SELECT * FROM marked UNION ALL SELECT * FROM deleted",
                tokens = carried_tokens("response"),
                expiry = carried_expiry("response"),
            ),
            // $1 key, $2 token, $3 remember_for (ms), $4 lock id, $5 version. True when the
            // marker of the token is written (in place of its in-flight row, of an expired
            // row or of nothing; a marker there takes the token too, keeping the 15 latest
            // before it; in place of its in-flight row that took the key over a marker, that
            // marker's tokens too, kept for the rest of its time at least) or a completed row
            // is there, which is then kept for at least `remember_for` (it stands for the
            // marker: a late `begin` of the token must find it for as long). False when
            // another token's in-flight row is there, or a
            // transaction holds the key's advisory lock (the caller tries again). The two
            // writes never meet: the upsert leaves a live completed row alone.
            abandon: format!(
                "WITH lock AS MATERIALIZED (
                     SELECT pg_try_advisory_xact_lock($4) AS held
                 ), marked AS (
                     INSERT INTO {t} AS r (key, fingerprint, token, state, version, expires_at)
                     SELECT $1, ''::bytea, $2, 'a', $5,
                            clock_timestamp() + $3 * interval '1 millisecond'
                     FROM lock WHERE lock.held
                     ON CONFLICT (key) DO UPDATE
                     SET fingerprint = EXCLUDED.fingerprint,
                         token = CASE WHEN r.state = 'a' AND r.expires_at > clock_timestamp()
                                      THEN right(r.token || ' ' || EXCLUDED.token, 527)
                                      WHEN r.state = 'i' AND r.response IS NOT NULL
                                      THEN right({tokens} || ' ' || EXCLUDED.token, 527)
                                      ELSE EXCLUDED.token END,
                         state = 'a', version = EXCLUDED.version,
                         expires_at = greatest(EXCLUDED.expires_at,
                             CASE WHEN r.state = 'i' AND r.response IS NOT NULL
                                  THEN {expiry} END),
                         response = NULL
                     WHERE r.expires_at <= clock_timestamp() OR r.state = 'a'
                        OR (r.state = 'i' AND r.token = EXCLUDED.token)
                     RETURNING 1
                 ), kept AS (
                     UPDATE {t}
                     SET expires_at = greatest(expires_at,
                                               clock_timestamp() + $3 * interval '1 millisecond')
                     WHERE key = $1 AND state = 'c' AND expires_at > clock_timestamp()
                       AND (SELECT held FROM lock)
                     RETURNING 1
                 )
                 SELECT EXISTS (SELECT 1 FROM marked) OR EXISTS (SELECT 1 FROM kept)",
                tokens = carried_tokens("r.response"),
                expiry = carried_expiry("r.response"),
            ),
            // The completion inside a transactional route's transaction: $1 key, $2 token,
            // $3 response, $4 ttl (ms). Divides by zero unless exactly our in-flight row was
            // completed, which aborts the transaction, so the COMMIT sent right behind it
            // rolls back instead of committing the handler's writes without their record.
            complete: complete("key = $1"),
            // The same, under a stricter isolation ([`isolation`]): $5 the claimed row's
            // `ctid`. The row is found by its `ctid` (no other statement changes it while the
            // claim holds it), not by the key's index: inside a SERIALIZABLE transaction that
            // read is a predicate lock on the index page, and the claims of other keys on
            // that page made the commit fail to serialize.
            complete_claimed_row: complete("ctid = $5::tid AND key = $1"),
            // Inspection: $1 key, $2 lock id. Whether the advisory lock was free (taken: a
            // transactional route's transaction is working on the key, its row not yet
            // committed; looked up, not taken), and the live row with its remaining time in
            // milliseconds.
            inspect: format!(
                "WITH lock AS MATERIALIZED ({lock_free_2})
                 SELECT lock.held, r.state::text, r.response,
                        (extract(epoch FROM r.expires_at - clock_timestamp()) * 1000)::bigint
                 FROM lock LEFT JOIN {t} r
                   ON r.key = $1 AND r.expires_at > clock_timestamp() AND r.state <> 'a'"
            ),
            // Deletion by hand: $1 key, $2 force, $3 lock id. Deletes the live row if it is
            // completed or `force`; answers whether the key's lock was free (looked up, not
            // taken: a transactional claim's row, not yet committed, is in flight), whether a
            // row was deleted, and the live row's state before the statement. An abandoned
            // token's marker is no record: left alone and not reported.
            delete: format!(
                "WITH lock AS MATERIALIZED ({lock_free_3}), deleted AS (
                     DELETE FROM {t}
                     WHERE key = $1 AND expires_at > clock_timestamp() AND state <> 'a'
                       AND (state = 'c' OR $2)
                     RETURNING 1
                 )
                 SELECT lock.held, EXISTS (SELECT 1 FROM deleted),
                        (SELECT state::text FROM {t}
                         WHERE key = $1 AND expires_at > clock_timestamp() AND state <> 'a')
                 FROM lock"
            ),
            // $1 batch size. Rows locked by a running statement or transaction are skipped.
            // `now()` (not the volatile `clock_timestamp()`) so the expiry index is used.
            // The keys as an array (found once, then through the primary key): as `key IN
            // (…)` the planner joined them to a sequential scan of the whole table.
            delete_expired: format!(
                "DELETE FROM {t} WHERE key = ANY (ARRAY(
                     SELECT key FROM {t} WHERE expires_at < now()
                     ORDER BY expires_at LIMIT $1
                     FOR UPDATE SKIP LOCKED
                 ))"
            ),
        }
    }

    /// The advisory lock of `key` in this table: 64 bits of a digest of the table's schema
    /// and name as the catalog has them ([`table::lock_namespace`]), however an instance
    /// spells the table, so keys of two tables (or of other users of advisory locks)
    /// practically never share one; a shared one would only make a request answer 409 while
    /// the other runs. The lock is not what keeps a key from running twice, the row's
    /// primary key is: a claim that missed another's lock waits for that transaction's row
    /// instead of answering 409 at once.
    fn lock_id(&self, key: &StorageKey) -> i64 {
        let mut hasher = blake3::Hasher::new_derive_key("idempotency-actix postgres lock v1");
        hasher.update(self.lock_namespace.as_bytes());
        hasher.update(&[0]);
        hasher.update(key.as_str().as_bytes());
        let digest = hasher.finalize();
        let mut id = [0; 8];
        id.copy_from_slice(&digest.as_bytes()[..8]);
        i64::from_le_bytes(id)
    }
}

impl PostgresStore {
    /// The longest key prefix, in bytes, this store takes
    /// ([`Idempotency::key_prefix`](crate::Idempotency::key_prefix) panics over it): its
    /// storage keys, the prefix and a 64-character digest, must fit an entry of the table's
    /// primary key index. For an app that reads its prefix from its configuration and
    /// checks it there.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::PostgresStore;
    ///
    /// let prefix = std::env::var("IDEMPOTENCY_PREFIX").unwrap_or_else(|_| "shop:".to_owned());
    /// assert!(prefix.len() <= PostgresStore::MAX_KEY_PREFIX_BYTES, "IDEMPOTENCY_PREFIX is too long");
    /// assert_eq!(PostgresStore::MAX_KEY_PREFIX_BYTES, 2628);
    /// ```
    pub const MAX_KEY_PREFIX_BYTES: usize = key_prefix::MAX_KEY_PREFIX_BYTES;

    /// Panics, saying why, unless this store can key records under `prefix` (see
    /// [`Idempotency::key_prefix`](crate::Idempotency::key_prefix)).
    pub(crate) fn check_key_prefix(&self, prefix: &str) {
        key_prefix::check_key_prefix(prefix);
    }

    /// A store on `pool`, in the table [`DEFAULT_TABLE`] (`idempotency_records`).
    ///
    /// # Examples
    ///
    /// ```
    /// use actix_web::App;
    /// use idempotency_actix::{Idempotency, PostgresStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::new(PostgresStore::pool("postgres://app@127.0.0.1/app")?);
    /// let app = App::new().wrap(Idempotency::postgres(store.clone()));
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(pool: PostgresPool) -> Self {
        let table = Table::new(DEFAULT_TABLE).unwrap_or_else(|_| unreachable!());
        Self {
            pool,
            table: Arc::new(table),
            isolation: Arc::default(),
            renewals: Arc::default(),
        }
    }

    /// The same store in the table `name` (`table` or `schema.table`). The name is quoted in
    /// SQL, so it is taken as written: `Records` is a table other than `records`, as in SQL
    /// that quotes it (`"Records"`), where unquoted SQL folds it to `records`.
    ///
    /// # Errors
    ///
    /// When `name` is not a plain identifier (letters, digits, underscores, not starting with
    /// a digit, at most 63 bytes), optionally qualified by one: nothing else reaches SQL.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::PostgresStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PostgresStore::pool("postgres://postgres@127.0.0.1/app")?;
    /// assert!(PostgresStore::new(pool.clone()).table("billing.idempotency").is_ok());
    /// assert!(PostgresStore::new(pool).table("records; DROP TABLE users").is_err());
    /// # Ok(())
    /// # }
    /// ```
    pub fn table(self, name: &str) -> Result<Self, TableNameError> {
        Ok(Self {
            pool: self.pool,
            table: Arc::new(Table::new(name)?),
            isolation: self.isolation,
            renewals: self.renewals,
        })
    }

    /// A pool for `url` (e.g. `postgres://user@host/db`, or `host=… user=…`) with the
    /// settings this store wants: no health check on checkout (a dead connection fails its
    /// statement and is replaced), 16 connections, a 2 s wait for one, no connection made
    /// until the first use, so an app starts while the database is still down, and, where
    /// `url` says nothing of them, TCP keepalives every 30 s (10 s apart once unanswered,
    /// three of them) and a 10 s `tcp_user_timeout` (Linux): a connection a NAT or firewall
    /// dropped without a word is closed within about a minute, or 10 s after a statement was
    /// sent on it, and replaced, instead of failing every statement sent on it (503) for up
    /// to two hours. A pool you build yourself gets them from its URL
    /// (`?keepalives_idle=30&keepalives_interval=10&keepalives_retries=3&tcp_user_timeout=10`,
    /// in seconds: tokio-postgres reads `tcp_user_timeout` so, where libpq reads
    /// milliseconds).
    ///
    /// Call it inside a Tokio runtime (an Actix system): each connection's I/O runs on the
    /// runtime that opened it. Without TLS. The store also opens one connection per worker
    /// for lease renewals, outside the pool. A transactional request holds a connection for
    /// its whole run: with more than a few of those at once, build a larger pool (README,
    /// "Size the pool for the transactions").
    ///
    /// # Errors
    ///
    /// When `url` is not a PostgreSQL connection string.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::PostgresStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PostgresStore::pool("postgres://app@127.0.0.1/app")?;
    /// assert_eq!(pool.state().connections, 0); // none until the first use
    /// assert!(PostgresStore::pool("postgres://app@127.0.0.1:port/app").is_err());
    /// # Ok(())
    /// # }
    /// ```
    pub fn pool(url: &str) -> Result<PostgresPool, tokio_postgres::Error> {
        let manager = PostgresConnectionManager::new(client_config::client_config(url)?, NoTls);
        Ok(bb8::Pool::builder()
            .max_size(16)
            .test_on_check_out(false)
            .connection_timeout(CONNECT_TIMEOUT)
            .build_unchecked(manager))
    }

    /// The pool this store uses.
    ///
    /// # Examples
    ///
    /// ```
    /// use idempotency_actix::PostgresStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::new(PostgresStore::pool("postgres://app@127.0.0.1/app")?);
    /// // The app's own queries can share it:
    /// let pool = store.connection_pool().clone();
    /// assert_eq!(pool.state().connections, 0);
    /// # Ok(())
    /// # }
    /// ```
    pub fn connection_pool(&self) -> &PostgresPool {
        &self.pool
    }

    /// Creates the table and its expiry index if they do not exist. Call it once when the
    /// app starts; safe to run from several instances at once.
    ///
    /// A table that is already up to date (created by `migrate`, or by hand as in the README)
    /// is left alone without any DDL, so an app whose role may only `SELECT`, `INSERT`,
    /// `UPDATE` and `DELETE` on it can call it too. Creating or updating the table takes the
    /// rights to do so.
    ///
    /// Updating a table that exists (one of an earlier release, or made by hand without the
    /// expiry index) locks it, and every transaction that wrote to it holds that lock off
    /// (a transactional request of an instance still running), while every statement on the
    /// table waits behind the migration: it waits at most 2 s for each lock, then fails,
    /// changing nothing, with an error that says so; run it again once that transaction has
    /// ended. Another instance's migration is waited for until it ends.
    ///
    /// It also finds the table's schema (for a name without one, where `search_path` leads:
    /// the table's, or where it creates it), which every statement of the store names from
    /// then on; without `migrate`, the store's first statement finds it.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached within 2 s ([`StoreError::Timeout`]) or refuses
    /// the connection (why is in the error: a database that does not exist, a refused
    /// login) or the statements, or when a lock on the table is held for more than 2 s (see
    /// above).
    ///
    /// # Examples
    ///
    /// Not run here: it needs a PostgreSQL server.
    ///
    /// ```no_run
    /// use actix_web::{App, HttpServer};
    /// use idempotency_actix::{Idempotency, PostgresStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::new(PostgresStore::pool("postgres://app@127.0.0.1/app")?);
    /// store.migrate().await?; // once, before serving
    /// HttpServer::new(move || App::new().wrap(Idempotency::postgres(store.clone())))
    ///     .bind("127.0.0.1:8080")?
    ///     .run()
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn migrate(&self) -> Result<(), StoreError> {
        // A connection of its own rather than the pool's: a pool that cannot connect tells
        // only that it timed out, where a connection tells why.
        let connecting = self.pool.dedicated_connection();
        let connection = actix_rt::time::timeout(CONNECT_TIMEOUT, connecting)
            .await
            .map_err(|_| StoreError::Timeout(CONNECT_TIMEOUT))?
            .map_err(|error| {
                // The server's own words are in the error's source ("db error" alone says
                // nothing), so they go into the message.
                let mut why = error.to_string();
                let mut source = std::error::Error::source(&error);
                while let Some(cause) = source {
                    why = format!("{why}: {cause}");
                    source = cause.source();
                }
                StoreError::Unavailable(why.into())
            })?;
        // Where the name leads on this connection, as it would on the pool's: the table's
        // schema, or where `CREATE TABLE` puts it.
        let row = connection
            .query_typed_one(table::RESOLVE, &self.table.resolve_params())
            .await
            .map_err(unavailable)?;
        let resolution = Resolution::read(&row)?;
        self.isolation.observe(&resolution.isolation);
        let sql = resolution.statements(&self.table.configured)?;
        // `CREATE TABLE IF NOT EXISTS` checks the right to create even where the table exists.
        let migrated = resolution.exists && {
            let rows = connection
                .query_typed(MIGRATED, &[(&sql.relation, Type::TEXT)])
                .await
                .map_err(unavailable)?;
            match rows.as_slice() {
                [row] => row.try_get(0).map_err(unreadable)?,
                _ => false,
            }
        };
        if !migrated {
            connection
                .batch_execute(&sql.migrate)
                .await
                .map_err(|error| migration_failed(error, &sql.relation))?;
        }
        self.table.settle(sql);
        Ok(())
    }

    /// The statements of the store's table, resolved on first use where
    /// [`migrate`](Self::migrate) did not run (on a pooled connection of its own, so call it
    /// before taking one: see [`statements_on`](Self::statements_on)): an error while the
    /// table does not exist (tried again on the next use).
    async fn statements(&self) -> Result<&Statements, StoreError> {
        if let Some(sql) = self.table.statements() {
            return Ok(sql);
        }
        let rows = self
            .query(table::RESOLVE, &self.table.resolve_params())
            .await?;
        self.settle(the_only_row(&rows, "the table's resolution")?)
    }

    /// [`statements`](Self::statements) for a step that already holds `client` (a plain
    /// `begin`'s pooled connection, or a transactional claim's, inside its transaction):
    /// resolved on it, a round trip the first time only. On another pooled connection, as
    /// many such steps at once as the pool has connections each held one and waited for
    /// another until the store timeout (503). In a claim's transaction it runs before the
    /// claim and the handler (no `SET LOCAL search_path` of theirs yet), reads only the
    /// catalogs (no predicate locks; the snapshot is already `BEGIN`'s), reads the
    /// transaction's isolation, the sessions' default, and an error of it fails the claim,
    /// whose transaction is rolled back.
    async fn statements_on(
        &self,
        client: &tokio_postgres::Client,
    ) -> Result<&Statements, StoreError> {
        if let Some(sql) = self.table.statements() {
            return Ok(sql);
        }
        let row = client
            .query_typed_one(table::RESOLVE, &self.table.resolve_params())
            .await
            .map_err(unavailable)?;
        self.settle(&row)
    }

    /// Takes a row of [`table::RESOLVE`] as the table's resolution; an error while the table
    /// does not exist (nothing kept, so the next use resolves it again).
    fn settle(&self, row: &Row) -> Result<&Statements, StoreError> {
        let resolution = Resolution::read(row)?;
        if !resolution.exists {
            return Err(StoreError::Unavailable(
                format!(
                    "the table {:?} does not exist: run PostgresStore::migrate at start",
                    self.table.configured
                )
                .into(),
            ));
        }
        self.isolation.observe(&resolution.isolation);
        Ok(self
            .table
            .settle(resolution.statements(&self.table.configured)?))
    }

    /// Deletes expired rows, at most `batch` of them (up to [`EXPIRY_BATCH`] is sensible);
    /// the number deleted. Rows that a statement or transaction holds are skipped.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached.
    ///
    /// # Examples
    ///
    /// Not run here: it needs a PostgreSQL server.
    ///
    /// ```no_run
    /// use idempotency_actix::{EXPIRY_BATCH, PostgresStore};
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::new(PostgresStore::pool("postgres://app@127.0.0.1/app")?);
    /// let deleted = store.delete_expired(EXPIRY_BATCH).await?;
    /// println!("{deleted} expired records deleted");
    /// # Ok(())
    /// # }
    /// ```
    pub async fn delete_expired(&self, batch: i64) -> Result<u64, StoreError> {
        let sql = self.statements().await?;
        let params: [(&(dyn ToSql + Sync), Type); 1] = [(&batch, Type::INT8)];
        // Again while it fails to serialize, as every other step: under a stricter default
        // isolation a batch whose snapshot predates the takeover of one of its expired rows
        // failed, deleting nothing.
        again_while_unserializable(|| async {
            let connection = self.pool.get().await.map_err(|error| no_connection(&self.pool, error))?;
            let deleted = match connection.execute_typed(&sql.delete_expired, &params).await {
                // As every other step, once more on a live connection: after a restart or a
                // failover, or where the server ends idle sessions (`idle_session_timeout`),
                // the reaper of a quiet app is the pool's only user, and it met one closed
                // connection per period, each a period without deleting anything.
                Err(error) if lost(&connection, &error) => {
                    tracing::debug!(%error, "idempotency: PostgreSQL connection lost; reconnecting");
                    self.live_connection_after(connection)
                        .await?
                        .execute_typed(&sql.delete_expired, &params)
                        .await
                        .map_err(unavailable)
                }
                other => other.map_err(unavailable),
            };
            self.isolation.noting(deleted)
        })
        .await
    }

    /// Runs forever: every `period`, deletes expired rows in batches of [`EXPIRY_BATCH`]
    /// until none are left, pausing between batches so the request path keeps the pool.
    /// Spawn it once per process (`actix_web::rt::spawn`); failures are logged and retried
    /// at the next period. Expired rows count as absent whether or not this runs; it only
    /// keeps the table small.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    ///
    /// use idempotency_actix::PostgresStore;
    ///
    /// # #[actix_web::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::new(PostgresStore::pool("postgres://app@127.0.0.1/app")?);
    /// // Once per process, beside the server: every minute, delete what has expired.
    /// actix_web::rt::spawn(store.clone().expire_periodically(Duration::from_secs(60)));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn expire_periodically(self, period: Duration) {
        loop {
            actix_rt::time::sleep(period).await;
            loop {
                match self.delete_expired(EXPIRY_BATCH).await {
                    Ok(deleted) if deleted < EXPIRY_BATCH as u64 => break,
                    Ok(_) => actix_rt::time::sleep(Duration::from_millis(10)).await,
                    Err(error) => {
                        tracing::warn!(%error, "idempotency: deleting expired records failed");
                        break;
                    }
                }
            }
        }
    }

    /// A connection of the pool after one turned out closed, passing over the others the
    /// server closed too: after a restart or a failover the pool still holds every
    /// connection it had, each of which would fail its statement. The pool discards a closed
    /// connection when it comes back.
    async fn live_connection(&self) -> Result<PostgresConnection, StoreError> {
        // Bounded by what the pool holds now: each closed one taken leaves it for good.
        let held = self.pool.state().connections;
        let mut connection = self
            .pool
            .get_owned()
            .await
            .map_err(|error| no_connection(&self.pool, error))?;
        for _ in 0..held {
            if !connection.is_closed() {
                break;
            }
            drop(connection);
            connection = self
                .pool
                .get_owned()
                .await
                .map_err(|error| no_connection(&self.pool, error))?;
        }
        Ok(connection)
    }

    /// A live connection in place of `lost` ([`lost`]), which goes back to the pool once
    /// closed ([`closing`]), so that the pool discards it rather than hand it out again.
    async fn live_connection_after(
        &self,
        lost: impl std::ops::Deref<Target = tokio_postgres::Client>,
    ) -> Result<PostgresConnection, StoreError> {
        closing(&lost).await;
        drop(lost);
        self.live_connection().await
    }

    /// Runs one statement on a pooled connection; if the connection turns out closed (the
    /// server restarted), once more on a live one (the broken one is discarded by the pool);
    /// and again while it fails to serialize (see [`serialization`]).
    async fn query(
        &self,
        statement: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        again_while_unserializable(|| async {
            self.isolation
                .noting(self.query_once(statement, params).await)
        })
        .await
    }

    /// [`query`](Self::query), without running it again when it fails to serialize.
    async fn query_once(
        &self,
        statement: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        let connection = self
            .pool
            .get()
            .await
            .map_err(|error| no_connection(&self.pool, error))?;
        self.query_on(connection, statement, params).await
    }

    /// [`query_once`](Self::query_once) on `connection`, taken from the pool.
    async fn query_on(
        &self,
        connection: bb8::PooledConnection<'_, PostgresConnectionManager<NoTls>>,
        statement: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, StoreError> {
        match connection.query_typed(statement, params).await {
            Err(error) if lost(&connection, &error) => {
                tracing::debug!(%error, "idempotency: PostgreSQL connection lost; reconnecting");
                let connection = self.live_connection_after(connection).await?;
                connection
                    .query_typed(statement, params)
                    .await
                    .map_err(unavailable)
            }
            other => other.map_err(unavailable),
        }
    }

    async fn query_flag(
        &self,
        statement: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<bool, StoreError> {
        flag(&self.query(statement, params).await?)
    }

    /// Runs the renewal `statement` once (`$1` key, `$2` token, `$3` lease in
    /// milliseconds) on this thread's renewal connection ([`renewals`]), never waiting for
    /// the pool; while that connection opens, on it or a pooled connection, whichever comes
    /// first; on a pooled connection while it cannot be opened, or when it turns out
    /// closed, or was given up on while this renewal waited on it (a renewal is safe to
    /// send twice). On the renewal connection, a renewal of a lease whose
    /// last one is still on its way there waits for that one's answer
    /// ([`renewals::RenewalClient::renew`]).
    ///
    /// Commits stay on the pool, also when their lease is at risk: while a commit waits
    /// for a pooled connection its lease is renewed here (the engine renews until the commit
    /// answers, and a commit that timed out is retried in the background under renewals),
    /// so the key stays locked and a duplicate gets 409, never a second run. Sent here, a
    /// commit (a slow write with the response's body) would hold up the renewals behind it,
    /// which the server answers in order on one connection.
    async fn renew_once(
        &self,
        statement: &str,
        key: &str,
        token: &str,
        lease_ms: i64,
    ) -> Result<bool, StoreError> {
        let params = renewal_params(&key, &token, &lease_ms);
        let on_renewal_connection =
            || self.renew_on_renewal_connection(statement, key, token, lease_ms);
        if let Some(renewed) = on_renewal_connection().await {
            return renewed;
        }
        // None open (or it failed this renewal): a pooled connection, or the renewal
        // connection once an attempt to open it ends with it open, whichever comes first. The
        // checkout keeps its place in the pool's queue meanwhile.
        let mut checkout = std::pin::pin!(self.pool.get());
        loop {
            let opened = std::pin::pin!(self.renewals.opened());
            match futures_util::future::select(checkout.as_mut(), opened).await {
                Either::Left((checked_out, _)) => {
                    let connection =
                        checked_out.map_err(|error| no_connection(&self.pool, error))?;
                    return flag(&self.query_on(connection, statement, &params).await?);
                }
                Either::Right(((), _)) => {
                    if let Some(renewed) = on_renewal_connection().await {
                        return renewed;
                    }
                }
            }
        }
    }

    /// The renewal on this thread's renewal connection; `None` where none is open, or where
    /// it turned out lost or was given up on while this renewal waited on it (the renewal
    /// then goes to the pool: it is safe to send twice).
    async fn renew_on_renewal_connection(
        &self,
        statement: &str,
        key: &str,
        token: &str,
        lease_ms: i64,
    ) -> Option<Result<bool, StoreError>> {
        let client = self.renewals.client(&self.pool).await?;
        match client.renew(statement, key, token, lease_ms).await {
            Err(RenewalFailure::Postgres(error)) if lost(&client, &error) => {
                tracing::debug!(%error, "idempotency: PostgreSQL renewal connection lost; renewing on the pool");
                self.renewals.forget(&client).await;
                None
            }
            // Sent on a connection given up on since (silent, or its session lost).
            Err(RenewalFailure::Abandoned) => {
                tracing::debug!(
                    "idempotency: PostgreSQL renewal connection given up on; renewing on the pool"
                );
                None
            }
            Err(RenewalFailure::Postgres(error)) => Some(Err(shared_unavailable(error))),
            Err(RenewalFailure::Protocol(error)) => Some(Err(StoreError::Protocol(error))),
            Ok(renewed) => Some(Ok(renewed)),
        }
    }

    /// `begin` on `client` (pooled, or a transaction's), repeated while its snapshot missed
    /// a row committed by a concurrent statement; with a completed record, how much longer
    /// the table keeps it; with a record acquired by the statement for a stricter isolation,
    /// its row's `ctid`.
    async fn begin_on(
        &self,
        client: &tokio_postgres::Client,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<(BeginOutcome, Option<Duration>, Option<String>), StoreError> {
        let sql = self.statements_on(client).await?;
        let params = BeginParams::new(sql, key, fingerprint, token, lease);
        let strict = self.isolation.strict();
        let statement = if strict {
            &sql.begin_strict
        } else {
            &sql.begin
        };
        for _ in 0..MAX_SNAPSHOT_RETRIES {
            let row = client
                .query_typed_one(statement, &params.as_params())
                .await
                .map_err(unavailable)?;
            let claimed_row = if strict {
                self.isolation.observe(row.try_get(8).map_err(unreadable)?);
                row.try_get(7).map_err(unreadable)?
            } else {
                None
            };
            if let Some((outcome, remaining)) = begin_outcome(&row, fingerprint, token)? {
                return Ok((outcome, remaining, claimed_row));
            }
        }
        Err(StoreError::Protocol(
            "begin found a conflicting record it could not read, repeatedly".to_owned(),
        ))
    }

    /// Opens a transaction on a connection of its own and runs `begin` inside it (one round
    /// trip: `BEGIN` is pipelined with the statement), the database watching the client for
    /// about the lease ([`begin_watching_the_client`]). When acquired, the transaction is
    /// returned, holding the key's advisory lock and the uncommitted in-flight row; otherwise
    /// it is rolled back in the background and its connection goes back to the pool. On a
    /// connection that turns out closed (the server restarted), once more on a live one; on a
    /// transaction that failed to serialize (a stricter default isolation than READ
    /// COMMITTED, whose snapshot predates a record just committed), again on a new one.
    pub(crate) async fn claim_in_transaction(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<(BeginOutcome, Option<OpenTransaction>), StoreError> {
        again_while_unserializable(|| async {
            self.isolation
                .noting(self.claim_once(key, fingerprint, token, lease).await)
        })
        .await
    }

    /// [`claim_in_transaction`](Self::claim_in_transaction), without claiming again when the
    /// transaction fails to serialize.
    async fn claim_once(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<(BeginOutcome, Option<OpenTransaction>), StoreError> {
        // Marked as never sent where no connection can be had by the operation's deadline.
        let transaction = OpenTransaction::on(
            unsent_by_the_deadline(async {
                self.pool
                    .get_owned()
                    .await
                    .map_err(|error| no_connection(&self.pool, error))
            })
            .await?,
        );
        let (mut transaction, (outcome, claimed_row)) = match self
            .claim_on(&transaction, key, fingerprint, token, lease)
            .await
        {
            // Safe to send again: nothing was committed on the closed connection, and the
            // claim is idempotent for its token.
            Err(error) if lost_with(transaction.client(), &error) => {
                tracing::debug!(%error, "idempotency: PostgreSQL connection lost; reconnecting");
                closing(transaction.client()).await;
                transaction.finished();
                let transaction = OpenTransaction::on(self.live_connection().await?);
                let outcome = self
                    .claim_on(&transaction, key, fingerprint, token, lease)
                    .await?;
                (transaction, outcome)
            }
            // Rolled back at once rather than in the background, so that the claim made
            // again finds the key's lock free.
            Err(error) if failed_to_serialize(&error) => {
                if let Err(rollback) = transaction.roll_back().await {
                    tracing::debug!(%rollback, "idempotency: rollback after a serialization failure failed");
                }
                return Err(error);
            }
            claimed => (transaction, claimed?),
        };
        match outcome {
            BeginOutcome::Acquired => {
                transaction.claimed_row = claimed_row;
                Ok((BeginOutcome::Acquired, Some(transaction)))
            }
            outcome => Ok((outcome, None)),
        }
    }

    /// `BEGIN`, with the client watched ([`begin_watching_the_client`]), pipelined with
    /// `begin` on `transaction`'s connection; with a record acquired by the statement for a
    /// stricter isolation, its row's `ctid`.
    async fn claim_on(
        &self,
        transaction: &OpenTransaction,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<(BeginOutcome, Option<String>), StoreError> {
        let client = transaction.client();
        let (opened, begun) = futures_util::future::join(
            client.batch_execute(&begin_watching_the_client(lease)),
            self.begin_on(client, key, fingerprint, token, lease),
        )
        .await;
        let (outcome, _, claimed_row) = opened.map_err(unavailable).and(begun)?;
        Ok((outcome, claimed_row))
    }

    /// A transaction on a connection of its own, without any record (a keyless request to a
    /// transactional route); on a connection that turns out closed, once more on a live one.
    /// Opened as a claim's is ([`begin_watching_the_client`] for `lease`): the server's
    /// limits on idle transactions would otherwise end it while its handler is away from the
    /// database (its writes rolled back, the client answered 503 after the handler's calls
    /// elsewhere were made), and a dead host's would hold its row locks for hours.
    pub(crate) async fn open_transaction(
        &self,
        lease: Duration,
    ) -> Result<OpenTransaction, StoreError> {
        let begin = begin_watching_the_client(lease);
        let transaction = OpenTransaction::on(
            self.pool
                .get_owned()
                .await
                .map_err(|error| no_connection(&self.pool, error))?,
        );
        match transaction.client().batch_execute(&begin).await {
            Ok(()) => Ok(transaction),
            Err(error) if lost(transaction.client(), &error) => {
                tracing::debug!(%error, "idempotency: PostgreSQL connection lost; reconnecting");
                closing(transaction.client()).await;
                transaction.finished();
                let transaction = OpenTransaction::on(self.live_connection().await?);
                transaction
                    .client()
                    .batch_execute(&begin)
                    .await
                    .map_err(unavailable)?;
                Ok(transaction)
            }
            Err(error) => Err(unavailable(error)),
        }
    }

    /// Completes the in-flight row of `token` with `response` and commits `transaction` (one
    /// round trip: the `COMMIT` is pipelined behind the update, which aborts the transaction
    /// unless it completed exactly our row, so the handler's writes never commit without
    /// their record).
    pub(crate) async fn complete_and_commit(
        &self,
        transaction: OpenTransaction,
        key: &StorageKey,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        // Resolved by the claim.
        let sql = self.statements().await?;
        let encoded = response.encode();
        let ttl = millis(ttl);
        let claimed_row = transaction.claimed_row.as_deref();
        let params: [(&(dyn ToSql + Sync), Type); 5] = [
            (&key.as_str(), Type::TEXT),
            (&token.as_str(), Type::TEXT),
            (&encoded, Type::BYTEA),
            (&ttl, Type::INT8),
            (&claimed_row, Type::TEXT),
        ];
        // Completed as it was claimed: by its `ctid` under a stricter isolation.
        let (statement, params) = match claimed_row {
            Some(_) => (&sql.complete_claimed_row, &params[..]),
            None => (&sql.complete, &params[..4]),
        };
        let client = transaction.client();
        let (completed, committed) = futures_util::future::join(
            client.query_typed(statement, params),
            client.batch_execute("COMMIT"),
        )
        .await;
        let done = completed.map(drop).and(committed).map_err(unavailable);
        self.isolation.noting(done)?;
        transaction.finished();
        Ok(())
    }
}

/// The longest keepalive idle time and interval Linux takes (`TCP_KEEPIDLE`,
/// `TCP_KEEPINTVL`): PostgreSQL logs a failed `setsockopt` for a longer one, and keeps its
/// default.
const MAX_KEEPALIVE_SECONDS: u64 = 32_767;

/// `BEGIN` of a transactional route's transaction (a claim's, or a keyless request's), with
/// TCP keepalives on the database's side of the connection for as long as the transaction
/// lasts (`SET LOCAL`): after `lease / 3` of silence the server probes the client every
/// `lease / 6` and ends the session after 3 probes unanswered, rolling back its transaction
/// and freeing the key (and the rows) it holds. A host that dies without closing its
/// connections (power lost, network cut) frees its keys within about `5/6` of the lease,
/// as a plain route's lease would expire, instead of the two hours and more of the
/// operating system's default. A live client's kernel answers the probes however long its
/// handler takes. (Without effect on a Unix-socket connection, which needs none.) Both
/// times are at most [`MAX_KEEPALIVE_SECONDS`], as Linux takes no more. Keepalives are not
/// sent while data the server sent is unacknowledged (a statement's reply on its way when
/// the host died or was cut off), when retransmissions keep the session for about 15
/// minutes: `tcp_user_timeout` (PostgreSQL 12 and later; left alone where the server has no
/// such setting) ends it after as long, `idle` plus 3 `interval`s. (So does a client that
/// leaves a streamed reply unread for as long: Linux counts a receive window kept shut as
/// unacknowledged data.)
///
/// The server's own limits on the transaction are turned off for it, also `SET LOCAL`:
/// `idle_in_transaction_session_timeout` (common on managed PostgreSQL) would end the
/// session while the handler is away from the database (calling a payment provider, say),
/// and `transaction_timeout` (PostgreSQL 17 and later; left alone where the server has no
/// such setting) once the handler runs long; either would roll back the claim with its
/// advisory lock and let a duplicate run the handler while the first still runs. Anything
/// else that ends the session mid-handler (a restart, a failover, `pg_terminate_backend`)
/// still rolls back the claim together with the handler's writes: the first request then
/// fails, and a retry runs the handler again. Its writes in the transaction are gone, but
/// what it did outside it (a call to a payment provider) is not: such side effects belong
/// on plain routes, whose record is committed at once.
fn begin_watching_the_client(lease: Duration) -> String {
    let idle = (lease.as_secs() / 3).clamp(1, MAX_KEEPALIVE_SECONDS);
    let interval = (lease.as_secs() / 6).clamp(1, MAX_KEEPALIVE_SECONDS);
    let unacknowledged_ms = (idle + 3 * interval) * 1000;
    format!(
        "BEGIN; SET LOCAL tcp_keepalives_idle = {idle}; \
         SET LOCAL tcp_keepalives_interval = {interval}; SET LOCAL tcp_keepalives_count = 3; \
         SELECT set_config('tcp_user_timeout', '{unacknowledged_ms}', true) \
         WHERE current_setting('tcp_user_timeout', true) IS NOT NULL; \
         SET LOCAL idle_in_transaction_session_timeout = 0; \
         SELECT set_config('transaction_timeout', '0', true) \
         WHERE current_setting('transaction_timeout', true) IS NOT NULL"
    )
}

/// A pooled connection inside `BEGIN`. Dropped without [`commit`](Self::commit) or
/// [`roll_back`](Self::roll_back) (an error, a timeout, a cancelled future), its transaction
/// is rolled back on a task of its own before the connection goes back to the pool: a pooled
/// connection never carries an open transaction to its next user. The server answers in
/// order, so that `ROLLBACK` also ends whatever a statement still running left open (and
/// after a `COMMIT` that went through it changes nothing).
pub(crate) struct OpenTransaction {
    /// The connection, until the transaction ends.
    connection: Option<PostgresConnection>,
    /// The `ctid` of the record's row that a transactional claim acquired under a stricter
    /// isolation, for its completion; `None` for a transaction without a record, or with
    /// one claimed under READ COMMITTED (completed by its key).
    claimed_row: Option<String>,
}

impl OpenTransaction {
    /// A transaction to open on `connection`, without a record yet.
    fn on(connection: PostgresConnection) -> Self {
        Self {
            connection: Some(connection),
            claimed_row: None,
        }
    }

    /// The connection, to run statements in the transaction.
    pub(crate) fn client(&self) -> &tokio_postgres::Client {
        // Only `finished` and `drop`, which both consume the transaction, take it out.
        self.connection
            .as_deref()
            .expect("an open transaction keeps its connection until it ends")
    }

    /// Commits (for a transaction that holds no record), or fails if it cannot.
    ///
    /// The server answers `COMMIT` of a transaction that a failed statement aborted (one
    /// whose error the handler ignored) with a rollback and no error, so a statement that
    /// fails in an aborted transaction is pipelined before it (one round trip): the
    /// transaction then ends rolled back, and the caller learns that nothing committed.
    pub(crate) async fn commit(self) -> Result<(), StoreError> {
        let client = self.client();
        let (checked, committed) = futures_util::future::join(
            client.batch_execute("SELECT 1"),
            client.batch_execute("COMMIT"),
        )
        .await;
        checked.and(committed).map_err(unavailable)?;
        self.finished();
        Ok(())
    }

    /// Rolls back.
    pub(crate) async fn roll_back(self) -> Result<(), StoreError> {
        self.end("ROLLBACK").await
    }

    async fn end(self, statement: &str) -> Result<(), StoreError> {
        self.client()
            .batch_execute(statement)
            .await
            .map_err(unavailable)?;
        self.finished();
        Ok(())
    }

    /// The transaction ended (or its connection closed, which ended it): the connection goes
    /// back to the pool as it is, and the pool discards a closed one.
    fn finished(mut self) {
        drop(self.connection.take());
    }
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        let Some(connection) = self.connection.take() else {
            return;
        };
        let mut rollback = Box::pin(async move {
            if let Err(error) = connection.batch_execute("ROLLBACK").await {
                tracing::debug!(%error, "idempotency: rollback in the background failed");
            }
        });
        // Polled once here, which queues the `ROLLBACK` on the connection, ahead of anything
        // its next user sends: however the task below ends, the connection never goes back
        // to the pool inside this transaction. (Left to the task alone, a runtime that stops
        // (a worker stopped or restarted, the pool shared with the others) dropped it
        // unpolled, and the connection went back open: the next requests on it ran inside
        // this transaction, its key locked, their own writes undone by its next rollback.)
        let mut queued = std::task::Context::from_waker(std::task::Waker::noop());
        if rollback.as_mut().poll(&mut queued).is_ready() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(rollback)),
            // No runtime left (the process is stopping): the `ROLLBACK` is queued all the same.
            Err(_) => tracing::debug!("idempotency: transaction dropped without a runtime"),
        }
    }
}

/// The pauses before a commit's re-creation of its lost record is tried again while the
/// key's advisory lock is busy: 150 ms in all, well within a store step's time limit (2 s by
/// default), and far longer than one statement holds the lock.
const RECREATE_PAUSES: [Duration; 4] = [
    Duration::from_millis(10),
    Duration::from_millis(20),
    Duration::from_millis(40),
    Duration::from_millis(80),
];

/// How often `begin` runs again when its snapshot missed a just-committed row: once is
/// enough unless rows for the key come and go in between.
const MAX_SNAPSHOT_RETRIES: usize = 4;

/// The parameters of the `begin` statement, owned so that a retry sends them again.
struct BeginParams<'a> {
    key: &'a str,
    fingerprint: &'a [u8],
    token: &'a str,
    lease: i64,
    lock: i64,
    version: i16,
}

impl<'a> BeginParams<'a> {
    fn new(
        sql: &Statements,
        key: &'a StorageKey,
        fingerprint: &'a Fingerprint,
        token: &'a LeaseToken,
        lease: Duration,
    ) -> Self {
        Self {
            key: key.as_str(),
            fingerprint: fingerprint.as_bytes(),
            token: token.as_str(),
            lease: millis(lease),
            lock: sql.lock_id(key),
            version: i16::from(RECORD_VERSION),
        }
    }

    fn as_params(&self) -> [(&(dyn ToSql + Sync), Type); 6] {
        [
            (&self.key, Type::TEXT),
            (&self.fingerprint, Type::BYTEA),
            (&self.token, Type::TEXT),
            (&self.lease, Type::INT8),
            (&self.lock, Type::INT8),
            (&self.version, Type::INT2),
        ]
    }
}

/// Reads the row of the `begin` statement, with a completed record's remaining ttl; `None`
/// when it must run again (the lock was ours but the conflicting row is not in the
/// statement's snapshot yet).
fn begin_outcome(
    row: &Row,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
) -> Result<Option<(BeginOutcome, Option<Duration>)>, StoreError> {
    let outcome = outcome_without_ttl(row, fingerprint, token)?;
    let Some(BeginOutcome::Completed(_)) = outcome else {
        return Ok(outcome.map(|outcome| (outcome, None)));
    };
    let remaining: i64 = row
        .try_get(6)
        .map_err(|error| StoreError::Protocol(error.to_string()))?;
    // A row read live has time left; one that lapsed while the statement ran has none, and
    // the cache then keeps it for no time at all.
    let remaining = Duration::from_millis(u64::try_from(remaining).unwrap_or(0));
    Ok(outcome.map(|outcome| (outcome, Some(remaining))))
}

/// The flag in the first column of the only row, if any, that a statement answers.
fn flag(rows: &[Row]) -> Result<bool, StoreError> {
    match rows {
        [] => Ok(false),
        [row] => row
            .try_get(0)
            .map_err(|error| StoreError::Protocol(error.to_string())),
        _ => Err(StoreError::Protocol(format!(
            "expected at most one row, got {}",
            rows.len()
        ))),
    }
}

/// The one row a statement answers, or a protocol error naming `statement`.
fn the_only_row<'a>(rows: &'a [Row], statement: &str) -> Result<&'a Row, StoreError> {
    match rows {
        [row] => Ok(row),
        _ => Err(StoreError::Protocol(format!(
            "{statement} answered {} rows",
            rows.len()
        ))),
    }
}

/// A column that cannot be read as the statement defines it.
fn unreadable(error: tokio_postgres::Error) -> StoreError {
    StoreError::Protocol(error.to_string())
}

/// [`begin_outcome`] without the remaining ttl.
fn outcome_without_ttl(
    row: &Row,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
) -> Result<Option<BeginOutcome>, StoreError> {
    let held: bool = row.try_get(0).map_err(unreadable)?;
    let acquired: bool = row.try_get(1).map_err(unreadable)?;
    if acquired {
        return Ok(Some(BeginOutcome::Acquired));
    }
    let state: Option<String> = row.try_get(2).map_err(unreadable)?;
    let marker = state.as_deref() == Some("a");
    if marker {
        let marked: &str = row.try_get(5).map_err(unreadable)?;
        if marked
            .split(' ')
            .any(|abandoned| abandoned == token.as_str())
        {
            return Ok(Some(BeginOutcome::Abandoned));
        }
    }
    let Some(state) = state.filter(|_| !marker) else {
        // No live row, or another token's marker, and not taken. With the lock taken, a
        // transaction (or a concurrent statement) is working on the key right now: a
        // marker's takeover is not committed, so this snapshot still shows the marker.
        // With the lock free the statement would have acquired, so a row committed after
        // the snapshot stopped it: read again.
        return Ok((!held).then_some(BeginOutcome::InFlight));
    };
    let stored: Vec<u8> = row.try_get(3).map_err(unreadable)?;
    if stored.as_slice() != fingerprint.as_bytes().as_slice() {
        return Ok(Some(BeginOutcome::FingerprintMismatch));
    }
    match state.as_str() {
        // This token's own row: a `begin` sent again after its first landed (the store
        // resends on a new connection when one closes) holds the key, as `begin` is
        // idempotent for its token, also while another statement holds the lock for a moment.
        "i" if row.try_get::<_, &str>(5).map_err(unreadable)? == token.as_str() => {
            Ok(Some(BeginOutcome::Acquired))
        }
        "i" => Ok(Some(BeginOutcome::InFlight)),
        "c" => {
            let response: Option<Vec<u8>> = row.try_get(4).map_err(unreadable)?;
            let response = response.ok_or_else(|| {
                StoreError::Protocol("a completed record without a response".to_owned())
            })?;
            Ok(Some(BeginOutcome::Completed(StoredResponse::decode(
                &response,
            )?)))
        }
        other => Err(StoreError::Protocol(format!(
            "unknown record state {other:?}"
        ))),
    }
}

/// Whether `error`, which a statement on `client` met, lost the connection: it is closed,
/// or the error is FATAL, the server ending the session while the statement ran
/// (`pg_terminate_backend`, a shutdown, a failover, `idle_in_transaction_session_timeout`).
/// That error reaches the statement before the connection has read the end of its socket,
/// so the client is often not closed yet: the step failed where it could have been sent
/// again on a live connection.
fn lost(client: &tokio_postgres::Client, error: &tokio_postgres::Error) -> bool {
    client.is_closed()
        || error.is_closed()
        || error
            .as_db_error()
            .and_then(tokio_postgres::error::DbError::parsed_severity)
            .is_some_and(|severity| matches!(severity, Severity::Fatal | Severity::Panic))
}

/// [`lost`], for a step's [`StoreError`].
fn lost_with(client: &tokio_postgres::Client, error: &StoreError) -> bool {
    PostgresError::of(error).map_or_else(|| client.is_closed(), |error| lost(client, error))
}

/// How long a connection whose session ended ([`lost`]) is given to see its socket closed.
const CLOSING: Duration = Duration::from_millis(100);

/// Waits, up to [`CLOSING`], until `client`'s connection has closed, as it does a moment
/// after a FATAL error: the pool discards a closed connection when it comes back, and would
/// otherwise hand this one out again.
async fn closing(client: &tokio_postgres::Client) {
    let deadline = std::time::Instant::now() + CLOSING;
    while !client.is_closed() && std::time::Instant::now() < deadline {
        actix_rt::time::sleep(Duration::from_millis(1)).await;
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .max(1)
}

/// How long [`PostgresStore::migrate`] waits for each lock its DDL takes on an existing
/// table before it gives up: as long as a store step may take by default (the store
/// timeout), since every statement on the table waits behind it meanwhile.
const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(2);

/// The error of a migration that failed with `error` on the table `relation`: one that gave
/// up waiting for a lock ([`MIGRATION_LOCK_TIMEOUT`]) says what holds it and that it may be
/// run again.
fn migration_failed(error: tokio_postgres::Error, relation: &str) -> StoreError {
    if error.code() != Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
        return unavailable(error);
    }
    StoreError::Unavailable(
        format!(
            "migrate gave up after waiting {MIGRATION_LOCK_TIMEOUT:?} for a lock on the table \
             {relation}, which a transaction of another session holds (one that wrote to it, \
             such as a transactional request still running); nothing was changed: run it \
             again once that transaction has ended"
        )
        .into(),
    )
}

/// How long a connection may take to open: a pool's checkout waits as long, and so does
/// [`PostgresStore::migrate`] for its own.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

impl IdempotencyStore for PostgresStore {
    async fn begin(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<BeginOutcome, StoreError> {
        let (outcome, _) = self
            .begin_with_remaining_ttl(key, fingerprint, token, lease)
            .await?;
        Ok(outcome)
    }

    async fn begin_with_remaining_ttl(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<(BeginOutcome, Option<Duration>), StoreError> {
        again_while_unserializable(|| async {
            // Marked as never sent where no connection can be had by the operation's deadline
            // (the statements of earlier attempts, which failed to serialize, were rolled
            // back).
            let connection = unsent_by_the_deadline(async {
                self.pool
                    .get()
                    .await
                    .map_err(|error| no_connection(&self.pool, error))
            })
            .await?;
            let begun = match self
                .begin_on(&connection, key, fingerprint, token, lease)
                .await
            {
                Err(error) if lost_with(&connection, &error) => {
                    tracing::debug!(%error, "idempotency: PostgreSQL connection lost; reconnecting");
                    let connection = self.live_connection_after(connection).await?;
                    self.begin_on(&connection, key, fingerprint, token, lease)
                        .await
                }
                other => other,
            };
            self.isolation.noting(begun)
        })
        .await
        .map(|(outcome, remaining, _)| (outcome, remaining))
    }

    async fn renew(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let lease = millis(lease);
        let statement = &self.statements().await?.renew;
        again_while_unserializable(|| async {
            self.isolation.noting(
                self.renew_once(statement, key.as_str(), token.as_str(), lease)
                    .await,
            )
        })
        .await
    }

    async fn commit(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        token: &LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let encoded = response.encode();
        let (ttl, key_text, token_text) = (millis(ttl), key.as_str(), token.as_str());
        // The commit's parameters, and the first four of the re-creation's.
        let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
            (&key_text, Type::TEXT),
            (&token_text, Type::TEXT),
            (&encoded, Type::BYTEA),
            (&ttl, Type::INT8),
        ];
        let sql = self.statements().await?;
        if self.query_flag(&sql.commit, &params).await? {
            return Ok(true);
        }
        // Rare: the lease was lost, or the commit was sent twice.
        let (lock, version) = (sql.lock_id(key), i16::from(RECORD_VERSION));
        let fingerprint = fingerprint.as_bytes().as_slice();
        params.extend([
            (&fingerprint as &(dyn ToSql + Sync), Type::BYTEA),
            (&lock, Type::INT8),
            (&version, Type::INT2),
        ]);
        // The lock can be busy for a moment where the key is free (another token's
        // `abandon`, a late `begin` of an abandoned token: one statement each), so a busy
        // lock is tried again a few times; one busy throughout is a transaction's, which
        // holds the key.
        let mut pauses = RECREATE_PAUSES.iter();
        loop {
            let rows = self.query(&sql.recreate, &params).await?;
            let row = the_only_row(&rows, "the re-creation")?;
            let recreated: bool = row.try_get(0).map_err(unreadable)?;
            let held: bool = row.try_get(1).map_err(unreadable)?;
            if recreated {
                lost_record::report_written_anew();
                return Ok(true);
            }
            match pauses.next() {
                Some(pause) if !held => actix_rt::time::sleep(*pause).await,
                _ => return Ok(false),
            }
        }
    }

    async fn release(&self, key: &StorageKey, token: &LeaseToken) -> Result<bool, StoreError> {
        self.query_flag(
            &self.statements().await?.release,
            &[(&key.as_str(), Type::TEXT), (&token.as_str(), Type::TEXT)],
        )
        .await
    }

    async fn abandon(
        &self,
        key: &StorageKey,
        token: &LeaseToken,
        remember_for: Duration,
    ) -> Result<bool, StoreError> {
        let sql = self.statements().await?;
        let (remember_for, lock) = (millis(remember_for), sql.lock_id(key));
        let version = i16::from(RECORD_VERSION);
        self.query_flag(
            &sql.abandon,
            &[
                (&key.as_str(), Type::TEXT),
                (&token.as_str(), Type::TEXT),
                (&remember_for, Type::INT8),
                (&lock, Type::INT8),
                (&version, Type::INT2),
            ],
        )
        .await
    }

    /// A transactional route's in-flight claim lives inside its transaction, so it is seen
    /// as the key's advisory lock being taken: reported in flight, without an expiry.
    async fn inspect(
        &self,
        key: &StorageKey,
        with_body: bool,
    ) -> Result<Option<RecordSnapshot>, StoreError> {
        let sql = self.statements().await?;
        let lock = sql.lock_id(key);
        let rows = self
            .query(
                &sql.inspect,
                &[(&key.as_str(), Type::TEXT), (&lock, Type::INT8)],
            )
            .await?;
        let row = the_only_row(&rows, "inspection")?;
        let held: bool = row.try_get(0).map_err(unreadable)?;
        let state: Option<String> = row.try_get(1).map_err(unreadable)?;
        let response: Option<Vec<u8>> = row.try_get(2).map_err(unreadable)?;
        let remaining: Option<i64> = row.try_get(3).map_err(unreadable)?;
        let expires_in = remaining
            .and_then(|millis| u64::try_from(millis).ok())
            .map(Duration::from_millis);
        Ok(match (state.as_deref(), response) {
            (Some("c"), Some(response)) => Some(RecordSnapshot::completed(
                StoredResponse::decode(&response)?,
                expires_in,
                with_body,
            )),
            (Some("i"), _) => Some(RecordSnapshot::in_flight(expires_in)),
            (None, _) if !held => Some(RecordSnapshot::in_flight(None)),
            (None, _) => None,
            (Some(state), _) => {
                return Err(StoreError::Protocol(format!("a row in state {state:?}")));
            }
        })
    }

    /// A transactional route's in-flight claim lives inside its transaction and cannot be
    /// deleted from outside it, even by force: it is reported as [`Deletion::InFlight`].
    async fn delete(&self, key: &StorageKey, force: bool) -> Result<Deletion, StoreError> {
        let sql = self.statements().await?;
        let lock = sql.lock_id(key);
        let rows = self
            .query(
                &sql.delete,
                &[
                    (&key.as_str(), Type::TEXT),
                    (&force, Type::BOOL),
                    (&lock, Type::INT8),
                ],
            )
            .await?;
        let row = the_only_row(&rows, "deletion")?;
        let held: bool = row.try_get(0).map_err(unreadable)?;
        let deleted: bool = row.try_get(1).map_err(unreadable)?;
        let state: Option<String> = row.try_get(2).map_err(unreadable)?;
        Ok(match (deleted, state.as_deref()) {
            (true, _) => Deletion::Deleted,
            (false, Some(_)) => Deletion::InFlight,
            (false, None) if !held => Deletion::InFlight,
            (false, None) => Deletion::NotFound,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keepalives_follow_the_lease_within_what_linux_takes() {
        let keepalives = |lease: u64| begin_watching_the_client(Duration::from_secs(lease));
        assert!(keepalives(60).contains("idle = 20;"));
        assert!(keepalives(60).contains("interval = 10;"));
        assert!(keepalives(1).contains("idle = 1;"));
        assert!(keepalives(1).contains("interval = 1;"));
        let year = keepalives(365 * 24 * 3600);
        assert!(year.contains("idle = 32767;"), "{year}");
        assert!(year.contains("interval = 32767;"), "{year}");
        assert!(keepalives(60).contains("'tcp_user_timeout', '50000'"));
        assert!(year.contains("'tcp_user_timeout', '131068000'"), "{year}");
        // The server's limits on the transaction are off for it. (`transaction_timeout` is
        // PostgreSQL 17's, where CI's PostgreSQL has none: its name is checked here.)
        assert!(year.contains("SET LOCAL idle_in_transaction_session_timeout = 0;"));
        assert!(year.contains("set_config('transaction_timeout', '0', true)"));
        assert!(year.contains("current_setting('transaction_timeout', true) IS NOT NULL"));
    }

    #[test]
    fn table_names_are_identifiers() {
        for good in ["records", "_r1", "billing.records", "A_b", &"x".repeat(63)] {
            assert!(Table::new(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "1records",
            "records;drop",
            "re\"cords",
            "a.b.c",
            ".records",
            "records.",
            "rec ords",
            "récords",
            &"x".repeat(64),
        ] {
            assert_eq!(
                Table::new(bad).err().map(|error| error.0),
                Some(bad.to_owned()),
                "{bad}"
            );
        }
    }

    /// Two versions that derived a key's advisory lock differently would make a duplicate
    /// of a transactional claim during a rolling deploy wait for the claim's transaction
    /// instead of answering 409 at once (the key's row still keeps it from running twice).
    /// The default table in `public` keeps the lock that releases naming it without a
    /// schema derived.
    #[test]
    fn the_lock_id_of_a_known_key_never_changes() {
        let key = StorageKey::new(
            "pg:",
            b"",
            &crate::IdempotencyKey::parse(b"k").expect("a key"),
        );
        let sql = Statements::new("public", DEFAULT_TABLE);
        assert_eq!(sql.lock_id(&key), 6_440_539_836_243_116_760);
    }

    #[test]
    fn lock_ids_differ_by_table_and_key() {
        let key = |name: &str| {
            StorageKey::new(
                "p:",
                b"",
                &crate::IdempotencyKey::parse(name.as_bytes()).expect("a key"),
            )
        };
        let (a, b) = (
            Statements::new("public", "a"),
            Statements::new("public", "b"),
        );
        assert_ne!(a.lock_id(&key("k")), b.lock_id(&key("k")));
        let elsewhere = Statements::new("billing", "a");
        assert_ne!(a.lock_id(&key("k")), elsewhere.lock_id(&key("k")));
        assert_ne!(a.lock_id(&key("k")), a.lock_id(&key("l")));
        assert_eq!(a.lock_id(&key("k")), a.lock_id(&key("k")));
    }
}
