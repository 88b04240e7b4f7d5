//! Which key prefixes the table can key: checked when the app sets one
//! ([`Idempotency::key_prefix`](crate::Idempotency::key_prefix)), since a prefix it cannot
//! key fails every statement of every keyed request (a 503 each) at run time.

/// The longest key prefix, in bytes, whose storage keys (the prefix and a 64-character
/// digest) the table's primary key index always holds. A B-tree entry is at most 2 704 bytes
/// on PostgreSQL's 8 KiB pages: 8 bytes of tuple header and 4 of length before the key,
/// rounded up to 8, leaves 2 692 bytes for a key that does not compress (a compressible one
/// may be longer, but a prefix is taken only where every key under it fits).
pub(super) const MAX_KEY_PREFIX_BYTES: usize = 2628;

/// Panics, saying why and what to do, unless the table can key storage keys under `prefix`:
/// at most [`MAX_KEY_PREFIX_BYTES`], and no NUL byte, which PostgreSQL's `text` cannot hold.
pub(super) fn check_key_prefix(prefix: &str) {
    assert!(
        !prefix.contains('\0'),
        "Idempotency::key_prefix: a PostgreSQL store's key prefix cannot hold a NUL byte \
         (its keys are `text`, which cannot), so every keyed request would fail (503): \
         remove it from the prefix"
    );
    assert!(
        prefix.len() <= MAX_KEY_PREFIX_BYTES,
        "Idempotency::key_prefix: a PostgreSQL store's key prefix is at most \
         {MAX_KEY_PREFIX_BYTES} bytes (its keys, the prefix and 64 characters, must fit an \
         index entry), but this one is {} bytes, so every keyed request would fail (503): \
         shorten the prefix",
        prefix.len()
    );
}
