//! Which Redis the tests talk to: `REDIS_URL`, else the server on 127.0.0.1:6379, else a
//! private `redis-server` that this test process starts for its own run.
//!
//! A private server is started at most once per test binary, on a free loopback port, and a
//! small watchdog shell stops it when the test process exits (statics are never dropped, so
//! the test process itself cannot). Only a missing `redis-server` binary fails the tests,
//! with the install hint.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The default Redis address the tests try before starting their own.
const DEFAULT_ADDR: &str = "127.0.0.1:6379";

/// The Redis URL of this test run, decided once per test process.
pub(crate) fn url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("REDIS_URL")
            && !url.is_empty()
        {
            return url;
        }
        let default: SocketAddr = DEFAULT_ADDR.parse().expect("a valid socket address");
        if answers_ping(default) {
            return format!("redis://{DEFAULT_ADDR}");
        }
        start_private_redis()
    })
    .clone()
}

/// Whether a Redis server answers `PING` at `addr` within a short bound.
fn answers_ping(addr: SocketAddr) -> bool {
    let bound = Duration::from_millis(500);
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, bound) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(bound));
    let _ = stream.set_write_timeout(Some(bound));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

/// Starts a `redis-server` for this test process and answers its URL.
///
/// # Panics
///
/// When `redis-server` is not installed or does not answer within 10 s.
fn start_private_redis() -> String {
    let probe = Command::new("redis-server").arg("--version").output();
    if probe.is_err() {
        panic!(
            "nothing answers on {DEFAULT_ADDR}, REDIS_URL is unset, and redis-server is not \
             installed; install it with: apt-get install -y redis-server"
        );
    }
    eprintln!("tests: nothing answers on {DEFAULT_ADDR} and REDIS_URL is unset");
    start_private_server(Path::new("redis-server"))
}

/// Starts `server` (a `redis-server` or `valkey-server` binary) for this test process on a
/// free loopback port, and answers its URL.
///
/// A watchdog shell runs the server and waits on a pipe whose other end this process holds
/// until it exits, however it exits; it then stops the server and removes its directory. The
/// server and the shell write only to a log file in that directory, never to the test's
/// output, so a test runner that waits for a test's output to close (nextest) is not kept
/// waiting for them after the test.
///
/// The port is free when it is picked, not when the server binds it: an outgoing connection
/// or another test's server may take it in between. So the server counts as started only
/// once the one answering on the port is its process (`INFO server`'s `process_id`), and a
/// server that exited for the port is started again on another.
///
/// # Panics
///
/// When the server does not answer within 10 s (with what it logged), or could listen on
/// none of the ports tried.
pub(crate) fn start_private_server(server: &Path) -> String {
    for _ in 0..crate::PORT_TRIES {
        if let Some(url) = start_private_server_on(server, crate::free_loopback_port()) {
            return url;
        }
    }
    panic!(
        "{} could not listen on any of {} free loopback ports",
        server.display(),
        crate::PORT_TRIES
    );
}

/// [`start_private_server`] on `port`: `None` when the server exited (the port was taken).
#[expect(
    clippy::zombie_processes,
    reason = "the watchdog outlives the test process"
)]
fn start_private_server_on(server: &Path, port: u16) -> Option<String> {
    let name = server.display();
    let dir = std::env::temp_dir().join(format!(
        "idempotency-actix-test-server-{}-{port}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir)
        .unwrap_or_else(|error| panic!("cannot create {}: {error}", dir.display()));
    let log_path = dir.join("server.log");
    let log = std::fs::File::create(&log_path)
        .unwrap_or_else(|error| panic!("cannot create {}: {error}", log_path.display()));
    let log_too = log
        .try_clone()
        .unwrap_or_else(|error| panic!("cannot share {}: {error}", log_path.display()));
    let pid_path = dir.join("server.pid");
    // The binary and the directory are the shell's `$0` and `$1`, so they need no quoting.
    let script = format!(
        "\"$0\" --port {port} --bind 127.0.0.1 --save '' --appendonly no --dir \"$1\" & \
         server=$!; echo $server > \"$1/server.pid\"; read -r _; kill $server; \
         wait $server; rm -rf \"$1\""
    );
    let mut watchdog = Command::new("sh")
        .args(["-c", &script])
        .arg(server)
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(log)
        .stderr(log_too)
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start a private {name}: {error}"));
    let watchdog_input = watchdog.stdin.take();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let pid = std::fs::read_to_string(&pid_path)
            .ok()
            .and_then(|pid| pid.trim().parse::<u32>().ok());
        if let Some(pid) = pid {
            if info_server(addr).is_some_and(|info| crate::info_names_process(&info, pid)) {
                // Held until the process exits: the end of the watchdog's input. (Rust
                // opens pipes close-on-exec, so no other child inherits it.)
                std::mem::forget(watchdog_input);
                eprintln!("tests: started a private {name} on port {port} for this run");
                return Some(format!("redis://127.0.0.1:{port}"));
            }
            if has_exited(pid) {
                // It exited: the port was taken. Closing the watchdog's input ends it.
                drop(watchdog_input);
                let _ = watchdog.wait();
                return None;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let logged = std::fs::read_to_string(&log_path).unwrap_or_default();
    panic!("the private {name} on port {port} did not answer within 10 s; it logged:\n{logged}");
}

/// Whether process `pid` has exited: gone, or a zombie (the watchdog shell, waiting on its
/// input, does not reap the server it started).
fn has_exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        // `pid (name) state …`: the state follows the name's closing parenthesis.
        stat.rsplit_once(')')
            .is_none_or(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

/// `INFO server` from the Redis server at `addr`, if one answers it within a short bound.
fn info_server(addr: SocketAddr) -> Option<String> {
    let bound = Duration::from_millis(500);
    let mut stream = TcpStream::connect_timeout(&addr, bound).ok()?;
    stream.set_read_timeout(Some(bound)).ok()?;
    stream.set_write_timeout(Some(bound)).ok()?;
    stream.write_all(b"INFO server\r\n").ok()?;
    // A bulk string: `$<length>\r\n`, then that many bytes.
    let mut header = Vec::new();
    let mut byte = [0u8; 1];
    while !header.ends_with(b"\r\n") {
        stream.read_exact(&mut byte).ok()?;
        header.push(byte[0]);
        if header.len() > 32 {
            return None;
        }
    }
    let length: usize = std::str::from_utf8(header.strip_prefix(b"$")?)
        .ok()?
        .trim_end()
        .parse()
        .ok()?;
    let mut info = vec![0u8; length];
    stream.read_exact(&mut info).ok()?;
    String::from_utf8(info).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server whose port was taken before it bound it exits; the start moves on at once
    /// (it waited the whole 10 s for it and then panicked, failing the binary).
    #[test]
    fn a_server_that_finds_its_port_taken_is_given_up_at_once() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        let port = taken.local_addr().expect("its address").port();
        assert_eq!(
            start_private_server_on(Path::new("redis-server"), port),
            None
        );
    }
}
