//! `sessionAffinity: ClientIP`: every new connection from a client to a service port goes to
//! the endpoint the client's previous connection went to, as long as that was less than the
//! affinity timeout ago (refreshed by each new connection).
//!
//! kube-proxy keeps one dynamic set and one chain per endpoint. Here nothing is per service:
//! endpoints are numbered by slot (the same sorted order `pick-<k>` uses), and
//!
//! - `affinity-slot-<i>` (dynamic, timeout) holds `client . service address . protocol . port`
//!   for clients pinned to slot `i`; the packet path writes it (`update`), nodeproxy only declares
//!   it, so a restart or resync keeps the pins;
//! - `affinity-slot-<i>-endpoints` maps `service address . protocol . port` to the endpoint in
//!   slot `i` of every service with affinity;
//! - `affinity-<T>s-slot-<i>` (one per timeout `T` in use and slot): pin the client to slot `i`
//!   for `T` seconds, then DNAT to the slot's endpoint;
//! - `affinity-<T>s-pick-<k>` (one per timeout and endpoint count in use): go to the client's
//!   pinned slot if it has one, else pick a slot uniformly at random (a cascade of
//!   `numgen random mod (k-i)` rules, `i`-th taken with probability 1/(k-i), so each slot with 1/k;
//!   no anonymous set);
//! - `nodeport-affinity-<T>s-pick-<k>`: the same for NodePorts, after marking for masquerade.
//!
//! A service port turns affinity on or off by moving its elements (`service-ips` verdict, its
//! endpoints between `pick-<k>-endpoints` and the slot maps): data only, no rule changes, unless a
//! new timeout or endpoint count needs its static chains. The per-element timeout is carried by
//! the `update` statement of the slot chain, hence chains per timeout value in use.
//!
//! This runs after the main builder and rewrites what it produced for affinity services: a
//! `service-ips`/`external-picks`/`nodeport-picks` element that goes to `pick-<k>`/`nodeport-pick-<k>` goes to
//! the affinity chains instead, and its `k` endpoint elements move to the slot maps. Elements that
//! go elsewhere are left alone.
//!
//! Known difference from kube-proxy: pins are per slot, so when a service's endpoint list
//! changes, clients pinned to a slot whose endpoint changed follow the slot (kube-proxy pins to
//! the endpoint). The key holds the destination (ClusterIP or node address and NodePort), so a
//! client's pins via the ClusterIP and via a NodePort are independent.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::{Elements, Settings, chain, goto, set};
use crate::model::{ClusterState, IpFamily, ServicePortName};
use crate::ruleset::names;
use crate::ruleset::{Atom, ElemData, Element, KeyField, SetData, SetKind, Stmt, Table, Verdict};

/// `client . service address . protocol . port`: the key of the pins.
fn pin_key() -> Vec<KeyField> {
    vec![
        KeyField::Saddr,
        KeyField::Daddr,
        KeyField::L4Proto,
        KeyField::ThDport,
    ]
}

fn service_key() -> Vec<KeyField> {
    vec![KeyField::Daddr, KeyField::L4Proto, KeyField::ThDport]
}

/// The endpoint count `k` of a `goto <prefix><k>` verdict.
fn pick_count(data: &Option<ElemData>, prefix: &str) -> Option<usize> {
    match data {
        Some(ElemData::Verdict(Verdict::Goto(chain))) => chain.strip_prefix(prefix)?.parse().ok(),
        _ => None,
    }
}

/// Removes and returns the elements of map `name` whose key is one of `prefixes` plus a slot.
fn take_endpoints(
    table: &mut Table,
    name: &str,
    prefixes: &BTreeMap<Vec<Atom>, Vec<Vec<Atom>>>,
) -> Vec<Element> {
    let Some(map) = table.sets.iter_mut().find(|s| s.name == name) else {
        return Vec::new();
    };
    let (taken, kept): (Vec<Element>, Vec<Element>) = std::mem::take(&mut map.elements)
        .into_iter()
        .partition(|e| {
            e.key
                .split_last()
                .is_some_and(|(_, prefix)| prefixes.contains_key(prefix))
        });
    map.elements = kept;
    taken
}

/// One affinity service port found in the dispatch maps.
struct Pinned {
    timeout: u32,
    k: usize,
}

/// Rewrites `table` for the services with ClientIP affinity.
pub(super) fn add(state: &ClusterState, settings: &Settings, family: IpFamily, table: &mut Table) {
    let _ = family;
    let timeout_of = |origin: &Option<Arc<ServicePortName>>| {
        origin
            .as_ref()
            .and_then(|o| state.services.get(&o.service))
            .and_then(|s| s.session_affinity_timeout)
    };
    let nodeport_addrs: Vec<Atom> = table
        .set(names::NODEPORT_IPS)
        .map(|s| {
            s.elements
                .iter()
                .filter_map(|e| e.key.first().copied())
                .collect()
        })
        .unwrap_or_default();

    // Pass 1: redirect dispatch elements, remembering which endpoints to move.
    let mut moves: Vec<(String, Vec<Atom>, Vec<Atom>)> = Vec::new();
    let mut used: BTreeSet<(u32, usize)> = BTreeSet::new();
    let mut nodeport_used: BTreeSet<(u32, usize)> = BTreeSet::new();
    for s in table.sets.iter_mut() {
        // The maps whose elements send a service port to its cluster-wide `pick-<k>`: ClusterIPs
        // in `service-ips`, external and LB IPs in `external-picks`, NodePorts in
        // `nodeport-picks` (Local-policy local endpoints are not pinned).
        let nodeport = s.name == names::NODEPORT_PICKS;
        if s.name != names::SERVICE_IPS && s.name != names::EXTERNAL_PICKS && !nodeport {
            continue;
        }
        for e in s.elements.iter_mut() {
            let Some(timeout) = timeout_of(&e.origin) else {
                continue;
            };
            let prefix = if nodeport { "nodeport-pick-" } else { "pick-" };
            let Some(k) = pick_count(&e.data, prefix) else {
                continue;
            };
            let pinned = Pinned { timeout, k };
            if nodeport {
                e.data = goto(names::nodeport_affinity_pick_chain(
                    pinned.timeout,
                    pinned.k,
                ));
                nodeport_used.insert((pinned.timeout, pinned.k));
                // NodePort traffic's destination is a NodePort address: one slot-map key per
                // address.
                for addr in &nodeport_addrs {
                    let mut svc_key = vec![*addr];
                    svc_key.extend_from_slice(&e.key);
                    moves.push((names::nodeport_pick_map(k), e.key.clone(), svc_key));
                }
            } else {
                e.data = goto(names::affinity_pick_chain(pinned.timeout, pinned.k));
                moves.push((names::pick_map(k), e.key.clone(), e.key.clone()));
            }
            used.insert((pinned.timeout, pinned.k));
        }
    }

    // Pass 2: move endpoints from the pick maps to the slot maps, one pass over each map (a
    // pass per service port would be quadratic at 10k services).
    let mut slots: BTreeMap<usize, Elements> = BTreeMap::new();
    let mut wanted: BTreeMap<String, BTreeMap<Vec<Atom>, Vec<Vec<Atom>>>> = BTreeMap::new();
    for (map, from_key, svc_key) in moves {
        wanted
            .entry(map)
            .or_default()
            .entry(from_key)
            .or_default()
            .push(svc_key);
    }
    for (map, prefixes) in &wanted {
        for ep in take_endpoints(table, map, prefixes) {
            let (Some(Atom::Int(slot)), Some(prefix)) = (ep.key.last(), ep.key.split_last()) else {
                continue;
            };
            let Some(svc_keys) = prefixes.get(prefix.1) else {
                continue;
            };
            for svc_key in svc_keys {
                slots.entry(*slot as usize).or_default().push(Element {
                    key: svc_key.clone(),
                    data: ep.data.clone(),
                    comment: ep.comment.clone(),
                    origin: ep.origin.clone(),
                });
            }
        }
    }
    drop_unused_picks(table);

    // Static objects: slot sets and maps up to the largest k, chains per timeout and k.
    let max_k = used
        .iter()
        .chain(&nodeport_used)
        .map(|(_, k)| *k)
        .max()
        .unwrap_or(0);
    for i in 0..max_k {
        let mut pins = set(
            &names::affinity_slot_set(i),
            &format!("client . service . protocol . port pinned to endpoint slot {i}"),
            pin_key(),
            None,
            Vec::new(),
        );
        pins.kind = SetKind::Dynamic;
        pins.typeof_ = true;
        table.sets.push(pins);
        table.sets.push(set(
            &names::affinity_slot_map(i),
            &format!("service . protocol . port to the endpoint in slot {i} (ClientIP affinity)"),
            service_key(),
            Some(SetData::Value(vec![KeyField::Daddr, KeyField::ThDport])),
            slots.remove(&i).unwrap_or_default(),
        ));
    }
    let mut slot_chains: BTreeMap<u32, usize> = BTreeMap::new();
    for &(timeout, k) in used.iter().chain(&nodeport_used) {
        let n = slot_chains.entry(timeout).or_default();
        *n = (*n).max(k);
    }
    for (&timeout, &n) in &slot_chains {
        for i in 0..n {
            table.chains.push(chain(
                &names::affinity_slot_chain(timeout, i),
                &format!("pin the client to endpoint slot {i} for {timeout}s, DNAT to it"),
                None,
                vec![
                    // A separate rule: a full pin set must not stop the DNAT.
                    vec![Stmt::UpdateSet {
                        key: pin_key(),
                        set: names::affinity_slot_set(i),
                        timeout_secs: timeout,
                    }],
                    vec![Stmt::DnatMap {
                        key: service_key(),
                        map: names::affinity_slot_map(i),
                    }],
                ],
            ));
        }
    }
    for &(timeout, k) in &used {
        table.chains.push(chain(
            &names::affinity_pick_chain(timeout, k),
            &format!(
                "ClientIP affinity, {k} endpoints: the client's pinned slot, else one at random"
            ),
            None,
            pick_rules(timeout, k),
        ));
    }
    for &(timeout, k) in &nodeport_used {
        // External traffic to a Cluster-policy service is always masqueraded (as nodeport-pick).
        table.chains.push(chain(
            &names::nodeport_affinity_pick_chain(timeout, k),
            &format!("masquerade NodePort traffic, then ClientIP affinity among {k} endpoints"),
            None,
            vec![vec![
                Stmt::MarkOr(settings.mark),
                Stmt::Verdict(Verdict::Goto(names::affinity_pick_chain(timeout, k))),
            ]],
        ));
        if !used.contains(&(timeout, k)) {
            table.chains.push(chain(
                &names::affinity_pick_chain(timeout, k),
                &format!(
                    "ClientIP affinity, {k} endpoints: the client's pinned slot, else one at random"
                ),
                None,
                pick_rules(timeout, k),
            ));
        }
    }
}

fn pick_rules(timeout: u32, k: usize) -> Vec<Vec<Stmt>> {
    let to_slot = |i: usize| Stmt::Verdict(Verdict::Goto(names::affinity_slot_chain(timeout, i)));
    let mut rules: Vec<Vec<Stmt>> = (0..k)
        .map(|i| {
            vec![
                Stmt::InSet {
                    key: pin_key(),
                    set: names::affinity_slot_set(i),
                },
                to_slot(i),
            ]
        })
        .collect();
    // Rule i is reached with probability (k-i)/k and taken with 1/(k-i): each slot gets 1/k.
    for i in 0..k.saturating_sub(1) {
        let modulus = u32::try_from(k - i).unwrap_or(u32::MAX);
        rules.push(vec![Stmt::RandomIs { modulus, value: 0 }, to_slot(i)]);
    }
    if k > 0 {
        rules.push(vec![to_slot(k - 1)]);
    }
    rules
}

/// Removes `pick-<k>`/`nodeport-pick-<k>` chains and maps that affinity emptied and nothing
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
        let map = if let Some(k) = c.name.strip_prefix("nodeport-pick-") {
            k.parse().ok().map(names::nodeport_pick_map)
        } else if let Some(k) = c.name.strip_prefix("pick-") {
            k.parse().ok().map(names::pick_map)
        } else {
            None
        };
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
