//! Traffic tests of loadBalancerSourceRanges and ClientIP session affinity: nodeproxy programs
//! node-a of the namespace lab (`tests/lab`), real clients check who answers.

// Test code: a failed precondition must panic to fail the test.
#![allow(clippy::panic, clippy::expect_used, clippy::unwrap_used)]

mod lab;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use lab::{Lab, Ns, Proto, describe};

const NODEPROXY: &str = env!("CARGO_BIN_EXE_nodeproxy");
const CLUSTER_CIDR: &str = "198.51.100.0/24,2001:db8:a::/47";

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/traffic/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// Programs node-a once from `nodes.yaml` and `file`.
fn program_node_a(lab: &Lab, file: &str) {
    program_node_a_with(lab, file, &[]);
}

/// Like [`program_node_a`], with more nodeproxy arguments.
fn program_node_a_with(lab: &Lab, file: &str, extra: &[&str]) {
    let nodes = fixture("nodes.yaml");
    let file = fixture(file);
    let mut args = vec![
        "timeout",
        "30",
        NODEPROXY,
        "--once",
        "--hostname-override",
        "node-a",
        "--cluster-cidr",
        CLUSTER_CIDR,
        "--from-file",
        &nodes,
        "--from-file",
        &file,
    ];
    args.extend_from_slice(extra);
    let out = lab.exec(Ns::NodeA, &args);
    assert!(out.status.success(), "nodeproxy failed: {}", describe(&out));
}

/// NodePorts on every local address, without a list of them to key anything on.
const ALL_ADDRESSES: [&str; 2] = ["--nodeport-addresses", "all"];

fn ruleset(lab: &Lab) -> String {
    format!("\n=== node-a ===\n{}", lab.ruleset(Ns::NodeA))
}

/// The server that answered each of `count` requests (failing the test on any error).
fn answers(lab: &Lab, from: Ns, addr: IpAddr, port: u16, count: usize) -> Vec<String> {
    (0..count)
        .map(|i| match lab.request(from, Proto::Tcp, addr, port) {
            Ok((name, _)) => name,
            Err(e) => panic!(
                "request {i} from {} to {addr}:{port} failed: {e}{}",
                from.role(),
                ruleset(lab)
            ),
        })
        .collect()
}

fn distinct(names: &[String]) -> BTreeSet<String> {
    names.iter().cloned().collect()
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("valid IP literal")
}

/// Three endpoints of default/sticky, each answering with its name.
fn sticky_lab() -> Lab {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA1, Proto::Tcp, 8080, "a1");
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Tcp, 8080, "b1");
    lab
}

#[test]
fn client_ip_affinity_pins_each_client_and_turning_it_off_spreads_again() {
    let lab = sticky_lab();
    program_node_a(&lab, "affinity.yaml");
    let node_port = Ns::NodeA.addr(false);
    // 10 connections from one client all reach one endpoint, through the NodePort…
    let first = answers(&lab, Ns::Client, node_port, 30100, 10);
    assert_eq!(
        distinct(&first).len(),
        1,
        "client → NodePort: {first:?}{}",
        ruleset(&lab)
    );
    // …and another client is pinned too (maybe to another endpoint).
    let second = answers(&lab, Ns::NodeB, node_port, 30100, 10);
    assert_eq!(distinct(&second).len(), 1, "node-b → NodePort: {second:?}");
    // Through the ClusterIP from the node itself (output path).
    let local = answers(&lab, Ns::NodeA, ip("203.0.113.60"), 80, 10);
    assert_eq!(distinct(&local).len(), 1, "node-a → ClusterIP: {local:?}");

    // Affinity off on the live service: new connections spread over the endpoints again
    // (all 20 on one of 3 endpoints: probability 3^-19).
    program_node_a(&lab, "affinity-off.yaml");
    let spread = answers(&lab, Ns::Client, node_port, 30100, 20);
    assert!(
        distinct(&spread).len() >= 2,
        "affinity off, still pinned: {spread:?}{}",
        ruleset(&lab)
    );
    // And on again: pinned again.
    program_node_a(&lab, "affinity.yaml");
    let again = answers(&lab, Ns::Client, node_port, 30100, 10);
    assert_eq!(distinct(&again).len(), 1, "affinity on again: {again:?}");
}

/// With `--nodeport-addresses all` the NodePort answers on every address of node-a, here also
/// on 192.0.2.51, which the Node object does not list; a client is pinned whichever of them it
/// connects to, and the pin follows it from one address to the other.
#[test]
fn client_ip_affinity_pins_node_port_clients_on_every_address_with_nodeport_addresses_all() {
    let lab = sticky_lab();
    lab.add_lan_address(Ns::NodeA, "192.0.2.51/24");
    program_node_a_with(&lab, "affinity.yaml", &ALL_ADDRESSES);
    // 12 connections on one endpoint of 3 by chance: probability 3^-11.
    let first = answers(&lab, Ns::Client, Ns::NodeA.addr(false), 30100, 12);
    assert_eq!(
        distinct(&first).len(),
        1,
        "client → primary address:NodePort: {first:?}{}",
        ruleset(&lab)
    );
    let other = answers(&lab, Ns::Client, ip("192.0.2.51"), 30100, 6);
    assert_eq!(
        distinct(&other),
        distinct(&first),
        "client → unlisted address:NodePort, after the primary: {other:?}{}",
        ruleset(&lab)
    );
    let second = answers(&lab, Ns::NodeB, ip("192.0.2.51"), 30100, 12);
    assert_eq!(distinct(&second).len(), 1, "node-b → NodePort: {second:?}");

    // Control: without affinity, the same NodePort spreads (all 20 on one endpoint: 3^-19).
    program_node_a_with(&lab, "affinity-off.yaml", &ALL_ADDRESSES);
    let spread = answers(&lab, Ns::Client, ip("192.0.2.51"), 30100, 20);
    assert!(
        distinct(&spread).len() >= 2,
        "affinity off, still pinned: {spread:?}{}",
        ruleset(&lab)
    );
}

#[test]
fn client_ip_affinity_expires_after_its_timeout() {
    let lab = sticky_lab();
    program_node_a(&lab, "affinity-short.yaml");
    let node_port = Ns::NodeA.addr(false);
    // Within the 2 s timeout, every connection refreshes the pin: one endpoint.
    let quick = answers(&lab, Ns::Client, node_port, 30100, 5);
    assert_eq!(distinct(&quick).len(), 1, "{quick:?}{}", ruleset(&lab));
    // After the timeout the pin is gone and the next connection picks anew: over 8 rounds the
    // endpoint must change at least once (all equal: probability 3^-7).
    let mut seen = vec![quick[0].clone()];
    for _ in 0..7 {
        std::thread::sleep(Duration::from_millis(2300));
        let round = answers(&lab, Ns::Client, node_port, 30100, 2);
        assert_eq!(distinct(&round).len(), 1, "within a round: {round:?}");
        seen.push(round[0].clone());
    }
    assert!(
        distinct(&seen).len() >= 2,
        "the pin never expired: {seen:?}{}",
        ruleset(&lab)
    );
}

#[test]
fn lb_source_ranges_admit_listed_sources_and_drop_others_while_the_node_port_stays_open() {
    let mut lab = Lab::new();
    // The LB IP lands on node-a (as an L2 load balancer would announce it). Until LB IPs are
    // DNATed by nodeproxy, a server on node-a itself answers on it; either answer proves the
    // packet passed the pre-DNAT filter.
    lab.add_lan_address(Ns::NodeA, "192.0.2.50/24");
    lab.spawn_server(Ns::NodeA, Proto::Tcp, 80, "node-a-lb");
    lab.spawn_server(Ns::PodA2, Proto::Tcp, 8080, "a2");
    let lb = ip("192.0.2.50");
    // Control: before nodeproxy runs, node-b reaches the address, so a timeout below is the
    // filter's doing.
    assert_eq!(
        answers(&lab, Ns::NodeB, lb, 80, 1),
        vec!["node-a-lb".to_string()]
    );
    program_node_a(&lab, "source-ranges.yaml");
    // Allowed source: the external client, 192.0.2.100/32.
    let allowed = answers(&lab, Ns::Client, lb, 80, 3);
    assert!(!allowed.is_empty());
    // Not allowed: node-b (192.0.2.12). Dropped silently, so the client times out.
    let got = lab.request(Ns::NodeB, Proto::Tcp, lb, 80);
    assert_eq!(
        got,
        Err("timeout".to_string()),
        "node-b reached the LB IP{}",
        ruleset(&lab)
    );
    // The NodePort is not filtered: both reach the endpoint.
    for from in [Ns::Client, Ns::NodeB] {
        let got = answers(&lab, from, Ns::NodeA.addr(false), 30110, 2);
        assert_eq!(distinct(&got), BTreeSet::from(["a2".to_string()]));
    }
}

/// Each client's endpoint, asking `rounds` times per client and failing the test if one client
/// is answered by more than one endpoint.
fn pinned(lab: &Lab, clients: &[IpAddr], rounds: usize) -> Vec<String> {
    let node_port = Ns::NodeA.addr(false);
    clients
        .iter()
        .map(|&src| {
            let names: Vec<String> = (0..rounds)
                .map(|i| {
                    match lab.request_from(Ns::Client, Some(src), Proto::Tcp, node_port, 30100) {
                        Ok((name, _)) => name,
                        Err(e) => panic!("request {i} from {src} failed: {e}{}", ruleset(lab)),
                    }
                })
                .collect();
            assert_eq!(
                distinct(&names).len(),
                1,
                "client {src} is not pinned: {names:?}{}",
                ruleset(lab)
            );
            names[0].clone()
        })
        .collect()
}

/// kube-proxy keeps a pinned client on its endpoint for as long as that endpoint exists, whatever
/// happens to the others. 24 clients (addresses of the client namespace) are pinned over the
/// endpoints a1 < a2 < b1 of default/sticky; then a1, first in sorted order, goes away (each
/// re-applied by a new `nodeproxy --once`, so the pins also survive a restart): clients
/// of a2 and b1 stay, a1's clients are pinned anew; then an endpoint that sorts before all
/// others arrives (pod-a1 on port 8081, server `d`): every client stays where it was.
#[test]
fn client_ip_affinity_keeps_each_client_on_its_endpoint_when_others_come_and_go() {
    keeps_each_client_on_its_endpoint(&[]);
}

/// The same with `--nodeport-addresses all`, whose NodePort pins are kept in their own maps.
#[test]
fn client_ip_affinity_keeps_node_port_clients_on_their_endpoints_with_nodeport_addresses_all() {
    keeps_each_client_on_its_endpoint(&ALL_ADDRESSES);
}

fn keeps_each_client_on_its_endpoint(extra: &[&str]) {
    let mut lab = sticky_lab();
    lab.spawn_server(Ns::PodA1, Proto::Tcp, 8081, "d");
    let clients: Vec<IpAddr> = (101..125)
        .map(|i| {
            lab.add_lan_address(Ns::Client, &format!("192.0.2.{i}/24"));
            ip(&format!("192.0.2.{i}"))
        })
        .collect();
    program_node_a_with(&lab, "affinity.yaml", extra);
    let before = pinned(&lab, &clients, 2);
    // Every client on a2 is "a client pinned to B of {A, B, C}"; with 24 clients over three
    // endpoints, none on a2 has probability (2/3)^24 < 1e-4.
    assert!(
        before.iter().any(|n| n == "a2"),
        "no client was pinned to a2: {before:?}"
    );

    program_node_a_with(&lab, "affinity-minus-first.yaml", extra);
    let after_removal = pinned(&lab, &clients, 3);
    for ((src, was), now) in clients.iter().zip(&before).zip(&after_removal) {
        if was == "a1" {
            assert!(now == "a2" || now == "b1", "client {src}: {was} -> {now}");
        } else {
            assert_eq!(
                now,
                was,
                "client {src} left its endpoint when another one was removed{}",
                ruleset(&lab)
            );
        }
    }

    program_node_a_with(&lab, "affinity-plus-new.yaml", extra);
    let after_addition = pinned(&lab, &clients, 3);
    for ((src, was), now) in clients.iter().zip(&after_removal).zip(&after_addition) {
        assert_eq!(
            now,
            was,
            "client {src} left its endpoint when a new one was added{}",
            ruleset(&lab)
        );
    }
}

/// externalTrafficPolicy Local with ClientIP affinity (`affinity-local.yaml`): outside clients
/// of node-a's NodePort and LB IP reach only node-a's three endpoints, unmasqueraded, and each
/// client sticks to one of them (kube-proxy pins the Local-policy endpoints too).
#[test]
fn client_ip_affinity_pins_outside_clients_to_one_local_endpoint_under_external_traffic_policy_local()
 {
    let mut lab = sticky_lab();
    lab.spawn_server(Ns::PodA1, Proto::Tcp, 8081, "d");
    // The LB IP lands on node-a, as an L2 load balancer would announce it.
    lab.add_lan_address(Ns::NodeA, "192.0.2.50/24");
    let clients: Vec<IpAddr> = (131..143)
        .map(|i| {
            lab.add_lan_address(Ns::Client, &format!("192.0.2.{i}/24"));
            ip(&format!("192.0.2.{i}"))
        })
        .collect();
    program_node_a(&lab, "affinity-local.yaml");
    let local = BTreeSet::from(["a1", "a2", "d"].map(String::from));
    for (addr, port) in [(Ns::NodeA.addr(false), 30102), (ip("192.0.2.50"), 80)] {
        let mut seen = BTreeSet::new();
        for &src in &clients {
            // 6 connections of an unpinned client on one of 3 endpoints: probability 3^-5.
            let got: Vec<String> = (0..6)
                .map(
                    |i| match lab.request_from(Ns::Client, Some(src), Proto::Tcp, addr, port) {
                        Ok((name, peer)) => {
                            assert_eq!(
                                peer,
                                src.to_string(),
                                "{src} → {addr}:{port}: the client address was not kept{}",
                                ruleset(&lab)
                            );
                            name
                        }
                        Err(e) => panic!(
                            "request {i} from {src} to {addr}:{port} failed: {e}{}",
                            ruleset(&lab)
                        ),
                    },
                )
                .collect();
            let names = distinct(&got);
            assert_eq!(
                names.len(),
                1,
                "{src} → {addr}:{port} is not pinned: {got:?}{}",
                ruleset(&lab)
            );
            assert!(
                names.is_subset(&local),
                "{src} → {addr}:{port} left node-a: {got:?}{}",
                ruleset(&lab)
            );
            seen.extend(names);
        }
        // The clients are spread over the local endpoints (all 12 on one: probability 3^-11).
        assert!(
            seen.len() >= 2,
            "{addr}:{port}: every client on one endpoint: {seen:?}{}",
            ruleset(&lab)
        );
    }
}
