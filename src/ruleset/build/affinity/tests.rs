//! Unit tests of ClientIP-affinity slots: their assignment, their round trip through the
//! kernel's form of the table, and what the evaluator says a client's connections do.
use std::net::IpAddr;

use super::*;
use crate::config::NodePortAddresses;
use crate::model::{
    Conditions, EndpointSlice, IpFamily, Node, Service, ServiceName, ServicePort, SliceEndpoint,
    SlicePort, TrafficPolicy,
};
use crate::nft::{WireTable, lower};
use crate::ruleset::build::{DetectLocal, Settings, build, build_with};
use crate::ruleset::eval::{self, DynamicSets, Origin, Packet, Trace};
use crate::ruleset::{Ruleset, Table};

fn sock(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

const A: &str = "198.51.100.10:8080";
const B: &str = "198.51.100.11:8080";
const C: &str = "198.51.100.130:8080";
/// Sorts before all the others.
const D: &str = "198.51.100.1:8080";

fn slots(pairs: &[(&str, usize)]) -> BTreeMap<SocketAddr, usize> {
    pairs.iter().map(|(ep, slot)| (sock(ep), *slot)).collect()
}

#[test]
fn without_hints_slots_are_the_positions_in_sorted_order() {
    assert_eq!(assign_slots(&[sock(A), sock(B), sock(C)], None), [0, 1, 2]);
}

#[test]
fn removing_an_endpoint_keeps_the_others_in_their_slots() {
    let before = slots(&[(A, 0), (B, 1), (C, 2)]);
    assert_eq!(assign_slots(&[sock(B), sock(C)], Some(&before)), [1, 2]);
    assert_eq!(assign_slots(&[sock(A), sock(C)], Some(&before)), [0, 2]);
}

#[test]
fn new_endpoints_take_the_lowest_free_slots_in_sorted_order() {
    let before = slots(&[(B, 1), (C, 2)]);
    assert_eq!(
        assign_slots(&[sock(D), sock(B), sock(C)], Some(&before)),
        [0, 1, 2]
    );
    let before = slots(&[(A, 0), (C, 2)]);
    assert_eq!(
        assign_slots(&[sock(D), sock(A), sock(B), sock(C)], Some(&before)),
        [1, 0, 3, 2]
    );
}

#[test]
fn a_slot_claimed_twice_goes_to_the_first_endpoint_only() {
    let before = slots(&[(A, 0), (B, 0)]);
    assert_eq!(assign_slots(&[sock(A), sock(B)], Some(&before)), [0, 1]);
}

fn settings() -> Settings {
    Settings {
        node_name: "node-a".into(),
        cluster_cidrs: vec!["198.51.100.0/24".parse().unwrap()],
        masquerade_all: false,
        mark: 0x4000,
        nodeport_addresses: NodePortAddresses::primary(),
        detect_local: DetectLocal::ClusterCidr,
        service_cidrs: vec![],
        own_tables: false,
    }
}

/// shop/web: ClusterIP 203.0.113.20 and 2001:db8:ffff::20, port 80/TCP, NodePort 30080,
/// ClientIP affinity (3 h), with `endpoints` (IPv4 `addr:port`) plus one IPv6 endpoint.
fn state(endpoints: &[&str]) -> ClusterState {
    let mut st = ClusterState::default();
    st.nodes.insert(
        "node-a".into(),
        Node {
            name: "node-a".into(),
            internal_ips: vec![ip("192.0.2.11")],
            ..Node::default()
        },
    );
    let name = ServiceName {
        namespace: "shop".into(),
        name: "web".into(),
    };
    st.services.insert(
        name.clone(),
        Service {
            cluster_ips: vec![ip("203.0.113.20"), ip("2001:db8:ffff::20")],
            ports: vec![ServicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: Some(30080),
            }],
            session_affinity_timeout: Some(10800),
            ..Service::new(name.clone())
        },
    );
    // One slice per endpoint: they may differ in port.
    let v6 = ["[2001:db8:b::10]:8080"];
    for (i, ep) in endpoints.iter().chain(&v6).enumerate() {
        let ep = sock(ep);
        let slice = EndpointSlice {
            name: ServiceName {
                namespace: "shop".into(),
                name: format!("web-{i}"),
            },
            service: name.clone(),
            family: IpFamily::of(&ep.ip()),
            ports: vec![SlicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: ep.port(),
            }],
            endpoints: vec![SliceEndpoint {
                addr: ep.ip(),
                conditions: Conditions {
                    ready: true,
                    serving: true,
                    terminating: false,
                },
                node_name: Some("node-b".into()),
                zone: None,
                zone_hints: vec![],
                node_hints: vec![],
            }],
        };
        st.slices.insert(slice.name.clone(), slice);
    }
    st
}

fn lowered(rs: &Ruleset) -> Vec<WireTable> {
    rs.tables.iter().map(|t| lower(t).unwrap()).collect()
}

/// What the kernel would hand a restarted nodeproxy.
fn hints_of(rs: &Ruleset) -> Hints {
    let tables = lowered(rs);
    crate::sync::affinity_hints(&tables.iter().collect::<Vec<_>>())
}

fn v4(rs: &Ruleset) -> &Table {
    rs.table(IpFamily::V4).unwrap()
}

/// The slot of each endpoint of `key`, read from the slot maps of its path.
fn slots_of(table: &Table, key: &[Atom]) -> BTreeMap<SocketAddr, usize> {
    let mut out = BTreeMap::new();
    for set in &table.sets {
        let Some((_, slot)) = Path::slot_of_map(&set.name) else {
            continue;
        };
        for e in set.elements.iter().filter(|e| e.key == key) {
            if let Some(ElemData::Value(v)) = &e.data
                && let [Atom::Addr(a), Atom::Port(p)] = v.as_slice()
            {
                out.insert(SocketAddr::new(*a, *p), slot);
            }
        }
    }
    out
}

/// The service key `addr . tcp . port`.
fn svc(addr: &str, port: u16) -> Vec<Atom> {
    vec![
        Atom::Addr(ip(addr)),
        Atom::Proto(Protocol::Tcp),
        Atom::Port(port),
    ]
}

/// The NodePort key `tcp . port`.
fn np(port: u16) -> Vec<Atom> {
    vec![Atom::Proto(Protocol::Tcp), Atom::Port(port)]
}

/// The chain `map` sends `key` to.
fn verdict_of(table: &Table, map: &str, key: &[Atom]) -> String {
    let e = table
        .set(map)
        .unwrap()
        .elements
        .iter()
        .find(|e| e.key == key)
        .unwrap_or_else(|| panic!("no {key:?} in {map}"));
    match &e.data {
        Some(ElemData::Verdict(Verdict::Goto(c))) => c.clone(),
        other => panic!("{other:?}"),
    }
}

fn cluster_key() -> Vec<Atom> {
    svc("203.0.113.20", 80)
}

#[test]
fn slots_survive_the_kernel_form_when_endpoints_go_and_come() {
    let first = build(&state(&[A, B, C]), &settings());
    let dense = slots(&[(A, 0), (B, 1), (C, 2)]);
    assert_eq!(slots_of(v4(&first), &cluster_key()), dense);
    assert_eq!(slots_of(v4(&first), &np(30080)), dense);
    assert_eq!(
        verdict_of(v4(&first), names::SERVICE_IPS, &cluster_key()),
        "affinity-10800s-pick-3"
    );

    // A goes: B and C keep their slots, wherever the service is reached.
    let second = build_with(&state(&[B, C]), &settings(), &hints_of(&first));
    let sparse = slots(&[(B, 1), (C, 2)]);
    assert_eq!(slots_of(v4(&second), &cluster_key()), sparse);
    assert_eq!(slots_of(v4(&second), &np(30080)), sparse);
    assert_eq!(
        verdict_of(v4(&second), names::SERVICE_IPS, &cluster_key()),
        "affinity-pick-2-in-3"
    );
    assert_eq!(
        verdict_of(v4(&second), names::NODEPORT_PICKS, &np(30080)),
        "affinity-nodeport-pick-2-in-3"
    );
    // Without hints the same state is numbered densely, as before slots were kept.
    assert_eq!(
        slots_of(v4(&build(&state(&[B, C]), &settings())), &cluster_key()),
        slots(&[(B, 0), (C, 1)])
    );

    // D arrives, sorting first: it takes the free slot 0, B and C stay.
    let third = build_with(&state(&[D, B, C]), &settings(), &hints_of(&second));
    assert_eq!(
        slots_of(v4(&third), &cluster_key()),
        slots(&[(D, 0), (B, 1), (C, 2)])
    );
    // No holes any more: the dense chain, with no per-service verdict elements.
    assert_eq!(
        verdict_of(v4(&third), names::SERVICE_IPS, &cluster_key()),
        "affinity-10800s-pick-3"
    );
    for set in &v4(&third).sets {
        if set.name.starts_with("affinity-random-") || set.name.ends_with("-chains") {
            assert!(set.elements.is_empty(), "{}: {:?}", set.name, set.elements);
        }
    }
    // The IPv6 table keeps its own slots.
    let v6 = third.table(IpFamily::V6).unwrap();
    assert_eq!(
        slots_of(v6, &svc("2001:db8:ffff::20", 80)),
        slots(&[("[2001:db8:b::10]:8080", 0)])
    );
}

#[test]
fn the_random_map_points_at_the_present_endpoints_only() {
    let first = build(&state(&[A, B, C]), &settings());
    let second = build_with(&state(&[B, C]), &settings(), &hints_of(&first));
    let random = v4(&second)
        .set(&names::affinity_random_map(names::AFFINITY, 2))
        .unwrap();
    let mut key = cluster_key();
    let mut targets = Vec::new();
    for index in 0..2 {
        key.push(Atom::Int(index));
        targets.push(verdict_of(v4(&second), &random.name, &key));
        key.pop();
    }
    assert_eq!(
        targets,
        ["affinity-10800s-slot-1", "affinity-10800s-slot-2"]
    );
}

fn connect(rs: &Ruleset, dst: &str, pins: &DynamicSets) -> Trace {
    connect_on(rs, &[ip("192.0.2.11")], dst, pins)
}

/// A connection from an outside client to `dst` on a node with the local addresses `node`.
fn connect_on(rs: &Ruleset, node: &[IpAddr], dst: &str, pins: &DynamicSets) -> Trace {
    let dst = sock(dst);
    eval::evaluate_with(
        rs,
        node,
        Packet {
            src: ip("192.0.2.200"),
            dst: dst.ip(),
            proto: Protocol::Tcp,
            dport: dst.port(),
            origin: Origin::External,
            iif: Some("eth0".into()),
        },
        pins,
    )
    .unwrap()
}

/// The pins a client holds after its connection was DNATed to `target`.
fn pins_after(t: &Trace, target: &str) -> DynamicSets {
    t.branch_to(sock(target))
        .unwrap_or_else(|| panic!("no branch to {target}: {:?}", t.dnat_targets()))
        .dynamic
        .clone()
}

#[test]
fn a_new_client_is_spread_uniformly_over_the_present_endpoints() {
    let first = build(&state(&[A, B, C]), &settings());
    let second = build_with(&state(&[B, C]), &settings(), &hints_of(&first));
    for dst in ["203.0.113.20:80", "192.0.2.11:30080"] {
        let t = connect(&second, dst, &DynamicSets::new());
        // One branch per value of `numgen random mod 2`, each to another endpoint.
        let targets: Vec<SocketAddr> = t
            .branches
            .iter()
            .map(|b| b.dnat.as_ref().unwrap().target)
            .collect();
        assert_eq!(targets.len(), 2, "{dst}: {targets:?}");
        assert_eq!(t.dnat_targets(), [sock(B), sock(C)], "{dst}");
    }
}

#[test]
fn a_pinned_client_stays_on_its_endpoint_and_a_stale_pin_is_dropped() {
    let first = build(&state(&[A, B, C]), &settings());
    let second = build_with(&state(&[B, C]), &settings(), &hints_of(&first));
    let third = build_with(&state(&[D, B, C]), &settings(), &hints_of(&second));
    let dst = "203.0.113.20:80";
    let none = DynamicSets::new();

    // Pinned to B: B after A went, B after D came.
    let on_b = pins_after(&connect(&first, dst, &none), B);
    assert_eq!(connect(&first, dst, &on_b).dnat_targets(), [sock(B)]);
    assert_eq!(connect(&second, dst, &on_b).dnat_targets(), [sock(B)]);
    assert_eq!(connect(&third, dst, &on_b).dnat_targets(), [sock(B)]);

    // Pinned to A, which goes: picked anew among B and C, and the stale pin is gone, so when
    // D refills A's slot the client stays where it was picked anew.
    let on_a = pins_after(&connect(&first, dst, &none), A);
    let again = connect(&second, dst, &on_a);
    assert_eq!(again.dnat_targets(), [sock(B), sock(C)]);
    for branch in &again.branches {
        let target = branch.dnat.as_ref().unwrap().target;
        let slot0 = branch
            .dynamic
            .get(&names::affinity_slot_set(names::AFFINITY, 0));
        assert!(
            slot0.is_none_or(|pins| pins.is_empty()),
            "the stale pin of A survived: {slot0:?}"
        );
        assert_eq!(
            connect(&third, dst, &branch.dynamic).dnat_targets(),
            [target]
        );
    }
    // A client that did not connect while A's slot was empty follows the pin to D, which
    // refilled it (see the module documentation).
    assert_eq!(connect(&third, dst, &on_a).dnat_targets(), [sock(D)]);
}

#[test]
fn hints_are_read_for_the_services_asked_for() {
    let rs = build(&state(&[A, B]), &settings());
    let tables = lowered(&rs);
    let tables: Vec<&WireTable> = tables.iter().collect();
    let web = ServiceName {
        namespace: "shop".into(),
        name: "web".into(),
    };
    let other = ServiceName {
        namespace: "shop".into(),
        name: "other".into(),
    };
    let all = crate::sync::affinity_hints(&tables);
    let key = |addr: &str, port| ServiceKey {
        addr: Some(ip(addr)),
        proto: Protocol::Tcp,
        port,
        local: false,
    };
    assert_eq!(
        all.slots(&key("203.0.113.20", 80)),
        Some(&slots(&[(A, 0), (B, 1)]))
    );
    assert_eq!(
        all.slots(&key("2001:db8:ffff::20", 80)),
        Some(&slots(&[("[2001:db8:b::10]:8080", 0)]))
    );
    // The NodePort's key names no address, so both families' slots are under it: each family
    // looks up its own endpoints.
    let node_port = ServiceKey {
        addr: None,
        proto: Protocol::Tcp,
        port: 30080,
        local: false,
    };
    assert_eq!(
        all.slots(&node_port),
        Some(&slots(&[(A, 0), (B, 1), ("[2001:db8:b::10]:8080", 0)]))
    );
    assert_eq!(
        crate::sync::affinity_hints_for(&tables, &BTreeSet::from([web])),
        all
    );
    assert!(crate::sync::affinity_hints_for(&tables, &BTreeSet::from([other])).is_empty());
}

#[test]
fn with_every_address_answering_node_ports_a_client_is_pinned_whichever_address_it_uses() {
    let mut all = settings();
    all.nodeport_addresses = NodePortAddresses {
        primary: false,
        all: true,
        cidrs: vec![],
    };
    let first = build(&state(&[A, B, C]), &all);
    assert_eq!(
        verdict_of(v4(&first), names::NODEPORT_PICKS, &np(30080)),
        "affinity-nodeport-10800s-pick-3"
    );
    // 192.0.2.99 is on an interface but not in the Node object: only `all` answers there.
    let node = [ip("192.0.2.11"), ip("192.0.2.99")];
    let none = DynamicSets::new();
    let t = connect_on(&first, &node, "192.0.2.99:30080", &none);
    assert_eq!(t.dnat_targets(), [sock(A), sock(B), sock(C)]);
    let on_b = pins_after(&t, B);
    // The pin names the NodePort, not the address: it holds on every address of the node.
    for dst in ["192.0.2.99:30080", "192.0.2.11:30080"] {
        assert_eq!(
            connect_on(&first, &node, dst, &on_b).dnat_targets(),
            [sock(B)],
            "{dst}"
        );
    }
    // Pins via the NodePort and via the ClusterIP are independent (module documentation).
    assert_eq!(
        connect_on(&first, &node, "203.0.113.20:80", &on_b).dnat_targets(),
        [sock(A), sock(B), sock(C)]
    );
    // A goes: B keeps its slot through the kernel's form of the table, and the client its
    // endpoint; a client pinned to A is picked anew among B and C.
    let second = build_with(&state(&[B, C]), &all, &hints_of(&first));
    assert_eq!(slots_of(v4(&second), &np(30080)), slots(&[(B, 1), (C, 2)]));
    assert_eq!(
        connect_on(&second, &node, "192.0.2.11:30080", &on_b).dnat_targets(),
        [sock(B)]
    );
    let on_a = pins_after(&t, A);
    assert_eq!(
        connect_on(&second, &node, "192.0.2.11:30080", &on_a).dnat_targets(),
        [sock(B), sock(C)]
    );
}

/// LB IP of [`local_state`].
const LB: &str = "203.0.113.120";

/// shop/web of [`state`] with `externalTrafficPolicy: Local` and the LoadBalancer IP [`LB`]:
/// the IPv4 `endpoints` run on node-a (this node) but for `remote`, which runs on node-b.
fn local_state(endpoints: &[&str], remote: &str) -> ClusterState {
    let mut all: Vec<&str> = endpoints.to_vec();
    all.push(remote);
    let mut st = state(&all);
    for svc in st.services.values_mut() {
        svc.external_traffic_policy = TrafficPolicy::Local;
        svc.load_balancer_ips = vec![ip(LB)];
        svc.health_check_node_port = Some(30999);
    }
    for slice in st.slices.values_mut() {
        for ep in &mut slice.endpoints {
            if endpoints.iter().any(|local| sock(local).ip() == ep.addr) {
                ep.node_name = Some("node-a".into());
            }
        }
    }
    st
}

/// The slot of each endpoint of `key` in the slot maps of the path named by `prefix` only.
fn slots_in(table: &Table, prefix: &str, key: &[Atom]) -> BTreeMap<SocketAddr, usize> {
    let mut out = BTreeMap::new();
    for set in &table.sets {
        let Some(slot) = names::affinity_slot_of_map(prefix, &set.name) else {
            continue;
        };
        for e in set.elements.iter().filter(|e| e.key == key) {
            if let Some(ElemData::Value(v)) = &e.data
                && let [Atom::Addr(a), Atom::Port(p)] = v.as_slice()
            {
                out.insert(SocketAddr::new(*a, *p), slot);
            }
        }
    }
    out
}

#[test]
fn local_policy_lists_have_their_own_slots_kept_across_changes() {
    let lb = svc(LB, 80);
    let first = build(&local_state(&[A, B, D], C), &settings());
    let t = v4(&first);
    // Outside traffic: the local endpoints in slots of their own, sorted (D, A, B).
    let local = slots(&[(D, 0), (A, 1), (B, 2)]);
    assert_eq!(slots_in(t, names::AFFINITY_LOCAL, &lb), local);
    assert_eq!(
        slots_in(t, names::AFFINITY_NODEPORT_LOCAL, &np(30080)),
        local
    );
    assert_eq!(
        verdict_of(t, names::EXTERNAL_LOCAL_PICKS, &lb),
        "affinity-local-10800s-pick-3"
    );
    assert_eq!(
        verdict_of(t, names::NODEPORT_LOCAL_PICKS, &np(30080)),
        "affinity-nodeport-local-10800s-pick-3"
    );
    // Pods and the node itself still use the cluster-wide list, C included.
    let cluster = slots(&[(D, 0), (A, 1), (B, 2), (C, 3)]);
    assert_eq!(slots_in(t, names::AFFINITY, &lb), cluster);
    assert_eq!(slots_in(t, names::AFFINITY_NODEPORT, &np(30080)), cluster);
    // No Local-policy pick chain or map is left unused.
    assert!(!t.sets.iter().any(|s| s.name.contains("local-pick-")));
    assert!(
        !t.chains.iter().any(
            |c| c.name.starts_with("local-pick-") || c.name.starts_with("nodeport-local-pick-")
        )
    );

    // The hints keep the two lists apart.
    let hints = hints_of(&first);
    let key = |local| ServiceKey {
        addr: Some(ip(LB)),
        proto: Protocol::Tcp,
        port: 80,
        local,
    };
    assert_eq!(hints.slots(&key(true)), Some(&local));
    assert_eq!(hints.slots(&key(false)), Some(&cluster));

    // D goes: A and B keep their local slots, on the sparse chain.
    let second = build_with(&local_state(&[A, B], C), &settings(), &hints);
    let t = v4(&second);
    assert_eq!(
        slots_in(t, names::AFFINITY_LOCAL, &lb),
        slots(&[(A, 1), (B, 2)])
    );
    assert_eq!(
        verdict_of(t, names::EXTERNAL_LOCAL_PICKS, &lb),
        "affinity-local-pick-2-in-3"
    );
    assert_eq!(
        verdict_of(t, names::NODEPORT_LOCAL_PICKS, &np(30080)),
        "affinity-nodeport-local-pick-2-in-3"
    );
}

#[test]
fn an_outside_client_of_a_local_policy_service_stays_on_its_local_endpoint() {
    let first = build(&local_state(&[A, B, D], C), &settings());
    let second = build_with(&local_state(&[A, B], C), &settings(), &hints_of(&first));
    let none = DynamicSets::new();
    for dst in ["203.0.113.120:80", "192.0.2.11:30080"] {
        // A new outside client: any local endpoint, never C, and its address is kept.
        let t = connect(&first, dst, &none);
        assert_eq!(t.dnat_targets(), [sock(D), sock(A), sock(B)], "{dst}");
        assert_eq!(t.masqueraded(), Some(false), "{dst}");
        for target in [A, B, D] {
            let pinned = pins_after(&t, target);
            let again = connect(&first, dst, &pinned);
            assert_eq!(again.dnat_targets(), [sock(target)], "{dst}");
            assert_eq!(again.masqueraded(), Some(false), "{dst}");
            // The pin is in the Local-policy sets only.
            assert!(
                pinned
                    .iter()
                    .filter(|(_, pins)| !pins.is_empty())
                    .all(|(name, _)| name.starts_with("affinity-local-")
                        || name.starts_with("affinity-nodeport-local-")),
                "{dst}: {pinned:?}"
            );
        }
        // Pinned to B, it stays on B when D goes.
        let on_b = pins_after(&t, B);
        assert_eq!(
            connect(&second, dst, &on_b).dnat_targets(),
            [sock(B)],
            "{dst}"
        );
        // Pinned to D, which went: picked anew among the local endpoints left.
        let on_d = pins_after(&t, D);
        assert_eq!(
            connect(&second, dst, &on_d).dnat_targets(),
            [sock(A), sock(B)],
            "{dst}"
        );
    }
}
