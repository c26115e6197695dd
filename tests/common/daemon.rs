//! The nodeproxy binary as a daemon in tests: a per-test lock file, health and metrics ports and
//! short sync periods; killed on drop, with its log printed when the test failed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Every wait on the daemon is bounded by this.
pub const PATIENCE: Duration = Duration::from_secs(20);
/// The bound of [`wait_for`]: the end-to-end waits include a daemon's start and first sync.
pub const DEADLINE: Duration = Duration::from_secs(45);

/// Polls `probe` until it returns `Ok`, and returns that value. At [`DEADLINE`] the test fails
/// with `what` and the last thing `probe` saw.
pub fn wait_for<T, E: std::fmt::Debug>(what: &str, mut probe: impl FnMut() -> Result<T, E>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let last = match probe() {
            Ok(v) => return v,
            Err(e) => e,
        };
        assert!(
            Instant::now() < deadline,
            "timed out after {DEADLINE:?} waiting until {what}; last seen: {last:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

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
    let r = http_get(SocketAddr::from(([127, 0, 0, 1], port)), path).ok()?;
    Some((r.code, r.body))
}

/// An HTTP answer: status code, headers (names lowercased) and body.
#[derive(Debug)]
pub struct HttpAnswer {
    pub code: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpAnswer {
    /// The value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A GET on `addr` from the calling thread's network namespace. An I/O error (e.g.
/// `ConnectionRefused`) is returned as is; an answer that is not HTTP is `InvalidData`.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<HttpAnswer> {
    use std::io::{Error, ErrorKind};
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let bad = || {
        Error::new(
            ErrorKind::InvalidData,
            format!("not an HTTP answer: {text:?}"),
        )
    };
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(bad)?;
    let mut lines = head.split("\r\n");
    let code = lines
        .next()
        .and_then(|status| status.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(bad)?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(HttpAnswer {
        code,
        headers,
        body: body.to_owned(),
    })
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
        Daemon::start_with_env(kubeconfig, dir, name, args, &[])
    }

    /// [`Daemon::start`] with extra environment variables.
    pub fn start_with_env(
        kubeconfig: &Path,
        dir: &Path,
        name: &str,
        args: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Daemon {
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
            .envs(env.iter().copied())
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
