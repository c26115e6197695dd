//! nftables table ownership: which mode our tables use on this kernel, who holds an existing
//! table, and taking over a table a previous nodeproxy left behind.
//!
//! Kernel behaviour (checked on 6.18, see `nf_tables_api.c`): a table created with
//! `NFT_TABLE_F_OWNER` (5.12+) belongs to the creating netlink socket; every change from
//! another socket (`nft add element`, `nft delete table`) fails with EPERM, `nft flush ruleset`
//! skips it, and dumps (`nft list`, our read-back) still work. Without `NFT_TABLE_F_PERSIST`
//! (6.9+) the kernel deletes the table when the socket closes; with it the table stays, as an
//! orphan (the owner flag is dropped), which anyone may change or delete and which a NEWTABLE
//! carrying `NFT_TABLE_F_OWNER | NFT_TABLE_F_PERSIST` claims for its socket. A table created
//! without persist can never be claimed (EOPNOTSUPP).

use std::fmt;

use super::diff::{Op, Plan};
use super::uapi::{TABLE_F_OWNED, TABLE_F_OWNER, TABLE_F_PERSIST};
use super::{Kernel, NetlinkKernel, NftError};
use crate::model::IpFamily;
use crate::report;

/// Whether our tables are owned by the process programming them, from what the kernel supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ownership {
    /// `NFT_TABLE_F_OWNER | NFT_TABLE_F_PERSIST` (kernel 6.9+): while we run, no other process
    /// can change our tables; when we exit they stay, orphaned, and the next instance claims
    /// them.
    Owned,
    /// `NFT_TABLE_F_OWNER` without `NFT_TABLE_F_PERSIST` (kernels 5.12 to 6.8): not used, since
    /// the kernel deletes an owned table when its owner exits, and the rules must outlive the
    /// process (SIGTERM during an upgrade leaves them in place).
    NotPersistent,
    /// Neither flag (kernels before 5.12).
    Unsupported,
    /// Not used because `--table-ownership off` says so.
    Off,
}

impl Ownership {
    pub fn from_flags(owner: bool, persist: bool) -> Ownership {
        match (owner, persist) {
            (true, true) => Ownership::Owned,
            (true, false) => Ownership::NotPersistent,
            _ => Ownership::Unsupported,
        }
    }

    /// Whether our tables are created (and claimed) owned.
    pub fn enabled(self) -> bool {
        self == Ownership::Owned
    }
}

impl fmt::Display for Ownership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ownership::Owned => {
                "nftables table ownership: our tables are owned by this process (flags \
                 owner,persist; kernel 6.9+): no other process can change them while it runs, \
                 and they stay in place when it exits"
            }
            Ownership::NotPersistent => {
                "nftables table ownership: not used: the kernel supports the owner flag but not \
                 persist (kernels 5.12 to 6.8), and an owned table would be deleted when \
                 nodeproxy exits; changes by others are repaired at the next verification"
            }
            Ownership::Unsupported => {
                "nftables table ownership: not supported by this kernel (owner flag: 5.12+, \
                 persist: 6.9+); changes by others are repaired at the next verification"
            }
            Ownership::Off => {
                "nftables table ownership: off (--table-ownership off): our tables are \
                 ordinary ones; changes by others are repaired at the next verification"
            }
        })
    }
}

/// A table's header as the kernel dumps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableInfo {
    /// `NFTA_TABLE_FLAGS` (dormant, owner, persist).
    pub flags: u32,
    /// `NFTA_TABLE_OWNER`: the owner's netlink port id, while the table has one.
    pub owner: Option<u32>,
}

/// Who holds a table, from our socket's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// Owned by this socket.
    Us,
    /// Owned by another socket (its port id): only that process may change it.
    Other(u32),
    /// Persistent and unowned (its owner exited): anyone may change it, and a NEWTABLE with
    /// `NFT_TABLE_F_OWNER | NFT_TABLE_F_PERSIST` claims it.
    Orphan,
    /// Created without ownership: anyone may change it, and nobody can claim it.
    Unowned,
}

impl TableInfo {
    pub fn holder(&self, our_port: u32) -> Holder {
        match self.owner {
            Some(p) if self.flags & TABLE_F_OWNER != 0 => {
                if p == our_port {
                    Holder::Us
                } else {
                    Holder::Other(p)
                }
            }
            _ if self.flags & TABLE_F_PERSIST != 0 => Holder::Orphan,
            _ => Holder::Unowned,
        }
    }
}

/// Names the process behind netlink port `port` as far as it can be known: a process's first
/// netlink socket gets its pid as port id (nft's `# progname` comment relies on the same), so
/// `/proc/<port>/comm` names it when that process exists.
pub fn describe_owner(port: u32) -> String {
    match std::fs::read_to_string(format!("/proc/{port}/comm")) {
        Ok(comm) => format!(
            "netlink port {port}, the first socket of pid {port} `{}`",
            comm.trim()
        ),
        Err(_) => format!("netlink port {port}"),
    }
}

/// What [`take_over`] found for one family's table.
#[derive(Debug)]
pub enum TakeOver {
    /// No such table: the first sync creates it owned.
    Absent,
    /// Already ours.
    Ours,
    /// An orphan, now ours.
    Claimed,
    /// An orphan we could not claim (it changed meanwhile, or the kernel refused).
    ClaimFailed(NftError),
    /// Owned by another live process (its description): syncs fail with EPERM until it exits,
    /// then the table is an orphan and the next sync claims it.
    OwnedByOther(String),
    /// Created without persist: it cannot be claimed, and stays unowned until deleted.
    Unclaimable,
}

impl fmt::Display for TakeOver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TakeOver::Absent => f.write_str("does not exist yet; it is created owned"),
            TakeOver::Ours => f.write_str("is already owned by this process"),
            TakeOver::Claimed => f.write_str(
                "was left by a previous nodeproxy; taken over: no other process can change it now",
            ),
            TakeOver::ClaimFailed(e) => write!(
                f,
                "was left by a previous nodeproxy, but taking it over failed ({}); every sync \
                 tries again",
                report::chain(e)
            ),
            TakeOver::OwnedByOther(owner) => write!(
                f,
                "is owned by another process ({owner}): nodeproxy cannot change it until that \
                 process exits, and takes it over then"
            ),
            TakeOver::Unclaimable => f.write_str(
                "exists without ownership flags (created by a nodeproxy without table \
                 ownership, or by `nft -f`); the kernel cannot add ownership to an existing \
                 table, and recreating it would drop its affinity pins, so it stays unowned \
                 (changes by others are repaired at the next verification) until it is deleted, \
                 e.g. by `nodeproxy --cleanup` while nodeproxy is stopped",
            ),
        }
    }
}

/// With ownership off (`--table-ownership off`): the families whose table `name` still carries
/// the persist flag from a run with ownership. The kernel refuses to toggle persist on an
/// existing table (`nf_tables_updtable`: `(flags ^ table->flags) & NFT_TABLE_F_PERSIST` is
/// EOPNOTSUPP, kernel 6.9+), and nodeproxy does not recreate a table by itself (that drops the
/// affinity pins in its dynamic sets), so the operator is told how to get rid of it.
pub fn persisted(kernel: &mut NetlinkKernel, name: &str) -> Vec<IpFamily> {
    IpFamily::ALL
        .into_iter()
        .filter(|&family| {
            matches!(
                kernel.table_info(family, name),
                Ok(Some(info)) if info.flags & TABLE_F_PERSIST != 0
            )
        })
        .collect()
}

/// The warning for [`persisted`] tables, or `None` when there are none.
pub fn persisted_warning(families: &[IpFamily], name: &str) -> Option<String> {
    if families.is_empty() {
        return None;
    }
    let tables = families
        .iter()
        .map(|f| format!("table {} {name}", crate::nft::wire::family_keyword(*f)))
        .collect::<Vec<_>>()
        .join(" and ");
    Some(format!(
        "--table-ownership off, but {tables} still carries the persist flag of an earlier run \
         with ownership, and the kernel cannot clear it in place: `nft` before 1.1 keeps \
         printing it as an empty `flags` line. To start over with ordinary tables, stop \
         nodeproxy, run `nodeproxy --cleanup` (Services are not proxied until the next start), \
         then start it again"
    ))
}

/// At start-up, before the first sync: claims our tables where a previous nodeproxy left them
/// orphaned, and reports each family's state. Claiming changes no rule, so it need not wait for
/// the API server, and it protects the tables from then on instead of from the first sync,
/// which may be long in coming while the API server is unreachable.
pub fn take_over(kernel: &mut NetlinkKernel, name: &str) -> Vec<(IpFamily, TakeOver)> {
    let mut out = Vec::new();
    for family in IpFamily::ALL {
        let info = match kernel.table_info(family, name) {
            Ok(info) => info,
            Err(e) => {
                out.push((family, TakeOver::ClaimFailed(e)));
                continue;
            }
        };
        let state = match info.map(|i| i.holder(kernel.port_id())) {
            None => TakeOver::Absent,
            Some(Holder::Us) => TakeOver::Ours,
            Some(Holder::Other(port)) => TakeOver::OwnedByOther(describe_owner(port)),
            Some(Holder::Unowned) => TakeOver::Unclaimable,
            Some(Holder::Orphan) => {
                let plan = Plan {
                    family,
                    table: name.to_owned(),
                    phase1: vec![Op::UpdateTable {
                        flags: TABLE_F_OWNED,
                    }],
                    phase2: Vec::new(),
                };
                match kernel.apply(&plan) {
                    Ok(_) => TakeOver::Claimed,
                    Err(e) => TakeOver::ClaimFailed(e),
                }
            }
        };
        out.push((family, state));
    }
    out
}
