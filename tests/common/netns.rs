//! Run test code in a fresh network namespace.
//!
//! `unshare(CLONE_NEWNET)` applies to the calling thread only, so the closure runs on a
//! dedicated thread: netlink sockets it opens and processes it spawns (`nft`) live in the new
//! namespace, and the namespace disappears with the thread, also when the test panics.

use std::process::Command;

/// Runs `f` in a new network namespace. Panics (fails the test) if the namespace cannot be
/// created: kernel tests must not silently skip.
pub fn in_netns<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    let h = std::thread::spawn(move || {
        if let Err(e) = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET) {
            panic!("unshare(CLONE_NEWNET) failed ({e}); kernel tests need root (CAP_SYS_ADMIN)");
        }
        f()
    });
    match h.join() {
        Ok(r) => r,
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// A node lock file for nodeproxy runs from the calling thread's network namespace: each test
/// namespace stands for a node of its own, and tests run in parallel must not share the
/// default lock.
pub fn lock_file_for_this_netns() -> std::path::PathBuf {
    let link = std::fs::read_link("/proc/thread-self/ns/net")
        .unwrap_or_else(|e| panic!("reading /proc/thread-self/ns/net: {e}"));
    let id: String = link
        .to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    std::env::temp_dir().join(format!("nodeproxy-test-net-{id}.lock"))
}

/// Runs `f` on a thread that has entered the named network namespace (an `ip netns` name, such
/// as a lab's), and waits for it. Processes it spawns and threads it creates start in that
/// namespace too. A panic in `f` is re-raised here.
pub fn in_named_netns<R: Send>(name: &str, f: impl FnOnce() -> R + Send) -> R {
    let path = format!("/run/netns/{name}");
    std::thread::scope(|scope| {
        let h = scope.spawn(|| {
            let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
            if let Err(e) = nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET) {
                panic!("setns {path} failed ({e}); kernel tests need root (CAP_SYS_ADMIN)");
            }
            f()
        });
        match h.join() {
            Ok(r) => r,
            Err(p) => std::panic::resume_unwind(p),
        }
    })
}

/// Runs `nft` with arguments in the current thread's namespace; panics on failure.
pub fn nft(args: &[&str]) -> String {
    let out = Command::new("nft")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run nft: {e}"));
    if !out.status.success() {
        panic!(
            "nft {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Loads nft text with `nft -f -`.
pub fn nft_load(text: &str) {
    use std::io::Write;
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run nft: {e}"));
    child.stdin.take().map(|mut s| s.write_all(text.as_bytes()));
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("wait nft: {e}"));
    if !out.status.success() {
        panic!(
            "nft -f failed: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// What nft (1.0.6) adds to a table listing for table flags: ` # progname <owner>` after the
/// header of an owned table, a `\tflags …` line after it (for an orphan just `\tflags `, as
/// 1.0.6 does not know persist), and then a blank line before the first set or chain. Removes
/// exactly that, so a listing of an owned or orphaned table compares with our rendering, which
/// never shows ownership.
pub fn strip_ownership(text: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if !line.starts_with("table ") {
            out.push(line);
            continue;
        }
        out.push(line.split(" # progname ").next().unwrap_or(line));
        if !lines.peek().is_some_and(|l| l.starts_with("\tflags ")) {
            continue;
        }
        lines.next();
        if let Some(comment) = lines.next_if(|l| l.starts_with("\tcomment ")) {
            out.push(comment);
        }
        lines.next_if(|l| l.is_empty());
    }
    let mut joined = out.join("\n");
    if text.ends_with('\n') {
        joined.push('\n');
    }
    joined
}
