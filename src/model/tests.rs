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
        }]
        .into(),
        endpoints: vec![SliceEndpoint {
            addr: "192.0.2.10".parse().unwrap(),
            conditions: Conditions {
                ready: !terminating,
                serving: true,
                terminating,
            },
            locality: None,
        }]
        .into(),
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
            ports: vec![].into(),
            endpoints: vec![].into(),
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
fn an_endpoint_is_thirty_two_bytes() {
    // docs/performance.md ("Node and zone names shared"): the model holds 100k of these at 10k
    // Services × 10 endpoints.
    assert_eq!(std::mem::size_of::<SliceEndpoint>(), 32);
}

#[test]
fn hints_are_set_on_the_endpoint_alone_keeping_its_node_and_zone() {
    let mut names = NameTable::default();
    let ep = |locality| SliceEndpoint {
        addr: "192.0.2.10".parse().unwrap(),
        conditions: Conditions {
            ready: true,
            serving: true,
            terminating: false,
        },
        locality,
    };
    let mut hinted = ep(names.locality(Some("node-a"), Some("zone-a")));
    let plain = ep(names.locality(Some("node-a"), Some("zone-a")));
    hinted.set_hints(Hints::new(vec!["zone-b".into()], vec![]));
    assert_eq!(hinted.zone_hints(), ["zone-b"]);
    assert_eq!(
        (hinted.node_name(), hinted.zone()),
        (Some("node-a"), Some("zone-a"))
    );
    // The locality the two shared is not changed under the other endpoint.
    assert!(plain.hints().is_none());
    assert_eq!(
        plain.locality,
        names.locality(Some("node-a"), Some("zone-a"))
    );
    hinted.set_hints(None);
    assert!(hinted.hints().is_none());
    assert_eq!(hinted.locality, plain.locality);
    // Hints alone, with neither node nor zone, are kept; removing them leaves nothing.
    let mut bare = ep(None);
    bare.set_hints(Hints::new(vec![], vec!["node-b".into()]));
    assert_eq!(bare.node_hints(), ["node-b"]);
    assert_eq!(bare.node_name(), None);
    bare.set_hints(None);
    assert_eq!(bare.locality, None);
}

#[test]
fn a_name_table_gives_one_locality_per_pair_and_forgets_what_nobody_holds() {
    let mut names = NameTable::default();
    assert_eq!(names.locality(None, None), None);
    let a = names.locality(Some("node-a"), Some("zone-1")).unwrap();
    let again = names.locality(Some("node-a"), Some("zone-1")).unwrap();
    assert!(Arc::ptr_eq(&a, &again));
    assert_eq!(
        (a.node_name.as_deref(), a.zone.as_deref()),
        (Some("node-a"), Some("zone-1"))
    );
    // Another pair with the same node shares the node's text.
    let other = names.locality(Some("node-a"), None).unwrap();
    assert!(!Arc::ptr_eq(&a, &other));
    assert_eq!(other.zone, None);
    assert!(Arc::ptr_eq(
        a.node_name.as_ref().unwrap(),
        other.node_name.as_ref().unwrap()
    ));
    let zone_only = names.locality(None, Some("zone-1")).unwrap();
    assert!(Arc::ptr_eq(
        a.zone.as_ref().unwrap(),
        zone_only.zone.as_ref().unwrap()
    ));
    drop((other, zone_only));

    // What nothing holds any more is dropped once the table reaches its pruning size; what is
    // still held stays, and is given again afterwards.
    for i in 0..NameTable::PRUNE_FROM {
        names.locality(Some(&format!("gone-{i}")), None);
    }
    assert!(names.len() <= NameTable::PRUNE_FROM + 3);
    let kept = names.locality(Some("node-a"), Some("zone-1")).unwrap();
    assert!(Arc::ptr_eq(&a, &kept));

    // A stream of names that are never kept costs at most twice what is held (checked before
    // a request, which adds at most a node, a zone and their pair).
    for i in 0..10 * NameTable::PRUNE_FROM {
        names.locality(Some(&format!("churn-{i}")), Some("zone-1"));
        assert!(names.len() <= NameTable::PRUNE_FROM + 3, "{}", names.len());
    }
    assert!(Arc::ptr_eq(
        &a,
        &names.locality(Some("node-a"), Some("zone-1")).unwrap()
    ));
}

#[test]
fn a_uid_prints_back_exactly_as_it_was_read() {
    let canonical = "6f1c2f1e-1d2b-4c5a-9e0f-0a1b2c3d4e5f";
    let uid = Uid::new(canonical);
    assert_eq!(
        uid,
        Uid::Uuid([
            0x6f, 0x1c, 0x2f, 0x1e, 0x1d, 0x2b, 0x4c, 0x5a, 0x9e, 0x0f, 0x0a, 0x1b, 0x2c, 0x3d,
            0x4e, 0x5f
        ])
    );
    assert_eq!(uid.to_string(), canonical);
    assert_eq!(
        Uid::new("00000000-0000-0000-0000-000000000000").to_string(),
        "00000000-0000-0000-0000-000000000000"
    );
    // Anything that would not print back the same is kept as text: upper case, braces, a
    // dash out of place, a non-hex digit, one character too many or too few, other uids.
    for other in [
        "6F1C2F1E-1D2B-4C5A-9E0F-0A1B2C3D4E5F",
        "{6f1c2f1e-1d2b-4c5a-9e0f-0a1b2c3d4e5}",
        "6f1c2f1e1-d2b-4c5a-9e0f-0a1b2c3d4e5f",
        "6f1c2f1e-1d2b-4c5a-9e0f-0a1b2c3d4e5g",
        "6f1c2f1e-1d2b-4c5a-9e0f-0a1b2c3d4e5f0",
        "6f1c2f1e-1d2b-4c5a-9e0f-0a1b2c3d4e5",
        "6f1c2f1e-1d2b-4c5a-9e0f+0a1b2c3d4e5f",
        "uid-1",
        "",
        "6f1c2f1é-1d2b-4c5a-9e0f-0a1b2c3d4e5",
    ] {
        let uid = Uid::new(other);
        assert_eq!(uid, Uid::Text(other.into()), "{other}");
        assert_eq!(uid.to_string(), other);
    }
}

/// The bytes of a B-tree leaf of eleven `(ServiceName, V)` entries, as the model's maps hold
/// them: parent pointer, index and length (12 bytes, padded to 16), then the keys and values.
#[cfg(target_pointer_width = "64")]
fn leaf_of_eleven<V>() -> usize {
    16 + 11 * (std::mem::size_of::<ServiceName>() + std::mem::size_of::<V>())
}

/// A leaf of Services must stay within jemalloc's 2,048-byte class (it was in the 2,560-byte
/// one before the rarely used lists became [`Rare`]), a leaf of EndpointSlices within the
/// 1,280-byte one (1,536 before their ports and endpoints became boxed slices, two words each
/// instead of three). Only on 64-bit targets, which is what ships.
#[test]
#[cfg(target_pointer_width = "64")]
fn leaves_of_services_and_slices_stay_in_their_size_classes() {
    assert!(
        leaf_of_eleven::<Service>() <= 2048,
        "{}",
        leaf_of_eleven::<Service>()
    );
    assert!(
        leaf_of_eleven::<EndpointSlice>() <= 1280,
        "{}",
        leaf_of_eleven::<EndpointSlice>()
    );
    assert_eq!(std::mem::size_of::<Rare<std::net::IpAddr>>(), 8);
}

#[test]
fn a_rare_list_reads_as_the_slice_it_was_built_from() {
    let empty: Rare<u32> = Vec::new().into();
    assert!(empty.is_empty());
    assert_eq!(empty, Rare::default());
    let some: Rare<u32> = vec![3, 1].into();
    assert_eq!(&some[..], &[3, 1]);
    assert_eq!(some, vec![3, 1]);
    assert_ne!(some, empty);
    assert_eq!((&some).into_iter().sum::<u32>(), 4);
    assert_eq!(format!("{some:?}"), "[3, 1]");
    assert_eq!([7u32].into_iter().collect::<Rare<u32>>(), vec![7]);
}
