//! An in-memory kernel for unit tests, with the nftables semantics the diff relies on:
//! ENOENT for missing objects, EEXIST for exclusive adds and clashing elements, EBUSY for objects still referenced
//! (element references count as of the start of the transaction, as on kernels before 6.2),
//! ENFILE for an element past a set's size, and all-or-nothing transactions that report every
//! failing operation.

use std::collections::BTreeMap;

use super::diff::{Op, Plan};
use super::wire::{WireTable, family_keyword};
use super::{ApplyStats, Kernel, NftError, RejectedOp};
use crate::model::IpFamily;

#[derive(Debug, Default, Clone)]
pub struct FakeKernel {
    pub tables: BTreeMap<(IpFamily, String), WireTable>,
    /// Transactions committed so far (an empty plan must not add any).
    pub transactions: usize,
    /// The ruleset generation: moves with every committed transaction, ours or, through
    /// [`FakeKernel::tables_mut`], someone else's.
    generation: u32,
    /// The seal's text (`Kernel::write_seal`), as the comment of `SEAL_TABLE` would hold it.
    pub seal: Option<String>,
    /// Seals written: each is a transaction of its own, not counted in `transactions`.
    pub seals_written: usize,
    /// The generation when this "process" opened its handle, and its own commits since
    /// ([`Kernel::generation_at_open`]); [`FakeKernel::reopen`] starts a new process.
    opened_at: u32,
    own_commits: u32,
}

use super::ReplyKind::{Busy, Exists, Invalid, NotFound};

/// Whether the kernel accepts changing an existing table's flags from `cur` to `want`, written
/// after `nf_tables_updtable` (kernel 6.9+, with the fix that lets an owner resend its flags):
/// independent of `diff::table_flags_update`, so that tests catch a diff sending an update the
/// kernel would refuse.
fn kernel_accepts_table_update(cur: u32, want: u32) -> bool {
    use super::uapi::{TABLE_F_OWNER, TABLE_F_PERSIST};
    let has_owner = |f: u32| f & TABLE_F_OWNER != 0;
    let is_orphan = |f: u32| f & (TABLE_F_OWNER | TABLE_F_PERSIST) == TABLE_F_PERSIST;
    if want == cur {
        return true;
    }
    if (has_owner(cur) && !has_owner(want))
        || (has_owner(want) && !(has_owner(cur) || is_orphan(cur)))
    {
        return false;
    }
    (want ^ cur) & TABLE_F_PERSIST == 0
}

impl FakeKernel {
    pub fn new() -> FakeKernel {
        FakeKernel::default()
    }

    /// The same kernel as a new process sees it: its handle opens at the current generation.
    pub fn reopen(&mut self) {
        self.opened_at = self.generation;
        self.own_commits = 0;
    }

    /// The tables, to change them as another process would: the generation moves.
    pub fn tables_mut(&mut self) -> &mut BTreeMap<(IpFamily, String), WireTable> {
        self.generation = self.generation.wrapping_add(1);
        &mut self.tables
    }

    /// What the kernel does to our tables when the owning process exits (its netlink socket
    /// closes): owned persistent tables become orphans, owned ones without persist are deleted.
    pub fn owner_exits(&mut self) {
        use super::uapi::{TABLE_F_OWNER, TABLE_F_PERSIST};
        self.tables
            .retain(|_, t| t.flags & TABLE_F_OWNER == 0 || t.flags & TABLE_F_PERSIST != 0);
        for t in self.tables.values_mut() {
            t.flags &= !TABLE_F_OWNER;
        }
    }

    fn run(
        &self,
        family: IpFamily,
        table: &str,
        ops: &[Op<'_>],
        phase: u8,
    ) -> Result<BTreeMap<(IpFamily, String), WireTable>, Vec<RejectedOp>> {
        let mut tables = self.tables.clone();
        let key = (family, table.to_owned());
        let before = tables.get(&key).cloned();
        let desc = format!("table {} {table}", family_keyword(family));
        let mut errors = Vec::new();
        for op in ops {
            if let Err((errno, object)) = apply_op(&mut tables, &key, before.as_ref(), op, &desc) {
                errors.push(RejectedOp {
                    op: op.kind(),
                    object,
                    origin: None,
                    errno,
                    ext_ack: None,
                    ext_ack_offset: None,
                    phase,
                });
            }
        }
        if errors.is_empty() {
            Ok(tables)
        } else {
            Err(errors)
        }
    }
}

/// The errno the kernel answers with, and the object it refused.
type OpErr = (std::io::Error, String);

fn apply_op(
    tables: &mut BTreeMap<(IpFamily, String), WireTable>,
    key: &(IpFamily, String),
    before: Option<&WireTable>,
    op: &Op<'_>,
    desc: &str,
) -> Result<(), OpErr> {
    if let Op::AddTable { flags, userdata } = op {
        let t = tables.entry(key.clone()).or_insert_with(|| {
            let mut t = WireTable::new(key.0, &key.1);
            t.userdata = userdata.to_vec();
            t.flags = *flags;
            t
        });
        // NEWTABLE on an existing table is an update of its flags.
        if !kernel_accepts_table_update(t.flags, *flags) {
            return Err((Invalid.errno(), desc.to_owned())); // the kernel's EOPNOTSUPP
        }
        t.flags = *flags;
        return Ok(());
    }
    let Some(t) = tables.get_mut(key) else {
        return Err((NotFound.errno(), desc.to_owned()));
    };
    match op {
        Op::AddTable { .. } => {}
        Op::UpdateTable { flags } => {
            if !kernel_accepts_table_update(t.flags, *flags) {
                return Err((Invalid.errno(), desc.to_owned())); // the kernel's EOPNOTSUPP
            }
            t.flags = *flags;
        }
        Op::AddChain { name, chain } => {
            if t.chains.contains_key(*name) {
                return Err((Exists.errno(), format!("chain {name} of {desc}")));
            }
            let mut c = (*chain).clone();
            c.rules.clear();
            t.add_chain(name, c);
        }
        Op::DelChain { name } => {
            if !t.chains.contains_key(*name) {
                return Err((NotFound.errno(), format!("chain {name} of {desc}")));
            }
            let by_rule = t
                .chains
                .iter()
                .filter(|(n, _)| n.as_str() != *name)
                .any(|(_, c)| c.rules.iter().any(|r| r.chain_refs().any(|x| x == *name)));
            // Before kernel 6.2, element references are released only at commit: an element
            // removed in this transaction still holds the chain.
            let elem_ref = |t: &WireTable| {
                t.sets
                    .values()
                    .any(|s| s.elements.values().any(|e| e.chain() == Some(*name)))
            };
            if by_rule || elem_ref(t) || before.is_some_and(elem_ref) {
                return Err((Busy.errno(), format!("chain {name} of {desc}")));
            }
            t.chains.remove(*name);
            t.chain_order.retain(|n| n != name);
        }
        Op::FlushChain { name } => match t.chains.get_mut(*name) {
            Some(c) => c.rules.clear(),
            None => return Err((NotFound.errno(), format!("chain {name} of {desc}"))),
        },
        Op::AddRule { chain, index, rule } => {
            let object = format!("rule {} of chain {chain} of {desc}", index + 1);
            for s in rule.set_refs() {
                if !t.sets.contains_key(&s) {
                    return Err((NotFound.errno(), object));
                }
            }
            for c in rule.chain_refs() {
                if !t.chains.contains_key(&c) {
                    return Err((NotFound.errno(), object));
                }
            }
            match t.chains.get_mut(*chain) {
                Some(c) => c.rules.push((*rule).clone()),
                None => return Err((NotFound.errno(), object)),
            }
        }
        Op::AddSet { name, set } => {
            if t.sets.contains_key(*name) {
                return Err((Exists.errno(), set.describe(name, desc)));
            }
            let mut s = (*set).clone();
            s.elements.clear();
            t.add_set(name, s);
        }
        Op::DelSet { name } => {
            if !t.sets.contains_key(*name) {
                return Err((NotFound.errno(), format!("set {name} of {desc}")));
            }
            if t.chains
                .values()
                .any(|c| c.rules.iter().any(|r| r.set_refs().any(|s| s == *name)))
            {
                return Err((Busy.errno(), format!("set {name} of {desc}")));
            }
            t.sets.remove(*name);
            t.set_order.retain(|n| n != name);
        }
        Op::AddElems { set, elems, .. } => {
            let chains: Vec<String> = t.chains.keys().cloned().collect();
            let Some(s) = t.sets.get_mut(*set) else {
                return Err((NotFound.errno(), format!("set {set} of {desc}")));
            };
            for (k, e) in elems {
                let object = format!("element {} in {}", s.format_key(k), s.describe(set, desc));
                if k.len() != s.key_len as usize {
                    return Err((Invalid.errno(), object));
                }
                // Adds are not exclusive (see netlink.rs): like the kernel, an element that
                // exists with the same data is left as it is; different data is a clash.
                if let Some(existing) = s.elements.get(*k) {
                    if existing.data() != e.data() {
                        return Err((Exists.errno(), object));
                    }
                    continue;
                }
                if let Some(c) = e.chain()
                    && !chains.iter().any(|x| x == c)
                {
                    return Err((NotFound.errno(), object));
                }
                // A size is the set's maximum: `nft_add_set_elem` counts a new element against
                // the size plus the elements this transaction deleted (`ndeact`), so a delete
                // and an add in one transaction fit in a full set; the fake deletes at once,
                // which counts the same.
                if s.size.is_some_and(|max| s.elements.len() >= max as usize) {
                    return Err((std::io::Error::from_raw_os_error(nix::libc::ENFILE), object));
                }
                s.elements.insert((*k).into(), (*e).clone());
            }
        }
        Op::DelElems { set, elems, .. } => {
            let Some(s) = t.sets.get_mut(*set) else {
                return Err((NotFound.errno(), format!("set {set} of {desc}")));
            };
            for (k, _) in elems {
                if s.elements.remove(*k).is_none() {
                    return Err((
                        NotFound.errno(),
                        format!("element {} in {}", s.format_key(k), s.describe(set, desc)),
                    ));
                }
            }
        }
    }
    Ok(())
}

impl Kernel for FakeKernel {
    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError> {
        Ok(self.tables.get(&(family, name.to_owned())).map(|t| {
            let mut t = t.clone();
            // The kernel does not store origins.
            for s in t.sets.values_mut() {
                for e in s.elements.values_mut() {
                    e.origin = None;
                }
            }
            t
        }))
    }

    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError> {
        let mut stats = ApplyStats::default();
        let before = self.generation()?;
        for (phase, ops) in [(1u8, &plan.phase1), (2, &plan.phase2)] {
            if ops.is_empty() {
                continue;
            }
            match self.run(plan.family, &plan.table, ops, phase) {
                Ok(t) => {
                    self.tables = t;
                    self.transactions += 1;
                    self.generation = self.generation.wrapping_add(1);
                    self.own_commits = self.own_commits.wrapping_add(1);
                    stats.messages += ops.len() + 2;
                }
                Err(errors) => return Err(NftError::Rejected { errors }),
            }
        }
        stats.generation = Some((before, self.generation()?));
        Ok(stats)
    }

    fn delete_tables(&mut self, name: &str) -> Result<usize, NftError> {
        let before = self.tables.len();
        self.tables.retain(|(_, n), _| n != name);
        if self.tables.len() != before {
            self.transactions += 1;
            self.generation = self.generation.wrapping_add(1);
        }
        Ok(before - self.tables.len())
    }

    fn generation(&mut self) -> Result<u32, NftError> {
        Ok(self.generation)
    }

    fn generation_at_open(&mut self) -> Result<Option<u32>, NftError> {
        let now = self.opened_at.wrapping_add(self.own_commits);
        Ok((self.generation == now).then_some(self.opened_at))
    }

    fn read_seal(&mut self) -> Result<Option<String>, NftError> {
        Ok(self.seal.clone())
    }

    fn write_seal(&mut self, text: &str) -> Result<(), NftError> {
        self.seal = Some(text.to_owned());
        self.seals_written += 1;
        self.generation = self.generation.wrapping_add(1);
        self.own_commits = self.own_commits.wrapping_add(1);
        Ok(())
    }
}
