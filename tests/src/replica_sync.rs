//! A replica in sync as its primary's `WAIT` counts it, before a test's first replicated
//! write: what [`PrivateRedis::start_replica_of`] waits for.
//!
//! The replica's link up is not enough: after a diskless sync the primary lists the replica
//! online (with an acknowledged offset of 0) and holds back the replication stream, the
//! `GETACK` of a `WAIT` included, until the replica's first acknowledgement arrives: its
//! once-a-second `REPLCONF ACK`. A `WAIT` of a few hundred milliseconds in that window
//! reports no replica at all (a `NotReplicated { acknowledged: 0 }` error, a 503), and on a
//! fresh primary, whose offset is still 0, the offsets alone do not show the window.

use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;

use crate::PrivateRedis;

/// How long a replica may take to catch up, with room for a loaded machine (it acknowledges
/// its offset once a second).
const CATCH_UP_WITHIN: Duration = Duration::from_secs(20);

/// Waits until `replica` has caught up with `primary`: once a write (a `PUBLISH`, which
/// touches no key) has moved the primary's replication offset on, the replica reports its
/// link up (`master_link_status:up`) and that offset as its own, and the primary lists it
/// online with that offset acknowledged (`INFO replication` on both).
///
/// # Panics
///
/// When it has not caught up within 20 s, with what both last said.
pub(crate) async fn wait_until_in_sync(primary: &PrivateRedis, replica: &PrivateRedis) {
    let (mut primary, mut replica) = (Asked::new(primary).await, Asked::new(replica).await);
    let _: i64 = redis::cmd("PUBLISH")
        .arg("idempotency-actix-tests:replica-sync")
        .arg("")
        .query_async(&mut primary.connection)
        .await
        .unwrap_or_else(|error| panic!("PUBLISH on port {}: {error}", primary.port));
    let target = Seen::now(&mut primary, &mut replica).await.primary_offset;
    let started = Instant::now();
    loop {
        let seen = Seen::now(&mut primary, &mut replica).await;
        if seen.in_sync(target) {
            return;
        }
        assert!(
            started.elapsed() < CATCH_UP_WITHIN,
            "the replica on port {} had not caught up with its primary on port {} (offset \
             {target}) after {:?}: {seen:?}",
            replica.port,
            primary.port,
            started.elapsed()
        );
        actix_rt::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A server [`wait_until_in_sync`] asks, on a connection of its own that waits for each
/// reply as long as the whole catch-up may take. redis-rs gives up on a reply after 500 ms
/// by default, which a loaded machine can exceed (the server, or this test's thread, kept
/// off the CPU): the wait then failed on the `INFO replication` it had asked for (seen once
/// under the whole suite), where the answer was only late.
struct Asked {
    port: u16,
    connection: MultiplexedConnection,
}

impl Asked {
    async fn new(server: &PrivateRedis) -> Self {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CATCH_UP_WITHIN))
            .set_response_timeout(Some(CATCH_UP_WITHIN));
        let connection = redis::Client::open(server.url())
            .expect("valid URL")
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .unwrap_or_else(|error| panic!("connecting to port {}: {error}", server.port()));
        Self {
            port: server.port(),
            connection,
        }
    }

    /// Its `INFO replication`.
    async fn replication_info(&mut self) -> String {
        redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut self.connection)
            .await
            .unwrap_or_else(|error| panic!("INFO replication on port {}: {error}", self.port))
    }
}

/// What a primary and its replica say of their replication, the primary asked first.
#[derive(Debug)]
struct Seen {
    /// The primary's `master_repl_offset`.
    primary_offset: u64,
    /// The primary's line for the replica (`slaveN:ip=…,port=…,state=…,offset=…,lag=…`).
    primary_lists: Option<String>,
    /// The replica's `master_link_status`.
    replica_link: Option<String>,
    /// The replica's `slave_repl_offset`.
    replica_offset: Option<u64>,
}

impl Seen {
    async fn now(primary: &mut Asked, replica: &mut Asked) -> Self {
        let on_primary = primary.replication_info().await;
        let on_replica = replica.replication_info().await;
        let port = format!("port={}", replica.port);
        Self {
            primary_offset: field(&on_primary, "master_repl_offset")
                .and_then(|offset| offset.parse().ok())
                .expect("the primary's master_repl_offset"),
            primary_lists: on_primary
                .lines()
                .find(|line| line.starts_with("slave") && line.split(',').any(|kv| kv == port))
                .map(str::to_owned),
            replica_link: field(&on_replica, "master_link_status").map(str::to_owned),
            replica_offset: field(&on_replica, "slave_repl_offset")
                .and_then(|offset| offset.parse().ok()),
        }
    }

    /// Whether the replica has `target` of the primary's offset, and the primary knows it.
    fn in_sync(&self, target: u64) -> bool {
        let listed = |name: &str| {
            let line = self.primary_lists.as_deref()?;
            let (_, values) = line.split_once(':')?;
            values
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        };
        let acknowledged = listed("offset").and_then(|offset| offset.parse::<u64>().ok());
        self.replica_link.as_deref() == Some("up")
            && self.replica_offset >= Some(target)
            && listed("state") == Some("online")
            && acknowledged >= Some(target)
    }
}

/// The value of `name` in `info` (`name:value` lines).
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}
