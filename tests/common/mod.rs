//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};

/// A fresh directory under the system's temporary directory, removed when the test is done
/// with it. A test that fails (panics) keeps it and says where, so that its files can be
/// read.
pub struct TempDir(PathBuf);

impl TempDir {
    /// `erase-{tag}-{pid}`, emptied if an earlier run left it.
    pub fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("erase-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", d.display()));
        TempDir(d)
    }
}

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept {} (the test failed)", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
