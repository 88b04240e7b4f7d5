//! [`CapturingBody`]: forwards a streamed response body chunk by chunk while keeping what is
//! to be stored, and commits the record before the response is complete.

use std::error::Error as StdError;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use actix_web::body::{BodySize, MessageBody};
use actix_web::dev::ResponseHead;
use actix_web::http::header;
use actix_web::web::{Bytes, BytesMut};
use futures_util::future::LocalBoxFuture;

use crate::workload::{ClientAttached, WorkSlot};

/// Completes the record with the captured body, or without one (`None`).
pub(crate) type Commit = Box<dyn FnOnce(Option<Bytes>) -> LocalBoxFuture<'static, ()>>;

type Chunk = Option<Result<Bytes, Box<dyn StdError>>>;

/// A streamed body on its way to the client, recorded as it passes.
///
/// Each chunk is forwarded as soon as the handler produces it. The record is committed
/// before the response is complete: before the end of the stream is signalled (for a body
/// of unknown size) or before the last chunk is delivered (for a body of known size), so a
/// client that has the whole response and retries always gets the replay. A body that grows
/// past `limit` is committed without a body at once and then only forwarded, so an endless
/// stream ends its record (and its lease renewals) there. A body that fails or panics, or
/// one of known size that ends before that size, is committed without a body, and the
/// client's response ends with the error. Of a body of known size that runs past its size,
/// what the client gets (that size) is stored. Empty chunks are left out, as Actix's own
/// streams leave them out: Actix would end a chunked response at one. A body whose `Drop`
/// panics is logged, the panic caught: once it has ended, its record is complete.
///
/// If the client goes away first, the rest of the body is read on a task of its own, up to
/// the limit, and committed the same way. A body that then produces nothing for `idle` (the
/// lease) is dropped and its record committed without a body: with no client to wait for
/// it, a stalled stream would otherwise keep its key locked (renewing its lease) and its
/// work slot taken for as long as the process runs.
pub(crate) struct CapturingBody<B: MessageBody + 'static> {
    body: Option<Pin<Box<B>>>,
    /// `Some` until the record is being completed.
    recording: Option<Recording>,
    /// The commit under way, and the chunk (or end, or error) that waits for it.
    committing: Option<(LocalBoxFuture<'static, ()>, Chunk)>,
    client: Option<ClientAttached>,
    /// How long the rest of the body may produce nothing once its client is gone.
    idle: Duration,
    /// Whether this is the rest of a body whose client went away, read on a task of its own.
    detached: bool,
}

struct Recording {
    captured: BytesMut,
    limit: usize,
    /// For a body of known size: how many bytes are still to come.
    remaining: Option<u64>,
    commit: Commit,
}

impl<B> CapturingBody<B>
where
    B: MessageBody + 'static,
{
    /// Records `body`, which the client is told is `size` long (see [`framed_size`]).
    pub(crate) fn new(
        body: B,
        size: BodySize,
        limit: usize,
        idle: Duration,
        commit: Commit,
        slot: Option<Rc<WorkSlot>>,
    ) -> Self {
        let remaining = match size {
            BodySize::Sized(size) => Some(size),
            BodySize::None => Some(0),
            BodySize::Stream => None,
        };
        Self {
            body: Some(Box::pin(body)),
            recording: Some(Recording {
                captured: BytesMut::new(),
                limit,
                remaining,
                commit,
            }),
            committing: None,
            client: Some(ClientAttached::new(slot)),
            idle,
            detached: false,
        }
    }

    /// Starts completing the record; `chunk` is delivered once that is done.
    fn commit(&mut self, body: Option<Bytes>, chunk: Chunk) {
        if let Some(recording) = self.recording.take() {
            self.committing = Some(((recording.commit)(body), chunk));
        }
    }

    /// What the client gets next; `None` once the response is complete.
    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Chunk> {
        loop {
            if let Some((commit, _)) = &mut self.committing {
                ready!(commit.as_mut().poll(cx));
                let (_, chunk) = self.committing.take().unwrap_or_else(|| unreachable!());
                // The record is complete: what is left of the body is only forwarded, and
                // holds no share of the worker's keyed work (nor a drain) any longer.
                if let Some(client) = self.client.take() {
                    client.finish();
                }
                return Poll::Ready(chunk);
            }
            let Some(body) = &mut self.body else {
                // Gone before the record had its end (a drop that unwound, which
                // `drop_body` catches): the record completes without a body rather than
                // wait, renewed, for an end that never comes.
                if self.recording.is_some() {
                    self.commit(None, None);
                    continue;
                }
                return Poll::Ready(None);
            };
            let polled = std::panic::catch_unwind(AssertUnwindSafe(|| body.as_mut().poll_next(cx)));
            let chunk: Chunk = match polled {
                Ok(Poll::Pending) => return Poll::Pending,
                // Actix ends a chunked response at an empty chunk (its own streams leave
                // them out): passed on, the client would have the body so far as complete
                // while the record waits for the rest.
                Ok(Poll::Ready(Some(Ok(bytes)))) if bytes.is_empty() => continue,
                Ok(Poll::Ready(chunk)) => chunk.map(|result| result.map_err(Into::into)),
                Err(_panic) => {
                    tracing::error!(
                        "idempotency: the response body panicked; its record completes without a body"
                    );
                    Some(Err("the response body panicked".into()))
                }
            };
            if !matches!(chunk, Some(Ok(_))) {
                self.drop_body();
            }
            let Some(recording) = &mut self.recording else {
                return Poll::Ready(chunk);
            };
            match chunk {
                Some(Ok(bytes)) => {
                    // Of a body of known size the client gets no more than that size (Actix
                    // writes no more; sent without chunking, the client reads no more), so no
                    // more is stored.
                    let kept = match recording.remaining {
                        Some(remaining) => bytes
                            .len()
                            .min(usize::try_from(remaining).unwrap_or(usize::MAX)),
                        None => bytes.len(),
                    };
                    if recording.captured.len() + kept > recording.limit {
                        self.commit(None, Some(Ok(bytes)));
                        continue;
                    }
                    recording.captured.extend_from_slice(&bytes[..kept]);
                    if let Some(remaining) = &mut recording.remaining {
                        *remaining -= kept as u64;
                        if *remaining == 0 {
                            let captured = std::mem::take(&mut recording.captured).freeze();
                            self.commit(Some(captured), Some(Ok(bytes)));
                            continue;
                        }
                    }
                    return Poll::Ready(Some(Ok(bytes)));
                }
                // A body of known size that ends before that size is a response cut short
                // (Actix closes the connection): stored without a body, as after an error,
                // never as a complete shorter one.
                None if recording.remaining.is_some_and(|remaining| remaining > 0) => {
                    tracing::error!(
                        "idempotency: the response body ended before its declared size; its record completes without a body"
                    );
                    self.commit(None, None);
                }
                None => {
                    let captured = std::mem::take(&mut recording.captured).freeze();
                    self.commit(Some(captured), None);
                }
                Some(Err(error)) => self.commit(None, Some(Err(error))),
            }
        }
    }

    /// Drops the handler's body once it is done (or given up on). A `Drop` that panics is
    /// caught and logged, as a panic in its `poll_next` is: unwinding from here would leave
    /// the record without the end it waits for, its lease renewed by task after task, each
    /// spawned by the drop of the last, for as long as the process runs (its key 409, its
    /// worker busy), and abort the process at its stop.
    fn drop_body(&mut self) {
        let Some(body) = self.body.take() else {
            return;
        };
        if std::panic::catch_unwind(AssertUnwindSafe(move || drop(body))).is_err() {
            tracing::error!("idempotency: the response body panicked as it was dropped");
        }
    }

    /// Whether the record still waits for this body.
    fn is_recording(&self) -> bool {
        self.recording.is_some() || self.committing.is_some()
    }
}

/// The size the client is told a response's body has: the body's own, or, for a body of
/// unknown size on a response sent without chunking
/// ([`no_chunking`](actix_web::HttpResponseBuilder::no_chunking)), the response's
/// `Content-Length`, which Actix then writes as the handler set it, followed by the body as
/// it comes: the client reads that many bytes, as from a body of that known size.
pub(crate) fn framed_size(head: &ResponseHead, size: BodySize) -> BodySize {
    if size != BodySize::Stream || head.chunked() {
        return size;
    }
    head.headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok())
        .map_or(size, BodySize::Sized)
}

impl<B> MessageBody for CapturingBody<B>
where
    B: MessageBody + 'static,
{
    type Error = Box<dyn StdError>;

    fn size(&self) -> BodySize {
        match &self.body {
            Some(body) => body.size(),
            None => BodySize::Stream,
        }
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let this = self.get_mut();
        let chunk = ready!(this.poll_chunk(cx));
        if !matches!(chunk, Some(Ok(_))) {
            // The client has the whole response (or its error).
            if let Some(client) = this.client.take() {
                client.finish();
            }
        }
        Poll::Ready(chunk)
    }
}

impl<B: MessageBody + 'static> Drop for CapturingBody<B> {
    fn drop(&mut self) {
        // The rest's task dropped before its end: its runtime is stopping (a server stopped,
        // or at the end of its shutdown timeout), which drops every task, and one spawned now
        // at once, so spawning the rest once more dropped it again, and again, until the
        // stack overflowed and the process aborted. The lease ends by itself.
        if self.detached || self.recording.is_none() && self.committing.is_none() {
            return;
        }
        // The client went away before the end: read the rest (up to the limit) and commit
        // on a task of its own, as the handler's run would have.
        let mut rest = Self {
            body: self.body.take(),
            recording: self.recording.take(),
            committing: self.committing.take(),
            client: None,
            idle: self.idle,
            detached: true,
        };
        let idle = self.idle;
        actix_rt::spawn(async move {
            while rest.is_recording() {
                let waits_for_body = rest.recording.is_some();
                let next = std::future::poll_fn(|cx| rest.poll_chunk(cx));
                let chunk = if waits_for_body {
                    match actix_rt::time::timeout(idle, next).await {
                        Ok(chunk) => chunk,
                        Err(_stalled) => {
                            tracing::warn!(
                                "idempotency: a response body produced nothing for a lease after its client left; its record completes without a body"
                            );
                            rest.drop_body();
                            rest.commit(None, None);
                            continue;
                        }
                    }
                } else {
                    next.await
                };
                if chunk.is_none() {
                    break;
                }
            }
        });
    }
}
