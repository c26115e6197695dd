//! Problems in the input that do not stop the build but that an operator must hear about, and
//! the address warnings the daemon logs when they change.

use super::*;

/// Problems in the input that do not stop the build but that an operator must hear about.
pub fn diagnostics(state: &ClusterState, settings: &Settings) -> Vec<String> {
    let mut out = Vec::new();
    let node = state.nodes.get(&settings.node_name);
    match node {
        None => out.push(format!(
            "Node {:?} not found in the input: NodePorts are not programmed (no node address \
             is guessed); set --hostname-override to this node's name",
            settings.node_name
        )),
        Some(node) => {
            for family in IpFamily::ALL {
                let wanted = state.services.values().any(|s| {
                    s.cluster_ip(family).is_some() && s.ports.iter().any(|p| p.node_port.is_some())
                });
                if wanted
                    && !settings.nodeport_addresses.all_of(family)
                    && nodeport_addresses(settings, Some(node), family).is_empty()
                {
                    out.push(format!(
                        "no {family} address of Node {} is selected by --nodeport-addresses \
                         (only the Node object's InternalIPs and ExternalIPs are considered): \
                         {family} NodePorts are not answered",
                        node.name
                    ));
                }
            }
        }
    }
    for family in IpFamily::ALL {
        let used = state
            .services
            .values()
            .any(|s| s.cluster_ip(family).is_some());
        if used && settings.local_match(node, family, false).is_none() {
            let what = match &settings.detect_local {
                DetectLocal::ClusterCidr => format!("no {family} --cluster-cidr"),
                DetectLocal::NodeCidr => format!("the Node has no {family} podCIDR"),
                DetectLocal::BridgeInterface(_) => "no --pod-bridge-interface".to_string(),
                DetectLocal::InterfaceNamePrefix(_) => "no --pod-interface-name-prefix".to_string(),
            };
            let masq = if settings.masquerade_all {
                ""
            } else {
                "traffic to ClusterIPs from outside the pod network is not masqueraded, and "
            };
            out.push(format!(
                "{what}: {family} {masq}pod traffic to externalTrafficPolicy: Local services \
                 is not short-circuited to all endpoints"
            ));
        }
    }
    out.extend(address_warnings(state, settings));
    out
}

/// Services whose addresses cannot all be programmed: a ClusterIP that is one of this node's
/// own addresses (left out: it would capture the node's own traffic on that port), and two
/// Services claiming the same address and port or NodePort. The daemon logs them after each
/// full sync, `--dry-run`, `--once` and `explain` with [`diagnostics`].
pub fn address_warnings(state: &ClusterState, settings: &Settings) -> Vec<String> {
    let mut out = Vec::new();
    let ranges = settings.service_ranges(state);
    // Named as the operator gave them: the flag, or the cluster's objects.
    let source = if settings.service_cidrs.is_empty() {
        "the ServiceCIDRs"
    } else {
        "--service-cidr"
    };
    // Per family, once: per ClusterIP, at 50k Services, this list was a third of the time
    // the warnings took.
    let ranges_of = |family: IpFamily| -> Vec<_> {
        ranges
            .iter()
            .filter(|c| IpFamily::of(&c.addr()) == family)
            .collect()
    };
    let (v4, v6) = (ranges_of(IpFamily::V4), ranges_of(IpFamily::V6));
    if !ranges.is_empty() {
        for svc in state.services.values() {
            for ip in &svc.cluster_ips {
                let of_family = match IpFamily::of(ip) {
                    IpFamily::V4 => &v4,
                    IpFamily::V6 => &v6,
                };
                if !of_family.is_empty() && !of_family.iter().any(|c| c.contains(ip)) {
                    out.push(format!(
                        "Service {}: ClusterIP {ip} is outside {source} ({}): the API \
                         server allocates ClusterIPs inside it; is the flag or the object wrong?",
                        svc.name,
                        of_family
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
            }
        }
    }
    if let Some(node) = state.nodes.get(&settings.node_name) {
        for svc in state.services.values() {
            for ip in svc.cluster_ips.iter().filter(|ip| node.owns(ip)) {
                out.push(format!(
                    "Service {}: ClusterIP {ip} is an address of this node ({}): left out, \
                     it would capture the node's own connections",
                    svc.name, node.name
                ));
            }
        }
    }
    for family in IpFamily::ALL {
        out.extend(
            Claims::new(state, family)
                .clashes
                .iter()
                .map(ToString::to_string),
        );
    }
    let mut node_ports: BTreeMap<(u16, crate::model::Protocol), ServicePortName> = BTreeMap::new();
    for svc in state.services.values() {
        for port in &svc.ports {
            let Some(np) = port.node_port else {
                continue;
            };
            let name = svc.port_name(port);
            match node_ports.entry((np, port.protocol)) {
                std::collections::btree_map::Entry::Vacant(slot) => {
                    slot.insert(name);
                }
                std::collections::btree_map::Entry::Occupied(first) if *first.get() != name => {
                    let first = first.get();
                    out.push(format!(
                        "{name} and {first} both claim NodePort {np}/{}; {first} keeps it",
                        port.protocol
                    ));
                }
                std::collections::btree_map::Entry::Occupied(_) => {}
            }
        }
    }
    out
}
