//! The daemon's parts below the async loop: when syncs run, what is derived from the state after
//! a sync (incrementally, checked against the whole-state computation it replaces), and the sync
//! thread against the in-memory kernel.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::schedule::Schedule;
use super::writer::health_check_addresses;
use super::*;
use crate::config::NodePortAddresses;
use crate::health::HealthCheckService;
use crate::model::{
    Conditions, EndpointSlice, Locality, Node, Protocol, Service, ServicePort, ServicePortName,
    SliceEndpoint, SlicePort, TrafficPolicy, endpoints_for,
};
use crate::nft::{ApplyStats, FakeKernel, Plan, WireTable};
use crate::ruleset::categorize::{NodeView, categorize};

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
    assert!(!s.periodic, "the first sync is not a mere verification");
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
    assert!(s.periodic);
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
    assert!(!s.periodic, "a retry is not a mere verification");
    s.succeeded(t0);
    s.changed();
    assert!(!s.start(t0 + 500 * MS));
}

#[test]
fn a_quiet_verification_does_not_hold_the_next_change_back() {
    let t0 = Instant::now();
    let mut s = Schedule::new(cfg(), t0);
    s.start(t0);
    s.succeeded(t0);
    // The periodic verification, nothing pending; it found nothing to do.
    let tv = s.due(t0);
    assert!(s.start(tv) && s.periodic);
    s.succeeded(tv);
    s.verified_quietly();
    // A change right after it is due at once: the last sync was a sync period ago.
    s.changed();
    assert!(s.due(tv + MS) <= tv + MS);
    // Whereas after a verification that synced, min_sync_period applies.
    let tv2 = tv + cfg().sync_period;
    assert!(s.start(tv2));
    s.succeeded(tv2);
    s.changed();
    assert_eq!(s.due(tv2 + MS), tv2 + cfg().min_sync_period);
}

#[test]
fn a_steady_stream_of_changes_still_verifies_every_sync_period() {
    // Found while writing the soak: with a change at least once per sync period no sync was idle,
    // so none read the kernel back and `nft flush ruleset` stayed unrepaired.
    let t0 = Instant::now();
    let mut s = Schedule::new(cfg(), t0);
    assert!(s.start(t0));
    s.succeeded(t0);
    let mut verified = Vec::new();
    let mut now = t0;
    while now < t0 + 3 * cfg().sync_period + MS {
        now += 500 * MS;
        s.changed();
        assert!(
            s.due(now) <= now,
            "a change 500 ms after the last sync is due"
        );
        if s.start(now) {
            assert!(s.due_only, "verifying because the period came due");
            verified.push(now - t0);
        } else {
            assert!(!s.due_only);
        }
        assert!(!s.periodic, "a change sync is not a mere verification");
        s.succeeded(now);
    }
    assert_eq!(
        verified,
        [1, 2, 3].map(|i| i * cfg().sync_period),
        "one change sync per sync period verifies, and only one"
    );
}

// The whole-state computations the per-Service caches replaced, kept as the reference the caches
// must agree with.

type OracleUdp = BTreeMap<(IpFamily, ServicePortName), BTreeSet<IpAddr>>;

fn oracle_slices_of<'a>(
    index: &HashMap<&ServiceName, Vec<&'a EndpointSlice>>,
    svc: &ServiceName,
    family: IpFamily,
) -> Vec<&'a EndpointSlice> {
    index
        .get(svc)
        .map(|v| v.iter().copied().filter(|s| s.family == family).collect())
        .unwrap_or_default()
}

fn oracle_udp_endpoints(state: &ClusterState) -> OracleUdp {
    let index = state.slices_by_service();
    let mut out = OracleUdp::new();
    for svc in state.services.values() {
        for f in FAMILIES {
            if svc.cluster_ip(f).is_none() {
                continue;
            }
            let slices = oracle_slices_of(&index, &svc.name, f);
            for port in svc.ports.iter().filter(|p| p.protocol == Protocol::Udp) {
                let eps = endpoints_for(&slices, port)
                    .iter()
                    .filter(|ep| ep.conditions.ready || ep.conditions.serving)
                    .map(|ep| ep.addr)
                    .collect();
                out.insert((f, svc.port_name(port)), eps);
            }
        }
    }
    out
}

fn oracle_differs(a: &OracleUdp, b: &OracleUdp, family: IpFamily) -> bool {
    let of = |m: &OracleUdp| -> Vec<(ServicePortName, BTreeSet<IpAddr>)> {
        m.iter()
            .filter(|((f, _), _)| *f == family)
            .map(|((_, n), eps)| (n.clone(), eps.clone()))
            .collect()
    };
    of(a) != of(b)
}

fn oracle_udp_services(state: &ClusterState, family: IpFamily) -> Vec<UdpService> {
    let index = state.slices_by_service();
    let mut out = Vec::new();
    for svc in state.services.values() {
        let Some(cluster_ip) = svc.cluster_ip(family) else {
            continue;
        };
        let ips: Vec<IpAddr> = std::iter::once(cluster_ip)
            .chain(svc.external_ips.iter().copied())
            .chain(svc.load_balancer_ips.iter().copied())
            .filter(|ip| IpFamily::of(ip) == family)
            .collect();
        let slices = oracle_slices_of(&index, &svc.name, family);
        for port in svc.ports.iter().filter(|p| p.protocol == Protocol::Udp) {
            let serving_endpoints = endpoints_for(&slices, port)
                .iter()
                .filter(|ep| ep.conditions.ready || ep.conditions.serving)
                .map(|ep| ep.addr)
                .collect();
            out.push(UdpService {
                ips: ips.clone(),
                port: port.port,
                node_port: port.node_port,
                serving_endpoints,
            });
        }
    }
    out
}

fn oracle_health_check_services(state: &ClusterState, node_name: &str) -> Vec<HealthCheckService> {
    let index = state.slices_by_service();
    let mut out = Vec::new();
    for svc in state.services.values() {
        if svc.external_traffic_policy != TrafficPolicy::Local {
            continue;
        }
        let Some(port) = svc.health_check_node_port else {
            continue;
        };
        let slices = index.get(&svc.name).map(Vec::as_slice).unwrap_or_default();
        let mut local = BTreeSet::new();
        for p in &svc.ports {
            for ep in endpoints_for(slices, p) {
                if ep.node_name == Some(node_name) && ep.conditions.ready {
                    local.insert(ep.addr);
                }
            }
        }
        out.push(HealthCheckService {
            namespace: svc.name.namespace().to_owned(),
            name: svc.name.name().to_owned(),
            port,
            local_endpoints: local.len(),
        });
    }
    out
}

fn oracle_no_local(state: &ClusterState, node_name: &str, family: IpFamily) -> (usize, usize) {
    let index = state.slices_by_service();
    let node = state.nodes.get(node_name);
    let view = NodeView {
        name: node_name,
        zone: node.and_then(|n| n.zone.as_deref()),
    };
    let (mut internal, mut external) = (0, 0);
    for svc in state.services.values() {
        if svc.cluster_ip(family).is_none() {
            continue;
        }
        let slices = oracle_slices_of(&index, &svc.name, family);
        let external_ips = svc
            .external_ips
            .iter()
            .chain(&svc.load_balancer_ips)
            .any(|ip| IpFamily::of(ip) == family);
        for port in &svc.ports {
            let eps = endpoints_for(&slices, port);
            let c = categorize(&eps, &view);
            if !c.has_endpoints || !c.local.is_empty() {
                continue;
            }
            if svc.internal_traffic_policy == TrafficPolicy::Local {
                internal += 1;
            }
            if svc.external_traffic_policy == TrafficPolicy::Local
                && (port.node_port.is_some() || external_ips)
            {
                external += 1;
            }
        }
    }
    (internal, external)
}

/// Asserts that the caches hold exactly what the whole-state computations give for `state`.
fn assert_caches_match(caches: &Caches, state: &ClusterState, context: &str) {
    assert_eq!(
        caches.health_checks(),
        oracle_health_check_services(state, "node-a"),
        "health checks, {context}"
    );
    for f in FAMILIES {
        assert_eq!(
            caches.udp_services(f),
            oracle_udp_services(state, f),
            "UDP services of {f}, {context}"
        );
        assert_eq!(
            caches.no_local(f),
            oracle_no_local(state, "node-a", f),
            "no-local counts of {f}, {context}"
        );
    }
}

/// The delta the whole-state computations imply between two states.
fn oracle_delta(before: &ClusterState, after: &ClusterState) -> Delta {
    let (a, b) = (oracle_udp_endpoints(before), oracle_udp_endpoints(after));
    Delta {
        udp_families: FAMILIES
            .into_iter()
            .filter(|&f| oracle_differs(&a, &b, f))
            .collect(),
        health_checks: oracle_health_check_services(before, "node-a")
            != oracle_health_check_services(after, "node-a"),
    }
}

fn built(state: &ClusterState) -> Caches {
    let mut caches = Caches::default();
    caches.rebuild(state, "node-a");
    caches
}

fn name(n: &str) -> ServiceName {
    ServiceName::new("ns", n)
}

fn svc(n: &str, ip: &str, protocol: Protocol) -> Service {
    Service {
        cluster_ips: vec![ip.parse().unwrap()],
        ports: vec![ServicePort {
            name: String::new(),
            protocol,
            port: 53,
            node_port: Some(30053),
        }],
        ..Service::new(name(n))
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
        locality: Locality::of(Some(node.into()), None),
    }
}

fn node_a() -> Node {
    Node {
        name: "node-a".into(),
        internal_ips: vec!["192.0.2.10".parse().unwrap()],
        external_ips: vec!["198.51.100.10".parse().unwrap()],
        ..Node::default()
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
            }]
            .into(),
            endpoints: endpoints.into(),
        };
        st.slices.insert(slice.name.clone(), slice);
    }
    st.nodes.insert("node-a".into(), node_a());
    st
}

#[test]
fn udp_services_carry_every_address_and_serving_endpoints_only() {
    let mut dns = svc("dns", "10.96.0.10", Protocol::Udp);
    dns.external_ips = vec![
        "203.0.113.1".parse().unwrap(),
        "2001:db8::1".parse().unwrap(),
    ]
    .into();
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
    let caches = built(&st);
    assert_eq!(
        caches.udp_services(IpFamily::V4),
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
    assert!(caches.udp_services(IpFamily::V6).is_empty());
}

#[test]
fn udp_endpoint_changes_are_noticed_per_family_in_full_and_incremental_updates() {
    let a = state(
        vec![svc("dns", "10.96.0.10", Protocol::Udp)],
        vec![("dns", Protocol::Udp, vec![ep("10.0.0.1", "node-a", true)])],
    );
    let b = state(
        vec![svc("dns", "10.96.0.10", Protocol::Udp)],
        vec![("dns", Protocol::Udp, vec![ep("10.0.0.2", "node-a", true)])],
    );
    let mut caches = Caches::default();
    let first = caches.rebuild(&a, "node-a");
    assert_eq!(first.udp_families, BTreeSet::from(FAMILIES), "first build");
    assert!(caches.rebuild(&a, "node-a").udp_families.is_empty());
    assert_eq!(
        caches.rebuild(&b, "node-a").udp_families,
        BTreeSet::from([IpFamily::V4])
    );

    let mut caches = built(&a);
    let changed = BTreeSet::from([name("dns")]);
    let delta = caches.update(&b.subset(&changed), &changed, "node-a");
    assert_eq!(delta.udp_families, BTreeSet::from([IpFamily::V4]));
    assert_eq!(caches, built(&b));
    // The Service deleted: its port's entry goes, which is a change too.
    let mut gone = b.clone();
    gone.services.clear();
    let delta = caches.update(&gone.subset(&changed), &changed, "node-a");
    assert_eq!(delta.udp_families, BTreeSet::from([IpFamily::V4]));
    assert!(caches.udp_services(IpFamily::V4).is_empty());
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
        built(&st).health_checks(),
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
    let mut caches = built(&st);
    assert_eq!(caches.no_local(IpFamily::V4), (1, 1));
    assert_eq!(caches.no_local(IpFamily::V6), (0, 0));
    // "both" gets a local endpoint: the sums follow.
    let mut after = st.clone();
    after.slices.get_mut(&name("both-1")).unwrap().endpoints[0].locality =
        Locality::of(Some("node-a".into()), None);
    let changed = BTreeSet::from([name("both")]);
    caches.update(&after.subset(&changed), &changed, "node-a");
    assert_eq!(caches.no_local(IpFamily::V4), (0, 0));
}

/// A small deterministic generator (xorshift64*): random cases without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap()
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

const SERVICES: usize = 12;
const SLICES: usize = 20;

fn random_policy(rng: &mut Rng) -> TrafficPolicy {
    if rng.chance(50) {
        TrafficPolicy::Local
    } else {
        TrafficPolicy::Cluster
    }
}

fn random_protocol(rng: &mut Rng) -> Protocol {
    *rng.pick(&[Protocol::Tcp, Protocol::Udp, Protocol::Udp, Protocol::Sctp])
}

fn random_service(rng: &mut Rng, n: usize) -> Service {
    let mut cluster_ips = Vec::new();
    if rng.chance(80) {
        cluster_ips.push(format!("10.96.0.{n}").parse().unwrap());
    }
    if rng.chance(40) {
        cluster_ips.push(format!("fd00:96::{n:x}").parse().unwrap());
    }
    let ports = (0..1 + rng.below(2))
        .map(|i| ServicePort {
            name: format!("p{i}"),
            protocol: random_protocol(rng),
            port: 53 + u16::try_from(i).unwrap(),
            node_port: rng
                .chance(40)
                .then_some(30000 + u16::try_from(n).unwrap() * 2 + u16::try_from(i).unwrap()),
        })
        .collect();
    let external = ["203.0.113.7", "2001:db8::7", "198.51.100.7"];
    Service {
        cluster_ips,
        ports,
        external_ips: (0..rng.below(3))
            .map(|_| rng.pick(&external).parse().unwrap())
            .collect(),
        load_balancer_ips: if rng.chance(20) {
            vec![rng.pick(&external).parse().unwrap()].into()
        } else {
            crate::model::Rare::default()
        },
        external_traffic_policy: random_policy(rng),
        internal_traffic_policy: random_policy(rng),
        health_check_node_port: rng.chance(60).then_some(32000 + u16::try_from(n).unwrap()),
        ..Service::new(name(&format!("s{n}")))
    }
}

fn random_slice(rng: &mut Rng, n: usize) -> EndpointSlice {
    let family = *rng.pick(&FAMILIES);
    let ports = (0..rng.below(3))
        .map(|i| SlicePort {
            name: format!("p{i}"),
            protocol: random_protocol(rng),
            port: 5353 + u16::try_from(i).unwrap(),
        })
        .collect();
    let endpoints = (0..rng.below(4))
        .map(|_| {
            let i = 1 + rng.below(5);
            let ready = rng.chance(70);
            SliceEndpoint {
                addr: match family {
                    IpFamily::V4 => format!("10.0.0.{i}"),
                    IpFamily::V6 => format!("fd00:10::{i}"),
                }
                .parse()
                .unwrap(),
                conditions: Conditions {
                    ready,
                    serving: ready || rng.chance(50),
                    terminating: !ready && rng.chance(70),
                },
                locality: Locality::of(
                    rng.pick(&[Some("node-a"), Some("node-b"), None])
                        .map(Arc::from),
                    None,
                ),
            }
        })
        .collect();
    EndpointSlice {
        name: name(&format!("sl{n}")),
        service: name(&format!("s{}", rng.below(SERVICES))),
        family,
        ports,
        endpoints,
    }
}

/// One random change to `state`, like one watch event; returns the Services it concerns as the
/// watch records them (a Service: its name; a slice: its old and new Service).
fn random_change(rng: &mut Rng, state: &mut ClusterState) -> Vec<ServiceName> {
    let n = rng.below(SERVICES.max(SLICES));
    match rng.below(4) {
        0 => {
            let s = random_service(rng, n % SERVICES);
            let name = s.name.clone();
            state.services.insert(name.clone(), s);
            vec![name]
        }
        1 => {
            let name = name(&format!("s{}", n % SERVICES));
            state.services.remove(&name);
            vec![name]
        }
        2 => {
            let s = random_slice(rng, n % SLICES);
            let mut owners = vec![s.service.clone()];
            if let Some(old) = state.slices.insert(s.name.clone(), s) {
                owners.push(old.service);
            }
            owners
        }
        _ => state
            .slices
            .remove(&name(&format!("sl{}", n % SLICES)))
            .map(|old| vec![old.service])
            .unwrap_or_default(),
    }
}

#[test]
fn incremental_cache_updates_equal_the_whole_state_computation() {
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut st = ClusterState::default();
        st.nodes.insert("node-a".into(), node_a());
        for _ in 0..30 {
            random_change(&mut rng, &mut st);
        }
        let mut caches = built(&st);
        assert_caches_match(&caches, &st, &format!("seed {seed}, initial build"));
        for step in 0..60 {
            let before = st.clone();
            let mut changed = BTreeSet::new();
            for _ in 0..1 + rng.below(3) {
                changed.extend(random_change(&mut rng, &mut st));
            }
            let context = format!("seed {seed}, step {step}, changed {changed:?}");
            let delta = caches.update(&st.subset(&changed), &changed, "node-a");
            assert_eq!(delta, oracle_delta(&before, &st), "delta, {context}");
            assert_caches_match(&caches, &st, &context);
            assert_eq!(caches, built(&st), "caches vs a rebuild, {context}");
        }
        // A rebuild reports what changed since the caches' state, like an update does.
        let before = st.clone();
        for _ in 0..5 {
            random_change(&mut rng, &mut st);
        }
        let delta = caches.rebuild(&st, "node-a");
        assert_eq!(delta, oracle_delta(&before, &st), "seed {seed}, rebuild");
        assert_caches_match(&caches, &st, &format!("seed {seed}, rebuild"));
    }
}

/// The in-memory kernel, failing every transaction while `fail` is set.
struct Flaky {
    inner: FakeKernel,
    fail: Arc<AtomicBool>,
}

impl Kernel for Flaky {
    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError> {
        self.inner.read_table(family, name)
    }
    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError> {
        if self.fail.load(Ordering::SeqCst) {
            return Err(NftError::Io {
                context: "test".into(),
                source: io::Error::other("injected failure"),
            });
        }
        self.inner.apply(plan)
    }
    fn delete_tables(&mut self, name: &str) -> Result<usize, NftError> {
        self.inner.delete_tables(name)
    }
    fn generation(&mut self) -> Result<u32, NftError> {
        self.inner.generation()
    }
}

/// The conntrack reconciler's calls: the family and the UDP Service ports it was given.
type Calls = Vec<(IpFamily, Vec<UdpService>)>;

/// A sync thread on the in-memory kernel whose snapshots come from `cluster`, recording the
/// conntrack reconciler's calls instead of touching the host's table.
struct Harness {
    writer: Writer<Flaky>,
    cluster: Arc<Mutex<ClusterState>>,
    reconciled: Arc<Mutex<Calls>>,
    fail: Arc<AtomicBool>,
    _runtime: tokio::runtime::Runtime,
}

impl Harness {
    fn new(initial: ClusterState) -> Harness {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let fail = Arc::new(AtomicBool::new(false));
        let cluster = Arc::new(Mutex::new(initial));
        let reconciled = Arc::new(Mutex::new(Vec::new()));
        let snapshot = cluster.clone();
        let mut writer = Writer::new(
            Syncer::new(Flaky {
                inner: FakeKernel::new(),
                fail: fail.clone(),
            }),
            settings(NodePortAddresses::primary()),
            ProxyHealth::new(Duration::from_secs(60)),
            runtime.handle().clone(),
            Box::new(move || std::sync::Arc::new(snapshot.lock().unwrap().clone())),
        );
        let calls = reconciled.clone();
        writer.reconcile_udp = Box::new(move |f, services| {
            calls.lock().unwrap().push((f, services.to_vec()));
            Ok(0)
        });
        Harness {
            writer,
            cluster,
            reconciled,
            fail,
            _runtime: runtime,
        }
    }

    /// Replaces the cluster with `state`; returns the Services that differ.
    fn set(&mut self, state: ClusterState) -> BTreeSet<ServiceName> {
        let mut cluster = self.cluster.lock().unwrap();
        let names = |s: &ClusterState| -> BTreeSet<ServiceName> {
            s.services
                .keys()
                .cloned()
                .chain(s.slices.values().map(|sl| sl.service.clone()))
                .collect()
        };
        let changed = names(&cluster)
            .union(&names(&state))
            .filter(|n| {
                let one = BTreeSet::from([(*n).clone()]);
                cluster.subset(&one) != state.subset(&one)
            })
            .cloned()
            .collect();
        *cluster = state;
        changed
    }

    fn full(&mut self, verify: bool) -> Result<Synced, NftError> {
        let state = self.cluster.lock().unwrap().clone();
        self.writer.handle(Work::Full {
            state: std::sync::Arc::new(state),
            verify,
        })
    }

    fn changed(&mut self, changed: BTreeSet<ServiceName>) -> Result<Synced, NftError> {
        let scoped = self.cluster.lock().unwrap().subset(&changed);
        self.writer.handle(Work::Changed {
            scoped,
            changed,
            verify: false,
        })
    }

    fn reconciled(&self) -> Calls {
        std::mem::take(&mut *self.reconciled.lock().unwrap())
    }
}

fn dns_and_web(dns_endpoint: &str, web_endpoint: &str) -> ClusterState {
    let mut web = svc("web", "10.96.0.20", Protocol::Tcp);
    web.internal_traffic_policy = TrafficPolicy::Local;
    state(
        vec![svc("dns", "10.96.0.10", Protocol::Udp), web],
        vec![
            ("dns", Protocol::Udp, vec![ep(dns_endpoint, "node-b", true)]),
            ("web", Protocol::Tcp, vec![ep(web_endpoint, "node-b", true)]),
        ],
    )
}

#[test]
fn the_sync_thread_reconciles_conntrack_only_after_udp_endpoints_changed() {
    let mut h = Harness::new(dns_and_web("10.0.0.1", "10.0.1.1"));
    let first = h.full(true).unwrap();
    assert_eq!(first.kind, SyncKind::Full);
    assert_eq!(
        first.no_local,
        vec![(IpFamily::V4, 1, 0), (IpFamily::V6, 0, 0)]
    );
    // The first sync reconciles every family: stale entries may predate a restart.
    let calls = h.reconciled();
    assert_eq!(
        calls.iter().map(|(f, _)| *f).collect::<Vec<_>>(),
        FAMILIES.to_vec()
    );
    assert_eq!(
        calls[0].1,
        oracle_udp_services(&h.cluster.lock().unwrap(), IpFamily::V4)
    );

    // A TCP Service's endpoints change: no reconciliation.
    let changed = h.set(dns_and_web("10.0.0.1", "10.0.1.2"));
    assert_eq!(changed, BTreeSet::from([name("web")]));
    h.changed(changed).unwrap();
    assert!(h.reconciled().is_empty());

    // The UDP Service's endpoint changes: its family is reconciled, with every UDP Service.
    let changed = h.set(dns_and_web("10.0.0.2", "10.0.1.2"));
    let synced = h.changed(changed).unwrap();
    let calls = h.reconciled();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].0, IpFamily::V4);
    assert_eq!(
        calls[0].1[0].serving_endpoints,
        vec!["10.0.0.2".parse::<IpAddr>().unwrap()]
    );
    assert_eq!(synced.no_local[0], (IpFamily::V4, 1, 0));

    // A verification with nothing changed reconciles nothing.
    h.full(true).unwrap();
    assert!(h.reconciled().is_empty());
}

#[test]
fn a_failed_sync_leaves_the_caches_so_the_retry_still_reconciles() {
    let mut h = Harness::new(dns_and_web("10.0.0.1", "10.0.1.1"));
    h.full(true).unwrap();
    h.reconciled();
    let changed = h.set(dns_and_web("10.0.0.2", "10.0.1.1"));
    h.fail.store(true, Ordering::SeqCst);
    assert!(h.changed(changed).is_err());
    assert!(h.reconciled().is_empty(), "nothing after a failed sync");
    h.fail.store(false, Ordering::SeqCst);
    // The loop retries a failure with a verifying full sync.
    let retry = h.full(true).unwrap();
    assert_eq!(retry.kind, SyncKind::Full);
    let calls = h.reconciled();
    assert_eq!(
        calls.iter().map(|(f, _)| *f).collect::<Vec<_>>(),
        [IpFamily::V4]
    );
}

#[test]
fn a_failed_conntrack_reconciliation_is_retried_on_the_next_sync() {
    let mut h = Harness::new(dns_and_web("10.0.0.1", "10.0.1.1"));
    h.full(true).unwrap();
    h.reconciled();
    let failing = Arc::new(AtomicBool::new(true));
    let calls = h.reconciled.clone();
    let fail = failing.clone();
    h.writer.reconcile_udp = Box::new(move |f, services| {
        calls.lock().unwrap().push((f, services.to_vec()));
        if fail.load(Ordering::SeqCst) {
            return Err(ConntrackError::Io {
                context: "test".into(),
                source: io::Error::other("injected timeout"),
            });
        }
        Ok(0)
    });
    let changed = h.set(dns_and_web("10.0.0.2", "10.0.1.1"));
    h.changed(changed).unwrap();
    assert_eq!(h.reconciled().len(), 1, "tried once, and it failed");
    failing.store(false, Ordering::SeqCst);
    // A sync that changes no UDP Service (here: the TCP one) still retries the failed family.
    let changed = h.set(dns_and_web("10.0.0.2", "10.0.1.2"));
    h.changed(changed).unwrap();
    let calls = h.reconciled();
    assert_eq!(
        calls.iter().map(|(f, _)| *f).collect::<Vec<_>>(),
        [IpFamily::V4]
    );
    // Once it succeeded, nothing more is retried.
    let changed = h.set(dns_and_web("10.0.0.2", "10.0.1.3"));
    h.changed(changed).unwrap();
    assert!(h.reconciled().is_empty());
}

#[test]
fn a_changed_request_the_syncer_cannot_do_alone_is_synced_from_a_full_snapshot() {
    let mut h = Harness::new(dns_and_web("10.0.0.1", "10.0.1.1"));
    h.full(true).unwrap();
    // The request names only "web", but the cluster also changed "dns" meanwhile (the snapshot
    // is newer than the request): whatever path ran, the caches must match the state synced.
    let mut st = dns_and_web("10.0.0.3", "10.0.1.2");
    st.services
        .get_mut(&name("web"))
        .unwrap()
        .internal_traffic_policy = TrafficPolicy::Cluster;
    h.set(st.clone());
    let synced = h
        .changed(BTreeSet::from([name("web"), name("dns")]))
        .unwrap();
    match synced.kind {
        // The syncer synced only the changed Services.
        SyncKind::Partial => assert_eq!(synced.rebuilt, 2),
        // It asked for a full sync: the sync thread took its own snapshot.
        SyncKind::Full => assert_eq!(*synced.state, st),
    }
    assert_eq!(synced.no_local[0], (IpFamily::V4, 0, 0));
    assert_caches_match(&h.writer.caches, &st, "after the changed request");
    assert_eq!(h.writer.caches, built(&st));
}

#[test]
fn a_change_sync_due_to_verify_stays_incremental_unless_someone_else_committed() {
    let mut h = Harness::new(dns_and_web("10.0.0.1", "10.0.1.1"));
    h.full(true).unwrap();
    let due = |h: &mut Harness, changed: BTreeSet<ServiceName>| {
        let scoped = h.cluster.lock().unwrap().subset(&changed);
        h.writer.handle(Work::Changed {
            scoped,
            changed,
            verify: true,
        })
    };
    // Nobody else committed: the change sync is the verification, one Service rebuilt.
    let changed = h.set(dns_and_web("10.0.0.2", "10.0.1.1"));
    let quiet = due(&mut h, changed).unwrap();
    assert_eq!(quiet.kind, SyncKind::Partial);
    assert_eq!(quiet.rebuilt, 1);
    assert!(!quiet.outcome.full);
    // Someone deletes our IPv4 table: the next one syncs everything from a read-back.
    let key = (IpFamily::V4, "nodeproxy".to_string());
    h.writer.syncer.kernel().inner.tables_mut().remove(&key);
    let changed = h.set(dns_and_web("10.0.0.3", "10.0.1.1"));
    let repaired = due(&mut h, changed).unwrap();
    assert_eq!(repaired.kind, SyncKind::Full);
    assert!(repaired.outcome.full, "read back");
    let fresh = {
        let mut k = FakeKernel::new();
        let state = h.cluster.lock().unwrap().clone();
        let mut settings = h.writer.settings.clone();
        settings.own_tables = false;
        crate::nft::sync(&mut k, crate::ruleset::build(&state, &settings)).unwrap();
        k.tables[&key].clone()
    };
    assert_eq!(h.writer.syncer.kernel().inner.tables[&key], fresh);
}

#[test]
fn a_verification_reads_the_kernel_back_only_when_someone_else_committed() {
    let mut h = Harness::new(dns_and_web("10.0.0.1", "10.0.1.1"));
    h.full(true).unwrap();
    h.reconciled();
    // Nobody committed since: nothing rebuilt, nothing read, health checks left alone.
    let quiet = h.writer.handle(Work::Verify).unwrap();
    assert_eq!(quiet.kind, SyncKind::Partial);
    assert_eq!(quiet.rebuilt, 0);
    assert!(!quiet.outcome.full);
    assert_eq!(quiet.no_local[0], (IpFamily::V4, 1, 0));
    assert!(h.reconciled().is_empty());
    // Someone deletes our IPv4 table: the next verification rebuilds and repairs it.
    let key = (IpFamily::V4, "nodeproxy".to_string());
    let before = h.writer.syncer.kernel().inner.tables[&key].clone();
    h.writer.syncer.kernel().inner.tables_mut().remove(&key);
    let repaired = h.writer.handle(Work::Verify).unwrap();
    assert_eq!(repaired.kind, SyncKind::Full);
    assert!(repaired.outcome.full, "read back");
    assert_eq!(h.writer.syncer.kernel().inner.tables[&key], before);
    // And it is quiet again afterwards.
    let quiet = h.writer.handle(Work::Verify).unwrap();
    assert_eq!(quiet.rebuilt, 0);
    // A full rebuild is forced once it is overdue, even with nothing changed.
    h.writer.last_full_rebuild = Some(Instant::now() - FULL_REBUILD_PERIOD);
    let forced = h.writer.handle(Work::Verify).unwrap();
    assert_eq!(forced.kind, SyncKind::Full);
    assert_eq!(
        forced.outcome.report.empty_plans, forced.outcome.report.tables,
        "nothing to change"
    );
}
