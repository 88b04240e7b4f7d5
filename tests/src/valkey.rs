//! Valkey (≥ 8.1) for the tests of the commit by `SET … IFEQ`, which Redis 7 does not have.
//!
//! The binary is `VALKEY_SERVER` when set, else `valkey-server` on the `PATH`. Debian 13 and
//! later package it (`apt-get install -y valkey-server`); on older systems
//! `.ci/install-valkey` builds it from Debian's source package. A missing or older binary
//! fails the tests that need it, with that hint; they never pass silently.

use std::path::PathBuf;
use std::sync::OnceLock;

/// What to do when no suitable `valkey-server` is found.
const INSTALL_VALKEY: &str = "install valkey-server ≥ 8.1 (Debian ≥ 13: apt-get install -y valkey-server; \
     older systems: .ci/install-valkey builds it from Debian's source package), or set \
     VALKEY_SERVER to its path";

/// The oldest Valkey with `SET … IFEQ`.
const MIN_VERSION: (u32, u32) = (8, 1);

/// The `valkey-server` binary of the tests, checked once per test process to be ≥ 8.1.
///
/// # Panics
///
/// When it is missing or older, with the install hint.
pub fn valkey_server() -> PathBuf {
    static SERVER: OnceLock<PathBuf> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let server = std::env::var_os("VALKEY_SERVER")
                .filter(|path| !path.is_empty())
                .map_or_else(|| PathBuf::from("valkey-server"), PathBuf::from);
            let output = std::process::Command::new(&server)
                .arg("--version")
                .output()
                .unwrap_or_else(|error| {
                    panic!(
                        "cannot run {} ({error}); {INSTALL_VALKEY}",
                        server.display()
                    )
                });
            let banner = String::from_utf8_lossy(&output.stdout);
            let version = parse_version(&banner).unwrap_or_else(|| {
                panic!(
                    "{} --version answered {banner:?}; {INSTALL_VALKEY}",
                    server.display()
                )
            });
            assert!(
                version >= MIN_VERSION,
                "{} is Valkey {}.{}, without SET … IFEQ; {INSTALL_VALKEY}",
                server.display(),
                version.0,
                version.1
            );
            server
        })
        .clone()
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

/// Major and minor version from `valkey-server --version` (`Valkey server v=8.1.1 sha=…`).
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
        assert_eq!(parse_version("something else"), None);
    }
}
