//! Unit tests of the ruleset builder.
use super::*;
use crate::model::{
    Conditions, EndpointSlice, Locality, Node, Protocol, Service, ServiceName, ServicePort,
    SliceEndpoint, SlicePort,
};
use crate::ruleset::render::render;

fn name(ns: &str, n: &str) -> ServiceName {
    ServiceName::new(ns, n)
}

fn service(
    ns: &str,
    n: &str,
    ips: &[&str],
    ports: &[(&str, Protocol, u16, Option<u16>)],
) -> Service {
    Service {
        cluster_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        ports: ports
            .iter()
            .map(|(pn, proto, port, np)| ServicePort {
                name: pn.to_string(),
                protocol: *proto,
                port: *port,
                node_port: *np,
            })
            .collect(),
        ..Service::new(name(ns, n))
    }
}

fn slice(
    ns: &str,
    svc: &str,
    slice_name: &str,
    ports: &[(&str, Protocol, u16)],
    eps: &[(&str, bool, Option<&str>)],
) -> EndpointSlice {
    let first: IpAddr = eps[0].0.parse().unwrap();
    EndpointSlice {
        name: name(ns, slice_name),
        service: name(ns, svc),
        family: IpFamily::of(&first),
        ports: ports
            .iter()
            .map(|(n, p, port)| SlicePort {
                name: n.to_string(),
                protocol: *p,
                port: *port,
            })
            .collect(),
        endpoints: eps
            .iter()
            .map(|(a, ready, node)| SliceEndpoint {
                addr: a.parse().unwrap(),
                conditions: Conditions {
                    ready: *ready,
                    serving: *ready,
                    terminating: false,
                },
                locality: Locality::of(node.map(Arc::from), None),
            })
            .collect(),
    }
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

fn state() -> ClusterState {
    let mut st = ClusterState::default();
    let web = service(
        "shop",
        "web",
        &["203.0.113.20"],
        &[("http", Protocol::Tcp, 80, Some(30080))],
    );
    let empty = service(
        "shop",
        "empty",
        &["203.0.113.30"],
        &[("", Protocol::Tcp, 80, Some(30090))],
    );
    st.services.insert(web.name.clone(), web);
    st.services.insert(empty.name.clone(), empty);
    let s = slice(
        "shop",
        "web",
        "web-1",
        &[("http", Protocol::Tcp, 8080)],
        &[
            ("198.51.100.10", true, Some("node-a")),
            ("198.51.100.130", true, Some("node-b")),
            ("198.51.100.11", false, Some("node-a")),
        ],
    );
    st.slices.insert(s.name.clone(), s);
    st.nodes.insert(
        "node-a".into(),
        Node {
            name: "node-a".into(),
            internal_ips: vec!["192.0.2.11".parse().unwrap()],
            ..Node::default()
        },
    );
    st
}

fn set<'a>(t: &'a Table, name: &str) -> &'a Set {
    t.set(name).unwrap_or_else(|| panic!("no set {name}"))
}

#[test]
fn ready_endpoints_become_pick_map_elements_and_unready_ones_do_not() {
    let rs = build(&state(), &settings());
    let t = rs.table(IpFamily::V4).unwrap();
    let svc = set(t, names::SERVICE_IPS);
    assert_eq!(svc.elements.len(), 1);
    assert_eq!(
        svc.elements[0].data,
        Some(ElemData::Verdict(Verdict::Goto("pick-2".into())))
    );
    let picks = set(t, "pick-2-endpoints");
    let targets: Vec<_> = picks
        .elements
        .iter()
        .map(|e| e.data.clone().unwrap())
        .collect();
    assert_eq!(targets.len(), 2);
    assert!(!render(&rs).contains("198.51.100.11"));
    assert!(t.chain("pick-2").is_some());
    assert!(t.chain("pick-3").is_none());
}

#[test]
fn service_without_endpoints_is_rejected_on_cluster_ip_and_node_port() {
    let rs = build(&state(), &settings());
    let t = rs.table(IpFamily::V4).unwrap();
    let reject = Some(ElemData::Verdict(Verdict::Goto(names::REJECT_CHAIN.into())));
    let ne = set(t, names::NO_ENDPOINT_SERVICES);
    assert_eq!(ne.elements.len(), 1);
    assert_eq!(
        ne.elements[0].key.atoms()[0],
        Atom::Addr("203.0.113.30".parse().unwrap())
    );
    assert_eq!(ne.elements[0].data, reject);
    let nn = set(t, names::NO_ENDPOINT_NODEPORTS);
    assert_eq!(
        nn.elements[0].key,
        vec![Atom::Proto(Protocol::Tcp), Atom::Port(30090)]
    );
    assert_eq!(nn.elements[0].data, reject);
    assert_eq!(set(t, names::CLUSTER_IPS).elements.len(), 2);
}

#[test]
fn hairpin_set_holds_only_local_endpoints() {
    let rs = build(&state(), &settings());
    let t = rs.table(IpFamily::V4).unwrap();
    let hp = set(t, names::HAIRPIN_CONNECTIONS);
    assert_eq!(hp.elements.len(), 1);
    let a: IpAddr = "198.51.100.10".parse().unwrap();
    assert_eq!(
        hp.elements[0].key,
        vec![
            Atom::Addr(a),
            Atom::Addr(a),
            Atom::Proto(Protocol::Tcp),
            Atom::Port(8080)
        ]
    );
}

#[test]
fn node_port_addresses_are_the_nodes_primary_ip_and_never_guessed() {
    let rs = build(&state(), &settings());
    let t = rs.table(IpFamily::V4).unwrap();
    let ips = set(t, names::NODEPORT_IPS);
    assert_eq!(
        ips.elements[0].key,
        vec![Atom::Addr("192.0.2.11".parse().unwrap())]
    );

    let mut other = settings();
    other.node_name = "node-missing".into();
    let rs = build(&state(), &other);
    assert!(
        set(rs.table(IpFamily::V4).unwrap(), names::NODEPORT_IPS)
            .elements
            .is_empty()
    );
    assert!(
        diagnostics(&state(), &other)
            .iter()
            .any(|d| d.contains("not found"))
    );
}

#[test]
fn masquerade_rule_follows_cluster_cidr_or_masquerade_all() {
    let rs = build(&state(), &settings());
    let text = render(&rs);
    assert!(text.contains(
        "ip daddr @cluster-ips ip saddr != 198.51.100.0/24 meta mark set meta mark | 0x00004000"
    ));
    let mut all = settings();
    all.masquerade_all = true;
    all.mark = 1 << 3;
    let text = render(&build(&state(), &all));
    assert!(text.contains("ip daddr @cluster-ips meta mark set meta mark | 0x00000008\n"));
    assert!(text.contains("meta mark & 0x00000008 != 0x00000000"));
}

#[test]
fn ipv4_only_services_leave_the_ipv6_table_empty_of_elements() {
    let rs = build(&state(), &settings());
    let t6 = rs.table(IpFamily::V6).unwrap();
    assert!(t6.sets.iter().all(|s| s.elements.is_empty()));
    assert!(t6.chains.iter().all(|c| !c.name.starts_with("pick-")));
}

#[test]
fn build_is_deterministic() {
    assert_eq!(build(&state(), &settings()), build(&state(), &settings()));
}

#[test]
fn address_warnings_name_clusterips_outside_their_familys_ranges_and_shared_nodeports() {
    let mut st = ClusterState::default();
    let http = |n, ip, np| service("a", n, &[ip], &[("", Protocol::Tcp, 80, np)]);
    for svc in [
        http("in4", "10.96.0.10", Some(30001)),
        http("out4", "10.200.0.1", None),
        http("in6", "fd00:10:96::10", None),
        http("out6", "fd00:99::1", None),
        // The NodePort of a/in4 again: on TCP a clash, on UDP not.
        service(
            "b",
            "again",
            &["10.96.0.11"],
            &[
                ("t", Protocol::Tcp, 443, Some(30001)),
                ("u", Protocol::Udp, 53, Some(30001)),
            ],
        ),
        // One Service giving two of its ports the same NodePort.
        service(
            "c",
            "twice",
            &["10.96.0.12"],
            &[
                ("x", Protocol::Tcp, 81, Some(30002)),
                ("y", Protocol::Tcp, 82, Some(30002)),
            ],
        ),
    ] {
        st.services.insert(svc.name.clone(), svc);
    }
    let mut s = settings();
    s.service_cidrs = vec![
        "10.96.0.0/16".parse().unwrap(),
        "fd00:10:96::/108".parse().unwrap(),
    ];
    let warnings = address_warnings(&st, &s);
    let expected = [
        "Service a/out4: ClusterIP 10.200.0.1 is outside --service-cidr (10.96.0.0/16): the API \
         server allocates ClusterIPs inside it; is the flag or the object wrong?",
        "Service a/out6: ClusterIP fd00:99::1 is outside --service-cidr (fd00:10:96::/108): the \
         API server allocates ClusterIPs inside it; is the flag or the object wrong?",
        "b/again:t and a/in4:tcp both claim NodePort 30001/tcp; a/in4:tcp keeps it",
        "c/twice:y and c/twice:x both claim NodePort 30002/tcp; c/twice:x keeps it",
    ];
    assert_eq!(warnings, expected);
}

#[test]
fn service_ranges_are_the_flags_else_every_service_cidr_objects() {
    let mut state = ClusterState::default();
    state.service_cidrs.insert(
        "kubernetes".into(),
        vec![
            "10.96.0.0/16".parse().unwrap(),
            "fd00:10:96::/108".parse().unwrap(),
        ],
    );
    state
        .service_cidrs
        .insert("extension".into(), vec!["10.97.0.0/16".parse().unwrap()]);
    // The same range twice (two objects) is one range.
    state
        .service_cidrs
        .insert("again".into(), vec!["10.97.0.0/16".parse().unwrap()]);
    let mut s = settings();
    s.service_cidrs = Vec::new();
    let ranges: Vec<String> = s
        .service_ranges(&state)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(ranges, ["10.96.0.0/16", "10.97.0.0/16", "fd00:10:96::/108"]);
    s.service_cidrs = vec!["10.100.0.0/16".parse().unwrap()];
    let ranges: Vec<String> = s
        .service_ranges(&state)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        ranges,
        ["10.100.0.0/16"],
        "--service-cidr replaces the objects"
    );
}

#[test]
fn sort_stably_is_the_stable_sort_by_key() {
    // Keys with many ties (16 distinct), each element tagged with its position in its comment.
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    for len in [0, 1, 2, 3, 17, 500] {
        let elements: Vec<Element> = (0..len)
            .map(|i| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                tagged(vec![Atom::Port(u16::try_from(seed % 16).unwrap())], i)
            })
            .collect();
        assert_sorts_as_std_does(elements);
    }
}

/// An element with `key`, tagged with `i` in its comment so that ties can be told apart.
fn tagged(key: Vec<Atom>, i: usize) -> Element {
    Element {
        key: key.into(),
        data: None,
        comment: Some(Comment::from(i.to_string())),
        origin: None,
    }
}

/// `sort_stably` orders `elements` as std's stable sort by key does.
fn assert_sorts_as_std_does(elements: Vec<Element>) {
    let mut expected = elements.clone();
    expected.sort_by(|a, b| a.key.cmp(&b.key));
    let mut sorted = elements;
    sort_stably(&mut sorted);
    assert_eq!(sorted, expected, "{} elements", expected.len());
}

#[test]
fn sort_stably_orders_mixed_keys_as_their_atoms_do() {
    // Every kind of atom, IPv6 addresses that share their first 60 bits, IPv4 ones at both
    // ends, empty keys; keys of up to five atoms, with ties.
    let atoms = [
        Atom::Addr("0.0.0.0".parse().unwrap()),
        Atom::Addr("10.96.0.1".parse().unwrap()),
        Atom::Addr("255.255.255.255".parse().unwrap()),
        Atom::Addr("::".parse().unwrap()),
        Atom::Addr("2001:db8::1".parse().unwrap()),
        Atom::Addr("2001:db8::2".parse().unwrap()),
        Atom::Addr("2001:db8:0:f::2".parse().unwrap()),
        Atom::Addr("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff".parse().unwrap()),
        Atom::Proto(Protocol::Tcp),
        Atom::Proto(Protocol::Sctp),
        Atom::Port(0),
        Atom::Port(80),
        Atom::Port(256),
        Atom::Port(65535),
        Atom::Int(1),
        Atom::Int(65536),
        Atom::Int(0),
        Atom::Int(u32::MAX),
        Atom::Net("10.0.0.0/8".parse().unwrap()),
        Atom::Net("2001:db8::/32".parse().unwrap()),
    ];
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |n: usize| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        usize::try_from(seed % n as u64).unwrap()
    };
    let elements: Vec<Element> = (0..3000)
        .map(|i| tagged((0..next(6)).map(|_| atoms[next(atoms.len())]).collect(), i))
        .collect();
    assert_sorts_as_std_does(elements);
}

#[test]
fn sort_stably_orders_pick_keys_whole_in_their_prefix_and_not() {
    // Pick-map keys (address . protocol . port . slot) over random IPv4 and IPv6 addresses, so
    // that every byte of the prefix varies somewhere, many keys repeated; IPv6 keys share
    // prefixes and are told apart by the key.
    let mut seed = 0x1234_5678_9abc_def1_u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let elements: Vec<Element> = (0..20_000)
        .map(|i| {
            let r = next();
            // A few hundred addresses, their bits spread over every byte of the prefix.
            let pool = u32::try_from((r >> 32) % 300)
                .unwrap()
                .wrapping_mul(0x9e37_79b9);
            let addr = if (r >> 24) % 3 == 0 {
                // The low bits, which the prefix has no room for, differ.
                let v6 = u128::from(pool) << 96 | u128::from(pool) << 40 | u128::from(r % 4);
                Atom::Addr(std::net::Ipv6Addr::from(v6).into())
            } else {
                Atom::Addr(std::net::Ipv4Addr::from(pool).into())
            };
            let proto =
                [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][usize::try_from(r % 3).unwrap()];
            let port = u16::try_from((r >> 8) % 4).unwrap();
            let slot = u32::try_from((r >> 16) % 3).unwrap();
            tagged(
                vec![addr, Atom::Proto(proto), Atom::Port(port), Atom::Int(slot)],
                i,
            )
        })
        .collect();
    assert_sorts_as_std_does(elements);
}
