//! Unit tests for the model.
use super::*;

#[test]
fn endpoints_prefer_non_terminating_duplicate() {
    let svc = ServiceName::new("ns", "a");
    let mk = |slice: &str, terminating: bool| EndpointSlice {
        name: ServiceName::new("ns", slice),
        service: svc.clone(),
        family: IpFamily::V4,
        ports: vec![SlicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 8080,
        }],
        endpoints: vec![SliceEndpoint {
            addr: "192.0.2.10".parse().unwrap(),
            conditions: Conditions {
                ready: !terminating,
                serving: true,
                terminating,
            },
            node_name: None,
            zone: None,
            hints: None,
        }],
    };
    let mut state = ClusterState::default();
    for (name, term) in [("a-1", false), ("a-2", true)] {
        let s = mk(name, term);
        state.slices.insert(s.name.clone(), s);
    }
    let service = Service {
        cluster_ips: vec!["198.51.100.10".parse().unwrap()],
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: Protocol::Tcp,
            port: 80,
            node_port: None,
        }],
        ..Service::new(svc.clone())
    };
    let index = state.slices_by_service();
    let eps = endpoints_for(&index[&service.name], &service.ports[0]);
    assert_eq!(eps.len(), 1);
    assert!(!eps[0].conditions.terminating);
    assert_eq!(eps[0].port, 8080);
}

#[test]
fn a_subset_holds_the_services_and_every_slice_of_theirs_whatever_the_slices_are_named() {
    let name = |ns: &str, n: &str| ServiceName::new(ns, n);
    let mut state = ClusterState::default();
    // Slices named after their Service or not, in namespaces that sort before, between and
    // after the changed Services' ones, with same-named Services in other namespaces.
    for (ns, slice, svc) in [
        ("a", "web-1", "web"),
        ("b", "web-1", "web"),
        ("b", "custom", "web"),
        ("b", "zzz", "web"),
        ("b", "db-1", "db"),
        ("bb", "web-1", "web"),
        ("c", "web-1", "web"),
        ("c", "other", "db"),
        ("d", "web-1", "web"),
    ] {
        let s = EndpointSlice {
            name: name(ns, slice),
            service: name(ns, svc),
            family: IpFamily::V4,
            ports: vec![],
            endpoints: vec![],
        };
        state.slices.insert(s.name.clone(), s);
    }
    for (ns, svc) in [("b", "web"), ("b", "db"), ("c", "db")] {
        let s = Service::new(name(ns, svc));
        state.services.insert(s.name.clone(), s);
    }
    // "c/web" changed too but no longer exists: its slice is kept, as the full build keeps it.
    let changed = BTreeSet::from([name("b", "web"), name("c", "db"), name("c", "web")]);
    let subset = state.subset(&changed);
    let slices: Vec<String> = subset.slices.keys().map(ToString::to_string).collect();
    assert_eq!(
        slices,
        ["b/custom", "b/web-1", "b/zzz", "c/other", "c/web-1"]
    );
    let services: Vec<String> = subset.services.keys().map(ToString::to_string).collect();
    assert_eq!(services, ["b/web", "c/db"]);
}

#[test]
fn a_service_name_is_its_namespace_and_name_compared_as_that_pair() {
    let name = ServiceName::new("shop", "web");
    assert_eq!((name.namespace(), name.name()), ("shop", "web"));
    assert_eq!(name.to_string(), "shop/web");
    assert_eq!(
        format!("{name:?}"),
        r#"ServiceName { namespace: "shop", name: "web" }"#
    );
    assert_eq!(name.clone(), name);

    // Ordered by namespace first: as one text "a-b/y" would sort before "a/x" ('-' < '/').
    let mut names = [
        ServiceName::new("a-b", "y"),
        ServiceName::new("a", "x"),
        ServiceName::new("a", "x-1"),
        ServiceName::new("a", ""),
    ];
    names.sort();
    let pairs: Vec<(&str, &str)> = names.iter().map(|n| (n.namespace(), n.name())).collect();
    assert_eq!(pairs, [("a", ""), ("a", "x"), ("a", "x-1"), ("a-b", "y")]);

    // A file may put a '/' in a name (only control characters and length are refused): the
    // split is part of the identity, although both display alike.
    let left = ServiceName::new("a/b", "c");
    let right = ServiceName::new("a", "b/c");
    assert_eq!(left.to_string(), right.to_string());
    assert_ne!(left, right);
    assert_eq!((left.namespace(), left.name()), ("a/b", "c"));
    assert_eq!((right.namespace(), right.name()), ("a", "b/c"));
    assert_eq!(left.cmp(&right), std::cmp::Ordering::Greater);
    let set: std::collections::HashSet<ServiceName> = [left, right].into_iter().collect();
    assert_eq!(set.len(), 2);
}

#[test]
fn a_name_table_gives_one_text_per_name_and_forgets_names_nobody_holds() {
    let mut names = NameTable::default();
    let a = names.get("node-a");
    let again = names.get("node-a");
    assert!(Arc::ptr_eq(&a, &again));
    assert_eq!(&*a, "node-a");
    assert!(!Arc::ptr_eq(&a, &names.get("node-b")));

    // Names that nothing holds any more are dropped once the table reaches its pruning size;
    // the ones still held stay, and give the same text afterwards.
    for i in 0..NameTable::PRUNE_FROM {
        names.get(&format!("gone-{i}"));
    }
    assert!(names.len() <= NameTable::PRUNE_FROM);
    let kept = names.get("node-a");
    assert!(Arc::ptr_eq(&a, &kept));
    assert_eq!(&*names.get("node-c"), "node-c");

    // A stream of names that are never kept costs at most twice what is held (here: nothing
    // but node-a, node-c and the newest name).
    for i in 0..10 * NameTable::PRUNE_FROM {
        names.get(&format!("churn-{i}"));
        assert!(names.len() <= NameTable::PRUNE_FROM);
    }
    assert!(Arc::ptr_eq(&a, &names.get("node-a")));
}
