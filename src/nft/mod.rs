//! The kernel side: lowering the ruleset to netlink, applying, reading back.
//!
//! `wire::lower` turns a ruleset table into its encoded form, `Kernel::read_table` reads ours
//! back in the same form, `diff::diff` computes the operations between the two, and
//! `Kernel::apply` sends them as (at most two) atomic transactions. `sync` does all of it.

pub mod diff;
pub mod fake;
pub mod fault;
pub mod leftovers;
pub mod netlink;
pub mod owner;
pub mod preview;
pub mod probe;
pub mod uapi;
pub mod udata;
pub mod wire;

#[cfg(test)]
mod tests;

use std::fmt;
use std::time::{Duration, Instant};

pub use diff::{Op, Plan, diff};
pub use fake::FakeKernel;
pub use netlink::NetlinkKernel;
pub use wire::{
    ChainName, DataRef, ElemBytes, WireChain, WireData, WireElem, WireExpr, WireHook, WireRule,
    WireSet, WireTable, kind_names, lower, lower_owned, size_sets,
};

use crate::model::{IpFamily, ServicePortName};
use crate::ruleset::Ruleset;

/// What the kernel's answer to one operation means to us. nf_tables answers with an errno; these
/// are the ones sync, cleanup, the fake kernel and the rejection metric tell apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ReplyKind {
    /// ENOENT: the object (or the one it refers to) does not exist.
    NotFound,
    /// EEXIST: an exclusive add of an object or element that exists.
    Exists,
    /// EBUSY: an object still referenced (a chain jumped to, a set looked up).
    Busy,
    /// EPERM (or EACCES): another process owns the table, or we lack CAP_NET_ADMIN.
    Permission,
    /// EINVAL, EOPNOTSUPP, ERANGE, E2BIG: the kernel cannot take the object as built.
    Invalid,
    /// Anything else (ENOMEM, ENOBUFS, …).
    Other,
}

impl ReplyKind {
    pub const ALL: [ReplyKind; 6] = [
        ReplyKind::NotFound,
        ReplyKind::Exists,
        ReplyKind::Busy,
        ReplyKind::Permission,
        ReplyKind::Invalid,
        ReplyKind::Other,
    ];

    /// The kind of an errno the kernel answered with.
    pub fn of(err: &std::io::Error) -> ReplyKind {
        use nix::libc;
        match err.raw_os_error() {
            Some(libc::ENOENT) => ReplyKind::NotFound,
            Some(libc::EEXIST) => ReplyKind::Exists,
            Some(libc::EBUSY) => ReplyKind::Busy,
            Some(libc::EPERM | libc::EACCES) => ReplyKind::Permission,
            Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ERANGE | libc::E2BIG) => {
                ReplyKind::Invalid
            }
            _ => ReplyKind::Other,
        }
    }

    /// The errno a kernel answers with for this kind (what the fake kernel answers).
    pub fn errno(self) -> std::io::Error {
        use nix::libc;
        std::io::Error::from_raw_os_error(match self {
            ReplyKind::NotFound => libc::ENOENT,
            ReplyKind::Exists => libc::EEXIST,
            ReplyKind::Busy => libc::EBUSY,
            ReplyKind::Permission => libc::EPERM,
            ReplyKind::Invalid => libc::EINVAL,
            ReplyKind::Other => libc::EIO,
        })
    }

    /// The `kind` label of `nodeproxy_kernel_rejections_total`.
    pub fn label(self) -> &'static str {
        match self {
            ReplyKind::NotFound => "not_found",
            ReplyKind::Exists => "exists",
            ReplyKind::Busy => "busy",
            ReplyKind::Permission => "permission",
            ReplyKind::Invalid => "invalid",
            ReplyKind::Other => "other",
        }
    }
}

/// One operation the kernel refused.
#[derive(Debug)]
pub struct RejectedOp {
    /// `add element`, `delete chain`, …
    pub op: &'static str,
    /// `element 10.96.0.10 . tcp . 80 : goto x in map service-ips of table ip nodeproxy`
    pub object: String,
    /// The Service port the object was built for, when known.
    pub origin: Option<ServicePortName>,
    pub errno: std::io::Error,
    /// The kernel's extended ack message, if it sent one.
    pub ext_ack: Option<String>,
    /// Offset of the offending attribute in the failing message (`NLMSGERR_ATTR_OFFS`).
    pub ext_ack_offset: Option<u32>,
    /// Transaction 1 or 2 of the plan.
    pub phase: u8,
}

impl fmt::Display for RejectedOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.op, self.object)?;
        if let Some(o) = &self.origin {
            write!(f, " (Service {o})")?;
        }
        write!(f, ": {}", self.errno)?;
        if let Some(m) = &self.ext_ack {
            write!(f, ": {m}")?;
        }
        if let Some(o) = self.ext_ack_offset {
            write!(f, " [attribute at offset {o}]")?;
        }
        Ok(())
    }
}

impl RejectedOp {
    /// What the kernel's errno means.
    pub fn kind(&self) -> ReplyKind {
        ReplyKind::of(&self.errno)
    }
}

fn list_rejected(errors: &[RejectedOp]) -> String {
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("{context}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("the kernel rejected the transaction ({} error(s)): {}", errors.len(), list_rejected(errors))]
    Rejected { errors: Vec<RejectedOp> },
    #[error("cannot express {object}{}: {reason}", origin.as_ref().map(|o| format!(" (Service {o})")).unwrap_or_default())]
    Invalid {
        object: String,
        reason: String,
        origin: Option<Box<ServicePortName>>,
    },
    #[error("unexpected netlink data: {0}")]
    Protocol(String),
    #[error("outcome of the transaction unknown: {0}")]
    Unknown(String),
    #[error("dump interrupted by concurrent ruleset changes, retries exhausted")]
    Interrupted,
    /// EPERM: the table is owned by another process (nftables table ownership), or we lack
    /// CAP_NET_ADMIN. Not a Service's fault, so never a reason to quarantine one.
    #[error("{}", denied_message(table, owner.as_deref()))]
    Denied {
        /// `table ip nodeproxy`
        table: String,
        /// Who owns it, when the kernel says (see `NetlinkKernel::describe_owner`).
        owner: Option<String>,
    },
}

fn denied_message(table: &str, owner: Option<&str>) -> String {
    match owner {
        Some(owner) => format!(
            "{table} is owned by another process ({owner}): only the owner of a table may \
             change or delete it (nftables table ownership); stop that process first (a \
             nodeproxy leaves its table in place and the next one takes it over)"
        ),
        None => format!(
            "the kernel refused to change {table} (EPERM): changing nftables needs \
             CAP_NET_ADMIN in the network namespace"
        ),
    }
}

/// What one `apply` did.
#[derive(Debug, Clone, Default)]
pub struct ApplyStats {
    pub messages: usize,
    pub bytes: usize,
    /// Time spent encoding batches.
    pub encode: Duration,
    /// Time from send to the last reply.
    pub kernel: Duration,
    /// Whether the kernel acked BATCH_END (kernels ≥ 6.10 do on success).
    pub batch_end_acked: bool,
    /// The ruleset generation just before and just after this apply, when the kernel can tell
    /// that nothing but this apply's own transactions committed in between; `None` otherwise
    /// (another process committed meanwhile, or nothing is known).
    pub generation: Option<(u32, u32)>,
}

/// A kernel holding nftables tables: the netlink backend, or the in-memory fake.
pub trait Kernel {
    /// Reads our table back in wire form; `None` when it does not exist. Its flags carry
    /// `NFT_TABLE_F_OWNER` only when this handle owns the table: a table owned by another
    /// process reads as an orphan, so that the diff tries to claim it and the kernel's EPERM
    /// then names the owner ([`NftError::Denied`]).
    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError>;
    /// Applies a plan: phase 1 as one transaction, then phase 2 as another.
    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError>;
    /// Deletes table `name` of families ip and ip6 where present (`--cleanup`), all in one
    /// transaction: both or neither (a table owned by another process fails it with
    /// [`NftError::Denied`]). Returns how many were deleted. Tables of other names or families
    /// are never touched.
    fn delete_tables(&mut self, name: &str) -> Result<usize, NftError>;
    /// The netns' nftables ruleset generation (`NFT_MSG_GETGEN`): every committed transaction,
    /// by any process and on any table, changes it; packet-path set updates do not. Equal
    /// before and after a period means nobody changed anything in that period.
    fn generation(&mut self) -> Result<u32, NftError>;
    /// Reads our table back like [`Kernel::read_table`], but without the elements of its sets:
    /// chains, rules and set definitions only. What an adoption the previous process sealed
    /// needs (`sync::seal`): the elements are what cost (the kernel restarts its set walk for
    /// every dump message), and the seal proves what they are.
    fn read_table_definitions(
        &mut self,
        family: IpFamily,
        name: &str,
    ) -> Result<Option<WireTable>, NftError> {
        let mut table = self.read_table(family, name)?;
        for set in table.iter_mut().flat_map(|t| t.sets.values_mut()) {
            set.elements.clear();
        }
        Ok(table)
    }
    /// The generation this handle found when it was opened, if every transaction committed
    /// since is one of its own (`None` otherwise, or when it cannot tell): what a seal written
    /// before this process started is checked against, since a process commits before its
    /// first sync (capability probes, claiming its tables, removing kube-proxy's leftovers).
    fn generation_at_open(&mut self) -> Result<Option<u32>, NftError> {
        Ok(None)
    }
    /// The seal a previous process left ([`SEAL_TABLE`]'s comment); `None` when there is none,
    /// or when this kernel keeps none (a preview, the test doubles).
    fn read_seal(&mut self) -> Result<Option<String>, NftError> {
        Ok(None)
    }
    /// Replaces the seal with `text`, in one transaction of its own. A kernel that keeps no
    /// seal ignores it.
    fn write_seal(&mut self, text: &str) -> Result<(), NftError> {
        let _ = text;
        Ok(())
    }
}

/// The table holding the seal (`sync::seal`): `table ip nodeproxy-seal`, with no chains or sets
/// and so no effect on any packet, its comment the seal. A table of its own because the
/// kernel never updates a table's, set's or chain's comment in place (tested on 6.18: `nft add
/// table ip t { comment "b"; }` on an existing table keeps its old comment), and replacing an
/// element of our own table would make the seal part of the ruleset every sync compares.
pub const SEAL_TABLE: &str = "nodeproxy-seal";

/// A borrowed kernel is a kernel, so a caller can lend its handle to a one-shot sync and look at
/// it afterwards.
impl<K: Kernel + ?Sized> Kernel for &mut K {
    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError> {
        (**self).read_table(family, name)
    }
    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError> {
        (**self).apply(plan)
    }
    fn delete_tables(&mut self, name: &str) -> Result<usize, NftError> {
        (**self).delete_tables(name)
    }
    fn generation(&mut self) -> Result<u32, NftError> {
        (**self).generation()
    }
    fn read_table_definitions(
        &mut self,
        family: IpFamily,
        name: &str,
    ) -> Result<Option<WireTable>, NftError> {
        (**self).read_table_definitions(family, name)
    }
    fn generation_at_open(&mut self) -> Result<Option<u32>, NftError> {
        (**self).generation_at_open()
    }
    fn read_seal(&mut self) -> Result<Option<String>, NftError> {
        (**self).read_seal()
    }
    fn write_seal(&mut self, text: &str) -> Result<(), NftError> {
        (**self).write_seal(text)
    }
}

/// What `sync` did, for logs, metrics and benchmarks.
#[derive(Debug, Clone, Default)]
pub struct SyncReport {
    pub tables: usize,
    pub messages: usize,
    pub bytes: usize,
    pub elements_added: usize,
    pub elements_removed: usize,
    pub chains_rewritten: usize,
    /// Orphaned tables (left by an exited nodeproxy) taken over: see `diff::table_flags_update`.
    pub tables_claimed: usize,
    /// Plans with nothing to do are not sent.
    pub empty_plans: usize,
    /// Tables adopted on the previous process's seal: their elements were not read back
    /// (`sync::seal`).
    pub tables_adopted: usize,
    /// Lowering the IR.
    pub lower: Duration,
    /// Reading our tables back.
    pub read: Duration,
    /// Diffing.
    pub diff: Duration,
    /// Encoding batches.
    pub encode: Duration,
    /// Send until the last reply.
    pub kernel: Duration,
}

impl SyncReport {
    /// Counts what `plan` changes (before it is sent).
    pub fn count_plan(&mut self, plan: &Plan<'_>) {
        self.elements_added += plan.elements_added();
        self.elements_removed += plan.elements_removed();
        self.chains_rewritten += plan.chains_rewritten();
        self.tables_claimed += plan.tables_claimed();
    }

    /// Counts what sending a plan cost.
    pub fn count_apply(&mut self, st: &ApplyStats) {
        self.messages += st.messages;
        self.bytes += st.bytes;
        self.encode += st.encode;
        self.kernel += st.kernel;
    }
}

impl fmt::Display for SyncReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        write!(
            f,
            "synced {} table(s): {} element(s) added, {} removed, {} chain(s) rewritten; ",
            self.tables, self.elements_added, self.elements_removed, self.chains_rewritten,
        )?;
        if self.tables_claimed > 0 {
            write!(f, "took over {} orphaned table(s); ", self.tables_claimed)?;
        }
        write!(
            f,
            "{} message(s), {} bytes; lower {:.2} ms, read back {:.2} ms, diff {:.2} ms, \
             encode {:.2} ms, kernel {:.3} ms",
            self.messages,
            self.bytes,
            ms(self.lower),
            ms(self.read),
            ms(self.diff),
            ms(self.encode),
            ms(self.kernel),
        )?;
        if self.tables_adopted > 0 {
            write!(
                f,
                "; adopted {} table(s) on the previous process's seal (elements not read back)",
                self.tables_adopted
            )?;
        }
        Ok(())
    }
}

/// Brings every table of `desired` into the kernel: read back, diff, apply.
pub fn sync(kernel: &mut impl Kernel, desired: Ruleset) -> Result<SyncReport, NftError> {
    let mut rep = SyncReport::default();
    apply_tables(kernel, desired, &mut rep)?;
    Ok(rep)
}

/// Lowers and applies each table of `desired` against what the kernel holds (read back).
fn apply_tables(
    kernel: &mut impl Kernel,
    desired: Ruleset,
    rep: &mut SyncReport,
) -> Result<(), NftError> {
    for table in desired.tables {
        let (family, name) = (table.family, table.name.clone());
        let t = Instant::now();
        let mut want = lower_owned(table)?;
        rep.lower += t.elapsed();
        let t = Instant::now();
        let current = kernel.read_table(family, &name)?;
        rep.read += t.elapsed();
        size_sets(&mut want, current.as_ref());
        apply_diff(kernel, current.as_ref(), &want, rep)?;
    }
    Ok(())
}

/// The step every sync path ends with: diffs `want` against `have` (what the kernel holds) and
/// sends the difference as one transaction, counting both in `rep`. `None` when there was
/// nothing to send.
pub fn apply_diff(
    kernel: &mut impl Kernel,
    have: Option<&WireTable>,
    want: &WireTable,
    rep: &mut SyncReport,
) -> Result<Option<ApplyStats>, NftError> {
    let t = Instant::now();
    let plan = diff(have, want);
    rep.diff += t.elapsed();
    rep.tables += 1;
    if plan.is_empty() {
        rep.empty_plans += 1;
        return Ok(None);
    }
    rep.count_plan(&plan);
    let st = kernel.apply(&plan)?;
    rep.count_apply(&st);
    Ok(Some(st))
}
