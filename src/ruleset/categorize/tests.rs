//! Table-driven tests of endpoint categorisation and topology hints.

use super::*;
use crate::model::Conditions;

/// Conditions as short codes: R ready (and serving), T serving+terminating, U unready and not
/// serving (terminating or not), X terminating and not serving.
fn cond(code: char) -> Conditions {
    match code {
        'R' => Conditions {
            ready: true,
            serving: true,
            terminating: false,
        },
        'T' => Conditions {
            ready: false,
            serving: true,
            terminating: true,
        },
        'U' => Conditions {
            ready: false,
            serving: false,
            terminating: false,
        },
        'X' => Conditions {
            ready: false,
            serving: false,
            terminating: true,
        },
        _ => panic!("unknown condition code {code}"),
    }
}

/// One test endpoint: last address byte, condition code, node, zone hints, node hints.
type Spec = (
    u8,
    char,
    Option<&'static str>,
    &'static [&'static str],
    &'static [&'static str],
);

fn endpoints(
    specs: &[Spec],
    hints: &'static mut Vec<(Vec<String>, Vec<String>)>,
) -> Vec<Endpoint<'static>> {
    for (_, _, _, zones, nodes) in specs {
        hints.push((
            zones.iter().map(|s| s.to_string()).collect(),
            nodes.iter().map(|s| s.to_string()).collect(),
        ));
    }
    let hints: &'static Vec<(Vec<String>, Vec<String>)> = hints;
    specs
        .iter()
        .zip(hints.iter())
        .map(|((last, code, node, _, _), (zones, nodes))| Endpoint {
            addr: std::net::IpAddr::from([198, 51, 100, *last]),
            port: 8080,
            conditions: cond(*code),
            node_name: *node,
            zone: None,
            zone_hints: zones,
            node_hints: nodes,
        })
        .collect()
}

fn lasts(eps: &[Endpoint<'_>]) -> Vec<u8> {
    eps.iter()
        .map(|ep| match ep.addr {
            std::net::IpAddr::V4(a) => a.octets()[3],
            std::net::IpAddr::V6(_) => 0,
        })
        .collect()
}

const ME: NodeView<'static> = NodeView {
    name: "node-a",
    zone: Some("zone-1"),
};

const A: Option<&str> = Some("node-a");
const B: Option<&str> = Some("node-b");

struct Case {
    name: &'static str,
    eps: &'static [Spec],
    cluster: &'static [u8],
    local: &'static [u8],
    has: bool,
}

#[test]
fn categorisation_matches_kube_proxy() {
    let cases = [
        Case {
            name: "no endpoints",
            eps: &[],
            cluster: &[],
            local: &[],
            has: false,
        },
        Case {
            name: "ready endpoints on both nodes",
            eps: &[(1, 'R', A, &[], &[]), (2, 'R', B, &[], &[])],
            cluster: &[1, 2],
            local: &[1],
            has: true,
        },
        Case {
            name: "ready elsewhere wins over serving-terminating here (cluster); local falls back",
            eps: &[(1, 'T', A, &[], &[]), (2, 'R', B, &[], &[])],
            cluster: &[2],
            local: &[1],
            has: true,
        },
        Case {
            name: "none ready anywhere: cluster uses serving-terminating ones",
            eps: &[
                (1, 'T', A, &[], &[]),
                (2, 'T', B, &[], &[]),
                (3, 'U', B, &[], &[]),
            ],
            cluster: &[1, 2],
            local: &[1],
            has: true,
        },
        Case {
            name: "local ready preferred over local serving-terminating",
            eps: &[(1, 'R', A, &[], &[]), (2, 'T', A, &[], &[])],
            cluster: &[1],
            local: &[1],
            has: true,
        },
        Case {
            name: "unready non-serving endpoints are never used and do not count",
            eps: &[(1, 'U', A, &[], &[]), (2, 'X', B, &[], &[])],
            cluster: &[],
            local: &[],
            has: false,
        },
        Case {
            name: "only remote endpoints: no local ones, still has endpoints",
            eps: &[(2, 'R', B, &[], &[])],
            cluster: &[2],
            local: &[],
            has: true,
        },
        Case {
            name: "endpoint without nodeName is never local",
            eps: &[(1, 'R', None, &[], &[])],
            cluster: &[1],
            local: &[],
            has: true,
        },
        Case {
            name: "zone hints for this zone restrict cluster endpoints, not local ones",
            eps: &[
                (1, 'R', A, &["zone-2"], &[]),
                (2, 'R', B, &["zone-1"], &[]),
                (3, 'R', B, &["zone-2"], &[]),
            ],
            cluster: &[2],
            local: &[1],
            has: true,
        },
        Case {
            name: "zone hints ignored unless every ready endpoint has one",
            eps: &[
                (1, 'R', A, &["zone-1"], &[]),
                (2, 'R', B, &[], &[]),
                (3, 'T', B, &[], &[]),
            ],
            cluster: &[1, 2],
            local: &[1],
            has: true,
        },
        Case {
            name: "zone hints ignored when none names this zone",
            eps: &[(1, 'R', A, &["zone-2"], &[]), (2, 'R', B, &["zone-3"], &[])],
            cluster: &[1, 2],
            local: &[1],
            has: true,
        },
        Case {
            name: "unready endpoints without hints do not disable hints",
            eps: &[
                (1, 'U', A, &[], &[]),
                (2, 'R', B, &["zone-1"], &[]),
                (3, 'R', B, &["zone-2"], &[]),
            ],
            cluster: &[2],
            local: &[],
            has: true,
        },
        Case {
            name: "node hints win over zone hints",
            eps: &[
                (1, 'R', A, &["zone-1"], &["node-a"]),
                (2, 'R', B, &["zone-1"], &["node-b"]),
            ],
            cluster: &[1],
            local: &[1],
            has: true,
        },
        Case {
            name: "node hints not for this node: zone hints apply",
            eps: &[
                (1, 'R', A, &["zone-2"], &["node-c"]),
                (2, 'R', B, &["zone-1"], &["node-b"]),
            ],
            cluster: &[2],
            local: &[1],
            has: true,
        },
        Case {
            name: "node hints incomplete: zone hints apply",
            eps: &[
                (1, 'R', A, &["zone-2"], &["node-a"]),
                (2, 'R', B, &["zone-1"], &[]),
            ],
            cluster: &[2],
            local: &[1],
            has: true,
        },
        Case {
            name: "terminating fallback ignores topology",
            eps: &[(1, 'T', A, &["zone-2"], &[]), (2, 'T', B, &["zone-3"], &[])],
            cluster: &[1, 2],
            local: &[1],
            has: true,
        },
    ];
    for case in cases {
        let hints = Box::leak(Box::default());
        let eps = endpoints(case.eps, hints);
        let got = categorize(&eps, &ME);
        assert_eq!(lasts(&got.cluster), case.cluster, "{}: cluster", case.name);
        assert_eq!(lasts(&got.local), case.local, "{}: local", case.name);
        assert_eq!(got.has_endpoints, case.has, "{}: has_endpoints", case.name);
    }
}

#[test]
fn a_node_without_zone_label_ignores_zone_hints() {
    let hints = Box::leak(Box::default());
    let eps = endpoints(
        &[(1, 'R', A, &["zone-1"], &[]), (2, 'R', B, &["zone-2"], &[])],
        hints,
    );
    let node = NodeView {
        name: "node-a",
        zone: None,
    };
    assert_eq!(topology_mode(&eps, &node), TopologyMode::Ignored);
    assert_eq!(lasts(&categorize(&eps, &node).cluster), vec![1, 2]);
}

#[test]
fn topology_modes() {
    let hints = Box::leak(Box::default());
    let eps = endpoints(&[(1, 'R', A, &["zone-1"], &["node-a"])], hints);
    assert_eq!(topology_mode(&eps, &ME), TopologyMode::SameNode);
    let hints = Box::leak(Box::default());
    let eps = endpoints(&[(1, 'R', A, &["zone-1"], &[])], hints);
    assert_eq!(topology_mode(&eps, &ME), TopologyMode::SameZone);
    assert_eq!(topology_mode(&[], &ME), TopologyMode::Ignored);
}
