//! [`PackedCommand`]: a command of the protocol written once, as the bytes that go on the
//! wire, and [`Carrier`]: a connection that takes it.
//!
//! A `redis::Cmd` keeps its arguments in a buffer of its own and is packed into another
//! when it is sent: a `begin` or a `commit` (records of a few hundred bytes) cost about
//! 2 200 and 3 200 instructions to build and pack that way. Written straight as RESP, in a
//! buffer of its final size, a command costs a fraction of that, and the store's own
//! connection (`direct`) copies it into its write buffer as it is. Connections of redis-rs
//! (the cluster connection, a pool the app built, the spares of replicated writes) take a
//! `redis::Cmd`, made from the bytes the first time one asks.

use std::sync::OnceLock;

use redis::aio::ConnectionLike;
use redis::{RedisFuture, Value};

/// A command as RESP bytes (an array of bulk strings), and as a `redis::Cmd` once needed.
pub(crate) struct PackedCommand {
    bytes: Vec<u8>,
    command: OnceLock<redis::Cmd>,
}

/// Writes a [`PackedCommand`] of a known number of arguments.
pub(crate) struct Packer {
    bytes: Vec<u8>,
    /// Arguments still to write; checked in debug builds.
    left: usize,
}

/// Room for the framing of one argument: `$`, up to 20 digits, and two `\r\n`.
const FRAMING: usize = 1 + 20 + 4;

impl PackedCommand {
    /// A command of `name` and `args` more arguments, of about `bytes` bytes in all (the
    /// buffer is sized for them and grows only if they are longer).
    pub(crate) fn build(name: &str, args: usize, bytes: usize) -> Packer {
        let mut bytes = Vec::with_capacity(FRAMING * (2 + args) + name.len() + bytes);
        bytes.push(b'*');
        write_decimal(&mut bytes, 1 + args as u64);
        bytes.extend_from_slice(b"\r\n");
        let mut packer = Packer {
            bytes,
            left: 1 + args,
        };
        packer.push(name.as_bytes());
        packer
    }

    /// A command built with redis-rs (for commands off the request path).
    pub(crate) fn of(command: redis::Cmd) -> Self {
        Self {
            bytes: command.get_packed_command(),
            command: OnceLock::from(command),
        }
    }

    /// The bytes that go on the wire.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The command as redis-rs takes it, made from the bytes the first time.
    pub(crate) fn command(&self) -> &redis::Cmd {
        self.command.get_or_init(|| {
            let mut command = redis::Cmd::new();
            for arg in arguments(&self.bytes) {
                command.arg(arg);
            }
            command
        })
    }
}

impl Packer {
    /// Adds an argument.
    pub(crate) fn arg(mut self, arg: impl AsRef<[u8]>) -> Self {
        self.push(arg.as_ref());
        self
    }

    /// Adds a number argument, in decimal.
    pub(crate) fn number(mut self, number: u64) -> Self {
        let (digits, start) = decimal(number);
        self.push(&digits[start..]);
        self
    }

    /// The command, once every argument announced is written.
    pub(crate) fn done(self) -> PackedCommand {
        debug_assert_eq!(self.left, 0, "a command got fewer arguments than announced");
        PackedCommand {
            bytes: self.bytes,
            command: OnceLock::new(),
        }
    }

    fn push(&mut self, arg: &[u8]) {
        debug_assert!(self.left > 0, "a command got more arguments than announced");
        self.left = self.left.saturating_sub(1);
        self.bytes.push(b'$');
        write_decimal(&mut self.bytes, arg.len() as u64);
        self.bytes.extend_from_slice(b"\r\n");
        self.bytes.extend_from_slice(arg);
        self.bytes.extend_from_slice(b"\r\n");
    }
}

/// Writes `number` in decimal. Lengths and counts are short: up to three digits are written
/// byte by byte, without the digit buffer and the copy out of it (a hundred instructions
/// for each of a command's dozen numbers).
fn write_decimal(out: &mut Vec<u8>, number: u64) {
    let digit = |value: u64| b'0' + (value % 10) as u8;
    match number {
        0..10 => out.push(digit(number)),
        10..100 => out.extend_from_slice(&[digit(number / 10), digit(number)]),
        100..1000 => {
            out.extend_from_slice(&[digit(number / 100), digit(number / 10), digit(number)])
        }
        _ => {
            let (digits, start) = decimal(number);
            out.extend_from_slice(&digits[start..]);
        }
    }
}

/// The decimal digits of `number`: they start at the index returned.
fn decimal(mut number: u64) -> ([u8; 20], usize) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (number % 10) as u8;
        number /= 10;
        if number == 0 {
            return (digits, at);
        }
    }
}

/// The arguments of a command this module packed (well-formed by construction).
fn arguments(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let header_end = bytes
        .iter()
        .position(|&byte| byte == b'\n')
        .map_or(bytes.len(), |at| at + 1);
    let mut rest = &bytes[header_end..];
    std::iter::from_fn(move || {
        // `$<length>\r\n<bytes>\r\n`
        let line_end = rest.iter().position(|&byte| byte == b'\r')?;
        let length: usize = std::str::from_utf8(rest.get(1..line_end)?)
            .ok()?
            .parse()
            .ok()?;
        let start = line_end + 2;
        let arg = rest.get(start..start + length)?;
        rest = rest.get(start + length + 2..)?;
        Some(arg)
    })
}

/// A connection a [`PackedCommand`] is sent on: as its bytes where the connection takes
/// them, as a `redis::Cmd` elsewhere.
pub(crate) trait Carrier: ConnectionLike {
    /// Sends `command` and returns its reply (a server error as [`Value::ServerError`]).
    fn send_packed<'a>(&'a mut self, command: &'a PackedCommand) -> RedisFuture<'a, Value> {
        self.req_packed_command(command.command())
    }

    /// Whether the connection reached a server trusted with `SET … IFEQ` (Valkey; see
    /// `server_kind`): a request by it is sent on no other (see
    /// [`Exchange::send`](super::exchange::Exchange::send)). None unless it says so.
    fn trusts_conditional_set(&self) -> bool {
        false
    }
}

impl Carrier for redis::aio::MultiplexedConnection {}

#[cfg(feature = "redis-cluster")]
impl Carrier for redis::cluster_async::ClusterConnection {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_command_is_what_redis_rs_packs() {
        let packed = PackedCommand::build("SET", 6, 0)
            .arg("key")
            .arg(b"v\r\nal\0ue")
            .arg("NX")
            .arg("PX")
            .number(86_400_000)
            .arg("")
            .done();
        let mut expected = redis::cmd("SET");
        expected
            .arg("key")
            .arg(b"v\r\nal\0ue")
            .arg("NX")
            .arg("PX")
            .arg(86_400_000_u64)
            .arg("");
        assert_eq!(packed.bytes(), expected.get_packed_command().as_slice());
        assert_eq!(
            packed.command().get_packed_command(),
            expected.get_packed_command(),
            "the redis-rs command made from the bytes is the same command"
        );
    }

    #[test]
    fn numbers_are_written_in_decimal() {
        for number in [
            0,
            7,
            9,
            10,
            42,
            99,
            100,
            512,
            999,
            1_000,
            86_400_000,
            u64::MAX,
        ] {
            let mut out = Vec::new();
            write_decimal(&mut out, number);
            assert_eq!(out, number.to_string().into_bytes());
        }
    }

    #[test]
    fn a_command_built_by_redis_rs_keeps_its_bytes() {
        let mut command = redis::cmd("EVAL");
        command.arg("return 1").arg(0);
        let packed = PackedCommand::of(command.clone());
        assert_eq!(packed.bytes(), command.get_packed_command().as_slice());
        assert_eq!(
            packed.command().get_packed_command(),
            command.get_packed_command()
        );
    }
}
