//! [`Request`]: one step of the protocol as it goes over the wire, on any connection (a
//! server's multiplexed connection or a cluster connection), with `WAIT` pipelined behind
//! it when the write must reach replicas.
//!
//! Scripts are sent as `EVALSHA`; a server that does not know the script (`NOSCRIPT`: it
//! restarted, or it is a replica promoted by a failover that never saw the script) gets
//! the same call as `EVAL` with the source, which also caches the script there. Both name
//! the record's key, so a cluster connection routes them to the key's primary; a
//! `SCRIPT LOAD` would go to every node and fail while one of them is down.

use std::time::Duration;

use redis::{Cmd, ServerErrorKind, Value};

use super::replication::{NotReplicated, ReplicatedWrites};
use crate::store::StoreError;

/// A Lua script of the protocol: its source and SHA1 digest.
pub(crate) struct LuaScript {
    source: &'static str,
    hash: String,
}

impl LuaScript {
    pub(crate) fn new(source: &'static str) -> Self {
        Self {
            source,
            hash: redis::Script::new(source).get_hash().to_owned(),
        }
    }
}

/// One step, ready to be sent on any connection.
pub(crate) struct Request {
    command: Cmd,
    /// The script a `EVALSHA` command calls, to send its source on `NOSCRIPT`.
    script: Option<&'static LuaScript>,
    wait: Option<ReplicatedWrites>,
}

/// What a request answered.
pub(crate) struct Reply {
    /// The step's own reply.
    pub(crate) value: Value,
    /// How many replicas acknowledged the write, when the request waited for them.
    pub(crate) replication: Acknowledgement,
}

/// How many replicas acknowledged a request's write, and how many were asked for (`None`:
/// the request did not wait).
#[derive(Clone, Copy)]
pub(crate) struct Acknowledgement(Option<(u32, ReplicatedWrites)>);

impl Request {
    /// A plain command.
    pub(crate) fn command(command: Cmd) -> Self {
        Self {
            command,
            script: None,
            wait: None,
        }
    }

    /// `script` on one key with these arguments.
    pub(crate) fn script<'a>(
        script: &'static LuaScript,
        key: &str,
        args: impl IntoIterator<Item = &'a [u8]>,
    ) -> Self {
        let mut command = redis::cmd("EVALSHA");
        command.arg(&script.hash).arg(1).arg(key);
        for arg in args {
            command.arg(arg);
        }
        Self {
            command,
            script: Some(script),
            wait: None,
        }
    }

    /// The same request followed by `WAIT` for `wait`'s replicas, when set.
    pub(crate) fn replicated(mut self, wait: Option<ReplicatedWrites>) -> Self {
        self.wait = wait;
        self
    }

    /// Sends the request on `connection` (one round trip, plus one more the first time a
    /// server meets a script).
    pub(crate) async fn send(
        &self,
        connection: &mut impl redis::aio::ConnectionLike,
    ) -> redis::RedisResult<Reply> {
        match self.exchange(connection, &self.command).await {
            Err(error) if error.kind() == ServerErrorKind::NoScript.into() => {
                let Some(script) = self.script else {
                    return Err(error);
                };
                self.exchange(connection, &eval_of(&self.command, script))
                    .await
            }
            reply => reply,
        }
    }

    async fn exchange(
        &self,
        connection: &mut impl redis::aio::ConnectionLike,
        command: &Cmd,
    ) -> redis::RedisResult<Reply> {
        let Some(wait) = self.wait else {
            return Ok(Reply {
                value: command.query_async(connection).await?,
                replication: Acknowledgement(None),
            });
        };
        // `WAIT` has no key: a cluster connection sends the pipeline to the node of the
        // command's key, where `WAIT` waits for that primary's replicas.
        let mut pipeline = redis::pipe();
        pipeline
            .add_command(command.clone())
            .add_command(wait.command())
            .ignore_errors();
        let replies: Vec<Value> = pipeline.query_async(connection).await?;
        let [value, acknowledged] = <[Value; 2]>::try_from(replies).map_err(|replies| {
            redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "a pipeline of two commands answered",
                format!("{} replies", replies.len()),
            ))
        })?;
        let value = value.extract_error()?;
        let acknowledged = match acknowledged.extract_error()? {
            Value::Int(count) => u32::try_from(count).unwrap_or(0),
            other => {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "WAIT answered",
                    format!("{other:?}"),
                )));
            }
        };
        Ok(Reply {
            value,
            replication: Acknowledgement(Some((acknowledged, wait))),
        })
    }
}

impl Acknowledgement {
    /// `Ok` unless the request waited for replicas, fewer acknowledged than asked, and
    /// the setting is strict (otherwise a warning is logged).
    pub(crate) fn check(self, step: &'static str) -> Result<(), StoreError> {
        let Some((acknowledged, wait)) = self.0 else {
            return Ok(());
        };
        if acknowledged >= wait.replicas() {
            return Ok(());
        }
        let shortfall = NotReplicated {
            step,
            acknowledged,
            wait,
        };
        if wait.is_strict() {
            return Err(StoreError::Unavailable(Box::new(shortfall)));
        }
        tracing::warn!(%shortfall, "idempotency: write not replicated as asked; going on");
        Ok(())
    }
}

/// `EVAL` with the script's source in place of `EVALSHA` with its digest, same arguments.
fn eval_of(evalsha: &Cmd, script: &LuaScript) -> Cmd {
    let mut eval = redis::cmd("EVAL");
    eval.arg(script.source);
    for arg in evalsha.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = arg {
            eval.arg(bytes);
        }
    }
    eval
}

/// Milliseconds for a Redis timeout argument, at least 1 (0 means "forever" to `WAIT`).
pub(crate) fn timeout_millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eval_repeats_the_evalsha_arguments_after_the_source() {
        let script = LuaScript::new("return ARGV[1]");
        let request = Request::script(
            Box::leak(Box::new(script)),
            "key",
            [b"a".as_slice(), b"b".as_slice()],
        );
        let script = request.script.expect("a script request");
        let eval = eval_of(&request.command, script);
        let args: Vec<Vec<u8>> = eval
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes.to_vec(),
                _ => panic!("only plain arguments"),
            })
            .collect();
        assert_eq!(
            args,
            [
                b"EVAL".to_vec(),
                b"return ARGV[1]".to_vec(),
                b"1".to_vec(),
                b"key".to_vec(),
                b"a".to_vec(),
                b"b".to_vec()
            ]
        );
    }
}
