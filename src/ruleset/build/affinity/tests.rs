//! Unit tests of ClientIP affinity: the objects it needs whatever the endpoint count, its
//! elements, and what the evaluator says a client's connections do.
use std::net::{IpAddr, SocketAddr};

use super::*;
use crate::config::NodePortAddresses;
use crate::model::{
    Conditions, EndpointSlice, IpFamily, Locality, Node, Protocol, Service, ServiceName,
    ServicePort, SliceEndpoint, SlicePort, TrafficPolicy,
};
use crate::nft::lower;
use crate::ruleset::build::{DetectLocal, Settings, build};
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
    let name = ServiceName::new("shop", "web");
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
            name: ServiceName::new("shop", &format!("web-{i}")),
            service: name.clone(),
            family: IpFamily::of(&ep.ip()),
            ports: vec![SlicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: ep.port(),
            }]
            .into(),
            endpoints: vec![SliceEndpoint {
                addr: ep.ip(),
                conditions: Conditions {
                    ready: true,
                    serving: true,
                    terminating: false,
                },
                locality: Locality::of(Some("node-b".into()), None),
            }]
            .into(),
        };
        st.slices.insert(slice.name.clone(), slice);
    }
    st
}

fn v4(rs: &Ruleset) -> &Table {
    rs.table(IpFamily::V4).unwrap()
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
        Some(ElemData::Verdict(Verdict::Goto(c))) => c.to_string(),
        other => panic!("{other:?}"),
    }
}

fn cluster_key() -> Vec<Atom> {
    svc("203.0.113.20", 80)
}

/// The names of the table's sets and chains, with each `pick-<k>` chain's count dropped.
fn objects(t: &Table) -> Vec<String> {
    let mut names: Vec<String> = t.sets.iter().map(|s| s.name.clone()).collect();
    names.extend(t.chains.iter().map(|c| match c.name.rsplit_once("-pick-") {
        Some((head, _)) => format!("{head}-pick-k"),
        None => c.name.clone(),
    }));
    names.sort();
    names
}

fn endpoints(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("198.51.{}.{}:8080", 100 + i / 250, 1 + i % 250))
        .collect()
}

#[test]
fn the_objects_do_not_depend_on_the_endpoint_count() {
    let few = endpoints(3);
    let many = endpoints(2000);
    let few = build(
        &state(&few.iter().map(String::as_str).collect::<Vec<_>>()),
        &settings(),
    );
    let many = build(
        &state(&many.iter().map(String::as_str).collect::<Vec<_>>()),
        &settings(),
    );
    for (a, b) in few.tables.iter().zip(&many.tables) {
        assert_eq!(objects(a), objects(b), "{:?}", a.family);
        for (ca, cb) in a.chains.iter().zip(&b.chains) {
            assert_eq!(ca.rules.len(), cb.rules.len(), "{}", ca.name);
        }
        // Everything lowers (the keys fit their maps, the statements their registers).
        lower(a).unwrap();
        lower(b).unwrap();
    }
    let t = v4(&many);
    assert_eq!(
        verdict_of(t, names::SERVICE_IPS, &cluster_key()),
        "affinity-pick-2000-pin-10800s"
    );
    // One element per endpoint in each of the path's two maps.
    for map in ["affinity-endpoints", "affinity-pick"] {
        assert_eq!(t.set(map).unwrap().elements.len(), 2000, "{map}");
    }
}

#[test]
fn each_endpoint_is_in_the_endpoints_and_pick_maps_of_its_paths() {
    let rs = build(&state(&[A, B, C]), &settings());
    let t = v4(&rs);
    let elements = |map: &str| -> Vec<(Vec<Atom>, Option<ElemData>)> {
        t.set(map)
            .unwrap()
            .elements
            .iter()
            .map(|e| (e.key.to_vec(), e.data.clone()))
            .collect()
    };
    let with = |key: &[Atom], more: Atom| {
        let mut key = key.to_vec();
        key.push(more);
        key
    };
    for (prefix, key) in [
        ("affinity-", cluster_key()),
        ("affinity-nodeport-", np(30080)),
    ] {
        let mut want: Vec<_> = [A, B, C]
            .iter()
            .map(|ep| {
                let ep = sock(ep);
                (
                    with(&key, Atom::Addr(ep.ip())),
                    Some(ElemData::Value(
                        [Atom::Addr(ep.ip()), Atom::Port(ep.port())].into(),
                    )),
                )
            })
            .collect();
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(elements(&format!("{prefix}endpoints")), want, "{prefix}");
        // Indices in sorted endpoint order.
        let picks: Vec<_> = [A, B, C]
            .iter()
            .enumerate()
            .map(|(i, ep)| {
                (
                    with(&key, Atom::Int(u32::try_from(i).unwrap())),
                    Some(ElemData::Value([Atom::Addr(sock(ep).ip())].into())),
                )
            })
            .collect();
        assert_eq!(elements(&format!("{prefix}pick")), picks, "{prefix}");
        assert!(t.set(&format!("{prefix}pins")).unwrap().elements.is_empty());
    }
    // The endpoints moved: no `pick-3` objects are left.
    assert!(!t.sets.iter().any(|s| s.name.starts_with("pick-")));
    assert!(!t.chains.iter().any(|c| c.name.starts_with("pick-")));
}

#[test]
fn two_endpoints_at_one_address_are_one_endpoint() {
    let rs = build(&state(&[A, "198.51.100.10:9090", B]), &settings());
    let t = v4(&rs);
    assert_eq!(
        verdict_of(t, names::SERVICE_IPS, &cluster_key()),
        "affinity-pick-2-pin-10800s"
    );
    assert_eq!(t.set("affinity-endpoints").unwrap().elements.len(), 2);
}

fn connect(rs: &Ruleset, dst: &str, pins: &DynamicSets) -> Trace {
    connect_on(rs, &[ip("192.0.2.11")], dst, pins)
}

/// A connection from an outside client to `dst` on a node with the local addresses `node`.
fn connect_on(rs: &Ruleset, node: &[IpAddr], dst: &str, pins: &DynamicSets) -> Trace {
    connect_from(rs, node, "192.0.2.200", dst, pins)
}

/// A connection from outside client `src` to `dst` on a node with the local addresses `node`.
fn connect_from(rs: &Ruleset, node: &[IpAddr], src: &str, dst: &str, pins: &DynamicSets) -> Trace {
    let dst = sock(dst);
    eval::evaluate_with(
        rs,
        node,
        Packet {
            src: ip(src),
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
fn a_new_client_is_spread_uniformly_over_the_endpoints() {
    let rs = build(&state(&[B, C]), &settings());
    for dst in ["203.0.113.20:80", "192.0.2.11:30080"] {
        let t = connect(&rs, dst, &DynamicSets::new());
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
fn a_pinned_client_stays_on_its_endpoint_and_a_stale_pin_is_replaced() {
    let first = build(&state(&[A, B, C]), &settings());
    let second = build(&state(&[B, C]), &settings());
    let third = build(&state(&[D, B, C]), &settings());
    let dst = "203.0.113.20:80";
    let none = DynamicSets::new();

    // Pinned to B: B after A went (the pick map renumbered), B after D came.
    let on_b = pins_after(&connect(&first, dst, &none), B);
    assert_eq!(
        on_b.get("affinity-pins")
            .map(|p| p.values().cloned().collect::<Vec<_>>()),
        Some(vec![vec![Atom::Addr(sock(B).ip())]])
    );
    for rs in [&first, &second, &third] {
        let t = connect(rs, dst, &on_b);
        assert_eq!(t.dnat_targets(), [sock(B)]);
        // The pin is refreshed, not rewritten.
        assert_eq!(t.branches[0].dynamic, on_b);
    }

    // Pinned to A, which goes: picked anew among B and C, and the pin now holds the new
    // endpoint, where the client then stays.
    let on_a = pins_after(&connect(&first, dst, &none), A);
    let again = connect(&second, dst, &on_a);
    assert_eq!(again.dnat_targets(), [sock(B), sock(C)]);
    for branch in &again.branches {
        let target = branch.dnat.as_ref().unwrap().target;
        let pins: Vec<_> = branch.dynamic["affinity-pins"].values().cloned().collect();
        assert_eq!(pins, [vec![Atom::Addr(target.ip())]]);
        assert_eq!(
            connect(&third, dst, &branch.dynamic).dnat_targets(),
            [target]
        );
    }
    // A pin to an address the service no longer has never follows another endpoint.
    assert_eq!(
        connect(&third, dst, &on_a).dnat_targets(),
        [sock(D), sock(B), sock(C)]
    );
}

#[test]
fn ipv6_clients_are_pinned_by_a_hash_of_client_and_service() {
    let v6 = "[2001:db8:b::11]:8080";
    let rs = build(&state(&[A, v6]), &settings());
    let dst = "[2001:db8:ffff::20]:80";
    let client =
        |src: &str, pins: &DynamicSets| connect_from(&rs, &[ip("2001:db8:a::11")], src, dst, pins);
    let t = client("2001:db8:c::1", &DynamicSets::new());
    assert_eq!(t.dnat_targets(), [sock("[2001:db8:b::10]:8080"), sock(v6)]);
    let pinned = pins_after(&t, v6);
    let pins = &pinned["affinity-pins"];
    assert_eq!(pins.len(), 1);
    assert!(
        pins.keys()
            .all(|k| matches!(k.as_slice(), [Atom::Int(_), Atom::Int(_)]))
    );
    assert_eq!(client("2001:db8:c::1", &pinned).dnat_targets(), [sock(v6)]);
    // Another client's key is another hash: not pinned.
    assert_eq!(client("2001:db8:c::2", &pinned).dnat_targets().len(), 2);
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
        "affinity-nodeport-pick-3-pin-10800s"
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
    // A goes: the client keeps B; a client pinned to A is picked anew among B and C.
    let second = build(&state(&[B, C]), &all);
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
        svc.load_balancer_ips = vec![ip(LB)].into();
        svc.health_check_node_port = Some(30999);
    }
    for slice in st.slices.values_mut() {
        for ep in &mut slice.endpoints {
            if endpoints.iter().any(|local| sock(local).ip() == ep.addr) {
                ep.locality = Locality::of(Some("node-a".into()), ep.zone().map(Arc::from));
            }
        }
    }
    st
}

/// The endpoints in the `endpoints` map of the path named by `prefix`, under `key`.
fn endpoints_in(table: &Table, prefix: &str, key: &[Atom]) -> Vec<SocketAddr> {
    table
        .set(&format!("{prefix}endpoints"))
        .unwrap()
        .elements
        .iter()
        .filter(|e| e.key.atoms().starts_with(key) && e.key.len() == key.len() + 1)
        .filter_map(|e| match &e.data {
            Some(ElemData::Value(v)) => match *v.atoms() {
                [Atom::Addr(a), Atom::Port(p)] => Some(SocketAddr::new(a, p)),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

#[test]
fn local_policy_lists_have_their_own_maps() {
    let lb = svc(LB, 80);
    let first = build(&local_state(&[A, B, D], C), &settings());
    let t = v4(&first);
    // Outside traffic: the local endpoints.
    let local = vec![sock(D), sock(A), sock(B)];
    assert_eq!(endpoints_in(t, names::AFFINITY_LOCAL, &lb), local);
    assert_eq!(
        endpoints_in(t, names::AFFINITY_NODEPORT_LOCAL, &np(30080)),
        local
    );
    assert_eq!(
        verdict_of(t, names::EXTERNAL_LOCAL_PICKS, &lb),
        "affinity-local-pick-3-pin-10800s"
    );
    assert_eq!(
        verdict_of(t, names::NODEPORT_LOCAL_PICKS, &np(30080)),
        "affinity-nodeport-local-pick-3-pin-10800s"
    );
    // Pods and the node itself still use the cluster-wide list, C included.
    let cluster = vec![sock(D), sock(A), sock(B), sock(C)];
    assert_eq!(endpoints_in(t, names::AFFINITY, &lb), cluster);
    assert_eq!(
        endpoints_in(t, names::AFFINITY_NODEPORT, &np(30080)),
        cluster
    );
    // No Local-policy pick chain or map is left unused.
    assert!(!t.sets.iter().any(|s| s.name.contains("local-pick-")));
    assert!(
        !t.chains.iter().any(
            |c| c.name.starts_with("local-pick-") || c.name.starts_with("nodeport-local-pick-")
        )
    );
}

#[test]
fn an_outside_client_of_a_local_policy_service_stays_on_its_local_endpoint() {
    let first = build(&local_state(&[A, B, D], C), &settings());
    let second = build(&local_state(&[A, B], C), &settings());
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
            // The pin is in the Local-policy pins only.
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
