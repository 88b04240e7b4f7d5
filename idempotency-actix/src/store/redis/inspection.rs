//! Inspection and deletion by hand on Redis (not on the request path), for any connection
//! that carries the protocol: one `EVAL` each, touching one key.
//!
//! | step | what Redis runs |
//! |---|---|
//! | inspect | `GET` and `PTTL` of the record, in one script (atomic) |
//! | delete | `GETRANGE` of the state byte, `DEL` unless in flight and not forced |
//!
//! Forced, a key of another type (`GETRANGE` answers `WRONGTYPE`) is deleted too.

use std::time::Duration;

use actix_web::web::Bytes;
use redis::Value;

use super::packed::PackedCommand;
use super::protocol::Request;
use super::record::{self, Found};
use crate::scope::StorageKey;
use crate::store::{Deletion, RecordSnapshot, StoreError};

const INSPECT: &str = "return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}";

/// The state is byte 2 of the record (Lua is 1-based): `i` in flight, `c` completed, `a`
/// an abandoned token's marker (no record: left alone). Answers 1 deleted, 0 not found, 2
/// in flight and not forced (nothing deleted). A key of another type (no version of this
/// crate wrote it, and every request for it is refused while it lives), for which
/// `GETRANGE` answers `WRONGTYPE`, is deleted when forced; unforced, that error is the
/// answer, and says what the key is. (`GETRANGE`'s own error, not a `TYPE` first: a
/// support user needs no right beyond those README lists.)
const DELETE: &str = r"
local state = redis.pcall('GETRANGE', KEYS[1], 1, 1)
if type(state) == 'table' and state.err then
  if ARGV[1] == '1' and string.sub(state.err, 1, 9) == 'WRONGTYPE' then
    return redis.call('DEL', KEYS[1])
  end
  return redis.error_reply(state.err)
end
if state == '' or state == 'a' then return 0 end
if state == 'i' and ARGV[1] ~= '1' then return 2 end
redis.call('DEL', KEYS[1])
return 1
";

fn eval(script: &str, key: &StorageKey) -> redis::Cmd {
    let mut command = redis::cmd("EVAL");
    command.arg(script).arg(1).arg(key.as_str());
    command
}

/// Reads the record under `key` and its remaining time to live.
pub(crate) fn inspect(key: &StorageKey) -> Request {
    Request::Command(PackedCommand::of(eval(INSPECT, key)))
}

/// Decodes the reply to [`inspect`]: the record as it is, its body only if `with_body`.
pub(crate) fn snapshot(
    reply: Value,
    with_body: bool,
) -> Result<Option<RecordSnapshot>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(unexpected(&reply));
    };
    let (record, ttl) = match <[Value; 2]>::try_from(items) {
        Ok([Value::Nil, _]) => return Ok(None),
        Ok([Value::BulkString(record), Value::Int(ttl)]) => (record, ttl),
        Ok(other) => return Err(unexpected(&Value::Array(other.into()))),
        Err(items) => return Err(unexpected(&Value::Array(items))),
    };
    let expires_in = u64::try_from(ttl).ok().map(Duration::from_millis);
    match Found::read(&record)? {
        Found::InFlight { .. } => Ok(Some(RecordSnapshot::in_flight(expires_in))),
        // The marker of an abandoned token is no record.
        Found::Abandoned { .. } => Ok(None),
        Found::Completed {
            format, tail_start, ..
        } => {
            let tail = Bytes::from(record).slice(tail_start..);
            let (response, _) = record::decode_completion(format, tail)?;
            Ok(Some(RecordSnapshot::completed(
                response, expires_in, with_body,
            )))
        }
    }
}

/// Deletes the record under `key`: completed always, in flight (or a key of another type)
/// only if `force`.
pub(crate) fn delete(key: &StorageKey, force: bool) -> Request {
    let mut command = eval(DELETE, key);
    command.arg(if force { "1" } else { "0" });
    Request::Command(PackedCommand::of(command))
}

/// Decodes the reply to [`delete`].
pub(crate) fn deletion(reply: Value) -> Result<Deletion, StoreError> {
    match reply {
        Value::Int(1) => Ok(Deletion::Deleted),
        Value::Int(0) => Ok(Deletion::NotFound),
        Value::Int(2) => Ok(Deletion::InFlight),
        other => Err(unexpected(&other)),
    }
}

fn unexpected(value: &Value) -> StoreError {
    StoreError::Protocol(format!("unexpected reply: {value:?}"))
}
