//! A scratch directory per test, and the binary run the way the one-shot tests run it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A directory of its own for one test, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// `nodeproxy-<suite>-<name>-<pid>` under the temporary directory, empty.
    pub fn new(suite: &str, name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("nodeproxy-{suite}-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    /// Writes `text` to `name` in the directory; returns its path.
    pub fn file(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the binary with `args` as node-a, locking `lock`, with no config file from the
/// environment.
pub fn nodeproxy(args: &[&str], lock: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .env_remove("NODEPROXY_CONFIG")
        .env("NODEPROXY_LOCK_FILE", lock)
        .args(["--hostname-override", "node-a"])
        .args(args)
        .output()
        .expect("run nodeproxy")
}
