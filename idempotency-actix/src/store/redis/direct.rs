//! [`DirectConnection`]: the store's own multiplexed connection to one server over plain TCP
//! or a Unix socket.
//!
//! Requests write their commands into one shared buffer and wait for their replies in the
//! order they wrote them; a driver task, on the thread that opened the connection, writes
//! what the buffer holds in one system call, reads what came back, and hands each reply to
//! the request that waits for it. It is what redis-rs's `MultiplexedConnection` does, with
//! the parts a store on one worker does not need left out: no channel between the requests
//! and the driver (a mutex no one else contends for), no copy of each command before it is
//! written (commands are packed straight into the shared buffer), no timer per command,
//! and a reply reader for the few reply types of the protocol (`reply`). That is about
//! 4 500 instructions less per round trip (`docs/performance.md`, "What each change bought").
//!
//! It keeps the deadlines of the store operations that send commands on it
//! (`store::deadline`): one timer, set for the earliest, answers every request still
//! waiting at its deadline with a timeout error, so that the engine needs no timer of its
//! own per operation (about a thousand instructions each).
//!
//! It speaks RESP2 and understands `redis://` and Unix-socket URLs (`unix://`,
//! `redis+unix://`): host and port or the socket's path, user and password (`AUTH`), and
//! database (`SELECT`). TLS (`rediss://`) goes through redis-rs (see `pool`). A connection whose socket fails stays failed: every request on it, and every
//! one after, gets an I/O error, so that the store replaces it (`connection`).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use redis::{Cmd, Pipeline, RedisError, RedisFuture, Value};
use tokio::sync::oneshot;
use tokio::time::Sleep;

use super::packed::{Carrier, PackedCommand};
use super::pool::ServerAddress;
use super::reply::read_reply;
use super::socket::Socket;
use crate::store::deadline;

/// A handle on the connection; clones share it. The driver task ends, closing the socket,
/// once the last handle is dropped.
#[derive(Clone)]
pub(super) struct DirectConnection {
    owner: Arc<Owner>,
    db: i64,
}

/// What the handles share; dropped with the last of them.
struct Owner {
    shared: Arc<Shared>,
}

/// What the handles and the driver share.
struct Shared {
    state: Mutex<State>,
}

struct State {
    /// Commands packed by requests, not yet taken by the driver.
    outgoing: Vec<u8>,
    /// One entry per command or pipeline written or queued, in order.
    waiting: VecDeque<Waiter>,
    /// The driver's waker, while it waits for commands to write.
    driver: Option<Waker>,
    /// The driver's waker, while it waits with its timer set for no deadline or for
    /// `next_deadline`: a request that brings an earlier deadline wakes it to set the timer
    /// again, also while a write waits for room in the socket (and `driver` is empty).
    watcher: Option<Waker>,
    /// Why the connection no longer works, once it does not.
    failed: Option<std::io::ErrorKind>,
    /// The last handle is gone: the driver ends.
    abandoned: bool,
    /// No waiting request that is still to be answered has a deadline before this one
    /// (it may be earlier than the earliest: the driver finds out when it comes).
    next_deadline: Option<Instant>,
}

/// A request waiting for `replies` replies, of which it keeps the ones after the first
/// `skip` (a transaction's `MULTI` and `QUEUED`s).
struct Waiter {
    replies: usize,
    skip: usize,
    pipelined: bool,
    values: Vec<Value>,
    /// When the request gives up: the deadline of the store operation that sent it
    /// (`store::deadline`), if one did.
    deadline: Option<Instant>,
    /// `None` once the request was answered with a timeout; its replies are then read
    /// and dropped.
    answer: Option<oneshot::Sender<Result<Value, RedisError>>>,
}

/// How much the read buffer grows by when it is full: a reply of the protocol is a record,
/// a few hundred bytes to the size of a stored body.
const READ_CHUNK: usize = 16 * 1024;

/// How long past its deadline a request may stay unanswered before the connection is taken
/// for stalled and closed: a server that does not answer for that long (a partition, a
/// frozen host) is no longer waited for on this connection; the next command opens a new
/// one. Until then every request still gets its timeout at its deadline, and a server that
/// is only slow (a long `DEBUG SLEEP`, a busy script) is waited out.
pub(super) const STALLED_AFTER: Duration = Duration::from_secs(2);

/// Most bytes of commands that may wait unwritten: a server that reads nothing while
/// requests keep coming (each timing out and retried) would otherwise have every copy of
/// them, stored bodies included, pile up in the process. A command queued past it finds the
/// connection stalled and closed, as for [`STALLED_AFTER`]. One command larger than it is
/// still sent.
const MAX_UNWRITTEN: usize = 64 * 1024 * 1024;

impl DirectConnection {
    /// Connects to `server`, authenticates and selects its database, and starts the driver
    /// on this thread's runtime.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached or refuses `AUTH` or `SELECT`.
    pub(super) async fn open(server: &ServerAddress) -> Result<Self, RedisError> {
        let stream = Socket::connect(&server.endpoint).await?;
        // The runtime that drives the socket: this thread's, as the store opens its
        // connection on the worker that uses it.
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                outgoing: Vec::with_capacity(READ_CHUNK),
                waiting: VecDeque::new(),
                driver: None,
                watcher: None,
                failed: None,
                abandoned: false,
                next_deadline: None,
            }),
        });
        let runtime = tokio::runtime::Handle::try_current().map_err(|error| {
            RedisError::from((
                redis::ErrorKind::Client,
                "the Redis store needs a Tokio runtime (an Actix worker has one)",
                error.to_string(),
            ))
        })?;
        runtime.spawn(Driver {
            stream,
            shared: Arc::clone(&shared),
            writing: Vec::with_capacity(READ_CHUNK),
            written: 0,
            read: Vec::with_capacity(READ_CHUNK),
            read_from: 0,
            timer: None,
            armed: None,
        });
        let mut connection = Self {
            owner: Arc::new(Owner { shared }),
            db: server.db,
        };
        if let Some(password) = &server.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(username) = &server.username {
                auth.arg(username);
            }
            auth.arg(password);
            auth.query_async::<()>(&mut connection).await?;
        }
        if server.db != 0 {
            redis::cmd("SELECT")
                .arg(server.db)
                .query_async::<()>(&mut connection)
                .await?;
        }
        Ok(connection)
    }

    /// Whether the connection has failed: every request sent on it from now on is refused
    /// before anything is written.
    pub(super) fn has_failed(&self) -> bool {
        self.owner.shared.lock().failed.is_some()
    }

    /// Queues the bytes `pack` writes, answered by `replies` replies; the answer comes on the
    /// receiver.
    fn queue(
        &self,
        pack: impl FnOnce(&mut Vec<u8>),
        replies: usize,
        skip: usize,
        pipelined: bool,
    ) -> Result<Queued, RedisError> {
        let (answer, receiver) = oneshot::channel();
        let deadline = deadline::current();
        let driver = {
            let mut state = self.owner.shared.lock();
            if let Some(kind) = state.failed {
                return Err(closed(kind));
            }
            if state.outgoing.len() >= MAX_UNWRITTEN {
                tracing::warn!(
                    "idempotency: the Redis server reads nothing; closing the connection"
                );
                state.fail(STALLED);
                let driver = state.driver_wakers();
                drop(state);
                driver.into_iter().flatten().for_each(Waker::wake);
                return Err(closed(STALLED));
            }
            pack(&mut state.outgoing);
            state.waiting.push_back(Waiter {
                replies,
                skip,
                pipelined,
                values: Vec::new(),
                deadline,
                answer: Some(answer),
            });
            // The driver sets its timer for it on its next pass, which this wakes if the
            // driver waits for commands, or for an earlier deadline than this one.
            let earliest =
                deadline.filter(|&deadline| state.next_deadline.is_none_or(|next| deadline < next));
            if earliest.is_some() {
                state.next_deadline = earliest;
            }
            let driver = state.driver.take();
            match driver {
                None if earliest.is_some() => state.watcher.take(),
                driver => driver,
            }
        };
        if let Some(driver) = driver {
            driver.wake();
        }
        Ok(Queued {
            receiver,
            keeps_deadline: deadline.is_some(),
        })
    }
}

impl Carrier for DirectConnection {
    fn send_packed<'a>(&'a mut self, command: &'a PackedCommand) -> RedisFuture<'a, Value> {
        let queued = self.queue(|out| out.extend_from_slice(command.bytes()), 1, 0, false);
        Box::pin(answer(queued))
    }
}

impl ConnectionLike for DirectConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let queued = self.queue(|out| cmd.write_packed_command(out), 1, 0, false);
        Box::pin(answer(queued))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let queued = self.queue(
            |out| out.extend_from_slice(&pipeline.get_packed_pipeline()),
            offset + count,
            offset,
            true,
        );
        Box::pin(async move {
            match answer(queued).await? {
                Value::Array(values) => Ok(values),
                value => Ok(vec![value]),
            }
        })
    }

    fn get_db(&self) -> i64 {
        self.db
    }
}

/// A request queued on the connection: its answer comes on `receiver`, by the deadline of
/// the operation that sent it if it has one.
struct Queued {
    receiver: oneshot::Receiver<Result<Value, RedisError>>,
    keeps_deadline: bool,
}

/// The answer to a queued request. While it waits, it tells the engine that the
/// connection keeps the operation's deadline (`store::deadline::kept`) when the request
/// has one: the driver answers it by then.
async fn answer(queued: Result<Queued, RedisError>) -> Result<Value, RedisError> {
    let Queued {
        mut receiver,
        keeps_deadline,
    } = queued?;
    std::future::poll_fn(|cx| {
        let polled = Pin::new(&mut receiver).poll(cx);
        if polled.is_pending() && keeps_deadline {
            deadline::kept();
        }
        polled
    })
    .await
    .unwrap_or_else(|_| Err(closed(std::io::ErrorKind::ConnectionAborted)))
}

impl Drop for Owner {
    fn drop(&mut self) {
        let driver = {
            let mut state = self.shared.lock();
            state.abandoned = true;
            state.driver_wakers()
        };
        driver.into_iter().flatten().for_each(Waker::wake);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl State {
    /// Hands `reply` to the request at the front; `false` when no request waits for it
    /// (the connection is out of step).
    fn deliver(&mut self, reply: Value) -> bool {
        let Some(waiter) = self.waiting.front_mut() else {
            return false;
        };
        if !waiter.pipelined {
            if let Some(answer) = self.waiting.pop_front().and_then(|done| done.answer) {
                let _ = answer.send(Ok(reply));
            }
            return true;
        }
        waiter.replies -= 1;
        if waiter.skip > 0 {
            waiter.skip -= 1;
        } else {
            waiter.values.push(reply);
        }
        if waiter.replies == 0
            && let Some(done) = self.waiting.pop_front()
            && let Some(answer) = done.answer
        {
            let _ = answer.send(Ok(Value::Array(done.values)));
        }
        true
    }

    /// Answers every request whose deadline is `now` or past with a timeout (its replies
    /// will be dropped when they come), and notes the earliest deadline left; fails the
    /// connection (`false`) when its oldest request has waited [`STALLED_AFTER`] past its
    /// deadline.
    fn expire(&mut self, now: Instant) -> bool {
        // Replies come in order: the first request with a deadline is the oldest unanswered.
        let stalled_at = self
            .waiting
            .iter()
            .find_map(|waiter| waiter.deadline)
            .map(|deadline| deadline + STALLED_AFTER);
        if stalled_at.is_some_and(|stalled_at| stalled_at <= now) {
            tracing::warn!(
                "idempotency: the Redis server has not answered for {STALLED_AFTER:?} past a \
                 deadline; closing the connection"
            );
            self.fail(STALLED);
            return false;
        }
        let mut next: Option<Instant> = stalled_at;
        for waiter in &mut self.waiting {
            let Some(deadline) = waiter.deadline else {
                continue;
            };
            if deadline > now {
                if waiter.answer.is_some() {
                    next = Some(next.map_or(deadline, |next| next.min(deadline)));
                }
            } else if let Some(answer) = waiter.answer.take() {
                let _ = answer.send(Err(timed_out()));
            }
        }
        self.next_deadline = next;
        true
    }

    /// Whether the driver has nothing more to do: the connection failed, or its handles
    /// are all gone.
    fn is_done(&self) -> bool {
        self.abandoned || self.failed.is_some()
    }

    /// The driver's wakers, to wake it wherever it waits, once the connection is done: for
    /// commands (`driver`), or for room in the socket to write a batch the server has not
    /// read yet. Then only `watcher` wakes it (the driver sets it whenever it waits), and
    /// nothing else until the server reads, however long that takes: a driver left waiting
    /// would hold the socket and the batch.
    fn driver_wakers(&mut self) -> [Option<Waker>; 2] {
        [self.driver.take(), self.watcher.take()]
    }

    /// Fails every waiting request and every later one with `kind`.
    fn fail(&mut self, kind: std::io::ErrorKind) {
        self.failed = Some(kind);
        self.outgoing = Vec::new();
        for answer in self.waiting.drain(..).filter_map(|waiter| waiter.answer) {
            let _ = answer.send(Err(closed(kind)));
        }
    }
}

/// Why a stalled connection was closed: an I/O error that is not a timeout, so the store
/// replaces the connection.
const STALLED: std::io::ErrorKind = std::io::ErrorKind::ConnectionAborted;

fn timed_out() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "the Redis server did not answer by the store operation's deadline",
    ))
}

fn closed(kind: std::io::ErrorKind) -> RedisError {
    RedisError::from(std::io::Error::new(
        kind,
        "the connection to the Redis server was lost",
    ))
}

/// Keeps the waker of `cx` in `slot`, unless the one there already wakes the same task.
fn register(slot: &mut Option<Waker>, cx: &Context<'_>) {
    if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
        *slot = Some(cx.waker().clone());
    }
}

/// Most a buffer keeps between batches: one that grew past it for a large record (a stored
/// body of megabytes) is given back rather than kept for the life of the connection.
const KEPT_CAPACITY: usize = 1024 * 1024;

/// Empties `buffer` for the next batch, keeping its room unless it grew past
/// [`KEPT_CAPACITY`].
fn reuse(buffer: &mut Vec<u8>) {
    if buffer.capacity() > KEPT_CAPACITY {
        *buffer = Vec::with_capacity(READ_CHUNK);
    } else {
        buffer.clear();
    }
}

/// The task that owns the socket: writes what requests queued and reads their replies.
struct Driver {
    stream: Socket,
    shared: Arc<Shared>,
    /// Bytes taken from `State::outgoing`, written up to `written`.
    writing: Vec<u8>,
    written: usize,
    /// Bytes read, replies read up to `read_from`.
    read: Vec<u8>,
    read_from: usize,
    /// One timer for the deadlines of all waiting requests, made with the first.
    timer: Option<Pin<Box<Sleep>>>,
    /// The instant `timer` is set for.
    armed: Option<Instant>,
}

/// What one pass of the driver found.
enum Progress {
    /// Something was written or read: look again.
    Some,
    /// Nothing to do until woken.
    None,
    /// The connection is done: failed, or abandoned by its handles.
    Done,
}

impl Future for Driver {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let driver = self.get_mut();
        loop {
            let wrote = driver.write(cx);
            let read = driver.read(cx);
            match (wrote, read) {
                (Progress::Done, _) | (_, Progress::Done) => return Poll::Ready(()),
                (Progress::None, Progress::None) => {
                    return match driver.watch(cx) {
                        Progress::Done => Poll::Ready(()),
                        _ => Poll::Pending,
                    };
                }
                _ => {}
            }
        }
    }
}

impl Driver {
    /// Writes what is queued, taking more from the requests once the last batch is out.
    fn write(&mut self, cx: &mut Context<'_>) -> Progress {
        if self.written < self.writing.len() {
            // A batch the server has not read yet: the connection may have been closed
            // meanwhile (stalled, or dropped by its handles).
            if self.shared.lock().is_done() {
                return Progress::Done;
            }
        } else {
            reuse(&mut self.writing);
            self.written = 0;
            let mut state = self.shared.lock();
            if state.is_done() {
                return Progress::Done;
            }
            if state.outgoing.is_empty() {
                register(&mut state.driver, cx);
                return Progress::None;
            }
            std::mem::swap(&mut state.outgoing, &mut self.writing);
        }
        let mut progress = Progress::None;
        while self.written < self.writing.len() {
            match self.stream.try_write(&self.writing[self.written..]) {
                Ok(0) => return self.fail(std::io::ErrorKind::WriteZero),
                Ok(count) => {
                    self.written += count;
                    progress = Progress::Some;
                }
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    match self.stream.poll_write_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(error)) => return self.fail(error.kind()),
                        Poll::Pending => return progress,
                    }
                }
                Err(error) => return self.fail(error.kind()),
            }
        }
        // Everything went out: take the next batch on the next pass.
        Progress::Some
    }

    /// Reads what arrived and hands out every whole reply in it.
    fn read(&mut self, cx: &mut Context<'_>) -> Progress {
        let mut progress = Progress::None;
        loop {
            if self.read.capacity() - self.read.len() < READ_CHUNK / 4 {
                self.read.reserve(READ_CHUNK);
            }
            match self.stream.try_read_buf(&mut self.read) {
                Ok(0) => return self.fail(std::io::ErrorKind::UnexpectedEof),
                Ok(_) => {
                    progress = Progress::Some;
                    if let Progress::Done = self.hand_out_replies() {
                        return Progress::Done;
                    }
                }
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    match self.stream.poll_read_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(error)) => return self.fail(error.kind()),
                        Poll::Pending => return progress,
                    }
                }
                Err(error) => return self.fail(error.kind()),
            }
        }
    }

    fn hand_out_replies(&mut self) -> Progress {
        let mut state = self.shared.lock();
        loop {
            match read_reply(&self.read[self.read_from..]) {
                Ok(Some((reply, used))) => {
                    self.read_from += used;
                    if !state.deliver(reply) {
                        tracing::warn!("idempotency: a Redis reply no request waited for");
                        state.fail(std::io::ErrorKind::InvalidData);
                        return Progress::Done;
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%error, "idempotency: closing the Redis connection");
                    state.fail(std::io::ErrorKind::InvalidData);
                    return Progress::Done;
                }
            }
        }
        drop(state);
        if self.read_from == self.read.len() {
            reuse(&mut self.read);
            self.read_from = 0;
        } else if self.read_from > READ_CHUNK {
            self.read.drain(..self.read_from);
            self.read_from = 0;
        }
        Progress::Some
    }

    /// Keeps the deadlines of the waiting requests: the timer is set for the earliest the
    /// state knows of, and when it fires every request past its deadline is answered with
    /// a timeout. Under a steady load it fires about once per store timeout, not once per
    /// request.
    fn watch(&mut self, cx: &mut Context<'_>) -> Progress {
        loop {
            let next_deadline = {
                let mut state = self.shared.lock();
                register(&mut state.watcher, cx);
                state.next_deadline
            };
            let Some(at) = next_deadline else {
                return Progress::None;
            };
            let timer = self
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at.into())));
            if self.armed != Some(at) {
                timer.as_mut().reset(at.into());
                self.armed = Some(at);
            }
            if timer.as_mut().poll(cx).is_pending() {
                return Progress::None;
            }
            if !self.shared.lock().expire(Instant::now()) {
                return Progress::Done;
            }
            // Set for a deadline now past: `reset` to the next one, even if it is equal.
            self.armed = None;
        }
    }

    fn fail(&mut self, kind: std::io::ErrorKind) -> Progress {
        tracing::debug!(?kind, "idempotency: Redis connection lost");
        self.shared.lock().fail(kind);
        Progress::Done
    }
}

impl Drop for Driver {
    /// A driver dropped before its end (its runtime shut down, or a panic) can answer no
    /// request: those waiting, and every later one, fail at once, and the store replaces
    /// the connection, rather than waiting for replies no one reads.
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        if state.failed.is_none() {
            state.fail(std::io::ErrorKind::ConnectionAborted);
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::super::socket::Endpoint;
    use super::*;

    /// A server that reads `expect` bytes of commands, then answers `replies`, a few bytes
    /// per write, and then closes the connection.
    async fn scripted_server(
        expect: usize,
        replies: &'static [u8],
    ) -> (ServerAddress, tokio::task::JoinHandle<Vec<u8>>) {
        scripted_server_writing(expect, replies, 3, Duration::ZERO).await
    }

    /// [`scripted_server`], waiting `delay` before it answers and writing `chunk` bytes at a
    /// time.
    async fn scripted_server_writing(
        expect: usize,
        replies: &'static [u8],
        chunk: usize,
        delay: Duration,
    ) -> (ServerAddress, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let port = listener.local_addr().expect("an address").port();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("the store connects");
            let mut received = vec![0; expect];
            socket
                .read_exact(&mut received)
                .await
                .expect("the commands");
            tokio::time::sleep(delay).await;
            for chunk in replies.chunks(chunk) {
                socket.write_all(chunk).await.expect("a reply");
                socket.flush().await.expect("a flush");
                tokio::task::yield_now().await;
            }
            received
        });
        (loopback(port), server)
    }

    /// Port `port` of the loopback address, without a password, database 0.
    fn loopback(port: u16) -> ServerAddress {
        ServerAddress {
            endpoint: Endpoint::Tcp {
                host: "127.0.0.1".to_owned(),
                port,
            },
            db: 0,
            username: None,
            password: None,
        }
    }

    fn get(key: &str) -> Cmd {
        let mut command = redis::cmd("GET");
        command.arg(key);
        command
    }

    #[actix_web::test]
    async fn concurrent_requests_get_their_own_replies_in_order() {
        let commands = [get("a"), get("b"), get("c")];
        let expect = commands.iter().map(|c| c.get_packed_command().len()).sum();
        let (address, server) =
            scripted_server(expect, b"$1\r\nA\r\n$-1\r\n-ERR Function not found\r\n").await;
        let connection = DirectConnection::open(&address).await.expect("connected");
        let [a, b, c] = commands;
        let (mut first, mut second, mut third) =
            (connection.clone(), connection.clone(), connection);
        let (a, b, c) = futures_util::future::join3(
            first.req_packed_command(&a),
            second.req_packed_command(&b),
            third.req_packed_command(&c),
        )
        .await;
        assert_eq!(a.expect("a reply"), Value::BulkString(b"A".to_vec()));
        assert_eq!(b.expect("a reply"), Value::Nil);
        let error = c
            .expect("a reply")
            .extract_error()
            .expect_err("a server error");
        assert_eq!(error.code(), Some("ERR"));
        assert_eq!(error.detail(), Some("Function not found"));
        let received = server.await.expect("the server ran");
        assert_eq!(received, b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n*2\r\n$3\r\nGET\r\n$1\r\nb\r\n*2\r\n$3\r\nGET\r\n$1\r\nc\r\n");
    }

    /// Polls `future` as the engine polls a store operation with `deadline`; says whether
    /// every poll that left it waiting reported the deadline kept.
    async fn under_deadline<F: Future>(deadline: Instant, future: F) -> (F::Output, bool) {
        let mut future = std::pin::pin!(future);
        let mut always_kept = true;
        let output = std::future::poll_fn(|cx| {
            let (polled, kept) = deadline::polling(deadline, || future.as_mut().poll(cx));
            always_kept &= polled.is_ready() || kept;
            polled
        })
        .await;
        (output, always_kept)
    }

    #[actix_web::test]
    async fn a_request_unanswered_at_its_deadline_times_out_and_its_late_reply_is_dropped() {
        let commands = [get("slow"), get("next")];
        let expect = commands.iter().map(|c| c.get_packed_command().len()).sum();
        let (address, _server) = scripted_server_writing(
            expect,
            b"$4\r\nSLOW\r\n$4\r\nNEXT\r\n",
            64,
            Duration::from_millis(400),
        )
        .await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        let mut other = connection.clone();
        let [slow, next] = commands;
        let started = Instant::now();
        let deadline = started + Duration::from_millis(60);
        let ((slow, kept), next) = futures_util::future::join(
            // Sent during a poll under the deadline, as the engine's store steps are.
            under_deadline(deadline, async {
                connection.req_packed_command(&slow).await
            }),
            async {
                // Queued after the slow one, without a deadline.
                tokio::task::yield_now().await;
                other.req_packed_command(&next).await
            },
        )
        .await;
        let error = slow.expect_err("no reply by the deadline");
        assert!(error.is_timeout(), "{error}");
        assert!(
            kept,
            "the connection kept the deadline while the request waited"
        );
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(60),
            "answered before its deadline: {waited:?}"
        );
        // The request without a deadline got its own reply, the slow one's dropped.
        assert_eq!(next.expect("a reply"), Value::BulkString(b"NEXT".to_vec()));
    }

    /// A server that accepts the connection and never reads from it, with a small receive
    /// buffer, so that a large enough write stalls; it holds the socket until the test ends.
    async fn server_that_never_reads() -> (ServerAddress, tokio::task::JoinHandle<()>) {
        let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
        socket
            .set_recv_buffer_size(16 * 1024)
            .expect("a small receive buffer");
        socket
            .bind("127.0.0.1:0".parse().expect("an address"))
            .expect("a loopback port");
        let listener = socket.listen(1).expect("listening");
        let port = listener.local_addr().expect("an address").port();
        let server = tokio::spawn(async move {
            let (_socket, _) = listener.accept().await.expect("the store connects");
            std::future::pending::<()>().await;
        });
        (loopback(port), server)
    }

    #[actix_web::test]
    async fn a_request_queued_behind_a_stalled_write_still_times_out_at_its_deadline() {
        let (address, server) = server_that_never_reads().await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        let mut later = connection.clone();
        // More than the socket buffers of both ends hold: the write stalls.
        let mut large = redis::cmd("SET");
        large.arg("large").arg(vec![b'x'; 64 * 1024 * 1024]);
        let deadline = Instant::now() + Duration::from_millis(50);
        let (stalled, _) = under_deadline(deadline, async {
            connection.req_packed_command(&large).await
        })
        .await;
        assert!(stalled.expect_err("no reply").is_timeout());
        // Every waiter has now timed out; a new request's deadline must still be kept
        // while the write is stalled.
        let deadline = Instant::now() + Duration::from_millis(50);
        let waited = tokio::time::timeout(
            Duration::from_secs(5),
            under_deadline(deadline, async {
                later.req_packed_command(&get("a")).await
            }),
        )
        .await;
        let (reply, kept) = waited.expect("answered by its deadline, not left waiting");
        assert!(reply.expect_err("no reply").is_timeout());
        assert!(kept);
        server.abort();
    }

    /// Whether `error` is one for which the store replaces the connection.
    fn closes_the_connection(error: &RedisError) -> bool {
        error.is_io_error() && !error.is_timeout()
    }

    #[actix_web::test]
    async fn a_server_silent_for_longer_than_a_deadline_and_its_grace_is_left() {
        let (address, server) = server_that_never_reads().await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        let mut later = connection.clone();
        let deadline = Instant::now() + Duration::from_millis(50);
        let (silent, _) = under_deadline(deadline, async {
            connection.req_packed_command(&get("a")).await
        })
        .await;
        assert!(silent.expect_err("no reply").is_timeout());
        // A request without a deadline of its own, queued within the grace (the connection
        // is kept then: a slow server is waited out), waits until the connection is left.
        let b = get("b");
        let within = later.req_packed_command(&b);
        tokio::time::sleep(STALLED_AFTER + Duration::from_millis(300)).await;
        let within = tokio::time::timeout(Duration::from_secs(1), within)
            .await
            .expect("answered once the connection was left");
        assert!(closes_the_connection(&within.expect_err("no reply")));
        let after = later.req_packed_command(&get("c")).await;
        assert!(closes_the_connection(
            &after.expect_err("the connection is closed")
        ));
        server.abort();
    }

    #[actix_web::test]
    async fn commands_piling_up_unwritten_close_the_connection() {
        let (address, server) = server_that_never_reads().await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        // One command larger than the bound is still sent; it stalls the write.
        let mut large = redis::cmd("SET");
        large.arg("large").arg(vec![b'x'; MAX_UNWRITTEN + 1]);
        drop(connection.req_packed_command(&large));
        tokio::task::yield_now().await;
        // Then commands of 8 MiB each, as retried commits of large bodies would queue, each
        // left unanswered: the bound is reached after 8 of them.
        let mut piece = redis::cmd("SET");
        piece.arg("piece").arg(vec![b'x'; 8 * 1024 * 1024]);
        let mut queued = 0;
        let refused = loop {
            match connection.queue(|out| piece.write_packed_command(out), 1, 0, false) {
                Ok(_) => queued += 1,
                Err(error) => break error,
            }
            assert!(queued <= 9, "{queued} commands queued unwritten");
        };
        assert!(queued >= 8, "closed after {queued} commands");
        assert!(closes_the_connection(&refused));
        // Closed for real: its driver ends, and with it the socket and the stalled batch,
        // while the server still reads nothing.
        assert!(
            driver_ends(&connection.owner.shared).await,
            "the driver of the closed connection still runs, holding its socket"
        );
        server.abort();
    }

    /// Whether the driver of the connection that shares `shared` ends within a second
    /// (its task holds the only other reference), with `shared` held by one handle.
    async fn driver_ends(shared: &Arc<Shared>) -> bool {
        let deadline = Instant::now() + Duration::from_secs(1);
        while Arc::strong_count(shared) > 1 {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    #[actix_web::test]
    async fn a_connection_dropped_while_its_write_stalls_ends_its_driver() {
        let (address, server) = server_that_never_reads().await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        let mut large = redis::cmd("SET");
        large.arg("large").arg(vec![b'x'; 64 * 1024 * 1024]);
        drop(connection.req_packed_command(&large));
        // The driver writes what the socket takes, then waits for room.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let shared = Arc::clone(&connection.owner.shared);
        // The last handle goes (a spare whose exchange timed out, a store dropped).
        drop(connection);
        assert!(
            driver_ends(&shared).await,
            "the driver of a connection no one holds still runs, holding its socket"
        );
        server.abort();
    }

    #[test]
    fn a_connection_whose_runtime_is_gone_fails_its_requests_at_once() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime")
        };
        let first = runtime();
        let mut connection = first.block_on(async {
            let (address, _server) = server_that_never_reads().await;
            DirectConnection::open(&address).await.expect("connected")
        });
        // Its driver was spawned on that runtime, and goes with it.
        drop(first);
        runtime().block_on(async {
            let reply = tokio::time::timeout(
                Duration::from_secs(1),
                connection.req_packed_command(&get("a")),
            )
            .await
            .expect("answered at once, not left waiting for a driver that is gone");
            assert!(closes_the_connection(&reply.expect_err("no driver")));
        });
    }

    #[actix_web::test]
    async fn a_request_answered_before_its_deadline_gets_its_reply() {
        let command = get("a");
        let (address, _server) =
            scripted_server(command.get_packed_command().len(), b"$1\r\nA\r\n").await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        let deadline = Instant::now() + Duration::from_secs(5);
        let (reply, kept) = under_deadline(deadline, async {
            connection.req_packed_command(&command).await
        })
        .await;
        assert_eq!(reply.expect("a reply"), Value::BulkString(b"A".to_vec()));
        assert!(kept);
    }

    #[actix_web::test]
    async fn a_reply_larger_than_the_buffers_arrives_whole() {
        let body = vec![b'x'; 3 * KEPT_CAPACITY];
        let mut reply = format!("${}\r\n", body.len()).into_bytes();
        reply.extend_from_slice(&body);
        reply.extend_from_slice(b"\r\n+OK\r\n");
        let commands = [get("big"), get("small")];
        let expect = commands.iter().map(|c| c.get_packed_command().len()).sum();
        let (address, _server) =
            scripted_server_writing(expect, reply.leak(), 64 * 1024, Duration::ZERO).await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        let mut other = connection.clone();
        let [big, small] = commands;
        let (big, small) = futures_util::future::join(
            connection.req_packed_command(&big),
            other.req_packed_command(&small),
        )
        .await;
        assert_eq!(big.expect("a reply"), Value::BulkString(body));
        assert_eq!(small.expect("a reply"), Value::Okay);
    }

    #[actix_web::test]
    async fn a_pipeline_gets_its_replies_after_the_skipped_ones() {
        let mut pipeline = redis::pipe();
        pipeline
            .add_command(get("a"))
            .add_command(get("b"))
            .add_command(get("c"));
        let expect = pipeline.get_packed_pipeline().len();
        let (address, _server) = scripted_server(expect, b"+QUEUED\r\n:1\r\n$1\r\nC\r\n").await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        let values = connection
            .req_packed_commands(&pipeline, 1, 2)
            .await
            .expect("replies");
        assert_eq!(
            values,
            vec![Value::Int(1), Value::BulkString(b"C".to_vec())]
        );
    }

    #[actix_web::test]
    async fn a_lost_connection_fails_the_waiting_request_and_every_later_one_as_io_errors() {
        let expect = get("a").get_packed_command().len();
        // The server reads the command and closes without answering.
        let (address, server) = scripted_server(expect, b"").await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        let waiting = connection.req_packed_command(&get("a")).await;
        server.await.expect("the server ran");
        assert!(waiting.expect_err("no reply").is_io_error());
        let later = connection.req_packed_command(&get("b")).await;
        assert!(later.expect_err("the connection is gone").is_io_error());
    }

    #[actix_web::test]
    async fn a_reply_no_request_waits_for_fails_the_connection() {
        let (address, _server) = scripted_server(0, b"+OK\r\n").await;
        let mut connection = DirectConnection::open(&address).await.expect("connected");
        // The stray reply arrives while nothing waits; the connection is then out of step.
        for _ in 0..500 {
            if connection.has_failed() {
                break;
            }
            actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(connection.has_failed(), "the stray reply failed nothing");
        let after = connection.req_packed_command(&get("a")).await;
        assert!(after.expect_err("the connection failed").is_io_error());
    }

    #[actix_web::test]
    async fn a_server_that_cannot_be_reached_is_an_io_error() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .expect("a free port")
            .port();
        let error = DirectConnection::open(&loopback(port))
            .await
            .err()
            .expect("refused");
        assert!(error.is_io_error());
    }

    /// A server on a Unix socket at `path` that reads `expect` bytes of commands, answers
    /// `replies`, and closes the connection.
    #[cfg(unix)]
    fn unix_server(
        path: &std::path::Path,
        expect: usize,
        replies: &'static [u8],
    ) -> tokio::task::JoinHandle<Vec<u8>> {
        let listener = tokio::net::UnixListener::bind(path).expect("a socket");
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.expect("the store connects");
            let mut received = vec![0; expect];
            socket
                .read_exact(&mut received)
                .await
                .expect("the commands");
            socket.write_all(replies).await.expect("the replies");
            received
        })
    }

    /// A directory for a test's socket, removed when dropped, even by a failing test.
    #[cfg(unix)]
    struct SocketDirectory(std::path::PathBuf);

    #[cfg(unix)]
    impl SocketDirectory {
        fn new() -> Self {
            let path =
                std::env::temp_dir().join(format!("idempotency-direct-{}", std::process::id()));
            std::fs::create_dir_all(&path).expect("a directory");
            Self(path)
        }
    }

    #[cfg(unix)]
    impl Drop for SocketDirectory {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[cfg(unix)]
    #[actix_web::test]
    async fn a_unix_socket_carries_the_commands_and_their_replies() {
        let directory = SocketDirectory::new();
        let path = directory.0.join("redis.sock");
        let _ = std::fs::remove_file(&path);
        let (a, b) = (get("a"), get("b"));
        let expect = a.get_packed_command().len() + b.get_packed_command().len();
        let server = unix_server(&path, expect, b"$1\r\nA\r\n$-1\r\n");
        let address = ServerAddress {
            endpoint: Endpoint::Unix(path.clone()),
            db: 0,
            username: None,
            password: None,
        };
        let connection = DirectConnection::open(&address).await.expect("connected");
        let (mut first, mut second) = (connection.clone(), connection);
        let (a, b) =
            futures_util::future::join(first.req_packed_command(&a), second.req_packed_command(&b))
                .await;
        assert_eq!(a.expect("a reply"), Value::BulkString(b"A".to_vec()));
        assert_eq!(b.expect("a reply"), Value::Nil);
        let received = server.await.expect("the server ran");
        assert_eq!(
            received,
            b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n*2\r\n$3\r\nGET\r\n$1\r\nb\r\n"
        );
    }
}
