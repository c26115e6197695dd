//! Unit tests of the single writer against the in-memory kernel.
use std::collections::BTreeSet;

use super::*;
use crate::config::Config;
use crate::model::{
    Conditions, Hints, Locality, Node, Protocol, ServicePort, SliceEndpoint, SlicePort,
    TrafficPolicy,
};
use crate::nft::{ApplyStats, FakeKernel, Op, Plan, RejectedOp};
use crate::sync::incremental;

fn name(ns: &str, n: &str) -> ServiceName {
    ServiceName::new(ns, n)
}

/// A ClusterIP Service `ns/n` on port 80 with one ready endpoint (port 8080 on node-b); also
/// the fixture of `nft::preview`'s tests.
pub(crate) fn add_service(state: &mut ClusterState, n: &str, ip: &str, endpoint: &str) {
    let svc = Service {
        cluster_ips: vec![ip.parse().unwrap()],
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 80,
            node_port: None,
        }],
        ..Service::new(name("ns", n))
    };
    let slice = EndpointSlice {
        name: name("ns", &format!("{n}-1")),
        service: svc.name.clone(),
        family: IpFamily::V4,
        ports: vec![SlicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 8080,
        }]
        .into(),
        endpoints: vec![SliceEndpoint {
            addr: endpoint.parse().unwrap(),
            conditions: Conditions {
                ready: true,
                serving: true,
                terminating: false,
            },
            locality: Locality::of(Some("node-b".into()), None),
        }]
        .into(),
    };
    state.slices.insert(slice.name.clone(), slice);
    state.services.insert(svc.name.clone(), svc);
}

fn state() -> ClusterState {
    let mut st = ClusterState::default();
    st.nodes.insert(
        "node-a".into(),
        Node {
            name: "node-a".into(),
            internal_ips: vec!["192.0.2.11".parse().unwrap()],
            ..Node::default()
        },
    );
    add_service(&mut st, "good", "203.0.113.10", "198.51.100.10");
    add_service(&mut st, "bad", "203.0.113.20", "198.51.100.20");
    st
}

fn settings() -> Settings {
    Settings::new(&Config::default(), "node-a".into())
}

/// The in-memory kernel, plus a rule: it refuses any element built for Services named in
/// `poisoned` (as a kernel would refuse an object it cannot accept), and counts reads.
struct PoisonKernel {
    inner: FakeKernel,
    poisoned: Vec<String>,
    reads: usize,
}

impl Kernel for PoisonKernel {
    fn generation(&mut self) -> Result<u32, NftError> {
        self.inner.generation()
    }

    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError> {
        self.reads += 1;
        self.inner.read_table(family, name)
    }

    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError> {
        let mut errors = Vec::new();
        for op in plan.phase1.iter().chain(&plan.phase2) {
            if let Op::AddElems { set, elems, .. } = op {
                for (_, elem) in elems {
                    if let Some(origin) = &elem.origin
                        && self.poisoned.iter().any(|p| p == origin.service.name())
                    {
                        errors.push(RejectedOp {
                            op: "add element",
                            object: format!("element in {set}"),
                            origin: Some((**origin).clone()),
                            errno: ReplyKind::Invalid.errno(),
                            ext_ack: None,
                            ext_ack_offset: None,
                            phase: 1,
                        });
                    }
                }
            }
        }
        if errors.is_empty() {
            self.inner.apply(plan)
        } else {
            Err(NftError::Rejected { errors })
        }
    }

    fn delete_tables(&mut self, name: &str) -> Result<usize, NftError> {
        self.inner.delete_tables(name)
    }
}

fn kernel(poisoned: &[&str]) -> PoisonKernel {
    PoisonKernel {
        inner: FakeKernel::new(),
        poisoned: poisoned.iter().map(|s| s.to_string()).collect(),
        reads: 0,
    }
}

fn cluster_ips(k: &mut PoisonKernel) -> Vec<String> {
    let table = k
        .inner
        .read_table(IpFamily::V4, "nodeproxy")
        .unwrap()
        .unwrap();
    let set = &table.sets["cluster-ips"];
    set.elements.keys().map(|k| set.format_key(k)).collect()
}

#[test]
fn a_rejected_service_is_quarantined_and_the_others_are_applied() {
    let mut syncer = Syncer::new(kernel(&["bad"]));
    let out = syncer.sync(&state(), &settings(), false).unwrap();
    assert_eq!(out.quarantined.len(), 1);
    assert_eq!(out.quarantined[0].0, name("ns", "bad"));
    assert_eq!(
        cluster_ips(syncer.kernel()),
        vec!["203.0.113.10".to_string()]
    );
}

#[test]
fn once_quarantines_a_rejected_service_from_a_reloaded_state_and_applies_the_others() {
    let mut k = kernel(&["bad"]);
    let mut reloads = 0;
    let reload = || -> Result<ClusterState, NftError> {
        reloads += 1;
        Ok(state())
    };
    let out = super::once(&mut k, state(), &settings(), reload).unwrap();
    assert_eq!(reloads, 1, "the retry reads the input again");
    assert_eq!(
        out.quarantined.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        vec![&name("ns", "bad")]
    );
    assert_eq!(cluster_ips(&mut k), vec!["203.0.113.10".to_string()]);
    // Run again with nothing rejected: everything is there, and what was is kept.
    k.poisoned.clear();
    let out = super::once(&mut k, state(), &settings(), || -> Result<_, NftError> {
        panic!("no retry needed")
    })
    .unwrap();
    assert!(out.quarantined.is_empty());
    assert_eq!(cluster_ips(&mut k).len(), 2);
}

#[test]
fn once_fails_when_a_rejection_names_no_service() {
    struct Refusing(FakeKernel);
    impl Kernel for Refusing {
        fn generation(&mut self) -> Result<u32, NftError> {
            self.0.generation()
        }
        fn read_table(
            &mut self,
            family: IpFamily,
            name: &str,
        ) -> Result<Option<WireTable>, NftError> {
            self.0.read_table(family, name)
        }
        fn apply(&mut self, _: &Plan<'_>) -> Result<ApplyStats, NftError> {
            Err(NftError::Rejected {
                errors: vec![RejectedOp {
                    op: "add table",
                    object: "table ip nodeproxy".into(),
                    origin: None,
                    errno: ReplyKind::Permission.errno(),
                    ext_ack: None,
                    ext_ack_offset: None,
                    phase: 1,
                }],
            })
        }
        fn delete_tables(&mut self, name: &str) -> Result<usize, NftError> {
            self.0.delete_tables(name)
        }
    }
    let err = super::once(Refusing(FakeKernel::new()), state(), &settings(), || {
        Ok::<_, NftError>(state())
    })
    .unwrap_err();
    assert!(
        matches!(&err, NftError::Rejected { errors } if errors.len() == 1),
        "{err}"
    );
}

#[test]
fn the_kinds_of_rejected_operations_are_kept_until_taken() {
    let mut syncer = Syncer::new(kernel(&["bad"]));
    syncer.sync(&state(), &settings(), false).unwrap();
    // Rejected once against the first view, once more after the fresh read-back that comes
    // before any quarantine: "bad" has one element in each of the two rejected transactions.
    let kinds = syncer.take_rejections();
    assert!(!kinds.is_empty());
    assert!(kinds.iter().all(|k| *k == ReplyKind::Invalid), "{kinds:?}");
    assert!(syncer.take_rejections().is_empty());
    // Quarantined and unchanged: nothing is sent for it again, so nothing more is rejected.
    syncer.sync(&state(), &settings(), false).unwrap();
    assert!(syncer.take_rejections().is_empty());
}

#[test]
fn a_quarantined_service_is_retried_when_it_changes() {
    let mut syncer = Syncer::new(kernel(&["bad"]));
    syncer.sync(&state(), &settings(), false).unwrap();
    // Unchanged: stays out, without another rejection.
    let again = syncer.sync(&state(), &settings(), false).unwrap();
    assert_eq!(again.quarantined.len(), 1);
    assert_eq!(again.report.messages, 0);

    syncer.kernel().poisoned.clear();
    let mut changed = state();
    add_service(&mut changed, "bad", "203.0.113.20", "198.51.100.21");
    let out = syncer.sync(&changed, &settings(), false).unwrap();
    assert!(out.quarantined.is_empty());
    assert_eq!(cluster_ips(syncer.kernel()).len(), 2);
}

#[test]
fn a_quarantine_and_its_release_are_each_reported_once_with_what_the_kernel_refused() {
    let mut syncer = Syncer::new(kernel(&["bad"]));
    let out = syncer.sync(&state(), &settings(), false).unwrap();
    assert_eq!(out.newly_quarantined.len(), 1, "{out:?}");
    let (who, why) = &out.newly_quarantined[0];
    assert_eq!(who, &name("ns", "bad"));
    assert_eq!(why.op, "add element");
    assert!(why.object.starts_with("element in "), "{why}");
    assert!(!why.error.is_empty(), "{why}");
    assert!(out.released.is_empty());
    // Still quarantined, but no longer news.
    let out = syncer.sync(&state(), &settings(), false).unwrap();
    assert!(
        out.newly_quarantined.is_empty() && out.released.is_empty(),
        "{out:?}"
    );

    syncer.kernel().poisoned.clear();
    let mut changed = state();
    add_service(&mut changed, "bad", "203.0.113.20", "198.51.100.21");
    let out = syncer.sync(&changed, &settings(), false).unwrap();
    assert_eq!(out.released, vec![name("ns", "bad")]);
    assert!(out.newly_quarantined.is_empty());
    let out = syncer.sync(&changed, &settings(), false).unwrap();
    assert!(out.released.is_empty());
}

#[test]
fn a_service_released_on_the_incremental_path_is_reported_a_deleted_one_is_not() {
    let mut st = state();
    let mut syncer = Syncer::new(kernel(&["bad"]));
    assert_eq!(
        syncer
            .sync(&st, &settings(), false)
            .unwrap()
            .newly_quarantined
            .len(),
        1
    );
    syncer.kernel().poisoned.clear();
    set_endpoints(&mut st, "bad", &["198.51.100.21"]);
    let out = done(syncer.sync_changed(&st.subset(&one("bad")), &one("bad"), &settings()));
    assert_eq!(out.released, vec![name("ns", "bad")]);

    // Quarantined again, then deleted: nobody to tell it was released.
    syncer.kernel().poisoned = vec!["bad".into()];
    set_endpoints(&mut st, "bad", &["198.51.100.22"]);
    let out = syncer.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.newly_quarantined.len(), 1);
    st.services.remove(&name("ns", "bad"));
    st.slices.retain(|_, s| s.service != name("ns", "bad"));
    let out = syncer.sync(&st, &settings(), false).unwrap();
    assert!(out.quarantined.is_empty());
    assert!(out.released.is_empty(), "{out:?}");
}

#[test]
fn steady_state_syncs_do_not_read_the_kernel_back_but_verification_does() {
    let mut syncer = Syncer::new(kernel(&[]));
    let first = syncer.sync(&state(), &settings(), false).unwrap();
    assert!(first.full);
    let reads = syncer.kernel().reads;
    let second = syncer.sync(&state(), &settings(), false).unwrap();
    assert!(!second.full);
    assert_eq!(syncer.kernel().reads, reads);
    assert_eq!(second.report.messages, 0);
    let verified = syncer.sync(&state(), &settings(), true).unwrap();
    assert!(verified.full);
    assert!(!verified.drift_repaired);
    assert!(syncer.kernel().reads > reads);
}

#[test]
fn verification_repairs_a_table_deleted_behind_our_back() {
    let mut syncer = Syncer::new(kernel(&[]));
    syncer.sync(&state(), &settings(), false).unwrap();
    syncer.kernel().inner.delete_tables("nodeproxy").unwrap();
    // Trusting memory, nothing is noticed…
    assert_eq!(
        syncer
            .sync(&state(), &settings(), false)
            .unwrap()
            .report
            .messages,
        0
    );
    // …verification reads the kernel and rebuilds the table.
    let out = syncer.sync(&state(), &settings(), true).unwrap();
    assert!(out.report.messages > 0);
    assert_eq!(cluster_ips(syncer.kernel()).len(), 2);
}

#[test]
fn a_verification_carrying_changes_reports_drift_only_when_someone_else_changed_the_table() {
    // The daemon verifies with the pending changes when the sync period falls due under
    // churn: those changes are not someone else's.
    let mut st = state();
    let mut syncer = Syncer::new(kernel(&[]));
    syncer.sync(&st, &settings(), false).unwrap();
    set_endpoints(&mut st, "good", &["198.51.100.41"]);
    let out = syncer.sync(&st, &settings(), true).unwrap();
    assert!(out.report.messages > 0, "the change is applied");
    assert!(!out.drift_repaired, "our own change reported as drift");
    // Someone deletes our table; a change is pending as the verification runs.
    syncer.kernel().inner.delete_tables("nodeproxy").unwrap();
    set_endpoints(&mut st, "good", &["198.51.100.42"]);
    let out = syncer.sync(&st, &settings(), true).unwrap();
    assert!(out.drift_repaired);
    assert!(syncer.kernel().inner.tables == full_tables(&st, &settings()).tables);
}

#[test]
fn a_rejection_of_every_service_in_turn_is_bounded() {
    let mut st = state();
    for i in 0..20 {
        add_service(
            &mut st,
            &format!("s{i}"),
            &format!("203.0.113.{}", 100 + i),
            "198.51.100.50",
        );
    }
    let everyone: Vec<String> = st.services.keys().map(|n| n.name().to_owned()).collect();
    let refs: Vec<&str> = everyone.iter().map(String::as_str).collect();
    let mut syncer = Syncer::new(kernel(&refs));
    // All of them are rejected in the first round, so all are quarantined at once and the
    // rest (nothing) applies.
    let out = syncer.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.quarantined.len(), everyone.len());
}

/// `ns/sticky` (ClusterIP 203.0.113.30, NodePort 30090) with ClientIP affinity and one
/// endpoint per address.
fn add_sticky(state: &mut ClusterState, endpoints: &[&str]) {
    add_service(state, "sticky", "203.0.113.30", endpoints[0]);
    let svc = name("ns", "sticky");
    if let Some(s) = state.services.get_mut(&svc) {
        s.session_affinity_timeout = Some(10800);
        s.ports[0].node_port = Some(30090);
    }
    if let Some(slice) = state.slices.get_mut(&name("ns", "sticky-1")) {
        let template = slice.endpoints[0].clone();
        slice.endpoints = endpoints
            .iter()
            .map(|addr| SliceEndpoint {
                addr: addr.parse().unwrap(),
                ..template.clone()
            })
            .collect();
    }
}

/// The elements of affinity map `map` of `ns/sticky`, as `nft list` would show their keys.
fn affinity_keys(k: &mut PoisonKernel, map: &str) -> Vec<String> {
    let table = k
        .inner
        .read_table(IpFamily::V4, "nodeproxy")
        .unwrap()
        .unwrap();
    let set = &table.sets[map];
    set.elements.keys().map(|key| set.format_key(key)).collect()
}

#[test]
fn affinity_endpoints_are_elements_and_a_restart_reads_each_table_once() {
    let (a, b, c) = ("198.51.100.31", "198.51.100.32", "198.51.100.33");
    let mut st = state();
    add_sticky(&mut st, &[a, b, c]);
    let mut syncer = Syncer::new(kernel(&[]));
    syncer.sync(&st, &settings(), false).unwrap();
    assert_eq!(syncer.kernel().reads, 2);
    let endpoints = |addrs: &[&str], key: &str| -> Vec<String> {
        addrs.iter().map(|a| format!("{key} . {a}")).collect()
    };
    assert_eq!(
        affinity_keys(syncer.kernel(), "affinity-endpoints"),
        endpoints(&[a, b, c], "203.0.113.30 . tcp . 80")
    );
    assert_eq!(
        affinity_keys(syncer.kernel(), "affinity-nodeport-endpoints"),
        endpoints(&[a, b, c], "tcp . 30090")
    );

    // A new process (nothing applied in memory) over the same kernel, after `a` went away:
    // one read per family, and the endpoints map holds b and c.
    let mut restarted = Syncer::new(PoisonKernel {
        inner: std::mem::take(&mut syncer.kernel().inner),
        poisoned: Vec::new(),
        reads: 0,
    });
    let mut without_a = state();
    add_sticky(&mut without_a, &[b, c]);
    restarted.sync(&without_a, &settings(), false).unwrap();
    assert_eq!(restarted.kernel().reads, 2);
    assert_eq!(
        affinity_keys(restarted.kernel(), "affinity-endpoints"),
        endpoints(&[b, c], "203.0.113.30 . tcp . 80")
    );
    // In steady state the sync diffs against what it applied: no read.
    let mut with_d = state();
    add_sticky(&mut with_d, &["198.51.100.3", b, c]);
    restarted.sync(&with_d, &settings(), false).unwrap();
    assert_eq!(restarted.kernel().reads, 2);
    assert_eq!(
        affinity_keys(restarted.kernel(), "affinity-pick"),
        (0..3)
            .map(|i| format!("203.0.113.30 . tcp . 80 . {i}"))
            .collect::<Vec<_>>()
    );
}

// ---- the incremental sync ----

/// A tiny deterministic PRNG (xorshift64), so that a failing sequence can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap()
    }

    /// True with probability `num / den`.
    fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

const SLOTS: usize = 24;

fn slot_name(i: usize) -> ServiceName {
    name(
        if i.is_multiple_of(3) {
            "team-a"
        } else {
            "team-b"
        },
        &format!("svc{i}"),
    )
}

fn node_a() -> Node {
    Node {
        name: "node-a".into(),
        internal_ips: vec![
            "192.0.2.11".parse().unwrap(),
            "2001:db8::11".parse().unwrap(),
        ],
        external_ips: vec!["192.0.2.21".parse().unwrap()],
        pod_cidrs: vec![
            "198.51.100.0/25".parse().unwrap(),
            "2001:db8:a::/64".parse().unwrap(),
        ],
        zone: Some("zone-a".into()),
        ..Node::default()
    }
}

/// A random Service in slot `i`: mostly its own addresses and ports, sometimes ones shared with
/// other slots (contested keys), with every feature the builder has.
fn random_service(rng: &mut Rng, i: usize) -> Service {
    let n = u16::try_from(i).unwrap();
    let mut cluster_ips: Vec<std::net::IpAddr> = Vec::new();
    let v4 = !rng.chance(1, 8);
    if v4 {
        let host = if rng.chance(1, 25) { 250 } else { 1 + n };
        cluster_ips.push(format!("203.0.113.{host}").parse().unwrap());
    }
    if !v4 || rng.chance(1, 4) {
        cluster_ips.push(format!("2001:db8:5::{:x}", 1 + n).parse().unwrap());
    }
    let mut ports: Vec<ServicePort> = Vec::new();
    for j in 0..1 + rng.below(3) {
        let protocol = *rng.pick(&[Protocol::Tcp, Protocol::Tcp, Protocol::Udp, Protocol::Sctp]);
        let port = *rng.pick(&[80u16, 443, 53, 8080]);
        if ports
            .iter()
            .any(|p| p.protocol == protocol && p.port == port)
        {
            continue;
        }
        let node_port = rng.chance(1, 3).then(|| {
            if rng.chance(1, 25) {
                30999
            } else {
                30000 + n * 4 + u16::try_from(j).unwrap()
            }
        });
        ports.push(ServicePort {
            name: format!("p{j}"),
            protocol,
            port,
            node_port,
        });
    }
    let mut external_ips = Vec::new();
    if rng.chance(1, 4) {
        external_ips.push(format!("198.51.100.{}", 200 + n).parse().unwrap());
        if rng.chance(1, 3) {
            external_ips.push(format!("2001:db8:e0::{:x}", 1 + n).parse().unwrap());
        }
        if rng.chance(1, 20) {
            external_ips.push("198.51.100.254".parse().unwrap());
        }
    }
    let mut load_balancer_ips = Vec::new();
    let mut load_balancer_source_ranges = Vec::new();
    if rng.chance(1, 4) {
        load_balancer_ips.push(format!("203.0.113.{}", 128 + n).parse().unwrap());
        if rng.chance(1, 3) {
            load_balancer_ips.push(format!("2001:db8:1b::{:x}", 1 + n).parse().unwrap());
        }
        if rng.chance(1, 2) {
            for _ in 0..1 + rng.below(2) {
                load_balancer_source_ranges.push(
                    rng.pick(&[
                        "192.0.2.0/24",
                        "198.51.100.0/26",
                        "198.51.100.32/27",
                        "203.0.113.7/32",
                        "2001:db8:c::/48",
                    ])
                    .parse()
                    .unwrap(),
                );
            }
        }
    }
    let policy = |rng: &mut Rng, den| {
        if rng.chance(1, den) {
            TrafficPolicy::Local
        } else {
            TrafficPolicy::Cluster
        }
    };
    let external_traffic_policy = policy(rng, 3);
    let internal_traffic_policy = policy(rng, 4);
    let has_node_port = ports.iter().any(|p| p.node_port.is_some());
    Service {
        cluster_ips,
        ports,
        external_ips: external_ips.into(),
        load_balancer_ips: load_balancer_ips.into(),
        load_balancer_source_ranges: load_balancer_source_ranges.into(),
        external_traffic_policy,
        internal_traffic_policy,
        health_check_node_port: (external_traffic_policy == TrafficPolicy::Local && has_node_port)
            .then_some(32000 + n),
        session_affinity_timeout: rng.chance(1, 4).then(|| *rng.pick(&[10800u32, 60])),
        ..Service::new(slot_name(i))
    }
}

/// Changes the slice's endpoints (a boxed slice in the model) as a vector.
fn edit_endpoints(slice: &mut EndpointSlice, edit: impl FnOnce(&mut Vec<SliceEndpoint>)) {
    let mut endpoints = std::mem::take(&mut slice.endpoints).into_vec();
    edit(&mut endpoints);
    slice.endpoints = endpoints.into();
}

fn random_endpoint(rng: &mut Rng, i: usize, family: IpFamily) -> SliceEndpoint {
    let host = if rng.chance(1, 20) {
        240 + rng.below(3)
    } else {
        i * 8 + rng.below(8)
    };
    let addr = match family {
        IpFamily::V4 => format!("198.51.100.{}", host % 240 + 1),
        IpFamily::V6 => format!("2001:db8:e::{:x}", host + 1),
    };
    let ready = rng.chance(3, 4);
    let hinted = rng.chance(1, 4);
    SliceEndpoint {
        addr: addr.parse().unwrap(),
        conditions: Conditions {
            ready,
            serving: ready || rng.chance(1, 2),
            terminating: rng.chance(1, 4),
        },
        locality: Locality::with_hints(
            Locality::of(
                match rng.below(5) {
                    0 | 1 => Some("node-a".into()),
                    2 | 3 => Some("node-b".into()),
                    _ => None,
                },
                Some((*rng.pick(&["zone-a", "zone-b"])).into()),
            ),
            Hints::new(
                if hinted {
                    vec![rng.pick(&["zone-a", "zone-b"]).to_string()]
                } else {
                    vec![]
                },
                if rng.chance(1, 8) {
                    vec![rng.pick(&["node-a", "node-b"]).to_string()]
                } else {
                    vec![]
                },
            ),
        ),
    }
}

/// A random slice `k` of the Service in slot `i` (whose spec may be gone or different: slices
/// and Services change independently).
fn random_slice(rng: &mut Rng, i: usize, k: usize, service: Option<&Service>) -> EndpointSlice {
    let family = if rng.chance(1, 4) {
        IpFamily::V6
    } else {
        IpFamily::V4
    };
    let mut ports: Vec<SlicePort> = Vec::new();
    for p in service.map(|s| s.ports.as_slice()).unwrap_or_default() {
        if rng.chance(1, 10) {
            continue;
        }
        ports.push(SlicePort {
            name: p.name.clone(),
            protocol: p.protocol,
            port: *rng.pick(&[8080u16, 8080, 9090]),
        });
    }
    if ports.is_empty() {
        ports.push(SlicePort {
            name: "p0".into(),
            protocol: Protocol::Tcp,
            port: 8080,
        });
    }
    let count = *rng.pick(&[0usize, 1, 2, 2, 3, 3, 4, 5]);
    let svc = slot_name(i);
    EndpointSlice {
        name: name(svc.namespace(), &format!("{}-{k}", svc.name())),
        service: svc,
        family,
        ports: ports.into(),
        endpoints: (0..count)
            .map(|_| random_endpoint(rng, i, family))
            .collect(),
    }
}

/// Replaces the slices of slot `i` with 0 to 2 new random ones.
fn reslice(rng: &mut Rng, st: &mut ClusterState, i: usize) {
    let svc = slot_name(i);
    st.slices.retain(|_, s| s.service != svc);
    for k in 0..rng.below(3) {
        let slice = random_slice(rng, i, k, st.services.get(&svc));
        st.slices.insert(slice.name.clone(), slice);
    }
}

/// One random change of `st`; returns the Services it touched.
fn mutate(rng: &mut Rng, st: &mut ClusterState) -> BTreeSet<ServiceName> {
    let mut changed = BTreeSet::new();
    let i = rng.below(SLOTS);
    let svc = slot_name(i);
    let exists = st.services.contains_key(&svc);
    match rng.below(100) {
        // Endpoints: one endpoint changes, is added or removed, or the slices are redone.
        0..=39 => {
            let slice = st.slices.values_mut().find(|s| s.service == svc);
            match slice {
                Some(slice) if rng.chance(3, 4) => {
                    let family = slice.family;
                    match rng.below(4) {
                        0 => edit_endpoints(slice, |e| e.push(random_endpoint(rng, i, family))),
                        1 if !slice.endpoints.is_empty() => {
                            let e = rng.below(slice.endpoints.len());
                            edit_endpoints(slice, |endpoints| {
                                endpoints.remove(e);
                            });
                        }
                        _ if !slice.endpoints.is_empty() => {
                            let e = rng.below(slice.endpoints.len());
                            let ep = &mut slice.endpoints[e];
                            match rng.below(4) {
                                0 => ep.conditions.ready = !ep.conditions.ready,
                                1 => ep.conditions.terminating = !ep.conditions.terminating,
                                2 => {
                                    let node = match ep.node_name() {
                                        Some("node-a") => "node-b",
                                        _ => "node-a",
                                    };
                                    let hints = ep.hints().cloned().map(Box::new);
                                    ep.locality = Locality::with_hints(
                                        Locality::of(
                                            Some(node.into()),
                                            ep.zone().map(std::sync::Arc::from),
                                        ),
                                        hints,
                                    );
                                }
                                _ => {
                                    let zones = if ep.zone_hints().is_empty() {
                                        vec!["zone-a".into()]
                                    } else {
                                        vec![]
                                    };
                                    ep.set_hints(Hints::new(zones, ep.node_hints().to_vec()));
                                }
                            }
                        }
                        _ => edit_endpoints(slice, |e| e.push(random_endpoint(rng, i, family))),
                    }
                }
                _ => reslice(rng, st, i),
            }
            changed.insert(svc);
        }
        // The Service's spec: a new random one, or one field flipped.
        40..=64 => {
            let mut service = random_service(rng, i);
            if let Some(old) = st.services.get(&svc)
                && rng.chance(1, 2)
            {
                let mut tweaked = old.clone();
                match rng.below(6) {
                    0 => {
                        tweaked.session_affinity_timeout = match tweaked.session_affinity_timeout {
                            Some(_) => None,
                            None => Some(10800),
                        }
                    }
                    1 => tweaked.external_traffic_policy = service.external_traffic_policy,
                    2 => tweaked.internal_traffic_policy = service.internal_traffic_policy,
                    3 => tweaked.external_ips = service.external_ips.clone(),
                    4 => {
                        tweaked.load_balancer_ips = service.load_balancer_ips.clone();
                        tweaked.load_balancer_source_ranges =
                            service.load_balancer_source_ranges.clone();
                    }
                    _ => {
                        for p in &mut tweaked.ports {
                            p.node_port = match p.node_port {
                                Some(_) => None,
                                None => Some(30000 + u16::try_from(i).unwrap() * 4 + 3),
                            };
                        }
                    }
                }
                service = tweaked;
            }
            let new_slices = !exists;
            st.services.insert(svc.clone(), service);
            if new_slices {
                reslice(rng, st, i);
            }
            changed.insert(svc);
        }
        // Deletion of the Service, with or without its slices.
        65..=76 => {
            st.services.remove(&svc);
            if rng.chance(2, 3) {
                st.slices.retain(|_, s| s.service != svc);
            }
            changed.insert(svc);
        }
        // Several Services at once.
        77..=94 => {
            for _ in 0..2 + rng.below(3) {
                changed.extend(mutate(rng, st));
            }
        }
        // The Node: always the full path.
        _ => {
            let node = st.nodes.entry("node-a".into()).or_insert_with(node_a);
            node.zone = match node.zone.as_deref() {
                Some("zone-a") => Some("zone-b".into()),
                _ => Some("zone-a".into()),
            };
        }
    }
    changed
}

fn random_state(rng: &mut Rng) -> ClusterState {
    let mut st = ClusterState::default();
    st.nodes.insert("node-a".into(), node_a());
    for i in 0..SLOTS {
        if rng.chance(2, 3) {
            st.services.insert(slot_name(i), random_service(rng, i));
            reslice(rng, &mut st, i);
        }
    }
    st
}

/// The configurations the sequences run under: defaults, NodePorts on every address with
/// masquerade-all, and NodePorts on a CIDR with an interface-prefix detector.
fn configs() -> Vec<Settings> {
    let base = Config {
        cluster_cidr: vec!["198.51.100.0/24".parse().unwrap()],
        service_cidr: vec!["203.0.113.0/25".parse().unwrap()],
        ..Config::default()
    };
    let mut all = base.clone();
    all.nodeport_addresses.all = true;
    all.masquerade_all = true;
    all.detect_local_mode = crate::config::DetectLocalMode::NodeCidr;
    let mut cidrs = base.clone();
    cidrs.nodeport_addresses.primary = false;
    cidrs.nodeport_addresses.cidrs = vec!["192.0.2.0/24".parse().unwrap()];
    cidrs.detect_local_mode = crate::config::DetectLocalMode::InterfaceNamePrefix;
    cidrs.pod_interface_name_prefix = Some("veth".into());
    [base, all, cidrs]
        .iter()
        .map(|c| Settings::new(c, "node-a".into()))
        .collect()
}

/// Asserts that the incremental syncer's kernel, and its memory of it, equal those of a syncer
/// that did a full sync of the same state, and that its counts and index equal those computed
/// afresh.
fn assert_same(inc: &mut Syncer<FakeKernel>, full: &mut Syncer<FakeKernel>, context: &str) {
    assert!(
        inc.kernel().tables == full.kernel().tables,
        "{context}: the incremental kernel differs from the full one:\n{}",
        table_differences(&inc.kernel().tables, &full.kernel().tables)
    );
    for family in IpFamily::ALL {
        let (Some(Some(mine)), Some(Some(theirs))) =
            (inc.applied.get(&family), full.applied.get(&family))
        else {
            panic!("{context}: {family} table unknown after a sync");
        };
        assert!(
            mine == theirs,
            "{context}: applied {family} differs from the kernel"
        );
        // Origins are not programmed, but the index is built from them.
        for (name, set) in &mine.sets {
            for (key, elem) in &set.elements {
                assert_eq!(
                    elem.origin,
                    theirs.sets[name].elements[key].origin,
                    "{context}: origin of {} in {name}",
                    set.format_key(key)
                );
            }
        }
    }
    if let Some(base) = &inc.baseline {
        let fresh = incremental::Baseline::new(
            &inc.applied,
            &base_settings(base),
            &base_nodes(base),
            Default::default(),
        )
        .unwrap();
        let diffs = base.differences(&fresh, &inc.applied);
        assert!(diffs.is_empty(), "{context}: {diffs:?}");
    }
}

fn base_settings(base: &incremental::Baseline) -> Settings {
    base.settings_for_tests().clone()
}

fn base_nodes(base: &incremental::Baseline) -> std::collections::BTreeMap<String, Node> {
    base.nodes_for_tests().clone()
}

/// The first few elements and objects by which two kernels differ, for failure messages.
fn table_differences(
    a: &std::collections::BTreeMap<(IpFamily, String), WireTable>,
    b: &std::collections::BTreeMap<(IpFamily, String), WireTable>,
) -> String {
    let mut out = Vec::new();
    for (k, ta) in a {
        let Some(tb) = b.get(k) else {
            out.push(format!("{k:?} only in incremental"));
            continue;
        };
        for (name, ca) in &ta.chains {
            if tb.chains.get(name) != Some(ca) {
                out.push(format!(
                    "{k:?}: chain {name} differs or only in incremental"
                ));
            }
        }
        for name in tb.chains.keys().filter(|n| !ta.chains.contains_key(*n)) {
            out.push(format!("{k:?}: chain {name} only in full"));
        }
        for (name, sa) in &ta.sets {
            let Some(sb) = tb.sets.get(name) else {
                out.push(format!("{k:?}: set {name} only in incremental"));
                continue;
            };
            for (key, e) in &sa.elements {
                if sb.elements.get(key) != Some(e) {
                    out.push(format!(
                        "{k:?}: {name}: {} {e:?} (incremental) vs {:?}",
                        sa.format_key(key),
                        sb.elements.get(key)
                    ));
                }
            }
            for key in sb.elements.keys().filter(|k| !sa.elements.contains_key(*k)) {
                out.push(format!(
                    "{k:?}: {name}: {} only in full",
                    sb.format_key(key)
                ));
            }
        }
        for name in tb.sets.keys().filter(|n| !ta.sets.contains_key(*n)) {
            out.push(format!("{k:?}: set {name} only in full"));
        }
    }
    out.truncate(12);
    out.join("\n")
}

#[test]
fn incremental_syncs_equal_full_syncs_over_random_changes() {
    let mut total_incremental = 0;
    let mut total_steps = 0;
    let mut reasons: std::collections::BTreeMap<&'static str, usize> = Default::default();
    for (c, settings) in configs().iter().enumerate() {
        for seed in 0..2u64 {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (seed * 7919 + c as u64 * 104_729 + 1));
            let mut st = random_state(&mut rng);
            let mut inc = Syncer::new(FakeKernel::new());
            let mut full = Syncer::new(FakeKernel::new());
            inc.sync(&st, settings, false).unwrap();
            full.sync(&st, settings, false).unwrap();
            assert_same(&mut inc, &mut full, "initial");
            for step in 0..250 {
                let changed = mutate(&mut rng, &mut st);
                let scoped = st.subset(&changed);
                let context = format!("config {c}, seed {seed}, step {step}, changed {changed:?}");
                match inc.sync_changed(&scoped, &changed, settings).unwrap() {
                    Incremental::Done(out) => {
                        assert!(!out.full, "{context}");
                        total_incremental += 1;
                    }
                    Incremental::NeedsFull(reason) => {
                        // The fake kernel accepts whatever a correct delta holds: a rejection
                        // means the delta referred to an object that is not there.
                        assert!(!reason.contains("rejected"), "{context}: {reason}");
                        *reasons.entry(reason).or_default() += 1;
                        inc.sync(&st, settings, false).unwrap();
                    }
                }
                full.sync(&st, settings, false).unwrap();
                total_steps += 1;
                assert_same(&mut inc, &mut full, &context);
            }
        }
    }
    eprintln!("{total_incremental} of {total_steps} steps incremental; full because: {reasons:?}");
    // The fast path must actually run: most changes touch Services without contested keys
    // and within existing endpoint counts.
    assert!(
        total_incremental * 2 >= total_steps,
        "only {total_incremental} of {total_steps} steps were incremental: {reasons:?}"
    );
}

fn one(n: &str) -> BTreeSet<ServiceName> {
    BTreeSet::from([name("ns", n)])
}

/// Sets endpoint addresses of Service `n` (all on node-b, ready).
fn set_endpoints(st: &mut ClusterState, n: &str, addrs: &[&str]) {
    let slice = st.slices.get_mut(&name("ns", &format!("{n}-1"))).unwrap();
    let template = slice.endpoints[0].clone();
    slice.endpoints = addrs
        .iter()
        .map(|a| SliceEndpoint {
            addr: a.parse().unwrap(),
            ..template.clone()
        })
        .collect();
}

fn full_tables(st: &ClusterState, settings: &Settings) -> FakeKernel {
    let mut full = Syncer::new(FakeKernel::new());
    full.sync(st, settings, false).unwrap();
    full.kernel().clone()
}

fn needs_full(r: Result<Incremental, NftError>) -> &'static str {
    match r.unwrap() {
        Incremental::NeedsFull(reason) => reason,
        Incremental::Done(out) => panic!("expected the full path, got {out}"),
    }
}

fn done(r: Result<Incremental, NftError>) -> SyncOutcome {
    match r.unwrap() {
        Incremental::Done(out) => *out,
        Incremental::NeedsFull(reason) => panic!("expected an incremental sync: {reason}"),
    }
}

#[test]
fn an_endpoint_change_is_applied_incrementally_without_reading_back() {
    let mut st = state();
    let mut syncer = Syncer::new(kernel(&[]));
    syncer.sync(&st, &settings(), false).unwrap();
    let reads = syncer.kernel().reads;
    set_endpoints(&mut st, "good", &["198.51.100.11"]);
    let out = done(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
    assert!(!out.full);
    // The endpoint in `pick-1-endpoints` is replaced, its hairpin-free neighbours untouched.
    assert_eq!(out.report.elements_added, 1);
    assert_eq!(out.report.elements_removed, 1);
    assert_eq!(syncer.kernel().reads, reads);
    assert!(syncer.kernel().inner.tables == full_tables(&st, &settings()).tables);
}

#[test]
fn the_element_index_stays_bounded_over_many_change_syncs() {
    let mut st = state();
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    let index_bytes = |s: &Syncer<FakeKernel>| s.baseline.as_ref().unwrap().index.key_bytes();
    let after_full = index_bytes(&syncer);
    let mut most = 0;
    // About 32 bytes of keys per sync: 5000 syncs leave far more than the compaction threshold.
    for i in 0..5000 {
        // Alternating endpoints: every sync removes the previous ones' runs and adds new ones.
        let ep = if i % 2 == 0 {
            "198.51.100.11"
        } else {
            "198.51.100.12"
        };
        set_endpoints(&mut st, "good", &[ep]);
        let out = done(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
        assert_eq!(
            out.report.elements_removed, out.report.elements_added,
            "sync {i}"
        );
        most = most.max(index_bytes(&syncer));
    }
    // Compaction keeps the garbage under its threshold (twice the live keys, plus a slack
    // that unit tests set to 0) instead of growing with every sync.
    assert!(
        most <= 2 * after_full + incremental::SLACK + 1024,
        "index grew to {most} bytes (after the full sync: {after_full})"
    );
    assert!(syncer.kernel().tables == full_tables(&st, &settings()).tables);
}

#[test]
fn what_the_baseline_keeps_after_a_full_sync_has_no_spare_capacity() {
    let mut rng = Rng(7);
    let st = random_state(&mut rng);
    assert!(st.services.len() > 4, "a state with several Services");
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    let base = syncer.baseline.as_ref().unwrap();
    assert_eq!(base.spare_capacity(), 0);
}

#[test]
fn a_deleted_service_is_removed_incrementally() {
    let mut st = state();
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    st.services.remove(&name("ns", "good"));
    st.slices.remove(&name("ns", "good-1"));
    let out = done(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
    assert!(out.report.elements_removed > 0);
    assert_eq!(out.report.elements_added, 0);
    assert!(syncer.kernel().tables == full_tables(&st, &settings()).tables);
}

#[test]
fn the_incremental_path_needs_a_full_sync_first() {
    let st = state();
    let mut syncer = Syncer::new(FakeKernel::new());
    let reason =
        needs_full(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
    assert!(reason.contains("no full sync"), "{reason}");
    assert_eq!(syncer.kernel().transactions, 0);
}

#[test]
fn changed_settings_or_nodes_need_a_full_sync() {
    let mut st = state();
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    let transactions = syncer.kernel().transactions;
    let mut other = settings();
    other.masquerade_all = true;
    let reason = needs_full(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &other));
    assert!(reason.contains("settings"), "{reason}");
    st.nodes.get_mut("node-a").unwrap().zone = Some("zone-b".into());
    let reason =
        needs_full(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
    assert!(reason.contains("Node"), "{reason}");
    assert_eq!(syncer.kernel().transactions, transactions);
}

#[test]
fn a_changed_service_taking_an_address_from_an_unchanged_one_takes_the_full_path() {
    // Found by the sync_diff fuzz target: "older" (created first) gains the externalIP that
    // "young" holds, so "young" loses it; rebuilding "older" alone left young's elements.
    let mut st = state();
    add_service(&mut st, "young", "203.0.113.30", "198.51.100.30");
    let young = st.services.get_mut(&name("ns", "young")).unwrap();
    young.external_ips = vec!["198.51.100.200".parse().unwrap()].into();
    young.created = Some(2_000);
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    add_service(&mut st, "older", "203.0.113.31", "198.51.100.31");
    let older = st.services.get_mut(&name("ns", "older")).unwrap();
    older.external_ips = vec!["198.51.100.200".parse().unwrap()].into();
    older.created = Some(1_000);
    let reason =
        needs_full(syncer.sync_changed(&st.subset(&one("older")), &one("older"), &settings()));
    assert!(reason.contains("another Service holds"), "{reason}");
    syncer.sync(&st, &settings(), false).unwrap();
    assert!(syncer.kernel().tables == full_tables(&st, &settings()).tables);
    // Its claims are tracked through incremental syncs too: an endpoint change of an
    // uninvolved Service is incremental, and "older" leaving again needs the full path.
    set_endpoints(&mut st, "bad", &["198.51.100.32"]);
    done(syncer.sync_changed(&st.subset(&one("bad")), &one("bad"), &settings()));
    st.services.remove(&name("ns", "older"));
    st.slices.remove(&name("ns", "older-1"));
    let reason =
        needs_full(syncer.sync_changed(&st.subset(&one("older")), &one("older"), &settings()));
    assert!(
        reason.contains("contested") || reason.contains("another"),
        "{reason}"
    );
}

#[test]
fn a_scoped_state_with_unchanged_services_is_refused() {
    let st = state();
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    // The whole state, but only "good" named as changed.
    let reason = needs_full(syncer.sync_changed(&st, &one("good"), &settings()));
    assert!(reason.contains("not marked changed"), "{reason}");
}

#[test]
fn services_sharing_a_key_take_the_full_path() {
    let mut st = state();
    // "twin" claims the ClusterIP of "good": only one element can hold it.
    add_service(&mut st, "twin", "203.0.113.10", "198.51.100.30");
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    for n in ["good", "twin"] {
        set_endpoints(&mut st, n, &["198.51.100.31"]);
        let reason = needs_full(syncer.sync_changed(&st.subset(&one(n)), &one(n), &settings()));
        assert!(reason.contains("depend on other"), "{n}: {reason}");
    }
    // The uninvolved one is still incremental.
    set_endpoints(&mut st, "bad", &["198.51.100.32"]);
    done(syncer.sync_changed(&st.subset(&one("bad")), &one("bad"), &settings()));
}

#[test]
fn an_external_ip_on_another_services_cluster_ip_keeps_both_on_the_full_path() {
    let mut st = state();
    // "thief" lists the ClusterIP of "good" as an externalIP: the full build gives it no
    // element for that key, so nothing in the table shows the dependency; the build notes it.
    add_service(&mut st, "thief", "203.0.113.30", "198.51.100.30");
    st.services
        .get_mut(&name("ns", "thief"))
        .unwrap()
        .external_ips = vec!["203.0.113.10".parse().unwrap()].into();
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    for n in ["good", "thief"] {
        set_endpoints(&mut st, n, &["198.51.100.31"]);
        let reason = needs_full(syncer.sync_changed(&st.subset(&one(n)), &one(n), &settings()));
        assert!(reason.contains("depend on other"), "{n}: {reason}");
    }
    // Once "good" is gone the externalIP is the thief's: a full build, as the path requires.
    st.services.remove(&name("ns", "good"));
    syncer.sync(&st, &settings(), false).unwrap();
    let mut fresh = Syncer::new(FakeKernel::new());
    fresh.sync(&st, &settings(), false).unwrap();
    assert_eq!(syncer.kernel().tables, fresh.kernel().tables);
}

#[test]
fn claiming_a_key_another_service_holds_takes_the_full_path() {
    let mut st = state();
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    // "bad" moves to the ClusterIP of "good".
    st.services.get_mut(&name("ns", "bad")).unwrap().cluster_ips =
        vec!["203.0.113.10".parse().unwrap()];
    let reason = needs_full(syncer.sync_changed(&st.subset(&one("bad")), &one("bad"), &settings()));
    assert!(reason.contains("another Service holds"), "{reason}");
    // Two changed Services claiming one key between them: also the full path, so that the
    // next full build records them.
    let both: BTreeSet<ServiceName> = [name("ns", "good"), name("ns", "bad")].into();
    let reason = needs_full(syncer.sync_changed(&st.subset(&both), &both, &settings()));
    assert!(reason.contains("claim the same element key"), "{reason}");
}

#[test]
fn a_new_endpoint_count_needs_its_objects_from_a_full_sync() {
    let mut st = state();
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    let transactions = syncer.kernel().transactions;
    // Two endpoints: `pick-2` does not exist yet.
    set_endpoints(&mut st, "good", &["198.51.100.10", "198.51.100.11"]);
    let reason =
        needs_full(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
    assert!(reason.contains("not in the table"), "{reason}");
    assert_eq!(syncer.kernel().transactions, transactions);
}

#[test]
fn leaving_an_endpoint_count_unused_needs_a_full_sync() {
    let mut st = state();
    set_endpoints(&mut st, "good", &["198.51.100.10", "198.51.100.11"]);
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings(), false).unwrap();
    // Back to one endpoint: `pick-2` would stay behind, empty, which a full build drops.
    set_endpoints(&mut st, "good", &["198.51.100.12"]);
    let reason =
        needs_full(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
    assert!(reason.contains("left unused"), "{reason}");
    syncer.sync(&st, &settings(), false).unwrap();
    let tables = &syncer.kernel().tables;
    assert!(
        !tables[&(IpFamily::V4, "nodeproxy".into())]
            .chains
            .contains_key("pick-2")
    );
}

#[test]
fn a_rejected_incremental_sync_falls_back_to_the_full_path() {
    let mut st = state();
    let mut syncer = Syncer::new(kernel(&[]));
    syncer.sync(&st, &settings(), false).unwrap();
    syncer.kernel().poisoned = vec!["good".into()];
    set_endpoints(&mut st, "good", &["198.51.100.11"]);
    let reason =
        needs_full(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
    assert!(reason.contains("rejected"), "{reason}");
    // The kernel state is forgotten: the next incremental attempt declines, and the full sync
    // reads the kernel back and quarantines the Service.
    needs_full(syncer.sync_changed(&st.subset(&one("good")), &one("good"), &settings()));
    let out = syncer.sync(&st, &settings(), false).unwrap();
    assert!(out.full);
    assert_eq!(out.quarantined.len(), 1);
    assert_eq!(out.quarantined[0].0, name("ns", "good"));
}

#[test]
fn quarantine_holds_and_releases_services_on_the_incremental_path() {
    let mut st = state();
    let mut syncer = Syncer::new(kernel(&["bad"]));
    syncer.sync(&st, &settings(), false).unwrap();
    assert_eq!(syncer.quarantined().len(), 1);
    // Named as changed but unchanged: stays out, nothing is sent.
    let out = done(syncer.sync_changed(&st.subset(&one("bad")), &one("bad"), &settings()));
    assert_eq!(out.quarantined.len(), 1);
    assert_eq!(out.report.messages, 0);
    assert_eq!(
        cluster_ips(syncer.kernel()),
        vec!["203.0.113.10".to_string()]
    );
    // Changed: released and built.
    syncer.kernel().poisoned.clear();
    set_endpoints(&mut st, "bad", &["198.51.100.21"]);
    let out = done(syncer.sync_changed(&st.subset(&one("bad")), &one("bad"), &settings()));
    assert!(out.quarantined.is_empty());
    assert_eq!(cluster_ips(syncer.kernel()).len(), 2);
    assert!(syncer.kernel().inner.tables == full_tables(&st, &settings()).tables);
}

#[test]
fn an_affinity_nodeport_on_every_address_is_rebuilt_like_a_full_build() {
    // With NodePorts on every address, an affinity Service's NodePort is pinned through the
    // NodePort affinity maps (keyed `protocol . NodePort`, no address); deleting the Service
    // must leave the kernel exactly as a full build would.
    let config = Config {
        nodeport_addresses: crate::config::NodePortAddresses {
            primary: false,
            all: true,
            cidrs: vec![],
        },
        ..Config::default()
    };
    let settings = Settings::new(&config, "node-a".into());
    let mut st = state();
    let svc = st.services.get_mut(&name("ns", "good")).unwrap();
    svc.session_affinity_timeout = Some(10800);
    svc.ports[0].node_port = Some(30080);
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings, false).unwrap();
    let key = (IpFamily::V4, "nodeproxy".to_string());
    let table = &syncer.kernel().tables[&key];
    assert!(!table.sets.contains_key("nodeport-pick-1-endpoints"));
    let map = &table.sets["affinity-nodeport-endpoints"];
    let keys: Vec<String> = map.elements.keys().map(|k| map.format_key(k)).collect();
    assert_eq!(keys.len(), 1);
    assert!(keys[0].starts_with("tcp . 30080 . "), "{keys:?}");
    st.services.remove(&name("ns", "good"));
    match syncer
        .sync_changed(&st.subset(&one("good")), &one("good"), &settings)
        .unwrap()
    {
        Incremental::Done(_) => {}
        Incremental::NeedsFull(_) => {
            syncer.sync(&st, &settings, false).unwrap();
        }
    }
    assert!(syncer.kernel().tables == full_tables(&st, &settings).tables);
}

/// Each golden fixture under its own arguments: every Service deleted, put back, and with its
/// first endpoint's readiness flipped, one at a time, incrementally where possible; after each
/// step the kernel must equal a full sync's.
#[test]
fn incremental_syncs_equal_full_syncs_on_the_golden_fixtures() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden");
    let mut fixtures = 0;
    let mut incremental = 0;
    let mut steps = 0;
    let mut reasons: std::collections::BTreeMap<&'static str, usize> = Default::default();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let args = std::fs::read_to_string(path.with_extension("args")).unwrap();
        let argv = ["nodeproxy".to_string()]
            .into_iter()
            .chain(args.split_whitespace().map(String::from))
            .map(std::ffi::OsString::from);
        let config = crate::config::load(argv, &|_| None).unwrap().config;
        let settings = Settings::new(&config, config.node_name().unwrap());
        let original = crate::source::file::load_files(std::slice::from_ref(&path))
            .unwrap()
            .state;
        fixtures += 1;

        let mut inc = Syncer::new(FakeKernel::new());
        let mut full = Syncer::new(FakeKernel::new());
        inc.sync(&original, &settings, false).unwrap();
        let mut st = original.clone();
        let names: Vec<ServiceName> = original.services.keys().cloned().collect();
        for svc in &names {
            let changed = BTreeSet::from([svc.clone()]);
            let mut variants = Vec::new();
            let mut deleted = st.clone();
            deleted.services.remove(svc);
            variants.push(("deleted", deleted));
            variants.push(("restored", original.clone()));
            let mut flipped = original.clone();
            if let Some(slice) = flipped.slices.values_mut().find(|s| &s.service == svc)
                && let Some(ep) = slice.endpoints.first_mut()
            {
                ep.conditions.ready = !ep.conditions.ready;
                variants.push(("flipped", flipped));
                variants.push(("restored", original.clone()));
            }
            for (what, next) in variants {
                st = next;
                let context = format!("{}: {svc} {what}", path.display());
                match inc
                    .sync_changed(&st.subset(&changed), &changed, &settings)
                    .unwrap()
                {
                    Incremental::Done(_) => incremental += 1,
                    Incremental::NeedsFull(reason) => {
                        assert!(!reason.contains("rejected"), "{context}: {reason}");
                        *reasons.entry(reason).or_default() += 1;
                        inc.sync(&st, &settings, false).unwrap();
                    }
                }
                full.sync(&st, &settings, false).unwrap();
                steps += 1;
                assert_same(&mut inc, &mut full, &context);
            }
        }
    }
    assert!(fixtures >= 8, "found only {fixtures} fixtures");
    eprintln!("{incremental} of {steps} fixture steps incremental; full because: {reasons:?}");
    // The fixtures are small: removing a Service often leaves its endpoint count's objects
    // unused, and putting it back needs them again, which only a full sync does.
    assert!(
        incremental * 5 >= steps,
        "{incremental} of {steps}: {reasons:?}"
    );
}

#[test]
fn the_kernel_is_known_unchanged_exactly_while_only_we_commit() {
    let mut st = state();
    let mut syncer = Syncer::new(FakeKernel::new());
    assert!(!syncer.kernel_unchanged().unwrap(), "nothing applied yet");
    syncer.sync(&st, &settings(), false).unwrap();
    assert!(syncer.kernel_unchanged().unwrap());
    // Our own incremental transaction keeps it known.
    add_service(&mut st, "later", "203.0.113.40", "198.51.100.40");
    let out = syncer
        .sync_changed(&st.subset(&one("later")), &one("later"), &settings())
        .unwrap();
    assert!(matches!(out, Incremental::Done(_)), "{out:?}");
    assert!(syncer.kernel_unchanged().unwrap());
    // So does a full one.
    st.services.remove(&name("ns", "later"));
    syncer.sync(&st, &settings(), false).unwrap();
    assert!(syncer.kernel_unchanged().unwrap());
    // Someone else changes our table: no longer known, until a verifying sync repairs it.
    let key = (IpFamily::V4, "nodeproxy".to_string());
    syncer
        .kernel()
        .tables_mut()
        .get_mut(&key)
        .unwrap()
        .chains
        .clear();
    assert!(!syncer.kernel_unchanged().unwrap());
    assert!(!syncer.kernel_unchanged().unwrap(), "it stays unknown");
    let repaired = syncer.sync(&st, &settings(), true).unwrap();
    assert!(repaired.drift_repaired);
    assert!(syncer.kernel_unchanged().unwrap());
    // A sync that trusts memory while someone else committed does not make it known again.
    let foreign = syncer.kernel().tables[&key]
        .chains
        .values()
        .next()
        .unwrap()
        .clone();
    syncer
        .kernel()
        .tables_mut()
        .get_mut(&key)
        .unwrap()
        .chains
        .insert("foreign".into(), foreign);
    add_service(&mut st, "later", "203.0.113.40", "198.51.100.40");
    let out = syncer.sync(&st, &settings(), false).unwrap();
    assert!(!out.full, "trusted memory");
    assert!(!syncer.kernel_unchanged().unwrap());
    // The next verification reads back and removes the foreign chain.
    assert!(syncer.sync(&st, &settings(), true).unwrap().drift_repaired);
    assert!(syncer.kernel_unchanged().unwrap());
}

/// ClusterIP Services `bulk-<i>` for each `i` of `range`, one endpoint each: one element each in
/// `cluster-ips`, `service-ips` and `pick-1-endpoints`.
fn add_bulk(st: &mut ClusterState, range: std::ops::Range<u32>) -> BTreeSet<ServiceName> {
    let mut names = BTreeSet::new();
    for i in range {
        let (hi, lo) = (i / 256, i % 256);
        let n = format!("bulk-{i}");
        add_service(
            st,
            &n,
            &format!("10.96.{hi}.{lo}"),
            &format!("10.201.{hi}.{lo}"),
        );
        names.insert(name("ns", &n));
    }
    names
}

/// Element count and size of each of the three sets `add_bulk` fills, in the kernel's ip table.
fn bulk_sets(k: &FakeKernel) -> Vec<(usize, Option<u32>)> {
    let t = &k.tables[&(IpFamily::V4, ruleset::names::TABLE.to_owned())];
    ["cluster-ips", "service-ips", "pick-1-endpoints"]
        .iter()
        .map(|n| (t.sets[*n].elements.len(), t.sets[*n].size))
        .collect()
}

/// The full path, reading the kernel back, finds nothing to change: the change syncs left what
/// it would (the sizes kept by hysteresis included).
fn assert_full_path_agrees(syncer: &mut Syncer<FakeKernel>, st: &ClusterState, context: &str) {
    let mut check = Syncer::new(syncer.kernel().clone());
    let out = check.sync(st, &settings(), true).unwrap();
    assert_eq!(out.report.messages, 0, "{context}: {out}");
}

#[test]
fn a_change_sync_leaving_a_sets_size_margin_goes_the_full_path_which_resizes() {
    let settings = settings();
    let mut st = state();
    add_bulk(&mut st, 0..998);
    let mut syncer = Syncer::new(FakeKernel::new());
    syncer.sync(&st, &settings, false).unwrap();
    assert_eq!(bulk_sets(syncer.kernel()), vec![(1000, None); 3]);

    // Past the threshold: the sets need a size.
    let changed = add_bulk(&mut st, 998..999);
    let reason = needs_full(syncer.sync_changed(&st.subset(&changed), &changed, &settings));
    assert!(reason.contains("margin of its size"), "{reason}");
    syncer.sync(&st, &settings, false).unwrap();
    assert_eq!(bulk_sets(syncer.kernel()), vec![(1001, Some(2048)); 3]);
    assert!(syncer.kernel().tables == full_tables(&st, &settings).tables);

    // Up to 3/4 of the size, change syncs keep it (a fresh kernel would get 4096)...
    let changed = add_bulk(&mut st, 999..1534);
    done(syncer.sync_changed(&st.subset(&changed), &changed, &settings));
    assert_eq!(bulk_sets(syncer.kernel()), vec![(1536, Some(2048)); 3]);
    assert_full_path_agrees(&mut syncer, &st, "at 3/4");
    // ... one more element leaves the margin, and the full path recreates the sets.
    let changed = add_bulk(&mut st, 1534..1535);
    needs_full(syncer.sync_changed(&st.subset(&changed), &changed, &settings));
    let out = syncer.sync(&st, &settings, false).unwrap();
    assert_eq!(out.report.elements_added, 3 * 1537, "{out}");
    assert_eq!(bulk_sets(syncer.kernel()), vec![(1537, Some(4096)); 3]);
    assert!(syncer.kernel().tables == full_tables(&st, &settings).tables);

    // Shrinking: kept down to 1/8 of the size, then none below the threshold.
    let gone: BTreeSet<ServiceName> = (510..1535)
        .map(|i| name("ns", &format!("bulk-{i}")))
        .collect();
    st.services.retain(|n, _| !gone.contains(n));
    st.slices.retain(|_, s| !gone.contains(&s.service));
    done(syncer.sync_changed(&st.subset(&gone), &gone, &settings));
    assert_eq!(bulk_sets(syncer.kernel()), vec![(512, Some(4096)); 3]);
    assert_full_path_agrees(&mut syncer, &st, "at 1/8");
    let gone = BTreeSet::from([name("ns", "bulk-509")]);
    st.services.retain(|n, _| !gone.contains(n));
    st.slices.retain(|_, s| !gone.contains(&s.service));
    needs_full(syncer.sync_changed(&st.subset(&gone), &gone, &settings));
    syncer.sync(&st, &settings, false).unwrap();
    assert_eq!(bulk_sets(syncer.kernel()), vec![(511, None); 3]);
    assert!(syncer.kernel().tables == full_tables(&st, &settings).tables);
}

/// A new process on the kernel the previous one left: its handle opens now.
fn restart(syncer: &mut Syncer<FakeKernel>) -> Syncer<FakeKernel> {
    let mut k = syncer.kernel().clone();
    k.reopen();
    Syncer::new(k)
}

fn clear_set(k: &mut FakeKernel, set: &str) {
    k.tables
        .get_mut(&(IpFamily::V4, "nodeproxy".to_string()))
        .unwrap()
        .sets
        .get_mut(set)
        .unwrap()
        .elements
        .clear();
}

#[test]
fn a_restart_adopts_sealed_tables_without_reading_their_elements_and_verifies_later() {
    let st = state();
    let mut first = Syncer::new(FakeKernel::new());
    first.sync(&st, &settings(), false).unwrap();
    assert!(first.seal().unwrap());
    assert_eq!(first.kernel().seals_written, 1);
    assert!(
        first.kernel_unchanged().unwrap(),
        "the seal is our own commit"
    );

    // Nothing changed: both tables adopted, nothing to send, and a verification agrees.
    let mut second = restart(&mut first);
    let out = second.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 2, "{out}");
    assert_eq!(out.report.messages, 0, "{out}");
    let verified = second.sync(&st, &settings(), true).unwrap();
    assert_eq!(
        verified.report.tables_adopted, 0,
        "only a first sync adopts"
    );
    assert!(
        !verified.drift_repaired && verified.report.messages == 0,
        "{verified}"
    );
    assert!(second.seal().unwrap());

    // The elements are really not read: an element removed without moving the generation
    // (which a real kernel never does) goes unnoticed by the adoption, and is found by the next
    // verification, which reads everything.
    let mut third = restart(&mut second);
    clear_set(third.kernel(), "cluster-ips");
    let out = third.sync(&st, &settings(), false).unwrap();
    assert_eq!(
        (out.report.tables_adopted, out.report.elements_added),
        (2, 0),
        "{out}"
    );
    let verified = third.sync(&st, &settings(), true).unwrap();
    assert!(verified.drift_repaired, "{verified}");
    assert_eq!(verified.report.elements_added, 2, "{verified}");
    assert!(third.kernel().tables == full_tables(&st, &settings()).tables);
}

/// Our ip table in the fake kernel, changed without moving the generation (which a real
/// kernel never allows): what a seal cannot see.
fn ip_table_unseen(k: &mut FakeKernel) -> &mut WireTable {
    k.tables
        .get_mut(&(IpFamily::V4, "nodeproxy".to_string()))
        .unwrap()
}

#[test]
fn an_adopted_table_gets_what_differs_in_its_definitions_and_keeps_its_elements() {
    let st = state();
    let full = full_tables(&st, &settings()).tables;
    let mut first = Syncer::new(FakeKernel::new());
    first.sync(&st, &settings(), false).unwrap();
    assert!(first.seal().unwrap());

    // A chain's rules differ: rewritten on adoption, no element sent or copied.
    let mut second = restart(&mut first);
    let (chain, rules) = {
        let table = ip_table_unseen(second.kernel());
        let (name, chain) = table
            .chains
            .iter_mut()
            .find(|(_, c)| !c.rules.is_empty())
            .unwrap();
        (name.clone(), std::mem::take(&mut chain.rules).len())
    };
    let out = second.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 2, "{out}");
    assert_eq!(
        (out.report.elements_added, out.report.elements_removed),
        (0, 0),
        "{out}"
    );
    assert!(
        rules > 0 && out.report.chains_rewritten >= 1,
        "{chain}: {out}"
    );
    assert!(second.kernel().tables == full);
    // What the syncer applied has the elements: a verification reads everything and agrees.
    let verified = second.sync(&st, &settings(), true).unwrap();
    assert!(
        !verified.drift_repaired && verified.report.messages == 0,
        "{verified}"
    );

    // A set's definition differs: it is recreated, with the sealed elements.
    assert!(second.seal().unwrap());
    let mut third = restart(&mut second);
    let set = ip_table_unseen(third.kernel())
        .sets
        .get_mut("cluster-ips")
        .unwrap();
    let count = set.elements.len();
    set.userdata.push(0);
    let out = third.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 2, "{out}");
    assert_eq!(out.report.elements_added, count, "{out}");
    assert!(count > 0 && third.kernel().tables == full);
    let verified = third.sync(&st, &settings(), true).unwrap();
    assert!(
        !verified.drift_repaired && verified.report.messages == 0,
        "{verified}"
    );
}

#[test]
fn a_seal_is_not_trusted_after_anyone_elses_commit_in_another_boot_or_for_other_elements() {
    let st = state();
    let mut first = Syncer::new(FakeKernel::new());
    first.sync(&st, &settings(), false).unwrap();
    assert!(first.seal().unwrap());
    let sealed = first.kernel().clone();
    let full = full_tables(&st, &settings()).tables;

    // Someone else's change to our table moves the generation: read back and repaired.
    let mut k = sealed.clone();
    k.tables_mut();
    clear_set(&mut k, "cluster-ips");
    k.reopen();
    let mut second = Syncer::new(k);
    let out = second.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 0, "{out}");
    assert_eq!(out.report.elements_added, 2, "{out}");
    assert!(second.kernel().tables == full);

    // Anyone's commit after our handle opened, even on nothing of ours, too.
    let mut k = sealed.clone();
    k.reopen();
    let mut second = Syncer::new(k);
    second.kernel().tables_mut();
    let out = second.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 0, "{out}");

    // A seal of another boot (a ruleset saved and restored after a reboot).
    let mut k = sealed.clone();
    let text = k.seal.clone().unwrap();
    let boot = seal::boot_id().unwrap();
    k.seal = Some(text.replace(&boot, &"0".repeat(32)));
    k.reopen();
    let out = Syncer::new(k).sync(&st, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 0, "{out}");

    // Other elements wanted (an endpoint moved): that table is read back, and the result is
    // what a full build from scratch gives.
    let mut moved = st.clone();
    let slice = moved.slices.values_mut().next().unwrap();
    slice.endpoints[0].addr = "198.51.100.99".parse().unwrap();
    let mut k = sealed;
    k.reopen();
    let mut second = Syncer::new(k);
    let out = second.sync(&moved, &settings(), false).unwrap();
    assert_eq!(
        out.report.tables_adopted, 1,
        "the ip6 table is the sealed one: {out}"
    );
    assert!(out.report.elements_added > 0, "{out}");
    assert!(second.kernel().tables == full_tables(&moved, &settings()).tables);
}

#[test]
fn once_seals_and_the_next_once_adopts() {
    let mut k = FakeKernel::new();
    let reload = || -> Result<ClusterState, NftError> { Ok(state()) };
    let out = super::once(&mut k, state(), &settings(), reload).unwrap();
    assert_eq!(out.report.tables_adopted, 0, "{out}");
    assert_eq!(k.seals_written, 1);
    k.reopen();
    let out = super::once(&mut k, state(), &settings(), reload).unwrap();
    assert_eq!(out.report.tables_adopted, 2, "{out}");
    assert_eq!(out.report.messages, 0, "{out}");
    assert_eq!(k.seals_written, 2);
}

#[test]
fn once_seals_a_changed_table_with_the_digest_made_while_it_was_sent() {
    let mut k = FakeKernel::new();
    let salt = |k: &FakeKernel| Seal::parse(k.seal.as_deref().unwrap()).unwrap().salt;
    let st = state();
    let reload = || -> Result<ClusterState, NftError> { unreachable!("nothing is rejected") };
    super::once(&mut k, st.clone(), &settings(), reload).unwrap();
    let first = salt(&k);

    // An endpoint moved: the ip table is sent (and hashed meanwhile, with the salt of the
    // seal the ip6 table is adopted on), the ip6 table adopted; both are sealed together.
    let mut moved = st.clone();
    let slice = moved.slices.values_mut().next().unwrap();
    slice.endpoints[0].addr = "198.51.100.99".parse().unwrap();
    k.reopen();
    let out = super::once(&mut k, moved.clone(), &settings(), reload).unwrap();
    assert_eq!(out.report.tables_adopted, 1, "{out}");
    assert!(out.report.messages > 0, "{out}");
    assert_eq!(
        salt(&k),
        first,
        "the seal was hashed again with a fresh salt"
    );

    // That seal holds: the next process adopts both tables, and they are a full build's.
    k.reopen();
    let out = super::once(&mut k, moved.clone(), &settings(), reload).unwrap();
    assert_eq!(out.report.tables_adopted, 2, "{out}");
    assert_eq!(out.report.messages, 0, "{out}");
    assert!(k.tables == full_tables(&moved, &settings()).tables);
}

#[test]
fn a_seal_after_adopting_unchanged_tables_reuses_their_digests_and_one_after_a_change_does_not() {
    let st = state();
    let sealed =
        |s: &mut Syncer<FakeKernel>| Seal::parse(s.kernel().seal.as_deref().unwrap()).unwrap();
    let mut first = Syncer::new(FakeKernel::new());
    first.sync(&st, &settings(), false).unwrap();
    assert!(first.seal().unwrap());
    let one = sealed(&mut first);

    let mut second = restart(&mut first);
    let out = second.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 2, "{out}");
    assert!(second.seal().unwrap());
    let two = sealed(&mut second);
    assert_eq!((two.salt, &two.digests), (one.salt, &one.digests));
    assert_eq!(two.generation, one.generation.wrapping_add(1));

    // Adopted again on the seal written from the reused digests; then a change, after which
    // the seal is hashed anew: the next process adopts the changed tables, not the old ones.
    let mut third = restart(&mut second);
    let out = third.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 2, "{out}");
    let mut changed = st.clone();
    changed.services.pop_first().unwrap();
    let out = third.sync(&changed, &settings(), false).unwrap();
    assert!(out.report.messages > 0, "{out}");
    assert!(third.seal().unwrap());
    let three = sealed(&mut third);
    assert_ne!(three.salt, one.salt);
    let mut fourth = restart(&mut third);
    let out = fourth.sync(&changed, &settings(), false).unwrap();
    assert_eq!(out.report.tables_adopted, 2, "{out}");
    let mut fifth = restart(&mut fourth);
    let out = fifth.sync(&st, &settings(), false).unwrap();
    // (The table whose elements the change left alone may be adopted.)
    assert!(
        out.report.tables_adopted < 2 && out.report.elements_added > 0,
        "{out}"
    );
    assert!(fifth.kernel().tables == full_tables(&st, &settings()).tables);
}
