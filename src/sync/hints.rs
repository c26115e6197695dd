//! Recovers ClientIP-affinity slots ([`Hints`]) from our tables as the kernel holds them or as
//! last applied, so that a rebuild keeps every pinned client on its endpoint: the kernel's bytes
//! are decoded here, and the builder gets plain assignments.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use crate::model::{ServiceName, ServicePortName};
use crate::nft::wire::{WireData, WireTable, decode_atoms};
use crate::ruleset::build::ServiceKey;
use crate::ruleset::build::affinity::SlotMap;
use crate::ruleset::{Atom, Hints};

/// The assignments held by `tables`: every element of every slot endpoint map
/// (`affinity-slot-<i>-endpoints`, `affinity-nodeport-slot-<i>-endpoints`,
/// `affinity-local-slot-<i>-endpoints`, `affinity-nodeport-local-slot-<i>-endpoints`).
pub fn affinity_hints(tables: &[&WireTable]) -> Hints {
    decode(tables, |_| true)
}

/// Like [`affinity_hints`], only for the elements built for `services` (by the elements'
/// origin; elements without one, as read back from the kernel, are all kept): what a build of
/// part of the state (`ClusterState::subset`) needs.
pub fn affinity_hints_for(tables: &[&WireTable], services: &BTreeSet<ServiceName>) -> Hints {
    decode(tables, |origin| {
        origin.is_none_or(|o| services.contains(&o.service))
    })
}

fn decode(tables: &[&WireTable], keep: impl Fn(Option<&ServicePortName>) -> bool) -> Hints {
    let mut hints = Hints::default();
    for table in tables {
        for (name, set) in &table.sets {
            let Some(map) = SlotMap::of(name) else {
                continue;
            };
            for (key, elem) in &set.elements {
                if !keep(elem.origin.as_deref()) {
                    continue;
                }
                let Some(WireData::Value(data)) = &elem.data else {
                    continue;
                };
                let key = decode_atoms(table.family, &map.key, key);
                let data = decode_atoms(table.family, &SlotMap::DATA, data);
                let (Some(key), Some(data)) = (key, data) else {
                    continue;
                };
                let (Some(key), [Atom::Addr(addr), Atom::Port(port)]) =
                    (ServiceKey::from_atoms(&key, map.local), data.as_slice())
                else {
                    continue;
                };
                hints.insert(key, SocketAddr::new(*addr, *port), map.slot);
            }
        }
    }
    hints
}
