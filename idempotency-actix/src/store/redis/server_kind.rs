//! [`ServerKind`]: which server a connection reached, as `HELLO` names it, which decides
//! whether commits may go by `SET … IFEQ` (see `conditional_set`).
//!
//! Only Valkey (≥ 8.1) is trusted with `SET … IFEQ`. Redis 8.6.3 was seen to answer `OK` to
//! `SET key value IFEQ expected` while writing the value into *another* key and leaving
//! `key` as it was, after a spell at `maxmemory` (reproduced with plain commands, no client
//! of ours: `docs/redis-8-set-ifeq.md`). For this store that is one request's response
//! replayed for another key (another client's payment), and a lost record, so on Redis
//! the commit goes by function, whatever the version: the function's `GET` and `SET` did
//! not show it in the same runs. The cause, in the server's source: `SET … IFEQ` writes
//! through the hash-table slot it found before looking the key up again to compare, and
//! that second lookup can move another key into the slot while the table shrinks; the
//! function's `SET`s and the `begin` take no such second look (the document's "The cause").

use redis::Value;
use redis::aio::ConnectionLike;

/// The server behind a connection, as far as the store's commits care.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServerKind {
    /// Valkey: commits try `SET … IFEQ` (Valkey 8.1 and later take it).
    Valkey,
    /// Redis, another server, or one that did not say (`HELLO` renamed away, say: no ACL
    /// refuses it), or a Valkey that calls itself Redis (`extended-redis-compatibility`):
    /// commits go by function.
    Other,
}

impl ServerKind {
    /// Asks the server behind `connection` with `HELLO` (no protocol version, so the
    /// connection's protocol stays as it is); any answer but Valkey's, an error included,
    /// is [`ServerKind::Other`].
    pub(crate) async fn of(connection: &mut impl ConnectionLike) -> Self {
        let hello: redis::RedisResult<Value> = redis::cmd("HELLO").query_async(connection).await;
        match hello {
            Ok(reply) => Self::named_in(&reply),
            Err(error) => {
                tracing::debug!(
                    %error,
                    "idempotency: the Redis server did not say which it is (HELLO); commits go by function"
                );
                Self::Other
            }
        }
    }

    /// The kind the `server` field of a `HELLO` reply names: a flat array of names and
    /// values over RESP2, a map over RESP3.
    fn named_in(reply: &Value) -> Self {
        let server = match reply {
            Value::Array(fields) => fields
                .chunks_exact(2)
                .find(|pair| is_text(&pair[0], "server"))
                .map(|pair| &pair[1]),
            Value::Map(fields) => fields
                .iter()
                .find(|(name, _)| is_text(name, "server"))
                .map(|(_, value)| value),
            _ => None,
        };
        if server.is_some_and(|server| is_text(server, "valkey")) {
            Self::Valkey
        } else {
            Self::Other
        }
    }
}

/// Whether `value` is the string `text` (bulk or simple), ASCII case ignored.
fn is_text(value: &Value, text: &str) -> bool {
    match value {
        Value::BulkString(bytes) => bytes.eq_ignore_ascii_case(text.as_bytes()),
        Value::SimpleString(string) => string.eq_ignore_ascii_case(text),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(text: &str) -> Value {
        Value::BulkString(text.as_bytes().to_vec())
    }

    /// `HELLO` over RESP2, as `server` and `version` name the server.
    fn hello(server: &str, version: &str) -> Value {
        Value::Array(vec![
            bulk("server"),
            bulk(server),
            bulk("version"),
            bulk(version),
            bulk("proto"),
            Value::Int(2),
            bulk("modules"),
            Value::Array(Vec::new()),
        ])
    }

    #[test]
    fn only_valkey_is_valkey() {
        assert_eq!(
            ServerKind::named_in(&hello("valkey", "8.1.1")),
            ServerKind::Valkey
        );
        assert_eq!(
            ServerKind::named_in(&hello("redis", "8.6.3")),
            ServerKind::Other
        );
        assert_eq!(
            ServerKind::named_in(&hello("redis", "7.0.15")),
            ServerKind::Other
        );
        assert_eq!(ServerKind::named_in(&Value::Nil), ServerKind::Other);
    }

    #[test]
    fn a_resp3_map_names_the_server_too() {
        let reply = Value::Map(vec![
            (bulk("server"), bulk("valkey")),
            (bulk("version"), bulk("8.1.1")),
        ]);
        assert_eq!(ServerKind::named_in(&reply), ServerKind::Valkey);
    }

    /// A value that happens to be `server` is not taken for the field's name.
    #[test]
    fn only_a_field_named_server_counts() {
        let reply = Value::Array(vec![bulk("id"), bulk("server"), bulk("valkey"), bulk("x")]);
        assert_eq!(ServerKind::named_in(&reply), ServerKind::Other);
    }
}
