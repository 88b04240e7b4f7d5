//! The load benchmark (DESIGN §10): the reference server in every mode against a private
//! `redis-server`, loaded by `wrk`, each figure next to the unprotected baseline of the same
//! run. Run it with
//!
//! ```sh
//! cargo run --release -p idempotency-actix-examples --example load_benchmark
//! ```
//!
//! It builds the reference server (release), starts one `redis-server` of its own on a free
//! loopback port (never 6379), and for each mode starts the reference server with
//! `WORKERS=1`, warms it up, and runs `wrk -t1 -c32` against `POST /orders`. Modes:
//!
//! | mode | server | requests |
//! |---|---|---|
//! | baseline | `IDEMPOTENCY=off`, measured before and after every mode | a new key each |
//! | Redis, new key | `REDIS_URL` | a new key each |
//! | Redis, replay | `REDIS_URL` | one key, completed before the run |
//! | Redis, replay, cache | `REDIS_URL`, `REPLAY_CACHE=on` | one key, completed before the run |
//! | memory, new key | in-memory store | a new key each |
//! | memory, replay | in-memory store | one key, completed before the run |
//! | Redis, no key | `REDIS_URL` | no key (the route is protected, the key optional) |
//!
//! Every mode runs the same `wrk` Lua script (only the key differs), so the load tool costs
//! the same everywhere. Each mode's ratio is to the mean of the baselines measured just
//! before and just after it (the baseline rows' own ratios are to the mean of all of them,
//! a measure of how steady the machine was). Printed per mode: requests per second and its ratio to the baseline,
//! p99 latency, server CPU per request (`/proc/PID/stat` user + system time over the run ÷
//! requests), Redis CPU per request (`INFO cpu`) and Redis commands per request
//! (`INFO commandstats`), wrk's CPU per request (this process's waited-for children), and the
//! number of responses that were not 2xx (should be 0). "× baseline by CPU" is the ratio of
//! the CPU all three processes (server, Redis, wrk) spend per request, baseline over mode:
//! what the throughput ratio comes to when they have the machine's cores to themselves, and
//! steady while other processes load the machine (the req/s ratio is not).
//!
//! Environment: `BENCH_SECONDS` [8] per mode, `BENCH_CONNECTIONS` [32].
//! Needs `wrk` and `redis-server` (`apt-get install -y wrk redis-server`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

type Error = Box<dyn std::error::Error>;

/// How the requests of a mode carry their key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Keys {
    /// A new key for every request.
    New,
    /// One key, completed before the run: every request is a replay.
    Replay,
    /// No key at all.
    None,
}

struct Mode {
    name: &'static str,
    env: &'static [(&'static str, &'static str)],
    redis: bool,
    keys: Keys,
    /// The target ratio to the baseline (DESIGN §10), if there is one.
    target: Option<f64>,
}

const BASELINE: Mode = Mode {
    name: "baseline (IDEMPOTENCY=off)",
    env: &[("IDEMPOTENCY", "off")],
    redis: false,
    keys: Keys::New,
    target: None,
};

const MODES: [Mode; 6] = [
    Mode {
        name: "Redis, new key",
        env: &[],
        redis: true,
        keys: Keys::New,
        target: Some(0.50),
    },
    Mode {
        name: "Redis, replay",
        env: &[],
        redis: true,
        keys: Keys::Replay,
        target: Some(0.65),
    },
    Mode {
        name: "Redis, replay, REPLAY_CACHE=on",
        env: &[("REPLAY_CACHE", "on")],
        redis: true,
        keys: Keys::Replay,
        target: Some(0.90),
    },
    Mode {
        name: "memory, new key",
        env: &[],
        redis: false,
        keys: Keys::New,
        target: Some(0.60),
    },
    Mode {
        name: "memory, replay",
        env: &[],
        redis: false,
        keys: Keys::Replay,
        target: Some(0.90),
    },
    Mode {
        name: "Redis, no key (protected route)",
        env: &[],
        redis: true,
        keys: Keys::None,
        target: Some(0.95),
    },
];

/// What one mode measured.
struct Measured {
    /// CPU per request of all three processes: the server, Redis and wrk.
    total_cpu_per_request: Duration,
    per_second: f64,
    p99: Duration,
    not_2xx: u64,
    server_cpu_per_request: Duration,
    wrk_cpu_per_request: Duration,
    redis_cpu_per_request: Option<Duration>,
    redis_commands_per_request: Option<f64>,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("load_benchmark: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Error> {
    for (tool, package) in [("wrk", "wrk"), ("redis-server", "redis-server")] {
        if Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            return Err(format!("`{tool}` is not installed: apt-get install -y {package}").into());
        }
    }
    let seconds: u64 = env_number("BENCH_SECONDS", 8)?;
    let connections: u64 = env_number("BENCH_CONNECTIONS", 32)?;
    let server = build_reference_server()?;
    let work =
        std::env::temp_dir().join(format!("idempotency-load-benchmark-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let redis = Redis::start(&work)?;

    println!(
        "wrk -t1 -c{connections} -d{seconds}s, POST /orders, WORKERS=1, private redis-server on port {}",
        redis.port
    );
    println!("load before: {}", load_average());
    let load = Load {
        server: &server,
        work: &work,
        redis: &redis,
        seconds,
        connections,
    };
    // The baseline runs before and after every mode; each mode is compared with the mean of
    // the two baselines around it, so a change in the machine's load during the run (other
    // processes) moves both sides of a ratio alike.
    let mut baselines = vec![load.measure(&BASELINE)?];
    let mut results = Vec::new();
    for mode in &MODES {
        let measured = load.measure(mode)?;
        baselines.push(load.measure(&BASELINE)?);
        let around = &baselines[baselines.len() - 2..];
        let baseline = Baseline {
            per_second: (around[0].per_second + around[1].per_second) / 2.0,
            total_cpu: (around[0].total_cpu_per_request + around[1].total_cpu_per_request) / 2,
        };
        results.push((mode, measured, baseline));
    }
    println!("load after: {}", load_average());

    println!();
    println!(
        "| mode | req/s | × baseline (target) | × baseline by CPU | p99 | server CPU / req | Redis CPU / req | wrk CPU / req | Redis commands / req | non-2xx |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let count = baselines.len() as f64;
    let mean = Baseline {
        per_second: baselines.iter().map(|b| b.per_second).sum::<f64>() / count,
        total_cpu: baselines
            .iter()
            .map(|b| b.total_cpu_per_request)
            .sum::<Duration>()
            .div_f64(count),
    };
    for (i, measured) in baselines.iter().enumerate() {
        print_row(&format!("baseline {}", i + 1), measured, &mean, None);
    }
    for (mode, measured, baseline) in &results {
        print_row(mode.name, measured, baseline, mode.target);
    }
    let _ = std::fs::remove_dir_all(&work);
    Ok(())
}

/// The baseline a mode is compared with.
struct Baseline {
    per_second: f64,
    total_cpu: Duration,
}

fn print_row(name: &str, measured: &Measured, baseline: &Baseline, target: Option<f64>) {
    let ratio = measured.per_second / baseline.per_second;
    let ratio = match target {
        Some(target) => format!(
            "{ratio:.2}× (≥ {target:.2}{})",
            if ratio >= target { "" } else { ", missed" }
        ),
        None => format!("{ratio:.2}×"),
    };
    let by_cpu = baseline.total_cpu.as_secs_f64() / measured.total_cpu_per_request.as_secs_f64();
    let micros = |duration: Duration| format!("{:.1} µs", duration.as_secs_f64() * 1e6);
    println!(
        "| {name} | {:.0} | {ratio} | {by_cpu:.2}× | {:.2} ms | {} | {} | {} | {} | {} |",
        measured.per_second,
        measured.p99.as_secs_f64() * 1e3,
        micros(measured.server_cpu_per_request),
        measured
            .redis_cpu_per_request
            .map_or("—".to_owned(), micros),
        micros(measured.wrk_cpu_per_request),
        measured
            .redis_commands_per_request
            .map_or("—".to_owned(), |commands| format!("{commands:.2}")),
        measured.not_2xx,
    );
}

fn env_number(name: &str, default: u64) -> Result<u64, Error> {
    match std::env::var(name) {
        Ok(value) => Ok(value
            .parse()
            .map_err(|_| format!("{name}={value:?} is not a number"))?),
        Err(_) => Ok(default),
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|line| {
            line.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Builds the reference server (release) and returns its path, next to this executable.
fn build_reference_server() -> Result<PathBuf, Error> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let status = Command::new(cargo)
        .args([
            "build",
            "--release",
            "-p",
            "idempotency-actix-examples",
            "--example",
            "reference_server",
        ])
        .status()?;
    if !status.success() {
        return Err("building the reference server failed".into());
    }
    let here = std::env::current_exe()?;
    let path = here
        .parent()
        .ok_or("this executable has no directory")?
        .join("reference_server");
    if !path.exists() {
        return Err(format!("no reference server at {}", path.display()).into());
    }
    Ok(path)
}

/// A `redis-server` of the benchmark's own, on a free loopback port.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start(work: &Path) -> Result<Self, Error> {
        let port = free_port()?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .current_dir(work)
            .stdout(Stdio::null())
            .spawn()?;
        let redis = Self { child, port };
        let started = Instant::now();
        while redis
            .cli(&["PING"])
            .map(|pong| pong.trim() != "PONG")
            .unwrap_or(true)
        {
            if started.elapsed() > Duration::from_secs(10) {
                return Err("redis-server did not answer PING within 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(redis)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cli(&self, args: &[&str]) -> Result<String, Error> {
        let output = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()?;
        Ok(String::from_utf8(output.stdout)?)
    }

    /// User + system CPU time of the server so far.
    fn cpu(&self) -> Result<Duration, Error> {
        let info = self.cli(&["INFO", "cpu"])?;
        let field = |name: &str| -> f64 {
            info.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|value| value.trim().parse().ok())
                .unwrap_or(0.0)
        };
        Ok(Duration::from_secs_f64(
            field("used_cpu_sys") + field("used_cpu_user"),
        ))
    }

    /// Commands run since the last reset (what clients sent and what scripts ran), leaving
    /// out this benchmark's own `INFO`/`CONFIG`; then resets the counts.
    fn take_commands(&self) -> Result<BTreeMap<String, u64>, Error> {
        let info = self.cli(&["INFO", "commandstats"])?;
        self.cli(&["CONFIG", "RESETSTAT"])?;
        Ok(info
            .lines()
            .filter_map(|line| {
                let (name, stats) = line.trim().strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = stats.split(',').find_map(|s| s.strip_prefix("calls="))?;
                Some((name.to_owned(), calls.parse().ok()?))
            })
            .filter(|(name, _)| !["info", "config"].contains(&name.as_str()))
            .collect())
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16, Error> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Everything a measurement needs.
struct Load<'a> {
    server: &'a Path,
    work: &'a Path,
    redis: &'a Redis,
    seconds: u64,
    connections: u64,
}

impl Load<'_> {
    fn measure(&self, mode: &Mode) -> Result<Measured, Error> {
        eprintln!("load_benchmark: {} ...", mode.name);
        let prefix = format!(
            "bench-{}:",
            mode.name.replace([' ', ',', '(', ')', '='], "")
        );
        let mut command = Command::new(self.server);
        command
            .env("BIND", "127.0.0.1:0")
            .env("WORKERS", "1")
            .env("IDEMPOTENCY_PREFIX", &prefix)
            .env_remove("REDIS_URL")
            .env_remove("REPLAY_CACHE")
            .env_remove("IDEMPOTENCY")
            .env_remove("IDEMPOTENCY_METHODS");
        if mode.redis {
            command.env("REDIS_URL", self.redis.url());
        }
        for (name, value) in mode.env {
            command.env(name, value);
        }
        let server = Server::start(command, &self.work.join("server.log"))?;

        let fixed_key = "load-benchmark-replay";
        if mode.keys == Keys::Replay {
            let first = post(server.addr, Some(fixed_key))?;
            let again = post(server.addr, Some(fixed_key))?;
            if !first.starts_with("HTTP/1.1 201")
                || !again
                    .to_ascii_lowercase()
                    .contains("idempotent-replayed: true")
            {
                return Err(format!("the replay key did not replay:\n{first}\n{again}").into());
            }
        }
        let script = self.work.join("request.lua");
        std::fs::write(&script, lua_script(mode.keys, fixed_key))?;
        let url = format!("http://{}/orders", server.addr);

        // Warm up (connections, caches, the script load), then measure.
        self.wrk(&script, &url, 1)?;
        let server_cpu = process_cpu(server.child.id())?;
        let redis_cpu = self.redis.cpu()?;
        self.redis.take_commands()?;
        let wrk_cpu = children_cpu()?;
        let run = self.wrk(&script, &url, self.seconds)?;
        let wrk_cpu = children_cpu()?.saturating_sub(wrk_cpu);
        let server_cpu = process_cpu(server.child.id())?.saturating_sub(server_cpu);
        let redis_cpu = if mode.redis {
            self.redis.cpu()?.saturating_sub(redis_cpu)
        } else {
            Duration::ZERO
        };
        let commands: u64 = self.redis.take_commands()?.values().sum();
        drop(server);

        let requests = run.requests.max(1);
        let per_request = |total: Duration| total / u32::try_from(requests).unwrap_or(u32::MAX);
        let touches_redis = mode.redis;
        Ok(Measured {
            per_second: run.requests as f64 / run.duration.as_secs_f64(),
            p99: run.p99,
            not_2xx: run.not_2xx,
            total_cpu_per_request: per_request(server_cpu + redis_cpu + wrk_cpu),
            server_cpu_per_request: per_request(server_cpu),
            wrk_cpu_per_request: per_request(wrk_cpu),
            redis_cpu_per_request: touches_redis.then(|| per_request(redis_cpu)),
            redis_commands_per_request: touches_redis.then(|| commands as f64 / requests as f64),
        })
    }

    fn wrk(&self, script: &Path, url: &str, seconds: u64) -> Result<WrkRun, Error> {
        let output = Command::new("wrk")
            .args(["-t1", &format!("-c{}", self.connections)])
            .args([&format!("-d{seconds}s"), "--timeout", "5s", "-s"])
            .arg(script)
            .arg(url)
            .output()?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let line = stdout
            .lines()
            .find_map(|line| line.strip_prefix("BENCH "))
            .ok_or_else(|| format!("wrk printed no summary:\n{stdout}"))?;
        let fields: BTreeMap<&str, u64> = line
            .split_whitespace()
            .filter_map(|field| {
                let (name, value) = field.split_once('=')?;
                Some((name, value.parse().ok()?))
            })
            .collect();
        let field = |name: &str| {
            fields
                .get(name)
                .copied()
                .ok_or_else(|| format!("wrk summary without {name}: {line}"))
        };
        Ok(WrkRun {
            requests: field("requests")?,
            duration: Duration::from_micros(field("duration_us")?),
            p99: Duration::from_micros(field("p99_us")?),
            not_2xx: field("not_2xx")? + field("errors")?,
        })
    }
}

struct WrkRun {
    requests: u64,
    duration: Duration,
    p99: Duration,
    not_2xx: u64,
}

/// The wrk script: the same per-request work in every mode, only the key differs. It prints
/// one `BENCH` line that the benchmark reads.
fn lua_script(keys: Keys, fixed_key: &str) -> String {
    let key = match keys {
        Keys::New => "headers['Idempotency-Key'] = prefix .. counter".to_owned(),
        Keys::Replay => format!("headers['Idempotency-Key'] = '{fixed_key}'"),
        Keys::None => "headers['Idempotency-Key'] = nil".to_owned(),
    };
    format!(
        r#"
local counter = 0
local prefix = string.format("%x-%x-", os.time(), math.random(0, 2^30))
local headers = {{ ["Content-Type"] = "application/json" }}
local body = '{{"item":"book","qty":1}}'

request = function()
  counter = counter + 1
  {key}
  return wrk.format("POST", nil, headers, body)
end

done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write
    + summary.errors.timeout
  io.write(string.format("BENCH requests=%d duration_us=%d p99_us=%d not_2xx=%d errors=%d\n",
    summary.requests, summary.duration, latency:percentile(99), summary.errors.status, errors))
end
"#
    )
}

/// A reference server, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(mut command: Command, log: &Path) -> Result<Self, Error> {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .spawn()?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(addr) = line.strip_prefix("listening on http://") {
                        break addr.parse()?;
                    }
                }
                _ => {
                    let _ = child.kill();
                    let log = std::fs::read_to_string(log).unwrap_or_default();
                    return Err(format!("the reference server did not start:\n{log}").into());
                }
            }
        };
        // Keep reading stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Ok(Self { child, addr })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One `POST /orders` (to complete the replay key before a run); the raw response.
fn post(addr: SocketAddr, key: Option<&str>) -> Result<String, Error> {
    let body = r#"{"item":"book","qty":1}"#;
    let key = key.map_or(String::new(), |key| format!("Idempotency-Key: {key}\r\n"));
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "POST /orders HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{key}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// User + system CPU time of process `pid` (all its threads) so far.
fn process_cpu(pid: u32) -> Result<Duration, Error> {
    // utime and stime are fields 14 and 15.
    proc_stat_cpu(&format!("/proc/{pid}/stat"), 14)
}

/// User + system CPU time of this process's children that have exited and been waited for
/// (each wrk run).
fn children_cpu() -> Result<Duration, Error> {
    // cutime and cstime are fields 16 and 17.
    proc_stat_cpu("/proc/self/stat", 16)
}

/// The sum of fields `field` and `field + 1` (1-based) of a `/proc/*/stat` file, in clock
/// ticks, as a duration.
fn proc_stat_cpu(path: &str, field: usize) -> Result<Duration, Error> {
    let stat = std::fs::read_to_string(path)?;
    // Fields after the command name (which may hold spaces) start with the state, field 3.
    let after_name = stat.rsplit_once(')').ok_or("unreadable /proc stat")?.1;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields
        .get(field - 3)
        .zip(fields.get(field - 2))
        .and_then(|(user, system)| Some(user.parse::<u64>().ok()? + system.parse::<u64>().ok()?))
        .ok_or("unreadable /proc stat")?;
    Ok(Duration::from_secs_f64(
        ticks as f64 / clock_ticks_per_second(),
    ))
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .and_then(|ticks| ticks.trim().parse().ok())
        .unwrap_or(100.0)
}
