//! `build(state, settings) -> Ruleset`: the desired ruleset, pure and deterministic.
//!
//! The layout is data-driven (DESIGN §3 "kernel cost"): a fixed set of chains, plus one small
//! `pick-<k>` chain per endpoint count `k` in use, and every Service, endpoint and NodePort is an
//! element of a map. Changing endpoints therefore only changes map elements, which the kernel
//! applies without re-validating the chain graph; only a change of a Service's endpoint count
//! moves its verdict element to another (tiny) `pick-<k>` chain.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use super::categorize::{NodeView, categorize};
use super::names;
use super::{
    AddrField, Atom, Atoms, BaseChain, Chain, ChainType, Comment, ElemData, Element, Hook,
    KeyField, Rule, Ruleset, Set, SetData, Stmt, Table, Verdict,
};
use crate::model::{
    ClusterState, Endpoint, IpFamily, Node, ServiceName, ServicePortName, SlicesByService,
    TrafficPolicy, endpoints_for,
};

/// Services that claimed an element key that another Service claimed too, in some set of a
/// build: only one element per key can exist, so which Service's element is kept depends on
/// the other Services, not on the Service alone.
pub type Contested = BTreeSet<ServiceName>;

/// [`build`], also returning the Services involved in a contested key (the one that kept it
/// and those whose element was dropped). The incremental sync rebuilds single Services, which
/// is only sound for Services whose elements do not depend on the others.
pub fn build_noting_contested(state: &ClusterState, settings: &Settings) -> (Ruleset, Contested) {
    let mut contested = Contested::new();
    // Once for both tables: at 50k Services it took a tenth of the build's instructions.
    let slices = state.slices_by_service();
    let tables = IpFamily::ALL
        .iter()
        .map(|&family| {
            let claims = Claims::new(state, family);
            contested.extend(claims.contested());
            let mut table = build_table(state, &slices, settings, family, &claims, &mut contested);
            // Source ranges and session affinity live in their own modules.
            firewall::add(state, settings, family, &claims, &mut table, &mut contested);
            affinity::add(state, &mut table, &mut contested);
            table
        })
        .collect();
    (Ruleset { tables }, contested)
}

/// Builds both tables.
pub fn build(state: &ClusterState, settings: &Settings) -> Ruleset {
    build_noting_contested(state, settings).0
}

mod affinity;
mod claims;
mod diagnostics;
mod firewall;
mod layout;
mod settings;

pub use claims::{AddressKind, Claim, Claims, Clash};
pub use diagnostics::{address_warnings, diagnostics};
use layout::*;
pub use settings::{DetectLocal, NodePortAddresses, Settings};

/// Elements of one set; sorted and de-duplicated by [`finish`] once collected.
type Elements = Vec<Element>;

/// The Service port an element serves, formatted once and shared by all its elements.
struct Origin {
    name: Arc<ServicePortName>,
    comment: Comment,
}

impl Origin {
    fn new(name: ServicePortName) -> Origin {
        use std::fmt::Write as _;
        // Sized up front: grown as it was written, the text was reallocated several times for
        // each Service port (55 of the build's 726 M instructions at 50k Services).
        let service = &name.service;
        let mut text = String::with_capacity(
            service.namespace().len() + service.name().len() + name.port.len().max(4) + 2,
        );
        let _ = write!(text, "{name}");
        Origin {
            comment: Comment::from(names::comment(&text)),
            name: Arc::new(name),
        }
    }
}

fn element(key: &[Atom], data: Option<ElemData>, origin: &Origin) -> Element {
    keyed(Atoms::new(key), data, origin)
}

fn keyed(key: Atoms, data: Option<ElemData>, origin: &Origin) -> Element {
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
/// share its hairpin key the same way. The Services of a key claimed by more than one go into
/// `contested`.
fn finish(mut elements: Elements, contested: &mut Contested) -> Vec<Element> {
    sort_stably(&mut elements);
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
    // The vectors grew by doubling; at 10k services the pick maps' slack alone is megabytes.
    elements.shrink_to_fit();
    elements
}

/// Sorts by key, stably, without the scratch copy of the elements a stable sort allocates (9.2
/// MiB for the 100k-element pick map at 10k Services × 10 endpoints, on top of the start-up
/// peak): positions are sorted by their key's first 16 bytes ([`Atoms::order_prefix`]), ties
/// (equal prefixes) by key and then by position, which is the stable order, and the elements
/// are then moved along the permutation's cycles in place. The prefixes are sorted by
/// [`radix_sort`]: a comparison sort of them was 135 of 371 M instructions of a cold build at
/// 10k × 10 and 368 M at 50k × 5 (callgrind), and most keys (IPv4 ones) are whole in their
/// prefix, so that hardly a key is read. The positions take 24 bytes each, twice while sorting
/// (4.8 MB for the 100k-element map there).
fn sort_stably(elements: &mut [Element]) {
    if elements.is_sorted_by(|a, b| a.key <= b.key) {
        return;
    }
    let mut order: Vec<Ranked> = elements
        .iter()
        .enumerate()
        .map(|(at, e)| Ranked {
            prefix: e.key.order_prefix(),
            at,
        })
        .collect();
    radix_sort(&mut order);
    // Equal prefixes say nothing about the keys: each run of them is ordered by key. The radix
    // sort kept such a run in position order, which breaks the ties between equal keys.
    let mut start = 0;
    while start < order.len() {
        let prefix = order[start].prefix;
        let len = order[start..]
            .iter()
            .take_while(|r| r.prefix == prefix)
            .count();
        if len > 1 {
            order[start..start + len].sort_unstable_by(|a, b| {
                elements[a.at]
                    .key
                    .cmp(&elements[b.at].key)
                    .then(a.at.cmp(&b.at))
            });
        }
        start += len;
    }
    // Position `i` takes the element at `order[i]`; a position done is marked `order[i] == i`.
    for start in 0..order.len() {
        let mut at = start;
        loop {
            let from = order[at].at;
            order[at].at = at;
            if from == start || from == at {
                break;
            }
            elements.swap(at, from);
            at = from;
        }
    }
}

/// A position in a set's elements and its key's [`Atoms::order_prefix`] (most significant byte
/// first).
#[derive(Clone, Copy, Default)]
struct Ranked {
    prefix: [u8; 16],
    at: usize,
}

impl Ranked {
    /// The prefix's byte `d`, from the least significant (0) to the most (15).
    fn byte(&self, d: usize) -> usize {
        usize::from(self.prefix[15 - d])
    }
}

/// Sorts by prefix, stably: a least-significant-digit radix sort, a byte per pass, that skips
/// the bytes every prefix shares (the atoms' kinds, the high bytes of a slot, those of
/// addresses from one range, the zeros after an IPv4 pick key), so that the 100k-element pick
/// map at 10k × 10 takes a few passes of two reads and a write each, where a comparison sort
/// made ~17 rounds of comparisons.
fn radix_sort(items: &mut Vec<Ranked>) {
    let n = items.len();
    let mut counts = [[0usize; 256]; 16];
    for r in items.iter() {
        for (d, count) in counts.iter_mut().enumerate() {
            count[r.byte(d)] += 1;
        }
    }
    let mut scratch = vec![Ranked::default(); n];
    for (d, count) in counts.iter().enumerate() {
        if count.contains(&n) {
            continue;
        }
        let mut next = [0usize; 256];
        let mut sum = 0;
        for (slot, c) in next.iter_mut().zip(count) {
            *slot = sum;
            sum += c;
        }
        for r in items.iter() {
            let b = r.byte(d);
            scratch[next[b]] = *r;
            next[b] += 1;
        }
        std::mem::swap(items, &mut scratch);
    }
}

/// `goto` verdicts with one shared name per chain: a verdict map's tens of thousands of
/// elements name a handful of chains.
#[derive(Default)]
struct Gotos(HashMap<String, Arc<str>>);

impl Gotos {
    fn to(&mut self, chain: &str) -> Option<ElemData> {
        let name = match self.0.get(chain) {
            Some(name) => name.clone(),
            None => {
                let name: Arc<str> = Arc::from(chain);
                self.0.insert(chain.to_owned(), name.clone());
                name
            }
        };
        Some(ElemData::Verdict(Verdict::Goto(name)))
    }
}

fn goto(chain: String) -> Option<ElemData> {
    Some(ElemData::Verdict(Verdict::Goto(chain.into())))
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
    /// The elements of the four kinds of `pick` maps, made once they are all known.
    picks: PendingPicks,
}

/// The endpoints of `family`, the only ones a table of that family can DNAT to.
fn of_family(endpoints: Vec<Endpoint<'_>>, family: IpFamily) -> Vec<Endpoint<'_>> {
    endpoints
        .into_iter()
        .filter(|ep| IpFamily::of(&ep.addr) == family)
        .collect()
}

/// The kinds of `pick` maps, in [`layout::PICK_KINDS`]' order.
#[derive(Clone, Copy)]
enum PickMap {
    /// `pick-<k>-endpoints`: service address (ClusterIP or external) . proto . port . slot.
    Cluster = 0,
    /// `local-pick-<k>-endpoints`: external address . proto . port . slot, local endpoints.
    Local = 1,
    /// `nodeport-pick-<k>-endpoints`: proto . NodePort . slot, cluster-wide endpoints.
    NodePort = 2,
    /// `nodeport-local-pick-<k>-endpoints`: proto . NodePort . slot, local endpoints.
    NodePortLocal = 3,
}

/// A list of endpoints recorded in [`PendingPicks::endpoints`].
#[derive(Clone, Copy)]
struct Span {
    start: usize,
    len: usize,
}

/// One key's slot elements, to be made by [`PendingPicks::into_picks`].
struct PendingKey {
    map: PickMap,
    prefix: Atoms,
    origin: Arc<ServicePortName>,
    endpoints: Span,
}

/// The `pick` maps' elements, recorded while collecting and made at the end, when each
/// vector's length is known and it can be allocated once. Grown by doubling instead, the
/// largest (100k elements at 10k Services x 10) had left its 0.75 + 1.5 + 3 + 6 MiB of earlier
/// buffers freed but resident (jemalloc keeps freed pages for its decay time) at the build's
/// peak; the record costs 20 bytes per endpoint list entry and one `PendingKey` per key
/// (docs/performance.md, "The `--once` peak's floor").
#[derive(Default)]
struct PendingPicks {
    /// Address and port of the endpoints of every list recorded; ClusterIP, external
    /// addresses and NodePort of a Service port share its lists.
    endpoints: Vec<(IpAddr, u16)>,
    keys: Vec<PendingKey>,
    /// Elements per map kind and endpoint count.
    counts: [BTreeMap<usize, usize>; 4],
}

impl PendingPicks {
    fn record(&mut self, endpoints: &[Endpoint<'_>]) -> Span {
        let start = self.endpoints.len();
        self.endpoints
            .extend(endpoints.iter().map(|ep| (ep.addr, ep.port)));
        Span {
            start,
            len: endpoints.len(),
        }
    }

    /// Records the `k` slot elements of one key for the `pick` map of `map` for
    /// `k = endpoints.len`, and returns `k`. `endpoints` is never empty here (callers send
    /// empty lists to reject/drop instead).
    fn add(
        &mut self,
        map: PickMap,
        key_prefix: &[Atom],
        endpoints: Span,
        origin: &Origin,
    ) -> usize {
        let k = endpoints.len;
        *self.counts[map as usize].entry(k).or_default() += k;
        self.keys.push(PendingKey {
            map,
            prefix: Atoms::new(key_prefix),
            origin: origin.name.clone(),
            endpoints,
        });
        k
    }

    /// The elements of each kind of map, by endpoint count, in the order their keys were
    /// recorded.
    fn into_picks(self) -> [Picks; 4] {
        let mut picks = self.counts.map(|counts| {
            counts
                .into_iter()
                .map(|(k, count)| (k, Elements::with_capacity(count)))
                .collect::<Picks>()
        });
        for pending in self.keys {
            let list = self
                .endpoints
                .get(pending.endpoints.start..pending.endpoints.start + pending.endpoints.len)
                .unwrap_or_default();
            let elements = picks[pending.map as usize]
                .entry(pending.endpoints.len)
                .or_default();
            for (slot, &(addr, port)) in list.iter().enumerate() {
                // No comment: the Service-level element whose key begins this one (the `goto`
                // to the pick chain) carries it, and `nodeproxy diff` names the Service by that
                // key ([`names::endpoint_owner_maps`]). Comments on these (125k of 145k
                // elements at 10k Services x 10) were 3 of a cold batch's 10 MB, with the
                // kernel time and read-back they cost (docs/performance.md, "Element
                // comments").
                insert(
                    elements,
                    Element {
                        key: pending.prefix.then(slot_atom(slot)),
                        data: Some(ElemData::Value(Atoms::new(&[
                            Atom::Addr(addr),
                            Atom::Port(port),
                        ]))),
                        comment: None,
                        origin: Some(pending.origin.clone()),
                    },
                );
            }
        }
        picks
    }
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
            key: Atoms::new(&[Atom::Addr(ip)]),
            data: None,
            comment: Some(Comment::from(names::comment(&comment))),
            origin: None,
        });
    }
    out
}

fn collect(
    state: &ClusterState,
    slices: &SlicesByService<'_>,
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
    let mut gotos = Gotos::default();
    let reject = gotos.to(names::REJECT_CHAIN);
    let reject = || reject.clone();
    let drop = || Some(ElemData::Verdict(Verdict::Drop));

    for svc in state.services.values() {
        // A Service is handled by the table of each family it has a ClusterIP in, like
        // kube-proxy's per-family proxiers.
        let Some(cluster_ip) = svc.cluster_ip(family) else {
            continue;
        };
        let svc_slices = slices.get(&svc.name).map(Vec::as_slice).unwrap_or_default();
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
                element(&[Atom::Addr(cluster_ip)], None, &origin),
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
            let service_key = [Atom::Addr(cluster_ip), proto, svc_port];
            let np_key = port.node_port.map(|np| [proto, Atom::Port(np)]);
            if !eps.has_endpoints {
                // No endpoint anywhere: refuse at once on every address (kube-proxy §2.12).
                if keeps_cluster_ip {
                    insert(
                        &mut c.no_endpoint_services,
                        element(&service_key, reject(), &origin),
                    );
                }
                for addr in &external {
                    insert(
                        &mut c.no_endpoint_services,
                        element(&[Atom::Addr(*addr), proto, svc_port], reject(), &origin),
                    );
                }
                if let Some(np_key) = np_key {
                    insert(
                        &mut c.no_endpoint_nodeports,
                        element(&np_key, reject(), &origin),
                    );
                }
                continue;
            }

            // ClusterIP: internalTrafficPolicy picks the list. Local without a local endpoint
            // drops: there are endpoints, just none this policy may use.
            let cluster = c.picks.record(&eps.cluster);
            let local = c.picks.record(&eps.local);
            let (internal, internal_list) = if internal_local {
                (&eps.local, local)
            } else {
                (&eps.cluster, cluster)
            };
            if keeps_cluster_ip && internal.is_empty() {
                insert(
                    &mut c.no_endpoint_services,
                    element(&service_key, drop(), &origin),
                );
            } else if keeps_cluster_ip {
                let k = c
                    .picks
                    .add(PickMap::Cluster, &service_key, internal_list, &origin);
                insert(
                    &mut c.service_ips,
                    element(&service_key, gotos.to(&names::pick_chain(k)), &origin),
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
                let key = [Atom::Addr(*addr), proto, svc_port];
                insert(
                    &mut c.service_ips,
                    element(&key, gotos.to(ext_chain), &origin),
                );
                let k = c.picks.add(PickMap::Cluster, &key, cluster, &origin);
                insert(
                    &mut c.external_picks,
                    element(&key, gotos.to(&names::pick_chain(k)), &origin),
                );
                if !external_local {
                    continue;
                }
                if eps.local.is_empty() {
                    insert(&mut c.no_endpoint_services, element(&key, drop(), &origin));
                } else {
                    let k = c.picks.add(PickMap::Local, &key, local, &origin);
                    insert(
                        &mut c.external_local_picks,
                        element(&key, gotos.to(&names::local_pick_chain(k)), &origin),
                    );
                }
            }
            if let Some(np_key) = np_key {
                insert(
                    &mut c.service_nodeports,
                    element(&np_key, gotos.to(np_chain), &origin),
                );
                let k = c.picks.add(PickMap::NodePort, &np_key, cluster, &origin);
                insert(
                    &mut c.nodeport_picks,
                    element(&np_key, gotos.to(&names::nodeport_pick_chain(k)), &origin),
                );
                if external_local {
                    if eps.local.is_empty() {
                        insert(
                            &mut c.no_endpoint_nodeports,
                            element(&np_key, drop(), &origin),
                        );
                    } else {
                        let k = c.picks.add(PickMap::NodePortLocal, &np_key, local, &origin);
                        insert(
                            &mut c.nodeport_local_picks,
                            element(
                                &np_key,
                                gotos.to(&names::nodeport_local_pick_chain(k)),
                                &origin,
                            ),
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
                        &[
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

/// A set of `elements`, finished: the Services of a key more than one of them claims go into
/// `contested`.
fn set(
    name: &str,
    comment: &str,
    key: Vec<KeyField>,
    data: Option<SetData>,
    elements: Elements,
    contested: &mut Contested,
) -> Set {
    Set {
        name: name.to_string(),
        comment: comment.to_string(),
        key,
        data,
        typeof_: false,
        elements: finish(elements, contested),
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
    Stmt::Verdict(Verdict::Jump(chain.into()))
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

#[cfg(test)]
mod tests;
