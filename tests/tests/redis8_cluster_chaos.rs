//! The Redis Cluster store on Redis 8.6 nodes (committed to by function) under failovers, with
//! the reference server: a primary stopped while commits wait for it, its replica promoted,
//! then the old primary woken.
//!
//! The nodes are `REDIS8_SERVER`, or `/opt/redis-8.6/bin/redis-server` (see
//! `idempotency_actix_tests::redis8_server`); the test fails with the install hint when
//! neither is there.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use idempotency_actix_tests::cluster::RedisCluster;
use idempotency_actix_tests::{ReferenceServer, unique_prefix};

/// `POST /orders?delay_ms=2000` with `key`: its status and body (`None` when the connection
/// failed).
fn order(addr: SocketAddr, key: &str) -> Option<(u16, Vec<u8>)> {
    let body = r#"{"item":"book","qty":1}"#;
    let mut stream = TcpStream::connect(addr).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("a read timeout");
    let request = format!(
        "POST /orders?delay_ms=2000 HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\
         Content-Type: application/json\r\nIdempotency-Key: \"{key}\"\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).ok()?;
    let text = String::from_utf8_lossy(&response);
    let status = text.get(9..12)?.parse().ok()?;
    let start = text.find("\r\n\r\n")? + 4;
    Some((status, response[start..].to_vec()))
}

/// 90 slow requests with new keys; while their handlers run, the primary of one third of
/// the slots is stopped (SIGSTOP) for 5 s, so their commits queue up on it and are sent
/// again, its replica takes over (`CLUSTER FAILOVER TAKEOVER`), and the old primary wakes:
/// it runs the commits queued for it before it learns it was demoted (the first completes
/// the record there, a resent one finds that and writes nothing), and the read after that
/// goes to the new primary, which holds the request's in-flight record. That commit was
/// taken for lost and given up, its lease no longer renewed: its key answered 409 until the
/// lease ran out, and the next retry ran the handler a second time. Where the read after
/// that reached the old primary before it learnt of its demotion, it found the record
/// completed, and the commit was taken as landed though the demotion dropped it (1 run in 8
/// under load; several keys in one run): a commit that lands in the background is now
/// looked at again a second later and sent again. Now every request's retry soon gets its
/// replay.
#[test]
fn a_primary_woken_after_its_replica_took_over_loses_no_commit() {
    let cluster = RedisCluster::start_redis8();
    let server = ReferenceServer::start(&[
        ("REDIS_CLUSTER_URLS", cluster.urls_env().as_str()),
        (
            "IDEMPOTENCY_PREFIX",
            unique_prefix("redis8-takeover").as_str(),
        ),
    ]);
    let addr = server.addr();
    let primary = cluster
        .primaries()
        .into_iter()
        .find(|primary| {
            primary
                .slots
                .iter()
                .any(|&(first, last)| (first..=last).contains(&16_000))
        })
        .expect("a primary serves slot 16000")
        .port;
    let replica = cluster.replica_of(primary);
    let keys: Vec<String> = (0..90)
        .map(|i| format!("takeover-{}-{i}", uuid::Uuid::new_v4().simple()))
        .collect();
    let requests: Vec<_> = keys
        .iter()
        .map(|key| {
            let key = key.clone();
            std::thread::spawn(move || order(addr, &key))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    cluster.pause(primary);
    std::thread::sleep(Duration::from_secs(5));
    // Unless the cluster promoted it already (the node timeout is 3 s): then the replica
    // refuses, being a primary, and that is fine.
    let _: redis::RedisResult<()> = redis::cmd("CLUSTER")
        .arg("FAILOVER")
        .arg("TAKEOVER")
        .query(&mut cluster.connection(replica));
    std::thread::sleep(Duration::from_millis(300));
    cluster.resume(primary);
    // The fault happened: the replica serves the slots now (else the test proves nothing;
    // test review).
    let promoted = Instant::now() + Duration::from_secs(10);
    loop {
        let role: Vec<redis::Value> = redis::cmd("ROLE")
            .query(&mut cluster.connection(replica))
            .expect("ROLE");
        if matches!(role.first(), Some(redis::Value::BulkString(role)) if role == b"master") {
            break;
        }
        assert!(
            Instant::now() < promoted,
            "the replica was not promoted: {role:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let firsts: Vec<Option<(u16, Vec<u8>)>> = requests
        .into_iter()
        .map(|request| request.join().expect("the request's thread"))
        .collect();
    // Each key whose first request ran its handler (201) is committed once the cluster
    // settles: a retry gets its replay, the same bytes, not 409 for the rest of a 30 s lease
    // and then a second run.
    let settle = Instant::now() + Duration::from_secs(15);
    for (key, first) in keys.iter().zip(&firsts) {
        let Some((201, body)) = first else { continue };
        loop {
            match order(addr, key) {
                Some((201, replay)) => {
                    assert_eq!(&replay, body, "key {key}: the replay of the first response");
                    break;
                }
                retry => assert!(
                    Instant::now() < settle,
                    "key {key}: still {:?} 15 s after the failover (its commit was given up)",
                    retry.map(|(status, _)| status)
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    assert!(
        firsts.iter().flatten().any(|(status, _)| *status == 201),
        "some first requests ran their handler"
    );
}
