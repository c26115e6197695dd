//! `sessionAffinity: ClientIP`: every new connection from a client to a service port goes to
//! the endpoint the client's previous connection went to, as long as that was less than the
//! affinity timeout ago (refreshed by each new connection) and that endpoint still exists.
//!
//! kube-proxy keeps one dynamic set and one chain per endpoint, and each new connection checks
//! one set per endpoint: a Service with 20k endpoints took 191 s of kernel time to program
//! that way, and its every new connection walked 20k lookups. Here the number of kernel objects
//! does not depend on any Service's endpoints, and neither does a new connection's work (a fixed
//! handful of hash lookups). Per *path* (below) there are three maps:
//!
//! - `<path>pins` (dynamic, timeout): `client . service key` → the endpoint address the client
//!   is pinned to. The packet path writes it (`update`, `delete`); nodeproxy only declares it,
//!   so a restart or resync keeps the pins. Its size is the kernel's default for a set a rule
//!   writes, 65535 pins (`nft_dynset_init`); when it is full, new clients are spread without
//!   being pinned (the update is a rule of its own, so it cannot stop the DNAT).
//! - `<path>endpoints`: `service key . endpoint address` → `endpoint address . port`, for every
//!   endpoint of every affinity Service: the DNAT target, and the proof that a pin still
//!   points at an endpoint of this service port.
//! - `<path>pick`: `service key . index` → endpoint address, indices `0..k` in sorted endpoint
//!   order: a new client's endpoint, uniformly at random (`numgen random mod k`).
//!
//! and chains that depend only on the timeout `T` and the endpoint count `k` in use:
//! `<path>pick-<k>-pin-<T>s`, where the dispatch maps send a Service's key, and `<path>pinned-<T>s`.
//! The chosen endpoint travels from one rule to the next in the packet's destination address
//! (`ip daddr set … map @…`), because nft has no other per-packet value to carry it in that
//! nobody else uses (marks are shared with every other firewall), and the service address is
//! read back from conntrack (`ct original ip daddr`), which took it before any rule ran:
//!
//! ```text
//! chain affinity-pick-3-pin-10800s
//!   ip daddr set ip saddr . ct original ip daddr . meta l4proto . th dport map @affinity-pins jump affinity-pinned-10800s
//!   ip daddr set ct original ip daddr . meta l4proto . th dport . numgen random mod 3 map @affinity-pick
//!   update @affinity-pins { ip saddr . ct original ip daddr . meta l4proto . th dport timeout 3h : ip daddr }
//!   dnat ip to ct original ip daddr . meta l4proto . th dport . ip daddr map @affinity-endpoints
//!   ip daddr set ct original ip daddr
//! chain affinity-pinned-10800s
//!   update @affinity-pins { … timeout 3h : ip daddr }      (refreshes the timeout, never the data)
//!   dnat ip to ct original ip daddr . meta l4proto . th dport . ip daddr map @affinity-endpoints
//!   delete @affinity-pins { … : ip daddr }                 (the endpoint is gone: pick anew)
//! ```
//!
//! Each statement that can fail is a rule of its own, and the last rule puts the service
//! address back: a packet that was not DNATed (a pin or pick that misses in an inconsistent
//! moment) leaves as if the service had no endpoint, never towards an endpoint without NAT, and
//! a later `fib daddr type local` never sees an endpoint's address. Rewriting the address keeps
//! the L4 checksum right (`nft_payload_set_eval` with `NFT_PAYLOAD_L4CSUM_PSEUDOHDR`, as nft
//! itself asks), and the NAT that follows rewrites from the address written.
//!
//! The paths, each with its own objects named by its prefix: `affinity-` (ClusterIPs, external
//! and LoadBalancer IPs, keyed by `address . protocol . port`), `affinity-nodeport-` (NodePorts,
//! keyed by `protocol . NodePort` without the destination: a NodePort answers on every NodePort
//! address, under `--nodeport-addresses all` on every local address, so a client's pin holds
//! whichever node address it connects to, as kube-proxy's does), and the same two for outside
//! traffic to this node's endpoints under `externalTrafficPolicy: Local` (`affinity-local-`,
//! `affinity-nodeport-local-`), whose endpoint list is not always a subset of the cluster-wide
//! one.
//!
//! IPv6 pins are keyed by two 32-bit `jhash`es of the client and service key (see
//! [`HashInput`] for why); two clients that collide on all 64 bits share a pin, which the
//! endpoints map still checks belongs to the service port.
//!
//! Endpoint changes are element changes only, as without affinity: the pick map renumbers, the
//! pins hold addresses and are untouched, so a pinned client stays on its endpoint whatever
//! else comes and goes. Only a new `k` or timeout needs a (small, shared) chain. A service port
//! turns affinity on or off by moving its elements.
//!
//! Two endpoints of one service port at the same address (different ports, possible only
//! across EndpointSlices) are one endpoint here, the first in sorted order: a pin is an
//! address.
//!
//! This runs after the main builder and rewrites what it produced for affinity services: a
//! `service-ips`/`external-picks`/`nodeport-picks` element that goes to
//! `pick-<k>`/`nodeport-pick-<k>`, and an `external-local-picks`/`nodeport-local-picks` element
//! that goes to `local-pick-<k>`/`nodeport-local-pick-<k>`, goes to the path's pick chain
//! instead, and its `k` endpoint elements move to the path's maps. Elements that go elsewhere
//! are left alone.
//!
//! Known difference from kube-proxy: the pin key holds the path (ClusterIP, external or LB
//! address, or NodePort; cluster-wide or Local-policy list), so a client's pins via the
//! ClusterIP and via the NodePort are independent.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use super::{Contested, Elements, chain, goto, set};
use crate::model::{ClusterState, IpFamily, ServicePortName};
use crate::ruleset::names;
use crate::ruleset::{
    Atom, Atoms, Comment, ElemData, Element, HashInput, KeyField, SetData, SetKind, Stmt, Table,
    Verdict,
};

/// The modulus a `pick` map's `typeof` names: only its type matters (a 32-bit integer); one
/// map serves every endpoint count, so no count is the true one.
const PICK_TYPEOF_MODULUS: u32 = 2;

/// Which traffic a set of affinity objects serves, and so what its keys hold.
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
    /// The prefix of the path's object names.
    fn prefix(self) -> &'static str {
        match self {
            Path::Address => names::AFFINITY,
            Path::NodePort => names::AFFINITY_NODEPORT,
            Path::AddressLocal => names::AFFINITY_LOCAL,
            Path::NodePortLocal => names::AFFINITY_NODEPORT_LOCAL,
        }
    }

    fn by_address(self) -> bool {
        matches!(self, Path::Address | Path::AddressLocal)
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

    /// The service key as the packet has it in the path's chains, whatever the destination
    /// address has been rewritten to.
    fn service_key(self) -> Vec<KeyField> {
        if self.by_address() {
            vec![KeyField::CtOrigDaddr, KeyField::L4Proto, KeyField::ThDport]
        } else {
            vec![KeyField::L4Proto, KeyField::ThDport]
        }
    }

    /// The service key's types, as the maps declare it.
    fn service_key_type(self) -> Vec<KeyField> {
        if self.by_address() {
            vec![KeyField::Daddr, KeyField::L4Proto, KeyField::ThDport]
        } else {
            vec![KeyField::L4Proto, KeyField::ThDport]
        }
    }

    /// `service key . endpoint address`: the `endpoints` map's key, looked up once the
    /// destination address holds the endpoint.
    fn endpoint_key(self) -> Vec<KeyField> {
        let mut key = self.service_key();
        key.push(KeyField::Daddr);
        key
    }

    fn pick_key(self, k: usize) -> Vec<KeyField> {
        let mut key = self.service_key();
        key.push(KeyField::Numgen {
            modulus: u32::try_from(k).unwrap_or(u32::MAX),
        });
        key
    }

    fn hash_input(self) -> HashInput {
        if self.by_address() {
            HashInput::ClientServiceAddress
        } else {
            HashInput::ClientNodePort
        }
    }

    /// The pin key: the client, then the service key; for IPv6 two hashes of them (see
    /// [`HashInput`]).
    fn pin_key(self, family: IpFamily) -> Vec<KeyField> {
        match family {
            IpFamily::V4 => {
                let mut key = vec![KeyField::Saddr];
                key.extend(self.service_key());
                key
            }
            IpFamily::V6 => [1, 2]
                .map(|seed| KeyField::Jhash {
                    input: self.hash_input(),
                    seed,
                })
                .to_vec(),
        }
    }

    /// The pins map's declared key: plain types for IPv4; for IPv6's hashes `typeof numgen …`,
    /// the 32-bit integer type nft 1.0.6 can both declare and list (`typeof jhash …` loads, but
    /// `nft list` then crashes).
    fn pin_key_type(self, family: IpFamily) -> (Vec<KeyField>, bool) {
        match family {
            IpFamily::V4 => {
                let mut key = vec![KeyField::Saddr];
                key.extend(self.service_key_type());
                (key, false)
            }
            IpFamily::V6 => (vec![KeyField::Numgen { modulus: 2 }; 2], true),
        }
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
        if matches!(self, Path::AddressLocal | Path::NodePortLocal) {
            "local endpoint"
        } else {
            "endpoint"
        }
    }

    fn pins_map(self) -> String {
        names::affinity_pins(self.prefix())
    }

    fn endpoints_map(self) -> String {
        names::affinity_endpoints(self.prefix())
    }

    fn pick_map(self) -> String {
        names::affinity_pick(self.prefix())
    }

    fn pinned_chain(self, timeout: u32) -> String {
        names::affinity_pinned_chain(self.prefix(), timeout)
    }

    fn pick_chain(self, timeout: u32, k: usize) -> String {
        names::affinity_pick_chain(self.prefix(), timeout, k)
    }
}

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

/// Removes and returns the elements of map `name` whose key is one of `prefixes` plus an index.
fn take_endpoints(table: &mut Table, name: &str, prefixes: &BTreeSet<Atoms>) -> Vec<Element> {
    let Some(map) = table.sets.iter_mut().find(|s| s.name == name) else {
        return Vec::new();
    };
    let (taken, kept): (Vec<Element>, Vec<Element>) = std::mem::take(&mut map.elements)
        .into_iter()
        .partition(|e| {
            e.key
                .atoms()
                .split_last()
                .is_some_and(|(_, prefix)| prefixes.contains(&Atoms::new(prefix)))
        });
    map.elements = kept;
    taken
}

/// The endpoint elements of one key prefix of a pick map, with their indices there, by map and
/// key prefix.
type Found = BTreeMap<(String, Atoms), Vec<(u32, Element)>>;

/// One dispatch element of an affinity service port, found in pass 1.
struct Job {
    /// Where the element is: index of its map in `table.sets`, and in the map's elements.
    set: usize,
    elem: usize,
    path: Path,
    timeout: u32,
    /// The `pick` map its endpoints are in, under the element's key (which is also the
    /// service key of the path's maps).
    from_map: String,
    key: Atoms,
}

/// The elements of one path's maps, and the chains they need.
#[derive(Default)]
struct PathObjects {
    endpoints: Elements,
    picks: Elements,
    /// `(timeout, k)` of the pick chains in use.
    chains: BTreeSet<(u32, usize)>,
}

/// Rewrites `table` for the services with ClientIP affinity (the Services of a key claimed
/// twice in its maps go into `contested`).
pub(super) fn add(state: &ClusterState, table: &mut Table, contested: &mut Contested) {
    // Looked up among the Services with affinity, usually few: a search of every Service per
    // dispatch element was a tenth of the build's instructions at 50k Services.
    let timeouts: BTreeMap<&crate::model::ServiceName, u32> = state
        .services
        .values()
        .filter_map(|s| Some((&s.name, s.session_affinity_timeout?)))
        .collect();
    let timeout_of = |origin: &Option<Arc<ServicePortName>>| {
        origin
            .as_ref()
            .and_then(|o| timeouts.get(&o.service))
            .copied()
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
    let mut wanted: BTreeMap<String, BTreeSet<Atoms>> = BTreeMap::new();
    for job in &jobs {
        wanted
            .entry(job.from_map.clone())
            .or_default()
            .insert(job.key.clone());
    }
    let mut found = Found::new();
    for (map, prefixes) in &wanted {
        for ep in take_endpoints(table, map, prefixes) {
            let key = ep.key.atoms();
            let Some((Atom::Int(index), prefix)) = key.split_last() else {
                continue;
            };
            let (index, prefix) = (*index, Atoms::new(prefix));
            found
                .entry((map.clone(), prefix))
                .or_default()
                .push((index, ep));
        }
    }

    // Pass 3: each job's elements in its path's maps, and its dispatch verdict.
    let mut paths: BTreeMap<Path, PathObjects> = BTreeMap::new();
    let mut verdicts = Vec::new();
    for job in jobs {
        // Two dispatch elements may share endpoints (an external IP that repeats the
        // ClusterIP): each gets its own copy.
        let Some(mut eps) = found.get(&(job.from_map.clone(), job.key.clone())).cloned() else {
            continue;
        };
        // Sorted endpoint order, as the pick map numbered them.
        eps.sort_by_key(|(index, _)| *index);
        let mut seen = BTreeSet::new();
        let eps: Vec<(IpAddr, Element)> = eps
            .into_iter()
            .filter_map(|(_, e)| match &e.data {
                Some(ElemData::Value(v)) => match *v.atoms() {
                    [Atom::Addr(a), Atom::Port(_)] => Some((a, e)),
                    _ => None,
                },
                _ => None,
            })
            .filter(|(addr, _)| seen.insert(*addr))
            .collect();
        if eps.is_empty() {
            continue;
        }
        let k = eps.len();
        // The pick maps' elements carry no comment (their dispatch element names the Service),
        // but these maps' keys end in an endpoint address or an index, which `nodeproxy diff`
        // does not take apart: they keep the Service port's comment, made once per job.
        let comment: Option<Comment> = eps
            .iter()
            .find_map(|(_, e)| e.label())
            .filter(|c| !c.is_empty());
        let objects = paths.entry(job.path).or_default();
        for (index, (addr, ep)) in eps.into_iter().enumerate() {
            let with = |key: Atoms, data: Option<ElemData>| Element {
                key,
                data,
                comment: comment.clone(),
                origin: ep.origin.clone(),
            };
            let pick = job
                .key
                .then(Atom::Int(u32::try_from(index).unwrap_or(u32::MAX)));
            objects.picks.push(with(
                pick,
                Some(ElemData::Value(Atoms::new(&[Atom::Addr(addr)]))),
            ));
            let endpoint = job.key.then(Atom::Addr(addr));
            objects.endpoints.push(with(endpoint, ep.data.clone()));
        }
        objects.chains.insert((job.timeout, k));
        verdicts.push((job.set, job.elem, job.path.pick_chain(job.timeout, k)));
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
    for (path, objects) in paths {
        objects.add_to(path, table, contested);
    }
}

impl PathObjects {
    /// The path's maps with their elements, and its chains.
    fn add_to(self, path: Path, table: &mut Table, contested: &mut Contested) {
        let family = table.family;
        let what = path.what();
        let traffic = path.traffic();
        let eps = path.endpoints();
        let (pin_type, pin_typeof) = path.pin_key_type(family);
        let mut pins = set(
            &path.pins_map(),
            &format!("client . {what} to the {eps} it is pinned to"),
            pin_type,
            Some(SetData::Value(vec![KeyField::Daddr])),
            Vec::new(),
            contested,
        );
        pins.kind = SetKind::Dynamic;
        pins.typeof_ = pin_typeof;
        table.sets.push(pins);
        let mut endpoint_type = path.service_key_type();
        endpoint_type.push(KeyField::Daddr);
        table.sets.push(set(
            &path.endpoints_map(),
            &format!("{what} . {eps} address to the {eps} (ClientIP affinity)"),
            endpoint_type,
            Some(SetData::Value(vec![KeyField::Daddr, KeyField::ThDport])),
            self.endpoints,
            contested,
        ));
        let mut pick_type = path.service_key_type();
        pick_type.push(KeyField::Numgen {
            modulus: PICK_TYPEOF_MODULUS,
        });
        let mut pick = set(
            &path.pick_map(),
            &format!("{what} . index to an {eps} address (ClientIP affinity)"),
            pick_type,
            Some(SetData::Value(vec![KeyField::Daddr])),
            self.picks,
            contested,
        );
        pick.typeof_ = true;
        table.sets.push(pick);

        let pin_key = path.pin_key(family);
        let timeouts: BTreeSet<u32> = self.chains.iter().map(|(t, _)| *t).collect();
        let update = |timeout: u32| Stmt::UpdateSet {
            key: pin_key.clone(),
            set: path.pins_map(),
            timeout_secs: timeout,
            data: Some(KeyField::Daddr),
        };
        let dnat = || Stmt::DnatMap {
            key: path.endpoint_key(),
            map: path.endpoints_map(),
        };
        for &timeout in &timeouts {
            table.chains.push(chain(
                &path.pinned_chain(timeout),
                &format!(
                    "{traffic}ClientIP affinity: refresh the pin ({timeout}s), DNAT to its {eps} \
                     if still there, else drop it"
                ),
                None,
                vec![
                    vec![update(timeout)],
                    vec![dnat()],
                    vec![Stmt::DeleteFromSet {
                        key: pin_key.clone(),
                        set: path.pins_map(),
                        data: Some(KeyField::Daddr),
                    }],
                ],
            ));
        }
        for &(timeout, k) in &self.chains {
            table.chains.push(chain(
                &path.pick_chain(timeout, k),
                &format!(
                    "{traffic}ClientIP affinity, {k} {eps}s: the pinned one, else one at random, \
                     pinned {timeout}s"
                ),
                None,
                vec![
                    vec![
                        Stmt::DaddrFromMap {
                            key: pin_key.clone(),
                            map: path.pins_map(),
                        },
                        Stmt::Verdict(Verdict::Jump(path.pinned_chain(timeout).into())),
                    ],
                    vec![Stmt::DaddrFromMap {
                        key: path.pick_key(k),
                        map: path.pick_map(),
                    }],
                    // Own rules: a full pins map must not stop the DNAT.
                    vec![update(timeout)],
                    vec![dnat()],
                    // Reached only without a DNAT: the service address goes back.
                    vec![Stmt::DaddrRestore],
                ],
            ));
        }
    }
}

/// Removes `pick-<k>`, `local-pick-<k>`, `nodeport-pick-<k>` and `nodeport-local-pick-<k>`
/// chains and maps that affinity emptied and nothing
/// references any more, so the table shows only what is in use.
fn drop_unused_picks(table: &mut Table) {
    let referenced: BTreeSet<Arc<str>> = table
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
        if empty && !referenced.contains(c.name.as_str()) {
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
