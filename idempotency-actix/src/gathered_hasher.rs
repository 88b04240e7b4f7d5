//! [`GatheredHasher`]: a blake3 hasher in key-derivation mode that gathers short inputs on the
//! stack and hands them over in one `update`.

use blake3::hazmat::{ContextKey, HasherExt};

/// How many bytes [`GatheredHasher`] keeps before it hands them to the hasher: room for the
/// parts of most requests' fingerprints and storage keys.
const GATHERED: usize = 256;

/// blake3 in key-derivation mode for one context, fed through a stack buffer.
///
/// blake3 pays a fixed cost per `update`, more than the hashing of a short input, so short
/// inputs are gathered and handed over together. The digest depends only on the bytes, not
/// on how they were split. The hasher is made from the context's key, derived once per
/// process: a prepared `blake3::Hasher` would be 1.9 KB of state to copy per digest.
pub(crate) struct GatheredHasher {
    hasher: blake3::Hasher,
    gathered: [u8; GATHERED],
    len: usize,
}

impl GatheredHasher {
    /// A hasher for the context whose key is `context_key`
    /// (see [`blake3::hazmat::hash_derive_key_context`]).
    #[inline]
    pub(crate) fn new(context_key: &ContextKey) -> Self {
        Self {
            hasher: blake3::Hasher::new_from_context_key(context_key),
            gathered: [0; GATHERED],
            len: 0,
        }
    }

    /// Hashes `bytes` after what came before.
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        if bytes.len() > GATHERED - self.len {
            self.hand_over();
            if bytes.len() > GATHERED {
                self.hasher.update(bytes);
                return;
            }
        }
        self.gathered[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    /// The digest of everything pushed.
    pub(crate) fn finalize(&mut self) -> [u8; 32] {
        self.hand_over();
        *self.hasher.finalize().as_bytes()
    }

    fn hand_over(&mut self) {
        self.hasher.update(&self.gathered[..self.len]);
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_blake3_derive_key_of_the_bytes_however_they_were_split() {
        let context_key = blake3::hazmat::hash_derive_key_context("idempotency-actix test");
        let long = vec![b'x'; 1000];
        let parts: [&[u8]; 4] = [b"short", &long, b"", b"tail"];
        let mut gathered = GatheredHasher::new(&context_key);
        for part in parts {
            gathered.push(part);
        }
        let whole = parts.concat();
        assert_eq!(
            gathered.finalize(),
            blake3::derive_key("idempotency-actix test", &whole)
        );
    }
}
