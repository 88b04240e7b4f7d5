//! [`read_reply`]: one RESP2 reply read from the front of a buffer, as a [`redis::Value`].
//!
//! The store's own connection (`direct`) reads its replies with this: the replies of the
//! protocol are a status, an integer, a bulk string, nil, or a short array, which a loop over
//! the buffer reads in a few hundred instructions, where redis-rs's general parser (combine
//! parsers, able to resume in the middle of a value) takes about 1 400 per reply. Server
//! errors are rare and carry the kinds the store tells apart (`OOM`, `WRONGTYPE`, a missing
//! function, `IFEQ` refused as a syntax error), so they are handed to redis-rs's own parser:
//! an error read here is exactly the error redis-rs would have made of it.

use redis::{ErrorKind, RedisError, Value};

/// How deeply arrays may nest in a reply: the protocol's deepest is one level (an array of
/// a record and its TTL); a deeper one is a protocol error, never a deep recursion.
const MAX_DEPTH: usize = 8;

/// Reads the reply at the front of `buffer`: the value and how many bytes it took, or
/// `None` while the buffer holds only part of it.
///
/// # Errors
///
/// A [`ErrorKind::Parse`] error when the bytes are not a RESP2 reply; the connection that
/// read them is then out of step with its server and must be closed.
pub(super) fn read_reply(buffer: &[u8]) -> Result<Option<(Value, usize)>, RedisError> {
    read_value(buffer, 0, 0)
}

fn read_value(
    buffer: &[u8],
    at: usize,
    depth: usize,
) -> Result<Option<(Value, usize)>, RedisError> {
    let Some(&kind) = buffer.get(at) else {
        return Ok(None);
    };
    let Some(line_end) = line_end(buffer, at + 1)? else {
        return Ok(None);
    };
    let line = &buffer[at + 1..line_end];
    let next = line_end + 2;
    match kind {
        b'+' if line == b"OK" => Ok(Some((Value::Okay, next))),
        b'+' => Ok(Some((
            Value::SimpleString(String::from_utf8_lossy(line).into_owned()),
            next,
        ))),
        b'-' => redis::parse_redis_value(&buffer[at..next]).map(|error| Some((error, next))),
        b':' => Ok(Some((Value::Int(number(line)?), next))),
        b'$' => {
            let length = number(line)?;
            if length == -1 {
                return Ok(Some((Value::Nil, next)));
            }
            let length = usize::try_from(length).map_err(|_| malformed("a bulk length"))?;
            let end = next
                .checked_add(length)
                .ok_or_else(|| malformed("a bulk length"))?;
            match buffer.get(end..end + 2) {
                None => Ok(None),
                Some(b"\r\n") => Ok(Some((
                    Value::BulkString(buffer[next..end].to_vec()),
                    end + 2,
                ))),
                Some(_) => Err(malformed("a bulk string's end")),
            }
        }
        b'*' => {
            let count = number(line)?;
            if count == -1 {
                return Ok(Some((Value::Nil, next)));
            }
            if depth == MAX_DEPTH {
                return Err(malformed("an array nested this deep"));
            }
            let count = usize::try_from(count).map_err(|_| malformed("an array length"))?;
            // The count comes from the server: the vector grows with the items that arrive.
            let mut items = Vec::with_capacity(count.min(16));
            let mut at = next;
            for _ in 0..count {
                let Some((item, after)) = read_value(buffer, at, depth + 1)? else {
                    return Ok(None);
                };
                items.push(item);
                at = after;
            }
            Ok(Some((Value::Array(items), at)))
        }
        _ => Err(malformed("a reply type")),
    }
}

/// Where the line starting at `from` ends (its `\r`), once its `\r\n` has arrived.
fn line_end(buffer: &[u8], from: usize) -> Result<Option<usize>, RedisError> {
    let Some(at) = buffer
        .get(from..)
        .and_then(|rest| rest.iter().position(|&byte| byte == b'\r'))
    else {
        return Ok(None);
    };
    let at = from + at;
    match buffer.get(at + 1) {
        Some(b'\n') => Ok(Some(at)),
        // No status, number or error holds a `\r`.
        Some(_) => Err(malformed("a line's end")),
        None => Ok(None),
    }
}

fn number(line: &[u8]) -> Result<i64, RedisError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|digits| digits.parse().ok())
        .ok_or_else(|| malformed("a number"))
}

fn malformed(what: &'static str) -> RedisError {
    RedisError::from((
        ErrorKind::Parse,
        "the Redis server sent a malformed reply",
        format!("could not read {what}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(bytes: &[u8]) -> Value {
        let (value, used) = read_reply(bytes).expect("a reply").expect("a whole reply");
        assert_eq!(used, bytes.len(), "the whole of {bytes:?} is one reply");
        value
    }

    #[test]
    fn the_replies_of_the_protocol_read_as_redis_rs_reads_them() {
        let replies: [&[u8]; 9] = [
            b"+OK\r\n",
            b"+PONG\r\n",
            b":42\r\n",
            b":-1\r\n",
            b"$-1\r\n",
            b"$0\r\n\r\n",
            b"$5\r\nab\r\nc\r\n",
            b"*2\r\n$3\r\nabc\r\n:7\r\n",
            b"*-1\r\n",
        ];
        for reply in replies {
            assert_eq!(
                whole(reply),
                redis::parse_redis_value(reply).unwrap(),
                "{reply:?}"
            );
        }
    }

    #[test]
    fn server_errors_keep_the_code_and_detail_the_store_tells_apart() {
        for reply in [
            &b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"[..],
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
            b"-ERR syntax error\r\n",
            b"-ERR Function not found\r\n",
        ] {
            let read = whole(reply).extract_error().unwrap_err();
            let expected = redis::parse_redis_value(reply)
                .unwrap()
                .extract_error()
                .unwrap_err();
            assert_eq!(read.code(), expected.code());
            assert_eq!(read.detail(), expected.detail());
        }
    }

    #[test]
    fn a_reply_cut_anywhere_waits_for_the_rest() {
        let reply = b"*3\r\n$5\r\nhello\r\n:12\r\n$-1\r\n";
        for cut in 0..reply.len() {
            assert_eq!(read_reply(&reply[..cut]).unwrap(), None, "cut at {cut}");
        }
        let mut two = reply.to_vec();
        two.extend_from_slice(b"+OK\r\n");
        let (_, used) = read_reply(&two).unwrap().unwrap();
        assert_eq!(used, reply.len());
        assert_eq!(read_reply(&two[used..]).unwrap(), Some((Value::Okay, 5)));
    }

    #[test]
    fn bytes_that_are_no_reply_are_a_parse_error() {
        for garbage in [
            &b"?what\r\n"[..],
            b":twelve\r\n",
            b"$-2\r\n",
            b"$3\r\nabcd\r\n",
            b"*-5\r\n",
            b"+O\rK\r\n",
            b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
        ] {
            let error = read_reply(garbage).unwrap_err();
            assert_eq!(error.kind(), ErrorKind::Parse, "{garbage:?}");
        }
    }
}
