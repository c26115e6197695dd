//! Unit tests for the model.
use super::*;

#[test]
fn endpoints_prefer_non_terminating_duplicate() {
    let svc = ServiceName {
        namespace: "ns".into(),
        name: "a".into(),
    };
    let mk = |slice: &str, terminating: bool| EndpointSlice {
        name: ServiceName {
            namespace: "ns".into(),
            name: slice.into(),
        },
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
            zone_hints: vec![],
            node_hints: vec![],
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
