//! Unit tests of the preview kernel: what it reports for the changes `nodeproxy diff` is for,
//! against the in-memory kernel, which must be left exactly as it was.

use super::*;
use crate::config::Config;
use crate::model::{ClusterState, Node};
use crate::nft::{self, FakeKernel};
use crate::ruleset::{self, Settings};
use crate::sync::tests::add_service;

fn name(n: &str) -> ServiceName {
    ServiceName::new("ns", n)
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
    add_service(&mut st, "web", "203.0.113.10", "198.51.100.10");
    st
}

fn settings() -> Settings {
    Settings::new(&Config::default(), "node-a".into())
}

/// A kernel programmed with `state`, as `--once` leaves it.
fn programmed(state: &ClusterState) -> FakeKernel {
    let mut kernel = FakeKernel::new();
    nft::sync(&mut kernel, ruleset::build(state, &settings())).unwrap();
    kernel
}

/// What a sync of `state` would change in `kernel`, checking that the kernel is untouched.
fn preview(kernel: &mut FakeKernel, state: &ClusterState) -> Report {
    let before = kernel.tables.clone();
    let transactions = kernel.transactions;
    let mut preview = Preview::new(&mut *kernel);
    nft::sync(&mut preview, ruleset::build(state, &settings())).unwrap();
    let report = preview.into_report();
    assert_eq!(kernel.tables, before, "a preview changed the kernel");
    assert_eq!(kernel.transactions, transactions);
    report
}

fn lines(report: &Report) -> Vec<String> {
    report.render().lines().map(str::to_owned).collect()
}

#[test]
fn the_programmed_state_previews_as_no_change() {
    let st = state();
    let mut kernel = programmed(&st);
    let report = preview(&mut kernel, &st);
    assert!(report.is_empty());
    assert_eq!(
        lines(&report),
        ["no changes: the kernel's tables are what a sync would program"]
    );
}

#[test]
fn a_replaced_endpoint_is_shown_under_its_service() {
    // The endpoint is on another node: no hairpin element, only the slot's endpoint changes.
    let mut kernel = programmed(&state());
    let mut st = ClusterState {
        nodes: state().nodes,
        ..ClusterState::default()
    };
    add_service(&mut st, "web", "203.0.113.10", "198.51.100.99");
    let report = preview(&mut kernel, &st);
    let text = lines(&report);
    assert_eq!(text[0], "Service ns/web", "{text:#?}");
    assert!(
        text.contains(&"  ~ element ip nodeproxy pick-1-endpoints { 203.0.113.10 . tcp . 80 . 0 : 198.51.100.99 . 8080 } (was : 198.51.100.10 . 8080)".to_owned()),
        "{text:#?}"
    );
    // Only elements move: no chain, set or shared object.
    assert!(!text.iter().any(|l| l.starts_with("Shared")), "{text:#?}");
    assert_eq!(report.counts(Object::Chain), Counts::default());
    assert_eq!(
        text.last().unwrap(),
        "summary: 1 Service(s) changed; element(s) 0 added, 0 removed, 1 changed"
    );
}

#[test]
fn a_new_service_is_all_additions_and_an_empty_kernel_is_everything() {
    let mut kernel = programmed(&state());
    let mut st = state();
    add_service(&mut st, "api", "203.0.113.11", "198.51.100.11");
    let report = preview(&mut kernel, &st);
    assert_eq!(
        report.services().into_iter().cloned().collect::<Vec<_>>(),
        [name("api")]
    );
    assert!(
        report
            .changes()
            .iter()
            .all(|c| c.sign == Sign::Added && c.owner == Owner::Service(name("api"))),
        "{:#?}",
        lines(&report)
    );
    assert!(
        lines(&report)
            .contains(&"  + element ip nodeproxy cluster-ips { 203.0.113.11 }".to_owned())
    );

    let mut empty = FakeKernel::new();
    let report = preview(&mut empty, &st);
    let text = lines(&report);
    assert!(
        text.contains(&"  + table ip nodeproxy".to_owned()),
        "{text:#?}"
    );
    assert!(
        text.contains(&"  + table ip6 nodeproxy".to_owned()),
        "{text:#?}"
    );
    assert!(
        report.changes().iter().all(|c| c.sign == Sign::Added),
        "{text:#?}"
    );
    assert_eq!(report.services().len(), 2);
}

#[test]
fn a_hand_edit_shows_its_repair() {
    let st = state();
    let mut kernel = programmed(&st);
    let key = (IpFamily::V4, ruleset::names::TABLE.to_owned());
    let table = kernel.tables_mut().get_mut(&key).unwrap();
    table
        .sets
        .get_mut(ruleset::names::CLUSTER_IPS)
        .unwrap()
        .elements
        .clear();
    let services = table.chains.get_mut(ruleset::names::SERVICES).unwrap();
    let rules = services.rules.len();
    services.rules.pop();
    let report = preview(&mut kernel, &st);
    let text = lines(&report);
    assert!(
        text.contains(&"  + element ip nodeproxy cluster-ips { 203.0.113.10 }".to_owned()),
        "{text:#?}"
    );
    let chain = format!(
        "  ~ chain ip nodeproxy services: rules rewritten (1 rule(s) added, 0 removed; {} -> {rules} rules)",
        rules - 1
    );
    assert!(text.contains(&chain), "{text:#?}");
    // The chain is shared; it comes after the Service's element.
    let service_at = text.iter().position(|l| l == "Service ns/web").unwrap();
    let shared_at = text
        .iter()
        .position(|l| l == "Shared objects (no single Service)")
        .unwrap();
    assert!(service_at < shared_at, "{text:#?}");
}

#[test]
fn removed_elements_are_attributed_by_their_comment_or_their_services_key() {
    let mut st = state();
    add_service(&mut st, "api", "203.0.113.11", "198.51.100.11");
    let mut kernel = programmed(&st);
    let report = preview(&mut kernel, &state());
    assert!(
        report
            .changes()
            .iter()
            .all(|c| c.sign == Sign::Removed && c.owner == Owner::Service(name("api"))),
        "{:#?}",
        lines(&report)
    );
    // The endpoint's element has no comment in the kernel: its key names the Service.
    assert!(
        report
            .changes()
            .iter()
            .any(|c| c.name == "pick-1-endpoints"),
        "{:#?}",
        lines(&report)
    );
}

/// `web` with a NodePort and the endpoints `endpoints`.
fn nodeport_state(endpoints: &[&str]) -> ClusterState {
    let mut st = state();
    let web = name("web");
    let svc = st.services.get_mut(&web).unwrap();
    svc.ports[0].node_port = Some(30080);
    let slice = st.slices.values_mut().next().unwrap();
    let first = slice.endpoints[0].clone();
    slice.endpoints = endpoints
        .iter()
        .map(|addr| crate::model::SliceEndpoint {
            addr: addr.parse().unwrap(),
            ..first.clone()
        })
        .collect();
    st
}

#[test]
fn endpoint_elements_without_comments_are_shown_under_their_service() {
    let two = nodeport_state(&["198.51.100.10", "198.51.100.20"]);
    let mut kernel = programmed(&two);
    let table = &kernel.tables[&(IpFamily::V4, ruleset::names::TABLE.to_owned())];
    for map in ["pick-2-endpoints", "nodeport-pick-2-endpoints"] {
        let elements = &table.sets[map].elements;
        assert_eq!(elements.len(), 2, "{map}");
        assert!(elements.values().all(|e| e.userdata.is_none()), "{map}");
    }

    // One endpoint left: the two-endpoint maps go, their elements under the Service.
    let report = preview(&mut kernel, &nodeport_state(&["198.51.100.10"]));
    let text = lines(&report);
    let removed = |map: &str| {
        report
            .changes()
            .iter()
            .filter(|c| c.object == Object::Element && c.name == map && c.sign == Sign::Removed)
            .map(|c| c.owner.clone())
            .collect::<Vec<_>>()
    };
    for map in ["pick-2-endpoints", "nodeport-pick-2-endpoints"] {
        assert_eq!(
            removed(map),
            [Owner::Service(name("web")), Owner::Service(name("web"))],
            "{map}: {text:#?}"
        );
    }
    assert!(
        report
            .changes()
            .iter()
            .filter(|c| c.object == Object::Element)
            .all(|c| c.owner == Owner::Service(name("web"))),
        "{text:#?}"
    );

    // A hand-made element whose key no Service-level element has is nobody's.
    let mut kernel = programmed(&two);
    let table = kernel
        .tables_mut()
        .get_mut(&(IpFamily::V4, ruleset::names::TABLE.to_owned()))
        .unwrap();
    let map = table.sets.get_mut("pick-2-endpoints").unwrap();
    let (key, elem) = map
        .elements
        .iter()
        .next()
        .map(|(k, e)| (k.clone(), e.clone()))
        .unwrap();
    let mut stray = key.to_vec();
    stray[0] ^= 0x40;
    map.elements
        .insert(nft::wire::ElemBytes::from(&stray[..]), elem);
    let report = preview(&mut kernel, &two);
    let changes = report.changes();
    assert_eq!(changes.len(), 1, "{:#?}", lines(&report));
    assert_eq!(
        (changes[0].sign, &changes[0].owner),
        (Sign::Removed, &Owner::Shared)
    );
}

#[test]
fn a_preview_never_deletes() {
    let mut kernel = programmed(&state());
    let mut preview = Preview::new(&mut kernel);
    assert!(preview.delete_tables(ruleset::names::TABLE).is_err());
    assert_eq!(kernel.tables.len(), 2);
}

#[test]
fn a_set_recreated_for_its_size_says_so() {
    let mut st = state();
    for i in 0..999 {
        let (hi, lo) = (i / 256, i % 256);
        add_service(
            &mut st,
            &format!("bulk-{i}"),
            &format!("10.96.{hi}.{lo}"),
            &format!("10.201.{hi}.{lo}"),
        );
    }
    let mut kernel = programmed(&st);
    add_service(&mut st, "one-more", "10.97.0.1", "10.202.0.1");
    let report = preview(&mut kernel, &st);
    let sets: Vec<String> = lines(&report)
        .into_iter()
        .filter(|l| l.contains(": recreated ("))
        .collect();
    assert_eq!(
        sets,
        ["cluster-ips", "pick-1-endpoints", "service-ips"].map(|n| format!(
            "  ~ {} ip nodeproxy {n}: recreated (its size changed: none -> 2048), 1001 element(s)",
            if n == "cluster-ips" { "set" } else { "map" }
        ))
    );
}
