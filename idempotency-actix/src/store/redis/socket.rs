//! [`Socket`]: the stream under the store's own connection, a TCP connection or a Unix
//! socket, and [`Endpoint`], where it connects.
//!
//! The driver of [`DirectConnection`](super::direct::DirectConnection) writes and reads
//! without blocking and waits for readiness itself, so it needs only those four operations
//! of a stream.

use std::io;
#[cfg(unix)]
use std::path::PathBuf;
use std::task::{Context, Poll};

use tokio::net::TcpStream;
#[cfg(unix)]
use tokio::net::UnixStream;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Endpoint {
    /// A host name or address, and a port.
    Tcp {
        /// The host, as the URL names it.
        host: String,
        /// The port.
        port: u16,
    },
    /// The path of a Unix socket (`unixsocket` in `redis.conf`).
    #[cfg(unix)]
    Unix(PathBuf),
}

impl std::fmt::Display for Endpoint {
    /// `host:port`, or the socket's path.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Tcp { host, port } => write!(f, "{host}:{port}"),
            #[cfg(unix)]
            Self::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// A connected stream to the server.
pub(super) enum Socket {
    /// Over TCP, with Nagle's algorithm off (a command waits for nothing).
    Tcp(TcpStream),
    /// Over a Unix socket.
    #[cfg(unix)]
    Unix(UnixStream),
}

impl Socket {
    /// Connects to `endpoint`.
    pub(super) async fn connect(endpoint: &Endpoint) -> io::Result<Self> {
        match endpoint {
            Endpoint::Tcp { host, port } => {
                let stream = TcpStream::connect((host.as_str(), *port)).await?;
                stream.set_nodelay(true)?;
                Ok(Self::Tcp(stream))
            }
            #[cfg(unix)]
            Endpoint::Unix(path) => Ok(Self::Unix(UnixStream::connect(path).await?)),
        }
    }

    /// Writes what it can of `bytes` without waiting (`WouldBlock` when it can write
    /// nothing).
    pub(super) fn try_write(&self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(stream) => stream.try_write(bytes),
            #[cfg(unix)]
            Self::Unix(stream) => stream.try_write(bytes),
        }
    }

    /// Reads what has arrived into the spare capacity of `buffer` without waiting
    /// (`WouldBlock` when nothing has).
    pub(super) fn try_read_buf(&self, buffer: &mut Vec<u8>) -> io::Result<usize> {
        match self {
            Self::Tcp(stream) => stream.try_read_buf(buffer),
            #[cfg(unix)]
            Self::Unix(stream) => stream.try_read_buf(buffer),
        }
    }

    /// Ready once the socket can take more bytes; registers `cx` until then.
    pub(super) fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Self::Tcp(stream) => stream.poll_write_ready(cx),
            #[cfg(unix)]
            Self::Unix(stream) => stream.poll_write_ready(cx),
        }
    }

    /// Ready once bytes have arrived; registers `cx` until then.
    pub(super) fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Self::Tcp(stream) => stream.poll_read_ready(cx),
            #[cfg(unix)]
            Self::Unix(stream) => stream.poll_read_ready(cx),
        }
    }
}
