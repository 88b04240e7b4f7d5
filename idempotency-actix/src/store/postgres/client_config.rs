//! The client's side of the TCP connections of [`PostgresStore::pool`](super::PostgresStore::pool):
//! keepalives and `tcp_user_timeout`, so that a connection a NAT or firewall dropped without
//! a word is closed by the system within about a minute, and replaced, instead of failing
//! every statement sent on it (a 503 each) for up to two hours.
//!
//! A pooled connection that went silent is given back to the pool by the statement that
//! timed out on it (bb8 takes a connection for broken only once it is closed), and taken
//! again by the next request: without these, Linux closes it only after 15 minutes of
//! retransmissions once something was sent on it, and after two hours of idleness
//! (tokio-postgres's default keepalive time) otherwise.

use std::time::Duration;

use tokio_postgres::Config;

/// Idle time before the first keepalive probe: short enough that the probes keep a NAT's or
/// load balancer's mapping of an idle pooled connection alive (cloud NATs and load
/// balancers drop idle flows after 4 to 6 minutes), and with [`KEEPALIVES_INTERVAL`] and
/// [`KEEPALIVES_RETRIES`], close one that was dropped anyway within about a minute.
pub(super) const KEEPALIVES_IDLE: Duration = Duration::from_secs(30);

/// Time between unanswered keepalive probes.
pub(super) const KEEPALIVES_INTERVAL: Duration = Duration::from_secs(10);

/// Unanswered probes before the system closes the connection.
pub(super) const KEEPALIVES_RETRIES: u32 = 3;

/// How long data sent on a connection may go unacknowledged before the system closes it
/// (Linux; elsewhere ignored): a statement sent on a connection that went silent closes it
/// within this, rather than after 15 minutes of retransmissions.
pub(super) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// `url` as a connection config, with the keepalives and `tcp_user_timeout` above where
/// `url` says nothing of them (a `keepalives…` or `tcp_user_timeout` parameter in `url` is
/// kept as it is, `keepalives=0` included; tokio-postgres reads `tcp_user_timeout` in
/// seconds, where libpq reads milliseconds).
pub(super) fn client_config(url: &str) -> Result<Config, tokio_postgres::Error> {
    let mut config: Config = url.parse()?;
    if !url.contains("keepalives") {
        config
            .keepalives(true)
            .keepalives_idle(KEEPALIVES_IDLE)
            .keepalives_interval(KEEPALIVES_INTERVAL)
            .keepalives_retries(KEEPALIVES_RETRIES);
    }
    if !url.contains("tcp_user_timeout") {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_that_says_nothing_gets_short_keepalives_and_a_user_timeout() {
        for url in [
            "postgres://app@127.0.0.1/app",
            "host=127.0.0.1 user=app dbname=app",
        ] {
            let config = client_config(url).unwrap();
            assert!(config.get_keepalives(), "{url}");
            assert_eq!(config.get_keepalives_idle(), KEEPALIVES_IDLE, "{url}");
            assert_eq!(config.get_keepalives_interval(), Some(KEEPALIVES_INTERVAL));
            assert_eq!(config.get_keepalives_retries(), Some(KEEPALIVES_RETRIES));
            assert_eq!(config.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
        }
    }

    #[test]
    fn what_the_url_says_of_them_is_kept() {
        let config =
            client_config("postgres://app@127.0.0.1/app?keepalives_idle=600&tcp_user_timeout=60")
                .unwrap();
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(600));
        assert_eq!(config.get_keepalives_interval(), None);
        // In seconds, as tokio-postgres reads it (libpq reads milliseconds).
        assert_eq!(
            config.get_tcp_user_timeout(),
            Some(&Duration::from_secs(60))
        );
        let off = client_config("postgres://app@127.0.0.1/app?keepalives=0").unwrap();
        assert!(!off.get_keepalives());
        assert_eq!(off.get_tcp_user_timeout(), Some(&TCP_USER_TIMEOUT));
    }

    #[test]
    fn a_url_that_is_no_connection_string_is_an_error() {
        assert!(client_config("postgres://app@127.0.0.1:port/app").is_err());
    }
}
