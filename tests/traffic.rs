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

/// Routes `dest` from `ns` through `via` (an external client or a node that must send an
/// external address to a particular node, as a load balancer or router would).
fn route(lab: &Lab, ns: Ns, dest: &str, via: Ns) {
    let via = via.v4().to_string();
    lab.exec_ok(
        ns,
        &["ip", "route", "add", dest, "via", &via, "dev", "eth0"],
    );
}

/// One request that must fail with `expected` ("timeout" for a drop, "connection refused"
/// for a reject).
fn refused_or_dropped(lab: &Lab, from: Ns, addr: IpAddr, port: u16, expected: &str) {
    let got = lab.request(from, Proto::Tcp, addr, port);
    assert_eq!(
        got,
        Err(expected.to_string()),
        "{} → {addr}:{port}{}",
        from.role(),
        rulesets(lab)
    );
}

/// A lab with servers on pod-a2 ("a2") and pod-b1 ("b1"), port 8080, and the client routing
/// external addresses 203.0.113.100/102/103/104 through node-a and 203.0.113.101 through node-b.
fn policy_lab() -> Lab {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    for dest in [
        "203.0.113.100",
        "203.0.113.102",
        "203.0.113.103",
        "203.0.113.104",
    ] {
        route(&lab, Ns::Client, dest, Ns::NodeA);
    }
    route(&lab, Ns::Client, "203.0.113.101", Ns::NodeB);
    // The client and the nodes share one LAN, so a node forwarding an external address back
    // out of the interface it came in on would first send the client an ICMP redirect to the
    // (absent) LAN router; a real load balancer or router does not take redirects.
    for node in [Ns::NodeA, Ns::NodeB] {
        lab.exec_ok(
            node,
            &[
                "sh",
                "-c",
                "echo 0 > /proc/sys/net/ipv4/conf/all/send_redirects; \
                 echo 0 > /proc/sys/net/ipv4/conf/eth0/send_redirects",
            ],
        );
    }
    lab
}

#[test]
fn external_traffic_policy_local_keeps_the_client_address_and_drops_on_nodes_without_endpoints() {
    let lab = policy_lab();
    program(&lab, &["policies.yaml"]);
    let client = Ns::Client.addr(false);
    // node-a has the only endpoint: NodePort and external IP answer, unmasqueraded.
    for (addr, port) in [(Ns::NodeA.addr(false), 30100), (ip("203.0.113.100"), 80)] {
        assert_eq!(
            spread(&lab, Ns::Client, Proto::Tcp, addr, port, 5, client),
            names(&["a2"]),
            "{addr}:{port}{}",
            rulesets(&lab)
        );
    }
    // node-b has none: dropped (not rejected, not forwarded to node-a).
    refused_or_dropped(&lab, Ns::Client, Ns::NodeB.addr(false), 30100, "timeout");
    refused_or_dropped(&lab, Ns::Client, ip("203.0.113.101"), 80, "timeout");
}

#[test]
fn pods_and_nodes_reach_an_external_traffic_policy_local_address_on_a_node_without_endpoints() {
    let lab = policy_lab();
    program(&lab, &["policies.yaml"]);
    // kubernetes#131765: pod-b1 on node-b (no local endpoint) is short-circuited to the
    // cluster-wide endpoints and keeps its address; node-b itself is masqueraded.
    assert_eq!(
        spread(
            &lab,
            Ns::PodB1,
            Proto::Tcp,
            ip("203.0.113.100"),
            80,
            5,
            Ns::PodB1.addr(false)
        ),
        names(&["a2"]),
        "{}",
        rulesets(&lab)
    );
    assert_eq!(
        spread(
            &lab,
            Ns::NodeB,
            Proto::Tcp,
            ip("203.0.113.100"),
            80,
            5,
            Ns::NodeB.addr(false)
        ),
        names(&["a2"]),
        "{}",
        rulesets(&lab)
    );
    // The same for its NodePort on node-b's own address.
    assert_eq!(
        spread(
            &lab,
            Ns::PodB1,
            Proto::Tcp,
            Ns::NodeB.addr(false),
            30100,
            5,
            Ns::PodB1.addr(false)
        ),
        names(&["a2"]),
        "{}",
        rulesets(&lab)
    );
}

#[test]
fn external_and_load_balancer_ips_with_cluster_policy_are_masqueraded_to_any_endpoint() {
    let lab = policy_lab();
    program(&lab, &["policies.yaml"]);
    for vip in ["203.0.113.102", "203.0.113.103"] {
        assert_eq!(
            spread(
                &lab,
                Ns::Client,
                Proto::Tcp,
                ip(vip),
                80,
                5,
                Ns::NodeA.addr(false)
            ),
            names(&["b1"]),
            "{vip}{}",
            rulesets(&lab)
        );
    }
}

#[test]
fn internal_traffic_policy_local_serves_local_pods_and_drops_elsewhere() {
    let lab = policy_lab();
    program(&lab, &["policies.yaml"]);
    assert_eq!(
        spread(
            &lab,
            Ns::PodA1,
            Proto::Tcp,
            ip("203.0.113.42"),
            80,
            5,
            Ns::PodA1.addr(false)
        ),
        names(&["a2"])
    );
    refused_or_dropped(&lab, Ns::PodB1, ip("203.0.113.42"), 80, "timeout");
}

#[test]
fn terminating_and_unready_endpoints_are_used_exactly_as_kube_proxy_uses_them() {
    let lab = policy_lab();
    program(&lab, &["policies.yaml"]);
    let pod = Ns::PodA1.addr(false);
    // A ready endpoint anywhere wins over a serving-terminating one.
    assert_eq!(
        spread(&lab, Ns::PodA1, Proto::Tcp, ip("203.0.113.43"), 80, 10, pod),
        names(&["a2"]),
        "{}",
        rulesets(&lab)
    );
    // None ready: serving-terminating ones keep serving; unready non-serving never.
    assert_eq!(
        spread(&lab, Ns::PodA1, Proto::Tcp, ip("203.0.113.44"), 80, 10, pod),
        names(&["b1"]),
        "{}",
        rulesets(&lab)
    );
    // Only unready endpoints: no endpoints, rejected on ClusterIP and external IP.
    refused_or_dropped(
        &lab,
        Ns::PodA1,
        ip("203.0.113.45"),
        80,
        "connection refused",
    );
    refused_or_dropped(
        &lab,
        Ns::Client,
        ip("203.0.113.104"),
        80,
        "connection refused",
    );
}

#[test]
fn zone_hints_keep_traffic_in_the_node_zone() {
    let lab = policy_lab();
    program(&lab, &["policies.yaml"]);
    let vip = ip("203.0.113.46");
    assert_eq!(
        spread(
            &lab,
            Ns::PodA1,
            Proto::Tcp,
            vip,
            80,
            10,
            Ns::PodA1.addr(false)
        ),
        names(&["a2"]),
        "{}",
        rulesets(&lab)
    );
    // pod-b1 is b1 itself: the hairpin masquerade shows node-b's address.
    assert_eq!(
        spread(
            &lab,
            Ns::PodB1,
            Proto::Tcp,
            vip,
            80,
            10,
            Ns::NodeB.addr(false)
        ),
        names(&["b1"]),
        "{}",
        rulesets(&lab)
    );
}

#[test]
fn every_detect_local_mode_tells_pods_from_the_node() {
    let lab = policy_lab();
    // Per mode: the extra arguments for node-a and node-b. The lab's pod veths on the nodes are
    // named after the pods (pod-a1, pod-a2, pod-b1), which stands in for a CNI's prefix or a
    // bridge.
    let modes: [(&str, Vec<&str>, Vec<&str>); 4] = [
        ("ClusterCIDR", vec![], vec![]),
        (
            "NodeCIDR",
            vec!["--detect-local-mode", "NodeCIDR"],
            vec!["--detect-local-mode", "NodeCIDR"],
        ),
        (
            "InterfaceNamePrefix",
            vec![
                "--detect-local-mode",
                "InterfaceNamePrefix",
                "--pod-interface-name-prefix",
                "pod-",
            ],
            vec![
                "--detect-local-mode",
                "InterfaceNamePrefix",
                "--pod-interface-name-prefix",
                "pod-",
            ],
        ),
        (
            "BridgeInterface",
            vec![
                "--detect-local-mode",
                "BridgeInterface",
                "--pod-bridge-interface",
                "pod-a1",
            ],
            vec![
                "--detect-local-mode",
                "BridgeInterface",
                "--pod-bridge-interface",
                "pod-b1",
            ],
        ),
    ];
    for (mode, a, b) in &modes {
        program_node(&lab, Ns::NodeA, &["policies.yaml"], a);
        program_node(&lab, Ns::NodeB, &["policies.yaml"], b);
        // Pod to ClusterIP: source kept. Node to ClusterIP: masqueraded.
        assert_eq!(
            spread(
                &lab,
                Ns::PodA1,
                Proto::Tcp,
                ip("203.0.113.40"),
                80,
                3,
                Ns::PodA1.addr(false)
            ),
            names(&["a2"]),
            "{mode}{}",
            rulesets(&lab)
        );
        assert_eq!(
            spread(
                &lab,
                Ns::NodeB,
                Proto::Tcp,
                ip("203.0.113.40"),
                80,
                3,
                Ns::NodeB.addr(false)
            ),
            names(&["a2"]),
            "{mode}{}",
            rulesets(&lab)
        );
        // Pod to an ETP=Local external IP on a node without endpoints: short-circuited.
        assert_eq!(
            spread(
                &lab,
                Ns::PodB1,
                Proto::Tcp,
                ip("203.0.113.100"),
                80,
                3,
                Ns::PodB1.addr(false)
            ),
            names(&["a2"]),
            "{mode}{}",
            rulesets(&lab)
        );
    }
}

#[test]
fn unallocated_addresses_of_the_service_cidr_are_dropped() {
    let mut lab = Lab::new();
    // A server outside the cluster that owns an address inside the service range: without the
    // drop, node-a routes to it and it answers.
    lab.exec_ok(
        Ns::Client,
        &["ip", "addr", "add", "203.0.113.77/32", "dev", "eth0"],
    );
    lab.spawn_server(Ns::Client, Proto::Tcp, 80, "outside");
    route(&lab, Ns::NodeA, "203.0.113.77/32", Ns::Client);
    route(&lab, Ns::Client, "198.51.100.0/25", Ns::NodeA);
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    let unallocated = ip("203.0.113.77");
    program_node(&lab, Ns::NodeA, &["web.yaml"], &[]);
    let got = lab.request(Ns::PodA1, Proto::Tcp, unallocated, 80);
    assert!(
        matches!(&got, Ok((name, _)) if name == "outside"),
        "setup: {got:?}{}",
        rulesets(&lab)
    );
    program_node(
        &lab,
        Ns::NodeA,
        &["web.yaml"],
        &["--service-cidr", "203.0.113.0/25"],
    );
    refused_or_dropped(&lab, Ns::PodA1, unallocated, 80, "timeout");
    // Allocated ClusterIPs still work.
    assert!(
        !spread(
            &lab,
            Ns::PodA1,
            Proto::Tcp,
            ip("203.0.113.10"),
            80,
            3,
            Ns::PodA1.addr(false)
        )
        .is_empty()
    );
}

#[test]
fn nodeport_addresses_cidrs_select_node_object_addresses_and_all_selects_every_local_one() {
    let mut lab = Lab::new();
    // 192.0.2.21 is node-a's ExternalIP in the Node object; 192.0.2.22 is on the interface only.
    lab.add_lan_address(Ns::NodeA, "192.0.2.21/24");
    lab.add_lan_address(Ns::NodeA, "192.0.2.22/24");
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    let masq = Ns::NodeA.addr(false);
    program_node(
        &lab,
        Ns::NodeA,
        &["web.yaml"],
        &["--nodeport-addresses", "192.0.2.0/24"],
    );
    for addr in ["192.0.2.11", "192.0.2.21"] {
        assert!(
            !spread(&lab, Ns::Client, Proto::Tcp, ip(addr), 30080, 3, masq).is_empty(),
            "{addr}"
        );
    }
    let got = lab.request(Ns::Client, Proto::Tcp, ip("192.0.2.22"), 30080);
    assert!(
        got.is_err(),
        "192.0.2.22 is not in the Node object: {got:?}{}",
        rulesets(&lab)
    );

    program_node(
        &lab,
        Ns::NodeA,
        &["web.yaml"],
        &["--nodeport-addresses", "all"],
    );
    let got = lab.request(Ns::Client, Proto::Tcp, ip("192.0.2.22"), 30080);
    assert!(got.is_ok(), "all: {got:?}{}", rulesets(&lab));
    // Never on loopback.
    let got = lab.request(Ns::NodeA, Proto::Tcp, ip("127.0.0.1"), 30080);
    assert!(
        got.is_err(),
        "loopback NodePort answered: {got:?}{}",
        rulesets(&lab)
    );
}

#[test]
fn a_dual_stack_service_answers_on_both_families() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    program(&lab, &["dualstack.yaml"]);
    for (vip, v6) in [("203.0.113.47", false), ("2001:db8:ffff::47", true)] {
        assert_eq!(
            spread(
                &lab,
                Ns::PodA1,
                Proto::Tcp,
                ip(vip),
                80,
                SPREAD_REQUESTS,
                Ns::PodA1.addr(v6)
            ),
            names(&["a2", "b1"]),
            "{vip}{}",
            rulesets(&lab)
        );
    }
}
