//! The Redis Cluster store on Redis 8.6 nodes (commits by `SET … IFEQ`) under failovers, with
//! the reference server: a primary stopped while commits wait for it, its replica promoted,
//! then the old primary woken.
//!
//! The nodes are `REDIS8_SERVER`, or `/opt/redis-8.6/bin/redis-server`, with the `redis-cli`
//! beside it (or on the `PATH`); a test fails with that message when neither is there.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotency_actix_tests::{ReferenceServer, unique_prefix};

/// Where the Redis 8.6 server is looked for when `REDIS8_SERVER` is unset.
const DEFAULT_SERVER: &str = "/opt/redis-8.6/bin/redis-server";

/// A 6-node Redis 8 cluster (3 primaries, each with a replica) on free loopback ports; the
/// nodes are killed and their directory removed on drop.
struct Cluster {
    server: PathBuf,
    dir: PathBuf,
    nodes: Vec<(u16, Child)>,
}

impl Cluster {
    fn start() -> Self {
        let server = std::env::var_os("REDIS8_SERVER")
            .map_or_else(|| PathBuf::from(DEFAULT_SERVER), PathBuf::from);
        assert!(
            server.exists(),
            "no Redis 8 server at {} (set REDIS8_SERVER to a redis-server ≥ 8.4)",
            server.display()
        );
        let dir = std::env::temp_dir().join(format!(
            "idempotency-redis8-cluster-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let mut cluster = Self {
            server,
            dir,
            nodes: Vec::new(),
        };
        for _ in 0..6 {
            let port = free_port_pair(&cluster.ports());
            let child = cluster.spawn(port);
            cluster.nodes.push((port, child));
        }
        for port in cluster.ports() {
            wait_until(&format!("node {port} to answer"), || {
                cli(&cluster.cli_path(), port, &["PING"]).trim() == "PONG"
            });
        }
        let addresses: Vec<String> = cluster
            .ports()
            .iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        let mut create = vec!["--cluster", "create"];
        create.extend(addresses.iter().map(String::as_str));
        create.extend(["--cluster-replicas", "1", "--cluster-yes"]);
        let created = cli(&cluster.cli_path(), cluster.ports()[0], &create);
        assert!(
            created.contains("All 16384 slots covered"),
            "redis-cli --cluster create failed:\n{created}"
        );
        cluster.wait_until_settled();
        cluster
    }

    fn spawn(&self, port: u16) -> Child {
        let dir = self.dir.join(port.to_string());
        std::fs::create_dir_all(&dir).expect("a directory for the node");
        Command::new(&self.server)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
            ])
            .args(["--cluster-node-timeout", "3000"])
            .args(["--cluster-replica-validity-factor", "0"])
            .args(["--save", "", "--appendonly", "no", "--logfile", "redis.log"])
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("cannot run {}: {error}", self.server.display()))
    }

    /// `redis-cli` beside the server, else the one on the `PATH`.
    fn cli_path(&self) -> PathBuf {
        let beside = self.server.with_file_name("redis-cli");
        if beside.exists() {
            beside
        } else {
            PathBuf::from("redis-cli")
        }
    }

    fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|(port, _)| *port).collect()
    }

    fn pid(&self, port: u16) -> u32 {
        self.nodes
            .iter()
            .find(|(node, _)| *node == port)
            .map(|(_, child)| child.id())
            .expect("a node of the cluster")
    }

    /// Every node says `cluster_state:ok` and every replica's link to its primary is up.
    fn wait_until_settled(&self) {
        let redis_cli = self.cli_path();
        for port in self.ports() {
            wait_until(&format!("node {port} to settle"), || {
                let state = cli(&redis_cli, port, &["CLUSTER", "INFO"]);
                let replication = cli(&redis_cli, port, &["INFO", "replication"]);
                state.contains("cluster_state:ok")
                    && (replication.contains("role:master")
                        || replication.contains("master_link_status:up"))
            });
        }
    }

    /// The primary that serves `slot` and its replica.
    fn primary_and_replica(&self, slot: u16) -> (u16, u16) {
        let nodes = cli(&self.cli_path(), self.ports()[0], &["CLUSTER", "NODES"]);
        let port_of = |address: &str| -> u16 {
            address
                .split(['@', ':'])
                .nth(1)
                .and_then(|port| port.parse().ok())
                .expect("a node address")
        };
        let primary = nodes
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|fields| {
                fields[2].contains("master")
                    && fields[8..].iter().any(|range| {
                        let (start, end) = range.split_once('-').unwrap_or((range, range));
                        let (start, end): (u16, u16) =
                            (start.parse().expect("a slot"), end.parse().expect("a slot"));
                        (start..=end).contains(&slot)
                    })
            })
            .expect("a primary for the slot");
        let replica = nodes
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .find(|fields| fields[3] == primary[0])
            .expect("a replica of the primary");
        (port_of(primary[1]), port_of(replica[1]))
    }

    fn urls(&self) -> String {
        self.ports()
            .iter()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.nodes {
            let _ = Command::new("kill")
                .args(["-CONT", &child.id().to_string()])
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn cli(cli: &Path, port: u16, args: &[&str]) -> String {
    let output = Command::new(cli)
        .args(["-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|error| panic!("cannot run {}: {error}", cli.display()));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A data port whose cluster bus port (+10000) is free too, not in `taken`.
fn free_port_pair(taken: &[u16]) -> u16 {
    for _ in 0..1_000 {
        let port = 20_000 + u16::try_from(uuid::Uuid::new_v4().as_u128() % 20_000).expect("fits");
        let bindable = |port: u16| TcpListener::bind(("127.0.0.1", port)).is_ok();
        if !taken.contains(&port) && bindable(port) && bindable(port + 10_000) {
            return port;
        }
    }
    panic!("no free pair of loopback ports");
}

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
/// lease ran out, and the next retry ran the handler a second time. Now every request's
/// retry soon gets its replay.
#[test]
fn a_primary_woken_after_its_replica_took_over_loses_no_commit() {
    let cluster = Cluster::start();
    let server = ReferenceServer::start(&[
        ("REDIS_CLUSTER_URLS", cluster.urls().as_str()),
        (
            "IDEMPOTENCY_PREFIX",
            unique_prefix("redis8-takeover").as_str(),
        ),
    ]);
    let addr = server.addr();
    let (primary, replica) = cluster.primary_and_replica(16_000);
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
    let pid = cluster.pid(primary).to_string();
    let signal = |name: &str| {
        let status = Command::new("kill")
            .args([name, &pid])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {name} {pid}");
    };
    signal("-STOP");
    std::thread::sleep(Duration::from_secs(5));
    // Unless the cluster promoted it already (the node timeout is 3 s).
    cli(
        &cluster.cli_path(),
        replica,
        &["CLUSTER", "FAILOVER", "TAKEOVER"],
    );
    std::thread::sleep(Duration::from_millis(300));
    signal("-CONT");

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
