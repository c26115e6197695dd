//! Diff of two wire tables into the operations of (at most) two transactions.
//!
//! Ops borrow from the current and desired tables: a cold start with 100k elements holds one
//! reference per element, never a copy.

use std::collections::BTreeSet;

use super::wire::{WireChain, WireElem, WireRule, WireSet, WireTable, family_keyword};
use crate::model::IpFamily;

#[derive(Debug, Clone)]
pub enum Op<'a> {
    /// NEWTABLE creating our table.
    AddTable {
        flags: u32,
        userdata: &'a [u8],
    },
    /// NEWTABLE changing the flags of the existing table: in practice, claiming an orphaned
    /// table (see [`table_flags_update`]).
    UpdateTable {
        flags: u32,
    },
    /// NEWCHAIN with `NLM_F_EXCL` (hook, type, policy, userdata; not the rules).
    AddChain {
        name: &'a str,
        chain: &'a WireChain,
    },
    DelChain {
        name: &'a str,
    },
    /// DELRULE without a handle: removes every rule of the chain.
    FlushChain {
        name: &'a str,
    },
    AddRule {
        chain: &'a str,
        index: usize,
        rule: &'a WireRule,
    },
    AddSet {
        name: &'a str,
        set: &'a WireSet,
    },
    DelSet {
        name: &'a str,
    },
    /// Elements of `set` (definition `def`) added (without `NLM_F_EXCL`: see `netlink.rs`).
    AddElems {
        set: &'a str,
        def: &'a WireSet,
        elems: Vec<(&'a [u8], &'a WireElem)>,
    },
    /// Elements removed; the element (as it is in the kernel) is kept for error reports.
    DelElems {
        set: &'a str,
        def: &'a WireSet,
        elems: Vec<(&'a [u8], &'a WireElem)>,
    },
}

impl Op<'_> {
    pub fn kind(&self) -> &'static str {
        match self {
            Op::AddTable { .. } => "add table",
            Op::UpdateTable { .. } => "update table",
            Op::AddChain { .. } => "add chain",
            Op::DelChain { .. } => "delete chain",
            Op::FlushChain { .. } => "flush chain",
            Op::AddRule { .. } => "add rule",
            Op::AddSet { .. } => "add set",
            Op::DelSet { .. } => "delete set",
            Op::AddElems { .. } => "add element",
            Op::DelElems { .. } => "delete element",
        }
    }
}

/// What to send for one table: `phase1` first, then `phase2` as a second transaction (deletions
/// of objects that the old state referenced; see DESIGN §4, EBUSY before kernel 6.2).
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    pub family: IpFamily,
    pub table: String,
    pub phase1: Vec<Op<'a>>,
    pub phase2: Vec<Op<'a>>,
}

impl Plan<'_> {
    pub fn is_empty(&self) -> bool {
        self.phase1.is_empty() && self.phase2.is_empty()
    }

    /// `table ip nodeproxy`
    pub fn table_desc(&self) -> String {
        format!("table {} {}", family_keyword(self.family), self.table)
    }

    pub fn elements_added(&self) -> usize {
        self.ops()
            .map(|o| {
                if let Op::AddElems { elems, .. } = o {
                    elems.len()
                } else {
                    0
                }
            })
            .sum()
    }

    pub fn elements_removed(&self) -> usize {
        self.ops()
            .map(|o| {
                if let Op::DelElems { elems, .. } = o {
                    elems.len()
                } else {
                    0
                }
            })
            .sum()
    }

    /// Orphaned tables this plan claims (0 or 1).
    pub fn tables_claimed(&self) -> usize {
        self.ops()
            .filter(|o| matches!(o, Op::UpdateTable { flags } if flags & super::uapi::TABLE_F_OWNER != 0))
            .count()
    }

    pub fn chains_rewritten(&self) -> usize {
        self.ops()
            .filter(|o| matches!(o, Op::FlushChain { .. }))
            .count()
    }

    pub fn ops(&self) -> impl Iterator<Item = &Op<'_>> {
        self.phase1.iter().chain(self.phase2.iter())
    }
}

fn chain_refs_of_table(t: &WireTable) -> BTreeSet<String> {
    let mut refs = BTreeSet::new();
    for c in t.chains.values() {
        for r in &c.rules {
            refs.extend(r.chain_refs());
        }
    }
    for s in t.sets.values() {
        if s.data_type == Some(super::uapi::DATA_TYPE_VERDICT) {
            for e in s.elements.values() {
                if let Some(c) = e.chain()
                    && !refs.contains(c)
                {
                    refs.insert(c.to_owned());
                }
            }
        }
    }
    refs
}

fn set_refs_of_table(t: &WireTable) -> BTreeSet<String> {
    t.chains
        .values()
        .flat_map(|c| c.rules.iter().flat_map(|r| r.set_refs()))
        .collect()
}

/// Computes the operations that turn `current` (what the kernel holds, `None` when our table
/// does not exist) into `desired`. Unchanged objects produce no operations.
pub fn diff<'a>(current: Option<&'a WireTable>, desired: &'a WireTable) -> Plan<'a> {
    let mut plan = Plan {
        family: desired.family,
        table: desired.name.clone(),
        phase1: Vec::new(),
        phase2: Vec::new(),
    };
    let Some(cur) = current else {
        // Fresh table: table, chains (elements and rules reference them), sets, rules, and the
        // elements last. A rule that looks up a map binds it (`nf_tables_bind_set`), and binding
        // a map that already holds elements walks all of them to check their data against the
        // rule's registers; added to a bound map, an element is checked as it arrives, its
        // data still in cache. At 10k Services x 10 endpoints the walk was 20-24 ms of the
        // kernel's ~120 ms in a cold load (`perf`, kernel 6.18), and the per-element checks
        // that replace it 2-4 ms.
        plan.phase1.push(Op::AddTable {
            flags: desired.flags,
            userdata: &desired.userdata,
        });
        for (name, c) in desired.chains_ordered() {
            plan.phase1.push(Op::AddChain { name, chain: c });
        }
        for (name, s) in desired.sets_ordered() {
            plan.phase1.push(Op::AddSet { name, set: s });
        }
        for (name, c) in desired.chains_ordered() {
            for (index, rule) in c.rules.iter().enumerate() {
                plan.phase1.push(Op::AddRule {
                    chain: name,
                    index,
                    rule,
                });
            }
        }
        for (name, s) in desired.sets_ordered() {
            if !s.elements.is_empty() {
                let elems = s.elements.iter().map(|(k, e)| (&k[..], e)).collect();
                plan.phase1.push(Op::AddElems {
                    set: name,
                    def: s,
                    elems,
                });
            }
        }
        return plan;
    };

    // A table's flags can be updated in place (within the limits of `table_flags_update`); its
    // userdata cannot (the kernel ignores it on update), so a changed table comment is left as
    // it is. Claiming an orphaned table is this update, first in the transaction, so that every
    // following message already finds the table ours.
    if let Some(flags) = table_flags_update(cur.flags, desired.flags) {
        plan.phase1.push(Op::UpdateTable { flags });
    }

    let old_chain_refs = chain_refs_of_table(cur);
    let old_set_refs = set_refs_of_table(cur);

    // Sets to (re)create.
    let mut recreate_sets: BTreeSet<&str> = BTreeSet::new();
    let mut new_sets: Vec<(&str, &WireSet)> = Vec::new();
    for (name, s) in desired.sets_ordered() {
        match cur.sets.get(name) {
            None => new_sets.push((name, s)),
            Some(old) if !old.same_definition(s) => {
                recreate_sets.insert(name);
                new_sets.push((name, s));
            }
            Some(_) => {}
        }
    }
    // Chains to (re)create: new ones, and base chains whose hook changed. A regular chain whose
    // comment changed is recreated too (the kernel does not update chain userdata in place).
    let mut recreate_chains: BTreeSet<&str> = BTreeSet::new();
    let mut new_chains: Vec<(&str, &WireChain)> = Vec::new();
    for (name, c) in desired.chains_ordered() {
        match cur.chains.get(name) {
            None => new_chains.push((name, c)),
            Some(old) if old.hook != c.hook || old.userdata != c.userdata => {
                recreate_chains.insert(name);
                new_chains.push((name, c));
            }
            Some(_) => {}
        }
    }
    let stale_chains: Vec<&str> = cur
        .chains_ordered()
        .map(|(n, _)| n)
        .filter(|n| !desired.chains.contains_key(*n))
        .collect();
    let stale_sets: Vec<&str> = cur
        .sets_ordered()
        .map(|(n, _)| n)
        .filter(|n| !desired.sets.contains_key(*n))
        .collect();

    // Chains whose rules are rewritten: changed rules, or rules that reference a recreated set
    // or chain (the references must be dropped before the object goes away).
    let mut rewrite: Vec<&str> = Vec::new();
    for (name, c) in desired.chains_ordered() {
        let Some(old) = cur.chains.get(name) else {
            continue;
        };
        if recreate_chains.contains(name) {
            continue;
        }
        let touches_recreated = old.rules.iter().any(|r| {
            r.set_refs().any(|s| recreate_sets.contains(s.as_str()))
                || r.chain_refs().any(|x| recreate_chains.contains(x.as_str()))
        });
        if old.rules != c.rules || touches_recreated {
            rewrite.push(name);
        }
    }

    // 1. Drop rules: rewritten chains, stale chains (their rules may reference stale objects).
    for name in &rewrite {
        plan.phase1.push(Op::FlushChain { name });
    }
    for name in &stale_chains {
        if cur.chains.get(*name).is_some_and(|c| !c.rules.is_empty()) {
            plan.phase1.push(Op::FlushChain { name });
        }
    }
    // 2. Recreated chains go away and come back (their rules with them).
    for name in &recreate_chains {
        if !cur.chains.get(*name).is_some_and(|c| c.rules.is_empty()) {
            plan.phase1.push(Op::FlushChain { name });
        }
    }
    for name in &recreate_chains {
        plan.phase1.push(Op::DelChain { name });
    }
    for (name, c) in &new_chains {
        plan.phase1.push(Op::AddChain { name, chain: c });
    }
    // 3. Elements of kept sets: removals first, then additions (a change is both).
    let mut adds: Vec<Op<'a>> = Vec::new();
    for (name, s) in desired.sets_ordered() {
        let Some(old) = cur.sets.get(name) else {
            continue;
        };
        if recreate_sets.contains(name) {
            continue;
        }
        let (del, add) = diff_elements(old, s);
        if !del.is_empty() {
            plan.phase1.push(Op::DelElems {
                set: name,
                def: old,
                elems: del,
            });
        }
        if !add.is_empty() {
            adds.push(Op::AddElems {
                set: name,
                def: s,
                elems: add,
            });
        }
    }
    // 4. Recreated and new sets.
    for name in &recreate_sets {
        plan.phase1.push(Op::DelSet { name });
    }
    for (name, s) in &new_sets {
        plan.phase1.push(Op::AddSet { name, set: s });
        if !s.elements.is_empty() {
            let elems = s.elements.iter().map(|(k, e)| (&k[..], e)).collect();
            adds.push(Op::AddElems {
                set: name,
                def: s,
                elems,
            });
        }
    }
    // 5. Rules of rewritten and recreated chains, then the elements added: after the rules, so
    // that a recreated map is bound while still empty (see the fresh table above).
    for (name, c) in desired.chains_ordered() {
        if rewrite.contains(&name)
            || recreate_chains.contains(name)
            || !cur.chains.contains_key(name)
        {
            for (index, rule) in c.rules.iter().enumerate() {
                plan.phase1.push(Op::AddRule {
                    chain: name,
                    index,
                    rule,
                });
            }
        }
    }
    plan.phase1.extend(adds);
    // 6. Stale objects: deleted now if nothing referenced them, else in phase 2.
    for name in &stale_sets {
        let op = Op::DelSet { name };
        if old_set_refs.contains(*name) {
            // Its elements' verdicts may hold chains deleted in phase 2 too: kernels before
            // 6.2 count element references as of the start of the transaction, so a chain
            // deleted with the map that jumps to it is EBUSY. Emptied now, the map holds
            // nothing by then (only stale rules, flushed above, still look it up).
            if let Some(old) = cur.sets.get(*name)
                && !old.elements.is_empty()
                && old.elements.values().any(|e| e.chain().is_some())
            {
                plan.phase1.push(Op::DelElems {
                    set: name,
                    def: old,
                    elems: old.elements.iter().map(|(k, e)| (&k[..], e)).collect(),
                });
            }
            plan.phase2.push(op)
        } else {
            plan.phase1.push(op)
        }
    }
    for name in &stale_chains {
        let op = Op::DelChain { name };
        if old_chain_refs.contains(*name) {
            plan.phase2.push(op)
        } else {
            plan.phase1.push(op)
        }
    }
    plan
}

/// The flags to send to turn an existing table with flags `cur` into one with `want`; `None`
/// when they are equal, or when the kernel cannot make the change in place.
///
/// The kernel's rules for an update (`nf_tables_updtable`, kernel 6.9+, checked on 6.18), in
/// terms of `NFT_TABLE_F_OWNER` and `NFT_TABLE_F_PERSIST`: persist never changes; an owner
/// never gives up ownership; ownership is gained only by claiming an orphan (persist without
/// owner). Anything else is EOPNOTSUPP and would fail the whole transaction, every time. So a
/// table created without persist (by a nodeproxy that predates ownership, or by `nft -f`) keeps
/// its flags: it stays unowned until it is deleted, rather than being recreated, which would
/// drop the affinity pins in its dynamic sets. `cur` has the owner flag only when the table is
/// ours (see `Kernel::read_table`), so "someone else owns it" reads as an orphan, and the claim
/// then fails with EPERM, naming the owner.
pub fn table_flags_update(cur: u32, want: u32) -> Option<u32> {
    const OWNER: u32 = super::uapi::TABLE_F_OWNER;
    const PERSIST: u32 = super::uapi::TABLE_F_PERSIST;
    if cur == want {
        return None;
    }
    let persist_changes = (cur ^ want) & PERSIST != 0;
    let gives_up_ownership = cur & OWNER != 0 && want & OWNER == 0;
    let orphan = cur & (OWNER | PERSIST) == PERSIST;
    let gains_ownership = cur & OWNER == 0 && want & OWNER != 0;
    if persist_changes || gives_up_ownership || (gains_ownership && !orphan) {
        return None;
    }
    Some(want)
}

pub(super) type ElemRef<'a> = (&'a [u8], &'a WireElem);

/// Element removals and additions turning `old` into `new` (a merge of two sorted maps).
pub(super) fn diff_elements<'a>(
    old: &'a WireSet,
    new: &'a WireSet,
) -> (Vec<ElemRef<'a>>, Vec<ElemRef<'a>>) {
    let mut del = Vec::new();
    let mut add = Vec::new();
    let mut a = old.elements.iter().peekable();
    let mut b = new.elements.iter().peekable();
    loop {
        match (a.peek(), b.peek()) {
            (None, None) => break,
            (Some((k, e)), None) => {
                del.push((&k[..], *e));
                a.next();
            }
            (None, Some((k, e))) => {
                add.push((&k[..], *e));
                b.next();
            }
            (Some((ka, ea)), Some((kb, eb))) => match ka.cmp(kb) {
                std::cmp::Ordering::Less => {
                    del.push((&ka[..], *ea));
                    a.next();
                }
                std::cmp::Ordering::Greater => {
                    add.push((&kb[..], *eb));
                    b.next();
                }
                std::cmp::Ordering::Equal => {
                    if ea != eb {
                        del.push((&ka[..], *ea));
                        add.push((&kb[..], *eb));
                    }
                    a.next();
                    b.next();
                }
            },
        }
    }
    (del, add)
}
