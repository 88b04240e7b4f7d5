//! What only the PostgreSQL store does, beyond the acceptance suite: its table (name,
//! migration), reclaiming expired rows in bounded batches, durability across pools, and
//! `begin` under heavy contention (the READ COMMITTED race where a conflicting row is not yet
//! in a statement's snapshot). Each test runs in a database of its own on the server at
//! `DATABASE_URL` (default postgres://postgres@127.0.0.1:5432/postgres).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::web::Bytes;
use idempotency_actix::{
    BeginOutcome, Fingerprint, IdempotencyKey, IdempotencyStore, Inspector, LeaseToken,
    PostgresStore, StorageKey, StoredResponse,
};
use idempotency_actix_tests::{TestDatabase, postgres_admin_url};

const LEASE: Duration = Duration::from_secs(30);

fn key(name: &str) -> StorageKey {
    StorageKey::new("pg:", b"", &IdempotencyKey::parse(name.as_bytes()).unwrap())
}

fn print() -> Fingerprint {
    Fingerprint::compute(&Method::POST, "/orders", "", b"{}", [])
}

fn response() -> StoredResponse {
    StoredResponse::new(
        StatusCode::CREATED,
        Vec::new(),
        Some(Bytes::from_static(b"done")),
    )
}

/// What a `begin` of a new token for `name` meets.
async fn begin_anew(store: &PostgresStore, name: &str) -> BeginOutcome {
    store
        .begin(&key(name), &print(), &LeaseToken::generate(), LEASE)
        .await
        .unwrap()
}

/// A new token's `begin` of `name`, which must acquire it.
async fn acquire(store: &PostgresStore, name: &str) -> LeaseToken {
    let token = LeaseToken::generate();
    assert_eq!(
        store
            .begin(&key(name), &print(), &token, LEASE)
            .await
            .unwrap(),
        BeginOutcome::Acquired
    );
    token
}

async fn rows(database: &TestDatabase, table: &str) -> i64 {
    database
        .connection()
        .await
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap()
        .get(0)
}

#[actix_web::test]
async fn a_table_of_its_own_name_is_created_and_used() {
    let database = TestDatabase::create().await;
    database
        .connection()
        .await
        .batch_execute("CREATE SCHEMA billing")
        .await
        .unwrap();
    let instance = || {
        let pool = PostgresStore::pool(database.url()).unwrap();
        PostgresStore::new(pool)
            .table("billing.Idempotency_Keys")
            .unwrap()
    };
    let (store, other) = (instance(), instance());
    // From two instances at once, then again: the migration is idempotent.
    let (first, second) = futures_util::future::join(store.migrate(), other.migrate()).await;
    first.unwrap();
    second.unwrap();
    store.migrate().await.unwrap();
    acquire(&store, "k").await;
    assert_eq!(rows(&database, "billing.\"Idempotency_Keys\"").await, 1);
}

/// A name without a schema is created and used where `search_path` leads, also in a schema
/// whose name is no plain identifier (a quote, spaces, a dollar quote): the statements name
/// the table with that schema, quoted.
#[actix_web::test]
async fn an_unqualified_name_is_created_and_used_in_the_schema_search_path_names() {
    let database = TestDatabase::create().await;
    let admin = database.connection().await;
    let name: String = admin
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    let schema = "\"tenant's $migrate$ 1\"";
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA {schema}; ALTER DATABASE \"{name}\" SET search_path = {schema}"
        ))
        .await
        .unwrap();
    let store = database.store().await;
    store.migrate().await.unwrap();
    let token = acquire(&store, "k").await;
    let ttl = Duration::from_secs(60);
    assert!(
        store
            .commit(&key("k"), &print(), &token, &response(), ttl)
            .await
            .unwrap()
    );
    assert_eq!(
        begin_anew(&store, "k").await,
        BeginOutcome::Completed(response())
    );
    let table = format!("{schema}.idempotency_records");
    assert_eq!(rows(&database, &table).await, 1);
}

/// Instances that start at once on a database whose sessions run `repeatable read` (as
/// `default_transaction_isolation` sets it, for the app's transactional routes) create one
/// table with one expiry index. (Each `migrate` checked for the index in a snapshot taken
/// before it waited for the one before: every instance that waited added an index of its
/// own, each written on every step of the store.)
#[actix_web::test]
async fn instances_migrating_at_once_under_repeatable_read_create_one_expiry_index() {
    let database = TestDatabase::create().await;
    let admin = database.connection().await;
    let mut config: tokio_postgres::Config = database.url().parse().unwrap();
    config.options("-c default_transaction_isolation=repeatable\\ read");
    // The migrations' lock held, so that all of them wait for it at once.
    let holder = database.connection().await;
    holder
        .batch_execute("BEGIN; SELECT pg_advisory_xact_lock(7291604383712561407)")
        .await
        .unwrap();
    let instances = 3;
    let migrations: Vec<_> = (0..instances)
        .map(|_| {
            let manager =
                bb8_postgres::PostgresConnectionManager::new(config.clone(), tokio_postgres::NoTls);
            let store = PostgresStore::new(bb8::Pool::builder().build_unchecked(manager));
            actix_rt::spawn(async move { store.migrate().await })
        })
        .collect();
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let mut count: i64 = 0;
    for _ in 0..500 {
        count = admin.query_one(waiting, &[]).await.unwrap().get(0);
        if count == instances {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    // Else they did not contend (the lock's id no longer the library's, say), and the test
    // would prove nothing (test review).
    assert_eq!(
        count, instances,
        "the migrations waiting on the lock after 5 s"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    // The sessions of those pools run `repeatable read`.
    let (session, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    actix_rt::spawn(connection);
    let isolation: String = session
        .query_one("SHOW transaction_isolation", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(isolation, "repeatable read");
    for migration in migrations {
        migration.await.unwrap().unwrap();
    }
    let indexes: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_indexes
             WHERE tablename = 'idempotency_records' AND indexdef LIKE '%(expires_at)'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(indexes, 1);
    assert_eq!(
        begin_anew(&database.store().await, "k").await,
        BeginOutcome::Acquired
    );
}

#[actix_web::test]
async fn a_table_of_the_previous_release_is_migrated_to_keep_abandoned_tokens() {
    let database = TestDatabase::create().await;
    // The table as 0.2 created it: only the states 'i' and 'c'.
    database
        .connection()
        .await
        .batch_execute(
            "CREATE TABLE idempotency_records (
                 key         text        PRIMARY KEY,
                 fingerprint bytea       NOT NULL,
                 token       text        NOT NULL,
                 state       \"char\"      NOT NULL CHECK (state IN ('i', 'c')),
                 version     smallint    NOT NULL,
                 expires_at  timestamptz NOT NULL,
                 response    bytea
             )",
        )
        .await
        .unwrap();
    let store = database.store().await;
    store.migrate().await.unwrap();
    let late = LeaseToken::generate();
    assert!(store.abandon(&key("k"), &late, LEASE).await.unwrap());
    assert_eq!(
        store
            .begin(&key("k"), &print(), &late, LEASE)
            .await
            .unwrap(),
        BeginOutcome::Abandoned
    );
    // Exactly one check on the state is left, and it still refuses what no version writes.
    let refused = database
        .connection()
        .await
        .batch_execute("INSERT INTO idempotency_records VALUES ('x', '', 't', 'z', 1, now(), NULL)")
        .await;
    assert!(refused.is_err(), "a state of no version was accepted");
    let checks: i64 = database
        .connection()
        .await
        .query_one(
            "SELECT count(*) FROM pg_constraint
             WHERE conrelid = 'idempotency_records'::regclass AND contype = 'c'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(checks, 1);
}

/// A migration whose DDL waits behind another session's transaction on the table (here an
/// old instance's transactional request, its row not yet committed, during an upgrade from
/// 0.2) gives up after its lock timeout with an error that says so, instead of waiting for
/// as long as that transaction runs while every statement on the table queues behind it;
/// run again once that transaction ended, it migrates. (It waited forever.)
#[actix_web::test]
async fn a_migration_behind_a_long_transaction_gives_up_and_says_why() {
    let database = TestDatabase::create().await;
    let old_instance = database.connection().await;
    old_instance
        .batch_execute(
            "CREATE TABLE idempotency_records (
                 key         text        PRIMARY KEY,
                 fingerprint bytea       NOT NULL,
                 token       text        NOT NULL,
                 state       \"char\"      NOT NULL CHECK (state IN ('i', 'c')),
                 version     smallint    NOT NULL,
                 expires_at  timestamptz NOT NULL,
                 response    bytea
             );
             BEGIN;
             INSERT INTO idempotency_records
                 VALUES ('claimed', '', 't', 'i', 1, now() + interval '1 minute', NULL)",
        )
        .await
        .unwrap();
    let store = PostgresStore::new(PostgresStore::pool(database.url()).unwrap());
    // Far longer than any lock timeout the store sets: only a migration that waits for the
    // transaction to end runs into it.
    let migrated = actix_rt::time::timeout(Duration::from_secs(60), store.migrate()).await;
    let error = migrated
        .expect("migrate waited for the other transaction, which never ends")
        .expect_err("migrate went through a lock another transaction holds");
    let message = error.to_string();
    assert!(message.contains("lock"), "{message}");
    assert!(message.contains("idempotency_records"), "{message}");
    old_instance.batch_execute("COMMIT").await.unwrap();
    store.migrate().await.unwrap();
    let late = LeaseToken::generate();
    assert!(store.abandon(&key("k"), &late, LEASE).await.unwrap());
}

/// A statement the server refuses is an error that says what the server said, wherever
/// it reaches the app: a request's step (in the log of its 503), the inspector, the reaper.
/// (Each said only "store unavailable: db error".)
#[actix_web::test]
async fn errors_of_statements_say_what_the_server_said() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    // The table is gone (a DBA's mistake, a restore that missed it): every statement of the
    // store fails.
    database
        .connection()
        .await
        .batch_execute("DROP TABLE idempotency_records")
        .await
        .unwrap();
    let said = "relation \"public.idempotency_records\" does not exist";
    let begun = store
        .begin(&key("k"), &print(), &LeaseToken::generate(), LEASE)
        .await
        .expect_err("a begin without its table");
    assert!(begun.to_string().contains(said), "{begun}");
    let looked_up = Inspector::new(store.clone())
        .key_prefix("pg:")
        .lookup(b"", "k")
        .await
        .expect_err("a lookup without its table");
    assert!(looked_up.to_string().contains(said), "{looked_up}");
    let reaped = store
        .delete_expired(10)
        .await
        .expect_err("a batch without its table");
    assert!(reaped.to_string().contains(said), "{reaped}");
}

/// A store step that found no connection in the pool says why: every connection in use
/// (here the only one, held by the app), which a transactional request does for its whole
/// run. (It said "store unavailable: Timed out in bb8".)
#[actix_web::test]
async fn a_step_that_finds_the_pool_in_use_says_so() {
    let database = TestDatabase::create().await;
    let manager = bb8_postgres::PostgresConnectionManager::new_from_stringlike(
        database.url(),
        tokio_postgres::NoTls,
    )
    .unwrap();
    let pool = bb8::Pool::builder()
        .max_size(1)
        .connection_timeout(Duration::from_millis(200))
        .build_unchecked(manager);
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    let held = pool.get().await.unwrap();
    let begun = store
        .begin(&key("k"), &print(), &LeaseToken::generate(), LEASE)
        .await
        .expect_err("a begin without a connection");
    let message = begun.to_string();
    assert!(
        message.contains("all 1 of its connections were in use"),
        "{message}"
    );
    drop(held);
    assert_eq!(begin_anew(&store, "k").await, BeginOutcome::Acquired);
}

/// A login role of the test's own. Dropped when this is: declare it before the database it
/// has rights in, which is then dropped first (with those rights), also when the test fails.
struct TestRole {
    name: String,
    password: String,
}

impl TestRole {
    async fn create() -> Self {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let role = Self {
            name: format!("idempotency_test_{}_{}", std::process::id(), &suffix[..12]),
            password: suffix,
        };
        admin()
            .await
            .batch_execute(&format!(
                "CREATE ROLE {} LOGIN PASSWORD '{}'",
                role.name, role.password
            ))
            .await
            .unwrap();
        role
    }

    /// Lets this role read and write `table` (in schema `public`) and create nothing in its
    /// schema, as a DBA grants an app's role, on `admin`'s database.
    async fn may_only_use(&self, admin: &tokio_postgres::Client, table: &str) {
        admin
            .batch_execute(&format!(
                "REVOKE CREATE ON SCHEMA public FROM PUBLIC;
                 GRANT SELECT, INSERT, UPDATE, DELETE ON \"{table}\" TO {}",
                self.name
            ))
            .await
            .unwrap();
    }

    /// A store on `database` that connects as this role.
    fn store(&self, database: &TestDatabase) -> PostgresStore {
        let mut config: tokio_postgres::Config = database.url().parse().unwrap();
        config.user(&self.name).password(&self.password);
        let manager = bb8_postgres::PostgresConnectionManager::new(config, tokio_postgres::NoTls);
        PostgresStore::new(bb8::Pool::builder().build_unchecked(manager))
    }
}

impl Drop for TestRole {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop may run inside a test's runtime: do the I/O on a thread of its own.
        let dropped = std::thread::spawn(move || {
            actix_rt::System::new().block_on(async move {
                admin()
                    .await
                    .batch_execute(&format!("DROP ROLE IF EXISTS {name}"))
                    .await
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop the test role {}", self.name);
        }
    }
}

async fn admin() -> tokio_postgres::Client {
    let (client, connection) =
        tokio_postgres::connect(&postgres_admin_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    actix_rt::spawn(connection);
    client
}

/// An app whose role may only read and write the table its DBA created (no right to create
/// anything in the schema) calls `migrate()` at start like any other, and the store works.
/// (`CREATE TABLE IF NOT EXISTS` checks the right to create even where the table exists:
/// `migrate()` failed with "permission denied for schema public", and the app did not start.)
#[actix_web::test]
async fn migrate_needs_no_right_to_create_where_the_table_is_up_to_date() {
    let role = TestRole::create().await;
    let database = TestDatabase::create().await;
    // The table, migrated by its owner.
    database.store().await;
    role.may_only_use(&database.connection().await, "idempotency_records")
        .await;
    let store = role.store(&database);
    store.migrate().await.unwrap();
    let token = acquire(&store, "k").await;
    assert!(
        store
            .commit(&key("k"), &print(), &token, &response(), LEASE)
            .await
            .unwrap()
    );
    // A table still to create takes the right to create it: the role's `migrate()` says so.
    let missing = store.table("other_records").unwrap().migrate().await;
    let refused = format!("{:?}", missing.unwrap_err());
    assert!(refused.contains("permission denied"), "{refused}");
}

/// The longest table name `table()` takes (63 bytes) gets its expiry index too, so the
/// table counts as up to date and a role that may not create anything migrates it at start.
/// (The index was named after the table plus `_expires_at`, which PostgreSQL cuts to 63
/// bytes: the table's own name, so `CREATE INDEX IF NOT EXISTS` skipped it. Every later
/// `migrate()` then ran its DDL, which such a role may not, and the app did not start; and
/// the reaper sorted the whole table for each batch.)
#[actix_web::test]
async fn a_table_of_the_longest_name_gets_its_expiry_index() {
    let role = TestRole::create().await;
    let database = TestDatabase::create().await;
    let name = "r".repeat(63);
    let pool = PostgresStore::pool(database.url()).unwrap();
    let owners = PostgresStore::new(pool).table(&name).unwrap();
    owners.migrate().await.unwrap();
    let admin = database.connection().await;
    let indexed: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE tablename = $1 AND indexdef LIKE '%(expires_at)'",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(indexed, 1, "the expiry index");
    role.may_only_use(&admin, &name).await;
    let store = role.store(&database).table(&name).unwrap();
    store.migrate().await.unwrap();
    acquire(&store, "k").await;
}

/// A table made by hand without the check on its state: its owner's `migrate()` adds it, so
/// the table counts as up to date and a role that may not create anything migrates it at
/// start. (`migrate()` only replaced a check that lacked the marker state, never added a
/// missing one: the table never counted as up to date, and such a role's `migrate()` ran
/// the DDL, was refused, and the app did not start.)
#[actix_web::test]
async fn a_table_made_without_the_state_check_gets_it_from_its_owners_migrate() {
    let role = TestRole::create().await;
    let database = TestDatabase::create().await;
    let owners = database.store().await;
    let admin = database.connection().await;
    let check: String = admin
        .query_one(
            "SELECT conname::text FROM pg_constraint
             WHERE conrelid = 'idempotency_records'::regclass AND contype = 'c'
               AND pg_get_constraintdef(oid) LIKE '%state%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    admin
        .batch_execute(&format!(
            "ALTER TABLE idempotency_records DROP CONSTRAINT \"{check}\""
        ))
        .await
        .unwrap();
    owners.migrate().await.unwrap();
    role.may_only_use(&admin, "idempotency_records").await;
    let store = role.store(&database);
    store.migrate().await.unwrap();
    acquire(&store, "k").await;
}

#[actix_web::test]
async fn names_that_are_not_identifiers_never_reach_sql() {
    let database = TestDatabase::create().await;
    let pool = PostgresStore::pool(database.url()).unwrap();
    for name in ["records; DROP TABLE x", "a\"b", "1st", "a.b.c", ""] {
        let error = PostgresStore::new(pool.clone()).table(name).unwrap_err();
        assert!(error.to_string().contains("is not a table name"), "{error}");
    }
}

#[actix_web::test]
async fn completed_records_survive_a_new_pool() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    let token = LeaseToken::generate();
    store
        .begin(&key("k"), &print(), &token, LEASE)
        .await
        .unwrap();
    assert!(
        store
            .commit(
                &key("k"),
                &print(),
                &token,
                &response(),
                Duration::from_secs(60)
            )
            .await
            .unwrap()
    );
    drop(store);
    // Another process, another pool: the record is in the database, not in memory.
    let again = PostgresStore::new(PostgresStore::pool(database.url()).unwrap());
    assert_eq!(
        again
            .begin(&key("k"), &print(), &LeaseToken::generate(), LEASE)
            .await
            .unwrap(),
        BeginOutcome::Completed(response())
    );
}

/// Inserts `count` completed rows keyed `<prefix>:<n>` that expire at `expires_at` (SQL).
async fn insert_rows(database: &TestDatabase, prefix: &str, count: i32, expires_at: &str) {
    database
        .connection()
        .await
        .execute(
            &format!(
                "INSERT INTO idempotency_records
                     (key, fingerprint, token, state, version, expires_at)
                 SELECT $1 || ':' || n, '\\x00', 't', 'c', 1, {expires_at}
                 FROM generate_series(1, $2) AS n"
            ),
            &[&prefix, &count],
        )
        .await
        .unwrap();
}

#[actix_web::test]
async fn expired_rows_are_deleted_in_bounded_batches() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    // 2 500 expired rows and 10 live ones.
    insert_rows(&database, "expired", 2_500, "now() - interval '1 minute'").await;
    insert_rows(&database, "live", 10, "now() + interval '1 hour'").await;
    assert_eq!(store.delete_expired(1_000).await.unwrap(), 1_000);
    assert_eq!(store.delete_expired(1_000).await.unwrap(), 1_000);
    assert_eq!(store.delete_expired(1_000).await.unwrap(), 500);
    assert_eq!(store.delete_expired(1_000).await.unwrap(), 0);
    assert_eq!(rows(&database, "idempotency_records").await, 10);
}

/// How many rows sequential scans of `idempotency_records` have read, once `sessions` (each
/// session that ran statements on it) have flushed their statistics.
async fn rows_read_by_sequential_scans(
    database: &TestDatabase,
    sessions: &[&tokio_postgres::Client],
) -> i64 {
    for session in sessions {
        // Flushed when the session goes idle after this; the next statement waits for that.
        session
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .expect("request a statistics flush");
        session
            .batch_execute("SELECT 1")
            .await
            .expect("a statement after the flush");
    }
    database
        .connection()
        .await
        .query_one(
            "SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables
             WHERE relid = 'idempotency_records'::regclass",
            &[],
        )
        .await
        .expect("read the table's statistics")
        .get(0)
}

/// A batch of the reaper reads the rows it deletes, not the whole table: its `DELETE …
/// WHERE key IN (SELECT … LIMIT n)` was planned as a hash join over a sequential scan of
/// every row, so each batch of 1 000 read the whole table (every batch of a large backlog,
/// on a table of millions of live records), however few rows had expired.
#[actix_web::test]
async fn a_batch_of_the_reaper_reads_no_more_than_its_batch() {
    let database = TestDatabase::create().await;
    // One connection, so that the test can flush the statistics of the reaper's session.
    let manager = bb8_postgres::PostgresConnectionManager::new_from_stringlike(
        database.url(),
        tokio_postgres::NoTls,
    )
    .expect("a valid URL");
    let pool = bb8::Pool::builder().max_size(1).build_unchecked(manager);
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.expect("migrate");
    insert_rows(&database, "live", 20_000, "now() + interval '1 hour'").await;
    insert_rows(&database, "expired", 1_500, "now() - interval '1 minute'").await;
    let admin = database.connection().await;
    // As autovacuum does on a table of that size.
    admin
        .batch_execute("ANALYZE idempotency_records")
        .await
        .expect("analyze");
    let before = rows_read_by_sequential_scans(&database, &[&admin]).await;

    assert_eq!(
        store
            .delete_expired(1_000)
            .await
            .expect("a batch of the reaper"),
        1_000
    );

    let reaper = pool.get().await.expect("the reaper's connection");
    let read = rows_read_by_sequential_scans(&database, &[&admin, &reaper]).await - before;
    assert!(
        read < 20_000,
        "one batch of 1 000 read {read} rows of a table of 21 500 by sequential scans"
    );
    assert_eq!(rows(&database, "idempotency_records").await, 20_500);
}

/// On a database whose sessions run `repeatable read`, a batch of the reaper whose snapshot
/// predates the takeover of one of its expired rows (a new `begin` of that key) runs again
/// on a new snapshot and deletes the other expired rows: it failed with "could not
/// serialize access due to concurrent update", deleting none, and `expire_periodically`
/// gave up until its next period, each time a key it was about to delete was taken again.
#[actix_web::test]
async fn a_batch_of_the_reaper_under_repeatable_read_survives_a_takeover_of_its_rows() {
    let database = TestDatabase::create().await;
    database.store().await; // the table
    let mut config: tokio_postgres::Config = database.url().parse().expect("a valid URL");
    config.options("-c default_transaction_isolation=repeatable\\ read");
    let manager = bb8_postgres::PostgresConnectionManager::new(config, tokio_postgres::NoTls);
    let store = PostgresStore::new(bb8::Pool::builder().build_unchecked(manager));
    store.migrate().await.expect("migrate");
    insert_rows(&database, "expired", 10, "now() - interval '1 minute'").await;
    insert_rows(&database, "taken", 1, "now() - interval '2 minutes'").await;
    // The table locked, so that the batch takes its snapshot and then waits.
    let holder = database.connection().await;
    holder
        .batch_execute("BEGIN; LOCK TABLE idempotency_records IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock the table");
    let reaper = {
        let store = store.clone();
        actix_rt::spawn(async move { store.delete_expired(1_000).await })
    };
    let admin = database.connection().await;
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let mut waited = false;
    for _ in 0..500 {
        let count: i64 = admin
            .query_one(waiting, &[])
            .await
            .expect("sessions waiting")
            .get(0);
        if count == 1 {
            waited = true;
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(waited, "the reaper's batch never waited for the table");
    // Meanwhile a new request takes the expired key `taken:1` over, as `begin` does.
    holder
        .batch_execute(
            "UPDATE idempotency_records
             SET token = 'new', state = 'i', expires_at = now() + interval '1 hour'
             WHERE key = 'taken:1';
             COMMIT",
        )
        .await
        .expect("take the key over");

    let deleted = reaper
        .await
        .expect("the reaper's task")
        .expect("a batch of the reaper");
    assert_eq!(deleted, 10);
    assert_eq!(rows(&database, "idempotency_records").await, 1);
}

/// Ends every other session on `database`, as a restart or a failover ends a pool's
/// connections, and waits until the server has let them go.
async fn end_the_other_sessions(database: &TestDatabase) {
    let admin = database.connection().await;
    let others = "FROM pg_stat_activity \
                  WHERE datname = current_database() AND pid <> pg_backend_pid()";
    let ended: i64 = admin
        .query_one(
            &format!("SELECT count(*) FROM (SELECT pg_terminate_backend(pid) {others}) ended"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ended > 0, "the pool had no session to end");
    let mut left: i64 = 0;
    for _ in 0..500 {
        left = admin
            .query_one(&format!("SELECT count(*) {others}"), &[])
            .await
            .unwrap()
            .get(0);
        if left == 0 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(left, 0, "sessions the server had not let go after 5 s");
}

/// After the server ended the pool's sessions (a restart, a failover, or
/// `idle_session_timeout` on a quiet app), the reaper's first batch deletes the expired rows,
/// passing over the closed connections as every other step does. (It failed with "connection
/// closed" once for each closed connection the pool held: with `expire_periodically`, one
/// period each without deleting anything, every period where the server ends idle sessions
/// sooner than the period.)
#[actix_web::test]
async fn the_reaper_passes_over_connections_the_server_closed() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    // Four connections in the pool, all idle.
    let pool = store.connection_pool();
    drop(futures_util::future::join_all((0..4).map(|_| pool.get())).await);
    assert_eq!(pool.state().idle_connections, 4);
    insert_rows(&database, "expired", 10, "now() - interval '1 minute'").await;
    end_the_other_sessions(&database).await;
    assert_eq!(store.delete_expired(1_000).await.unwrap(), 10);
    assert_eq!(rows(&database, "idempotency_records").await, 0);
}

/// Waits until a session of `database` waits for a lock, and ends it, as a restart, a
/// failover or `pg_terminate_backend` ends a session while its statement runs.
async fn end_the_waiting_session(database: &TestDatabase) {
    let admin = database.connection().await;
    let waiting = "FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    for _ in 0..500 {
        let ended: i64 = admin
            .query_one(
                &format!("SELECT count(*) FROM (SELECT pg_terminate_backend(pid) {waiting}) e"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if ended > 0 {
            return;
        }
        actix_rt::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no session waited for a lock");
}

/// A `begin` and a commit whose session the server ends while they run (they wait for the
/// key's row, which another transaction holds) are sent again on a live connection and
/// answer as ever. (The statement met PostgreSQL's FATAL error before its connection had
/// read the end of the socket, so it was not seen as lost: a store error, so a 503, or for
/// a commit retries in the background while the client got its response.)
#[actix_web::test]
async fn steps_whose_session_ends_while_they_run_are_sent_again() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    let writer = database.connection().await;
    // `begin` takes an expired row over, and a commit completes the row: each waits while
    // the writer holds it.
    let old = LeaseToken::generate();
    let lapsing = Duration::from_millis(1);
    store
        .begin(&key("k"), &print(), &old, lapsing)
        .await
        .unwrap();
    actix_rt::time::sleep(Duration::from_millis(20)).await;
    let token = LeaseToken::generate();
    let hold = "BEGIN; SELECT 1 FROM idempotency_records FOR UPDATE";
    writer.batch_execute(hold).await.unwrap();
    let begun = actix_rt::spawn({
        let store = store.clone();
        async move { store.begin(&key("k"), &print(), &token, LEASE).await }
    });
    end_the_waiting_session(&database).await;
    writer.batch_execute("COMMIT").await.unwrap();
    assert_eq!(begun.await.unwrap().unwrap(), BeginOutcome::Acquired);
    writer.batch_execute(hold).await.unwrap();
    let committed = actix_rt::spawn({
        let store = store.clone();
        async move {
            let response = response();
            store
                .commit(&key("k"), &print(), &token, &response, LEASE)
                .await
        }
    });
    end_the_waiting_session(&database).await;
    writer.batch_execute("COMMIT").await.unwrap();
    assert!(committed.await.unwrap().unwrap());
    assert_eq!(
        begin_anew(&store, "k").await,
        BeginOutcome::Completed(response())
    );
}

#[actix_web::test]
async fn the_background_task_deletes_expired_rows() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    let token = LeaseToken::generate();
    store
        .begin(&key("short"), &print(), &token, Duration::from_millis(1))
        .await
        .unwrap();
    assert_eq!(rows(&database, "idempotency_records").await, 1);
    let task = actix_rt::spawn(store.clone().expire_periodically(Duration::from_millis(50)));
    for _ in 0..200 {
        if rows(&database, "idempotency_records").await == 0 {
            break;
        }
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
    task.abort();
    assert_eq!(rows(&database, "idempotency_records").await, 0);
}

#[actix_web::test]
async fn contended_begins_acquire_exactly_once_per_key() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    // Many rounds of many connections racing for one fresh key: some statements start
    // before the winner commits and find its row missing from their snapshot.
    let fingerprint = print();
    for round in 0..20 {
        let key = key(&format!("race-{round}"));
        let tokens: Vec<LeaseToken> = (0..32).map(|_| LeaseToken::generate()).collect();
        let outcomes = futures_util::future::join_all(
            tokens
                .iter()
                .map(|token| store.begin(&key, &fingerprint, token, LEASE)),
        )
        .await;
        let acquired = outcomes
            .iter()
            .filter(|outcome| matches!(outcome, Ok(BeginOutcome::Acquired)))
            .count();
        let in_flight = outcomes
            .iter()
            .filter(|outcome| matches!(outcome, Ok(BeginOutcome::InFlight)))
            .count();
        assert_eq!(
            (acquired, in_flight),
            (1, 31),
            "round {round}: {outcomes:?}"
        );
    }
}

/// The store resends a `begin` on a new connection when the first one closes; if the first
/// had landed, the resend finds the token's own row. Another statement may hold the key's
/// advisory lock at that moment (a duplicate's `begin`, a transactional claim trying it):
/// the row is still this token's, and `begin` stays idempotent for its token. (It used to
/// answer 409 to its own request, leaving the key locked for a lease with no handler.)
#[actix_web::test]
async fn a_token_holds_its_key_while_another_statement_holds_the_lock() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    let (key, token) = (key("k"), LeaseToken::generate());
    // The advisory lock of `k` in `idempotency_records`, as the unit test
    // `the_lock_id_of_a_known_key_never_changes` pins it, held by another transaction.
    let holder = database.connection().await;
    let hold = || holder.batch_execute("BEGIN; SELECT pg_advisory_xact_lock(6440539836243116760)");
    // It is the lock the store takes for `k`: while it is held, a `begin` of the key that has
    // no record finds it taken and claims nothing (in flight). A store that derived another
    // lock would acquire here, and the rest of the test would meet no contention.
    hold().await.unwrap();
    assert_eq!(
        store.begin(&key, &print(), &token, LEASE).await.unwrap(),
        BeginOutcome::InFlight,
        "the store does not take the pinned lock of `k`"
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        store.begin(&key, &print(), &token, LEASE).await.unwrap(),
        BeginOutcome::Acquired
    );
    hold().await.unwrap();
    assert_eq!(
        store.begin(&key, &print(), &token, LEASE).await.unwrap(),
        BeginOutcome::Acquired
    );
    assert_eq!(
        store
            .begin(&key, &print(), &LeaseToken::generate(), LEASE)
            .await
            .unwrap(),
        BeginOutcome::InFlight
    );
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        store
            .commit(&key, &print(), &token, &response(), LEASE)
            .await
            .unwrap()
    );
}

/// A commit whose record is gone writes it anew where the key is free, also when the key's
/// advisory lock is busy at that moment (another token's `abandon`, a late `begin` of an
/// abandoned token: one statement each, here a transaction that lets it go once the
/// re-creation found it busy), and
/// a retry gets the replay. (It used to answer false at once: the record was not written
/// anew, and a retry ran the handler again.) A lock that stays taken is a transaction's that
/// holds the key: the commit then writes nothing.
#[actix_web::test]
async fn a_lost_record_is_written_anew_while_the_keys_lock_is_busy_for_a_moment() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    let (key, token) = (key("k"), LeaseToken::generate());
    assert_eq!(
        store.begin(&key, &print(), &token, LEASE).await.unwrap(),
        BeginOutcome::Acquired
    );
    let holder = database.connection().await;
    holder
        .batch_execute("DELETE FROM idempotency_records")
        .await
        .unwrap();
    // The lock of `k`, as `a_token_holds_its_key_while_another_statement_holds_the_lock`
    // pins it.
    let hold = || holder.batch_execute("BEGIN; SELECT pg_advisory_xact_lock(6440539836243116760)");
    hold().await.unwrap();
    assert!(
        !store
            .commit(&key, &print(), &token, &response(), LEASE)
            .await
            .unwrap(),
        "written anew while a transaction holds the key"
    );
    assert_eq!(rows(&database, "idempotency_records").await, 0);
    // The lock is let go once a re-creation sent from now on has found it busy (a backend of
    // this database ran one and is idle, paused before trying again), so the test shows the
    // retry, whatever the machine's speed.
    let watcher = database.connection().await;
    watcher
        .batch_execute("SELECT set_config('test.since', clock_timestamp()::text, false)")
        .await
        .unwrap();
    let released = async {
        // At most 5 s: a re-creation never sent fails the assertion below, not the run.
        for _ in 0..2_500 {
            let tried: bool = watcher
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                     WHERE datname = current_database() AND state = 'idle'
                       AND query LIKE '%anew AS%'
                       AND query_start > current_setting('test.since')::timestamptz)",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if tried {
                break;
            }
            actix_rt::time::sleep(Duration::from_millis(2)).await;
        }
        holder.batch_execute("ROLLBACK").await.unwrap();
    };
    let (committed, ()) = futures_util::future::join(
        store.commit(&key, &print(), &token, &response(), LEASE),
        released,
    )
    .await;
    assert!(committed.unwrap(), "not written anew");
    assert_eq!(
        store
            .begin(&key, &print(), &LeaseToken::generate(), LEASE)
            .await
            .unwrap(),
        BeginOutcome::Completed(response())
    );
}

#[actix_web::test]
async fn an_unreachable_server_is_a_store_error() {
    // A pool on a port where nothing listens: every operation is a store error, never a
    // hang or a panic.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let store = PostgresStore::new(
        PostgresStore::pool(&format!("postgres://postgres@127.0.0.1:{port}/postgres")).unwrap(),
    );
    let token = LeaseToken::generate();
    assert!(
        store
            .begin(&key("k"), &print(), &token, LEASE)
            .await
            .is_err()
    );
    assert!(store.migrate().await.is_err());
}

/// Runs 1 500 rounds of a `begin` of a fresh key racing three `inspect` calls on it (each
/// a lookup, or a deletion) through an `Inspector`, and checks that every `begin` acquired.
async fn first_begins_acquire_while_inspected<F, Fut, T>(inspect: F)
where
    F: Fn(Inspector<PostgresStore>, String) -> Fut,
    Fut: std::future::Future<Output = Result<T, idempotency_actix::InspectionError>>,
    T: std::fmt::Debug,
{
    let database = TestDatabase::create().await;
    let store = database.store().await;
    let inspector = Inspector::new(store.clone()).key_prefix("pg:");
    for round in 0..1500 {
        let name = format!("inspected-{round}");
        let token = LeaseToken::generate();
        let inspections = futures_util::future::join_all(
            (0..3).map(|_| inspect(inspector.clone(), name.clone())),
        );
        let (begun, inspected) = futures_util::future::join(
            store.begin(&key(&name), &print(), &token, LEASE),
            inspections,
        )
        .await;
        assert_eq!(begun.unwrap(), BeginOutcome::Acquired, "round {round}");
        for answer in inspected {
            answer.unwrap();
        }
    }
}

/// Inspection looks the key's advisory lock up (in `pg_locks`) instead of taking it:
/// taking it, however briefly, made a first `begin` of the key at that moment answer in
/// flight (a 409 to a request no other had claimed).
#[actix_web::test]
async fn lookups_never_make_a_first_begin_answer_in_flight() {
    first_begins_acquire_while_inspected(|inspector, name| async move {
        inspector.lookup(b"", &name).await
    })
    .await;
}

/// A transaction that holds a key's advisory lock (a transactional route's claim, its row
/// not yet committed) shows in a lookup as a record in flight without an expiry, although
/// the lookup no longer takes the lock itself.
#[actix_web::test]
async fn a_lookup_sees_a_key_whose_lock_another_transaction_holds_in_flight() {
    use idempotency_actix::RecordState;

    let database = TestDatabase::create().await;
    let inspector = Inspector::new(database.store().await).key_prefix("pg:");
    assert!(inspector.lookup(b"", "k").await.unwrap().is_none());
    // The lock of `k`, as `a_token_holds_its_key_while_another_statement_holds_the_lock` pins it.
    let holder = database.connection().await;
    holder
        .batch_execute("BEGIN; SELECT pg_advisory_xact_lock(6440539836243116760)")
        .await
        .unwrap();
    let found = inspector.lookup(b"", "k").await.unwrap().unwrap();
    assert_eq!(found.state, RecordState::InFlight);
    assert_eq!(found.expires_in, None);
    holder.batch_execute("ROLLBACK").await.unwrap();
    assert!(inspector.lookup(b"", "k").await.unwrap().is_none());
}

/// Deletion by hand looks the key's advisory lock up too, instead of taking it: a first
/// `begin` racing deletions of its key is never answered in flight.
#[actix_web::test]
async fn deletions_never_make_a_first_begin_answer_in_flight() {
    first_begins_acquire_while_inspected(|inspector, name| async move {
        inspector.delete(b"", &name).await
    })
    .await;
}

/// The pool's connections probe an idle database every 30 s (`PostgresStore::pool`: a
/// connection a NAT or firewall dropped without a word is closed within about a minute and
/// replaced, instead of failing every statement sent on it for up to two hours): `ss` shows
/// this process's connections to the database with their keepalive timer under a minute,
/// where tokio-postgres's own default leaves it at two hours.
#[actix_web::test]
async fn the_pools_connections_probe_an_idle_database_every_30_s() {
    let database = TestDatabase::create().await;
    let store = database.store().await;
    acquire(&store, "keepalives").await;
    let config: tokio_postgres::Config = database.url().parse().unwrap();
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let listed = std::process::Command::new("ss")
        .args(["-tnpoH", "state", "established"])
        .arg(format!("( dport = :{port} )"))
        .output()
        .expect("ss runs (apt-get install -y iproute2)");
    let listed = String::from_utf8_lossy(&listed.stdout);
    let ours = format!("pid={},", std::process::id());
    let timers: Vec<&str> = listed
        .lines()
        .filter(|line| line.contains(&ours))
        .filter_map(|line| line.split("timer:(keepalive,").nth(1))
        .filter_map(|timer| timer.split(',').next())
        .collect();
    assert!(
        timers
            .iter()
            .any(|left| left.ends_with("sec") || left.ends_with("ms")),
        "no connection of this process to the database probes within a minute: {timers:?} \
         in\n{listed}"
    );
}
