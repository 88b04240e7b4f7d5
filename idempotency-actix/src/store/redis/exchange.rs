//! [`Exchange`]: one request of the protocol as it goes over the wire, on any connection (a
//! server's multiplexed connection or a cluster connection): alone, or with `WAIT`
//! pipelined behind it when its write must reach replicas.

use redis::Value;

use super::packed::Carrier;
use super::protocol::{self, Request};
use super::replication::{NotReplicated, ReplicatedWrites};
use crate::log_interval::LogInterval;
use crate::store::StoreError;

/// The line of a write that fell short of its replicas (`or_warn`), logged at most once per
/// interval for the process.
static NOT_REPLICATED: std::sync::LazyLock<LogInterval> =
    std::sync::LazyLock::new(LogInterval::new);

/// A request, and the replicas its write must reach before it counts as done.
pub(crate) struct Exchange {
    request: Request,
    wait: Option<ReplicatedWrites>,
}

/// What an exchange answered.
pub(crate) struct Reply {
    /// The request's own reply.
    pub(crate) value: Value,
    /// How many replicas acknowledged the write, when the exchange waited for them.
    pub(crate) replication: Acknowledgement,
}

/// How many replicas acknowledged a write, and the setting that asked (`None`: the exchange
/// did not wait).
#[derive(Clone, Copy)]
pub(crate) struct Acknowledgement(Option<(u32, ReplicatedWrites)>);

impl Exchange {
    /// `request`, followed by `WAIT` when `wait` is set.
    pub(crate) fn new(request: Request, wait: Option<ReplicatedWrites>) -> Self {
        Self { request, wait }
    }

    /// `request` alone.
    pub(crate) fn plain(request: Request) -> Self {
        Self::new(request, None)
    }

    /// Whether it may be sent on `connection` (see [`Request::may_go_on`]).
    pub(crate) fn may_go_on(&self, connection: &impl Carrier) -> redis::RedisResult<()> {
        self.request.may_go_on(connection)
    }

    /// Whether it calls a function of the store's library.
    pub(crate) fn calls_function(&self) -> bool {
        matches!(self.request, Request::Function(_))
    }

    /// Whether it waits for replicas, blocking its connection meanwhile (see `spares`).
    pub(crate) fn blocks(&self) -> bool {
        self.wait.is_some()
    }

    /// Sends it on `connection`: one round trip (plus, the first time a server meets the
    /// store's functions, one to load them).
    pub(crate) async fn send(&self, connection: &mut impl Carrier) -> redis::RedisResult<Reply> {
        self.may_go_on(connection)?;
        let Some(wait) = self.wait else {
            return Ok(Reply {
                value: self.request.send(connection).await?,
                replication: Acknowledgement(None),
            });
        };
        match self.send_with_wait(connection, wait).await {
            Err(error) if protocol::is_function_not_found(&error) => {
                protocol::load_library(connection).await?;
                self.send_with_wait(connection, wait).await
            }
            reply => reply,
        }
    }

    /// The request and `WAIT` in one pipeline. `WAIT` is refused inside a script or
    /// function, hence a pipeline; and it has no key, so a cluster connection sends the
    /// pipeline to the node of the request's key, where `WAIT` counts that primary's
    /// replicas.
    async fn send_with_wait(
        &self,
        connection: &mut impl Carrier,
        wait: ReplicatedWrites,
    ) -> redis::RedisResult<Reply> {
        let mut pipeline = redis::pipe();
        pipeline
            .add_command(self.request.command().clone())
            .add_command(wait.command())
            .ignore_errors();
        let replies: Vec<Value> = pipeline.query_async(connection).await?;
        let [value, acknowledged] = <[Value; 2]>::try_from(replies).map_err(|replies| {
            unexpected(
                "a pipeline of two commands",
                format!("{} replies", replies.len()),
            )
        })?;
        let value = value.extract_error()?;
        let acknowledged = match acknowledged.extract_error()? {
            Value::Int(count) => u32::try_from(count).unwrap_or(0),
            other => return Err(unexpected("WAIT", format!("{other:?}"))),
        };
        Ok(Reply {
            value,
            replication: Acknowledgement(Some((acknowledged, wait))),
        })
    }
}

impl Acknowledgement {
    /// No acknowledgement asked for (a test transport's reply).
    #[cfg(test)]
    pub(crate) fn none() -> Self {
        Self(None)
    }

    /// `Ok` unless the exchange waited for replicas, fewer acknowledged than asked, and the
    /// setting is strict (otherwise a warning is logged).
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
        // Once per interval: while a replica is out, every write falls short.
        if let Some(unlogged) = NOT_REPLICATED.admit(std::time::Instant::now()) {
            tracing::warn!(%shortfall, unlogged, "idempotency: write not replicated as asked; going on");
        }
        Ok(())
    }
}

fn unexpected(what: &'static str, answered: String) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        what,
        format!("answered {answered}"),
    ))
}
