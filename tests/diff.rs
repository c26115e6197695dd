//! `nodeproxy diff` against the real kernel: after `--once` programmed a cluster, what the diff
//! prints and exits with for the same input, a changed endpoint, an added and a removed Service
//! and a table edited by hand, and that it never changes the kernel nor needs the node lock.
//!
//! Every case runs in a network namespace the test creates (root required; without it the
//! test fails, never skips). Addresses are documentation ranges.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::process::Output;

use common::netns::{in_netns, lock_file_for_this_netns, nft};
use common::scratch::{Scratch, nodeproxy};

/// One Service with two endpoints on this node (so each has a hairpin element).
const CLUSTER: &str = "\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata: {name: node-a}
  spec: {podCIDRs: [198.51.100.0/25]}
  status:
    addresses:
    - {type: InternalIP, address: 192.0.2.11}
- apiVersion: v1
  kind: Service
  metadata: {namespace: shop, name: web}
  spec:
    type: ClusterIP
    clusterIP: 203.0.113.20
    clusterIPs: [203.0.113.20]
    ports:
    - {name: http, protocol: TCP, port: 80, targetPort: 8080}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    namespace: shop
    name: web-abc12
    labels: {kubernetes.io/service-name: web}
  addressType: IPv4
  ports:
  - {name: http, protocol: TCP, port: 8080}
  endpoints:
  - addresses: [198.51.100.10]
    conditions: {ready: true}
    nodeName: node-a
  - addresses: [198.51.100.11]
    conditions: {ready: true}
    nodeName: node-a
";

/// A second Service, appended to [`CLUSTER`]'s items.
const API_SERVICE: &str = "\
- apiVersion: v1
  kind: Service
  metadata: {namespace: shop, name: api}
  spec:
    type: ClusterIP
    clusterIP: 203.0.113.21
    clusterIPs: [203.0.113.21]
    ports:
    - {name: grpc, protocol: TCP, port: 9000, targetPort: 9000}
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    namespace: shop
    name: api-xyz
    labels: {kubernetes.io/service-name: api}
  addressType: IPv4
  ports:
  - {name: grpc, protocol: TCP, port: 9000}
  endpoints:
  - addresses: [198.51.100.20]
    conditions: {ready: true}
    nodeName: node-b
";

const NO_CHANGES: &str = "no changes: the kernel's tables are what a sync would program";

fn stdout(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `nodeproxy diff --from-file FILE` while this test holds the node lock (a running daemon
/// would): diff takes no lock. Checks that the kernel's ruleset is the same afterwards.
fn diff(file: &str, lock: &Path) -> Output {
    let before = nft(&["list", "ruleset"]);
    let guard = hold_lock(lock);
    let out = nodeproxy(&["diff", "--from-file", file], lock);
    drop(guard);
    assert_eq!(
        nft(&["list", "ruleset"]),
        before,
        "diff changed the kernel; stderr:\n{}",
        stderr(&out)
    );
    out
}

/// Takes the node lock, as a running daemon holds it. Retried for a moment: a process that
/// another test's thread forks while we hold the lock keeps its file open, and so the lock,
/// until it execs.
fn hold_lock(lock: &Path) -> nodeproxy::lock::LockGuard {
    for _ in 0..100 {
        match nodeproxy::lock::acquire(lock) {
            Ok(guard) => return guard,
            Err(nodeproxy::lock::LockError::Held { .. }) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("take the lock: {e}"),
        }
    }
    panic!("the lock {} stayed held", lock.display());
}

/// Programs [`CLUSTER`] with `--once` in the current namespace.
fn program(file: &str, lock: &Path) {
    let mut out = nodeproxy(&["--once", "--from-file", file], lock);
    // The lock may still be held for a moment, as in [`hold_lock`].
    for _ in 0..50 {
        if out.status.success() || !stderr(&out).contains("holds the lock") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        out = nodeproxy(&["--once", "--from-file", file], lock);
    }
    assert!(out.status.success(), "--once failed: {}", stderr(&out));
}

/// In a fresh network namespace: programs `programmed` with `--once`, runs `between` (to look
/// at what the kernel holds), then `nodeproxy diff` of `diffed`.
fn program_then_diff(
    programmed: String,
    diffed: String,
    between: impl FnOnce() + Send + 'static,
) -> Output {
    in_netns(move || {
        let lock = lock_file_for_this_netns();
        program(&programmed, &lock);
        between();
        let out = diff(&diffed, &lock);
        let _ = std::fs::remove_file(&lock);
        out
    })
}

fn assert_has(lines: &[String], wanted: &[&str]) {
    for line in wanted {
        assert!(
            lines.iter().any(|l| l == line),
            "missing line {line:?} in:\n{}",
            lines.join("\n")
        );
    }
}

#[test]
fn the_same_input_is_no_change() {
    let scratch = Scratch::new("diff", "same");
    let cluster = scratch.file("cluster.yaml", CLUSTER);
    let out = program_then_diff(cluster.clone(), cluster, || ());
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out), [NO_CHANGES]);
}

#[test]
fn a_changed_endpoint_is_shown_under_its_service() {
    let scratch = Scratch::new("diff", "endpoint");
    let cluster = scratch.file("cluster.yaml", CLUSTER);
    let moved = scratch.file(
        "moved.yaml",
        &CLUSTER.replace("[198.51.100.11]", "[198.51.100.12]"),
    );
    let out = program_then_diff(cluster, moved, || ());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        [
            "Service shop/web",
            "  - element ip nodeproxy hairpin-connections { 198.51.100.11 . 198.51.100.11 . tcp . 8080 }",
            "  + element ip nodeproxy hairpin-connections { 198.51.100.12 . 198.51.100.12 . tcp . 8080 }",
            "  ~ element ip nodeproxy pick-2-endpoints { 203.0.113.20 . tcp . 80 . 1 : 198.51.100.12 . 8080 } (was : 198.51.100.11 . 8080)",
            "",
            "summary: 1 Service(s) changed; element(s) 1 added, 1 removed, 1 changed",
        ]
    );
}

#[test]
fn an_added_service_is_all_additions() {
    let scratch = Scratch::new("diff", "added");
    let cluster = scratch.file("cluster.yaml", CLUSTER);
    let more = scratch.file("more.yaml", &format!("{CLUSTER}{API_SERVICE}"));
    let out = program_then_diff(cluster, more, || ());
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let lines = stdout(&out);
    assert_eq!(
        lines,
        [
            "Service shop/api",
            "  + element ip nodeproxy cluster-ips { 203.0.113.21 }",
            "  + element ip nodeproxy pick-1-endpoints { 203.0.113.21 . tcp . 9000 . 0 : 198.51.100.20 . 9000 }",
            "  + element ip nodeproxy service-ips { 203.0.113.21 . tcp . 9000 : goto pick-1 }",
            "",
            "Shared objects (no single Service)",
            "  + chain ip nodeproxy pick-1 with 1 rule(s)",
            "  + map ip nodeproxy pick-1-endpoints",
            "",
            "summary: 1 Service(s) and shared objects changed; chain(s) 1 added, 0 removed, 0 \
             changed; set(s) and map(s) 1 added, 0 removed, 0 changed; element(s) 3 added, 0 \
             removed, 0 changed",
        ],
    );
}

#[test]
fn a_removed_services_endpoint_elements_are_named_by_their_key() {
    // The kernel holds endpoints maps' elements without a comment: the diff finds their Service
    // through the Service-level element whose key begins theirs.
    let scratch = Scratch::new("diff", "removed");
    let more = scratch.file("more.yaml", &format!("{CLUSTER}{API_SERVICE}"));
    let cluster = scratch.file("cluster.yaml", CLUSTER);
    let out = program_then_diff(more, cluster, || {
        let listed = nft(&["list", "map", "ip", "nodeproxy", "pick-1-endpoints"]);
        assert!(
            listed.contains("203.0.113.21 . tcp . 9000 . 0 : 198.51.100.20 . 9000"),
            "{listed}"
        );
        assert!(!listed.contains("comment \"shop/"), "{listed}");
    });
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(
        stdout(&out),
        [
            "Service shop/api",
            "  - element ip nodeproxy cluster-ips { 203.0.113.21 }",
            "  - element ip nodeproxy pick-1-endpoints { 203.0.113.21 . tcp . 9000 . 0 : 198.51.100.20 . 9000 }",
            "  - element ip nodeproxy service-ips { 203.0.113.21 . tcp . 9000 : goto pick-1 }",
            "",
            "Shared objects (no single Service)",
            "  - chain ip nodeproxy pick-1",
            "  - map ip nodeproxy pick-1-endpoints",
            "",
            "summary: 1 Service(s) and shared objects changed; chain(s) 0 added, 1 removed, 0 \
             changed; set(s) and map(s) 0 added, 1 removed, 0 changed; element(s) 0 added, 3 \
             removed, 0 changed",
        ],
    );
}

#[test]
fn a_table_edited_by_hand_shows_its_repair() {
    let scratch = Scratch::new("diff", "edited");
    let cluster = scratch.file("cluster.yaml", CLUSTER);
    let (edited, repaired) = in_netns(move || {
        let lock = lock_file_for_this_netns();
        program(&cluster, &lock);
        nft(&[
            "delete",
            "element",
            "ip",
            "nodeproxy",
            "cluster-ips",
            "{",
            "203.0.113.20",
            "}",
        ]);
        // The chain's last rule: the NodePort dispatch.
        let listing = nft(&["-a", "list", "chain", "ip", "nodeproxy", "services"]);
        let handle = listing
            .lines()
            .filter_map(|l| l.rsplit_once("# handle ").map(|(_, h)| h.trim().to_owned()))
            .next_back()
            .unwrap();
        nft(&[
            "delete",
            "rule",
            "ip",
            "nodeproxy",
            "services",
            "handle",
            &handle,
        ]);
        let edited = diff(&cluster, &lock);
        // What the diff showed is what a sync repairs: afterwards there is nothing left.
        program(&cluster, &lock);
        let repaired = diff(&cluster, &lock);
        let _ = std::fs::remove_file(&lock);
        (edited, repaired)
    });
    assert_eq!(edited.status.code(), Some(1), "{}", stderr(&edited));
    assert_eq!(
        stdout(&edited),
        [
            "Service shop/web",
            "  + element ip nodeproxy cluster-ips { 203.0.113.20 }",
            "",
            "Shared objects (no single Service)",
            "  ~ chain ip nodeproxy services: rules rewritten (1 rule(s) added, 0 removed; 2 -> 3 rules)",
            "",
            "summary: 1 Service(s) and shared objects changed; chain(s) 0 added, 0 removed, 1 \
             changed; element(s) 1 added, 0 removed, 0 changed",
        ]
    );
    assert_eq!(repaired.status.code(), Some(0), "{}", stderr(&repaired));
    assert_eq!(stdout(&repaired), [NO_CHANGES]);
}

#[test]
fn a_kernel_without_our_tables_gets_everything_added() {
    let scratch = Scratch::new("diff", "fresh");
    let cluster = scratch.file("cluster.yaml", CLUSTER);
    let (out, tables) = in_netns(move || {
        let lock = lock_file_for_this_netns();
        let out = diff(&cluster, &lock);
        let _ = std::fs::remove_file(&lock);
        (out, nft(&["list", "tables"]))
    });
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(tables.trim().is_empty(), "diff created tables:\n{tables}");
    let lines = stdout(&out);
    assert_has(
        &lines,
        &[
            "Service shop/web",
            "  + element ip nodeproxy cluster-ips { 203.0.113.20 }",
            "  + element ip nodeproxy service-ips { 203.0.113.20 . tcp . 80 : goto pick-2 }",
            "Shared objects (no single Service)",
            "  + table ip nodeproxy",
            "  + table ip6 nodeproxy",
            "  + chain ip nodeproxy services with 3 rule(s)",
            "  + map ip nodeproxy service-ips",
        ],
    );
    let signs: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("  ") && !l.starts_with("  + "))
        .collect();
    assert!(signs.is_empty(), "not all additions: {signs:#?}");
    assert!(
        lines
            .last()
            .unwrap()
            .starts_with("summary: 1 Service(s) and shared objects changed; table(s) 2 added,"),
        "{lines:#?}"
    );
}

#[test]
fn errors_exit_2_and_print_no_report() {
    let scratch = Scratch::new("diff", "errors");
    let unreadable = scratch.0.join("unreadable.yaml");
    // A directory where a file is expected: unreadable even for root.
    std::fs::create_dir_all(&unreadable).unwrap();
    let unreadable = unreadable.to_string_lossy().into_owned();
    let missing = scratch
        .0
        .join("missing.yaml")
        .to_string_lossy()
        .into_owned();
    let empty = scratch.file("empty.yaml", "");
    let cluster = scratch.file("cluster.yaml", CLUSTER);
    let outs = in_netns(move || {
        let lock = lock_file_for_this_netns();
        let outs = [
            ("unreadable", diff(&unreadable, &lock)),
            ("missing", diff(&missing, &lock)),
            ("empty", diff(&empty, &lock)),
            (
                "after --once",
                nodeproxy(&["--once", "diff", "--from-file", &cluster], &lock),
            ),
        ];
        let _ = std::fs::remove_file(&lock);
        outs
    });
    for (case, out) in &outs {
        assert_eq!(out.status.code(), Some(2), "{case}: {}", stderr(out));
        assert!(stdout(out).is_empty(), "{case}: {:?}", stdout(out));
    }
    let [unreadable, missing, empty, combined] = &outs;
    assert!(
        stderr(&unreadable.1).contains("unreadable.yaml"),
        "{}",
        stderr(&unreadable.1)
    );
    assert!(
        stderr(&missing.1).contains("missing.yaml: cannot read"),
        "{}",
        stderr(&missing.1)
    );
    assert!(
        stderr(&empty.1).contains("found no usable Service")
            && stderr(&empty.1).contains("--allow-empty"),
        "{}",
        stderr(&empty.1)
    );
    assert!(
        stderr(&combined.1).contains("`diff` cannot be combined with"),
        "{}",
        stderr(&combined.1)
    );
}
