//! The reference server (DESIGN §11): the app that the end-to-end tests, load tests and the
//! demo drive. Run it with
//!
//! ```sh
//! cargo run --release --example reference_server                                  # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --release --example reference_server # Redis store
//! REDIS_CLUSTER_URLS=redis://127.0.0.1:7000,redis://127.0.0.1:7001 \
//!     cargo run --release --example reference_server                              # Redis Cluster store
//! DATABASE_URL=postgres://postgres@127.0.0.1/postgres cargo run --release --example reference_server  # PostgreSQL
//! ```
//!
//! Environment (an empty variable counts as unset):
//!
//! * `BIND` [`127.0.0.1:8080`]: where to listen, an IP address or host name and a port
//!   (`127.0.0.1:8080`, `[::1]:8080`, `localhost:8080`); port 0 picks a free port.
//! * `REDIS_URL`: set → the Redis store (bb8 pool); unset → the in-memory store.
//! * `DATABASE_URL`: set → the PostgreSQL store (its table migrated at start) and the
//!   `/ledger` routes (table `ledger`, created at start). At most one of `REDIS_URL`,
//!   `REDIS_CLUSTER_URLS` and `DATABASE_URL` may be set.
//! * `REDIS_CLUSTER_URLS`: comma-separated seed node URLs → the Redis Cluster store. At most one
//!   of `REDIS_URL`, `REDIS_CLUSTER_URLS` and `DATABASE_URL` may be set.
//! * `IDEMPOTENCY_REPLICAS=N`: replicated writes on either Redis store: each write (the lock,
//!   the commit) waits up to 500 ms for N replicas, strictly (fewer → the step fails).
//! * `IDEMPOTENCY` [`on`] or `off`: `off` installs no middleware at all (benchmark baseline);
//!   the middleware's other variables are then ignored, as the start-up line says (a
//!   malformed value is still refused).
//! * `IDEMPOTENCY_METHODS`: e.g. `POST,PATCH`; also protect untagged routes of those methods.
//!   An empty entry (`,`, `POST,`) is refused: a typo must not leave routes unprotected.
//!   Not `POST` with `DATABASE_URL`: the app-level layer would claim the transactional
//!   `POST /ledger` before routing, outside its transaction, and every one would answer 500.
//! * `IDEMPOTENCY_PREFIX` [`idempotency:`]: prefix of every storage key, so apps or test runs
//!   sharing one Redis stay apart.
//! * `WORKERS` [one per core]: the number of Actix workers, 1 to 512 (Actix runs no more), in
//!   digits (`+2` is refused, as `IDEMPOTENCY_REPLICAS=+1` is).
//! * `LOG_LEVEL` [`warn`]: `off`, `error`, `warn`, `info`, `debug` or `trace`; the least
//!   severe level of the log on stderr: the middleware's `tracing` events (store errors,
//!   fail-open, lost records, misconfiguration; `debug` adds each request's outcome) and
//!   Actix's own.
//! * `REPLAY_CACHE` [`off`] or `on`: answer replays from a 64 MiB in-process replay cache;
//!   only with `REDIS_URL`, `REDIS_CLUSTER_URLS` or `DATABASE_URL` (the in-memory store
//!   answers replays from the process already and needs no cache).
//!
//! Once it accepts connections it prints `listening on http://ADDR` (one line per bound
//! address, with the real port) on stdout. An invalid variable (such as a `BIND` that is not
//! an address and port) is reported on stderr and the process exits with status 2; a failure
//! to start (bad `REDIS_URL` or `REDIS_CLUSTER_URLS`, a `DATABASE_URL` that cannot be
//! reached or migrated, a `BIND` address in use or a host name that does not resolve) with
//! status 1. The routes are listed in `idempotency_actix_examples::reference_app`.
//!
//! SIGTERM or SIGINT (Ctrl-C) stops it gracefully: it drains its keyed work first
//! (`Idempotency::drain`: new keyed requests get 503, and those in progress, whose clients
//! left included, finish and commit their records, for up to 90 s, the longest `delay_ms`
//! plus 30 s), then stops accepting connections and lets the other requests in progress
//! finish (for up to 90 s more; past either bound they are dropped), and exits with status
//! 0. A second
//! SIGTERM or SIGINT during that wait (Ctrl-C twice) stops it at once, with exit status 128
//! plus the signal's number, as a shell reports a process that signal killed (130 for
//! SIGINT, 143 for SIGTERM): the requests still running are dropped and their keys stay
//! locked (409) until their leases end.

use std::io::Write;
use std::pin::pin;
use std::process::ExitCode;
use std::task::Poll;

use actix_web::dev::ServerHandle;
use futures_util::future::Either;
use idempotency_actix::Idempotency;
use idempotency_actix_examples::StopSignals;
use idempotency_actix_examples::reference_app::{self, SHUTDOWN_TIMEOUT, ServerConfig};

/// mimalloc, as production Rust services commonly run: the benchmark's baseline and every
/// protected mode use the same allocator (`docs/performance.md`, "What each change bought").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let config = match ServerConfig::from_env() {
        Ok(config) => config,
        Err(error) => {
            eprintln!("reference_server: {error}");
            return ExitCode::from(2);
        }
    };
    // On stderr: stdout carries the `listening on` line that whoever started us waits for.
    let logging = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(config.log_level)
        .try_init();
    if let Err(error) = logging {
        eprintln!("reference_server: no log on stderr: {error}");
    }
    actix_web::rt::System::new().block_on(serve(config))
}

async fn serve(config: ServerConfig) -> ExitCode {
    let running = match reference_app::start(&config).await {
        Ok(running) => running,
        Err(error) => {
            eprintln!("reference_server: {error}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!("reference_server: {}", running.summary);
    // Listening before the line below: whoever started us may signal as soon as they read it.
    let signals = match StopSignals::listen() {
        Ok(signals) => signals,
        Err(error) => {
            eprintln!("reference_server: cannot listen for SIGINT and SIGTERM: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout().lock();
    for addr in &running.addrs {
        // Whoever started us waits for this line; a closed stdout is their business.
        let _ = writeln!(stdout, "listening on http://{addr}");
    }
    let _ = stdout.flush();
    drop(stdout);
    let mut forced = pin!(stop_on_signals(signals, running.server.handle()));
    let mut server = pin!(running.server);
    // Whichever ends first: the server, once stopped, or a second signal.
    std::future::poll_fn(|cx| {
        if let Poll::Ready(stopped) = server.as_mut().poll(cx) {
            return Poll::Ready(match stopped {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("reference_server: {error}");
                    ExitCode::FAILURE
                }
            });
        }
        forced.as_mut().poll(cx)
    })
    .await
}

/// Stops `server` gracefully on the first SIGINT or SIGTERM; returns on the second, with
/// the exit status of a forced stop (128 + the signal's number, as a shell reports a
/// process that signal killed). Dropping the server then drops what is still running.
async fn stop_on_signals(mut signals: StopSignals, server: ServerHandle) -> ExitCode {
    let (name, _) = signals.next().await;
    eprintln!(
        "reference_server: {name}: stopping once the requests in progress finish (at most {} s \
         for keyed ones, new ones answered 503, then {} s for the rest); SIGINT or SIGTERM \
         again stops at once",
        SHUTDOWN_TIMEOUT.as_secs(),
        SHUTDOWN_TIMEOUT.as_secs()
    );
    // Keyed work first, that of clients that left included, which Actix's stop would drop.
    let drained = {
        let drain = pin!(Idempotency::drain(SHUTDOWN_TIMEOUT));
        let second_signal = pin!(signals.next());
        match futures_util::future::select(drain, second_signal).await {
            Either::Left((left, _)) => left,
            Either::Right(((name, number), _)) => return forced_stop(name, number),
        }
    };
    if drained > 0 {
        eprintln!(
            "reference_server: {drained} pieces of keyed work still in progress after {} s; \
             stopping: the requests with an open connection get Actix's graceful stop, the \
             others are dropped (their keys stay locked until their leases end, and a \
             request whose commit had not landed runs again on retry)",
            SHUTDOWN_TIMEOUT.as_secs()
        );
    }
    // The stop command is sent now; what it returns only tells when the server has stopped,
    // which awaiting the server itself tells too.
    drop(server.stop(true));
    let (name, number) = signals.next().await;
    forced_stop(name, number)
}

/// Reports a stop forced by a second signal: the exit status of a process killed by it (128
/// + the signal's number, as a shell reports it).
fn forced_stop(name: &str, number: u8) -> ExitCode {
    eprintln!(
        "reference_server: {name} again: stopping at once; requests in progress are dropped \
         and their keys stay locked until their leases end"
    );
    ExitCode::from(128 + number)
}
