//! The Redis protocol of the store: the command or function of each step and the decoding of
//! its reply, independent of the connection that carries them (any
//! [`redis::aio::ConnectionLike`]: a server's multiplexed connection, a cluster connection).
//!
//! | step | what Redis runs | cost inside Redis |
//! |---|---|---|
//! | `begin` | `SET key <in-flight record> NX PX lease GET` | one plain command |
//! | `commit` (Valkey ≥ 8.1) | `SET key <completed record> IFEQ <in-flight record> PX ttl` | one plain command |
//! | `commit` (other servers) | `FCALL`: `GET`, compare with the in-flight record, then `SET key <completed record> PX ttl` | one short function |
//! | `renew` | `FCALL`: `GET`, then `PEXPIRE` | one short function |
//! | `release` | `FCALL`: `GET`, then `DEL` (or, for a key taken over a marker, `SET key <marker> PXAT <its expiry>`) | one short function |
//! | `abandon` | `FCALL`: `GET`, then `SET key <marker> PX remember_for` (or, on a completed record, `PEXPIRE key remember_for GT`) | one short function |
//! | `begin` finding another token's marker | `FCALL`: `GET`, then `SET key <in-flight record, the marker's expiry and the marker> PX lease` if the marker is still there | one short function, a second round trip |
//!
//! `begin` needs no script: `SET … NX … GET` (Redis ≥ 7.0) creates the in-flight record or
//! returns the record that is there, and the caller decides from it (its own token: a retry
//! after a lost reply; another fingerprint: mismatch; in flight: conflict; completed:
//! replay). The other steps are fenced by the token, a compare-and-write that only a script
//! or function does atomically on Redis 7.0; each reads the record with `GET`, and the
//! record it expects, an in-flight one, is the fixed-size header alone. `commit` is a plain
//! command on Valkey ≥ 8.1, `SET … IFEQ`, which compares the whole record (see
//! `conditional_set`; Redis ≥ 8.4 has it too but is not trusted with it, see
//! `server_kind`).
//!
//! Every request touches one key and is safe to send twice with the same arguments (a
//! retry after a connection dropped before the reply came): a repeated `begin` finds its
//! own token and acquires, a repeated `commit` finds the record completed by its token and
//! writes nothing (the function commit answers 2 then, for replicated writes to rewrite the
//! record before their `WAIT`), `renew` and `release` compare the token first.

use std::time::Duration;

use actix_web::web::Bytes;
use redis::Value;

use super::missing_library::LibraryMissing;
use super::packed::{Carrier, PackedCommand, Packer};
use super::record::{self, Found};
use crate::fingerprint::Fingerprint;
use crate::record::{RecordError, StoredResponse};
use crate::scope::StorageKey;
use crate::store::{BeginOutcome, LeaseToken, StoreError};

/// One step, ready to be sent on any connection.
pub(crate) enum Request {
    /// A plain command.
    Command(PackedCommand),
    /// A `SET … IFEQ` (a commit, or a rewrite for replicated writes): sent only on a
    /// connection to a server trusted with it (Valkey; see `server_kind`), refused with
    /// [`conditional_set_not_trusted`] before anything is written on any other, so that
    /// the step sends its function instead.
    ConditionalSet(PackedCommand),
    /// An `FCALL` of a function of [`LIBRARY`], loaded first if the server does not have it.
    Function(PackedCommand),
}

impl Request {
    /// The command (or `FCALL`) itself, to pipeline it with another.
    pub(crate) fn command(&self) -> &redis::Cmd {
        self.packed().command()
    }

    fn packed(&self) -> &PackedCommand {
        match self {
            Self::Command(command) | Self::ConditionalSet(command) | Self::Function(command) => {
                command
            }
        }
    }

    /// Whether it may be sent on `connection`: a `SET … IFEQ` only to a server trusted with
    /// it.
    pub(crate) fn may_go_on(&self, connection: &impl Carrier) -> redis::RedisResult<()> {
        match self {
            Self::ConditionalSet(_) if !connection.trusts_conditional_set() => {
                Err(conditional_set_not_trusted())
            }
            _ => Ok(()),
        }
    }

    /// Sends the request on `connection` and returns the raw reply. Whether it may go there
    /// at all is [`Exchange::send`](super::exchange::Exchange::send)'s to check, the one
    /// way every step sends.
    pub(crate) async fn send(&self, connection: &mut impl Carrier) -> redis::RedisResult<Value> {
        let reply = connection.send_packed(self.packed()).await?.extract_error();
        match (self, reply) {
            (Self::Function(call), Err(error)) if is_function_not_found(&error) => {
                load_library(connection).await?;
                connection.send_packed(call).await?.extract_error()
            }
            (_, reply) => reply,
        }
    }
}

/// The functions of the fenced steps, one library loaded once per server (Redis ≥ 7.0).
///
/// Functions rather than `EVALSHA` scripts: the same Lua costs about 1 µs less per call
/// inside Redis (measured with `INFO commandstats`), and a function stays loaded across a
/// `SCRIPT FLUSH`. The name carries the record format and the library's revision (`r2`:
/// renew and release flagged `allow-oom`; `r3`: `abandon` and `claim`, and `commit` only
/// completes an in-flight record; `r4`: every function reads the record with `GET`; `r5`:
/// `commit` is sent the whole completed record and compares the whole in-flight one; `r6`:
/// `commit` answers 2 for a record its token completed earlier, and `rewrite`; `r7`: r6 as
/// it ended, with `rewrite` flagged `allow-oom`, a flag some builds of r6 lacked; `r8`:
/// `abandon` keeps a completed record it finds for at least `remember_for`; `r9`: a record
/// written over a marker keeps the marker's tokens out for the marker's time, see below), so
/// versions of this crate with another format or revision load their own library next to
/// this one. Revisions of one format read and write the same records, so instances of
/// two revisions share keys safely. A library already loaded under its name is never
/// replaced (`FUNCTION LOAD` without `REPLACE`: an older instance may be calling it), so
/// its code must never change under one name: a test pins the code's digest to the name.
///
/// `abandon` replaces the token's in-flight record or nothing by the token's marker (state
/// `a`, 97), adds the token to a marker that is there (keeping the earlier tokens, bounded
/// by bytes), keeps a completed record for at least `remember_for` (`PEXPIRE … GT`: the
/// record stands for the marker, so a late `begin` of the token must find it as long as it
/// would have found the marker; 1), and answers 0 when another token's
/// in-flight record (or a state it does not know) is there. `claim` is how `begin` takes a
/// key where it found another token's marker: it writes the in-flight record only if that
/// marker (compared whole) is still there, or nothing is, and otherwise returns the record
/// that is there, as `SET … GET` would.
///
/// A key taken over a marker keeps the marker's tokens out for the rest of the marker's
/// time, whatever its holder does next: `claim` writes the in-flight record followed by the
/// marker's expiry (`PEXPIRETIME`, 8 bytes, Unix time in milliseconds, big-endian) and the
/// marker itself (see `record`); `release` puts that marker back until its expiry
/// (`SET … PXAT`, which writes nothing once it has passed) instead of deleting the key, so
/// that an abandoned `begin` landing after the release (another connection, a retried
/// command) still creates nothing; `abandon` of the holder's own token adds the marker's
/// tokens to its marker and keeps it at least until that expiry; `commit` completes the
/// record and keeps it at least until that expiry (`PEXPIREAT … GT`), as `abandon` keeps a
/// completed record. `claim` writing a completed record (a commit written anew over a
/// marker) keeps it for the marker's time the same way. `renew` extends the lease alone.
/// Only `claim` writes such a record, so a key taken over a marker by an instance of an
/// earlier revision is left empty by its release, as before. `PEXPIRETIME` and
/// `PEXPIREAT` are called only on these paths and only where the user may (`redis.pcall`):
/// a user granted what earlier revisions called alone (README, "The Redis user's rights")
/// gets their behaviour there, never a failed step.
///
/// Under `maxmemory` Redis refuses a function that may grow memory once it is full; renew
/// (`PEXPIRE`) and release (`DEL`) never do, so they are flagged `allow-oom` and keep working:
/// a request whose commit is refused keeps its key locked by renewing it until memory frees.
/// Commit grows memory and is left unflagged (refused when full, retried by the engine).
///
/// Lua strings are 1-based: the token field (length byte, then the token) starts at byte
/// `TOKEN_OFFSET + 1` = 35 and the state is byte 2 (`i` = 105, `c` = 99). Each function
/// reads the record with `GET`: the record a fenced step expects is an in-flight record,
/// which is its header alone (and a marker, for one that took the key over it), so only a
/// step that finds a completed record reads a stored body. `GET` rather than `GETRANGE` of the header: Lua formats a number argument of
/// `redis.call` with `printf`, which made the range cost more than the record (r4 measured
/// about 1 µs less per `commit` inside Redis than r3, with `redis-benchmark` and
/// `INFO commandstats`).
///
/// `commit` is sent both records, built by the client: the in-flight record its `begin`
/// wrote (format, state, fingerprint, token) and the completed one. It writes the completed
/// record if what it reads is that in-flight record, byte for byte. Lua interns its
/// strings, so that comparison is one pointer comparison, and no string is cut or joined
/// in Redis: r5's `commit` costs about 1.4 µs less inside Redis than r4's, which built the
/// completed record from the one it read (9.8 → 8.4 µs per call in `INFO commandstats`
/// under new keys). The comparison is the token's fence: a record holding `token` in flight
/// is the one its `begin` wrote (same format, fingerprint and token), as no one else
/// writes `token`. Only when it differs does `commit` look further, for the record its own
/// earlier `commit` completed (a retry after a lost reply), and answers 2 then: it wrote
/// nothing, which replicated writes must know (see [`rewrite`]). A record that took the key
/// over a marker is longer than the one the client sends: it is completed where it starts
/// with that one, a comparison made only after the first failed, so the commit of a key
/// taken the usual way runs as before.
///
/// `rewrite` writes a record over itself, its expiry kept, if the key holds exactly that
/// record: the function form of [`rewrite`]'s `SET … IFEQ … KEEPTTL`. The same bytes take no
/// more memory, so it is flagged `allow-oom`: a `begin` resent to a full server without
/// `SET … IFEQ` that finds its own lock can still have it counted by `WAIT`. A full server
/// with `SET … IFEQ` refuses that `SET` (`OOM`, whatever its size), so there such a `begin`
/// is refused (503, no handler run).
pub(crate) const LIBRARY: &str = r"#!lua name=idempotency_actix_2_r9

local function holds(found, token_field)
  return found and string.sub(found, 35, 34 + #token_field) == token_field
end

-- The reply of a command the user may not be granted (an ACL made for an earlier
-- revision), or nil where it was refused.
local function granted(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then return nil end
  return reply
end

-- The marker an in-flight record whose header is `header` bytes took the key over, and
-- the marker's expiry (Unix time in milliseconds); nil for a record that took a free key.
local function taken_over(found, header)
  if #found <= header + 8 then return nil end
  return string.sub(found, header + 9), (struct.unpack('>I8', found, header + 1))
end

redis.register_function('idempotency_actix_2_r9_commit', function(keys, args)
  local found = redis.call('GET', keys[1])
  if found == args[1] then
    redis.call('SET', keys[1], args[2], 'PX', args[3])
    return 1
  end
  if not found then return 0 end
  if string.sub(found, 1, #args[1]) == args[1] then
    local marker, expiry = taken_over(found, #args[1])
    if marker then
      redis.call('SET', keys[1], args[2], 'PX', args[3])
      granted('PEXPIREAT', keys[1], expiry, 'GT')
      return 1
    end
  end
  if holds(found, string.sub(args[1], 35)) and string.byte(found, 2) == 99 then return 2 end
  return 0
end)

redis.register_function{
  function_name = 'idempotency_actix_2_r9_rewrite',
  flags = {'allow-oom'},
  callback = function(keys, args)
    if redis.call('GET', keys[1]) ~= args[1] then return 0 end
    redis.call('SET', keys[1], args[1], 'KEEPTTL')
    return 1
  end,
}

redis.register_function{
  function_name = 'idempotency_actix_2_r9_renew',
  flags = {'allow-oom'},
  callback = function(keys, args)
    local found = redis.call('GET', keys[1])
    if not holds(found, args[1]) or string.byte(found, 2) ~= 105 then return 0 end
    redis.call('PEXPIRE', keys[1], args[2])
    return 1
  end,
}

redis.register_function{
  function_name = 'idempotency_actix_2_r9_release',
  flags = {'allow-oom'},
  callback = function(keys, args)
    local found = redis.call('GET', keys[1])
    if not holds(found, args[1]) or string.byte(found, 2) ~= 105 then return 0 end
    local marker, expiry = taken_over(found, 34 + #args[1])
    if marker then
      redis.call('SET', keys[1], marker, 'PXAT', expiry)
    else
      redis.call('DEL', keys[1])
    end
    return 1
  end,
}

redis.register_function{
  function_name = 'idempotency_actix_2_r9_abandon',
  flags = {'allow-oom'},
  callback = function(keys, args)
    local found = redis.call('GET', keys[1])
    local state = found and string.byte(found, 2)
    if state == 99 then
      redis.call('PEXPIRE', keys[1], args[3], 'GT')
      return 1
    end
    local earlier, expiry = found, nil
    if state == 105 and holds(found, args[1]) then
      earlier, expiry = taken_over(found, 34 + #args[1])
    elseif found and state ~= 97 then
      return 0
    end
    local marker = args[2]
    if earlier then
      marker = marker .. string.sub(earlier, 35, 34 + tonumber(args[4]))
    end
    redis.call('SET', keys[1], marker, 'PX', args[3])
    if expiry then granted('PEXPIREAT', keys[1], expiry, 'GT') end
    return 1
  end,
}

redis.register_function('idempotency_actix_2_r9_claim', function(keys, args)
  local found = redis.call('GET', keys[1])
  if found and found ~= args[1] then return found end
  local expiry = found and granted('PEXPIRETIME', keys[1])
  if not expiry or expiry <= 0 then
    redis.call('SET', keys[1], args[2], 'PX', args[3])
  elseif string.byte(args[2], 2) == 105 then
    redis.call('SET', keys[1], args[2] .. struct.pack('>I8', expiry) .. found, 'PX', args[3])
  else
    redis.call('SET', keys[1], args[2], 'PX', args[3])
    granted('PEXPIREAT', keys[1], expiry, 'GT')
  end
  return false
end)
";

pub(crate) fn is_function_not_found(error: &redis::RedisError) -> bool {
    error.to_string().contains("Function not found")
}

/// Loads [`LIBRARY`]; one that another connection loaded meanwhile is fine.
pub(crate) async fn load_library(
    connection: &mut impl redis::aio::ConnectionLike,
) -> redis::RedisResult<()> {
    let loaded: redis::RedisResult<Value> = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(LIBRARY)
        .query_async(connection)
        .await;
    match loaded {
        Err(error) if !error.to_string().contains("already exists") => Err(error),
        _ => Ok(()),
    }
}

/// Loads [`LIBRARY`] when a connection opens, ahead of any need, while the server likely
/// has room: `FUNCTION LOAD` is refused once it is full, when `renew` (flagged `allow-oom`)
/// must still work, and where commits go by `SET … IFEQ` no commit loads the library
/// before a `renew` needs it. A full server's refusal is logged and left to the load on
/// first use.
///
/// Any other refusal (a user without `FUNCTION LOAD`, a command renamed away) is an error
/// where the server lacks the library, or where the user may not call functions at all
/// (see [`probe_library`]): no step could then fence a commit, renew a lease or give a key
/// back, so a handler run under the connection's `begin` would leave its key locked for a
/// lease and then run again for a retry (or, its lease not renewed, run twice). The
/// connection is not used: keyed requests are refused (503 when failing closed) before
/// any handler runs, and a request opens a connection anew once the store's
/// [`RETRY_INTERVAL`](super::missing_library::RETRY_INTERVAL) has passed (see
/// [`MissingLibrary`](super::missing_library::MissingLibrary), through which every
/// connection is opened), so they are served within it once someone who may loads the
/// library (a user that needs `FCALL` only is then fine).
///
/// On Redis 7.0 and 7.1 it also keeps replicated writes honest: there a `WAIT` sent as a
/// connection's very first command answers at once, whatever the replicas hold, where
/// after any command (even a refused one) it counts the server's replication offset; every
/// connection the stores open sends this first. (Since 7.2 `WAIT` counts a connection's own
/// writes, so a step that wrote nothing rewrites its record before its `WAIT`: see
/// [`rewrite`].) Keep it so.
pub(crate) async fn load_library_ahead(
    connection: &mut impl LibraryProbe,
) -> Result<(), LibraryMissing> {
    let Err(error) = load_library(connection).await else {
        return Ok(());
    };
    if error.code() != Some("OOM") {
        match connection.probe_library().await {
            Library::Missing => return Err(LibraryMissing::found(&error)),
            Library::Forbidden(refusal) => return Err(LibraryMissing::forbidden(&refusal)),
            Library::Callable => {}
        }
    }
    tracing::debug!(%error, "idempotency: functions not loaded yet; they are loaded on first use");
    Ok(())
}

/// What [`probe_library`] finds of [`LIBRARY`] for a connection.
#[derive(Debug)]
pub(crate) enum Library {
    /// The server has it and the connection's user may call it; or the probe could not
    /// tell, and the steps find out for themselves.
    Callable,
    /// The server has no function of it.
    Missing,
    /// The connection's user may not call functions (`FCALL` refused by its ACL, with this
    /// error), so no step could be fenced, whether the server has them or not.
    Forbidden(redis::RedisError),
}

/// Whether the server has the functions of [`LIBRARY`] and the connection's user may call
/// them, asked without writing anything.
///
/// First an `FCALL_RO` of one with no key, which runs nothing either way (a function that
/// writes, called read-only, is refused after it is found): "not found" means missing. Where
/// it is found, or `FCALL_RO` itself is refused, an `FCALL` of `renew` with no key follows,
/// which the ACL refuses for a user who may not call functions (`-@scripting`, `-fcall`;
/// and where only `FCALL_RO` was refused, `-@scripting +fcall`, it tells whether the
/// functions are there), and which otherwise fails inside the function at its first line,
/// with no key to read, writing nothing. A user who may not call them gets nothing from
/// them: on a server with `SET … IFEQ` its `begin` and commit work, so keyed requests would
/// run their handlers with no lease renewed, nor any key given back. Any other answer
/// counts as callable: the steps then find out for themselves.
pub(crate) async fn probe_library(connection: &mut impl redis::aio::ConnectionLike) -> Library {
    let read_only = LibraryProbeStep::ReadOnly
        .command()
        .query_async(connection)
        .await;
    if let Some(found) = LibraryProbeStep::ReadOnly.decides(read_only) {
        return found;
    }
    let call = LibraryProbeStep::Call
        .command()
        .query_async(connection)
        .await;
    LibraryProbeStep::Call
        .decides(call)
        .unwrap_or(Library::Callable)
}

/// The two commands of [`probe_library`], in their order, for a connection that sends each
/// where it chooses (a cluster's, to each primary).
#[derive(Clone, Copy)]
pub(crate) enum LibraryProbeStep {
    /// `FCALL_RO` of a function with no key.
    ReadOnly,
    /// `FCALL` of `renew` with no key.
    Call,
}

impl LibraryProbeStep {
    pub(crate) fn command(self) -> redis::Cmd {
        let (command, function) = match self {
            Self::ReadOnly => ("FCALL_RO", "idempotency_actix_2_r9_commit"),
            Self::Call => ("FCALL", "idempotency_actix_2_r9_renew"),
        };
        let mut probe = redis::cmd(command);
        probe.arg(function).arg(0);
        probe
    }

    /// What the step's `answer` tells, if it decides: the read-only step only that the
    /// functions are missing, the call also that they may not be called (and nothing where
    /// neither: callable, as far as the probe can tell).
    pub(crate) fn decides(self, answer: redis::RedisResult<Value>) -> Option<Library> {
        match (self, answer) {
            (_, Err(error)) if is_function_not_found(&error) => Some(Library::Missing),
            (Self::Call, Err(error)) if error.code() == Some("NOPERM") => {
                Some(Library::Forbidden(error))
            }
            _ => None,
        }
    }
}

/// A connection the store can ask what its servers have of [`LIBRARY`]: one server's, which
/// [`probe_library`] asks; a cluster's asks every primary, as a key may live on any of them
/// (a primary added to the cluster, or restarted, without the functions).
pub(crate) trait LibraryProbe: redis::aio::ConnectionLike {
    /// What the connection's servers have of [`LIBRARY`], and whether its user may call it.
    async fn probe_library(&mut self) -> Library
    where
        Self: Sized,
    {
        probe_library(self).await
    }
}

/// An `FCALL` of `function` on `key`, with room for `args` more arguments of `bytes` bytes.
fn function(function: &str, key: &StorageKey, args: usize, bytes: usize) -> Packer {
    PackedCommand::build(
        "FCALL",
        3 + args,
        function.len() + 1 + key.as_str().len() + bytes,
    )
    .arg(function)
    .arg("1")
    .arg(key.as_str())
}

/// `begin`: create the in-flight record for `token`, or get the record that is there.
pub(crate) fn begin(
    key: &StorageKey,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
    lease: Duration,
) -> Request {
    let in_flight = record::in_flight(fingerprint, token);
    let bytes = key.as_str().len() + in_flight.len() + "NXPXGET".len();
    let command = PackedCommand::build("SET", 6, bytes)
        .arg(key.as_str())
        .arg(in_flight)
        .arg("NX")
        .arg("PX")
        .number(record::millis(lease))
        .arg("GET")
        .done();
    Request::Command(command)
}

/// `GET` of the record: what [`begin`] falls back to when Redis is out of memory (its reply
/// then decodes with [`begin_outcome`] like `begin`'s; nil: no record), and what a
/// commit that wrote nothing reads (decoded with [`unwritten`]).
pub(crate) fn read(key: &StorageKey) -> Request {
    let command = PackedCommand::build("GET", 1, key.as_str().len())
        .arg(key.as_str())
        .done();
    Request::Command(command)
}

/// Whether Redis refused the command because it is at `maxmemory` (`OOM` error), as it
/// refuses every write that may grow memory under `noeviction`.
pub(crate) fn is_out_of_memory(error: &StoreError) -> bool {
    match error {
        StoreError::Unavailable(source) => source
            .downcast_ref::<redis::RedisError>()
            .is_some_and(|error| error.code() == Some("OOM")),
        _ => false,
    }
}

/// Whether `reply` (to [`read`]) is the in-flight record of `token`. Never panics, whatever
/// the bytes.
pub(crate) fn is_lock_of(reply: &Value, token: &LeaseToken) -> bool {
    match reply {
        Value::BulkString(record) => matches!(
            Found::read(record),
            Ok(Found::InFlight { token: holder, .. }) if holder == token.as_bytes()
        ),
        _ => false,
    }
}

/// What the reply to [`begin`] (or [`claim`]) says.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Begun {
    /// The outcome and, for a completed record, how much longer it is kept.
    Decided(BeginOutcome, Option<Duration>),
    /// Another token's marker, which blocks no one: [`claim`] the key over it.
    OtherMarker(Vec<u8>),
}

/// Decodes the reply to [`begin`] or [`claim`].
pub(crate) fn begin_outcome(
    reply: Value,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
) -> Result<Begun, StoreError> {
    let record = match reply {
        Value::Nil => return Ok(Begun::Decided(BeginOutcome::Acquired, None)),
        Value::BulkString(record) => record,
        other => return Err(unexpected(&other)),
    };
    let ours = fingerprint.as_bytes().as_slice();
    let (outcome, remaining) = match Found::read(&record)? {
        Found::Abandoned { tokens } if record::remembers(tokens, token) => {
            (BeginOutcome::Abandoned, None)
        }
        Found::Abandoned { .. } => return Ok(Begun::OtherMarker(record)),
        Found::InFlight {
            token: holder,
            fingerprint: _,
        } if holder == token.as_bytes() => (BeginOutcome::Acquired, None),
        Found::InFlight { fingerprint, .. } | Found::Completed { fingerprint, .. }
            if fingerprint != ours =>
        {
            (BeginOutcome::FingerprintMismatch, None)
        }
        Found::InFlight { .. } => (BeginOutcome::InFlight, None),
        Found::Completed {
            format, tail_start, ..
        } => {
            // The reply's buffer becomes the body's: no copy of the stored body.
            let tail = Bytes::from(record).slice(tail_start..);
            let (response, remaining) = record::decode_completion(format, tail)?;
            (BeginOutcome::Completed(response), Some(remaining))
        }
    };
    Ok(Begun::Decided(outcome, remaining))
}

/// `claim`: what `begin` sends after it found another token's `marker`: the in-flight record
/// of `token`, written only if that marker is still there (or nothing is). Its reply decodes
/// with [`begin_outcome`].
pub(crate) fn claim(
    key: &StorageKey,
    marker: Vec<u8>,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
    lease: Duration,
) -> Request {
    claim_over(key, marker, record::in_flight(fingerprint, token), lease)
}

/// The library's `claim`: writes `record` for `expiry` if `marker` is still there (compared
/// whole) or nothing is; otherwise returns the record that is there.
fn claim_over(key: &StorageKey, marker: Vec<u8>, record: Vec<u8>, expiry: Duration) -> Request {
    let bytes = marker.len() + record.len();
    let call = function("idempotency_actix_2_r9_claim", key, 3, bytes)
        .arg(marker)
        .arg(record)
        .number(record::millis(expiry))
        .done();
    Request::Function(call)
}

/// How `commit` is sent.
///
/// Either way, a commit that wrote nothing is followed by a [`read`] of the record, decoded
/// with [`unwritten`]: whether an earlier send completed it, or the key is free and the
/// record is written anew ([`recreate`]). A rare round trip or two: only when the lease was
/// lost or the commit was sent twice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitBy {
    /// One plain command, on Valkey ≥ 8.1 (Redis ≥ 8.4 has `SET … IFEQ` too, but is not
    /// trusted with it: see `server_kind`):
    /// `SET key <completed record> IFEQ <in-flight record> PX ttl` writes what the function
    /// writes, under the same condition. Its reply decodes with [`written`]. A server
    /// without `IFEQ` answers a syntax error ([`is_syntax_error`]) and writes nothing.
    ConditionalSet,
    /// An `FCALL` of the library's `commit`. Its reply decodes with [`held`], which also
    /// answers 1 where an earlier send of the same commit completed the record.
    Function,
}

/// `commit`: complete the record held by `token` (for the request of `fingerprint`) with
/// `response`, kept for `ttl`. Both ways are sent the in-flight record the request's `begin`
/// wrote and the completed record that replaces it, and write only over the former.
pub(crate) fn commit(
    by: CommitBy,
    key: &StorageKey,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
    response: &StoredResponse,
    ttl: Duration,
) -> Request {
    let in_flight = record::in_flight(fingerprint, token);
    let completed = record::completed(&in_flight, response, ttl);
    match by {
        CommitBy::ConditionalSet => {
            let bytes = key.as_str().len() + completed.len() + in_flight.len() + "IFEQPX".len();
            let command = PackedCommand::build("SET", 6, bytes)
                .arg(key.as_str())
                .arg(completed)
                .arg("IFEQ")
                .arg(in_flight)
                .arg("PX")
                .number(record::millis(ttl))
                .done();
            Request::ConditionalSet(command)
        }
        CommitBy::Function => {
            let bytes = in_flight.len() + completed.len();
            let call = function("idempotency_actix_2_r9_commit", key, 3, bytes)
                .arg(in_flight)
                .arg(completed)
                .number(record::millis(ttl))
                .done();
            Request::Function(call)
        }
    }
}

/// Decodes the reply to a commit by [`CommitBy::ConditionalSet`]: whether it wrote.
pub(crate) fn written(reply: Value) -> Result<bool, StoreError> {
    match reply {
        Value::Okay => Ok(true),
        Value::SimpleString(status) if status == "OK" => Ok(true),
        Value::Nil => Ok(false),
        other => Err(unexpected(&other)),
    }
}

/// What a commit that wrote nothing finds at its key, read with [`read`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unwritten {
    /// The record completed by this token: an earlier send of the same commit landed (its
    /// reply was lost), so the commit is done (see [`rewrite`] for its replicas).
    CompletedEarlier(Vec<u8>),
    /// Nothing, or another token's marker, which blocks no one: the in-flight record was
    /// lost (evicted, deleted by hand, or expired with a lease that could not be renewed)
    /// and no request holds the key now: the completed record may be written anew
    /// ([`recreate`]), over that marker if any.
    Free(Option<Vec<u8>>),
    /// This token's own in-flight record, as `begin` wrote it: the commit that wrote nothing
    /// was answered by a node that no longer served the key (a primary that woke after its
    /// replica took over, and answered once before learning it), and this read by the one
    /// that does. The commit is sent again; nothing is lost.
    StillHeld,
    /// This token's own in-flight record, written over another token's marker, which it
    /// carries (see [`LIBRARY`]): `SET … IFEQ` compares the whole record, so it writes
    /// nothing there; the library's `commit` completes it.
    HeldOverMarker,
    /// Another request's record (or one this version cannot read): left alone.
    Taken,
}

/// Decodes the reply to [`read`] after a commit that wrote nothing (see [`Unwritten`]): the
/// commit of `token` for the request of `fingerprint`.
pub(crate) fn unwritten(
    reply: Value,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
) -> Result<Unwritten, StoreError> {
    let found = match reply {
        Value::Nil => return Ok(Unwritten::Free(None)),
        Value::BulkString(found) => found,
        other => return Err(unexpected(&other)),
    };
    if record::completed_by(&found, token) {
        return Ok(Unwritten::CompletedEarlier(found));
    }
    // Exactly what the commit compared with: the token with another fingerprint is not
    // the record its `begin` wrote, and a commit for it writes nothing, by design.
    let in_flight = record::in_flight(fingerprint, token);
    if found == in_flight {
        return Ok(Unwritten::StillHeld);
    }
    if record::took_over_a_marker(&found, &in_flight) {
        return Ok(Unwritten::HeldOverMarker);
    }
    Ok(match Found::read(&found) {
        Ok(Found::Abandoned { tokens }) if !record::remembers(tokens, token) => {
            Unwritten::Free(Some(found))
        }
        _ => Unwritten::Taken,
    })
}

/// Writes the completed record of `token` (for the request of `fingerprint`) with
/// `response`, kept for `ttl`, where [`unwritten`] found the key [`Free`](Unwritten::Free):
/// only if `marker` is still there, or nothing is (the library's `claim`, as `begin` takes
/// a key over a marker). Its reply decodes with [`recreated`].
pub(crate) fn recreate(
    key: &StorageKey,
    marker: Option<Vec<u8>>,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
    response: &StoredResponse,
    ttl: Duration,
) -> Request {
    let in_flight = record::in_flight(fingerprint, token);
    let completed = record::completed(&in_flight, response, ttl);
    claim_over(key, marker.unwrap_or_default(), completed, ttl)
}

/// Decodes the reply to [`recreate`]: `None` when it wrote; otherwise what it found there,
/// read as [`unwritten`] reads it: the record this very request wrote when it was sent
/// again after its connection died ([`Unwritten::CompletedEarlier`]), or another request's.
pub(crate) fn recreated(
    reply: Value,
    fingerprint: &Fingerprint,
    token: &LeaseToken,
) -> Result<Option<Unwritten>, StoreError> {
    match reply {
        Value::Nil => Ok(None),
        found @ Value::BulkString(_) => unwritten(found, fingerprint, token).map(Some),
        other => Err(unexpected(&other)),
    }
}

/// Writes `record` over itself, its expiry kept: a write that changes nothing but is
/// replicated, for a `WAIT` on this connection to count the record's replication, when the
/// write that made it went out on another connection or the step that found it wrote
/// nothing (see `Steps::rewritten_for_replicas`). Since Redis 7.2 (and on Valkey) `WAIT`
/// counts only what its own connection's writes were replicated to: after a command that
/// wrote nothing it answers at once. Nothing is written if the record is no longer exactly
/// `record`. `SET … IFEQ … KEEPTTL` where commits go by it (Valkey ≥ 8.1;
/// refused by a full server, as every `SET` is), the library's `rewrite` elsewhere; its
/// reply decodes with [`rewritten`].
pub(crate) fn rewrite(by: CommitBy, key: &StorageKey, record: &[u8]) -> Request {
    match by {
        CommitBy::ConditionalSet => {
            let bytes = key.as_str().len() + 2 * record.len() + "IFEQKEEPTTL".len();
            let command = PackedCommand::build("SET", 5, bytes)
                .arg(key.as_str())
                .arg(record)
                .arg("IFEQ")
                .arg(record)
                .arg("KEEPTTL")
                .done();
            Request::ConditionalSet(command)
        }
        CommitBy::Function => {
            let call = function("idempotency_actix_2_r9_rewrite", key, 1, record.len())
                .arg(record)
                .done();
            Request::Function(call)
        }
    }
}

/// Decodes the reply to [`rewrite`] sent `by`: whether it wrote.
pub(crate) fn rewritten(by: CommitBy, reply: Value) -> Result<bool, StoreError> {
    match by {
        CommitBy::ConditionalSet => written(reply),
        CommitBy::Function => held(reply),
    }
}

/// What a commit did: it wrote the completed record; it found the record its own token
/// completed earlier and wrote nothing (the function commit says so, `SET … IFEQ` cannot);
/// or it wrote nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Committed {
    Written,
    CompletedEarlier,
    Unwritten,
}

/// Decodes the reply to a [`commit`] sent `by`.
pub(crate) fn committed(by: CommitBy, reply: Value) -> Result<Committed, StoreError> {
    match (by, reply) {
        (CommitBy::ConditionalSet, reply) => Ok(if written(reply)? {
            Committed::Written
        } else {
            Committed::Unwritten
        }),
        (CommitBy::Function, Value::Int(1)) => Ok(Committed::Written),
        (CommitBy::Function, Value::Int(2)) => Ok(Committed::CompletedEarlier),
        (CommitBy::Function, Value::Int(0)) => Ok(Committed::Unwritten),
        (CommitBy::Function, other) => Err(unexpected(&other)),
    }
}

/// Why a `SET … IFEQ` was not sent (see [`conditional_set_not_trusted`]).
const NOT_TRUSTED: &str = "the connection's server is not trusted with it (only Valkey is)";

/// The refusal of a `SET … IFEQ` on a connection to a server not trusted with it (see
/// [`Request::ConditionalSet`]): nothing was sent.
pub(crate) fn conditional_set_not_trusted() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Client,
        "SET … IFEQ not sent",
        NOT_TRUSTED.to_owned(),
    ))
}

/// Whether a request by [`CommitBy::ConditionalSet`] was not sent because its connection's
/// server is not trusted with `SET … IFEQ` (see [`Request::ConditionalSet`]): the step is
/// sent by function instead.
pub(crate) fn was_not_trusted_with_conditional_set(error: &StoreError) -> bool {
    redis_error_of(error).is_some_and(|error| error.detail() == Some(NOT_TRUSTED))
}

/// Whether Redis refused the command as a syntax error: what a server without
/// `SET … IFEQ` answers to a commit by [`CommitBy::ConditionalSet`], writing nothing.
pub(crate) fn is_syntax_error(error: &StoreError) -> bool {
    redis_error_of(error)
        .is_some_and(|error| error.code() == Some("ERR") && error.detail() == Some("syntax error"))
}

/// The Redis error a store error carries, if it carries one.
fn redis_error_of(error: &StoreError) -> Option<&redis::RedisError> {
    match error {
        StoreError::Unavailable(source) => source.downcast_ref::<redis::RedisError>(),
        _ => None,
    }
}

/// `renew`: extend the lease held by `token` to `lease` from now.
pub(crate) fn renew(key: &StorageKey, token: &LeaseToken, lease: Duration) -> Request {
    let token = record::token_field(token);
    let call = function("idempotency_actix_2_r9_renew", key, 2, token.len())
        .arg(token)
        .number(record::millis(lease))
        .done();
    Request::Function(call)
}

/// `release`: delete the in-flight record held by `token`.
pub(crate) fn release(key: &StorageKey, token: &LeaseToken) -> Request {
    let token = record::token_field(token);
    let call = function("idempotency_actix_2_r9_release", key, 1, token.len())
        .arg(token)
        .done();
    Request::Function(call)
}

/// `abandon`: leave the marker of `token` for `remember_for` in place of its in-flight
/// record or nothing, add `token` to the marker that is there, or keep a completed record
/// that is there for at least `remember_for`.
pub(crate) fn abandon(key: &StorageKey, token: &LeaseToken, remember_for: Duration) -> Request {
    let (field, marker) = (record::token_field(token), record::abandoned(token));
    let bytes = field.len() + marker.len();
    let call = function("idempotency_actix_2_r9_abandon", key, 4, bytes)
        .arg(field)
        .arg(marker)
        .number(record::millis(remember_for))
        .number(record::REMEMBERED_TAIL as u64)
        .done();
    Request::Function(call)
}

/// Decodes the reply to `commit`, `renew`, `release` or `abandon`: whether the step was done
/// (the token held the record; for `abandon`, the marker is written).
pub(crate) fn held(reply: Value) -> Result<bool, StoreError> {
    match reply {
        Value::Int(flag) => Ok(flag == 1),
        other => Err(unexpected(&other)),
    }
}

/// Whether `error` means the connection can no longer serve the store, so that it is
/// replaced and the request sent once more (every request of the protocol is safe to send
/// twice): its socket died (a multiplexed connection whose socket died stays dead), or the
/// server it reaches is no longer a primary (`READONLY`: demoted in a failover that points
/// the address at the new primary, while the old one stays up as its replica; nothing else
/// would ever close the connection). A timeout is not a dead connection: the reply may
/// still come.
pub(crate) fn connection_is_dead(error: &redis::RedisError) -> bool {
    !error.is_timeout()
        && (error.is_unrecoverable_error()
            || error.is_io_error()
            || error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly))
}

/// What a Redis error means for the store: a key of another type (a record of this crate's
/// hash format, before 0.2, or a key another program wrote under the prefix) is a record
/// this version cannot read ([`RecordError::OtherType`]), never a free key.
pub(crate) fn store_error(error: redis::RedisError) -> StoreError {
    if error.code() == Some("WRONGTYPE") {
        return StoreError::Corrupt(RecordError::OtherType);
    }
    StoreError::Unavailable(Box::new(error))
}

/// Whether `error` is [`store_error`]'s for a key of another type: for a step fenced by a
/// token (commit, renew, release, abandon), the token's record is not there, as when
/// another record holds the key. Not a failure to retry: the key keeps that type until
/// someone deletes it.
pub(crate) fn is_not_a_record(error: &StoreError) -> bool {
    matches!(error, StoreError::Corrupt(RecordError::OtherType))
}

fn unexpected(value: &Value) -> StoreError {
    StoreError::Protocol(format!("unexpected reply: {value:?}"))
}

#[cfg(test)]
mod tests {
    use actix_web::http::StatusCode;

    use super::*;
    use crate::store::redis::exchange::Exchange;

    /// The in-flight record of `holder` as the library's `claim` writes it over the marker
    /// of `abandoned`: the record, the marker's expiry, the marker.
    fn taken_over_marker(
        print: &Fingerprint,
        holder: &LeaseToken,
        abandoned: &LeaseToken,
    ) -> Vec<u8> {
        let mut record = record::in_flight(print, holder);
        record.extend_from_slice(&1_796_552_482_663_u64.to_be_bytes());
        record.extend_from_slice(&record::abandoned(abandoned));
        record
    }

    fn outcome(reply: Value, print: u8, token: &LeaseToken) -> BeginOutcome {
        match begin_outcome(reply, &Fingerprint::from_bytes([print; 32]), token).unwrap() {
            Begun::Decided(outcome, _) => outcome,
            Begun::OtherMarker(marker) => panic!("another token's marker: {marker:?}"),
        }
    }

    /// A library already loaded under its name is kept (`FUNCTION LOAD` without `REPLACE`),
    /// so code changed under one name would leave servers running whichever code they loaded
    /// first: r6 was changed so once (`rewrite` flagged `allow-oom` after some builds had
    /// loaded it without). Changing the library means a new revision in its name, and this
    /// digest with it.
    #[test]
    fn the_library_s_code_is_pinned_to_its_name() {
        assert!(LIBRARY.starts_with("#!lua name=idempotency_actix_2_r9\n"));
        assert_eq!(
            blake3::hash(LIBRARY.as_bytes()).to_hex().as_str(),
            "19f6159403ebc04e5a0549f590a86fdbddc8083c78e3b6201bbca087cf4c4843",
            "the function library changed: give it a new revision (`_rN`) in its name and \
             its functions' names, then update this digest"
        );
    }

    #[test]
    fn begin_decodes_every_record_it_can_find() {
        let (mine, theirs) = (LeaseToken::generate(), LeaseToken::generate());
        let in_flight = record::in_flight(&Fingerprint::from_bytes([1; 32]), &theirs);
        let bulk = |bytes: &[u8]| Value::BulkString(bytes.to_vec());

        assert_eq!(outcome(Value::Nil, 1, &mine), BeginOutcome::Acquired);
        assert_eq!(
            outcome(bulk(&in_flight), 1, &theirs),
            BeginOutcome::Acquired
        );
        assert_eq!(outcome(bulk(&in_flight), 1, &mine), BeginOutcome::InFlight);
        let over_marker = taken_over_marker(&Fingerprint::from_bytes([1; 32]), &theirs, &mine);
        assert_eq!(
            outcome(bulk(&over_marker), 1, &theirs),
            BeginOutcome::Acquired
        );
        assert_eq!(
            outcome(bulk(&over_marker), 1, &mine),
            BeginOutcome::InFlight,
            "the marker it carries is not the key's"
        );
        assert_eq!(
            outcome(bulk(&in_flight), 2, &mine),
            BeginOutcome::FingerprintMismatch
        );

        let response = StoredResponse {
            status: StatusCode::OK,
            headers: Vec::new(),
            body: None,
        };
        let completed = record::completed(&in_flight, &response, Duration::from_secs(9));
        let Ok(Begun::Decided(found, remaining)) =
            begin_outcome(bulk(&completed), &Fingerprint::from_bytes([1; 32]), &mine)
        else {
            panic!("not decided");
        };
        assert_eq!(found, BeginOutcome::Completed(response));
        assert!(remaining.is_some_and(|left| left <= Duration::from_secs(9)));
        assert_eq!(
            outcome(bulk(&completed), 2, &mine),
            BeginOutcome::FingerprintMismatch
        );
    }

    #[test]
    fn a_marker_is_abandoned_for_its_token_and_claimable_for_any_other() {
        let (mine, theirs) = (LeaseToken::generate(), LeaseToken::generate());
        let marker = record::abandoned(&theirs);
        let bulk = Value::BulkString(marker.clone());
        assert_eq!(outcome(bulk.clone(), 1, &theirs), BeginOutcome::Abandoned);
        assert_eq!(
            begin_outcome(bulk, &Fingerprint::from_bytes([1; 32]), &mine).unwrap(),
            Begun::OtherMarker(marker)
        );
    }

    #[test]
    fn unreadable_replies_are_errors() {
        let token = LeaseToken::generate();
        let print = Fingerprint::from_bytes([0; 32]);
        assert!(begin_outcome(Value::Int(1), &print, &token).is_err());
        assert!(begin_outcome(Value::BulkString(vec![2, b'c']), &print, &token).is_err());
        assert!(held(Value::Nil).is_err());
        assert!(written(Value::Int(1)).is_err());
        assert!(unwritten(Value::Int(1), &print, &token).is_err());
        assert!(recreated(Value::Int(0), &print, &token).is_err());
    }

    #[test]
    fn a_commit_that_wrote_nothing_may_write_anew_only_where_the_key_is_free() {
        let (mine, theirs) = (LeaseToken::generate(), LeaseToken::generate());
        let print = Fingerprint::from_bytes([4; 32]);
        let response = StoredResponse {
            status: actix_web::http::StatusCode::CREATED,
            headers: Vec::new(),
            body: Some(Bytes::from_static(b"{}")),
        };
        let ttl = Duration::from_secs(60);
        let completed =
            |token| record::completed(&record::in_flight(&print, token), &response, ttl);
        let found = |record: Vec<u8>| unwritten(Value::BulkString(record), &print, &mine).unwrap();

        assert_eq!(
            unwritten(Value::Nil, &print, &mine).unwrap(),
            Unwritten::Free(None)
        );
        let marker = record::abandoned(&theirs);
        assert_eq!(found(marker.clone()), Unwritten::Free(Some(marker)));
        // Made once: a record holds its expiry in milliseconds, so two made a millisecond
        // apart differ.
        let completed_by_me = completed(&mine);
        assert_eq!(
            found(completed_by_me.clone()),
            Unwritten::CompletedEarlier(completed_by_me.clone())
        );
        assert_eq!(found(completed(&theirs)), Unwritten::Taken);
        assert_eq!(found(record::in_flight(&print, &theirs)), Unwritten::Taken);
        assert_eq!(
            found(record::in_flight(&print, &mine)),
            Unwritten::StillHeld,
            "our own lock, read from the node that serves the key now"
        );
        assert_eq!(
            found(record::in_flight(&Fingerprint::from_bytes([5; 32]), &mine)),
            Unwritten::Taken,
            "our token with another fingerprint: not the record our begin wrote"
        );
        assert_eq!(
            found(record::abandoned(&mine)),
            Unwritten::Taken,
            "our own marker"
        );
        assert_eq!(
            found(taken_over_marker(&print, &mine, &theirs)),
            Unwritten::HeldOverMarker,
            "our own lock, written over a marker, which it carries"
        );
        assert_eq!(
            found(taken_over_marker(&print, &theirs, &mine)),
            Unwritten::Taken
        );
        assert_eq!(found(vec![2, b'?']), Unwritten::Taken, "unreadable");

        assert_eq!(recreated(Value::Nil, &print, &mine).unwrap(), None);
        assert_eq!(
            recreated(Value::BulkString(completed_by_me.clone()), &print, &mine).unwrap(),
            Some(Unwritten::CompletedEarlier(completed_by_me)),
            "sent again after its connection died"
        );
        assert_eq!(
            recreated(Value::BulkString(completed(&theirs)), &print, &mine).unwrap(),
            Some(Unwritten::Taken)
        );
    }

    /// Whatever bytes Redis hands back under a key (another version's record, a value some
    /// other client wrote, a record cut short or corrupted), reading them as `begin`,
    /// `claim` or a commit that wrote nothing does is an answer or an error, never a panic.
    /// The records mutated here are valid ones of every state, so the reads get past the
    /// header into the completion and the marker's token fields.
    #[test]
    fn any_bytes_under_a_key_are_read_without_a_panic() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, RngSeed, TestRunner};

        let (mine, theirs) = (LeaseToken::generate(), LeaseToken::generate());
        let print = Fingerprint::from_bytes([7; 32]);
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![(
                actix_web::http::header::LOCATION,
                actix_web::http::header::HeaderValue::from_static("/orders/1"),
            )],
            body: Some(Bytes::from_static(b"{\"id\":1}")),
        };
        let in_flight = record::in_flight(&print, &theirs);
        let valid = vec![
            in_flight.clone(),
            record::completed(&in_flight, &response, Duration::from_secs(60)),
            record::completed(&record::in_flight(&print, &mine), &response, Duration::ZERO),
            record::abandoned(&theirs),
            taken_over_marker(&print, &theirs, &mine),
        ];
        let mutated = (
            proptest::sample::select(valid),
            proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
            any::<prop::sample::Index>(),
        )
            .prop_map(|(mut record, changes, cut)| {
                for (at, byte) in changes {
                    let at = at.index(record.len());
                    record[at] = byte;
                }
                record.truncate(cut.index(record.len() + 1));
                record
            });
        let bytes = prop_oneof![proptest::collection::vec(any::<u8>(), 0..400), mutated];
        let config = Config {
            cases: 8192,
            rng_seed: RngSeed::Fixed(0x1de5_0000_2026),
            failure_persistence: None,
            ..Config::default()
        };
        TestRunner::new(config)
            .run(&bytes, |found| {
                let bulk = || Value::BulkString(found.clone());
                let _ = begin_outcome(bulk(), &print, &mine);
                let _ = unwritten(bulk(), &print, &mine);
                let _ = recreated(bulk(), &print, &mine);
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_function_commit_tells_a_record_completed_earlier_from_one_it_wrote() {
        let by = CommitBy::Function;
        assert_eq!(committed(by, Value::Int(1)).unwrap(), Committed::Written);
        assert_eq!(
            committed(by, Value::Int(2)).unwrap(),
            Committed::CompletedEarlier
        );
        assert_eq!(committed(by, Value::Int(0)).unwrap(), Committed::Unwritten);
        assert!(committed(by, Value::Okay).is_err());
        let by = CommitBy::ConditionalSet;
        assert_eq!(committed(by, Value::Okay).unwrap(), Committed::Written);
        assert_eq!(committed(by, Value::Nil).unwrap(), Committed::Unwritten);
        assert!(rewritten(CommitBy::Function, Value::Int(1)).unwrap());
        assert!(!rewritten(CommitBy::Function, Value::Int(0)).unwrap());
        assert!(rewritten(CommitBy::ConditionalSet, Value::Okay).unwrap());
    }

    #[test]
    fn a_conditional_set_answers_ok_when_it_wrote_and_nil_when_not() {
        assert!(written(Value::Okay).unwrap());
        assert!(written(Value::SimpleString("OK".to_owned())).unwrap());
        assert!(!written(Value::Nil).unwrap());
    }

    /// A connection that counts what is sent on it and answers `OK`, trusted with
    /// `SET … IFEQ` or not.
    struct Counting {
        trusted: bool,
        sent: usize,
    }

    impl redis::aio::ConnectionLike for Counting {
        fn req_packed_command<'a>(
            &'a mut self,
            _cmd: &'a redis::Cmd,
        ) -> redis::RedisFuture<'a, Value> {
            self.sent += 1;
            Box::pin(async { Ok(Value::Okay) })
        }

        fn req_packed_commands<'a>(
            &'a mut self,
            _pipeline: &'a redis::Pipeline,
            _offset: usize,
            _count: usize,
        ) -> redis::RedisFuture<'a, Vec<Value>> {
            self.sent += 1;
            Box::pin(async { Ok(vec![Value::Okay]) })
        }

        fn get_db(&self) -> i64 {
            0
        }
    }

    impl Carrier for Counting {
        fn trusts_conditional_set(&self) -> bool {
            self.trusted
        }
    }

    /// A commit by `SET … IFEQ` goes out only on a connection to a server trusted with it;
    /// on any other nothing is sent, and the refusal says so (the step then sends its
    /// function). The function form goes out on either.
    #[actix_rt::test]
    async fn set_ifeq_is_sent_only_where_the_server_is_trusted_with_it() {
        let key = StorageKey::new("idem:", b"", &crate::IdempotencyKey::parse(b"k").unwrap());
        let (print, token) = (Fingerprint::from_bytes([1; 32]), LeaseToken::generate());
        let response = StoredResponse {
            status: StatusCode::CREATED,
            headers: Vec::new(),
            body: None,
        };
        let ttl = Duration::from_secs(60);
        let by_set = commit(
            CommitBy::ConditionalSet,
            &key,
            &print,
            &token,
            &response,
            ttl,
        );
        let by_function = commit(CommitBy::Function, &key, &print, &token, &response, ttl);

        let (by_set, by_function) = (Exchange::plain(by_set), Exchange::plain(by_function));
        let mut redis = Counting {
            trusted: false,
            sent: 0,
        };
        let refused = by_set.send(&mut redis).await.err().expect("refused");
        let refused = StoreError::Unavailable(Box::new(refused));
        assert!(was_not_trusted_with_conditional_set(&refused), "{refused}");
        assert!(!is_syntax_error(&refused));
        assert_eq!(redis.sent, 0, "nothing sent for the refused SET … IFEQ");
        by_function
            .send(&mut redis)
            .await
            .expect("the function goes out");
        assert_eq!(redis.sent, 1);

        let mut valkey = Counting {
            trusted: true,
            sent: 0,
        };
        by_set
            .send(&mut valkey)
            .await
            .expect("SET … IFEQ goes out to Valkey");
        assert_eq!(valkey.sent, 1);
    }
}
