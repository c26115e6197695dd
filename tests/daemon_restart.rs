//! Restarting the daemon under live traffic: the namespace lab (`tests/lab`) with three pod
//! endpoints behind a ClientIP-affinity Service, the fake API server (`tests/fakeapi`) running
//! inside node-a's namespace, and the real binary as node-a's daemon.
//!
//! A long-lived TCP connection through the ClusterIP and pinned affinity clients must survive
//! SIGTERM of the first daemon and the start of a second one (same lock file), and the second
//! daemon's first sync must change nothing in the kernel.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod fakeapi;
mod lab;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::daemon::{Daemon, PATIENCE};
use fakeapi::{FakeApi, Kind};
use lab::{Lab, Ns, Proto};
use serde_json::json;

const CLUSTER_CIDR: &str = "198.51.100.0/24,2001:db8:a::/47";
const CLUSTER_IP: &str = "203.0.113.60";
const NODE_PORT: u16 = 30100;
const DAEMON_ARGS: &[&str] = &[
    "--hostname-override",
    "node-a",
    "--cluster-cidr",
    CLUSTER_CIDR,
];

/// Echo servers on port 8080 of the three pods: the first line is `<name> <peer>` (what
/// [`Lab::request`] reads), then every line received comes back as `<name> <line>`.
fn spawn_echo_servers(lab: &Lab) -> Vec<Child> {
    let mut children = Vec::new();
    for (ns, name) in [(Ns::PodA1, "a1"), (Ns::PodA2, "a2"), (Ns::PodB1, "b1")] {
        let reply =
            format!("SYSTEM:echo {name} $SOCAT_PEERADDR; while read l; do echo {name} $l; done");
        let child = Command::new("ip")
            .args(["netns", "exec", &lab.ns(ns), "socat"])
            .args(["TCP4-LISTEN:8080,fork,reuseaddr", &reply])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        children.push(child);
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let out = lab.exec(ns, &["ss", "-Hltn", "sport = :8080"]);
            if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "no listener in {}", lab.ns(ns));
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    children
}

/// Moves the calling thread into the lab namespace `name` (a `/run/netns` entry).
fn enter(name: &str) {
    let f = std::fs::File::open(Path::new("/run/netns").join(name)).unwrap();
    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
}

/// A TCP connection held open by a socat client: each exchange sends a line and reads the
/// server's echo.
struct LongConn {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl LongConn {
    fn open(lab: &Lab, from: Ns, addr: &str, port: u16) -> (LongConn, String) {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &lab.ns(from),
                "socat",
                "-T",
                "120",
                "STDIO",
            ])
            .arg(format!("TCP4:{addr}:{port},connect-timeout=2"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut conn = LongConn {
            child,
            stdin,
            lines,
        };
        let greeting = conn.next_line();
        let name = greeting.split_whitespace().next().unwrap().to_owned();
        (conn, name)
    }

    fn next_line(&mut self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(3))
            .unwrap_or_else(|e| panic!("the long-lived connection did not answer: {e}"))
    }

    /// Sends `word`, returns the answering server's name.
    fn exchange(&mut self, word: &str) -> String {
        writeln!(self.stdin, "{word}").unwrap();
        self.stdin.flush().unwrap();
        let line = self.next_line();
        let (name, echoed) = line.split_once(' ').unwrap();
        assert_eq!(echoed, word, "{line}");
        name.to_owned()
    }
}

impl Drop for LongConn {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every answer from `count` new connections; all must succeed.
fn answers(lab: &Lab, from: Ns, addr: IpAddr, port: u16, count: usize) -> BTreeSet<String> {
    (0..count)
        .map(|i| match lab.request(from, Proto::Tcp, addr, port) {
            Ok((name, _)) => name,
            Err(e) => panic!(
                "request {i} from {} to {addr}:{port} failed: {e}\n{}",
                from.role(),
                lab.ruleset(Ns::NodeA)
            ),
        })
        .collect()
}

/// node-a's ruleset without what time changes by itself: the remaining lifetime of dynamic
/// (affinity) set elements; and without the seal, which a daemon rewrites as it exits.
fn ruleset_now() -> String {
    let out = Command::new("nft")
        .args(["list", "ruleset"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let full = String::from_utf8_lossy(&out.stdout);
    let mut text = String::new();
    let mut in_seal = false;
    for line in full.lines() {
        in_seal |= line == "table ip nodeproxy-seal {";
        if !in_seal {
            text.push_str(line);
            text.push('\n');
        }
        in_seal &= line != "}";
    }
    let mut clean = String::new();
    let mut words = text.split(' ');
    while let Some(w) = words.next() {
        if w == "expires" {
            // Drop the duration, but keep a separator it carried (`,` or a newline).
            let d = words.next().unwrap_or_default();
            clean.push_str("expires ");
            clean.push_str(d.trim_start_matches(|c: char| c.is_ascii_alphanumeric() || c == '.'));
            clean.push(' ');
        } else {
            clean.push_str(w);
            clean.push(' ');
        }
    }
    clean
}

fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn populate(api: &FakeApi) {
    for (name, ip, cidr) in [
        ("node-a", "192.0.2.11", "198.51.100.0/25"),
        ("node-b", "192.0.2.12", "198.51.100.128/25"),
    ] {
        api.apply(
            Kind::Node,
            json!({"metadata": {"name": name},
                   "spec": {"podCIDRs": [cidr]},
                   "status": {"addresses": [{"type": "InternalIP", "address": ip}]}}),
        );
    }
    api.apply(
        Kind::Service,
        json!({"metadata": {"namespace": "default", "name": "sticky"},
               "spec": {"type": "NodePort", "clusterIP": CLUSTER_IP, "clusterIPs": [CLUSTER_IP],
                        "sessionAffinity": "ClientIP",
                        "ports": [{"name": "http", "protocol": "TCP", "port": 80,
                                   "targetPort": 8080, "nodePort": NODE_PORT}]}}),
    );
    let ep = |addr: &str, node: &str| json!({"addresses": [addr], "conditions": {"ready": true}, "nodeName": node});
    api.apply(
        Kind::EndpointSlice,
        json!({"metadata": {"namespace": "default", "name": "sticky-1",
                            "labels": {"kubernetes.io/service-name": "sticky"}},
               "addressType": "IPv4",
               "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
               "endpoints": [ep("198.51.100.10", "node-a"), ep("198.51.100.11", "node-a"),
                             ep("198.51.100.130", "node-b")]}),
    );
}

#[test]
fn restart_under_traffic_keeps_connections_and_affinity_and_changes_nothing() {
    let lab = Lab::new();
    let _servers = spawn_echo_servers(&lab);
    let node_a = lab.ns(Ns::NodeA);
    let dir = std::env::temp_dir().join(format!("nodeproxy-restart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                // From here on this thread, the fake API's runtime threads and every process it
                // spawns are in node-a's namespace.
                enter(&node_a);
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .unwrap();
                let api = rt.block_on(FakeApi::start());
                populate(&api);

                let mut first = Daemon::start(api.kubeconfig(), &dir, "first", DAEMON_ARGS);
                wait_until("the first daemon synced", || {
                    first.last_sync().is_some_and(|t| t > 0.0)
                });
                let cluster_ip: IpAddr = CLUSTER_IP.parse().unwrap();
                let node_port_addr = Ns::NodeA.addr(false);

                // The long-lived connection, and two affinity clients pinned.
                let (mut conn, conn_name) = LongConn::open(&lab, Ns::NodeA, CLUSTER_IP, 80);
                assert_eq!(conn.exchange("before"), conn_name);
                let local = answers(&lab, Ns::NodeA, cluster_ip, 80, 5);
                assert_eq!(
                    local,
                    BTreeSet::from([conn_name.clone()]),
                    "node-a → ClusterIP not pinned to the long-lived connection's endpoint"
                );
                let remote = answers(&lab, Ns::Client, node_port_addr, NODE_PORT, 5);
                assert_eq!(remote.len(), 1, "client → NodePort not pinned: {remote:?}");
                let before = ruleset_now();

                first.sigterm_and_wait();
                // Between the two daemons: the rules stayed, traffic flows.
                assert_eq!(conn.exchange("between"), conn_name);

                let second = Daemon::start(api.kubeconfig(), &dir, "second", DAEMON_ARGS);
                wait_until("the second daemon synced", || {
                    second.last_sync().is_some_and(|t| t > 0.0)
                });
                assert!(
                    first.log().contains("sealed our tables for the next start"),
                    "the first daemon did not seal its tables as it exited:\n{}",
                    first.log()
                );
                let log = second.log();
                assert!(
                    log.contains("adopted 2 table(s) on the previous process's seal"),
                    "the second daemon read its tables back despite the seal:\n{log}"
                );
                assert!(
                    log.contains("full sync")
                        && log.contains(
                            "0 element(s) added, 0 removed, 0 chain(s) rewritten; 0 message(s)"
                        )
                        && log.contains("nothing to change"),
                    "the second daemon's first sync did not report `nothing to change`:\n{log}"
                );
                assert!(
                    !log.contains("change(s))"),
                    "the second daemon's first sync changed the kernel:\n{log}"
                );
                assert_eq!(
                    ruleset_now(),
                    before,
                    "the second daemon changed the ruleset"
                );

                assert_eq!(conn.exchange("after"), conn_name);
                assert_eq!(
                    answers(&lab, Ns::NodeA, cluster_ip, 80, 5),
                    local,
                    "node-a's affinity pin was lost"
                );
                assert_eq!(
                    answers(&lab, Ns::Client, node_port_addr, NODE_PORT, 5),
                    remote,
                    "the client's affinity pin was lost"
                );
                drop(conn);
                drop(second);
                drop(first);
                drop(api);
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
    });
    let _ = std::fs::remove_dir_all(&dir);
}
