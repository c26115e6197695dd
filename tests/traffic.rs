//! Traffic tests: nodeproxy programs two node namespaces of the lab and real TCP/UDP clients
//! check who answers and which source address the server saw.
//!
//! Both nodes run `nodeproxy --once` with the same fixtures (`tests/fixtures/traffic/`) and
//! their own `--hostname-override`, as two kube-proxies in one cluster would.

// The helpers below are test code: a failed precondition must panic to fail the test.
#![allow(clippy::panic, clippy::expect_used, clippy::unwrap_used)]

mod lab;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use lab::{Lab, Ns, Proto, describe};

const NODEPROXY: &str = env!("CARGO_BIN_EXE_nodeproxy");

/// Both families' pod ranges. The IPv6 pod CIDRs 2001:db8:a::/64 and 2001:db8:b::/64 differ in
/// the last bit of the third group, so /47 is the prefix that holds both nodes' pods.
const CLUSTER_CIDR: &str = "198.51.100.0/24,2001:db8:a::/47";

/// Requests per load-balancing check: the chance that one of two endpoints is never picked by
/// uniform random choice is 2 * 2^-20.
const SPREAD_REQUESTS: usize = 20;

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/traffic/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// Runs `nodeproxy` inside a node namespace (bounded, so a hang fails instead of blocking).
fn nodeproxy(lab: &Lab, node: Ns, args: &[&str]) -> std::process::Output {
    let mut full = vec!["timeout", "30", NODEPROXY];
    full.extend_from_slice(args);
    lab.exec(node, &full)
}

/// Programs one node once from the fixtures, and fails the test unless nodeproxy exits 0.
fn program_node(lab: &Lab, node: Ns, fixtures: &[&str], extra: &[&str]) {
    let paths: Vec<String> = std::iter::once("nodes.yaml")
        .chain(fixtures.iter().copied())
        .map(fixture)
        .collect();
    let mut args = vec![
        "--once",
        "--hostname-override",
        node.role(),
        "--cluster-cidr",
        CLUSTER_CIDR,
    ];
    for path in &paths {
        args.extend(["--from-file", path.as_str()]);
    }
    args.extend_from_slice(extra);
    let out = nodeproxy(lab, node, &args);
    assert!(
        out.status.success(),
        "nodeproxy {args:?} on {} failed: {}",
        node.role(),
        describe(&out)
    );
}

/// Programs both nodes from the same fixtures, each with its own hostname.
fn program(lab: &Lab, fixtures: &[&str]) {
    for node in [Ns::NodeA, Ns::NodeB] {
        program_node(lab, node, fixtures, &[]);
    }
}

/// The rulesets of both nodes, appended to failure messages so a failing run explains itself.
fn rulesets(lab: &Lab) -> String {
    format!(
        "\n=== nft list ruleset on node-a ===\n{}\n=== nft list ruleset on node-b ===\n{}",
        lab.ruleset(Ns::NodeA),
        lab.ruleset(Ns::NodeB)
    )
}

/// Sends `count` requests and returns the set of servers that answered; fails the test if any
/// request fails or a server saw another source than `expected_peer`.
fn spread(
    lab: &Lab,
    from: Ns,
    proto: Proto,
    addr: IpAddr,
    port: u16,
    count: usize,
    expected_peer: IpAddr,
) -> BTreeSet<String> {
    let target = SocketAddr::new(addr, port);
    let mut answered = BTreeSet::new();
    for i in 0..count {
        match lab.request(from, proto, addr, port) {
            Ok((name, peer)) => {
                assert_eq!(
                    peer,
                    expected_peer.to_string(),
                    "request {i} from {} to {target}/{proto:?} answered by {name}: the server \
                     saw source {peer}, expected {expected_peer}{}",
                    from.role(),
                    rulesets(lab)
                );
                answered.insert(name);
            }
            Err(e) => panic!(
                "request {i} from {} to {target}/{proto:?} failed: {e}{}",
                from.role(),
                rulesets(lab)
            ),
        }
    }
    answered
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("valid IP literal")
}

#[test]
fn a_pod_reaches_cluster_ip_endpoints_on_both_nodes_and_keeps_its_source_ip() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    program(&lab, &["web.yaml"]);
    let answered = spread(
        &lab,
        Ns::PodA1,
        Proto::Tcp,
        ip("203.0.113.10"),
        80,
        SPREAD_REQUESTS,
        Ns::PodA1.addr(false),
    );
    assert_eq!(answered, names(&["a2", "b1"]), "{}", rulesets(&lab));
}

#[test]
fn a_node_reaches_a_cluster_ip_and_the_server_sees_the_node_address() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    program(&lab, &["web.yaml"]);
    let answered = spread(
        &lab,
        Ns::NodeA,
        Proto::Tcp,
        ip("203.0.113.10"),
        80,
        10,
        Ns::NodeA.addr(false),
    );
    assert!(!answered.is_empty());
}

#[test]
fn a_pod_reaching_itself_through_its_cluster_ip_is_masqueraded_to_the_node() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA1, Proto::Tcp, 8081, "a1");
    program(&lab, &["hairpin.yaml"]);
    // Without masquerade the pod would get a packet from its own address and drop it as a
    // martian; with it, the source is node-a's address.
    for _ in 0..3 {
        let got = lab.request(Ns::PodA1, Proto::Tcp, ip("203.0.113.12"), 80);
        let (name, peer) = got.unwrap_or_else(|e| {
            panic!("hairpin request failed: {e}{}", rulesets(&lab));
        });
        assert_eq!(name, "a1");
        assert_ne!(
            peer,
            Ns::PodA1.v4().to_string(),
            "hairpin traffic was not masqueraded{}",
            rulesets(&lab)
        );
        assert_eq!(peer, Ns::NodeA.v4().to_string(), "{}", rulesets(&lab));
    }
}

#[test]
fn the_external_client_reaches_a_node_port_on_the_node_ip_but_not_on_other_node_addresses() {
    let mut lab = Lab::new();
    // A second address on node-a's LAN interface that is not its InternalIP, added before
    // nodeproxy runs so that it could (wrongly) be taken for a NodePort address.
    lab.add_lan_address(Ns::NodeA, "192.0.2.21/24");
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    program(&lab, &["web.yaml"]);
    // ETP=Cluster: external traffic is always masqueraded, so endpoints see node-a.
    let answered = spread(
        &lab,
        Ns::Client,
        Proto::Tcp,
        Ns::NodeA.addr(false),
        30080,
        SPREAD_REQUESTS,
        Ns::NodeA.addr(false),
    );
    assert_eq!(answered, names(&["a2", "b1"]), "{}", rulesets(&lab));
    let got = lab.request(Ns::Client, Proto::Tcp, ip("192.0.2.21"), 30080);
    assert!(
        got.is_err(),
        "NodePort answered on 192.0.2.21, which is not a NodePort address: {got:?}{}",
        rulesets(&lab)
    );
}

#[test]
fn a_service_without_endpoints_refuses_connections_quickly_on_cluster_ip_and_node_port() {
    let lab = Lab::new();
    program(&lab, &["no-endpoints.yaml"]);
    for (from, addr, port) in [
        (Ns::PodA1, ip("203.0.113.13"), 80),
        (Ns::Client, Ns::NodeA.addr(false), 30013),
    ] {
        let started = Instant::now();
        let got = lab.request(from, Proto::Tcp, addr, port);
        let took = started.elapsed();
        assert_eq!(
            got,
            Err("connection refused".to_string()),
            "{} → {addr}:{port}{}",
            from.role(),
            rulesets(&lab)
        );
        assert!(
            took < Duration::from_millis(1500),
            "{} → {addr}:{port} was refused only after {took:?}",
            from.role()
        );
    }
}

#[test]
fn a_udp_service_answers_a_pod_through_its_cluster_ip() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Udp, 5353, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Udp, 5353, "b1");
    program(&lab, &["udp.yaml"]);
    let answered = spread(
        &lab,
        Ns::PodA1,
        Proto::Udp,
        ip("203.0.113.11"),
        53,
        SPREAD_REQUESTS,
        Ns::PodA1.addr(false),
    );
    assert_eq!(answered, names(&["a2", "b1"]), "{}", rulesets(&lab));
}

#[test]
fn ipv6_cluster_ip_and_node_port_reach_endpoints_on_both_nodes() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    program(&lab, &["ipv6.yaml"]);
    let answered = spread(
        &lab,
        Ns::PodA1,
        Proto::Tcp,
        ip("2001:db8:ffff::10"),
        80,
        SPREAD_REQUESTS,
        Ns::PodA1.addr(true),
    );
    assert_eq!(
        answered,
        names(&["a2", "b1"]),
        "ClusterIP{}",
        rulesets(&lab)
    );
    let answered = spread(
        &lab,
        Ns::Client,
        Proto::Tcp,
        Ns::NodeA.addr(true),
        30086,
        SPREAD_REQUESTS,
        Ns::NodeA.addr(true),
    );
    assert_eq!(answered, names(&["a2", "b1"]), "NodePort{}", rulesets(&lab));
}

#[test]
fn each_port_and_protocol_of_a_multi_port_service_reaches_its_own_target_port() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "http");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 9090, "admin");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 5300, "dns-tcp");
    lab.spawn_server(Ns::PodB1, Proto::Udp, 5301, "dns-udp");
    // Decoys on the other protocol's target port: crossing TCP and UDP would answer with these.
    lab.spawn_server(Ns::PodB1, Proto::Udp, 5300, "wrong-udp");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 5301, "wrong-tcp");
    program(&lab, &["multiport.yaml"]);
    let vip = ip("203.0.113.20");
    for (proto, port, expected) in [
        (Proto::Tcp, 80, "http"),
        (Proto::Tcp, 81, "admin"),
        (Proto::Tcp, 53, "dns-tcp"),
        (Proto::Udp, 53, "dns-udp"),
    ] {
        let answered = spread(&lab, Ns::PodA1, proto, vip, port, 3, Ns::PodA1.addr(false));
        assert_eq!(
            answered,
            names(&[expected]),
            "{vip}:{port}/{proto:?}{}",
            rulesets(&lab)
        );
    }
}

#[test]
fn re_applying_a_changed_state_converges_and_leaves_nothing_of_the_old_state() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    let keep = ip("203.0.113.30");
    let gone = ip("203.0.113.31");
    let pod = Ns::PodA1.addr(false);

    program(&lab, &["converge-a.yaml"]);
    assert_eq!(
        spread(&lab, Ns::PodA1, Proto::Tcp, keep, 80, 3, pod),
        names(&["a2"])
    );
    assert_eq!(
        spread(&lab, Ns::PodA1, Proto::Tcp, gone, 80, 3, pod),
        names(&["b1"])
    );

    program(&lab, &["converge-b.yaml"]);
    assert_eq!(
        spread(&lab, Ns::PodA1, Proto::Tcp, keep, 80, 10, pod),
        names(&["b1"]),
        "default/keep must reach only its new endpoint{}",
        rulesets(&lab)
    );
    let got = lab.request(Ns::PodA1, Proto::Tcp, gone, 80);
    assert!(
        got.is_err(),
        "the removed service default/gone still answers: {got:?}{}",
        rulesets(&lab)
    );
    for node in [Ns::NodeA, Ns::NodeB] {
        let table = lab.exec_ok(node, &["nft", "list", "table", "ip", "nodeproxy"]);
        for stale in ["default/gone", "203.0.113.31", "198.51.100.11"] {
            assert!(
                !table.contains(stale),
                "{} still mentions {stale} after re-apply:\n{table}",
                node.role()
            );
        }
    }
}

#[test]
fn cleanup_removes_both_nodeproxy_tables_and_leaves_foreign_tables() {
    let lab = Lab::new();
    program_node(&lab, Ns::NodeA, &["web.yaml", "ipv6.yaml"], &[]);
    lab.exec_ok(Ns::NodeA, &["nft", "add", "table", "inet", "other"]);
    let before = lab.exec_ok(Ns::NodeA, &["nft", "list", "tables"]);
    for table in ["table ip nodeproxy", "table ip6 nodeproxy"] {
        assert!(
            before.lines().any(|l| l.trim() == table),
            "--once did not create {table}:\n{before}"
        );
    }
    let out = nodeproxy(&lab, Ns::NodeA, &["--cleanup"]);
    assert!(out.status.success(), "--cleanup failed: {}", describe(&out));
    let after = lab.exec_ok(Ns::NodeA, &["nft", "list", "tables"]);
    for table in ["table ip nodeproxy", "table ip6 nodeproxy"] {
        assert!(
            !after.lines().any(|l| l.trim() == table),
            "--cleanup left {table}:\n{after}"
        );
    }
    assert!(
        after.lines().any(|l| l.trim() == "table inet other"),
        "--cleanup removed a foreign table:\n{after}"
    );
}
