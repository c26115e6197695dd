//! The test-only fault switch [`REJECT_PORT_ENV`]: a [`Kernel`] wrapper that makes the real
//! kernel refuse the objects of chosen Service ports, so that the daemon's quarantine (and the
//! Events about it) can be tested end to end against a real kernel.
//!
//! The builder never produces an object the kernel refuses on purpose, so a test cannot get a
//! rejection from a valid Service; the wrapper therefore points the verdict of every element it
//! adds for such a port at a chain that does not exist, and the kernel answers ENOENT for it
//! exactly as it would for a bug of ours. Without the variable it passes everything through.

use std::sync::Arc;

use super::{ApplyStats, Kernel, NftError, Op, Plan, WireData, WireElem, WireTable};
use crate::model::IpFamily;

/// When set, the kernel is handed elements it must refuse for every Service port whose name is
/// the variable's value: renaming the port "fixes" the Service. The daemon tests set it; nothing
/// else should.
pub const REJECT_PORT_ENV: &str = "NODEPROXY_TEST_KERNEL_REJECT_PORT";

/// The chain the refused elements go to: no table has it.
const MISSING_CHAIN: &str = "nodeproxy-test-no-such-chain";

/// A kernel whose transactions carry refused elements for the Service ports named `port`.
pub struct Faulty<K> {
    inner: K,
    port: Option<String>,
}

impl<K: Kernel> Faulty<K> {
    /// Reads [`REJECT_PORT_ENV`]; unset (or empty), the wrapper changes nothing.
    pub fn from_env(inner: K) -> Faulty<K> {
        Faulty::new(inner, std::env::var(REJECT_PORT_ENV).ok())
    }

    /// Refuses the Service ports named `port` (none when `None` or empty).
    pub fn new(inner: K, port: Option<String>) -> Faulty<K> {
        let port = port.filter(|p| !p.is_empty());
        if let Some(p) = &port {
            tracing::warn!(
                "{REJECT_PORT_ENV} is set: the kernel is made to refuse Service ports named {p:?} \
                 (a test switch)"
            );
        }
        Faulty { inner, port }
    }

    pub fn inner(&mut self) -> &mut K {
        &mut self.inner
    }

    fn poisoned(&self, elem: &WireElem) -> Option<WireElem> {
        let port = self.port.as_deref()?;
        let origin = elem.origin.as_ref()?;
        if origin.port != port || !elem.data().is_some_and(WireData::is_verdict) {
            return None;
        }
        let mut poisoned = elem.clone();
        poisoned.set_data(Some(WireData::verdict(
            super::uapi::NFT_GOTO,
            Some(Arc::new(MISSING_CHAIN.to_owned())),
        )));
        Some(poisoned)
    }
}

/// `ops` with the elements that `replaced` (one list per op, in order) has a replacement for
/// replaced.
fn rewrite<'r>(
    ops: &'r [Op<'r>],
    replaced: &mut impl Iterator<Item = &'r Vec<Option<WireElem>>>,
) -> Vec<Op<'r>> {
    ops.iter()
        .map(|op| match (op, replaced.next()) {
            (Op::AddElems { set, def, elems }, Some(ours)) => Op::AddElems {
                set,
                def,
                elems: elems
                    .iter()
                    .zip(ours)
                    .map(|(&(key, elem), new)| (key, new.as_ref().unwrap_or(elem)))
                    .collect(),
            },
            _ => op.clone(),
        })
        .collect()
}

impl<K: Kernel> Kernel for Faulty<K> {
    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError> {
        self.inner.read_table(family, name)
    }

    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError> {
        // The replacements are made first so that the rewritten plan can borrow them.
        let replaced: Vec<Vec<Option<WireElem>>> = plan
            .ops()
            .map(|op| match op {
                Op::AddElems { elems, .. } => elems.iter().map(|(_, e)| self.poisoned(e)).collect(),
                _ => Vec::new(),
            })
            .collect();
        if replaced.iter().flatten().all(Option::is_none) {
            return self.inner.apply(plan);
        }
        let mut replaced = replaced.iter();
        let phase1 = rewrite(&plan.phase1, &mut replaced);
        let phase2 = rewrite(&plan.phase2, &mut replaced);
        let faulty = Plan {
            family: plan.family,
            table: plan.table.clone(),
            phase1,
            phase2,
        };
        self.inner.apply(&faulty)
    }

    fn delete_tables(&mut self, name: &str) -> Result<usize, NftError> {
        self.inner.delete_tables(name)
    }

    fn read_table_definitions(
        &mut self,
        family: IpFamily,
        name: &str,
    ) -> Result<Option<WireTable>, NftError> {
        self.inner.read_table_definitions(family, name)
    }

    fn generation_at_open(&mut self) -> Result<Option<u32>, NftError> {
        self.inner.generation_at_open()
    }

    fn read_seal(&mut self) -> Result<Option<String>, NftError> {
        self.inner.read_seal()
    }

    fn write_seal(&mut self, text: &str) -> Result<(), NftError> {
        self.inner.write_seal(text)
    }

    fn generation(&mut self) -> Result<u32, NftError> {
        self.inner.generation()
    }
}
