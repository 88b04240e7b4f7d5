//! [`MovableAddress`]: a TCP proxy of the test's own, to move a server's address or make the
//! connections open through it go silent.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::time::Duration;

/// A TCP proxy on a loopback port that sends each new connection to the port it is set to
/// now; connections already open stay where they are, as with a moved DNS name. It can also
/// make the connections open now go silent, as a network that drops their packets would:
/// what either end sends is read and dropped, and neither is told.
pub struct MovableAddress {
    port: u16,
    target: Arc<AtomicU16>,
    /// Connections are numbered as they come; those numbered below this one are silent.
    silent_below: Arc<AtomicU64>,
    /// How long a new connection waits, in milliseconds, before it is passed on.
    delay_ms: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
}

impl MovableAddress {
    /// A proxy to `target`, on a free loopback port.
    ///
    /// # Panics
    ///
    /// When no loopback port is free.
    pub fn to(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
        let port = listener.local_addr().expect("a bound listener").port();
        let target = Arc::new(AtomicU16::new(target));
        let silent_below = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (current, silent, counted, delay) = (
            Arc::clone(&target),
            Arc::clone(&silent_below),
            Arc::clone(&accepted),
            Arc::clone(&delay_ms),
        );
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                std::thread::sleep(Duration::from_millis(delay.load(Ordering::SeqCst)));
                let Ok(server) = TcpStream::connect(("127.0.0.1", current.load(Ordering::SeqCst)))
                else {
                    continue;
                };
                let number = counted.fetch_add(1, Ordering::SeqCst);
                for (from, to) in [
                    (
                        client.try_clone().expect("a socket handle"),
                        server.try_clone().expect("a socket handle"),
                    ),
                    (server, client),
                ] {
                    let silent = Arc::clone(&silent);
                    std::thread::spawn(move || {
                        forward(from, to, || number < silent.load(Ordering::SeqCst));
                    });
                }
            }
        });
        Self {
            port,
            target,
            silent_below,
            delay_ms,
            accepted,
        }
    }

    /// Makes every connection open now go silent for good.
    pub fn silence_open_connections(&self) {
        let open = self.accepted.load(Ordering::SeqCst);
        self.silent_below.store(open, Ordering::SeqCst);
    }

    /// Makes each connection made from now on wait `delay` before it is passed on (a server
    /// slow to accept connections, a pooler queueing them), one after another.
    pub fn delay_new_connections(&self, delay: Duration) {
        let millis = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.delay_ms.store(millis, Ordering::SeqCst);
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sends the connections made from now on to `target`.
    pub fn move_to(&self, target: u16) {
        self.target.store(target, Ordering::SeqCst);
    }
}

/// Copies what `from` sends to `to` until either closes, dropping it instead once `silent`.
fn forward(mut from: TcpStream, mut to: TcpStream, silent: impl Fn() -> bool) {
    let mut buffer = [0; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if !silent() && to.write_all(&buffer[..read]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
