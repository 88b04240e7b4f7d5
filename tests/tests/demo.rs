//! The README's first command, `cargo run --example demo`: it needs no set-up (no Redis), and
//! on Redis (`REDIS_URL`, keys under `IDEMPOTENCY_PREFIX`) it tells the same story. Runs the
//! built example as a process.

use idempotency_actix_tests::{
    example_executable, keys_under, redis_connection, redis_url, unique_prefix,
};

/// Runs the demo; on the Redis at the URL with the key prefix when one is given.
fn run_demo(redis: Option<(&str, &str)>) -> (bool, String, String) {
    let mut command = std::process::Command::new(example_executable("demo"));
    command
        .env_remove("REDIS_URL")
        .env_remove("IDEMPOTENCY_PREFIX");
    if let Some((url, prefix)) = redis {
        command
            .env("REDIS_URL", url)
            .env("IDEMPOTENCY_PREFIX", prefix);
    }
    let output = command
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|error| panic!("cannot run the demo: {error}"));
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn assert_full_transcript(stdout: &str) {
    for step in [
        "== 1. A first request with a key runs the handler",
        "== 2. A retry with the same key is replayed, not run again",
        "== 3. A duplicate while the first is still running gets 409",
        "== 4. The same key with another body gets 422",
        "== 5. No key on a route that requires one gets 400",
        "== 6. How often the handlers really ran",
    ] {
        assert!(stdout.contains(step), "missing step {step:?} in:\n{stdout}");
    }
    assert!(stdout.contains("idempotent-replayed: true"), "{stdout}");
    assert!(stdout.contains("< 409 Conflict"), "{stdout}");
    assert!(stdout.contains("< 422 Unprocessable Entity"), "{stdout}");
    assert!(stdout.contains("< 400 Bad Request"), "{stdout}");
    assert!(stdout.contains("\"orders\":2"), "{stdout}");
    assert!(
        stdout
            .trim_end()
            .ends_with("Every step behaved as expected."),
        "{stdout}"
    );
}

#[test]
fn the_demo_runs_without_any_set_up() {
    let (success, stdout, stderr) = run_demo(None);
    assert!(success, "the demo failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("in-memory store"), "{stdout}");
    assert_full_transcript(&stdout);
}

#[actix_web::test]
async fn the_demo_runs_on_redis() {
    let mut connection = redis_connection().await;
    let prefix = unique_prefix("demo");
    let (success, stdout, stderr) = run_demo(Some((&redis_url(), &prefix)));
    assert!(success, "the demo failed on Redis:\n{stdout}\n{stderr}");
    assert_full_transcript(&stdout);

    // Its records are under the test's prefix: the two orders' (24 h) and the keyed
    // payment's, unless its 2 s ttl has run out.
    let keys = keys_under(&mut connection, &prefix).await;
    assert!((2..=3).contains(&keys.len()), "{keys:?}");
    // None under the default prefix: a key's name ends in the digest of this run's random
    // idempotency key, whatever the prefix, so that name under `idempotency:` is this run's.
    for key in &keys {
        let default = format!("idempotency:{}", &key[prefix.len()..]);
        let exists: bool = redis::cmd("EXISTS")
            .arg(&default)
            .query_async(&mut connection)
            .await
            .expect("EXISTS");
        assert!(!exists, "the demo wrote {default}");
    }
    let _: () = redis::cmd("DEL")
        .arg(&keys)
        .query_async(&mut connection)
        .await
        .expect("DEL");
}
