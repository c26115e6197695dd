//! Build script: records the git commit and the target triple for `nodeproxy --version`.
//!
//! The commit comes from `git rev-parse` when building from a checkout (a worktree's `.git` is a
//! file, so the files to watch are found through `git rev-parse --git-dir`), else from
//! `NODEPROXY_GIT_COMMIT` (a source tarball's build), else "unknown". No build time or host name
//! is recorded: release binaries are byte-reproducible from the commit.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn main() {
    let commit = git(&["rev-parse", "--short=12", "HEAD"])
        .or_else(|| {
            std::env::var("NODEPROXY_GIT_COMMIT")
                .ok()
                .filter(|c| !c.is_empty())
        })
        .unwrap_or_else(|| "unknown".to_string());
    // A commit id is hex; anything else from the environment is not printed as is.
    let commit: String = commit
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(40)
        .collect();
    println!("cargo:rustc-env=NODEPROXY_GIT_COMMIT={commit}");
    let target = std::env::var("TARGET").unwrap_or_else(|_| "unknown".to_string());
    println!("cargo:rustc-env=NODEPROXY_TARGET={target}");
    println!("cargo:rerun-if-env-changed=NODEPROXY_GIT_COMMIT");
    if let Some(dir) = git(&["rev-parse", "--git-dir"]).map(PathBuf::from) {
        // HEAD moves on checkout; the branch it names moves on commit (loose or packed refs).
        println!("cargo:rerun-if-changed={}", dir.join("HEAD").display());
        if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={}", dir.join(&reference).display());
        }
        if let Some(common) = git(&["rev-parse", "--git-common-dir"]).map(PathBuf::from) {
            println!(
                "cargo:rerun-if-changed={}",
                common.join("packed-refs").display()
            );
            if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
                println!(
                    "cargo:rerun-if-changed={}",
                    common.join(reference).display()
                );
            }
        }
    }
}
