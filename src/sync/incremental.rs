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
//!   therefore leave out.
//!
//! The last rule relies on how the builder decides which objects exist beyond the fixed ones
//! (built from the Nodes and settings alone): exactly those reachable, through chain rules,
//! from a chain that some element's verdict goes to (`pick_objects` builds a `pick-<k>` chain
//! and map for each endpoint count a verdict goes to; `affinity::drop_unused_picks` removes those
//! that affinity left without a reference; affinity builds the slot objects its `affinity-…`
//! chains use). Keeping a count of verdicts per chain and, per object, of the referenced
//! chains it is reachable from makes the check cost what changed.
//!
//! The changed Services' current elements are found by one pass over the applied elements,
//! comparing each element's origin by address with those of the changed Services: ~3 ms of an
//! incremental sync at 10k Services × 10 endpoints (`benches/ruleset.rs`; the pass is bound by
//! memory, comparing names instead cost ~4 ms). An index from Service to element keys made the
//! pass unnecessary (~0.2 ms per sync), but building it after each full sync cost ~30 ms
//! (145k keys copied into 10k buffers) and 2.7 MB; recording the origins per Service and the
//! counts costs ~15 ms of a ~265 ms full sync.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::Instant;

use super::{SyncOutcome, Syncer, without};
use crate::model::{ClusterState, IpFamily, Node, Protocol, Service, ServiceName, ServicePortName};
use crate::nft::{self, Kernel, NftError, WireElem, WireSet, WireTable};
use crate::ruleset::{self, Contested, Settings};

/// What an incremental attempt did.
#[derive(Debug)]
pub enum Incremental {
    /// Applied; the kernel now holds what a full build of the whole current state would produce.
    Done(SyncOutcome),
    /// Could not be done incrementally (reason for the debug log); call `sync` with the full state.
    NeedsFull(&'static str),
}

/// A chain or a set of our table.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Object {
    Chain(String),
    Set(String),
}

/// What the incremental path knows about the last full sync beyond the applied tables.
pub(super) struct Baseline {
    settings: Settings,
    nodes: BTreeMap<String, Node>,
    /// Services that the last full build shows cannot be rebuilt alone: those involved in a
    /// contested key, and those owning elements of an object that no verdict reaches.
    contested: Contested,
    families: BTreeMap<IpFamily, Layout>,
    /// The origins of each Service's applied elements (one per Service port and builder
    /// module; every element of a port shares it). Holding them keeps their addresses from
    /// being reused, so an element belongs to a Service exactly when its origin's address is
    /// one of these.
    origins: HashMap<ServiceName, Vec<Arc<ServicePortName>>>,
    /// Who claims each address . protocol . port and each NodePort, winner or not. A changed
    /// Service that claims one held by an unchanged Service takes the full path: which of
    /// them gets the key decides elements of the unchanged one too, possibly in other maps
    /// (found by fuzzing: an added Service taking an externalIP from a younger one left the
    /// younger one's elements in place).
    claims: HashMap<ClaimKey, BTreeSet<ServiceName>>,
}

/// An address . protocol . port, or a NodePort (no address), that a Service claims.
type ClaimKey = (Option<std::net::IpAddr>, Protocol, u16);

fn claim_keys(svc: &Service) -> Vec<ClaimKey> {
    let addrs = svc
        .cluster_ips
        .iter()
        .chain(&svc.external_ips)
        .chain(&svc.load_balancer_ips);
    let mut keys: Vec<ClaimKey> = addrs
        .flat_map(|a| {
            svc.ports
                .iter()
                .map(move |p| (Some(*a), p.protocol, p.port))
        })
        .collect();
    keys.extend(
        svc.ports
            .iter()
            .filter_map(|p| Some((None, p.protocol, p.node_port?))),
    );
    keys
}

/// How the objects of one applied table are used.
#[derive(Debug)]
struct Layout {
    /// Elements not built for a Service (the Node's addresses), by set: they never change
    /// without a Node or settings change.
    unowned: BTreeMap<String, BTreeMap<Box<[u8]>, WireElem>>,
    /// How many elements' verdicts go to each chain.
    verdicts: HashMap<String, usize>,
    /// Per chain: the objects beyond the fixed ones that its rules reach (itself included if it
    /// is not fixed).
    reach: HashMap<String, Vec<Object>>,
    /// Per object beyond the fixed ones: how many chains with verdicts going to them reach it.
    support: HashMap<Object, usize>,
}

impl Baseline {
    /// Records what the incremental path needs after a successful full sync of `applied`, built
    /// from `nodes` and `settings`. `None` when a table is unknown; then every incremental
    /// attempt goes to the full path.
    pub(super) fn new(
        applied: &BTreeMap<IpFamily, Option<WireTable>>,
        settings: &Settings,
        nodes: &BTreeMap<String, Node>,
        mut contested: Contested,
    ) -> Option<Baseline> {
        // The objects a build holds whatever the Services.
        let fixed_state = ClusterState {
            nodes: nodes.clone(),
            ..ClusterState::default()
        };
        let mut fixed: BTreeMap<IpFamily, BTreeSet<Object>> = BTreeMap::new();
        for table in ruleset::build(&fixed_state, settings).tables {
            let objects = fixed.entry(table.family).or_default();
            objects.extend(table.chains.iter().map(|c| Object::Chain(c.name.clone())));
            objects.extend(table.sets.iter().map(|s| Object::Set(s.name.clone())));
        }

        let mut families = BTreeMap::new();
        let mut origins: HashMap<ServiceName, Vec<Arc<ServicePortName>>> = HashMap::new();
        let mut seen: HashSet<*const ServicePortName, BuildHasherDefault<AddressHasher>> =
            HashSet::default();
        // A port's endpoints are neighbours in key order: most elements share the previous
        // element's origin.
        let mut last: *const ServicePortName = std::ptr::null();
        for family in IpFamily::ALL {
            let table = applied.get(&family)?.as_ref()?;
            let fixed = fixed.remove(&family).unwrap_or_default();
            let mut unowned: BTreeMap<String, BTreeMap<Box<[u8]>, WireElem>> = BTreeMap::new();
            let mut verdicts: HashMap<String, usize> = HashMap::new();
            for (name, set) in &table.sets {
                if set.is_dynamic() {
                    continue;
                }
                for (key, elem) in &set.elements {
                    if let Some(chain) = elem.data.as_ref().and_then(|d| d.chain()) {
                        match verdicts.get_mut(chain) {
                            Some(n) => *n += 1,
                            None => {
                                verdicts.insert(chain.to_owned(), 1);
                            }
                        }
                    }
                    let Some(origin) = &elem.origin else {
                        unowned
                            .entry(name.clone())
                            .or_default()
                            .insert(key.clone(), elem.clone());
                        continue;
                    };
                    let ptr = Arc::as_ptr(origin);
                    if ptr != last && seen.insert(ptr) {
                        add_origin(&mut origins, origin);
                    }
                    last = ptr;
                }
            }
            let reach = reach(table, &fixed);
            let mut support: HashMap<Object, usize> = HashMap::new();
            for (chain, objects) in &reach {
                if verdicts.get(chain).is_some_and(|n| *n > 0) {
                    for o in objects {
                        *support.entry(o.clone()).or_default() += 1;
                    }
                }
            }
            // An object that no verdict reaches exists because elements were left in its map
            // (a `pick-<k>` map holding a contested Service's endpoints): whether it stays
            // depends on those elements' Services, which therefore take the full path, like
            // contested ones.
            let mut unreached: BTreeSet<&str> = BTreeSet::new();
            for (name, objects) in &reach {
                let chain = Object::Chain(name.clone());
                if !fixed.contains(&chain) && !support.contains_key(&chain) {
                    unreached.extend(objects.iter().filter_map(|o| match o {
                        Object::Set(s) => Some(s.as_str()),
                        Object::Chain(_) => None,
                    }));
                }
            }
            for name in table.sets.keys() {
                let o = Object::Set(name.clone());
                if !fixed.contains(&o) && !support.contains_key(&o) {
                    unreached.insert(name);
                }
            }
            for name in unreached {
                let owners = table.sets.get(name).into_iter().flat_map(|s| {
                    s.elements
                        .values()
                        .filter_map(|e| e.origin.as_ref().map(|o| o.service.clone()))
                });
                contested.extend(owners);
            }
            families.insert(
                family,
                Layout {
                    unowned,
                    verdicts,
                    reach,
                    support,
                },
            );
        }
        Some(Baseline {
            settings: settings.clone(),
            nodes: nodes.clone(),
            contested,
            families,
            origins,
            claims: HashMap::new(),
        })
    }

    /// Records the claims of `services`, the whole state the full build was made from.
    pub(super) fn with_claims(mut self, services: &BTreeMap<ServiceName, Service>) -> Baseline {
        self.claims.clear();
        for (name, svc) in services {
            self.claim(name, svc);
        }
        self
    }

    fn claim(&mut self, name: &ServiceName, svc: &Service) {
        for key in claim_keys(svc) {
            self.claims.entry(key).or_default().insert(name.clone());
        }
    }

    /// The claims of `changed` replaced by those of their versions in `scoped`.
    fn reclaim(&mut self, scoped: &ClusterState, changed: &BTreeSet<ServiceName>) {
        self.claims.retain(|_, holders| {
            holders.retain(|h| !changed.contains(h));
            !holders.is_empty()
        });
        for name in changed {
            if let Some(svc) = scoped.services.get(name) {
                self.claim(name, svc);
            }
        }
    }
}

/// Hashes an address with one multiplication: the addresses of the origins are distinct and
/// attacker-independent, and SipHash per element was a visible part of a full sync.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(26);
    }
}

/// Notes `origin` among its Service's origins.
fn add_origin(
    origins: &mut HashMap<ServiceName, Vec<Arc<ServicePortName>>>,
    origin: &Arc<ServicePortName>,
) {
    match origins.get_mut(&origin.service) {
        Some(list) => {
            if !list.iter().any(|o| Arc::ptr_eq(o, origin)) {
                list.push(origin.clone());
            }
        }
        None => {
            origins.insert(origin.service.clone(), vec![origin.clone()]);
        }
    }
}

/// The chains and sets the rules of `chain` refer to.
fn references(table: &WireTable, chain: &str) -> Vec<Object> {
    let Some(c) = table.chains.get(chain) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for rule in &c.rules {
        for e in &rule.exprs {
            out.extend(e.set_ref().map(Object::Set));
            out.extend(e.updated_set().map(Object::Set));
            out.extend(e.chain_ref().map(Object::Chain));
        }
    }
    out
}

/// For each chain of `table`: the objects not in `fixed` that its rules reach, directly or
/// through other chains, itself included when it is not fixed.
fn reach(table: &WireTable, fixed: &BTreeSet<Object>) -> HashMap<String, Vec<Object>> {
    let mut out = HashMap::new();
    for name in table.chains.keys() {
        let mut seen: BTreeSet<Object> = BTreeSet::new();
        let mut todo = vec![Object::Chain(name.clone())];
        while let Some(o) = todo.pop() {
            if !seen.insert(o.clone()) {
                continue;
            }
            if let Object::Chain(c) = &o {
                todo.extend(references(table, c));
            }
        }
        out.insert(
            name.clone(),
            seen.into_iter().filter(|o| !fixed.contains(o)).collect(),
        );
    }
    out
}

/// (set name, key, element).
type Entry = (String, Box<[u8]>, WireElem);

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
            tracing::info!("Service {name} changed: retrying it after quarantine");
            self.quarantine.remove(&name);
        }
        outcome.quarantined = self.quarantined();
        outcome.duration = started.elapsed();
        Ok(Incremental::Done(outcome))
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
        // The changed affinity Services keep their endpoints' slots, as in `sync`.
        let applied: Vec<&WireTable> = self.applied.values().flatten().collect();
        let hints = super::affinity_hints_for(&applied, changed);
        let (desired, contested) = ruleset::build_noting_contested(&effective, settings, &hints);
        if !contested.is_empty() {
            return Err("changed Services claim the same element key");
        }
        let mut wanted = Vec::with_capacity(desired.tables.len());
        for table in desired.tables {
            // The full path reports what cannot be lowered, with the Service it belongs to.
            wanted.push(nft::lower_owned(table).map_err(|_| "a rebuilt object cannot be lowered")?);
        }
        outcome.report.lower += t.elapsed();

        let t = Instant::now();
        // Sorted for a binary search per element: hashing 145k addresses cost more than the
        // few comparisons.
        let mut ours: Vec<*const ServicePortName> = changed
            .iter()
            .filter_map(|n| base.origins.get(n))
            .flatten()
            .map(Arc::as_ptr)
            .collect();
        ours.sort_unstable();
        let mut deltas = Vec::with_capacity(wanted.len());
        for want in wanted {
            let family = want.family;
            let (Some(Some(have)), Some(layout)) =
                (self.applied.get(&family), base.families.get(&family))
            else {
                return Err("the kernel's table is unknown");
            };
            deltas.push(delta(have, want, layout, changed, &ours)?);
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
            base.origins.remove(name);
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
            for (name, key, elem) in delta.new {
                if let Some(origin) = &elem.origin {
                    add_origin(&mut base.origins, origin);
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
    want: WireTable,
    layout: &Layout,
    changed: &BTreeSet<ServiceName>,
    ours: &[*const ServicePortName],
) -> Result<Delta, &'static str> {
    if want.name != have.name || want.userdata != have.userdata || want.flags != have.flags {
        return Err("the table itself changed");
    }
    for (name, chain) in &want.chains {
        if have.chains.get(name) != Some(chain) {
            return Err("a rebuilt Service needs a chain that is not in the table");
        }
    }
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
    let mut unowned: BTreeMap<String, BTreeMap<Box<[u8]>, WireElem>> = BTreeMap::new();
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

    // The changed Services' elements as applied, found by their origins' addresses.
    if !ours.is_empty() {
        for (name, set) in &have.sets {
            if set.is_dynamic() {
                continue;
            }
            for (key, elem) in &set.elements {
                if elem
                    .origin
                    .as_ref()
                    .is_some_and(|o| ours.binary_search(&Arc::as_ptr(o)).is_ok())
                {
                    count(&mut delta.verdicts, elem, -1);
                    delta.old.push((name.clone(), key.clone(), elem.clone()));
                }
            }
        }
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
    Ok(delta)
}

/// Counts the verdict of `elem` (if it has one) as `change` references to its chain.
fn count(verdicts: &mut HashMap<String, i64>, elem: &WireElem, change: i64) {
    if let Some(chain) = elem.data.as_ref().and_then(|d| d.chain()) {
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
        elements: BTreeMap::new(),
    }
}

#[cfg(test)]
impl Baseline {
    /// How the counts maintained incrementally differ from those `fresh` computed from the same
    /// applied tables (empty when they agree).
    pub(super) fn differences(&self, fresh: &Baseline) -> Vec<String> {
        let mut out = Vec::new();
        for (family, mine) in &self.families {
            let Some(theirs) = fresh.families.get(family) else {
                out.push(format!("{family}: no fresh layout"));
                continue;
            };
            let verdicts = |m: &HashMap<String, usize>| -> BTreeMap<String, usize> {
                m.iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(k, n)| (k.clone(), *n))
                    .collect()
            };
            if verdicts(&mine.verdicts) != verdicts(&theirs.verdicts) {
                out.push(format!(
                    "{family}: verdict counts {:?} != {:?}",
                    verdicts(&mine.verdicts),
                    verdicts(&theirs.verdicts)
                ));
            }
            let support = |m: &HashMap<Object, usize>| -> BTreeMap<Object, usize> {
                m.iter()
                    .filter(|(_, n)| **n > 0)
                    .map(|(k, n)| (k.clone(), *n))
                    .collect()
            };
            if support(&mine.support) != support(&theirs.support) {
                out.push(format!(
                    "{family}: support {:?} != {:?}",
                    support(&mine.support),
                    support(&theirs.support)
                ));
            }
            if mine.unowned != theirs.unowned {
                out.push(format!("{family}: unowned elements differ"));
            }
        }
        let addresses = |o: &HashMap<ServiceName, Vec<Arc<ServicePortName>>>| {
            o.iter()
                .map(|(n, list)| {
                    let set: BTreeSet<usize> =
                        list.iter().map(|a| Arc::as_ptr(a) as usize).collect();
                    (n.clone(), set)
                })
                .collect::<BTreeMap<_, _>>()
        };
        if addresses(&self.origins) != addresses(&fresh.origins) {
            out.push("origins per Service differ".to_string());
        }
        out
    }

    pub(super) fn settings_for_tests(&self) -> &Settings {
        &self.settings
    }

    pub(super) fn nodes_for_tests(&self) -> &BTreeMap<String, Node> {
        &self.nodes
    }
}
