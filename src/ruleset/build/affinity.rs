//! `sessionAffinity: ClientIP`: every new connection from a client to a service port goes to
//! the endpoint the client's previous connection went to, as long as that was less than the
//! affinity timeout ago (refreshed by each new connection) and that endpoint still exists.
//!
//! kube-proxy keeps one dynamic set and one chain per endpoint. Here nothing is per service:
//! each endpoint of a service key holds a *slot*. A service key is `service address . protocol
//! . port` for traffic to a ClusterIP, external IP or LoadBalancer IP, and `protocol . NodePort`
//! for NodePort traffic (the *paths*; see below why NodePorts have their own), and
//!
//! - `affinity-slot-<i>` (dynamic, timeout) holds `client . service address . protocol . port`
//!   for clients pinned to slot `i`; the packet path writes it (`update`, `delete`), nodeproxy
//!   only declares it, so a restart or resync keeps the pins;
//! - `affinity-slot-<i>-endpoints` maps a service key to its endpoint in slot `i`;
//! - `affinity-<T>s-slot-<i>` (per timeout `T` in use and slot): pin the client to slot `i` for
//!   `T` seconds, then DNAT to the slot's endpoint.
//!
//! NodePorts have the same objects named `affinity-nodeport-…` (`affinity-nodeport-slot-<i>`,
//! …), keyed without the destination address: `client . protocol . NodePort` pins and `protocol .
//! NodePort` slot maps. The destination must stay out of the key because a NodePort answers on
//! every NodePort address, and with `--nodeport-addresses all` on every local address through
//! `fib daddr type local`, so there may be no list of addresses to key elements on (keying on
//! the node's addresses left NodePorts unpinned under `all`). This layout is used for every
//! NodePort, not only under `all`: one layout whatever the flag, one slot element per endpoint
//! instead of one per endpoint and NodePort address, and a client's pin holds whichever node
//! address it connects to, as kube-proxy's does. What it costs is a second set of static slot
//! objects (chains per timeout and slot, sets and maps per slot), a constant; measured in
//! docs/ruleset.md ("Session affinity").
//!
//! Under `externalTrafficPolicy: Local`, outside clients of an external IP, LB IP or NodePort go
//! to this node's endpoints only (`external-local-picks`, `nodeport-local-picks`), and are
//! pinned there as kube-proxy pins them (its local-policy endpoint chains check affinity too).
//! These Local-policy lists have the same objects again, named `affinity-local-…` (keyed like
//! `affinity-…`) and `affinity-nodeport-local-…` (keyed like `affinity-nodeport-…`), with slots
//! of their own. Sharing the cluster-wide slots and slot maps would not do: the local list is not
//! always a subset of the cluster-wide one (with no ready local endpoint, the serving and
//! terminating local ones are used, while the cluster-wide list holds the ready ones elsewhere),
//! and a sparse local list needs occupancy and random maps of its own under the same service
//! key anyway. Separate objects make the Local-policy path one more [`Path`], like NodePorts;
//! its slots are kept through [`Hints`] (under [`ServiceKey::local`]) in the same way.
//!
//! Slots are stable: an endpoint keeps its slot while it exists, and a new endpoint takes the
//! lowest slot free for its service key. Where the previous slots come from: [`Hints`], decoded
//! from the `…slot-<i>-endpoints` maps of every path that the kernel holds (read back on start-up, so a restart keeps every assignment); without hints,
//! slots are the positions in sorted order.
//!
//! A key whose `k` endpoints are in slots `0..k` (dense: always so without hints, and again once
//! new endpoints have refilled the holes) goes to `affinity-<T>s-pick-<k>`: the client's pinned
//! slot, else a cascade of `numgen random mod (k-i)` rules, each slot taken with 1/k. That chain
//! looks up no per-service verdict map, so it costs the kernel's chain validation nothing per
//! service. A key with holes (sparse: highest slot `n-1 > k-1`) goes to
//! `affinity-pick-<k>-in-<n>`, which reads two more kinds of elements:
//!
//! - `affinity-slot-<i>-chains` maps a sparse key with an endpoint in slot `i` to the slot chain
//!   for its timeout: a pin counts only while its slot is occupied;
//! - `affinity-random-<k>` maps `service key . numgen random mod k` to the slot chains of the
//!   key's `k` endpoints: a uniform pick among the endpoints present, whatever their slots.
//!
//! For each slot below `n`, in ascending order, the sparse chain follows the client's pin if the
//! slot is occupied, else deletes the stale pin; then it picks at random. The NodePort pick
//! chains mark nothing: as for `nodeport-pick-<k>`, masquerading is the traffic policy chain's
//! decision (`nodeport-cluster` marks everyone, `nodeport-local` not pods).
//!
//! Stale pins: when an endpoint goes, its clients' pins stay in its slot set until they expire.
//! A client that connects while the slot is empty is pinned anew (by the sparse chain, which
//! deletes the stale pin, or by the dense one when the top slot went, whose stale pin lies above
//! every live slot); its next connections stop at its live pin, below any slot refilled later. A
//! client that does not connect while its slot is empty follows the pin to whichever endpoint
//! refills the slot (kube-proxy deletes the pins with the endpoint's set and picks anew).
//!
//! A service port turns affinity on or off by moving its elements: data only, no rule changes,
//! unless a new timeout, endpoint count or slot range needs its static chains.
//!
//! This runs after the main builder and rewrites what it produced for affinity services: a
//! `service-ips`/`external-picks`/`nodeport-picks` element that goes to
//! `pick-<k>`/`nodeport-pick-<k>`, and an `external-local-picks`/`nodeport-local-picks` element
//! that goes to `local-pick-<k>`/`nodeport-local-pick-<k>`, goes to the path's affinity chains
//! instead, and its `k` endpoint elements move to the path's slot maps. Elements that go
//! elsewhere are left alone.
//!
//! Known difference from kube-proxy: the pin key holds the path (ClusterIP, external or LB
//! address, or NodePort; cluster-wide or Local-policy list), so a client's pins via the
//! ClusterIP and via the NodePort are independent.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use super::{Contested, Elements, chain, goto, set};
use crate::model::{ClusterState, Protocol, ServicePortName};
use crate::ruleset::names;
use crate::ruleset::{Atom, ElemData, Element, KeyField, SetData, SetKind, Stmt, Table, Verdict};

/// `service address . protocol . port`, or `protocol . NodePort` (`addr: None`): what affinity
/// slots are assigned per, on the cluster-wide endpoint list or (`local`) on the Local-policy
/// list of outside traffic, each with its own slots. A NodePort's key is the same in both
/// families' tables; their endpoints are not, and slots are looked up per endpoint, so [`Hints`]
/// may hold both under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub addr: Option<IpAddr>,
    pub proto: Protocol,
    pub port: u16,
    /// The Local-policy list of outside traffic (`affinity-local-…`, `affinity-nodeport-local-…`).
    pub local: bool,
}

impl ServiceKey {
    /// The key a slot map's element key holds (`local` as [`SlotMap::local`] says).
    pub fn from_atoms(atoms: &[Atom], local: bool) -> Option<ServiceKey> {
        match atoms {
            [Atom::Addr(addr), Atom::Proto(proto), Atom::Port(port)] => Some(ServiceKey {
                addr: Some(*addr),
                proto: *proto,
                port: *port,
                local,
            }),
            [Atom::Proto(proto), Atom::Port(port)] => Some(ServiceKey {
                addr: None,
                proto: *proto,
                port: *port,
                local,
            }),
            _ => None,
        }
    }
}

/// What the name of a slot endpoint map (`affinity-slot-<i>-endpoints` and the other paths'
/// `…slot-<i>-endpoints`) says about its elements, which map a service key to the endpoint
/// (`address . port`) in slot `slot`: what a reader of the kernel's tables needs to recover
/// [`Hints`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotMap {
    pub slot: usize,
    /// The fields of the elements' keys ([`ServiceKey::from_atoms`] reads them).
    pub key: Vec<KeyField>,
    /// The Local-policy list of outside traffic.
    pub local: bool,
}

impl SlotMap {
    /// The fields of the elements' data.
    pub const DATA: [KeyField; 2] = [KeyField::Daddr, KeyField::ThDport];

    /// The slot map `name` is, or `None` for any other set or map.
    pub fn of(name: &str) -> Option<SlotMap> {
        let (path, slot) = Path::slot_of_map(name)?;
        Some(SlotMap {
            slot,
            key: path.service_key(),
            local: path.local(),
        })
    }
}

/// The slot of each ClientIP-affinity endpoint, per service key, as a previous build assigned
/// them: [`super::build_with`] keeps these, so pinned clients stay on their endpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hints {
    slots: BTreeMap<ServiceKey, BTreeMap<SocketAddr, usize>>,
}

impl Hints {
    /// Records that `endpoint` of `key` is in `slot`. An endpoint found in two slots (which
    /// nodeproxy never writes) keeps the lower one, whatever the order they are found in.
    pub fn insert(&mut self, key: ServiceKey, endpoint: SocketAddr, slot: usize) {
        let slots = self.slots.entry(key).or_default();
        let e = slots.entry(endpoint).or_insert(slot);
        *e = (*e).min(slot);
    }

    /// The slots of the endpoints of `key`.
    pub fn slots(&self, key: &ServiceKey) -> Option<&BTreeMap<SocketAddr, usize>> {
        self.slots.get(key)
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// The slot of each of `endpoints`: the one `previous` gives it when that is still free, else
/// the lowest free one, taken in the order of `endpoints`. Without `previous`, `0..k` in order.
pub(crate) fn assign_slots(
    endpoints: &[SocketAddr],
    previous: Option<&BTreeMap<SocketAddr, usize>>,
) -> Vec<usize> {
    let mut used = BTreeSet::new();
    let kept: Vec<Option<usize>> = endpoints
        .iter()
        .map(|ep| {
            previous
                .and_then(|p| p.get(ep))
                .copied()
                .filter(|&slot| used.insert(slot))
        })
        .collect();
    let mut next = 0;
    kept.into_iter()
        .map(|slot| {
            slot.unwrap_or_else(|| {
                while used.contains(&next) {
                    next += 1;
                }
                used.insert(next);
                next
            })
        })
        .collect()
}

/// Which traffic a set of slot objects serves, and so what its keys hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    /// ClusterIPs, external IPs and LoadBalancer IPs to the cluster-wide endpoints:
    /// `address . protocol . port`.
    Address,
    /// NodePorts, on whichever address they answer, to the cluster-wide endpoints:
    /// `protocol . NodePort`.
    NodePort,
    /// Outside traffic to an external or LoadBalancer IP of an `externalTrafficPolicy: Local`
    /// service, to this node's endpoints: `address . protocol . port`.
    AddressLocal,
    /// Outside traffic to a NodePort of an `externalTrafficPolicy: Local` service, to this
    /// node's endpoints: `protocol . NodePort`.
    NodePortLocal,
}

impl Path {
    const ALL: [Path; 4] = [
        Path::Address,
        Path::NodePort,
        Path::AddressLocal,
        Path::NodePortLocal,
    ];

    /// The prefix of the path's object names.
    fn prefix(self) -> &'static str {
        match self {
            Path::Address => names::AFFINITY,
            Path::NodePort => names::AFFINITY_NODEPORT,
            Path::AddressLocal => names::AFFINITY_LOCAL,
            Path::NodePortLocal => names::AFFINITY_NODEPORT_LOCAL,
        }
    }

    /// Whether the path serves the Local-policy (this node's) endpoint list.
    fn local(self) -> bool {
        matches!(self, Path::AddressLocal | Path::NodePortLocal)
    }

    /// The path whose endpoints a dispatch map's elements send to a `pick` chain, and the kind
    /// of that chain.
    fn of_dispatch_map(name: &str) -> Option<(Path, PickKind)> {
        let [pick, local_pick, nodeport_pick, nodeport_local_pick] = PICK_KINDS;
        Some(match name {
            names::SERVICE_IPS | names::EXTERNAL_PICKS => (Path::Address, pick),
            names::NODEPORT_PICKS => (Path::NodePort, nodeport_pick),
            names::EXTERNAL_LOCAL_PICKS => (Path::AddressLocal, local_pick),
            names::NODEPORT_LOCAL_PICKS => (Path::NodePortLocal, nodeport_local_pick),
            _ => return None,
        })
    }

    /// The path and slot of a slot endpoint map's name.
    fn slot_of_map(name: &str) -> Option<(Path, usize)> {
        Path::ALL
            .into_iter()
            .find_map(|path| names::affinity_slot_of_map(path.prefix(), name).map(|i| (path, i)))
    }

    /// The key of the slot maps.
    fn service_key(self) -> Vec<KeyField> {
        match self {
            Path::Address | Path::AddressLocal => {
                vec![KeyField::Daddr, KeyField::L4Proto, KeyField::ThDport]
            }
            Path::NodePort | Path::NodePortLocal => vec![KeyField::L4Proto, KeyField::ThDport],
        }
    }

    /// The key of the pins: the client, then the service key.
    fn pin_key(self) -> Vec<KeyField> {
        let mut key = vec![KeyField::Saddr];
        key.extend(self.service_key());
        key
    }

    fn random_key(self, k: usize) -> Vec<KeyField> {
        let mut key = self.service_key();
        key.push(KeyField::Numgen {
            modulus: u32::try_from(k).unwrap_or(u32::MAX),
        });
        key
    }

    /// What the service key is, for comments.
    fn what(self) -> &'static str {
        match self {
            Path::Address => "service . protocol . port",
            Path::NodePort => "protocol . NodePort",
            Path::AddressLocal => "external address . protocol . port",
            Path::NodePortLocal => "protocol . NodePort",
        }
    }

    /// What traffic the chains handle, for comments.
    fn traffic(self) -> &'static str {
        match self {
            Path::Address => "",
            Path::NodePort => "NodePort ",
            Path::AddressLocal => "Local-policy external ",
            Path::NodePortLocal => "Local-policy NodePort ",
        }
    }

    /// What the endpoints are, for comments.
    fn endpoints(self) -> &'static str {
        if self.local() {
            "local endpoint"
        } else {
            "endpoint"
        }
    }

    fn slot_set(self, i: usize) -> String {
        names::affinity_slot_set(self.prefix(), i)
    }

    fn slot_map(self, i: usize) -> String {
        names::affinity_slot_map(self.prefix(), i)
    }

    fn slot_chains_map(self, i: usize) -> String {
        names::affinity_slot_chains_map(self.prefix(), i)
    }

    fn slot_chain(self, timeout: u32, i: usize) -> String {
        names::affinity_slot_chain(self.prefix(), timeout, i)
    }

    fn random_map(self, k: usize) -> String {
        names::affinity_random_map(self.prefix(), k)
    }

    fn dense_pick_chain(self, timeout: u32, k: usize) -> String {
        names::affinity_dense_pick_chain(self.prefix(), timeout, k)
    }

    fn pick_chain(self, k: usize, n: usize) -> String {
        names::affinity_pick_chain(self.prefix(), k, n)
    }
}

/// A kind of `pick` chain: the prefix of its name (before `k`), and the name of its map.
type PickKind = (&'static str, fn(usize) -> String);

/// The `pick` chains that affinity replaces: cluster-wide and Local-policy lists of service
/// addresses and NodePorts.
const PICK_KINDS: [PickKind; 4] = [
    ("pick-", names::pick_map),
    ("local-pick-", names::local_pick_map),
    ("nodeport-pick-", names::nodeport_pick_map),
    ("nodeport-local-pick-", names::nodeport_local_pick_map),
];

/// The endpoint count `k` of a `goto <prefix><k>` verdict.
fn pick_count(data: &Option<ElemData>, prefix: &str) -> Option<usize> {
    match data {
        Some(ElemData::Verdict(Verdict::Goto(chain))) => chain.strip_prefix(prefix)?.parse().ok(),
        _ => None,
    }
}

/// Removes and returns the elements of map `name` whose key is one of `prefixes` plus a slot.
fn take_endpoints(table: &mut Table, name: &str, prefixes: &BTreeSet<Vec<Atom>>) -> Vec<Element> {
    let Some(map) = table.sets.iter_mut().find(|s| s.name == name) else {
        return Vec::new();
    };
    let (taken, kept): (Vec<Element>, Vec<Element>) = std::mem::take(&mut map.elements)
        .into_iter()
        .partition(|e| {
            e.key
                .split_last()
                .is_some_and(|(_, prefix)| prefixes.contains(prefix))
        });
    map.elements = kept;
    taken
}

/// The endpoint elements of one key prefix of a pick map, with their (dense) slots there.
type Numbered = Vec<(u32, Element)>;

/// One dispatch element of an affinity service port, found in pass 1.
struct Job {
    /// Where the element is: index of its map in `table.sets`, and in the map's elements.
    set: usize,
    elem: usize,
    path: Path,
    timeout: u32,
    /// The `pick` map its endpoints are in, under the element's key (which is also the
    /// service key of the slot maps).
    from_map: String,
    key: Vec<Atom>,
}

/// The slot maps' elements of one path, by slot, and what its static objects must cover.
#[derive(Default)]
struct Slots {
    endpoints: BTreeMap<usize, Elements>,
    chains: BTreeMap<usize, Elements>,
    /// `…random-<k>` elements by `k`.
    random: BTreeMap<usize, Elements>,
    /// The slot range `n` each timeout's slot chains must cover.
    ranges: BTreeMap<u32, usize>,
    /// `(timeout, k)` of the dense pick chains in use.
    dense: BTreeSet<(u32, usize)>,
    /// `(k, n)` of the sparse pick chains in use.
    picks: BTreeSet<(usize, usize)>,
    /// The slots below this have a `…slot-<i>-chains` map (some sparse key reaches them).
    sparse_slots: usize,
}

/// Rewrites `table` for the services with ClientIP affinity, keeping the slots `hints` gives
/// (the Services of a key claimed twice in its sets go into `contested`).
pub(super) fn add(
    state: &ClusterState,
    table: &mut Table,
    hints: &Hints,
    contested: &mut Contested,
) {
    let timeout_of = |origin: &Option<Arc<ServicePortName>>| {
        origin
            .as_ref()
            .and_then(|o| state.services.get(&o.service))
            .and_then(|s| s.session_affinity_timeout)
    };

    // Pass 1: find the dispatch elements of affinity service ports.
    let mut jobs = Vec::new();
    for (si, s) in table.sets.iter().enumerate() {
        // The maps whose elements send a service port to a `pick-<k>` chain: ClusterIPs in
        // `service-ips`, external and LB IPs in `external-picks` (cluster-wide endpoints) and
        // `external-local-picks` (Local policy), NodePorts in `nodeport-picks` and
        // `nodeport-local-picks`.
        let Some((path, (prefix, map))) = Path::of_dispatch_map(&s.name) else {
            continue;
        };
        for (ei, e) in s.elements.iter().enumerate() {
            let Some(timeout) = timeout_of(&e.origin) else {
                continue;
            };
            let Some(k) = pick_count(&e.data, prefix) else {
                continue;
            };
            jobs.push(Job {
                set: si,
                elem: ei,
                path,
                timeout,
                from_map: map(k),
                key: e.key.clone(),
            });
        }
    }

    // Pass 2: take the endpoints out of the pick maps, one pass over each map (a pass per
    // service port would be quadratic at 10k services).
    let mut wanted: BTreeMap<String, BTreeSet<Vec<Atom>>> = BTreeMap::new();
    for job in &jobs {
        wanted
            .entry(job.from_map.clone())
            .or_default()
            .insert(job.key.clone());
    }
    let mut found: BTreeMap<(String, Vec<Atom>), Numbered> = BTreeMap::new();
    for (map, prefixes) in &wanted {
        for ep in take_endpoints(table, map, prefixes) {
            let Some((Atom::Int(dense), prefix)) = ep.key.split_last() else {
                continue;
            };
            let (dense, prefix) = (*dense, prefix.to_vec());
            found
                .entry((map.clone(), prefix))
                .or_default()
                .push((dense, ep));
        }
    }

    // Pass 3: slots per service key, the slot maps' elements, and the dispatch verdicts.
    let mut paths: BTreeMap<Path, Slots> = BTreeMap::new();
    let mut verdicts = Vec::new();
    for job in jobs {
        // Two dispatch elements may share endpoints (an external IP that repeats the
        // ClusterIP): each gets its own copy.
        let Some(mut eps) = found.get(&(job.from_map.clone(), job.key.clone())).cloned() else {
            continue;
        };
        // Sorted endpoint order, as the pick map numbered them.
        eps.sort_by_key(|(dense, _)| *dense);
        let eps: Vec<(SocketAddr, Element)> = eps
            .into_iter()
            .filter_map(|(_, e)| match &e.data {
                Some(ElemData::Value(v)) => match v.as_slice() {
                    [Atom::Addr(a), Atom::Port(p)] => Some((SocketAddr::new(*a, *p), e)),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        if eps.is_empty() {
            continue;
        }
        let k = eps.len();
        let addrs: Vec<SocketAddr> = eps.iter().map(|(a, _)| *a).collect();
        let previous =
            ServiceKey::from_atoms(&job.key, job.path.local()).and_then(|key| hints.slots(&key));
        let assigned = assign_slots(&addrs, previous);
        // The k endpoints are numbered 0..k exactly when the highest slot is k-1.
        let n = assigned.iter().map(|s| s + 1).max().unwrap_or(k);
        let dense = n == k;
        let slots = paths.entry(job.path).or_default();
        if !dense {
            slots.sparse_slots = slots.sparse_slots.max(n);
        }
        slots.add_key(job.path, &job.key, &eps, &assigned, job.timeout, dense);
        let chain = if dense {
            slots.dense.insert((job.timeout, k));
            job.path.dense_pick_chain(job.timeout, k)
        } else {
            slots.picks.insert((k, n));
            job.path.pick_chain(k, n)
        };
        verdicts.push((job.set, job.elem, chain));
    }
    for (set, elem, chain) in verdicts {
        if let Some(e) = table
            .sets
            .get_mut(set)
            .and_then(|s| s.elements.get_mut(elem))
        {
            e.data = goto(chain);
        }
    }
    drop_unused_picks(table);
    for (path, slots) in paths {
        slots.add_objects(path, table, contested);
    }
}

impl Slots {
    /// Adds the elements of one service key whose endpoints (sorted) are in slots `assigned`:
    /// its endpoint in each slot, and when the slots are sparse, what the sparse pick chains
    /// read (which slots are occupied, and the random index of each).
    fn add_key(
        &mut self,
        path: Path,
        svc_key: &[Atom],
        eps: &[(SocketAddr, Element)],
        assigned: &[usize],
        timeout: u32,
        dense: bool,
    ) {
        let mut by_slot: Vec<(usize, &Element)> = assigned
            .iter()
            .copied()
            .zip(eps.iter().map(|(_, e)| e))
            .collect();
        by_slot.sort_by_key(|(slot, _)| *slot);
        let k = by_slot.len();
        for (index, (slot, ep)) in by_slot.iter().enumerate() {
            let with = |key: Vec<Atom>, data: Option<ElemData>| Element {
                key,
                data,
                comment: ep.comment.clone(),
                origin: ep.origin.clone(),
            };
            self.endpoints
                .entry(*slot)
                .or_default()
                .push(with(svc_key.to_vec(), ep.data.clone()));
            if dense {
                continue;
            }
            let to_slot = goto(path.slot_chain(timeout, *slot));
            self.chains
                .entry(*slot)
                .or_default()
                .push(with(svc_key.to_vec(), to_slot.clone()));
            let mut random = svc_key.to_vec();
            random.push(Atom::Int(u32::try_from(index).unwrap_or(u32::MAX)));
            self.random
                .entry(k)
                .or_default()
                .push(with(random, to_slot));
        }
        let n = by_slot.last().map_or(0, |(slot, _)| slot + 1);
        let range = self.ranges.entry(timeout).or_default();
        *range = (*range).max(n);
    }

    /// The static sets, maps and chains of `path` that the elements need.
    fn add_objects(mut self, path: Path, table: &mut Table, contested: &mut Contested) {
        let what = path.what();
        let traffic = path.traffic();
        let eps = path.endpoints();
        let slot_count = self.ranges.values().copied().max().unwrap_or(0);
        for i in 0..slot_count {
            let mut pins = set(
                &path.slot_set(i),
                &format!("client . {what} pinned to {eps} slot {i}"),
                path.pin_key(),
                None,
                Vec::new(),
                contested,
            );
            pins.kind = SetKind::Dynamic;
            pins.typeof_ = true;
            table.sets.push(pins);
            table.sets.push(set(
                &path.slot_map(i),
                &format!("{what} to the {eps} in slot {i} (ClientIP affinity)"),
                path.service_key(),
                Some(SetData::Value(vec![KeyField::Daddr, KeyField::ThDport])),
                self.endpoints.remove(&i).unwrap_or_default(),
                contested,
            ));
            if i >= self.sparse_slots {
                continue;
            }
            table.sets.push(set(
                &path.slot_chains_map(i),
                &format!("{what} with an {eps} in slot {i}: the slot chain for its timeout"),
                path.service_key(),
                Some(SetData::Verdict),
                self.chains.remove(&i).unwrap_or_default(),
                contested,
            ));
        }
        for (k, elements) in std::mem::take(&mut self.random) {
            // The comment shares nft's 256-byte set userdata with the `typeof` description.
            let mut random = set(
                &path.random_map(k),
                &format!("{what} . random index to a slot chain"),
                path.random_key(k),
                Some(SetData::Verdict),
                elements,
                contested,
            );
            random.typeof_ = true;
            table.sets.push(random);
        }
        for (&timeout, &n) in &self.ranges {
            for i in 0..n {
                table.chains.push(chain(
                    &path.slot_chain(timeout, i),
                    &format!(
                        "pin the {traffic}client to {eps} slot {i} for {timeout}s, DNAT to it"
                    ),
                    None,
                    vec![
                        // A separate rule: a full pin set must not stop the DNAT.
                        vec![Stmt::UpdateSet {
                            key: path.pin_key(),
                            set: path.slot_set(i),
                            timeout_secs: timeout,
                        }],
                        vec![Stmt::DnatMap {
                            key: path.service_key(),
                            map: path.slot_map(i),
                        }],
                    ],
                ));
            }
        }
        // Dense keys: the client's pinned slot, else a cascade of `numgen` over slots 0..k.
        for &(timeout, k) in &self.dense {
            table.chains.push(chain(
                &path.dense_pick_chain(timeout, k),
                &format!(
                    "{traffic}ClientIP affinity, {k} {eps}s: the client's pinned slot, else one \
                     at random"
                ),
                None,
                dense_pick_rules(path, timeout, k),
            ));
        }
        // Sparse keys.
        for &(k, n) in &self.picks {
            table.chains.push(chain(
                &path.pick_chain(k, n),
                &format!(
                    "{traffic}ClientIP affinity, {k} {eps}s in slots below {n}: the client's \
                     pinned slot while occupied, else one at random"
                ),
                None,
                pick_rules(path, k, n),
            ));
        }
    }
}

/// The pick rules of a dense key (slots 0..k, all occupied): the client's pinned slot, else
/// slot `i` with a cascade of `numgen random mod (k-i)` rules, rule `i` reached with probability
/// (k-i)/k and taken with 1/(k-i), so each slot gets 1/k. No per-service verdict map is looked
/// up here; the kernel's chain validation stays as cheap as for a service without affinity.
fn dense_pick_rules(path: Path, timeout: u32, k: usize) -> Vec<Vec<Stmt>> {
    let to_slot = |i: usize| Stmt::Verdict(Verdict::Goto(path.slot_chain(timeout, i)));
    let mut rules: Vec<Vec<Stmt>> = (0..k)
        .map(|i| {
            vec![
                Stmt::InSet {
                    key: path.pin_key(),
                    set: path.slot_set(i),
                },
                to_slot(i),
            ]
        })
        .collect();
    for i in 0..k.saturating_sub(1) {
        let modulus = u32::try_from(k - i).unwrap_or(u32::MAX);
        rules.push(vec![Stmt::RandomIs { modulus, value: 0 }, to_slot(i)]);
    }
    if k > 0 {
        rules.push(vec![to_slot(k - 1)]);
    }
    rules
}

/// For each slot below `n` in ascending order: follow the client's pin while the service has an
/// endpoint in the slot, else delete the pin; then a uniform pick among the `k` endpoints.
fn pick_rules(path: Path, k: usize, n: usize) -> Vec<Vec<Stmt>> {
    let pinned = |i: usize| Stmt::InSet {
        key: path.pin_key(),
        set: path.slot_set(i),
    };
    let mut rules = Vec::with_capacity(2 * n + 1);
    for i in 0..n {
        rules.push(vec![
            pinned(i),
            Stmt::Vmap {
                key: path.service_key(),
                map: path.slot_chains_map(i),
            },
        ]);
        // Reached only when the slot is empty for this service: the pin is stale. Deleting it
        // means the client, pinned anew below, holds exactly one live pin, so a later endpoint
        // refilling this slot cannot take the client over.
        rules.push(vec![
            pinned(i),
            Stmt::DeleteFromSet {
                key: path.pin_key(),
                set: path.slot_set(i),
            },
        ]);
    }
    rules.push(vec![Stmt::Vmap {
        key: path.random_key(k),
        map: path.random_map(k),
    }]);
    rules
}

/// Removes `pick-<k>`, `local-pick-<k>`, `nodeport-pick-<k>` and `nodeport-local-pick-<k>`
/// chains and maps that affinity emptied and nothing
/// references any more, so the table shows only what is in use.
fn drop_unused_picks(table: &mut Table) {
    let referenced: BTreeSet<String> = table
        .sets
        .iter()
        .flat_map(|s| s.elements.iter())
        .filter_map(|e| match &e.data {
            Some(ElemData::Verdict(Verdict::Goto(c) | Verdict::Jump(c))) => Some(c.clone()),
            _ => None,
        })
        .collect();
    let mut gone_maps = BTreeSet::new();
    table.chains.retain(|c| {
        let map = PICK_KINDS.iter().find_map(|(prefix, map)| {
            c.name
                .strip_prefix(prefix)
                .and_then(|k| k.parse().ok())
                .map(map)
        });
        let Some(map) = map else {
            return true;
        };
        let empty = table_set_empty(&table.sets, &map);
        if empty && !referenced.contains(&c.name) {
            gone_maps.insert(map);
            false
        } else {
            true
        }
    });
    table.sets.retain(|s| !gone_maps.contains(&s.name));
}

fn table_set_empty(sets: &[crate::ruleset::Set], name: &str) -> bool {
    sets.iter()
        .find(|s| s.name == name)
        .is_none_or(|s| s.elements.is_empty())
}

#[cfg(test)]
mod tests;
