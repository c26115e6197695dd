//! The daemon's pure parts: when syncs run, and what is derived from the state after a sync.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;
use crate::config::NodePortAddresses;
use crate::model::{Conditions, Node, Service, ServiceName, ServicePort, SliceEndpoint, SlicePort};

const MS: Duration = Duration::from_millis(1);

fn cfg() -> LoopConfig {
    LoopConfig {
        min_sync_period: 100 * MS,
        sync_period: Duration::from_secs(10),
    }
}

#[test]
fn first_sync_is_immediate_and_verifies() {
    let t0 = Instant::now();
    let mut s = Schedule::new(cfg(), t0);
    assert_eq!(s.due(t0), t0);
    assert!(s.start(t0));
}

#[test]
fn changes_wait_for_min_sync_period_and_do_not_verify() {
    let t0 = Instant::now();
    let mut s = Schedule::new(cfg(), t0);
    s.start(t0);
    s.succeeded(t0);
    // Idle: the next sync is the periodic verification.
    assert_eq!(s.due(t0 + MS), t0 + cfg().sync_period);
    // Several changes: one sync, min_sync_period after the previous start.
    s.changed();
    s.changed();
    assert_eq!(s.due(t0 + 10 * MS), t0 + 100 * MS);
    // Long after: already due (a deadline in the past fires at once).
    assert!(s.due(t0 + 500 * MS) <= t0 + 500 * MS);
    assert!(!s.start(t0 + 500 * MS));
}

#[test]
fn periodic_sync_verifies() {
    let t0 = Instant::now();
    let mut s = Schedule::new(cfg(), t0);
    s.start(t0);
    s.succeeded(t0);
    let at = s.due(t0);
    assert!(s.start(at));
}

#[test]
fn failures_back_off_up_to_the_sync_period_and_verify() {
    let t0 = Instant::now();
    let mut s = Schedule::new(cfg(), t0);
    s.start(t0);
    s.succeeded(t0);
    s.changed();
    s.start(t0);
    let mut delays = Vec::new();
    for _ in 0..6 {
        delays.push(s.failed(t0));
    }
    assert_eq!(delays[0], FIRST_BACKOFF);
    assert_eq!(delays[1], 2 * FIRST_BACKOFF);
    assert_eq!(*delays.last().unwrap(), cfg().sync_period);
    assert_eq!(s.due(t0), t0 + cfg().sync_period);
    assert!(s.start(t0 + cfg().sync_period));
    s.succeeded(t0);
    s.changed();
    assert!(!s.start(t0 + cfg().sync_period));
}

fn name(n: &str) -> ServiceName {
    ServiceName {
        namespace: "ns".into(),
        name: n.into(),
    }
}

fn svc(n: &str, ip: &str, protocol: Protocol) -> Service {
    Service {
        name: name(n),
        cluster_ips: vec![ip.parse().unwrap()],
        ports: vec![ServicePort {
            name: String::new(),
            protocol,
            port: 53,
            node_port: Some(30053),
        }],
        external_ips: vec![],
        load_balancer_ips: vec![],
        load_balancer_source_ranges: vec![],
        external_traffic_policy: TrafficPolicy::Cluster,
        internal_traffic_policy: TrafficPolicy::Cluster,
        health_check_node_port: None,
        session_affinity_timeout: None,
    }
}

fn ep(addr: &str, node: &str, ready: bool) -> SliceEndpoint {
    SliceEndpoint {
        addr: addr.parse().unwrap(),
        conditions: Conditions {
            ready,
            serving: ready,
            terminating: !ready,
        },
        node_name: Some(node.into()),
        zone: None,
        zone_hints: vec![],
        node_hints: vec![],
    }
}

fn state(services: Vec<Service>, eps: Vec<(&str, Protocol, Vec<SliceEndpoint>)>) -> ClusterState {
    let mut st = ClusterState::default();
    for s in services {
        st.services.insert(s.name.clone(), s);
    }
    for (svc, protocol, endpoints) in eps {
        let slice = EndpointSlice {
            name: name(&format!("{svc}-1")),
            service: name(svc),
            family: IpFamily::V4,
            ports: vec![SlicePort {
                name: String::new(),
                protocol,
                port: 5353,
            }],
            endpoints,
        };
        st.slices.insert(slice.name.clone(), slice);
    }
    st.nodes.insert(
        "node-a".into(),
        Node {
            name: "node-a".into(),
            internal_ips: vec!["192.0.2.10".parse().unwrap()],
            external_ips: vec!["198.51.100.10".parse().unwrap()],
            ..Node::default()
        },
    );
    st
}

#[test]
fn udp_services_carry_every_address_and_serving_endpoints_only() {
    let mut dns = svc("dns", "10.96.0.10", Protocol::Udp);
    dns.external_ips = vec![
        "203.0.113.1".parse().unwrap(),
        "2001:db8::1".parse().unwrap(),
    ];
    let st = state(
        vec![dns, svc("web", "10.96.0.20", Protocol::Tcp)],
        vec![(
            "dns",
            Protocol::Udp,
            vec![
                ep("10.0.0.1", "node-a", true),
                ep("10.0.0.2", "node-b", false),
            ],
        )],
    );
    let v4 = udp_services(&st, IpFamily::V4);
    assert_eq!(
        v4,
        vec![UdpService {
            ips: vec![
                "10.96.0.10".parse().unwrap(),
                "203.0.113.1".parse().unwrap()
            ],
            port: 53,
            node_port: Some(30053),
            serving_endpoints: vec!["10.0.0.1".parse().unwrap()],
        }]
    );
    assert!(udp_services(&st, IpFamily::V6).is_empty());
}

#[test]
fn udp_endpoint_changes_are_noticed_per_family() {
    let a = state(
        vec![svc("dns", "10.96.0.10", Protocol::Udp)],
        vec![("dns", Protocol::Udp, vec![ep("10.0.0.1", "node-a", true)])],
    );
    let b = state(
        vec![svc("dns", "10.96.0.10", Protocol::Udp)],
        vec![("dns", Protocol::Udp, vec![ep("10.0.0.2", "node-a", true)])],
    );
    let (ea, eb) = (udp_endpoints(&a), udp_endpoints(&b));
    assert!(!differs(&ea, &ea.clone(), IpFamily::V4));
    assert!(differs(&ea, &eb, IpFamily::V4));
    assert!(!differs(&ea, &eb, IpFamily::V6));
}

#[test]
fn health_check_services_count_local_ready_endpoints() {
    let mut lb = svc("lb", "10.96.0.30", Protocol::Tcp);
    lb.external_traffic_policy = TrafficPolicy::Local;
    lb.health_check_node_port = Some(32000);
    let mut cluster = svc("other", "10.96.0.31", Protocol::Tcp);
    cluster.health_check_node_port = Some(32001);
    let st = state(
        vec![lb, cluster],
        vec![(
            "lb",
            Protocol::Tcp,
            vec![
                ep("10.0.0.1", "node-a", true),
                ep("10.0.0.2", "node-a", false),
                ep("10.0.0.3", "node-b", true),
            ],
        )],
    );
    assert_eq!(
        health_check_services(&st, "node-a"),
        vec![HealthCheckService {
            namespace: "ns".into(),
            name: "lb".into(),
            port: 32000,
            local_endpoints: 1,
        }]
    );
}

fn settings(npa: NodePortAddresses) -> Settings {
    let config = Config {
        nodeport_addresses: npa,
        ..Config::default()
    };
    Settings::new(&config, "node-a".into())
}

#[test]
fn health_check_addresses_follow_nodeport_addresses() {
    let st = state(vec![], vec![]);
    assert_eq!(
        health_check_addresses(&st, &settings(NodePortAddresses::primary())),
        Some(vec!["192.0.2.10".parse().unwrap()])
    );
    let all = NodePortAddresses {
        primary: false,
        all: true,
        cidrs: vec![],
    };
    assert_eq!(health_check_addresses(&st, &settings(all)), Some(vec![]));
    let none = NodePortAddresses {
        primary: false,
        all: false,
        cidrs: vec!["172.16.0.0/12".parse().unwrap()],
    };
    assert_eq!(health_check_addresses(&st, &settings(none)), None);
    assert_eq!(
        health_check_addresses(
            &ClusterState::default(),
            &settings(NodePortAddresses::primary())
        ),
        None
    );
}

#[test]
fn no_local_endpoints_counts_local_policies_without_local_endpoints() {
    let mut both = svc("both", "10.96.0.40", Protocol::Tcp);
    both.internal_traffic_policy = TrafficPolicy::Local;
    both.external_traffic_policy = TrafficPolicy::Local;
    let mut local_here = both.clone();
    local_here.name = name("here");
    let mut no_eps = both.clone();
    no_eps.name = name("none");
    let st = state(
        vec![both, local_here, no_eps],
        vec![
            ("both", Protocol::Tcp, vec![ep("10.0.0.1", "node-b", true)]),
            ("here", Protocol::Tcp, vec![ep("10.0.0.2", "node-a", true)]),
        ],
    );
    assert_eq!(no_local_endpoints(&st, "node-a", IpFamily::V4), (1, 1));
    assert_eq!(no_local_endpoints(&st, "node-a", IpFamily::V6), (0, 0));
}
