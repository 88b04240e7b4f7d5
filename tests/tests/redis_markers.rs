//! The marker abandoned tokens leave on Redis (`IdempotencyStore::abandon`): it remembers
//! the latest 16 tokens abandoned on its key and no more, so a flood of requests that go away
//! during `begin` cannot grow one key without bound. On the test Redis, under a key prefix of
//! its own.

#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use actix_web::http::{Method, StatusCode};
use actix_web::web::Bytes;
use idempotency_actix::{
    BeginOutcome, Fingerprint, IdempotencyKey, IdempotencyStore, LeaseToken, RedisStore,
    StorageKey, StoredResponse,
};
use idempotency_actix_tests::{PrivateRedis, redis_connection, redis_pool, unique_prefix};

const LONG: Duration = Duration::from_secs(60);

#[actix_web::test]
async fn a_marker_remembers_the_latest_sixteen_abandoned_tokens_and_no_more() {
    let store = RedisStore::new(redis_pool().await);
    let prefix = unique_prefix("markers");
    let key = StorageKey::new(&prefix, b"", &IdempotencyKey::parse(b"k").unwrap());
    let print = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    let tokens: Vec<LeaseToken> = (0..40).map(|_| LeaseToken::generate()).collect();
    for token in &tokens {
        assert!(store.abandon(&key, token, LONG).await.unwrap());
    }
    let mut connection = redis_connection().await;
    let bytes: usize = redis::cmd("STRLEN")
        .arg(key.as_str())
        .query_async(&mut connection)
        .await
        .unwrap();
    // The header (format, state, fingerprint) and 16 token fields of 1 + 32 bytes.
    assert_eq!(bytes, 2 + 32 + 16 * 33);
    for token in &tokens[24..] {
        assert_eq!(
            store.begin(&key, &print, token, LONG).await.unwrap(),
            BeginOutcome::Abandoned
        );
    }
    // Forgotten: the oldest takes the key as any other token would.
    assert_eq!(
        store.begin(&key, &print, &tokens[0], LONG).await.unwrap(),
        BeginOutcome::Acquired
    );
}

/// A proxy to the Redis server on `port` that, before it passes on each of the first
/// `markers.len()` claims (`FCALL …_claim`) a store sends through it, writes the next of
/// `markers` at `key` from a connection of its own: as if yet another token were abandoned
/// on the key just before each of those claims. Answers the port it listens on.
fn proxy_abandoning_before_claims(port: u16, key: String, markers: Vec<Vec<u8>>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a free loopback port");
    let proxy = listener.local_addr().expect("a bound listener").port();
    let claims = Arc::new(AtomicUsize::new(0));
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { continue };
            let Ok(server) = TcpStream::connect(("127.0.0.1", port)) else {
                continue;
            };
            let (mut from_client, mut to_server) = (
                client.try_clone().expect("a socket handle"),
                server.try_clone().expect("a socket handle"),
            );
            let (key, markers, claims) = (key.clone(), markers.clone(), Arc::clone(&claims));
            std::thread::spawn(move || {
                let mut side = redis::Client::open(format!("redis://127.0.0.1:{port}"))
                    .expect("a valid URL")
                    .get_connection()
                    .expect("a side connection");
                let mut buffer = [0; 64 * 1024];
                loop {
                    let read = match from_client.read(&mut buffer) {
                        Ok(0) | Err(_) => break,
                        Ok(read) => read,
                    };
                    let chunk = &buffer[..read];
                    let contains = |needle: &[u8]| chunk.windows(needle.len()).any(|w| w == needle);
                    if contains(b"FCALL") && contains(b"_claim") && !contains(b"#!lua") {
                        let claim = claims.fetch_add(1, Ordering::SeqCst);
                        if let Some(marker) = markers.get(claim) {
                            let () = redis::cmd("SET")
                                .arg(&key)
                                .arg(marker.as_slice())
                                .arg("PX")
                                .arg(60_000)
                                .query(&mut side)
                                .expect("the marker written");
                        }
                    }
                    if to_server.write_all(chunk).is_err() {
                        break;
                    }
                }
                let _ = to_server.shutdown(Shutdown::Write);
            });
            let (mut from_server, mut to_client) = (server, client);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut from_server, &mut to_client);
                let _ = to_client.shutdown(Shutdown::Write);
            });
        }
    });
    proxy
}

/// A `begin` that finds another token's marker claims the key over it, up to three times
/// if yet other tokens are abandoned on the key meanwhile. The third claim's reply was
/// never read: when that claim took the key, `begin` answered in flight anyway, so the
/// request got 409 with no handler run, and the key stayed locked by a token no one held
/// (409 for everyone) until its lease ran out.
#[actix_web::test]
async fn a_begin_whose_third_claim_takes_the_key_holds_it() {
    let redis = PrivateRedis::start().await;
    let direct = RedisStore::new(RedisStore::pool(&redis.url()).expect("a valid URL"));
    let key = StorageKey::new(
        "claims",
        b"",
        &IdempotencyKey::parse(b"k").expect("a valid key"),
    );
    let print = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    // The markers of one, two and three abandoned tokens.
    let mut connection = redis.connection().await;
    let mut markers = Vec::new();
    for _ in 0..3 {
        let abandoned = direct.abandon(&key, &LeaseToken::generate(), LONG).await;
        assert!(abandoned.expect("abandoned"));
        let marker: Vec<u8> = redis::cmd("GET")
            .arg(key.as_str())
            .query_async(&mut connection)
            .await
            .expect("the marker");
        markers.push(marker);
    }
    let () = redis::cmd("SET")
        .arg(key.as_str())
        .arg(markers[0].as_slice())
        .arg("PX")
        .arg(60_000)
        .query_async(&mut connection)
        .await
        .expect("the first marker back");

    // The first two claims each find a marker with one more token; the third finds the
    // marker it was sent, and takes the key.
    let port = proxy_abandoning_before_claims(
        redis.port(),
        key.as_str().to_owned(),
        markers[1..].to_vec(),
    );
    let store = RedisStore::new(
        RedisStore::pool(&format!("redis://127.0.0.1:{port}")).expect("a valid URL"),
    );
    let token = LeaseToken::generate();
    let outcome = store.begin(&key, &print, &token, LONG).await;
    assert_eq!(
        outcome.expect("begun"),
        BeginOutcome::Acquired,
        "the third claim took the key for this token"
    );
    // And the request that holds it can give it back.
    assert!(store.release(&key, &token).await.expect("released"));
}

/// A commit that finds its in-flight record lost (evicted, or expired with a lease that
/// could not be renewed) writes the completed record anew over whatever marker is there;
/// when yet another token was abandoned on the key between the read and that write, the
/// write found the new marker and gave up: the commit answered "lost", the response was
/// sent but not stored, and a retry ran the handler a second time.
#[actix_web::test]
async fn a_commit_written_anew_over_a_marker_that_changed_meanwhile_is_stored() {
    let redis = PrivateRedis::start().await;
    let direct = RedisStore::new(RedisStore::pool(&redis.url()).expect("a valid URL"));
    let key = StorageKey::new(
        "anew",
        b"",
        &IdempotencyKey::parse(b"k").expect("a valid key"),
    );
    let print = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    // The marker of another abandoned token, made on a key of its own.
    let scratch = StorageKey::new(
        "scratch",
        b"",
        &IdempotencyKey::parse(b"k").expect("a valid key"),
    );
    let abandoned = direct
        .abandon(&scratch, &LeaseToken::generate(), LONG)
        .await;
    assert!(abandoned.expect("abandoned"));
    let mut connection = redis.connection().await;
    let marker: Vec<u8> = redis::cmd("GET")
        .arg(scratch.as_str())
        .query_async(&mut connection)
        .await
        .expect("the marker");

    let port = proxy_abandoning_before_claims(redis.port(), key.as_str().to_owned(), vec![marker]);
    let store = RedisStore::new(
        RedisStore::pool(&format!("redis://127.0.0.1:{port}")).expect("a valid URL"),
    );
    let token = LeaseToken::generate();
    let begun = store.begin(&key, &print, &token, LONG).await;
    assert_eq!(begun.expect("begun"), BeginOutcome::Acquired);
    // The in-flight record is lost.
    let () = redis::cmd("DEL")
        .arg(key.as_str())
        .query_async(&mut connection)
        .await
        .expect("deleted");

    let response = StoredResponse::new(
        StatusCode::CREATED,
        Vec::new(),
        Some(Bytes::from_static(b"paid")),
    );
    let committed = store
        .commit(&key, &print, &token, &response, LONG)
        .await
        .expect("committed");
    assert!(committed, "the completed record was written anew");
    let replayed = direct
        .begin(&key, &print, &LeaseToken::generate(), LONG)
        .await
        .expect("begun");
    assert!(
        matches!(&replayed, BeginOutcome::Completed(stored) if stored.body.as_deref() == Some(&b"paid"[..])),
        "a retry replays the stored response: {replayed:?}"
    );
}

/// A Redis user granted what README ("The Redis user's rights") asks at least, without
/// `PEXPIRETIME` and `PEXPIREAT`, or with `PEXPIRETIME` alone: a key taken over an abandoned
/// token's marker is begun, committed, released and abandoned with no failed step, the
/// library calling those two commands only where the user may (`redis.pcall`). And with
/// README's whole grant and its `+select`, through a URL that names database 1 (the
/// connection's `SELECT` was missing from README's grant, so such a URL got 503 for every
/// keyed request).
async fn keys_are_taken_over_markers_without_the_expiry_commands(redis: PrivateRedis) {
    // README's grant, for every key.
    const GRANTED: [&str; 12] = [
        "on",
        "nopass",
        "~*",
        "resetchannels",
        "-@all",
        "+set",
        "+get",
        "+fcall",
        "+fcall_ro",
        "+ping",
        "+pexpire",
        "+del",
    ];
    let mut admin = redis.connection().await;
    let print = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    let prefix = unique_prefix("narrow-user");
    for (user, rights, database) in [
        ("readme", &["+function|load"][..], 0),
        ("pexpiretime", &["+function|load", "+pexpiretime"][..], 0),
        (
            "database",
            &["+function|load", "+pexpiretime", "+pexpireat", "+select"][..],
            1,
        ),
    ] {
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg(user)
            .arg(&GRANTED[..])
            .arg(rights)
            .query_async(&mut admin)
            .await
            .unwrap();
        let url = format!("redis://{user}:any@127.0.0.1:{}/{database}", redis.port());
        let store = RedisStore::new(RedisStore::pool(&url).unwrap());
        let key = |name: &str| {
            let name = format!("{user}-{name}");
            StorageKey::new(
                &prefix,
                b"",
                &IdempotencyKey::parse(name.as_bytes()).unwrap(),
            )
        };
        let taken_over = |name: &str| {
            let (store, key) = (&store, key(name));
            async move {
                let (abandoned, taker) = (LeaseToken::generate(), LeaseToken::generate());
                assert!(store.abandon(&key, &abandoned, LONG).await.unwrap());
                let begun = store.begin(&key, &print, &taker, LONG).await.unwrap();
                assert_eq!(begun, BeginOutcome::Acquired, "{user}");
                (key, abandoned, taker)
            }
        };
        let (released, _, taker) = taken_over("released").await;
        assert!(store.release(&released, &taker).await.unwrap(), "{user}");
        let (completed, abandoned, taker) = taken_over("completed").await;
        let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), None);
        assert!(
            store
                .commit(&completed, &print, &taker, &response, LONG)
                .await
                .unwrap()
        );
        assert_eq!(
            store
                .begin(&completed, &print, &abandoned, LONG)
                .await
                .unwrap(),
            BeginOutcome::Completed(response),
            "{user}"
        );
        let (given_up, _, taker) = taken_over("abandoned").await;
        assert!(
            store.abandon(&given_up, &taker, LONG).await.unwrap(),
            "{user}"
        );
        assert_eq!(
            store.begin(&given_up, &print, &taker, LONG).await.unwrap(),
            BeginOutcome::Abandoned,
            "{user}"
        );
    }
}

#[actix_web::test]
async fn keys_are_taken_over_markers_without_the_expiry_commands_on_redis_7() {
    keys_are_taken_over_markers_without_the_expiry_commands(PrivateRedis::start_redis7(&[]).await)
        .await;
}

#[actix_web::test]
async fn keys_are_taken_over_markers_without_the_expiry_commands_on_valkey() {
    keys_are_taken_over_markers_without_the_expiry_commands(PrivateRedis::start_valkey(&[]).await)
        .await;
}

/// A connection that speaks RESP3 (a pool the app built on a URL with `protocol=3`): the
/// library's functions reply in RESP2 (none calls `redis.setresp(3)`), so a Lua `false`
/// reaches a RESP3 client as null, not as a boolean the store would not read. A key taken
/// over an abandoned token's marker (the `claim` answers `false` once it wrote) is
/// acquired, committed and replayed as over RESP2, and the inspector reads a missing key as
/// missing. (A review suspected the boolean; this pins the null, so a library revision that
/// switched its replies to RESP3 would fail here.)
#[actix_web::test]
async fn a_resp3_connection_takes_keys_over_markers() {
    redis_connection().await;
    let url = format!("{}?protocol=3", idempotency_actix_tests::redis_url());
    let manager = bb8_redis::RedisConnectionManager::new(url).unwrap();
    let pool = bb8::Pool::builder().build(manager).await.unwrap();
    let store = RedisStore::new(pool);
    let prefix = unique_prefix("resp3");
    let key = StorageKey::new(&prefix, b"", &IdempotencyKey::parse(b"k").unwrap());
    let print = Fingerprint::compute(&Method::POST, "/orders", "", b"{}", []);
    let (abandoned, taker) = (LeaseToken::generate(), LeaseToken::generate());
    assert!(store.abandon(&key, &abandoned, LONG).await.unwrap());
    assert_eq!(
        store.begin(&key, &print, &taker, LONG).await.unwrap(),
        BeginOutcome::Acquired
    );
    let response = StoredResponse::new(StatusCode::CREATED, Vec::new(), Some(Bytes::from("paid")));
    assert!(
        store
            .commit(&key, &print, &taker, &response, LONG)
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .begin(&key, &print, &LeaseToken::generate(), LONG)
            .await
            .unwrap(),
        BeginOutcome::Completed(response)
    );
    let missing = StorageKey::new(&prefix, b"", &IdempotencyKey::parse(b"none").unwrap());
    assert_eq!(store.inspect(&missing, false).await.unwrap(), None);
}
