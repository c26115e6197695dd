//! `build(state, settings) -> Ruleset`: the desired ruleset, pure and deterministic
//! (`build_with` also takes the affinity slots to keep, [`affinity::Hints`]).
//!
//! The layout is data-driven (DESIGN §3 "kernel cost"): a fixed set of chains, plus one small
//! `pick-<k>` chain per endpoint count `k` in use, and every Service, endpoint and NodePort is an
//! element of a map. Changing endpoints therefore only changes map elements, which the kernel
//! applies without re-validating the chain graph; only a change of a Service's endpoint count
//! moves its verdict element to another (tiny) `pick-<k>` chain.

use std::cell::Cell;
use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::categorize::{NodeView, categorize};
use super::names;
use super::{
    AddrField, Atom, BaseChain, Chain, ChainType, ElemData, Element, Hook, KeyField, Rule, Ruleset,
    Set, SetData, Stmt, Table, Verdict,
};
use crate::model::{
    ClusterState, Endpoint, IpFamily, Node, ServiceName, ServicePortName, TrafficPolicy,
    endpoints_for,
};

/// What `build` needs beyond the cluster state: the configuration with the node name resolved
/// (`Settings::new`, in `config`).
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
    /// How traffic from pods is recognised (`--detect-local-mode` and its parameter).
    pub detect_local: DetectLocal,
    /// `--service-cidr`: ClusterIP ranges, at most one per family. New connections to an address
    /// in them that no Service holds are dropped.
    pub service_cidrs: Vec<IpNet>,
    /// Our tables are owned by the programming process (see [`super::Table::owned`]). Never
    /// from the configuration: set by the daemon and `--once` when the kernel supports it
    /// (`nft::probe::Ownership`), so `--dry-run` output does not depend on the machine.
    pub own_tables: bool,
}

/// The local-traffic detector (kube-proxy's `--detect-local-mode`): what tells traffic from
/// pods apart from traffic from the node itself and from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetectLocal {
    /// The source address is in the cluster CIDR of its family (`Settings::cluster_cidrs`).
    ClusterCidr,
    /// The source address is in this Node's `spec.podCIDRs` (read from the Node object).
    NodeCidr,
    /// The packet arrived on this bridge interface.
    BridgeInterface(String),
    /// The packet arrived on an interface whose name starts with this prefix.
    InterfaceNamePrefix(String),
}

/// `--nodeport-addresses`: which local addresses answer NodePorts. The addresses selected are
/// the union of what each part selects; the default is `primary` alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePortAddresses {
    /// `primary`: the Node object's primary InternalIP of each family (kube-proxy's nftables
    /// default).
    pub primary: bool,
    /// `all`: every local address of both families.
    pub all: bool,
    /// The local addresses inside these CIDRs. `0.0.0.0/0` (or `::/0`) selects every address
    /// of that family.
    pub cidrs: Vec<IpNet>,
}

impl Default for NodePortAddresses {
    fn default() -> NodePortAddresses {
        NodePortAddresses::primary()
    }
}

impl NodePortAddresses {
    /// Only the Node's primary InternalIP of each family.
    pub fn primary() -> NodePortAddresses {
        NodePortAddresses {
            primary: true,
            all: false,
            cidrs: Vec::new(),
        }
    }

    /// Whether this is exactly the default, `primary`.
    pub fn is_primary_only(&self) -> bool {
        self.primary && !self.all && self.cidrs.is_empty()
    }

    /// Whether every local address of `family` answers: `all`, or a `/0` CIDR of the family.
    pub fn all_of(&self, family: IpFamily) -> bool {
        self.all
            || self
                .cidrs
                .iter()
                .any(|net| net.prefix_len() == 0 && IpFamily::of(&net.addr()) == family)
    }

    /// Whether local address `ip` answers NodePorts; `is_primary` says whether it is the
    /// Node's primary InternalIP of its family.
    pub fn selects(&self, ip: IpAddr, is_primary: bool) -> bool {
        (self.primary && is_primary) || self.all || self.cidrs.iter().any(|net| net.contains(&ip))
    }
}

impl Settings {
    fn cluster_cidr(&self, family: IpFamily) -> Option<IpNet> {
        first_of(&self.cluster_cidrs, family)
    }

    /// The statement matching traffic from pods (`negate`: traffic not from pods) in the table of
    /// `family`, or `None` when the detector has nothing to match for this family; then the
    /// rules that need it are left out, as kube-proxy does.
    fn local_match(&self, node: Option<&Node>, family: IpFamily, negate: bool) -> Option<Stmt> {
        let saddr_in = |net: IpNet| Stmt::AddrMatch {
            field: AddrField::Saddr,
            negate,
            net,
        };
        match &self.detect_local {
            DetectLocal::ClusterCidr => self.cluster_cidr(family).map(saddr_in),
            DetectLocal::NodeCidr => node
                .and_then(|n| first_of(&n.pod_cidrs, family))
                .map(saddr_in),
            DetectLocal::BridgeInterface(name) | DetectLocal::InterfaceNamePrefix(name)
                if name.is_empty() =>
            {
                None
            }
            DetectLocal::BridgeInterface(name) => Some(Stmt::Iifname {
                name: name.clone(),
                prefix: false,
                negate,
            }),
            DetectLocal::InterfaceNamePrefix(name) => Some(Stmt::Iifname {
                name: name.clone(),
                prefix: true,
                negate,
            }),
        }
    }
}

fn first_of(nets: &[IpNet], family: IpFamily) -> Option<IpNet> {
    nets.iter()
        .copied()
        .find(|net| IpFamily::of(&net.addr()) == family)
}

/// Services that claimed an element key that another Service claimed too, in some set of a
/// build: only one element per key can exist, so which Service's element is kept depends on
/// the other Services, not on the Service alone.
pub type Contested = BTreeSet<ServiceName>;

thread_local! {
    /// Where `finish` notes contested keys while [`build_noting_contested`] runs on this thread.
    /// A side channel so that every module's sets (which all go through `set`) are covered
    /// without threading a collector through each of them.
    static CONTESTED: Cell<Option<Contested>> = const { Cell::new(None) };
}

/// [`build`], also returning the Services involved in a contested key (the one that kept it and
/// those whose element was dropped). The incremental sync rebuilds single Services, which is
/// only sound for Services whose elements do not depend on the others.
pub fn build_noting_contested(
    state: &ClusterState,
    settings: &Settings,
    hints: &Hints,
) -> (Ruleset, Contested) {
    let outer = CONTESTED.replace(Some(Contested::new()));
    let ruleset = build_with(state, settings, hints);
    let contested = CONTESTED.replace(outer).unwrap_or_default();
    (ruleset, contested)
}

/// Builds both tables, with ClientIP-affinity slots in sorted endpoint order.
pub fn build(state: &ClusterState, settings: &Settings) -> Ruleset {
    build_with(state, settings, &Hints::default())
}

/// Builds both tables, keeping every ClientIP-affinity endpoint in the slot `hints` gives it
/// (see [`affinity`]): pass what the kernel holds so that pinned clients stay where they are.
pub fn build_with(state: &ClusterState, settings: &Settings, hints: &Hints) -> Ruleset {
    Ruleset {
        tables: IpFamily::ALL
            .iter()
            .map(|&family| {
                let claims = Claims::new(state, family);
                note_clashes(&claims);
                let mut table = build_table(state, settings, family, &claims);
                // Source ranges and session affinity live in their own modules.
                firewall::add(state, settings, family, &claims, &mut table);
                affinity::add(state, &mut table, hints);
                table
            })
            .collect(),
    }
}

pub mod affinity;
pub use affinity::{Hints, ServiceKey};
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
/// sort is stable), so the result stays deterministic. Two Services sharing a local endpoint
/// share its hairpin key the same way.
fn finish(mut elements: Elements) -> Vec<Element> {
    elements.sort_by(|a, b| a.key.cmp(&b.key));
    let mut contested: Vec<ServiceName> = Vec::new();
    elements.dedup_by(|later, earlier| {
        let same = later.key == earlier.key;
        if same {
            let service = |e: &Element| e.origin.as_ref().map(|o| o.service.clone());
            let (a, b) = (service(later), service(earlier));
            if a != b {
                contested.extend(a.into_iter().chain(b));
            }
        }
        same
    });
    note_contested(contested);
    // The vectors grew by doubling; at 10k services the pick maps' slack alone is megabytes.
    elements.shrink_to_fit();
    elements
}

/// Records Services in a contested key while [`build_noting_contested`] runs.
fn note_contested(services: Vec<ServiceName>) {
    if services.is_empty() {
        return;
    }
    CONTESTED.with(|c| {
        if let Some(mut noted) = c.take() {
            noted.extend(services);
            c.set(Some(noted));
        }
    });
}

fn goto(chain: String) -> Option<ElemData> {
    Some(ElemData::Verdict(Verdict::Goto(chain)))
}

/// Elements of the maps that `pick` chains read, by endpoint count `k`.
type Picks = BTreeMap<usize, Elements>;

#[derive(Default)]
struct Collected {
    cluster_ips: Elements,
    nodeport_ips: Elements,
    service_ips: Elements,
    service_nodeports: Elements,
    external_picks: Elements,
    external_local_picks: Elements,
    nodeport_picks: Elements,
    nodeport_local_picks: Elements,
    no_endpoint_services: Elements,
    no_endpoint_nodeports: Elements,
    hairpin: Elements,
    /// `pick-<k>-endpoints`: service address (ClusterIP or external) . proto . port . slot.
    picks: Picks,
    /// `local-pick-<k>-endpoints`: external address . proto . port . slot, local endpoints.
    local_picks: Picks,
    /// `nodeport-pick-<k>-endpoints`: proto . NodePort . slot, cluster-wide endpoints.
    np_picks: Picks,
    /// `nodeport-local-pick-<k>-endpoints`: proto . NodePort . slot, local endpoints.
    np_local_picks: Picks,
}

/// The endpoints of `family`, the only ones a table of that family can DNAT to.
fn of_family(endpoints: Vec<Endpoint<'_>>, family: IpFamily) -> Vec<Endpoint<'_>> {
    endpoints
        .into_iter()
        .filter(|ep| IpFamily::of(&ep.addr) == family)
        .collect()
}

/// Adds the `k` slot elements of one key to the `pick` map for `k = endpoints.len()` and returns
/// `k`. `endpoints` is never empty here (callers send empty lists to reject/drop instead).
fn add_picks(
    picks: &mut Picks,
    key: &[Atom],
    endpoints: &[Endpoint<'_>],
    origin: &Origin,
) -> usize {
    let k = endpoints.len();
    let elements = picks.entry(k).or_default();
    for (slot, ep) in endpoints.iter().enumerate() {
        let mut key = key.to_vec();
        key.push(slot_atom(slot));
        insert(elements, element(key, Some(endpoint_data(ep)), origin));
    }
    k
}

/// The addresses NodePorts answer on for `family`, from the Node object: its primary InternalIP
/// for `primary`, and its InternalIPs and ExternalIPs inside the configured CIDRs. The Node
/// object, not the host's interfaces, is the source so that `--dry-run` prints the same ruleset
/// on any machine for the same input, and so that an address a CNI or keepalived adds to an
/// interface does not silently start answering NodePorts. Loopback addresses never answer.
fn nodeport_addresses(settings: &Settings, node: Option<&Node>, family: IpFamily) -> Elements {
    let Some(node) = node else {
        return Vec::new();
    };
    let primary = node.primary_ip(family);
    let mut out = Vec::new();
    for ip in node.internal_ips.iter().chain(&node.external_ips).copied() {
        if IpFamily::of(&ip) != family
            || ip.is_loopback()
            || !settings.nodeport_addresses.selects(ip, Some(ip) == primary)
        {
            continue;
        }
        let comment = if Some(ip) == primary {
            format!("primary address of node {}", node.name)
        } else {
            format!("address of node {} in --nodeport-addresses", node.name)
        };
        out.push(Element {
            key: vec![Atom::Addr(ip)],
            data: None,
            comment: Some(Arc::from(names::comment(&comment))),
            origin: None,
        });
    }
    out
}

/// Which kind of address a Service claims a key with; lower wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AddressKind {
    /// Allocated by the API server: never shared, never taken over.
    ClusterIp,
    /// Written by a load-balancer controller into the status.
    LoadBalancerIp,
    /// Written by whoever may edit the Service's spec (CVE-2020-8554).
    ExternalIp,
}

impl fmt::Display for AddressKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddressKind::ClusterIp => "ClusterIP",
            AddressKind::LoadBalancerIp => "load-balancer IP",
            AddressKind::ExternalIp => "externalIP",
        })
    }
}

/// A Service's claim on one `address . protocol . port`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Claim<'a> {
    pub kind: AddressKind,
    /// Seconds since the epoch; a Service without a creation time counts as the newest.
    pub created: i64,
    pub service: &'a ServiceName,
}

/// Two Services claiming the same `address . protocol . port`: which one keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clash<'a> {
    pub addr: IpAddr,
    pub protocol: crate::model::Protocol,
    pub port: u16,
    pub winner: Claim<'a>,
    pub loser: Claim<'a>,
}

impl fmt::Display for Clash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Service {} claims {} {}:{}/{} that Service {} has as its {}: {} keeps it ({}), \
             {} gets no rule for it",
            self.loser.service,
            self.loser.kind,
            self.addr,
            self.port,
            self.protocol,
            self.winner.service,
            self.winner.kind,
            self.winner.service,
            if self.winner.kind != self.loser.kind {
                "ClusterIP before load-balancer IP before externalIP"
            } else if self.winner.created != self.loser.created {
                "created first"
            } else {
                "same kind and creation time: first by namespace/name"
            },
            self.loser.service,
        )
    }
}

/// Who keeps each Service address and port of one family. kube-proxy lets the rules of two
/// Services collide and the last one written wins, so a Service whose externalIP (or LB IP) is
/// another's ClusterIP takes that ClusterIP's traffic (CVE-2020-8554); here the decision cannot
/// be gamed by choosing a name: a ClusterIP (allocated by the API server) before a load-balancer
/// IP before an externalIP, then the older Service, and only then namespace/name. The loser gets
/// no element at all for that key, in any map (no dangling reject or firewall entry either).
pub struct Claims<'a> {
    winners: HashMap<(IpAddr, crate::model::Protocol, u16), Claim<'a>>,
    pub clashes: Vec<Clash<'a>>,
}

impl<'a> Claims<'a> {
    pub fn new(state: &'a ClusterState, family: IpFamily) -> Claims<'a> {
        let mut winners: HashMap<(IpAddr, crate::model::Protocol, u16), Claim<'a>> = HashMap::new();
        let mut clashes = Vec::new();
        for svc in state.services.values() {
            // Only Services with a ClusterIP of the family are programmed in it.
            let Some(cluster_ip) = svc.cluster_ip(family) else {
                continue;
            };
            let created = svc.created.unwrap_or(i64::MAX);
            let mut addrs: Vec<(IpAddr, AddressKind)> = vec![(cluster_ip, AddressKind::ClusterIp)];
            addrs.extend(
                svc.load_balancer_ips
                    .iter()
                    .map(|ip| (*ip, AddressKind::LoadBalancerIp)),
            );
            addrs.extend(
                svc.external_ips
                    .iter()
                    .map(|ip| (*ip, AddressKind::ExternalIp)),
            );
            // A Service's own address listed twice counts once, as its best kind.
            addrs.retain(|(ip, _)| IpFamily::of(ip) == family);
            addrs.sort();
            addrs.dedup_by_key(|(ip, _)| *ip);
            for port in &svc.ports {
                for (addr, kind) in &addrs {
                    let claim = Claim {
                        kind: *kind,
                        created,
                        service: &svc.name,
                    };
                    let key = (*addr, port.protocol, port.port);
                    match winners.entry(key) {
                        Entry::Vacant(v) => {
                            v.insert(claim);
                        }
                        Entry::Occupied(mut o) => {
                            if o.get().service == claim.service {
                                continue;
                            }
                            let (winner, loser) = if claim < *o.get() {
                                (claim.clone(), o.insert(claim))
                            } else {
                                (o.get().clone(), claim)
                            };
                            clashes.push(Clash {
                                addr: *addr,
                                protocol: port.protocol,
                                port: port.port,
                                winner,
                                loser,
                            });
                        }
                    }
                }
            }
        }
        // A third claimant can beat the one a clash was first decided for: name the final
        // winner in every report.
        for clash in &mut clashes {
            if let Some(w) = winners.get(&(clash.addr, clash.protocol, clash.port)) {
                if w.service == clash.loser.service {
                    std::mem::swap(&mut clash.winner, &mut clash.loser);
                }
                if w.service != clash.winner.service {
                    clash.winner = w.clone();
                }
            }
        }
        Claims { winners, clashes }
    }

    /// Whether `service` keeps `addr . protocol . port` (true for a key nobody else claims).
    pub(super) fn keeps(
        &self,
        service: &ServiceName,
        addr: IpAddr,
        protocol: crate::model::Protocol,
        port: u16,
    ) -> bool {
        self.winners
            .get(&(addr, protocol, port))
            .is_none_or(|w| w.service == service)
    }
}

/// Every Service in a clash depends on the others: a change to any of them needs a full build
/// (see `sync::incremental`).
fn note_clashes(claims: &Claims<'_>) {
    note_contested(
        claims
            .clashes
            .iter()
            .flat_map(|c| [c.winner.service.clone(), c.loser.service.clone()])
            .collect(),
    );
}

fn collect(
    state: &ClusterState,
    settings: &Settings,
    family: IpFamily,
    claims: &Claims<'_>,
) -> Collected {
    let mut c = Collected::default();
    let node = state.nodes.get(&settings.node_name);
    // With `all` (or a /0 CIDR) NodePorts answer on every local address through `fib daddr
    // type local`, and the set stays unused.
    if !settings.nodeport_addresses.all_of(family) {
        c.nodeport_ips = nodeport_addresses(settings, node, family);
    }
    let view = NodeView {
        name: &settings.node_name,
        zone: node.and_then(|n| n.zone.as_deref()),
    };
    let reject = || goto(names::REJECT_CHAIN.into());
    let drop = || Some(ElemData::Verdict(Verdict::Drop));

    let slices = state.slices_by_service();
    for svc in state.services.values() {
        let svc_slices = slices.get(&svc.name).map(Vec::as_slice).unwrap_or_default();
        // A Service is handled by the table of each family it has a ClusterIP in, like
        // kube-proxy's per-family proxiers.
        let Some(cluster_ip) = svc.cluster_ip(family) else {
            continue;
        };
        // A ClusterIP that is the node's own address would DNAT the node's own connections
        // on that port (see `address_warnings`, which reports it).
        if node.is_some_and(|n| n.owns(&cluster_ip)) {
            continue;
        }
        // externalIPs and LoadBalancer ingress IPs behave the same (only loadBalancer source
        // ranges tell them apart, elsewhere).
        let mut external: Vec<IpAddr> = svc
            .external_ips
            .iter()
            .chain(&svc.load_balancer_ips)
            .copied()
            .filter(|ip| IpFamily::of(ip) == family)
            .collect();
        external.sort();
        external.dedup();
        let internal_local = svc.internal_traffic_policy == TrafficPolicy::Local;
        let external_local = svc.external_traffic_policy == TrafficPolicy::Local;
        for port in &svc.ports {
            let origin = Origin::new(svc.port_name(port));
            let proto = Atom::Proto(port.protocol);
            let svc_port = Atom::Port(port.port);
            insert(
                &mut c.cluster_ips,
                element(vec![Atom::Addr(cluster_ip)], None, &origin),
            );
            let all = of_family(endpoints_for(svc_slices, port), family);
            let eps = categorize(&all, &view);
            // Addresses another Service keeps for this protocol and port get no element.
            let keeps_cluster_ip = claims.keeps(&svc.name, cluster_ip, port.protocol, port.port);
            let external: Vec<IpAddr> = external
                .iter()
                .copied()
                .filter(|a| claims.keeps(&svc.name, *a, port.protocol, port.port))
                .collect();
            let service_key = vec![Atom::Addr(cluster_ip), proto, svc_port];
            let np_key = port.node_port.map(|np| vec![proto, Atom::Port(np)]);
            if !eps.has_endpoints {
                // No endpoint anywhere: refuse at once on every address (kube-proxy §2.12).
                if keeps_cluster_ip {
                    insert(
                        &mut c.no_endpoint_services,
                        element(service_key, reject(), &origin),
                    );
                }
                for addr in &external {
                    insert(
                        &mut c.no_endpoint_services,
                        element(vec![Atom::Addr(*addr), proto, svc_port], reject(), &origin),
                    );
                }
                if let Some(np_key) = np_key {
                    insert(
                        &mut c.no_endpoint_nodeports,
                        element(np_key, reject(), &origin),
                    );
                }
                continue;
            }

            // ClusterIP: internalTrafficPolicy picks the list. Local without a local endpoint
            // drops: there are endpoints, just none this policy may use.
            let internal = if internal_local {
                &eps.local
            } else {
                &eps.cluster
            };
            if keeps_cluster_ip && internal.is_empty() {
                insert(
                    &mut c.no_endpoint_services,
                    element(service_key, drop(), &origin),
                );
            } else if keeps_cluster_ip {
                let k = add_picks(&mut c.picks, &service_key, internal, &origin);
                insert(
                    &mut c.service_ips,
                    element(service_key, goto(names::pick_chain(k)), &origin),
                );
            }

            // External addresses and the NodePort: externalTrafficPolicy picks the static
            // chain; both endpoint lists are data, so the chain can short-circuit pods and the
            // node itself to the cluster-wide list (kubernetes#131765) whatever the policy.
            // `has_endpoints` guarantees the cluster-wide list is not empty.
            let (ext_chain, np_chain) = if external_local {
                (names::EXTERNAL_LOCAL, names::NODEPORT_LOCAL)
            } else {
                (names::EXTERNAL_CLUSTER, names::NODEPORT_CLUSTER)
            };
            for addr in &external {
                let key = vec![Atom::Addr(*addr), proto, svc_port];
                insert(
                    &mut c.service_ips,
                    element(key.clone(), goto(ext_chain.into()), &origin),
                );
                let k = add_picks(&mut c.picks, &key, &eps.cluster, &origin);
                insert(
                    &mut c.external_picks,
                    element(key.clone(), goto(names::pick_chain(k)), &origin),
                );
                if !external_local {
                    continue;
                }
                if eps.local.is_empty() {
                    insert(&mut c.no_endpoint_services, element(key, drop(), &origin));
                } else {
                    let k = add_picks(&mut c.local_picks, &key, &eps.local, &origin);
                    insert(
                        &mut c.external_local_picks,
                        element(key, goto(names::local_pick_chain(k)), &origin),
                    );
                }
            }
            if let Some(np_key) = np_key {
                insert(
                    &mut c.service_nodeports,
                    element(np_key.clone(), goto(np_chain.into()), &origin),
                );
                let k = add_picks(&mut c.np_picks, &np_key, &eps.cluster, &origin);
                insert(
                    &mut c.nodeport_picks,
                    element(np_key.clone(), goto(names::nodeport_pick_chain(k)), &origin),
                );
                if external_local {
                    if eps.local.is_empty() {
                        insert(
                            &mut c.no_endpoint_nodeports,
                            element(np_key, drop(), &origin),
                        );
                    } else {
                        let k = add_picks(&mut c.np_local_picks, &np_key, &eps.local, &origin);
                        insert(
                            &mut c.nodeport_local_picks,
                            element(np_key, goto(names::nodeport_local_pick_chain(k)), &origin),
                        );
                    }
                }
            }

            // Hairpin: a pod reaching itself through the Service must be masqueraded, or it
            // would see a reply from its own address to itself and drop it. Only endpoints on
            // this node can be their own clients here; an endpoint without a nodeName might be.
            // Every usable endpoint is listed, whichever list uses it: the set only matters
            // for connections DNATed back to their own source.
            for ep in all.iter().filter(|ep| {
                (ep.conditions.ready || (ep.conditions.serving && ep.conditions.terminating))
                    && ep.node_name.is_none_or(|name| name == settings.node_name)
            }) {
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

/// One kind of `pick` chain: which key it reads, which names and comments it gets.
struct PickKind {
    chain: fn(usize) -> String,
    map: fn(usize) -> String,
    key: fn() -> Vec<KeyField>,
    /// What the map's key is, for its comment.
    map_what: &'static str,
    /// What traffic the chain DNATs, for its comment.
    chain_what: &'static str,
    /// The chain picks among this node's endpoints (a Local traffic policy's list).
    local: bool,
}

const PICK_KINDS: [PickKind; 4] = [
    PickKind {
        chain: names::pick_chain,
        map: names::pick_map,
        key: service_key,
        map_what: "service address . protocol . port . slot to endpoint",
        chain_what: "DNAT service address traffic to one of",
        local: false,
    },
    PickKind {
        chain: names::local_pick_chain,
        map: names::local_pick_map,
        key: service_key,
        map_what: "external address . protocol . port . slot to local endpoint",
        chain_what: "DNAT external address traffic to one of",
        local: true,
    },
    PickKind {
        chain: names::nodeport_pick_chain,
        map: names::nodeport_pick_map,
        key: nodeport_key,
        map_what: "protocol . NodePort . slot to endpoint",
        chain_what: "DNAT NodePort traffic to one of",
        local: false,
    },
    PickKind {
        chain: names::nodeport_local_pick_chain,
        map: names::nodeport_local_pick_map,
        key: nodeport_key,
        map_what: "protocol . NodePort . slot to local endpoint",
        chain_what: "DNAT NodePort traffic to one of",
        local: true,
    },
];

/// The `pick` maps and chains of one kind, one per endpoint count in use.
fn pick_objects(kind: &PickKind, picks: Picks, sets: &mut Vec<Set>, chains: &mut Vec<Chain>) {
    for (k, elements) in picks {
        let modulus = u32::try_from(k).unwrap_or(u32::MAX);
        let mut key = (kind.key)();
        key.push(KeyField::Numgen { modulus });
        let local = if kind.local {
            " local"
        } else {
            ""
        };
        // The count is in the name: nft keeps the comment and the `typeof` description in one
        // 256-byte userdata, so map comments must stay short.
        let mut s = set(
            &(kind.map)(k),
            kind.map_what,
            key.clone(),
            Some(SetData::Value(vec![KeyField::Daddr, KeyField::ThDport])),
            elements,
        );
        s.typeof_ = true;
        sets.push(s);
        chains.push(chain(
            &(kind.chain)(k),
            &format!(
                "{} {k}{local} endpoints, uniformly at random",
                kind.chain_what
            ),
            None,
            vec![vec![Stmt::DnatMap {
                key,
                map: (kind.map)(k),
            }]],
        ));
    }
}

/// The rules of a Local-policy chain for external traffic (kube-proxy's `external-` chain with
/// ETP=Local, §2.5), reading `cluster_picks` and `local_picks`, maps keyed by `key`: traffic
/// from pods goes to the cluster-wide endpoints as if it came back from the load balancer;
/// traffic from the node itself too, masqueraded (its source would be the node or VIP
/// address); everything else to this node's endpoints, unmasqueraded so the client address is
/// kept. With no local endpoint the lookup misses, the packet leaves without DNAT, and the
/// `drop` element of the no-endpoint check stops it.
fn local_policy_rules(
    local: Option<Stmt>,
    mark: u32,
    key: fn() -> Vec<KeyField>,
    cluster_picks: &str,
    local_picks: &str,
) -> Vec<Vec<Stmt>> {
    let mut rules = Vec::new();
    if let Some(local) = local {
        rules.push(vec![local, vmap(key(), cluster_picks)]);
    }
    rules.push(vec![
        Stmt::FibLocal {
            field: AddrField::Saddr,
        },
        Stmt::MarkOr(mark),
        vmap(key(), cluster_picks),
    ]);
    rules.push(vec![vmap(key(), local_picks)]);
    rules
}

/// 127.0.0.0/8 or ::1/128.
fn loopback(family: IpFamily) -> IpNet {
    match family {
        IpFamily::V4 => IpNet::V4(ipnet::Ipv4Net::new_assert(
            std::net::Ipv4Addr::new(127, 0, 0, 0),
            8,
        )),
        IpFamily::V6 => IpNet::V6(ipnet::Ipv6Net::new_assert(
            std::net::Ipv6Addr::LOCALHOST,
            128,
        )),
    }
}

fn build_table(
    state: &ClusterState,
    settings: &Settings,
    family: IpFamily,
    claims: &Claims<'_>,
) -> Table {
    let c = collect(state, settings, family, claims);
    let mark = settings.mark;
    let node = state.nodes.get(&settings.node_name);
    let all_addresses = settings.nodeport_addresses.all_of(family);

    let verdicts = Some(SetData::Verdict);
    let mut sets = vec![set(
        names::CLUSTER_IPS,
        "active ClusterIPs",
        vec![KeyField::Daddr],
        None,
        c.cluster_ips,
    )];
    if !all_addresses {
        sets.push(set(
            names::NODEPORT_IPS,
            "local addresses that accept NodePort traffic (--nodeport-addresses)",
            vec![KeyField::Daddr],
            None,
            c.nodeport_ips,
        ));
    }
    sets.extend([
        set(
            names::SERVICE_IPS,
            "ClusterIP, external IP and LoadBalancer IP . protocol . port of services with \
             endpoints: the chain that handles them",
            service_key(),
            verdicts.clone(),
            c.service_ips,
        ),
        set(
            names::SERVICE_NODEPORTS,
            "protocol . NodePort of services with endpoints: the chain for its traffic policy",
            nodeport_key(),
            verdicts.clone(),
            c.service_nodeports,
        ),
        set(
            names::EXTERNAL_PICKS,
            "external address . protocol . port: the chain that picks a cluster-wide endpoint",
            service_key(),
            verdicts.clone(),
            c.external_picks,
        ),
        set(
            names::EXTERNAL_LOCAL_PICKS,
            "external address . protocol . port: the chain that picks an endpoint on this node",
            service_key(),
            verdicts.clone(),
            c.external_local_picks,
        ),
        set(
            names::NODEPORT_PICKS,
            "protocol . NodePort: the chain that picks a cluster-wide endpoint",
            nodeport_key(),
            verdicts.clone(),
            c.nodeport_picks,
        ),
        set(
            names::NODEPORT_LOCAL_PICKS,
            "protocol . NodePort: the chain that picks an endpoint on this node",
            nodeport_key(),
            verdicts.clone(),
            c.nodeport_local_picks,
        ),
        set(
            names::NO_ENDPOINT_SERVICES,
            "service address . protocol . port without usable endpoints: reject or drop",
            service_key(),
            verdicts.clone(),
            c.no_endpoint_services,
        ),
        set(
            names::NO_ENDPOINT_NODEPORTS,
            "protocol . NodePort of services without usable endpoints: reject or drop",
            nodeport_key(),
            verdicts,
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
    ]);

    let mut pick_chains = Vec::new();
    for (kind, picks) in
        PICK_KINDS
            .iter()
            .zip([c.picks, c.local_picks, c.np_picks, c.np_local_picks])
    {
        pick_objects(kind, picks, &mut sets, &mut pick_chains);
    }

    let mut services_rules = Vec::new();
    if settings.masquerade_all {
        services_rules.push(vec![
            in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
            Stmt::MarkOr(mark),
        ]);
    } else if let Some(not_local) = settings.local_match(node, family, true) {
        // Off-cluster clients that route the service range to a node, and the node itself,
        // must get replies back through it; pod sources keep their address.
        services_rules.push(vec![
            in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
            not_local,
            Stmt::MarkOr(mark),
        ]);
    }
    services_rules.push(vec![vmap(service_key(), names::SERVICE_IPS)]);
    // NodePorts answer on the selected node addresses, or on every local address but loopback
    // (kube-proxy does not support localhost NodePorts in nftables mode).
    let nodeport_daddr = || {
        if all_addresses {
            vec![
                Stmt::FibLocal {
                    field: AddrField::Daddr,
                },
                Stmt::AddrMatch {
                    field: AddrField::Daddr,
                    negate: true,
                    net: loopback(family),
                },
            ]
        } else {
            vec![in_set(vec![KeyField::Daddr], names::NODEPORT_IPS)]
        }
    };
    let mut nodeport_rule = nodeport_daddr();
    nodeport_rule.push(vmap(nodeport_key(), names::SERVICE_NODEPORTS));
    services_rules.push(nodeport_rule);

    // Only new connections reach the filter checks; in `filter-input` the address is local
    // already, so `all` needs only the loopback exclusion there.
    let mut nodeport_check = if all_addresses {
        vec![Stmt::AddrMatch {
            field: AddrField::Daddr,
            negate: true,
            net: loopback(family),
        }]
    } else {
        vec![in_set(vec![KeyField::Daddr], names::NODEPORT_IPS)]
    };
    nodeport_check.push(vmap(nodeport_key(), names::NO_ENDPOINT_NODEPORTS));

    let mut cluster_ips_check = vec![vec![
        in_set(vec![KeyField::Daddr], names::CLUSTER_IPS),
        Stmt::Reject,
    ]];
    if let Some(cidr) = first_of(&settings.service_cidrs, family) {
        // An address of the service range that no Service holds: nothing will ever answer,
        // so drop rather than let the packet wander off to the default route.
        cluster_ips_check.push(vec![
            Stmt::AddrMatch {
                field: AddrField::Daddr,
                negate: false,
                net: cidr,
            },
            Stmt::Verdict(Verdict::Drop),
        ]);
    }

    let local = || settings.local_match(node, family, false);
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
            "dispatch by destination: service addresses, then NodePorts on NodePort addresses",
            None,
            services_rules,
        ),
        chain(
            names::EXTERNAL_CLUSTER,
            "externalTrafficPolicy Cluster, external and LoadBalancer IPs: masquerade, any endpoint",
            None,
            vec![vec![
                Stmt::MarkOr(mark),
                vmap(service_key(), names::EXTERNAL_PICKS),
            ]],
        ),
        chain(
            names::EXTERNAL_LOCAL,
            "externalTrafficPolicy Local, external and LoadBalancer IPs: pods and this node to \
             any endpoint, others to local ones",
            None,
            local_policy_rules(
                local(),
                mark,
                service_key,
                names::EXTERNAL_PICKS,
                names::EXTERNAL_LOCAL_PICKS,
            ),
        ),
        chain(
            names::NODEPORT_CLUSTER,
            "externalTrafficPolicy Cluster, NodePorts: masquerade, any endpoint",
            None,
            vec![vec![
                Stmt::MarkOr(mark),
                vmap(nodeport_key(), names::NODEPORT_PICKS),
            ]],
        ),
        chain(
            names::NODEPORT_LOCAL,
            "externalTrafficPolicy Local, NodePorts: pods and this node to any endpoint, others \
             to local ones",
            None,
            local_policy_rules(
                local(),
                mark,
                nodeport_key,
                names::NODEPORT_PICKS,
                names::NODEPORT_LOCAL_PICKS,
            ),
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
            vec![nodeport_check],
        ),
        chain(
            names::CLUSTER_IPS_CHECK,
            "reject traffic to ClusterIP ports that no service defines, drop unallocated ones",
            None,
            cluster_ips_check,
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
        owned: settings.own_tables,
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
    if !settings.service_cidrs.is_empty() {
        for svc in state.services.values() {
            for ip in &svc.cluster_ips {
                let family = IpFamily::of(ip);
                let of_family: Vec<_> = settings
                    .service_cidrs
                    .iter()
                    .filter(|c| IpFamily::of(&c.addr()) == family)
                    .collect();
                if !of_family.is_empty() && !of_family.iter().any(|c| c.contains(ip)) {
                    out.push(format!(
                        "Service {}: ClusterIP {ip} is outside --service-cidr ({}): the API \
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
            let name = svc.port_name(port);
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
    out
}

#[cfg(test)]
mod tests;
