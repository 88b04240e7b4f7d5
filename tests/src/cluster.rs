//! [`RedisCluster`]: a local Redis Cluster of the tests' own (3 primaries, 3 replicas), with
//! the faults the cluster tests inject: kill a primary, move slots, wait for the cluster to
//! agree again.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The highest data port a node may use: its cluster bus listens on the data port + 10000,
/// and both stay below Linux's default ephemeral range (32768–60999), from which the
/// kernel picks the local port of every outgoing connection and of every listener bound to
/// port 0 (the tests' private servers): a port found free there could be taken by one of
/// those before the node binds it.
const MAX_DATA_PORT: u16 = 22_767;
/// The lowest port tried, above the usual well-known and registered services.
const MIN_DATA_PORT: u16 = 20_000;
/// How long a node may stay silent before the others consider it failed. Short enough for
/// a failover within a few seconds, long enough that a loaded test machine does not make
/// healthy nodes look failed.
const NODE_TIMEOUT_MS: u32 = 3_000;
/// How long any wait for the cluster may take before the test fails.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A 6-node Redis Cluster (3 primaries, each with 1 replica) on free loopback ports, every
/// node a `redis-server --cluster-enabled yes` with its own directory under the system's
/// temporary directory, nothing persisted.
///
/// Dropping it kills the nodes and removes their directories. The one from
/// [`shared`](Self::shared) is never dropped (statics are not), so a watchdog process
/// does the same when the test binary exits, however it exits: it waits for the end of a
/// pipe that only the test process holds.
#[derive(Debug)]
pub struct RedisCluster {
    /// The node binary (`redis-server`, a Redis 8 one or a `valkey-server`), kept for
    /// restarts.
    server: PathBuf,
    dir: PathBuf,
    nodes: Mutex<Vec<Node>>,
    /// The watchdogs (one per batch of started nodes); each cleans up when its pipe closes.
    watchdogs: Mutex<Vec<Watchdog>>,
}

/// A shell that waits for the end of its stdin, then kills nodes and removes their
/// directories.
#[derive(Debug)]
struct Watchdog {
    process: Child,
    /// The write end of its stdin: nothing is written, only its closing matters.
    pipe: Option<ChildStdin>,
}

#[derive(Debug)]
struct Node {
    port: u16,
    child: Child,
    alive: bool,
}

/// One primary as the cluster reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Primary {
    /// Its data port on 127.0.0.1.
    pub port: u16,
    /// Its cluster node id.
    pub id: String,
    /// The slot ranges it serves (inclusive).
    pub slots: Vec<(u16, u16)>,
}

impl RedisCluster {
    /// The cluster of this test binary, started on first use.
    ///
    /// # Panics
    ///
    /// When the cluster cannot be started (see [`start`](Self::start)).
    pub fn shared() -> &'static Self {
        static SHARED: OnceLock<RedisCluster> = OnceLock::new();
        SHARED.get_or_init(Self::start)
    }

    /// A cluster of Valkey (≥ 8.1, see [`valkey_server`](crate::valkey_server)) nodes for
    /// this test binary, started on first use: its primaries take `SET … IFEQ`.
    ///
    /// # Panics
    ///
    /// When `valkey-server` is missing or older than 8.1 (with the install hint), or the
    /// cluster cannot be started (see [`start`](Self::start)).
    pub fn valkey_shared() -> &'static Self {
        static SHARED: OnceLock<RedisCluster> = OnceLock::new();
        SHARED.get_or_init(|| Self::start_nodes(crate::valkey_server()))
    }

    /// A cluster of Redis ≥ 8.4 (see [`redis8_server`](crate::redis8_server)) nodes for
    /// this test binary, started on first use: its primaries take `SET … IFEQ`.
    ///
    /// # Panics
    ///
    /// When no Redis ≥ 8.4 is found (with the install hint), or the cluster cannot be
    /// started (see [`start`](Self::start)).
    pub fn redis8_shared() -> &'static Self {
        static SHARED: OnceLock<RedisCluster> = OnceLock::new();
        SHARED.get_or_init(|| Self::start_nodes(crate::redis8_server()))
    }

    /// A cluster of Redis nodes without `SET … IFEQ` (7.0 to 8.2, see
    /// [`redis7_server`](crate::redis7_server)), started like [`start`](Self::start): its
    /// primaries commit by function, whatever the `PATH`'s `redis-server` is.
    ///
    /// # Panics
    ///
    /// When no such Redis is found (with the install hint), or the cluster cannot be
    /// started.
    pub fn start_redis7() -> Self {
        Self::start_nodes(crate::redis7_server())
    }

    /// A cluster of Redis ≥ 8.4 nodes of the caller's own (not shared: for tests that stop
    /// or fail over its nodes).
    ///
    /// # Panics
    ///
    /// As [`redis8_shared`](Self::redis8_shared).
    pub fn start_redis8() -> Self {
        Self::start_nodes(crate::redis8_server())
    }

    /// Starts the 6 nodes, creates the cluster with `redis-cli --cluster create` and waits
    /// until every node reports `cluster_state:ok`, every replica is in sync and all nodes
    /// agree on which primary serves which slots.
    ///
    /// Blocks the calling thread for a few seconds.
    ///
    /// # Panics
    ///
    /// When `redis-server` or `redis-cli` is missing, or the cluster does not settle
    /// within 60 s, with the nodes' logs.
    pub fn start() -> Self {
        Self::start_nodes(PathBuf::from("redis-server"))
    }

    /// [`start`](Self::start) with `server` as every node's binary.
    fn start_nodes(server: PathBuf) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "idempotency-cluster-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("a temporary directory for the cluster");
        let mut nodes = Vec::new();
        let mut taken = Vec::new();
        for _ in 0..6 {
            let (port, child) = spawn_own_node(&server, &dir, &mut taken);
            nodes.push(Node {
                port,
                child,
                alive: true,
            });
        }
        let watchdog = spawn_watchdog(&dir, &nodes);
        let cluster = Self {
            server,
            dir,
            nodes: Mutex::new(nodes),
            watchdogs: Mutex::new(vec![watchdog]),
        };
        for port in cluster.ports() {
            cluster.wait_for(&format!("node {port} to answer PING"), || {
                query::<String>(port, &mut redis::cmd("PING")).ok()
            });
        }
        cluster.create();
        cluster.wait_until_settled();
        cluster
    }

    fn create(&self) {
        let addresses: Vec<String> = self
            .ports()
            .iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|error| {
                panic!("cannot run redis-cli ({error}); install it with: apt-get install -y redis-server")
            });
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed ({}):\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// The data ports of the nodes that were not killed.
    pub fn ports(&self) -> Vec<u16> {
        self.lock_nodes()
            .iter()
            .filter(|node| node.alive)
            .map(|node| node.port)
            .collect()
    }

    /// The seed URLs of every node started (killed ones included: a client must cope with
    /// a dead seed).
    pub fn urls(&self) -> Vec<String> {
        self.lock_nodes()
            .iter()
            .map(|node| format!("redis://127.0.0.1:{}", node.port))
            .collect()
    }

    /// A client of this cluster with the settings of
    /// [`RedisClusterStore::client`](idempotency_actix::RedisClusterStore::client).
    pub fn client(&self) -> idempotency_actix::RedisClusterClient {
        idempotency_actix::RedisClusterStore::client(self.urls()).expect("valid node URLs")
    }

    /// [`urls`](Self::urls) joined by commas, as `REDIS_CLUSTER_URLS` takes them.
    pub fn urls_env(&self) -> String {
        self.urls().join(",")
    }

    /// The primaries as the first live node sees them, by port.
    pub fn primaries(&self) -> Vec<Primary> {
        let port = self.ports()[0];
        let mut primaries = parse_primaries(&cluster_nodes(port));
        primaries.sort_by_key(|primary| primary.port);
        primaries
    }

    /// The port of the primary that serves `key`'s slot.
    ///
    /// # Panics
    ///
    /// When no primary serves it (the cluster is not settled).
    pub fn primary_of(&self, key: &str) -> u16 {
        let slot = self.slot_of(key);
        self.primaries()
            .into_iter()
            .find(|primary| {
                primary
                    .slots
                    .iter()
                    .any(|&(first, last)| (first..=last).contains(&slot))
            })
            .unwrap_or_else(|| panic!("no primary serves slot {slot}"))
            .port
    }

    /// The hash slot of `key`.
    pub fn slot_of(&self, key: &str) -> u16 {
        let port = self.ports()[0];
        query(port, redis::cmd("CLUSTER").arg("KEYSLOT").arg(key)).expect("CLUSTER KEYSLOT")
    }

    /// Starts a new, empty node and has it join the cluster as a primary without slots
    /// (`CLUSTER MEET`, as a node added by hand: nothing is copied to it, functions
    /// included, unlike `redis-cli --cluster add-node`); returns its port once every node
    /// knows it. Give it slots with [`move_slots`](Self::move_slots).
    ///
    /// # Panics
    ///
    /// When the node does not start or join within 60 s.
    pub fn add_empty_primary(&self) -> u16 {
        let mut taken: Vec<u16> = self.lock_nodes().iter().map(|node| node.port).collect();
        let (port, child) = spawn_own_node(&self.server, &self.dir, &mut taken);
        let node = Node {
            port,
            child,
            alive: true,
        };
        let watchdog = spawn_watchdog(&self.dir, std::slice::from_ref(&node));
        self.watchdogs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(watchdog);
        let seed = self.ports()[0];
        self.lock_nodes().push(node);
        self.wait_for(&format!("node {port} to answer PING"), || {
            query::<String>(port, &mut redis::cmd("PING")).ok()
        });
        let _: () = query(
            seed,
            redis::cmd("CLUSTER").arg("MEET").arg("127.0.0.1").arg(port),
        )
        .expect("CLUSTER MEET");
        let id: String = query(port, redis::cmd("CLUSTER").arg("MYID")).expect("CLUSTER MYID");
        self.wait_for(&format!("every node to know node {port}"), || {
            self.ports()
                .iter()
                .all(|&other| {
                    cluster_nodes(other).lines().any(|line| {
                        line.starts_with(&id)
                            && !line.contains("handshake")
                            && line.contains("connected")
                    })
                })
                .then_some(())
        });
        // The new node learns the others by gossip: until every node has the same view,
        // `redis-cli --cluster reshard` refuses ("Nodes don't agree about configuration").
        self.wait_for("every node to agree about the configuration", || {
            Command::new("redis-cli")
                .args(["--cluster", "check", &format!("127.0.0.1:{seed}")])
                .stdin(Stdio::null())
                .output()
                .ok()
                .filter(|output| output.status.success())
                .map(|_| ())
        });
        port
    }

    /// Stops the node on `port` with SIGSTOP (a process that hangs: its sockets stay open
    /// and what is sent to it queues) until [`resume`](Self::resume); returns once it is
    /// stopped.
    pub fn pause(&self, port: u16) {
        crate::pause_process(self.pid(port), &format!("node {port}"));
    }

    /// Wakes the node on `port` that [`pause`](Self::pause) stopped (SIGCONT): it runs what
    /// queued meanwhile before it learns what the cluster decided without it.
    pub fn resume(&self, port: u16) {
        crate::signal_process(self.pid(port), "-CONT", &format!("node {port}"));
    }

    fn pid(&self, port: u16) -> u32 {
        self.lock_nodes()
            .iter()
            .find(|node| node.port == port && node.alive)
            .unwrap_or_else(|| panic!("no running node on port {port}"))
            .child
            .id()
    }

    /// The port of a replica of the primary on `primary`, as the first live node sees it.
    ///
    /// # Panics
    ///
    /// When that primary has no replica.
    pub fn replica_of(&self, primary: u16) -> u16 {
        let nodes = cluster_nodes(self.ports()[0]);
        let fields = |line: &str| {
            line.split_whitespace()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let port_of = |address: &str| -> u16 {
            address
                .split(['@', ':'])
                .nth(1)
                .and_then(|port| port.parse().ok())
                .unwrap_or_else(|| panic!("a node address: {address}"))
        };
        let id = nodes
            .lines()
            .map(fields)
            .find(|node| port_of(&node[1]) == primary)
            .unwrap_or_else(|| panic!("no node on port {primary}:\n{nodes}"))[0]
            .clone();
        nodes
            .lines()
            .map(fields)
            .find(|node| node[3] == id)
            .map(|node| port_of(&node[1]))
            .unwrap_or_else(|| panic!("no replica of {primary}:\n{nodes}"))
    }

    /// Kills the node on `port` with SIGKILL (a crash: it keeps nothing).
    pub fn kill(&self, port: u16) {
        let mut nodes = self.lock_nodes();
        let node = nodes
            .iter_mut()
            .find(|node| node.port == port)
            .unwrap_or_else(|| panic!("no node on port {port}"));
        let _ = node.child.kill();
        let _ = node.child.wait();
        node.alive = false;
    }

    /// Starts the killed node on `port` again, in its directory: it reads its cluster
    /// configuration, learns that a replica took its slots, and rejoins as that replica
    /// (call [`wait_until_settled`](Self::wait_until_settled) to wait for its sync).
    ///
    /// # Panics
    ///
    /// When no node was started on `port`, or it is still running.
    pub fn restart(&self, port: u16) {
        let mut nodes = self.lock_nodes();
        let node = nodes
            .iter_mut()
            .find(|node| node.port == port)
            .unwrap_or_else(|| panic!("no node on port {port}"));
        assert!(!node.alive, "node {port} is running");
        node.child = spawn_node(&self.server, &self.dir, port);
        node.alive = true;
        let watchdog = spawn_watchdog(&self.dir, std::slice::from_ref(node));
        self.watchdogs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(watchdog);
    }

    /// Moves `count` slots from the primary on `from` to the primary on `to` with
    /// `redis-cli --cluster reshard` (keys are migrated with `MIGRATE` while clients keep
    /// writing; they are redirected with `ASK` and `MOVED`), then waits until all nodes
    /// agree again.
    ///
    /// # Panics
    ///
    /// When redis-cli fails, with its output.
    pub fn move_slots(&self, from: u16, to: u16, count: u16) {
        let id_of = |port: u16| -> String {
            query(port, redis::cmd("CLUSTER").arg("MYID"))
                .unwrap_or_else(|error| panic!("CLUSTER MYID on {port}: {error}"))
        };
        let output = Command::new("redis-cli")
            .args(["--cluster", "reshard", &format!("127.0.0.1:{from}")])
            .args(["--cluster-from", &id_of(from)])
            .args(["--cluster-to", &id_of(to)])
            .args(["--cluster-slots", &count.to_string()])
            // Few keys per MIGRATE, so requests keep meeting keys on both sides.
            .args(["--cluster-pipeline", "10", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli runs");
        assert!(
            output.status.success(),
            "redis-cli --cluster reshard failed ({}):\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        self.wait_until_settled();
    }

    /// Waits until the live nodes have promoted a replica for every dead primary: every
    /// live node reports `cluster_state:ok`, all agree on who serves which slot, every slot
    /// is served by a live primary, and every live replica is in sync.
    ///
    /// # Panics
    ///
    /// After 60 s without that, with the nodes' logs.
    pub fn wait_until_settled(&self) {
        self.wait_for("the cluster to settle", || self.settled().then_some(()));
    }

    fn settled(&self) -> bool {
        let live = self.ports();
        let mut views = Vec::new();
        for &port in &live {
            let Ok(info) = query::<String>(port, redis::cmd("CLUSTER").arg("INFO")) else {
                return false;
            };
            if !info.contains("cluster_state:ok") {
                return false;
            }
            let Ok(replication) = query::<String>(port, redis::cmd("INFO").arg("replication"))
            else {
                return false;
            };
            if replication.contains("role:slave") && !replication.contains("master_link_status:up")
            {
                return false;
            }
            let nodes = cluster_nodes(port);
            // `[slot->-id]` and `[slot-<-id]` mark a slot being migrated or imported.
            if nodes.is_empty() || nodes.contains("->-") || nodes.contains("-<-") {
                return false;
            }
            let mut primaries = parse_primaries(&nodes);
            primaries.sort_by_key(|primary| primary.port);
            views.push(primaries);
        }
        let Some(first) = views.first() else {
            return false;
        };
        let covered: u32 = first
            .iter()
            .flat_map(|primary| &primary.slots)
            .map(|&(a, b)| u32::from(b - a) + 1)
            .sum();
        views.iter().all(|view| view == first)
            && covered == 16_384
            && first.iter().all(|primary| live.contains(&primary.port))
    }

    /// How many keys that start with `prefix` each primary holds (port → count).
    pub fn count_keys_by_primary(&self, prefix: &str) -> BTreeMap<u16, usize> {
        self.primaries()
            .iter()
            .map(|primary| (primary.port, keys_on_node(primary.port, prefix).len()))
            .collect()
    }

    /// Deletes every key that starts with `prefix`, on whichever primary holds it (as an
    /// eviction or a failover that lost writes would), and says how many there were.
    ///
    /// # Panics
    ///
    /// When a primary does not answer.
    pub fn delete_keys(&self, prefix: &str) -> usize {
        let mut deleted = 0;
        for primary in self.primaries() {
            let mut connection = self.connection(primary.port);
            for key in keys_on_node(primary.port, prefix) {
                let removed: usize = redis::cmd("DEL")
                    .arg(&key)
                    .query(&mut connection)
                    .unwrap_or_else(|error| panic!("DEL {key} on {}: {error}", primary.port));
                deleted += removed;
            }
        }
        deleted
    }

    /// A plain connection to the node on `port`.
    ///
    /// # Panics
    ///
    /// When it does not accept one.
    pub fn connection(&self, port: u16) -> redis::Connection {
        node_connection(port).unwrap_or_else(|error| panic!("node {port}: {error}"))
    }

    fn wait_for<T>(&self, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
        let started = Instant::now();
        while started.elapsed() < SETTLE_TIMEOUT {
            if let Some(value) = probe() {
                return value;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!(
            "timed out after {SETTLE_TIMEOUT:?} waiting for {what}; node logs:\n{}",
            self.logs()
        );
    }

    /// The tail of every node's log, for failure messages.
    pub fn logs(&self) -> String {
        self.lock_nodes()
            .iter()
            .map(|node| {
                let log = std::fs::read_to_string(node_dir(&self.dir, node.port).join("redis.log"))
                    .unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- node {} ---\n{}", node.port, tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn lock_nodes(&self) -> std::sync::MutexGuard<'_, Vec<Node>> {
        self.nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in self.lock_nodes().iter_mut() {
            let _ = node.child.kill();
            let _ = node.child.wait();
        }
        let watchdogs = self
            .watchdogs
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for watchdog in watchdogs.iter_mut() {
            drop(watchdog.pipe.take());
            let _ = watchdog.process.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A data port whose bus port (+10000) is free too, not in `taken`.
/// Spawns a node on a free pair of ports and waits until it answers as itself (`INFO
/// server`'s `process_id`): a port found free may be taken by another test's server before
/// the node binds it, and the node then exits while the other server answers on its port.
/// Tries other ports then; every port tried is added to `taken`.
fn spawn_own_node(server: &Path, dir: &Path, taken: &mut Vec<u16>) -> (u16, Child) {
    for _ in 0..5 {
        let port = free_port_pair(taken);
        taken.push(port);
        let mut child = spawn_node(server, dir, port);
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if matches!(child.try_wait(), Ok(Some(_))) {
                break;
            }
            let info: redis::RedisResult<String> = query(port, redis::cmd("INFO").arg("server"));
            if info.is_ok_and(|info| crate::info_names_process(&info, child.id())) {
                return (port, child);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("no cluster node could listen on any of 5 free pairs of loopback ports");
}

fn free_port_pair(taken: &[u16]) -> u16 {
    let span = u128::from(MAX_DATA_PORT - MIN_DATA_PORT);
    for _ in 0..1_000 {
        let offset = u16::try_from(uuid::Uuid::new_v4().as_u128() % span).expect("in range");
        let port = MIN_DATA_PORT + offset;
        let bindable = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
        if !taken.contains(&port) && bindable(port) && bindable(port + 10_000) {
            return port;
        }
    }
    panic!("no free pair of loopback ports found");
}

fn node_dir(dir: &Path, port: u16) -> PathBuf {
    dir.join(port.to_string())
}

fn spawn_node(server: &Path, dir: &Path, port: u16) -> Child {
    let node_dir = node_dir(dir, port);
    std::fs::create_dir_all(&node_dir).expect("a directory for the node");
    Command::new(server)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args([
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
        ])
        .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
        // A replica may always take over, however long it was cut off.
        .args(["--cluster-replica-validity-factor", "0"])
        .args(["--save", "", "--appendonly", "no"])
        .args(["--logfile", "redis.log"])
        .current_dir(&node_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "cannot run {} ({error}); install it with: apt-get install -y redis-server",
                server.display()
            )
        })
}

/// A shell that waits for its stdin to close (the test process exited, however it
/// exited), then kills the nodes and removes their directories.
fn spawn_watchdog(dir: &Path, nodes: &[Node]) -> Watchdog {
    let pids: Vec<String> = nodes
        .iter()
        .map(|node| node.child.id().to_string())
        .collect();
    let script = format!(
        "read -r _; kill -9 {} 2>/dev/null; rm -rf '{}'",
        pids.join(" "),
        dir.display()
    );
    let mut process = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sh runs");
    let pipe = process.stdin.take();
    Watchdog { process, pipe }
}

fn node_connection(port: u16) -> redis::RedisResult<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_connection_with_timeout(Duration::from_secs(2))
}

fn query<T: redis::FromRedisValue>(port: u16, command: &mut redis::Cmd) -> redis::RedisResult<T> {
    let mut connection = node_connection(port)?;
    connection.set_read_timeout(Some(Duration::from_secs(2)))?;
    command.query(&mut connection)
}

fn cluster_nodes(port: u16) -> String {
    query(port, redis::cmd("CLUSTER").arg("NODES")).unwrap_or_default()
}

/// The primaries that serve slots, from `CLUSTER NODES` output (failed nodes left out).
fn parse_primaries(nodes: &str) -> Vec<Primary> {
    nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let flags = fields.get(2)?;
            if !flags.contains("master") || flags.contains("fail") || fields.len() <= 8 {
                return None;
            }
            let address = fields[1].split('@').next()?;
            let port = address.rsplit(':').next()?.parse().ok()?;
            let slots = fields[8..]
                .iter()
                .filter(|range| !range.starts_with('['))
                .filter_map(|range| match range.split_once('-') {
                    Some((first, last)) => Some((first.parse().ok()?, last.parse().ok()?)),
                    None => range.parse().ok().map(|slot| (slot, slot)),
                })
                .collect();
            Some(Primary {
                port,
                id: fields[0].to_owned(),
                slots,
            })
        })
        .collect()
}

fn keys_on_node(port: u16, prefix: &str) -> Vec<String> {
    let mut connection = node_connection(port).expect("a connection to the node");
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query(&mut connection)
            .expect("SCAN");
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn primaries_are_read_from_cluster_nodes() {
        let nodes = "\
a1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:30002@40002 master - 0 0 2 connected 5461-10922 [5461->-c3]
c3 127.0.0.1:30003@40003 master,fail - 0 0 3 connected
d4 127.0.0.1:30004@40004 slave a1 0 0 1 connected
e5 127.0.0.1:30005@40005 master - 0 0 7 connected 10923-16383 42
";
        assert_eq!(
            parse_primaries(nodes),
            vec![
                Primary {
                    port: 30001,
                    id: "a1".to_owned(),
                    slots: vec![(0, 5460)]
                },
                Primary {
                    port: 30002,
                    id: "b2".to_owned(),
                    slots: vec![(5461, 10922)]
                },
                Primary {
                    port: 30005,
                    id: "e5".to_owned(),
                    slots: vec![(10923, 16383), (42, 42)]
                },
            ]
        );
    }
}
