//! The nodeproxy binary as a daemon in tests: a per-test lock file, health and metrics ports and
//! short sync periods; killed on drop, with its log printed when the test failed.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Every wait on the daemon is bounded by this.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// A free port on 127.0.0.1 in the current namespace (racy in principle; nothing else binds in
/// a fresh namespace).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A GET on 127.0.0.1:`port`; returns the status code and the body.
pub fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

/// The binary running as a daemon in the current network namespace.
pub struct Daemon {
    child: Child,
    log: PathBuf,
    pub healthz: u16,
    pub metrics: u16,
}

impl Daemon {
    /// Starts `nodeproxy` against the API server of `kubeconfig`, with its lock file and log in
    /// `dir` (the log named after `name`), plus `args` (node name, CIDRs, …).
    pub fn start(kubeconfig: &Path, dir: &Path, name: &str, args: &[&str]) -> Daemon {
        let log = dir.join(format!("{name}.log"));
        let (healthz, metrics) = (free_port(), free_port());
        let child = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .arg("--lock-file")
            .arg(dir.join("nodeproxy.lock"))
            .args(["--healthz-bind-address", &format!("127.0.0.1:{healthz}")])
            .args(["--metrics-bind-address", &format!("127.0.0.1:{metrics}")])
            .args(["--sync-period", "2s", "--min-sync-period", "100ms"])
            .env("NODEPROXY_LOG", "nodeproxy=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Daemon {
            child,
            log,
            healthz,
            metrics,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for the process to exit, at most [`PATIENCE`].
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the daemon did not exit; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends SIGTERM and requires a clean exit (status 0).
    pub fn sigterm_and_wait(&mut self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = self.wait_exit();
        assert_eq!(status.code(), Some(0), "log:\n{}", self.log());
    }

    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds`, once /metrics answers.
    pub fn last_sync(&self) -> Option<f64> {
        let (_, text) = get(self.metrics, "/metrics")?;
        text.lines()
            .filter(|l| l.starts_with("kubeproxy_sync_proxy_rules_last_timestamp_seconds"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .reduce(f64::max)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- daemon log {} ---\n{}", self.log.display(), self.log());
        }
    }
}
