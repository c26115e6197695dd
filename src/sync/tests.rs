//! Unit tests of the single writer against the in-memory kernel.
use std::io;

use super::*;
use crate::config::Config;
use crate::model::{
    Conditions, Node, Protocol, ServicePort, SliceEndpoint, SlicePort, TrafficPolicy,
};
use crate::nft::{ApplyStats, FakeKernel, Op, Plan, RejectedOp};

fn name(ns: &str, n: &str) -> ServiceName {
    ServiceName {
        namespace: ns.into(),
        name: n.into(),
    }
}

fn add_service(state: &mut ClusterState, n: &str, ip: &str, endpoint: &str) {
    let svc = Service {
        name: name("ns", n),
        cluster_ips: vec![ip.parse().unwrap()],
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 80,
            node_port: None,
        }],
        external_ips: vec![],
        load_balancer_ips: vec![],
        load_balancer_source_ranges: vec![],
        external_traffic_policy: TrafficPolicy::Cluster,
        internal_traffic_policy: TrafficPolicy::Cluster,
        health_check_node_port: None,
        session_affinity_timeout: None,
    };
    let slice = EndpointSlice {
        name: name("ns", &format!("{n}-1")),
        service: svc.name.clone(),
        family: IpFamily::V4,
        ports: vec![SlicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 8080,
        }],
        endpoints: vec![SliceEndpoint {
            addr: endpoint.parse().unwrap(),
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
                        && self.poisoned.contains(&origin.service.name)
                    {
                        errors.push(RejectedOp {
                            op: "add element",
                            object: format!("element in {set}"),
                            origin: Some((**origin).clone()),
                            errno: io::Error::from_raw_os_error(22),
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
    let everyone: Vec<String> = st.services.keys().map(|n| n.name.clone()).collect();
    let refs: Vec<&str> = everyone.iter().map(String::as_str).collect();
    let mut syncer = Syncer::new(kernel(&refs));
    // All of them are rejected in the first round, so all are quarantined at once and the
    // rest (nothing) applies.
    let out = syncer.sync(&st, &settings(), false).unwrap();
    assert_eq!(out.quarantined.len(), everyone.len());
}

/// `ns/sticky` (ClusterIP 203.0.113.30) with ClientIP affinity and one endpoint per address.
fn add_sticky(state: &mut ClusterState, endpoints: &[&str]) {
    add_service(state, "sticky", "203.0.113.30", endpoints[0]);
    let svc = name("ns", "sticky");
    if let Some(s) = state.services.get_mut(&svc) {
        s.session_affinity_timeout = Some(10800);
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

/// The slot map holding `endpoint` (`addr . 8080`) for the ClusterIP of `ns/sticky`.
fn slot_map_of(k: &mut PoisonKernel, endpoint: &str) -> Vec<String> {
    let table = k
        .inner
        .read_table(IpFamily::V4, "nodeproxy")
        .unwrap()
        .unwrap();
    table
        .sets
        .iter()
        .filter(|(name, _)| name.ends_with("-endpoints") && name.starts_with("affinity-slot-"))
        .filter(|(_, set)| {
            set.elements.iter().any(|(key, e)| {
                set.format_key(key) == "203.0.113.30 . tcp . 80"
                    && matches!(&e.data, Some(crate::nft::WireData::Value(v))
                        if crate::nft::wire::format_concat(set.data_type.unwrap_or(0), v)
                            == format!("{endpoint} . 8080"))
            })
        })
        .map(|(name, _)| name.clone())
        .collect()
}

#[test]
fn affinity_slots_are_kept_across_a_restart_from_what_the_kernel_holds() {
    let (a, b, c) = ("198.51.100.31", "198.51.100.32", "198.51.100.33");
    let mut st = state();
    add_sticky(&mut st, &[a, b, c]);
    let mut syncer = Syncer::new(kernel(&[]));
    syncer.sync(&st, &settings(), false).unwrap();
    // One read per family: the affinity hints and the diff share the read-back.
    assert_eq!(syncer.kernel().reads, 2);
    assert_eq!(
        slot_map_of(syncer.kernel(), b),
        ["affinity-slot-1-endpoints"]
    );

    // A new process (nothing applied in memory) over the same kernel, after `a` went away.
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
        slot_map_of(restarted.kernel(), b),
        ["affinity-slot-1-endpoints"]
    );
    assert_eq!(
        slot_map_of(restarted.kernel(), c),
        ["affinity-slot-2-endpoints"]
    );
    // In steady state the hints come from what was applied: no read.
    let mut with_d = state();
    add_sticky(&mut with_d, &["198.51.100.3", b, c]);
    restarted.sync(&with_d, &settings(), false).unwrap();
    assert_eq!(restarted.kernel().reads, 2);
    assert_eq!(
        slot_map_of(restarted.kernel(), "198.51.100.3"),
        ["affinity-slot-0-endpoints"]
    );
    assert_eq!(
        slot_map_of(restarted.kernel(), b),
        ["affinity-slot-1-endpoints"]
    );
}
