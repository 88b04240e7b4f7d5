//! [`TemporaryDirectory`]: a directory of a test's own, removed when the test ends, failed
//! or not.

use std::path::{Path, PathBuf};

/// A new, empty directory under the system's temporary directory, removed with what it
/// holds when dropped: a test that fails (panics) leaves nothing behind either.
#[derive(Debug)]
pub struct TemporaryDirectory {
    path: PathBuf,
}

impl TemporaryDirectory {
    /// Creates `idempotency-<purpose>-<unique id>`.
    ///
    /// # Panics
    ///
    /// When it cannot be created.
    pub fn new(purpose: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "idempotency-{purpose}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|error| panic!("cannot create {}: {error}", path.display()));
        Self { path }
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TemporaryDirectory {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
