//! The incremental sync: after a few Services changed, rebuild only those, and patch the applied
//! tables with the difference between their old and new elements, so that a sync costs what
//! changed rather than what the cluster holds (a full build and diff at 10k Services takes
//! ~300 ms; the kernel's part of a one-Service change is a fraction of a millisecond).
//!
//! The result must be exactly what a full build of the whole state would give, so every case
//! where a Service's elements or the table's objects depend on more than the changed Services
//! goes to the full path instead (`Incremental::NeedsFull`):
//!
//! - settings or the Nodes differ from the last full sync (they shape everything);
//! - a changed Service shares an element key with another one (a contested key: which element
//!   the full build keeps depends on both, see `finish` in `ruleset/build.rs`), or a rebuilt
//!   Service claims a key that another Service holds;
//! - the rebuilt Services need a chain or set that the table does not hold yet (a new endpoint
//!   count `k` needs its `pick-<k>` objects), or leave one unused that the full build would
//!   therefore leave out;
//! - a hash set's element count would leave the margin of its size (`ruleset::hash_set_size`):
//!   a new size is a new set, which the full path's diff recreates with its rules.
//!
//! The last rule relies on how the builder decides which objects exist beyond the fixed ones
//! (built from the Nodes and settings alone): exactly those reachable, through chain rules,
//! from a chain that some element's verdict goes to (`pick_objects` builds a `pick-<k>` chain
//! and map for each endpoint count a verdict goes to; `affinity::drop_unused_picks` removes those
//! that affinity left without a reference; affinity builds a pick chain per timeout and
//! endpoint count a verdict goes to, and the maps and pinned chain those use). Keeping a count of verdicts per chain and, per object, of the referenced
//! chains it is reachable from makes the check cost what changed.
//!
//! The changed Services' current elements are found through `index.rs`: per origin, the runs
//! of neighbouring keys it holds in each set, recorded after each full sync and kept up to
//! date by each change sync. A walk over every applied element instead cost ~2.5 ms of a
//! two-slice sync at 10k Services × 10 endpoints and ~22 ms at 50k × 5. The rebuilt chains are
//! compared with the last full build's before lowering (`BuiltChains`), so only sets are
//! lowered. The whole two-slice sync now takes 0.11 ms and 0.14 ms of user-space time
//! (`benches/ruleset.rs`, `two slices changed/incremental sync`; docs/performance.md).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use super::{SyncOutcome, Syncer, without};
use crate::model::{ClusterState, IpFamily, Node, Protocol, Service, ServiceName, ServicePortName};
use crate::nft::{self, ElemBytes, Kernel, NftError, WireElem, WireSet, WireTable};
use crate::ruleset::{self, Contested, Settings};

/// What an incremental attempt did.
#[derive(Debug)]
pub enum Incremental {
    /// Applied; the kernel now holds what a full build of the whole current state would produce.
    Done(Box<SyncOutcome>),
    /// Could not be done incrementally (reason for the debug log); call `sync` with the full state.
    NeedsFull(&'static str),
}

mod baseline;
mod index;

use baseline::*;
pub(super) use baseline::{Baseline, BuiltChains};
#[cfg(test)]
pub(super) use index::SLACK;
use index::{OriginAddr, address};

/// (set name, key, element).
type Entry = (String, ElemBytes, WireElem);

/// The elements of the changed Services in one family's table, before and after.
struct Delta {
    family: IpFamily,
    /// As applied now.
    old: Vec<Entry>,
    /// As rebuilt.
    new: Vec<Entry>,
    /// Changes of verdict counts per chain, and of support per object.
    verdicts: HashMap<String, i64>,
    support: HashMap<Object, i64>,
}

impl<K: Kernel> Syncer<K> {
    /// Brings the kernel up to date after the Services in `changed` (and/or their EndpointSlices)
    /// changed. `scoped` is `full_state.subset(changed)` (see `ClusterState::subset` in
    /// src/model/mod.rs): the current versions of the changed Services that still exist, all their
    /// slices, and the Nodes. A name in `changed` absent from `scoped.services` was deleted.
    pub fn sync_changed(
        &mut self,
        scoped: &ClusterState,
        changed: &BTreeSet<ServiceName>,
        settings: &Settings,
    ) -> Result<Incremental, NftError> {
        let started = Instant::now();
        self.digests.clear();
        let mut outcome = SyncOutcome::default();
        let (deltas, released) = match self.prepare(scoped, changed, settings, &mut outcome) {
            Ok(prepared) => prepared,
            Err(reason) => return Ok(Incremental::NeedsFull(reason)),
        };

        let rep = &mut outcome.report;
        for delta in &deltas {
            let Some(Some(have)) = self.applied.get(&delta.family) else {
                return Ok(Incremental::NeedsFull("the kernel's table is unknown"));
            };
            let t = Instant::now();
            // Two tables holding only the touched sets, with the changed Services' elements
            // before and after: their diff is the element operations of a full diff, with the
            // same replacement semantics (a changed element is deleted and added again).
            let part = |entries: &[Entry]| {
                let mut t = WireTable::new(have.family, &have.name);
                t.userdata = have.userdata.clone();
                t.flags = have.flags;
                for (name, _, _) in delta.old.iter().chain(&delta.new) {
                    if !t.sets.contains_key(name)
                        && let Some(def) = have.sets.get(name)
                    {
                        t.add_set(name, definition(def));
                    }
                }
                for (name, key, elem) in entries {
                    if let Some(set) = t.sets.get_mut(name) {
                        set.elements.insert(key.clone(), elem.clone());
                    }
                }
                t
            };
            let (before, after) = (part(&delta.old), part(&delta.new));
            rep.diff += t.elapsed();
            match nft::apply_diff(&mut self.kernel, Some(&before), &after, rep) {
                Ok(None) => {}
                Ok(Some(st)) => self.continue_generation_chain(st.generation),
                Err(e) => {
                    // A family applied before this one is patched in the kernel but not in
                    // memory: forget both, so that the full path reads the kernel back.
                    self.applied.clear();
                    self.baseline = None;
                    self.trusted_generation = None;
                    return match e {
                        NftError::Rejected { errors } => {
                            self.note_rejected(&errors);
                            tracing::debug!(
                                "incremental sync rejected ({} error(s)); falling back to a full \
                                 sync",
                                errors.len()
                            );
                            Ok(Incremental::NeedsFull(
                                "the kernel rejected the transaction",
                            ))
                        }
                        other => Err(other),
                    };
                }
            }
        }

        self.commit(deltas, changed);
        if let Some(base) = self.baseline.as_mut() {
            base.reclaim(scoped, changed);
        }
        for name in released {
            self.release(&name, scoped.services.contains_key(&name));
        }
        outcome.quarantined = self.quarantined();
        self.report_quarantine_changes(&mut outcome);
        outcome.duration = started.elapsed();
        Ok(Incremental::Done(Box::new(outcome)))
    }

    /// Everything up to the kernel: the checks, the rebuild, and the element changes per
    /// family, plus the quarantined Services this sync releases. `Err` is the reason to fall
    /// back to the full path.
    fn prepare(
        &self,
        scoped: &ClusterState,
        changed: &BTreeSet<ServiceName>,
        settings: &Settings,
        outcome: &mut SyncOutcome,
    ) -> Result<(Vec<Delta>, Vec<ServiceName>), &'static str> {
        let Some(base) = &self.baseline else {
            return Err("no full sync has succeeded since the start or the last failure");
        };
        if IpFamily::ALL
            .iter()
            .any(|f| !matches!(self.applied.get(f), Some(Some(_))))
        {
            return Err("the kernel's table is unknown");
        }
        if base.settings != *settings {
            return Err("the settings changed");
        }
        if base.nodes != scoped.nodes {
            return Err("the Node changed");
        }
        if scoped.services.keys().any(|n| !changed.contains(n))
            || scoped
                .slices
                .values()
                .any(|s| !changed.contains(&s.service))
        {
            return Err("the scoped state holds Services that are not marked changed");
        }
        if changed.iter().any(|n| base.contested.contains(n)) {
            return Err(
                "a changed Service's elements depend on other Services (a contested key, or a \
                 map that no verdict reaches)",
            );
        }

        for (name, svc) in &scoped.services {
            let shared = claim_keys(svc).into_iter().any(|key| {
                base.claims.get(&key).is_some_and(|holders| {
                    holders.iter().any(|h| h != name && !changed.contains(h))
                })
            });
            if shared {
                return Err(
                    "a changed Service claims an address, protocol and port (or a NodePort) that \
                     another Service holds",
                );
            }
        }

        // Quarantine: a changed quarantined Service gets another chance, as in `sync`; one
        // whose objects did not change stays out.
        let mut released = Vec::new();
        let mut held = BTreeSet::new();
        for name in changed {
            if let Some(q) = self.quarantine.get(name) {
                if q.unchanged(name, scoped) {
                    held.insert(name);
                } else {
                    released.push(name.clone());
                }
            }
        }
        let effective = if held.is_empty() {
            Cow::Borrowed(scoped)
        } else {
            Cow::Owned(without(scoped, |n| held.contains(n)))
        };

        let t = Instant::now();
        let (desired, contested) = ruleset::build_noting_contested(&effective, settings);
        if !contested.is_empty() {
            return Err("changed Services claim the same element key");
        }
        let mut wanted = Vec::with_capacity(desired.tables.len());
        for mut table in desired.tables {
            if !base.chains.hold_all(&table) {
                return Err("a rebuilt Service needs a chain that is not in the table");
            }
            // Equal to chains the table holds: only the sets need lowering and comparing.
            table.chains.clear();
            // The full path reports what cannot be lowered, with the Service it belongs to.
            wanted.push(nft::lower_owned(table).map_err(|_| "a rebuilt object cannot be lowered")?);
        }
        outcome.report.lower += t.elapsed();

        let t = Instant::now();
        let ours: Vec<OriginAddr> = changed
            .iter()
            .flat_map(|n| base.origins_of(n))
            .map(address)
            .collect();
        let mut deltas = Vec::with_capacity(wanted.len());
        for want in wanted {
            let family = want.family;
            let (Some(Some(have)), Some(layout)) =
                (self.applied.get(&family), base.families.get(&family))
            else {
                return Err("the kernel's table is unknown");
            };
            let old = Old {
                index: &base.index,
                origins: &ours,
            };
            deltas.push(delta(have, want, layout, changed, &old)?);
        }
        outcome.report.diff += t.elapsed();
        Ok((deltas, released))
    }

    /// Patches the applied tables, the origins and the counts after the kernel took the deltas.
    fn commit(&mut self, deltas: Vec<Delta>, changed: &BTreeSet<ServiceName>) {
        let Some(base) = self.baseline.as_mut() else {
            return;
        };
        for name in changed {
            for origin in base.take_origins(name) {
                base.index.remove(address(&origin));
            }
        }
        for delta in deltas {
            let (Some(Some(have)), Some(layout)) = (
                self.applied.get_mut(&delta.family),
                base.families.get_mut(&delta.family),
            ) else {
                continue;
            };
            for (name, key, _) in &delta.old {
                if let Some(set) = have.sets.get_mut(name) {
                    set.elements.remove(key);
                }
            }
            base.index.add_elements(
                delta.family,
                delta.new.iter().map(|(n, k, e)| (n.as_str(), &k[..], e)),
            );
            for (name, key, elem) in delta.new {
                if let Some(origin) = &elem.origin {
                    add_origin(&mut base.held, origin);
                }
                if let Some(set) = have.sets.get_mut(&name) {
                    set.elements.insert(key, elem);
                }
            }
            for (chain, change) in delta.verdicts {
                let n = layout.verdicts.entry(chain).or_default();
                *n = usize::try_from(*n as i64 + change).unwrap_or(0);
            }
            for (o, change) in delta.support {
                let n = layout.support.entry(o).or_default();
                *n = usize::try_from(*n as i64 + change).unwrap_or(0);
            }
        }
    }
}

/// The element changes that turn `have` into what a full build gives, from `want`, the rebuild
/// of the `changed` Services; `Err` says why that cannot be done without a full build.
fn delta(
    have: &WireTable,
    mut want: WireTable,
    layout: &Layout,
    changed: &BTreeSet<ServiceName>,
    old: &Old<'_>,
) -> Result<Delta, &'static str> {
    if want.name != have.name || want.userdata != have.userdata || want.flags != have.flags {
        return Err("the table itself changed");
    }
    // Lowering sized the rebuilt sets for the changed Services' elements alone: a change sync
    // keeps the sizes the kernel holds, and the check below sends it to the full path when the
    // result would leave a size's margin.
    for (name, set) in &mut want.sets {
        if let Some(held) = have.sets.get(name) {
            set.size = held.size;
        }
    }
    // The chains were compared before lowering (`BuiltChains::hold_all`).
    for (name, set) in &want.sets {
        if !have.sets.get(name).is_some_and(|h| h.same_definition(set)) {
            return Err("a rebuilt Service needs a set that is not in the table");
        }
    }

    let mut delta = Delta {
        family: want.family,
        old: Vec::new(),
        new: Vec::new(),
        verdicts: HashMap::new(),
        support: HashMap::new(),
    };
    let mut unowned: BTreeMap<String, BTreeMap<ElemBytes, WireElem>> = BTreeMap::new();
    for (name, set) in want.sets {
        if set.is_dynamic() {
            continue;
        }
        let applied_set = have.sets.get(&name);
        for (key, elem) in set.elements {
            if elem.origin.is_none() {
                unowned.entry(name.clone()).or_default().insert(key, elem);
                continue;
            }
            // The key must be free, or held by one of the changed Services.
            if let Some(holder) = applied_set.and_then(|s| s.elements.get(&key))
                && !holder
                    .origin
                    .as_ref()
                    .is_some_and(|o| changed.contains(&o.service))
            {
                return Err("a rebuilt Service claims an element key another one holds");
            }
            count(&mut delta.verdicts, &elem, 1);
            delta.new.push((name.clone(), key, elem));
        }
    }
    if unowned != layout.unowned {
        return Err("elements not built for a Service differ from the full build");
    }

    // The changed Services' elements as applied, found through the index by their origins.
    for origin in old.origins {
        old.index
            .elements_of(have.family, have, *origin, |name, key, elem| {
                count(&mut delta.verdicts, elem, -1);
                delta.old.push((name.to_owned(), key.into(), elem.clone()));
            });
    }

    // Objects beyond the fixed ones exist exactly while a chain with verdicts going to it
    // reaches them; the rebuilt Services must not leave one unreached.
    for (chain, change) in &delta.verdicts {
        let before = layout.verdicts.get(chain).copied().unwrap_or(0) as i64;
        let after = before + change;
        if after < 0 {
            return Err("the verdict counts are out of date");
        }
        let step = match (before > 0, after > 0) {
            (false, true) => 1,
            (true, false) => -1,
            _ => continue,
        };
        for o in layout.reach.get(chain).into_iter().flatten() {
            *delta.support.entry(o.clone()).or_default() += step;
        }
    }
    for (o, change) in &delta.support {
        let before = layout.support.get(o).copied().unwrap_or(0) as i64;
        if before > 0 && before + change <= 0 {
            return Err("an object would be left unused, which only a full build removes");
        }
    }
    if leaves_size_margin(have, &delta) {
        return Err(
            "a set's element count leaves the margin of its size, which only a full \
             sync changes (a new size is a new set)",
        );
    }
    Ok(delta)
}

/// Whether a hash set of `have` would, after `delta`, hold a count of elements for which
/// `hash_set_size` chooses another size than the one it has (also when it would overflow it:
/// the kernel would refuse the adds with ENFILE).
fn leaves_size_margin(have: &WireTable, delta: &Delta) -> bool {
    let mut change: HashMap<&str, i64> = HashMap::new();
    for (name, _, _) in &delta.old {
        *change.entry(name.as_str()).or_default() -= 1;
    }
    for (name, _, _) in &delta.new {
        *change.entry(name.as_str()).or_default() += 1;
    }
    change.into_iter().any(|(name, change)| {
        have.sets.get(name).is_some_and(|set| {
            let after = usize::try_from(set.elements.len() as i64 + change).unwrap_or(0);
            set.is_plain_hash() && ruleset::hash_set_size(after, set.size) != set.size
        })
    })
}

/// The changed Services' applied elements: their origins, and where those are.
struct Old<'a> {
    index: &'a index::ElementIndex,
    origins: &'a [OriginAddr],
}

/// Counts the verdict of `elem` (if it has one) as `change` references to its chain.
fn count(verdicts: &mut HashMap<String, i64>, elem: &WireElem, change: i64) {
    if let Some(chain) = elem.chain() {
        match verdicts.get_mut(chain) {
            Some(n) => *n += change,
            None => {
                verdicts.insert(chain.to_owned(), change);
            }
        }
    }
}

/// A set's definition without its elements.
fn definition(set: &WireSet) -> WireSet {
    WireSet {
        flags: set.flags,
        key_type: set.key_type,
        key_len: set.key_len,
        data_type: set.data_type,
        data_len: set.data_len,
        userdata: set.userdata.clone(),
        concat: set.concat.clone(),
        size: set.size,
        elements: BTreeMap::new(),
    }
}
