//! `nodeproxy diff`'s kernel: reads our tables from the real one, and records what each plan a
//! sync hands it would change (grouped by the Service each object was built for) instead of
//! sending it.
//!
//! Being a [`Kernel`], it lets `diff` run the sync path itself (read back, build, lower,
//! `diff::diff`), so what it shows is what a sync would send, not a second opinion of it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use super::diff::{Op, Plan, diff_elements};
use super::udata;
use super::wire::{WireChain, WireElem, WireRule, WireSet, WireTable, family_keyword};
use super::{ApplyStats, Kernel, NftError};
use crate::model::{IpFamily, ServiceName};
use crate::ruleset::names;

/// What happens to one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Sign {
    Removed,
    Added,
    Changed,
}

impl Sign {
    /// The mark `diff -u` readers know, `~` for a change in place.
    pub fn symbol(self) -> char {
        match self {
            Sign::Removed => '-',
            Sign::Added => '+',
            Sign::Changed => '~',
        }
    }
}

/// The kinds of objects, in the order a group lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Object {
    Table,
    Chain,
    Set,
    Element,
}

/// One object a sync would add, remove or change. Ordered as the report lists it: by Service
/// (shared objects last), family, kind, name, element key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Change {
    /// Whose the object is.
    pub owner: Owner,
    pub family: IpFamily,
    pub object: Object,
    /// The chain's or set's name; for an element, its set's.
    pub name: String,
    /// An element's key bytes, so elements list in the kernel's order.
    pub key: Box<[u8]>,
    pub sign: Sign,
    /// The line without its sign: `element ip nodeproxy hairpin-connections { … }`.
    pub text: String,
}

/// Whose an object is. Services sort before shared objects, so the report ends with the
/// objects no single Service owns.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Owner {
    /// Built for this Service (an element carrying its `ns/name:port`).
    Service(ServiceName),
    /// Base chains, shared sets and maps, and elements that name no Service.
    Shared,
}

/// A kernel that reads through to `inner` and records, without sending, every plan applied to
/// it. It never writes: `apply` only describes, `delete_tables` refuses.
pub struct Preview<K: Kernel> {
    inner: K,
    /// What each read returned: a plan names what it deletes, not what that held.
    read: BTreeMap<(IpFamily, String), Option<WireTable>>,
    changes: Vec<Change>,
}

impl<K: Kernel> Preview<K> {
    pub fn new(inner: K) -> Preview<K> {
        Preview {
            inner,
            read: BTreeMap::new(),
            changes: Vec::new(),
        }
    }

    /// Everything recorded, in the report's order.
    pub fn into_report(self) -> Report {
        let mut changes = self.changes;
        changes.sort();
        changes.dedup();
        Report { changes }
    }
}

impl<K: Kernel> Kernel for Preview<K> {
    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError> {
        let table = self.inner.read_table(family, name)?;
        self.read.insert((family, name.to_owned()), table.clone());
        Ok(table)
    }

    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError> {
        let have = self
            .read
            .get(&(plan.family, plan.table.clone()))
            .and_then(Option::as_ref);
        self.changes.extend(describe_plan(have, plan));
        // Nothing was sent, so no generation is claimed: a caller must not trust the kernel
        // to hold what it "applied".
        Ok(ApplyStats::default())
    }

    fn delete_tables(&mut self, name: &str) -> Result<usize, NftError> {
        Err(NftError::Protocol(format!(
            "a preview never deletes tables (asked to delete the {name} tables)"
        )))
    }

    fn generation(&mut self) -> Result<u32, NftError> {
        self.inner.generation()
    }
}

/// What a sync would change, ready to print.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    changes: Vec<Change>,
}

/// How many objects of one kind a report adds, removes and changes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub added: usize,
    pub removed: usize,
    pub changed: usize,
}

impl Report {
    pub fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    pub fn changes(&self) -> &[Change] {
        &self.changes
    }

    pub fn counts(&self, object: Object) -> Counts {
        let mut counts = Counts::default();
        for c in self.changes.iter().filter(|c| c.object == object) {
            match c.sign {
                Sign::Added => counts.added += 1,
                Sign::Removed => counts.removed += 1,
                Sign::Changed => counts.changed += 1,
            }
        }
        counts
    }

    /// The Services with at least one change.
    pub fn services(&self) -> BTreeSet<&ServiceName> {
        self.changes
            .iter()
            .filter_map(|c| match &c.owner {
                Owner::Service(name) => Some(name),
                Owner::Shared => None,
            })
            .collect()
    }

    /// The report as `nodeproxy diff` prints it: a heading per Service, then one for shared
    /// objects, each change on a line of its own, and a summary; or one line when there is
    /// nothing to change.
    pub fn render(&self) -> String {
        if self.changes.is_empty() {
            return "no changes: the kernel's tables are what a sync would program\n".to_owned();
        }
        let mut out = String::new();
        let mut group: Option<&Owner> = None;
        for c in &self.changes {
            if group != Some(&c.owner) {
                if group.is_some() {
                    out.push('\n');
                }
                match &c.owner {
                    Owner::Service(name) => {
                        let _ = writeln!(out, "Service {name}");
                    }
                    Owner::Shared => out.push_str("Shared objects (no single Service)\n"),
                }
                group = Some(&c.owner);
            }
            let _ = writeln!(out, "  {} {}", c.sign.symbol(), c.text);
        }
        let shared = self
            .changes
            .iter()
            .any(|c| matches!(c.owner, Owner::Shared));
        let _ = write!(
            out,
            "\nsummary: {} Service(s){} changed",
            self.services().len(),
            if shared { " and shared objects" } else { "" }
        );
        for (object, noun) in [
            (Object::Table, "table(s)"),
            (Object::Chain, "chain(s)"),
            (Object::Set, "set(s) and map(s)"),
            (Object::Element, "element(s)"),
        ] {
            let n = self.counts(object);
            if n != Counts::default() {
                let _ = write!(
                    out,
                    "; {noun} {} added, {} removed, {} changed",
                    n.added, n.removed, n.changed
                );
            }
        }
        out.push('\n');
        out
    }
}

/// The objects one table's plan touches, gathered by name: a recreated chain or set is a
/// delete and an add of one name, a rewritten chain a flush and its rules.
#[derive(Default)]
struct Touched<'p> {
    chains_added: BTreeMap<&'p str, &'p WireChain>,
    chains_deleted: BTreeSet<&'p str>,
    chains_flushed: BTreeSet<&'p str>,
    rules: BTreeMap<&'p str, Vec<&'p WireRule>>,
    sets_added: BTreeMap<&'p str, &'p WireSet>,
    sets_deleted: BTreeSet<&'p str>,
    /// Elements of kept sets: the set's definitions, removals and additions.
    elements: BTreeMap<&'p str, ElementOps<'p>>,
}

#[derive(Default)]
struct ElementOps<'p> {
    def: Option<&'p WireSet>,
    removed: Vec<(&'p [u8], &'p WireElem)>,
    added: Vec<(&'p [u8], &'p WireElem)>,
}

/// The changes `plan` makes to `have` (what the kernel holds; `None` when the table does not
/// exist, and then the plan adds everything).
fn describe_plan(have: Option<&WireTable>, plan: &Plan<'_>) -> Vec<Change> {
    let family = plan.family;
    let table = format!("{} {}", family_keyword(family), plan.table);
    let change = |owner: Owner, object: Object, name: &str, sign: Sign, text: String| Change {
        owner,
        family,
        object,
        name: name.to_owned(),
        key: Box::default(),
        sign,
        text,
    };
    let mut out = Vec::new();
    let mut t = Touched::default();
    for op in plan.ops() {
        match op {
            Op::AddTable { .. } => out.push(change(
                Owner::Shared,
                Object::Table,
                "",
                Sign::Added,
                format!("table {table}"),
            )),
            Op::UpdateTable { flags } => out.push(change(
                Owner::Shared,
                Object::Table,
                "",
                Sign::Changed,
                format!(
                    "table {table}: flags {:#x} -> {flags:#x}",
                    have.map_or(0, |h| h.flags)
                ),
            )),
            Op::AddChain { name, chain } => {
                t.chains_added.insert(name, chain);
            }
            Op::DelChain { name } => {
                t.chains_deleted.insert(name);
            }
            Op::FlushChain { name } => {
                t.chains_flushed.insert(name);
            }
            Op::AddRule { chain, rule, .. } => t.rules.entry(chain).or_default().push(rule),
            Op::AddSet { name, set } => {
                t.sets_added.insert(name, set);
            }
            Op::DelSet { name } => {
                t.sets_deleted.insert(name);
            }
            Op::AddElems { set, def, elems } => {
                let e = t.elements.entry(set).or_default();
                e.def = Some(def);
                e.added.extend(elems.iter().copied());
            }
            Op::DelElems { set, def, elems } => {
                let e = t.elements.entry(set).or_default();
                e.def.get_or_insert(def);
                e.removed.extend(elems.iter().copied());
            }
        }
    }

    let old_chain = |name: &str| have.and_then(|h| h.chains.get(name));
    let chain_names: BTreeSet<&str> = t
        .chains_added
        .keys()
        .chain(&t.chains_deleted)
        .chain(&t.chains_flushed)
        .copied()
        .collect();
    for name in chain_names {
        let rules = t.rules.get(name).map_or(&[][..], Vec::as_slice);
        let (sign, text) = match (t.chains_added.get(name), t.chains_deleted.contains(name)) {
            (Some(new), true) => {
                let why = match old_chain(name) {
                    Some(old) if old.hook != new.hook => "its hook changed",
                    _ => "its comment changed",
                };
                (
                    Sign::Changed,
                    format!(
                        "chain {table} {name}: recreated ({why}) with {} rule(s)",
                        rules.len()
                    ),
                )
            }
            (Some(_), false) => (
                Sign::Added,
                format!("chain {table} {name} with {} rule(s)", rules.len()),
            ),
            (None, true) => (Sign::Removed, format!("chain {table} {name}")),
            (None, false) => {
                let old = old_chain(name).map_or(&[][..], |c| c.rules.as_slice());
                let added = rules.iter().filter(|r| !old.contains(r)).count();
                let removed = old.iter().filter(|r| !rules.contains(r)).count();
                let what = if added == 0 && removed == 0 {
                    "re-added, as they refer to a recreated set or chain".to_owned()
                } else {
                    format!("{added} rule(s) added, {removed} removed")
                };
                (
                    Sign::Changed,
                    format!(
                        "chain {table} {name}: rules rewritten ({what}; {} -> {} rules)",
                        old.len(),
                        rules.len()
                    ),
                )
            }
        };
        out.push(change(Owner::Shared, Object::Chain, name, sign, text));
    }

    let old_set = |name: &str| have.and_then(|h| h.sets.get(name));
    let set_names: BTreeSet<&str> = t
        .sets_added
        .keys()
        .chain(&t.sets_deleted)
        .copied()
        .collect();
    for name in &set_names {
        let old = old_set(name);
        let new = t.sets_added.get(name).copied();
        let kind = |s: &WireSet| if s.is_map() { "map" } else { "set" };
        let (sign, text, removed, added) = match (new, t.sets_deleted.contains(name)) {
            (Some(new), true) => {
                // Recreated: the elements both sides hold come back as they were; the others
                // are what really changes, found by the diff's own element merge.
                let (removed, added) = match old {
                    Some(old) => diff_elements(old, new),
                    None => (
                        Vec::new(),
                        new.elements.iter().map(|(k, e)| (&k[..], e)).collect(),
                    ),
                };
                let size = |s: Option<u32>| s.map_or_else(|| "none".to_owned(), |n| n.to_string());
                let why = match old {
                    Some(old) if old.same_definition_but_size(new) => {
                        format!("its size changed: {} -> {}", size(old.size), size(new.size))
                    }
                    _ => "its definition changed".to_owned(),
                };
                let text = format!(
                    "{} {table} {name}: recreated ({why}), {} element(s)",
                    kind(new),
                    new.elements.len()
                );
                (Sign::Changed, text, removed, added)
            }
            (Some(new), false) => {
                let added = new.elements.iter().map(|(k, e)| (&k[..], e)).collect();
                (
                    Sign::Added,
                    format!("{} {table} {name}", kind(new)),
                    Vec::new(),
                    added,
                )
            }
            (None, _) => {
                let removed = old
                    .map(|o| o.elements.iter().map(|(k, e)| (&k[..], e)).collect())
                    .unwrap_or_default();
                let text = match old {
                    Some(o) => format!("{} {table} {name}", kind(o)),
                    None => format!("set {table} {name}"),
                };
                (Sign::Removed, text, removed, Vec::new())
            }
        };
        out.push(change(Owner::Shared, Object::Set, name, sign, text));
        let defs = (old.or(new), new.or(old));
        out.extend(element_changes(
            have, family, &table, name, defs, &removed, &added,
        ));
    }
    for (name, ops) in &t.elements {
        if set_names.contains(name) {
            continue;
        }
        let defs = (old_set(name).or(ops.def), ops.def.or(old_set(name)));
        out.extend(element_changes(
            have,
            family,
            &table,
            name,
            defs,
            &ops.removed,
            &ops.added,
        ));
    }
    out
}

/// Element lines of set `name`: a key both removed and added is changed in place.
fn element_changes(
    have: Option<&WireTable>,
    family: IpFamily,
    table: &str,
    name: &str,
    (old_def, new_def): (Option<&WireSet>, Option<&WireSet>),
    removed: &[(&[u8], &WireElem)],
    added: &[(&[u8], &WireElem)],
) -> Vec<Change> {
    let (Some(old_def), Some(new_def)) = (old_def, new_def) else {
        return Vec::new();
    };
    let mut by_key: BTreeMap<&[u8], (Option<&WireElem>, Option<&WireElem>)> = BTreeMap::new();
    for (k, e) in removed {
        by_key.entry(k).or_default().0 = Some(e);
    }
    for (k, e) in added {
        by_key.entry(k).or_default().1 = Some(e);
    }
    by_key
        .into_iter()
        .filter_map(|(key, sides)| {
            let (sign, def, elem, was) = match sides {
                (Some(old), Some(new)) => (Sign::Changed, new_def, new, Some(old)),
                (Some(old), None) => (Sign::Removed, old_def, old, None),
                (None, Some(new)) => (Sign::Added, new_def, new, None),
                (None, None) => return None,
            };
            let mut text = format!(
                "element {table} {name} {{ {} }}",
                element_text(def, key, elem)
            );
            if let Some(old) = was {
                text.push_str(&was_text(old_def, old, elem));
            }
            Some(Change {
                owner: service_of(elem)
                    .or_else(|| was.and_then(service_of))
                    .or_else(|| service_by_key(have, name, key))
                    .map_or(Owner::Shared, Owner::Service),
                family,
                object: Object::Element,
                name: name.to_owned(),
                key: key.into(),
                sign,
                text,
            })
        })
        .collect()
}

/// `203.0.113.20 . tcp . 80 : goto pick-2`, as nft writes an element (a range element's end
/// after `to`).
fn element_text(def: &WireSet, key: &[u8], elem: &WireElem) -> String {
    let mut text = def.format_key(key);
    if let Some(end) = elem.key_end().filter(|end| &end[..] != key) {
        let _ = write!(text, " to {}", def.format_key(end));
    }
    if let Some(data) = elem.data() {
        let _ = write!(text, " : {}", def.format_data(data));
    }
    text
}

/// What an element changed in place held before: its data, range end or comment.
fn was_text(def: &WireSet, old: &WireElem, new: &WireElem) -> String {
    let mut parts = Vec::new();
    if old.data() != new.data() {
        let data = old
            .data()
            .map_or_else(|| "no data".to_owned(), |d| def.format_data(d));
        parts.push(format!("was : {data}"));
    }
    if old.key_end() != new.key_end() {
        let end = old
            .key_end()
            .map_or_else(|| "none".to_owned(), |e| def.format_key(e));
        parts.push(format!("range end was {end}"));
    }
    if old.userdata != new.userdata {
        let comment = old
            .userdata
            .as_deref()
            .and_then(|u| udata::parse_comment(u))
            .unwrap_or_default();
        parts.push(format!("comment was {comment:?}"));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// The Service of an element of endpoints map `set` that the kernel holds without a comment (as
/// the build leaves them): the one named by the Service-level element, in the kernel, whose key
/// is this key without its slot.
fn service_by_key(have: Option<&WireTable>, set: &str, key: &[u8]) -> Option<ServiceName> {
    let maps = names::endpoint_owner_maps(set)?;
    // The slot is the last field, a 32-bit numgen register.
    let prefix = key.get(..key.len().checked_sub(4)?)?;
    let have = have?;
    maps.iter()
        .filter_map(|map| have.sets.get(*map)?.elements.get(prefix))
        .find_map(service_of)
}

/// The Service an element was built for: its origin when we built it, else the `ns/name:port`
/// comment it carries in the kernel.
fn service_of(elem: &WireElem) -> Option<ServiceName> {
    if let Some(origin) = &elem.origin {
        return Some(origin.service.clone());
    }
    let comment = udata::parse_comment(elem.userdata.as_deref()?)?;
    // A comment cut at nft's limit may lose the port, never the name before it.
    let service = comment.split(':').next()?;
    let (namespace, name) = service.split_once('/')?;
    let label = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    (label(namespace) && label(name)).then(|| ServiceName::new(namespace, name))
}

#[cfg(test)]
mod tests;
