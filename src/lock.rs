//! One nodeproxy per node: an exclusive, non-blocking `flock` on a host path (e.g.
//! `/run/nodeproxy/nodeproxy.lock`), taken before touching the kernel, with the holder's pid in the file.
//!
//! `flock` locks belong to the open file description and vanish when the process dies (also on
//! SIGKILL), so a crashed instance never leaves a stale lock; the pid in the file is only for
//! the error message. The path must be shared by every instance on the node (a hostPath mount
//! when running in a pod), or the lock protects nothing.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another nodeproxy holds the lock {}{}", path.display(), pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Held { path: PathBuf, pid: Option<u32> },
    #[error("lock {}: {context}", path.display())]
    Io {
        path: PathBuf,
        context: &'static str,
        source: io::Error,
    },
}

/// Holds the lock until dropped (closing the file releases it).
#[derive(Debug)]
pub struct LockGuard {
    path: PathBuf,
    _file: File,
}

impl LockGuard {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes the lock at `path` (created if missing) and writes our pid into it. Fails at once with
/// [`LockError::Held`] when another open file description holds it, naming the holder's pid when
/// the file has one.
pub fn acquire(path: &Path) -> Result<LockGuard, LockError> {
    let io = |context: &'static str| {
        move |source| LockError::Io {
            path: path.to_owned(),
            context,
            source,
        }
    };
    // The default lives in a directory of its own (/run/nodeproxy, the unit's RuntimeDirectory
    // and the DaemonSet's hostPath) so that a sandboxed unit can write it; /run is a tmpfs, so a
    // manual run after boot finds no directory yet. Only the last component is created: a
    // mistyped path deeper than that is an error, not a tree of directories.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.exists()
    {
        match std::fs::DirBuilder::new().mode(0o755).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("create the directory")(e)),
        }
    }
    // No truncate on open: the file holds the current holder's pid until we own the lock.
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .open(path)
        .map_err(io("open"))?;
    // std's try_lock is flock(LOCK_EX | LOCK_NB) on Linux.
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            let mut text = String::new();
            let pid = file
                .read_to_string(&mut text)
                .ok()
                .and_then(|_| text.trim().parse().ok());
            return Err(LockError::Held {
                path: path.to_owned(),
                pid,
            });
        }
        Err(TryLockError::Error(e)) => return Err(io("flock")(e)),
    }
    file.set_len(0).map_err(io("truncate"))?;
    file.seek(SeekFrom::Start(0)).map_err(io("seek"))?;
    writeln!(file, "{}", std::process::id()).map_err(io("write pid"))?;
    file.flush().map_err(io("write pid"))?;
    Ok(LockGuard {
        path: path.to_owned(),
        _file: file,
    })
}

/// Whether a nodeproxy holds the lock at `path`, without taking it (`--cleanup` checks it to
/// name the daemon that owns our tables): [`LockError::Held`] when one does; `Ok` when the file
/// does not exist or nobody holds it. A shared lock taken and released at once, so a daemon
/// starting at that very instant may find the lock busy and exit: `--cleanup` is not run
/// alongside a starting daemon.
pub fn check(path: &Path) -> Result<(), LockError> {
    let mut file = match File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(LockError::Io {
                path: path.to_owned(),
                context: "open",
                source,
            });
        }
    };
    match file.try_lock_shared() {
        Ok(()) => Ok(()),
        Err(TryLockError::WouldBlock) => {
            let mut text = String::new();
            let pid = file
                .read_to_string(&mut text)
                .ok()
                .and_then(|_| text.trim().parse().ok());
            Err(LockError::Held {
                path: path.to_owned(),
                pid,
            })
        }
        Err(TryLockError::Error(source)) => Err(LockError::Io {
            path: path.to_owned(),
            context: "flock",
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("nodeproxy-lock-{}-{name}", std::process::id()))
    }

    #[test]
    fn a_second_acquire_fails_naming_the_holder_until_the_guard_drops() {
        let path = temp_path("second");
        let guard = acquire(&path).unwrap();
        assert_eq!(guard.path(), path.as_path());
        let me = std::process::id();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap().trim(),
            me.to_string()
        );
        // flock conflicts between open file descriptions, also within one process.
        match acquire(&path) {
            Err(LockError::Held { path: p, pid }) => {
                assert_eq!(p, path);
                assert_eq!(pid, Some(me));
            }
            other => panic!("expected Held, got {other:?}"),
        }
        let msg = acquire(&path).unwrap_err().to_string();
        assert!(msg.contains(&format!("(pid {me})")), "{msg}");
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        drop(guard);
        let again = acquire(&path).unwrap();
        drop(again);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn check_names_the_holder_without_taking_the_lock() {
        let path = temp_path("check");
        let _ = std::fs::remove_file(&path);
        assert!(check(&path).is_ok(), "a missing file is not held");
        assert!(!path.exists(), "check must not create the file");
        let guard = acquire(&path).unwrap();
        match check(&path) {
            Err(LockError::Held { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("expected Held, got {other:?}"),
        }
        drop(guard);
        assert!(check(&path).is_ok());
        // check released its shared lock: the lock can be taken.
        let again = acquire(&path).unwrap();
        drop(again);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_stale_pid_in_an_unlocked_file_is_replaced() {
        let path = temp_path("stale");
        std::fs::write(&path, "999999999 and some garbage\n").unwrap();
        let guard = acquire(&path).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{}\n", std::process::id())
        );
        drop(guard);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn an_unreadable_directory_is_an_io_error_naming_the_path() {
        let path = Path::new("/nonexistent-nodeproxy-dir/deeper/lock");
        let e = acquire(path).unwrap_err();
        assert!(matches!(e, LockError::Io { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains("/nonexistent-nodeproxy-dir/deeper/lock")
        );
        assert!(!Path::new("/nonexistent-nodeproxy-dir").exists());
    }

    #[test]
    fn a_missing_last_directory_is_created() {
        let dir = temp_path("dir");
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("nodeproxy.lock");
        let guard = acquire(&path).unwrap();
        assert!(path.is_file());
        drop(guard);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
