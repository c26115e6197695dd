//! `build(state, settings) -> Ruleset`: the desired ruleset, pure and deterministic.
//!
//! The layout is data-driven (DESIGN §3 "kernel cost"): a fixed set of chains, plus one small
//! `pick-<k>` chain per endpoint count `k` in use, and every Service, endpoint and NodePort is an
//! element of a map. Changing endpoints therefore only changes map elements, which the kernel
//! applies without re-validating the chain graph; only a change of a Service's endpoint count
//! moves its verdict element to another (tiny) `pick-<k>` chain.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::names;
use super::{
    AddrField, Atom, BaseChain, Chain, ChainType, ElemData, Element, Hook, KeyField, Rule, Ruleset,
    Set, SetData, Stmt, Table, Verdict,
};
use crate::config::{Config, NodePortAddresses};
use crate::model::{ClusterState, Endpoint, IpFamily, ServicePortName, endpoints_for};

/// What `build` needs beyond the cluster state: the configuration with the node name resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// This node's name (endpoint locality, which Node object is ours).
    pub node_name: String,
    /// Pod network CIDRs, at most one per family.
    pub cluster_cidrs: Vec<IpNet>,
    pub masquerade_all: bool,
    /// The mark value with only the masquerade bit set.
    pub mark: u32,
    pub nodeport_addresses: NodePortAddresses,
}

impl Settings {
    pub fn new(config: &Config, node_name: String) -> Settings {
        Settings {
            node_name,
            cluster_cidrs: config.cluster_cidr.clone(),
            masquerade_all: config.masquerade_all,
            mark: config.masquerade_mark(),
            nodeport_addresses: config.nodeport_addresses.clone(),
        }
    }

    fn cluster_cidr(&self, family: IpFamily) -> Option<IpNet> {
        self.cluster_cidrs
            .iter()
            .copied()
            .find(|net| IpFamily::of(&net.addr()) == family)
    }
}

/// Builds both tables.
pub fn build(state: &ClusterState, settings: &Settings) -> Ruleset {
    Ruleset {
        tables: IpFamily::ALL
            .iter()
            .map(|&family| {
                let mut table = build_table(state, settings, family);
                // Source ranges and session affinity live in their own modules.
                firewall::add(state, settings, family, &mut table);
                affinity::add(state, settings, family, &mut table);
                table
            })
            .collect(),
    }
}

mod affinity;
mod firewall;

/// Elements of one set; sorted and de-duplicated by [`finish`] once collected.
type Elements = Vec<Element>;

/// The Service port an element serves, formatted once and shared by all its elements.
struct Origin {
    name: Arc<ServicePortName>,
    comment: Arc<str>,
}

impl Origin {
    fn new(name: ServicePortName) -> Origin {
        Origin {
            comment: Arc::from(names::comment(&name.to_string())),
            name: Arc::new(name),
        }
    }
}

fn element(key: Vec<Atom>, data: Option<ElemData>, origin: &Origin) -> Element {
    Element {
        key,
        data,
        comment: Some(origin.comment.clone()),
        origin: Some(origin.name.clone()),
    }
}

fn insert(elements: &mut Elements, elem: Element) {
    elements.push(elem);
}

/// Sorts by key and drops later duplicates: two Services claiming the same address and port (or
/// NodePort) is an API-server invariant violation; the first one in name order keeps it (the
/// sort is stable), so the result stays deterministic.
fn finish(mut elements: Elements) -> Vec<Element> {
    elements.sort_by(|a, b| a.key.cmp(&b.key));
    elements.dedup_by(|later, earlier| later.key == earlier.key);
    elements
}

fn goto(chain: String) -> Option<ElemData> {
    Some(ElemData::Verdict(Verdict::Goto(chain)))
}

#[derive(Default)]
struct Collected {
    cluster_ips: Elements,
    nodeport_ips: Elements,
    service_ips: Elements,
    service_nodeports: Elements,
    no_endpoint_services: Elements,
    no_endpoint_nodeports: Elements,
    hairpin: Elements,
    /// `pick-<k>` map elements by endpoint count.
    picks: BTreeMap<usize, Elements>,
    /// `nodeport-pick-<k>` map elements by endpoint count.
    nodeport_picks: BTreeMap<usize, Elements>,
}

/// The endpoints traffic may be sent to. In this version that is kube-proxy's normal case: the
/// ready endpoints of the family.
fn usable_endpoints(endpoints: Vec<Endpoint<'_>>, family: IpFamily) -> Vec<Endpoint<'_>> {
    endpoints
        .into_iter()
        .filter(|ep| IpFamily::of(&ep.addr) == family && ep.conditions.ready)
        .collect()
}

fn collect(state: &ClusterState, settings: &Settings, family: IpFamily) -> Collected {
    let mut c = Collected::default();
    let node = state.nodes.get(&settings.node_name);
    // Only the Node's primary address is programmed, and only when the selection includes it
    // (`primary`, `all`, or a CIDR containing it), so a NodePort never answers on an address
    // that was not selected. The other addresses that `all` and CIDR lists select are not
    // programmed in this version; for the default, `primary`, this is kube-proxy's complete
    // nftables behaviour.
    if let Some(ip) = node.and_then(|n| n.primary_ip(family))
        && settings.nodeport_addresses.selects(ip, true)
    {
        c.nodeport_ips.push(Element {
            key: vec![Atom::Addr(ip)],
            data: None,
            comment: Some(Arc::from(format!(
                "primary address of node {}",
                settings.node_name
            ))),
            origin: None,
        });
    }

    let slices = state.slices_by_service();
    for svc in state.services.values() {
        let svc_slices = slices.get(&svc.name).map(Vec::as_slice).unwrap_or_default();
        // A Service is handled by the table of each family it has a ClusterIP in, like
        // kube-proxy's per-family proxiers.
        let Some(cluster_ip) = svc.cluster_ip(family) else {
            continue;
        };
        for port in &svc.ports {
            let origin = Origin::new(svc.port_name(port));
            let proto = Atom::Proto(port.protocol);
            let svc_port = Atom::Port(port.port);
            insert(
                &mut c.cluster_ips,
                element(vec![Atom::Addr(cluster_ip)], None, &origin),
            );
            let endpoints = usable_endpoints(endpoints_for(svc_slices, port), family);
            let k = endpoints.len();
            let service_key = vec![Atom::Addr(cluster_ip), proto, svc_port];
            if k == 0 {
                insert(
                    &mut c.no_endpoint_services,
                    element(service_key, goto(names::REJECT_CHAIN.into()), &origin),
                );
                if let Some(node_port) = port.node_port {
                    insert(
                        &mut c.no_endpoint_nodeports,
                        element(
                            vec![proto, Atom::Port(node_port)],
                            goto(names::REJECT_CHAIN.into()),
                            &origin,
                        ),
                    );
                }
                continue;
            }
            insert(
                &mut c.service_ips,
                element(service_key.clone(), goto(names::pick_chain(k)), &origin),
            );
            let picks = c.picks.entry(k).or_default();
            for (slot, ep) in endpoints.iter().enumerate() {
                let mut key = service_key.clone();
                key.push(slot_atom(slot));
                insert(picks, element(key, Some(endpoint_data(ep)), &origin));
            }
            if let Some(node_port) = port.node_port {
                let np_key = vec![proto, Atom::Port(node_port)];
                insert(
                    &mut c.service_nodeports,
                    element(np_key.clone(), goto(names::nodeport_pick_chain(k)), &origin),
                );
                let picks = c.nodeport_picks.entry(k).or_default();
                for (slot, ep) in endpoints.iter().enumerate() {
                    let mut key = np_key.clone();
                    key.push(slot_atom(slot));
                    insert(picks, element(key, Some(endpoint_data(ep)), &origin));
                }
            }
            // Hairpin: a pod reaching itself through the Service must be masqueraded, or it
            // would see a reply from its own address to itself and drop it. Only endpoints on
            // this node can be their own clients here; an endpoint without a nodeName might be.
            for ep in endpoints
                .iter()
                .filter(|ep| ep.node_name.is_none_or(|name| name == settings.node_name))
            {
                insert(
                    &mut c.hairpin,
                    element(
                        vec![
                            Atom::Addr(ep.addr),
                            Atom::Addr(ep.addr),
                            proto,
                            Atom::Port(ep.port),
                        ],
                        None,
                        &origin,
                    ),
                );
            }
        }
    }
    c
}

fn slot_atom(slot: usize) -> Atom {
    Atom::Int(u32::try_from(slot).unwrap_or(u32::MAX))
}

fn endpoint_data(ep: &Endpoint<'_>) -> ElemData {
    ElemData::Value(vec![Atom::Addr(ep.addr), Atom::Port(ep.port)])
}

fn set(
    name: &str,
    comment: &str,
    key: Vec<KeyField>,
    data: Option<SetData>,
    elements: Elements,
) -> Set {
    Set {
        name: name.to_string(),
        comment: comment.to_string(),
        key,
        data,
        typeof_: false,
        elements: finish(elements),
        kind: Default::default(),
    }
}

fn chain(name: &str, comment: &str, base: Option<BaseChain>, rules: Vec<Vec<Stmt>>) -> Chain {
    Chain {
        name: name.to_string(),
        comment: comment.to_string(),
        base,
        rules: rules.into_iter().map(Rule::new).collect(),
    }
}

fn base(kind: ChainType, hook: Hook, priority: i32) -> Option<BaseChain> {
    Some(BaseChain {
        kind,
        hook,
        priority,
    })
}

fn jump(chain: &str) -> Stmt {
    Stmt::Verdict(Verdict::Jump(chain.to_string()))
}

fn service_key() -> Vec<KeyField> {
    vec![KeyField::Daddr, KeyField::L4Proto, KeyField::ThDport]
}

fn nodeport_key() -> Vec<KeyField> {
    vec![KeyField::L4Proto, KeyField::ThDport]
}

fn in_set(key: Vec<KeyField>, set: &str) -> Stmt {
    Stmt::InSet {
        key,
        set: set.to_string(),
    }
}

fn vmap(key: Vec<KeyField>, map: &str) -> Stmt {
    Stmt::Vmap {
        key,
        map: map.to_string(),
    }
}

/// kube-proxy's hook layout since 1.34: filter checks that need the pre-DNAT destination at
/// -110, service DNAT at dstnat (-100), no-endpoint and invalid-port checks after DNAT at filter
/// (0), masquerade at srcnat (100). Other components rely on these priorities.
const PRIO_DSTNAT: i32 = -100;
const PRIO_FILTER: i32 = 0;
const PRIO_SRCNAT: i32 = 100;

fn build_table(state: &ClusterState, settings: &Settings, family: IpFamily) -> Table {
    let c = collect(state, settings, family);
    let mark = settings.mark;

    let mut sets = vec![
        set(
            names::CLUSTER_IPS,
            "active ClusterIPs",
            vec![KeyField::Daddr],
            None,
            c.cluster_ips,
        ),
        set(
            names::NODEPORT_IPS,
            "local addresses that accept NodePort traffic (--nodeport-addresses)",
            vec![KeyField::Daddr],
            None,
            c.nodeport_ips,
        ),
        set(
            names::SERVICE_IPS,
            "ClusterIP . protocol . port of services with endpoints: the chain that picks one",
            service_key(),
            Some(SetData::Verdict),
            c.service_ips,
        ),
        set(
            names::SERVICE_NODEPORTS,
            "protocol . NodePort of services with endpoints: the chain that picks one",
            nodeport_key(),
            Some(SetData::Verdict),
            c.service_nodeports,
        ),
        set(
            names::NO_ENDPOINT_SERVICES,
            "ClusterIP . protocol . port of services without usable endpoints: reject or drop",
            service_key(),
            Some(SetData::Verdict),
            c.no_endpoint_services,
        ),
        set(
            names::NO_ENDPOINT_NODEPORTS,
            "protocol . NodePort of services without usable endpoints: reject or drop",
            nodeport_key(),
            Some(SetData::Verdict),
            c.no_endpoint_nodeports,
        ),
        set(
            names::HAIRPIN_CONNECTIONS,
            "endpoint . endpoint . protocol . port: a pod reaching itself through a service",
            vec![
                KeyField::Saddr,
                KeyField::Daddr,
                KeyField::L4Proto,
                KeyField::ThDport,
            ],
            None,
            c.hairpin,
        ),
    ];

    let endpoint_data = || Some(SetData::Value(vec![KeyField::Daddr, KeyField::ThDport]));
    let mut pick_chains = Vec::new();
    for (k, elements) in c.picks {
        let modulus = u32::try_from(k).unwrap_or(u32::MAX);
        let mut key = service_key();
        key.push(KeyField::Numgen { modulus });
        let mut s = set(
            &names::pick_map(k),
            &format!("ClusterIP . protocol . port . slot to endpoint, services with {k} endpoints"),
            key.clone(),
            endpoint_data(),
            elements,
        );
        s.typeof_ = true;
        sets.push(s);
        pick_chains.push(chain(
            &names::pick_chain(k),
            &format!("DNAT ClusterIP traffic to one of {k} endpoints, uniformly at random"),
            None,
            vec![vec![Stmt::DnatMap {
                key,
                map: names::pick_map(k),
            }]],
        ));
    }
    for (k, elements) in c.nodeport_picks {
        let modulus = u32::try_from(k).unwrap_or(u32::MAX);
        let mut key = nodeport_key();
        key.push(KeyField::Numgen { modulus });
        let mut s = set(
            &names::nodeport_pick_map(k),
            &format!("protocol . NodePort . slot to endpoint, services with {k} endpoints"),
            key.clone(),
            endpoint_data(),
            elements,
        );
        s.typeof_ = true;
        sets.push(s);
        // External traffic to a Cluster-policy service is always masqueraded, so replies
        // return through this node and its conntrack entry.
        pick_chains.push(chain(
            &names::nodeport_pick_chain(k),
            &format!("masquerade and DNAT NodePort traffic to one of {k} endpoints"),
            None,
            vec![vec![
                Stmt::MarkOr(mark),
                Stmt::DnatMap {
                    key,
                    map: names::nodeport_pick_map(k),
                },
            ]],
        ));
    }

    let mut services_rules = Vec::new();
    if settings.masquerade_all {
        services_rules.push(vec![
            in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
            Stmt::MarkOr(mark),
        ]);
    } else if let Some(cidr) = settings.cluster_cidr(family) {
        // Off-cluster clients that route the service range to a node must get replies back
        // through it; pod sources keep their address.
        services_rules.push(vec![
            in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
            Stmt::AddrMatch {
                field: AddrField::Saddr,
                negate: true,
                net: cidr,
            },
            Stmt::MarkOr(mark),
        ]);
    }
    services_rules.push(vec![vmap(service_key(), names::SERVICE_IPS)]);
    services_rules.push(vec![
        in_set(vec![KeyField::Daddr], names::NODEPORT_IPS),
        vmap(nodeport_key(), names::SERVICE_NODEPORTS),
    ]);

    let mut chains = vec![
        chain(
            names::NAT_PREROUTING,
            "service DNAT for traffic arriving at this node",
            base(ChainType::Nat, Hook::Prerouting, PRIO_DSTNAT),
            vec![vec![jump(names::SERVICES)]],
        ),
        chain(
            names::NAT_OUTPUT,
            "service DNAT for traffic from this node's own processes",
            base(ChainType::Nat, Hook::Output, PRIO_DSTNAT),
            vec![vec![jump(names::SERVICES)]],
        ),
        chain(
            names::NAT_POSTROUTING,
            "masquerade marked and hairpin traffic",
            base(ChainType::Nat, Hook::Postrouting, PRIO_SRCNAT),
            vec![vec![jump(names::MASQUERADING)]],
        ),
        chain(
            names::FILTER_INPUT,
            "reject new connections to NodePorts and services without endpoints",
            base(ChainType::Filter, Hook::Input, PRIO_FILTER),
            vec![
                vec![Stmt::CtStateNew, jump(names::NODEPORT_ENDPOINTS_CHECK)],
                vec![Stmt::CtStateNew, jump(names::SERVICE_ENDPOINTS_CHECK)],
            ],
        ),
        chain(
            names::FILTER_FORWARD,
            "reject new connections to services without endpoints or to invalid ClusterIP ports",
            base(ChainType::Filter, Hook::Forward, PRIO_FILTER),
            vec![
                vec![Stmt::CtStateNew, jump(names::SERVICE_ENDPOINTS_CHECK)],
                vec![Stmt::CtStateNew, jump(names::CLUSTER_IPS_CHECK)],
            ],
        ),
        chain(
            names::FILTER_OUTPUT,
            "reject new local connections to services without endpoints or to invalid ports",
            base(ChainType::Filter, Hook::Output, PRIO_FILTER),
            vec![
                vec![Stmt::CtStateNew, jump(names::SERVICE_ENDPOINTS_CHECK)],
                vec![Stmt::CtStateNew, jump(names::CLUSTER_IPS_CHECK)],
            ],
        ),
        chain(
            names::SERVICES,
            "dispatch by destination: ClusterIPs, then NodePorts on NodePort addresses",
            None,
            services_rules,
        ),
        chain(
            names::MASQUERADING,
            "masquerade packets marked for it (clearing the mark) and hairpin connections",
            None,
            vec![
                // The mark is cleared before masquerading: a packet re-entering the stack (a
                // VXLAN-encapsulated skb) must not be masqueraded twice (kubernetes#92035).
                vec![
                    Stmt::MarkTest { mask: mark },
                    Stmt::MarkXor(mark),
                    Stmt::Masquerade { fully_random: true },
                ],
                vec![
                    Stmt::CtStatusDnat,
                    in_set(
                        vec![
                            KeyField::Saddr,
                            KeyField::Daddr,
                            KeyField::L4Proto,
                            KeyField::ThDport,
                        ],
                        names::HAIRPIN_CONNECTIONS,
                    ),
                    Stmt::Masquerade { fully_random: true },
                ],
            ],
        ),
        chain(
            names::SERVICE_ENDPOINTS_CHECK,
            "services without usable endpoints (checked after DNAT, so only undelivered traffic)",
            None,
            vec![vec![vmap(service_key(), names::NO_ENDPOINT_SERVICES)]],
        ),
        chain(
            names::NODEPORT_ENDPOINTS_CHECK,
            "NodePorts of services without usable endpoints",
            None,
            vec![vec![
                in_set(vec![KeyField::Daddr], names::NODEPORT_IPS),
                vmap(nodeport_key(), names::NO_ENDPOINT_NODEPORTS),
            ]],
        ),
        chain(
            names::CLUSTER_IPS_CHECK,
            "reject traffic to ClusterIP ports that no service defines",
            None,
            vec![vec![
                in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
                Stmt::Reject,
            ]],
        ),
        chain(
            names::REJECT_CHAIN,
            "reject (a verdict map cannot reject directly, so its elements goto here)",
            None,
            vec![vec![Stmt::Reject]],
        ),
    ];
    chains.extend(pick_chains);

    Table {
        family,
        name: names::TABLE.to_string(),
        comment: names::TABLE_COMMENT.to_string(),
        sets,
        chains,
    }
}

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
                if wanted && node.primary_ip(family).is_none() {
                    out.push(format!(
                        "Node {} has no {family} InternalIP: {family} NodePorts are not programmed",
                        node.name
                    ));
                }
            }
        }
    }
    if !settings.masquerade_all {
        for family in IpFamily::ALL {
            let used = state
                .services
                .values()
                .any(|s| s.cluster_ip(family).is_some());
            if used && settings.cluster_cidr(family).is_none() {
                out.push(format!(
                    "no {family} --cluster-cidr: {family} traffic to ClusterIPs from outside the \
                     pod network is not masqueraded"
                ));
            }
        }
    }
    let mut seen: BTreeMap<(IpAddr, u16, crate::model::Protocol), ServicePortName> =
        BTreeMap::new();
    let mut node_ports: BTreeMap<(u16, crate::model::Protocol), ServicePortName> = BTreeMap::new();
    for svc in state.services.values() {
        for port in &svc.ports {
            let name = svc.port_name(port);
            for ip in &svc.cluster_ips {
                let first = seen
                    .entry((*ip, port.port, port.protocol))
                    .or_insert(name.clone());
                if *first != name {
                    out.push(format!(
                        "{name} and {first} both claim {ip} port {}/{}; {first} keeps it",
                        port.port, port.protocol
                    ));
                }
            }
            if let Some(np) = port.node_port {
                let first = node_ports
                    .entry((np, port.protocol))
                    .or_insert(name.clone());
                if *first != name {
                    out.push(format!(
                        "{name} and {first} both claim NodePort {np}/{}; {first} keeps it",
                        port.protocol
                    ));
                }
            }
        }
    }
    let unsupported: BTreeSet<String> = state
        .services
        .values()
        .filter_map(|s| {
            let mut what = Vec::new();
            if !s.external_ips.is_empty() {
                what.push("externalIPs");
            }
            if !s.load_balancer_ips.is_empty() {
                what.push("LoadBalancer ingress IPs");
            }
            if s.external_traffic_policy == crate::model::TrafficPolicy::Local {
                what.push("externalTrafficPolicy: Local");
            }
            if s.internal_traffic_policy == crate::model::TrafficPolicy::Local {
                what.push("internalTrafficPolicy: Local");
            }
            (!what.is_empty()).then(|| {
                format!(
                    "Service {} uses {} which this version does not implement yet; its \
                     ClusterIP and NodePorts are served with Cluster policy and no affinity",
                    s.name,
                    what.join(", ")
                )
            })
        })
        .collect();
    out.extend(unsupported);
    out
}

#[cfg(test)]
mod tests;
