//! The servers with `SET … IFEQ`, which Redis 7 does not have: Valkey ≥ 8.1, where the
//! store commits by it, and Redis ≥ 8.4, where it has it but the store commits by function
//! (`docs/redis-8-set-ifeq.md`).
//!
//! Valkey is `VALKEY_SERVER` when set, else `valkey-server` on the `PATH`. Debian 13 and
//! later package it (`apt-get install -y valkey-server`); on older systems
//! `.ci/install-valkey` builds it from Debian's source package.
//!
//! Redis 8 lives in a prefix of its own, never as the `redis-server` on the `PATH` (the
//! other tests run on that one, Redis 7 where it is): `REDIS8_SERVER` when set, else
//! `/opt/redis-8.6/bin/redis-server`, where `.ci/install-redis8` builds it from Debian's
//! source package, else the `redis-server` on the `PATH` if it is ≥ 8.4.
//!
//! The tests of the commit by function, which such a server does not use, need a Redis
//! without `SET … IFEQ` (7.0 to 8.2) instead: `REDIS7_SERVER` when set, else the
//! `redis-server` on the `PATH` if it is one (Debian 12's is Redis 7.0).
//!
//! A missing, older or (for `REDIS7_SERVER`) newer binary fails the tests that need it, with
//! the install hint; they never pass silently.

use std::path::PathBuf;
use std::sync::OnceLock;

/// A server binary the tests need, and how to find and check it.
struct Wanted {
    /// What it is, for messages (`Valkey`, `Redis`).
    name: &'static str,
    /// The variable that names its binary.
    variable: &'static str,
    /// Where it is looked for when the variable is unset, in order.
    candidates: &'static [&'static str],
    /// The oldest version accepted.
    min_version: (u32, u32),
    /// The first version too new, for a server wanted without `SET … IFEQ`.
    too_new: Option<(u32, u32)>,
    /// What to do when no suitable binary is found.
    install: &'static str,
}

const VALKEY: Wanted = Wanted {
    name: "Valkey",
    variable: "VALKEY_SERVER",
    candidates: &["valkey-server"],
    min_version: (8, 1),
    too_new: None,
    install: "install valkey-server ≥ 8.1 (Debian ≥ 13: apt-get install -y valkey-server; \
              older systems: .ci/install-valkey builds it from Debian's source package), or \
              set VALKEY_SERVER to its path",
};

const REDIS8: Wanted = Wanted {
    name: "Redis",
    variable: "REDIS8_SERVER",
    candidates: &["/opt/redis-8.6/bin/redis-server", "redis-server"],
    min_version: (8, 4),
    too_new: None,
    install: "install a redis-server ≥ 8.4 in a prefix of its own (.ci/install-redis8 builds \
              Redis 8.6 from Debian's source package into /opt/redis-8.6), or set \
              REDIS8_SERVER to its path",
};

const REDIS7: Wanted = Wanted {
    name: "Redis",
    variable: "REDIS7_SERVER",
    candidates: &["redis-server"],
    min_version: (7, 0),
    too_new: Some((8, 4)),
    install: "install a redis-server without SET … IFEQ (Redis 7.0 to 8.2; Debian 12: apt-get \
              install -y redis-server) and put it first on the PATH, or set REDIS7_SERVER to \
              its path",
};

impl Wanted {
    /// The binary: the variable's when set, else the first candidate that is new enough.
    ///
    /// # Panics
    ///
    /// When none is, with what each one is and the install hint.
    fn find(&self) -> PathBuf {
        if let Some(server) = std::env::var_os(self.variable).filter(|path| !path.is_empty()) {
            let server = PathBuf::from(server);
            if let Err(problem) = self.check(&server) {
                panic!(
                    "{} ({}): {problem}; {}",
                    self.variable,
                    server.display(),
                    self.install
                );
            }
            return server;
        }
        let mut problems = Vec::new();
        for candidate in self.candidates {
            let server = PathBuf::from(candidate);
            match self.check(&server) {
                Ok(()) => return server,
                Err(problem) => problems.push(problem),
            }
        }
        let below = self
            .too_new
            .map(|(major, minor)| format!(" and < {major}.{minor}"))
            .unwrap_or_default();
        panic!(
            "no {} ≥ {}.{}{below} ({}); {}",
            self.name,
            self.min_version.0,
            self.min_version.1,
            problems.join("; "),
            self.install
        );
    }

    /// Whether `server` runs and is at least the version needed.
    fn check(&self, server: &std::path::Path) -> Result<(), String> {
        let output = std::process::Command::new(server)
            .arg("--version")
            .output()
            .map_err(|error| format!("cannot run {} ({error})", server.display()))?;
        let banner = String::from_utf8_lossy(&output.stdout);
        let version = parse_version(&banner)
            .ok_or_else(|| format!("{} --version answered {banner:?}", server.display()))?;
        if !banner.starts_with(self.name) {
            return Err(format!(
                "{} is not {}: {banner:?}",
                server.display(),
                self.name
            ));
        }
        if version < self.min_version {
            return Err(format!(
                "{} is {} {}.{}, older than {}.{}",
                server.display(),
                self.name,
                version.0,
                version.1,
                self.min_version.0,
                self.min_version.1
            ));
        }
        if self.too_new.is_some_and(|too_new| version >= too_new) {
            return Err(format!(
                "{} is {} {}.{}, with SET … IFEQ",
                server.display(),
                self.name,
                version.0,
                version.1
            ));
        }
        Ok(())
    }
}

/// The `valkey-server` binary of the tests, checked once per test process to be ≥ 8.1.
///
/// # Panics
///
/// When it is missing or older, with the install hint.
pub fn valkey_server() -> PathBuf {
    static SERVER: OnceLock<PathBuf> = OnceLock::new();
    SERVER.get_or_init(|| VALKEY.find()).clone()
}

/// The Redis ≥ 8.4 `redis-server` binary of the tests, found once per test process (see
/// the module's documentation).
///
/// # Panics
///
/// When none is found, with the install hint.
pub fn redis8_server() -> PathBuf {
    static SERVER: OnceLock<PathBuf> = OnceLock::new();
    SERVER.get_or_init(|| REDIS8.find()).clone()
}

/// A `redis-server` binary without `SET … IFEQ` (Redis 7.0 to 8.2) for the tests of the
/// commit by function, found once per test process (see the module's documentation).
///
/// # Panics
///
/// When none is found, with the install hint.
pub fn redis7_server() -> PathBuf {
    static SERVER: OnceLock<PathBuf> = OnceLock::new();
    SERVER.get_or_init(|| REDIS7.find()).clone()
}

/// The URL of a private Valkey that this test process starts on first use (on a free
/// loopback port, stopped when the process exits).
///
/// # Panics
///
/// When `valkey-server` is missing or older than 8.1, or does not answer within 10 s.
pub fn valkey_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| crate::test_redis::start_private_server(&valkey_server()))
        .clone()
}

/// The URL of a private Redis ≥ 8.4 that this test process starts on first use (on a free
/// loopback port, stopped when the process exits).
///
/// # Panics
///
/// When no Redis ≥ 8.4 is found (see [`redis8_server`]), or it does not answer within 10 s.
pub fn redis8_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| crate::test_redis::start_private_server(&redis8_server()))
        .clone()
}

/// Major and minor version from a `--version` banner (`Valkey server v=8.1.1 sha=…`,
/// `Redis server v=8.6.3 sha=…`).
fn parse_version(banner: &str) -> Option<(u32, u32)> {
    let version = banner
        .split_whitespace()
        .find_map(|word| word.strip_prefix("v="))?;
    let mut parts = version.split('.').map(str::parse::<u32>);
    Some((parts.next()?.ok()?, parts.next()?.ok()?))
}

#[cfg(test)]
mod tests {
    use super::parse_version;

    #[test]
    fn the_version_is_read_from_the_banner() {
        let banner = "Valkey server v=8.1.1 sha=00000000:1 malloc=jemalloc-5.3.0 bits=64";
        assert_eq!(parse_version(banner), Some((8, 1)));
        assert_eq!(parse_version("Valkey server v=10.0.2 sha=0"), Some((10, 0)));
        let banner = "Redis server v=8.6.3 sha=00000000:1 malloc=jemalloc-5.3.0 bits=64";
        assert_eq!(parse_version(banner), Some((8, 6)));
        assert_eq!(parse_version("something else"), None);
    }
}
