//! The real binary as a daemon against the fake API server, each test in its own network
//! namespace: nothing is programmed before the watches have listed, changes reach the kernel,
//! an API outage changes nothing, drift is repaired, one instance per lock file, SIGTERM leaves
//! the rules, the health and metrics endpoints answer, and the tables are owned by the running
//! daemon (nftables table ownership): other processes cannot change them, they outlive it, and
//! the next daemon takes them over.
//!
//! The test thread enters a new network namespace, starts the fake API on its loopback, and
//! spawns the binary, which inherits the namespace: the kernel state every test looks at is its
//! own, and tests run in parallel.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod fakeapi;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::daemon::{Daemon, PATIENCE, get};
use common::netns::{in_netns, strip_ownership};
use fakeapi::{FakeApi, Kind, node, service, slice};
use nodeproxy::model::IpFamily;
use nodeproxy::nft::NetlinkKernel;
use nodeproxy::nft::owner::TableInfo;
use nodeproxy::nft::uapi::{TABLE_F_OWNED, TABLE_F_PERSIST};

const NODE: &str = "node-a";
const SYNC_PERIOD: Duration = Duration::from_secs(2);

/// A test's namespace: loopback up, a runtime for the fake API, a scratch directory.
struct Env {
    rt: tokio::runtime::Runtime,
    api: FakeApi,
    dir: PathBuf,
}

impl Env {
    /// Must run on the namespace's thread (see [`in_netns`]).
    fn new(test: &str) -> Env {
        let out = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .output()
            .unwrap();
        assert!(out.status.success(), "ip link set lo up: {out:?}");
        // Worker threads are created here, so they live in the namespace too.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let api = rt.block_on(FakeApi::start());
        let dir = std::env::temp_dir().join(format!(
            "nodeproxy-daemon-test-{}-{test}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Env { rt, api, dir }
    }

    /// The objects every test starts from: one Service with one endpoint, and our Node.
    fn populate(&self) {
        self.api.apply(Kind::Node, node(NODE, "192.0.2.10"));
        self.api
            .apply(Kind::Service, service("ns", "web", "10.96.0.10", 81));
        self.api.apply(
            Kind::EndpointSlice,
            slice("ns", "web-1", "web", &["10.244.0.5"], 9376),
        );
    }

    fn start(&self, name: &str) -> Daemon {
        Daemon::start(
            self.api.kubeconfig(),
            &self.dir,
            name,
            &["--hostname-override", NODE],
        )
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The child's exit status, or `None` (the child killed and reaped) when it is still running
/// after [`PATIENCE`].
fn exit_within_patience(child: &mut std::process::Child) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `nft list table ip nodeproxy`, or `None` when the table does not exist.
fn table() -> Option<String> {
    let out = Command::new("nft")
        .args(["list", "table", "ip", "nodeproxy"])
        .output()
        .unwrap();
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Polls `cond` until it holds, failing with `what` (and the table) after `limit`.
fn wait_until(what: &str, limit: Duration, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}; table:\n{}",
            table().unwrap_or_else(|| "(none)".into())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn table_has(text: &str) -> bool {
    table().is_some_and(|t| t.contains(text))
}

/// Both families' table headers as the kernel reports them to a third socket.
fn headers() -> Vec<Option<TableInfo>> {
    let mut k = NetlinkKernel::new().unwrap();
    IpFamily::ALL
        .iter()
        .map(|&f| k.table_info(f, "nodeproxy").unwrap())
        .collect()
}

/// `nft <args>` from another process: (success, stderr).
fn nft_try(args: &[&str]) -> (bool, String) {
    let out = Command::new("nft").args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `nodeproxy --cleanup` with the test's lock file: (exit code, stderr).
fn cleanup(env: &Env) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .arg("--cleanup")
        .arg("--lock-file")
        .arg(env.dir.join("nodeproxy.lock"))
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn programs_only_once_the_watches_listed_then_follows_changes() {
    in_netns(|| {
        let env = Env::new("follow");
        env.populate();
        env.api.hold(Kind::EndpointSlice);
        let d = env.start("daemon");
        // The Services and the Node are listed, the slices are not: nothing may be written.
        wait_until("the Service list was served", PATIENCE, || {
            env.api.count(Kind::Service, false) > 0
        });
        std::thread::sleep(Duration::from_secs(1));
        assert!(
            table().is_none(),
            "a table was programmed before the watches were ready"
        );
        // kube-proxy's semantics: healthy until a queued change is older than the health
        // timeout, but never synced (Go's zero time) until the first sync.
        let (_, body) = get(d.healthz, "/healthz").expect("healthz answers before the first sync");
        assert!(body.contains("0001-01-01T00:00:00Z"), "{body}");

        env.api.release(Kind::EndpointSlice);
        wait_until("the Service is programmed", PATIENCE, || {
            table_has("10.96.0.10") && table_has("10.244.0.5")
        });
        wait_until("/healthz answers 200 with a sync time", PATIENCE, || {
            get(d.healthz, "/healthz")
                .is_some_and(|(c, body)| c == 200 && !body.contains("0001-01-01T00:00:00Z"))
        });
        let (code, body) = get(d.metrics, "/metrics").unwrap();
        assert_eq!(code, 200);
        assert!(
            body.contains("kubeproxy_sync_proxy_rules_duration_seconds"),
            "{body}"
        );

        // Modify the Service's port, the slice's endpoints; add a second Service.
        env.api
            .apply(Kind::Service, service("ns", "web", "10.96.0.10", 82));
        wait_until("the new port is programmed", PATIENCE, || {
            table().is_some_and(|t| t.contains(" 82 ") && !t.contains(" 81 "))
        });
        env.api.apply(
            Kind::EndpointSlice,
            slice("ns", "web-1", "web", &["10.244.0.6", "10.244.0.7"], 9376),
        );
        wait_until("the new endpoints replace the old", PATIENCE, || {
            table().is_some_and(|t| {
                t.contains("10.244.0.6") && t.contains("10.244.0.7") && !t.contains("10.244.0.5")
            })
        });
        env.api
            .apply(Kind::Service, service("ns", "db", "10.96.0.20", 5432));
        wait_until("the second Service is programmed", PATIENCE, || {
            table_has("10.96.0.20")
        });

        // Deletes.
        env.api.delete(Kind::EndpointSlice, "ns", "web-1");
        wait_until("the endpoints are gone", PATIENCE, || {
            table().is_some_and(|t| !t.contains("10.244.0.6"))
        });
        env.api.delete(Kind::Service, "ns", "web");
        wait_until("the Service is gone", PATIENCE, || {
            table().is_some_and(|t| !t.contains("10.96.0.10") && t.contains("10.96.0.20"))
        });
        drop(d);
        drop(env);
    });
}

#[test]
fn api_outage_changes_nothing_and_drift_is_repaired() {
    in_netns(|| {
        let env = Env::new("outage");
        env.populate();
        // A table without ownership, as a nodeproxy that predates it leaves one (or as on a
        // kernel without ownership): the kernel cannot hand it to the daemon, so others can
        // still change it and drift repair is what keeps it right.
        common::netns::nft(&[
            "add",
            "table",
            "ip",
            "nodeproxy",
            "{ comment \"rules for nodeproxy\"; }",
        ]);
        let d = env.start("daemon");
        wait_until("the Service is programmed", PATIENCE, || {
            table_has("10.96.0.10")
        });
        let before = table().unwrap();

        env.api.go_down();
        // Several sync periods, each a verification against the last good state.
        std::thread::sleep(SYNC_PERIOD * 3);
        assert_eq!(
            table().as_deref(),
            Some(before.as_str()),
            "rules changed while the API server was down"
        );

        assert!(
            d.log().contains("exists without ownership flags"),
            "the unowned table was not reported:\n{}",
            d.log()
        );
        assert_eq!(headers()[0].map(|h| h.flags), Some(0));

        // Someone deletes our table: repaired within one sync period (plus the sync itself).
        common::netns::nft(&["delete", "table", "ip", "nodeproxy"]);
        assert!(table().is_none());
        wait_until(
            "the deleted table is back",
            SYNC_PERIOD + Duration::from_secs(2),
            || table_has("10.96.0.10"),
        );
        // The same rules, and now the table is created owned by the daemon.
        assert_eq!(table().map(|t| strip_ownership(&t)), Some(before.clone()));
        assert_eq!(headers()[0].map(|h| h.flags), Some(TABLE_F_OWNED));
        wait_until("the repair is counted", PATIENCE, || {
            get(d.metrics, "/metrics").is_some_and(|(_, b)| {
                b.contains("nodeproxy_drift_repairs_total{ip_family=\"IPv4\"} 1")
            })
        });

        // The API comes back, and changes flow again.
        env.rt.block_on(env.api.come_back());
        env.api
            .apply(Kind::Service, service("ns", "db", "10.96.0.20", 5432));
        wait_until("a change after the outage is programmed", PATIENCE, || {
            table_has("10.96.0.20")
        });
        drop(d);
        drop(env);
    });
}

#[test]
fn a_second_instance_exits_1_naming_the_holder() {
    in_netns(|| {
        let env = Env::new("lock");
        env.populate();
        let first = env.start("first");
        wait_until("the first instance programmed", PATIENCE, || {
            table_has("10.96.0.10")
        });
        let mut second = env.start("second");
        let status = second.wait_exit();
        assert_eq!(status.code(), Some(1), "log:\n{}", second.log());
        let log = second.log();
        assert!(
            log.contains(&format!("pid {}", first.pid())),
            "the error does not name the holder's pid {}:\n{log}",
            first.pid()
        );
        drop(second);
        drop(first);
        drop(env);
    });
}

#[test]
fn sigterm_exits_0_and_leaves_the_rules() {
    in_netns(|| {
        let env = Env::new("sigterm");
        env.populate();
        let mut d = env.start("daemon");
        wait_until("the Service is programmed", PATIENCE, || {
            table_has("10.96.0.10")
        });
        let before = table().unwrap();
        let sent = Command::new("kill")
            .args(["-TERM", &d.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = d.wait_exit();
        assert_eq!(status.code(), Some(0), "log:\n{}", d.log());
        // The same rules; no longer owned by anyone (an orphan, see the ownership test).
        assert_eq!(
            table().map(|t| strip_ownership(&t)),
            Some(strip_ownership(&before))
        );
        drop(d);
        drop(env);
    });
}

#[test]
fn dry_run_without_files_reads_the_api_server() {
    in_netns(|| {
        let env = Env::new("dryrun");
        env.populate();
        let out_path = env.dir.join("dry-run.out");
        let mut child = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
            .arg("--dry-run")
            .arg("--kubeconfig")
            .arg(env.api.kubeconfig())
            .args(["--hostname-override", NODE])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out_path).unwrap())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = exit_within_patience(&mut child)
            .unwrap_or_else(|| panic!("--dry-run against the API server did not exit"));
        assert!(status.success(), "{status:?}");
        let printed = std::fs::read_to_string(&out_path).unwrap();
        assert!(printed.contains("table ip nodeproxy"), "{printed}");
        assert!(printed.contains("10.96.0.10"), "{printed}");
        assert!(printed.contains("10.244.0.5"), "{printed}");
        assert!(table().is_none(), "--dry-run programmed the kernel");
        drop(env);
    });
}

#[test]
fn the_running_daemon_owns_its_tables_and_the_next_one_takes_them_over() {
    in_netns(|| {
        let env = Env::new("owner");
        env.populate();
        let mut first = env.start("first");
        wait_until("the Service is programmed", PATIENCE, || {
            table_has("10.96.0.10")
        });
        let before = table().unwrap();
        for h in headers() {
            let h = h.expect("both tables exist");
            assert_eq!(h.flags, TABLE_F_OWNED);
            // The daemon's first netlink socket is its nftables socket: port id = pid.
            assert_eq!(h.owner, Some(first.pid()));
        }
        assert!(before.contains("flags owner"), "{before}");
        assert!(
            first.log().contains("our tables are owned by this process"),
            "the ownership mode was not logged:\n{}",
            first.log()
        );

        // Other processes cannot change or delete it.
        let attempts: [&[&str]; 4] = [
            &["delete", "table", "ip", "nodeproxy"],
            &[
                "add",
                "element",
                "ip",
                "nodeproxy",
                "cluster-ips",
                "{ 192.0.2.99 }",
            ],
            &["add", "chain", "ip", "nodeproxy", "intruder"],
            &["flush", "chain", "ip", "nodeproxy", "services"],
        ];
        for args in attempts {
            let (ok, err) = nft_try(args);
            assert!(!ok, "nft {args:?} succeeded on an owned table");
            assert!(
                err.contains("Operation not permitted"),
                "nft {args:?}: {err}"
            );
        }
        // `nft flush ruleset` succeeds but skips tables owned by others.
        let (ok, err) = nft_try(&["flush", "ruleset"]);
        assert!(ok, "{err}");
        assert_eq!(table().as_deref(), Some(before.as_str()));
        assert!(headers().iter().all(Option::is_some), "ip6 table flushed");

        // --cleanup refuses, deletes nothing, and names the daemon.
        let (code, err) = cleanup(&env);
        assert_eq!(code, Some(1), "{err}");
        assert!(err.contains("owned by"), "{err}");
        assert!(err.contains(&format!("pid {}", first.pid())), "{err}");
        assert!(err.contains("nothing was deleted"), "{err}");
        assert_eq!(table().as_deref(), Some(before.as_str()));
        assert!(headers().iter().all(Option::is_some));

        // SIGTERM: the tables stay, with their rules, as orphans.
        first.sigterm_and_wait();
        assert_eq!(
            table().map(|t| strip_ownership(&t)),
            Some(strip_ownership(&before))
        );
        for h in headers() {
            assert_eq!(
                h,
                Some(TableInfo {
                    flags: TABLE_F_PERSIST,
                    owner: None
                })
            );
        }

        // The next daemon takes them over at start, and its first sync changes nothing.
        let second = env.start("second");
        wait_until("the second daemon synced", PATIENCE, || {
            second.last_sync().is_some_and(|t| t > 0.0)
        });
        for h in headers() {
            let h = h.expect("both tables exist");
            assert_eq!((h.flags, h.owner), (TABLE_F_OWNED, Some(second.pid())));
        }
        let log = second.log();
        assert_eq!(log.matches("taken over").count(), 2, "{log}");
        assert!(
            log.contains("full sync") && log.contains("nothing to change"),
            "the first sync after the take-over was not empty:\n{log}"
        );
        assert!(
            !log.contains("change(s))"),
            "the first sync changed the kernel:\n{log}"
        );
        // Same rules, same owner name: the listing is unchanged.
        assert_eq!(table().as_deref(), Some(before.as_str()));
        let (ok, _) = nft_try(&["delete", "table", "ip", "nodeproxy"]);
        assert!(!ok, "the taken-over table can be deleted by others");
        drop(second);

        // Killed: orphans again, which --cleanup removes.
        wait_until("the tables are orphans", PATIENCE, || {
            headers()
                .iter()
                .all(|h| h.is_some_and(|h| h.owner.is_none()))
        });
        let (code, err) = cleanup(&env);
        assert_eq!(code, Some(0), "{err}");
        assert_eq!(headers(), vec![None, None]);
        drop(first);
        drop(env);
    });
}

/// A stand-in for systemd's notification socket: what the daemon sends with `NOTIFY_SOCKET`.
struct NotifySocket {
    sock: std::os::unix::net::UnixDatagram,
    path: PathBuf,
}

impl NotifySocket {
    fn bind(dir: &std::path::Path) -> NotifySocket {
        let path = dir.join("notify.sock");
        let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        NotifySocket { sock, path }
    }

    /// Every message received within `window`, in order.
    fn messages_for(&self, window: Duration) -> Vec<String> {
        let deadline = Instant::now() + window;
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        while Instant::now() < deadline {
            if let Ok(n) = self.sock.recv(&mut buf) {
                out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        out
    }

    /// Messages until one contains `what` (returned last), failing after `limit`.
    fn until(&self, what: &str, limit: Duration) -> Vec<String> {
        let deadline = Instant::now() + limit;
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            for m in self.messages_for(Duration::from_millis(100)) {
                let found = m.contains(what);
                seen.push(m);
                if found {
                    return seen;
                }
            }
        }
        panic!("no {what:?} within {limit:?}; received {seen:?}");
    }
}

fn pings(messages: &[String]) -> usize {
    messages
        .iter()
        .filter(|m| m.lines().any(|l| l == "WATCHDOG=1"))
        .count()
}

#[test]
fn systemd_is_told_ready_only_once_the_rules_are_programmed_then_status_and_stopping() {
    in_netns(|| {
        let env = Env::new("notify");
        env.populate();
        env.api.hold(Kind::EndpointSlice);
        let notify = NotifySocket::bind(&env.dir);
        let mut d = Daemon::start_with_env(
            env.api.kubeconfig(),
            &env.dir,
            "daemon",
            &["--hostname-override", NODE],
            &[
                ("NOTIFY_SOCKET", notify.path.as_os_str()),
                ("WATCHDOG_USEC", std::ffi::OsStr::new("1000000")),
            ],
        );
        // The slices are held: the watches cannot list, nothing is programmed, and READY must
        // not be sent; the watchdog is pinged meanwhile (the writer is not stuck, it waits).
        let before = notify.messages_for(Duration::from_secs(3));
        assert!(
            !before.iter().any(|m| m.contains("READY=1")),
            "READY before the first sync: {before:?}"
        );
        assert!(
            pings(&before) >= 2,
            "watchdog pings while waiting: {before:?}"
        );
        assert!(table().is_none());

        env.api.release(Kind::EndpointSlice);
        let got = notify.until("READY=1", PATIENCE);
        // READY is sent after the transaction: the rules are in the kernel when it arrives.
        assert!(table_has("10.96.0.10") && table_has("10.244.0.5"));
        let ready = got.last().unwrap();
        assert!(
            ready.contains("STATUS=last sync ") && ready.contains("synced 2 table(s)"),
            "{ready}"
        );

        // Each later sync updates STATUS; READY is not repeated.
        env.api.apply(
            Kind::EndpointSlice,
            slice("ns", "web-1", "web", &["10.244.0.6"], 9376),
        );
        let later = notify.until("STATUS=last sync", PATIENCE);
        assert!(!later.iter().any(|m| m.contains("READY=1")), "{later:?}");

        let sent = Command::new("kill")
            .args(["-TERM", &d.pid().to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        notify.until("STOPPING=1", PATIENCE);
        assert_eq!(d.wait_exit().code(), Some(0), "log:\n{}", d.log());
    });
}

#[test]
fn a_hung_writer_stops_the_watchdog_pings() {
    in_netns(|| {
        let env = Env::new("watchdog");
        env.populate();
        let notify = NotifySocket::bind(&env.dir);
        let hang = env.dir.join("hang");
        let d = Daemon::start_with_env(
            env.api.kubeconfig(),
            &env.dir,
            "daemon",
            &["--hostname-override", NODE],
            &[
                ("NOTIFY_SOCKET", notify.path.as_os_str()),
                ("WATCHDOG_USEC", std::ffi::OsStr::new("1000000")),
                (nodeproxy::notify::HANG_WRITER_ENV, hang.as_os_str()),
            ],
        );
        notify.until("READY=1", PATIENCE);
        let healthy = notify.messages_for(Duration::from_secs(2));
        assert!(pings(&healthy) >= 2, "pings while healthy: {healthy:?}");

        // The writer hangs at the start of its next job (the periodic verification, every 2 s,
        // or this change); one watchdog interval later the pings stop.
        std::fs::write(&hang, b"").unwrap();
        env.api.apply(
            Kind::EndpointSlice,
            slice("ns", "web-1", "web", &["10.244.0.6"], 9376),
        );
        wait_until("the writer hangs", PATIENCE, || {
            d.log().contains("the sync thread hangs")
        });
        // Pings sent before the withholding (at most one interval and one tick after the hang)
        // may still wait in the socket: read them away before watching.
        notify.messages_for(Duration::from_secs(2));
        let hung = notify.messages_for(Duration::from_secs(3));
        assert_eq!(pings(&hung), 0, "pings while the writer hangs: {hung:?}");
        assert!(
            d.log().contains("withholding the watchdog ping"),
            "log:\n{}",
            d.log()
        );
    });
}

#[test]
fn a_relist_without_any_service_after_having_some_is_a_warning() {
    in_netns(|| {
        let env = Env::new("emptied");
        env.populate();
        let d = env.start("daemon");
        wait_until("the Service is programmed", PATIENCE, || {
            table_has("10.96.0.10")
        });
        assert!(!d.log().contains("listed no Service at all"), "{}", d.log());
        // Every Service is gone while the daemon is cut off, and the history is compacted: the
        // watch can only relist, and the relist holds nothing.
        env.api.go_down();
        env.api.delete(Kind::Service, "ns", "web");
        env.api.compact();
        env.rt.block_on(env.api.come_back());
        wait_until("the Service's rules are removed", PATIENCE, || {
            !table_has("10.96.0.10")
        });
        let log = d.log();
        let warning = log
            .lines()
            .find(|l| l.contains("listed no Service at all"))
            .unwrap_or_else(|| panic!("no warning in the log:\n{log}"));
        assert!(warning.contains("WARN"), "{warning}");
        assert!(warning.contains("after 1 before"), "{warning}");
    });
}

#[test]
fn an_api_server_never_reached_is_retried_with_a_growing_delay_and_never_called_back() {
    in_netns(|| {
        let env = Env::new("unreachable");
        env.populate();
        env.api.go_down();
        let d = env.start("daemon");
        std::thread::sleep(Duration::from_secs(12));
        let log = d.log();
        assert!(
            !log.contains("reachable again"),
            "the API server was never reachable:\n{log}"
        );
        // One warning when the Service watch first fails, then a debug line per retry. With
        // the delay stuck at its first step (the old behaviour) there were 12 or more retries
        // in 12 s; kube's default backoff (0.8 s doubling, with jitter) allows about 4.
        let retries = log
            .lines()
            .filter(|l| l.contains("Service watch still failing"))
            .count();
        assert!(
            log.contains("lost the API server (Service watch)"),
            "no warning:\n{log}"
        );
        assert!(retries <= 7, "{retries} retries in 12 s:\n{log}");
        // And once it answers, the daemon says so and programs the rules.
        env.rt.block_on(env.api.come_back());
        wait_until("the Service is programmed", Duration::from_secs(60), || {
            table_has("10.96.0.10")
        });
        assert!(d.log().contains("reachable again"), "{}", d.log());
    });
}

#[test]
fn a_service_claiming_another_services_cluster_ip_is_warned_counted_and_kept_out() {
    in_netns(|| {
        let env = Env::new("hijack");
        env.populate();
        let mut thief = service("aaa", "thief", "10.96.0.20", 81);
        thief["spec"]["externalIPs"] = serde_json::json!(["10.96.0.10"]);
        env.api.apply(Kind::Service, thief);
        env.api.apply(
            Kind::EndpointSlice,
            slice("aaa", "thief-1", "thief", &["10.244.0.66"], 9376),
        );
        let d = env.start("daemon");
        wait_until("both Services are programmed", PATIENCE, || {
            table_has("10.244.0.5") && table_has("10.244.0.66")
        });
        let table = table().unwrap_or_default();
        // Element by element (nft may list several on a line). An endpoints map's element
        // carries no comment: its endpoint says whose it is.
        for elem in table
            .split([',', '\n', '{', '}'])
            .filter(|e| e.contains("10.96.0.10 . tcp . 81"))
        {
            let ours = if elem.contains("comment") {
                elem.contains("comment \"ns/web:")
            } else {
                elem.contains(": 10.244.0.5 . ")
            };
            assert!(ours, "the thief holds {elem}");
        }
        wait_until("the conflict is counted", PATIENCE, || {
            get(d.metrics, "/metrics").is_some_and(|(_, text)| {
                text.lines()
                    .any(|l| l == "nodeproxy_service_address_conflicts 1")
            })
        });
        let log = d.log();
        assert_eq!(
            log.matches("Service aaa/thief claims externalIP 10.96.0.10:81/tcp")
                .count(),
            1,
            "{log}"
        );
    });
}

#[test]
fn bind_address_hard_fail_ends_the_daemon_when_its_health_port_is_taken() {
    in_netns(|| {
        let env = Env::new("hardfail");
        env.populate();
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let log = env.dir.join("hardfail.log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
            .arg("--kubeconfig")
            .arg(env.api.kubeconfig())
            .args(["--hostname-override", NODE, "--bind-address-hard-fail"])
            .arg("--lock-file")
            .arg(env.dir.join("nodeproxy.lock"))
            .args(["--healthz-bind-address", &format!("127.0.0.1:{port}")])
            .args(["--metrics-bind-address", ""])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let status = exit_within_patience(&mut child).unwrap_or_else(|| {
            panic!(
                "still running with its health port taken:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(status.code(), Some(1), "{text}");
        assert!(
            text.contains("healthz server (--bind-address-hard-fail)")
                && text.contains(&format!("127.0.0.1:{port}")),
            "{text}"
        );
        assert_eq!(
            table(),
            None,
            "nothing is programmed before the servers are up"
        );
        drop(taken);
        drop(env);
    });
}
