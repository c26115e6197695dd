//! Detects and removes what kube-proxy leaves in the kernel, without running any binary: its
//! nftables-mode tables (`ip kube-proxy`, `ip6 kube-proxy`), the `KUBE-*` chains its iptables
//! mode created through iptables-nft (which are ordinary nftables chains in the tables `nat`,
//! `filter` and `mangle`), and the presence of legacy (x_tables) iptables tables, which only the
//! iptables binary can list.
//!
//! Two proxies programming one node fight over every packet; see DESIGN and
//! `reference/peers.md` §4.5.

use std::fmt;
use std::io;
use std::path::PathBuf;

use super::netlink::RawMsg;
use super::uapi::{
    CHAIN_NAME, CHAIN_TABLE, DELCHAIN, DELRULE, DELTABLE, GETCHAIN, GETRULE, GETTABLE, RULE_CHAIN,
    RULE_EXPRESSIONS, RULE_HANDLE, RULE_TABLE, TABLE_NAME,
};
use super::wire::{self, family_keyword, nfproto};
use super::{NetlinkKernel, NftError};
use crate::model::IpFamily;
use crate::netlink::{Attrs, NLA_TYPE_MASK, cstr, put_attr, put_str};

/// The table kube-proxy's nftables mode owns in each family.
pub const KUBE_PROXY_TABLE: &str = "kube-proxy";
/// The iptables tables kube-proxy's iptables mode writes to.
pub const IPTABLES_TABLES: [&str; 3] = ["nat", "filter", "mangle"];
/// Chains with the `KUBE-` prefix that kubelet, not kube-proxy, owns: kubelet uses them as
/// canaries to notice a flushed ruleset and recreates them, so removing them only causes churn.
pub const KUBELET_CHAINS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leftover {
    /// kube-proxy's nftables-mode table.
    NftTable { family: IpFamily, name: String },
    /// `KUBE-*` chains in an iptables-nft table.
    IptablesNftChains {
        family: IpFamily,
        table: String,
        chains: Vec<String>,
    },
    /// Legacy iptables tables are loaded (`/proc/net/ip_tables_names`, `ip6_tables_names`):
    /// they may hold `KUBE-*` chains, which cannot be listed without the iptables binary.
    LegacyIptables {
        family: IpFamily,
        tables: Vec<String>,
    },
}

impl fmt::Display for Leftover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Leftover::NftTable { family, name } => write!(
                f,
                "nftables table {} {name} (kube-proxy nftables mode)",
                family_keyword(*family)
            ),
            Leftover::IptablesNftChains {
                family,
                table,
                chains,
            } => {
                let shown: Vec<&str> = chains.iter().take(5).map(String::as_str).collect();
                write!(
                    f,
                    "{} KUBE-* chain(s) in iptables-nft table {} {table} (kube-proxy iptables \
                     mode): {}{}",
                    chains.len(),
                    family_keyword(*family),
                    shown.join(", "),
                    if chains.len() > shown.len() {
                        ", …"
                    } else {
                        ""
                    }
                )
            }
            Leftover::LegacyIptables { family, tables } => write!(
                f,
                "legacy {} tables are loaded ({}); they may hold KUBE-* chains, which only \
                 `{}-legacy-save` can list",
                match family {
                    IpFamily::V4 => "iptables",
                    IpFamily::V6 => "ip6tables",
                },
                tables.join(", "),
                match family {
                    IpFamily::V4 => "iptables",
                    IpFamily::V6 => "ip6tables",
                },
            ),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeftoverError {
    #[error("kube-proxy leftovers")]
    Nft(#[from] NftError),
    #[error("kube-proxy leftovers: read {}", path.display())]
    Proc { path: PathBuf, source: io::Error },
}

/// What [`remove`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    pub tables: usize,
    pub chains: usize,
    /// Rules in other chains (e.g. `PREROUTING`) that jumped to a removed chain.
    pub jump_rules: usize,
    /// Leftovers that cannot be removed without other tools (legacy iptables).
    pub skipped: Vec<Leftover>,
}

/// Finds kube-proxy's leftovers in the current network namespace.
pub fn detect() -> Result<Vec<Leftover>, LeftoverError> {
    detect_with(&mut NetlinkKernel::new()?)
}

/// Removes the given leftovers: per family one atomic transaction that deletes the jumps to
/// `KUBE-*` chains from other chains, flushes and deletes those chains, and deletes the
/// `kube-proxy` tables. The chains of a listed iptables-nft table are looked up again at
/// removal time, so chains created since `detect` go too.
pub fn remove(leftovers: &[Leftover]) -> Result<Removed, LeftoverError> {
    remove_with(&mut NetlinkKernel::new()?, leftovers)
}

fn table_names(kernel: &mut NetlinkKernel, family: IpFamily) -> Result<Vec<String>, NftError> {
    let mut names = Vec::new();
    for t in kernel.dump_raw(nfproto(family), GETTABLE, None)? {
        for (ty, p, _) in Attrs::new(&t) {
            if ty & NLA_TYPE_MASK == TABLE_NAME {
                names.push(cstr(p));
            }
        }
    }
    Ok(names)
}

fn is_kube_chain(name: &str) -> bool {
    name.starts_with("KUBE-") && !KUBELET_CHAINS.contains(&name)
}

/// The `KUBE-*` chains of one table, sorted.
fn kube_chains(
    kernel: &mut NetlinkKernel,
    family: IpFamily,
    table: &str,
) -> Result<Vec<String>, NftError> {
    let mut chains = Vec::new();
    for c in kernel.dump_raw(nfproto(family), GETCHAIN, Some(table))? {
        let (mut t, mut n) = (String::new(), String::new());
        for (ty, p, _) in Attrs::new(&c) {
            match ty & NLA_TYPE_MASK {
                CHAIN_TABLE => t = cstr(p),
                CHAIN_NAME => n = cstr(p),
                _ => {}
            }
        }
        if t == table && is_kube_chain(&n) {
            chains.push(n);
        }
    }
    chains.sort();
    Ok(chains)
}

/// Legacy x_tables tables loaded in this network namespace. `/proc/thread-self/net` follows
/// the calling thread's namespace (`/proc/net` is `/proc/self/net`, the main thread's);
/// a missing file means the x_tables module is not loaded.
fn legacy_tables(family: IpFamily) -> Result<Vec<String>, LeftoverError> {
    let file = match family {
        IpFamily::V4 => "ip_tables_names",
        IpFamily::V6 => "ip6_tables_names",
    };
    let path = PathBuf::from("/proc/thread-self/net").join(file);
    match std::fs::read_to_string(&path) {
        Ok(text) => Ok(text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(source) => Err(LeftoverError::Proc { path, source }),
    }
}

/// [`detect`] with a given netlink kernel.
pub fn detect_with(kernel: &mut NetlinkKernel) -> Result<Vec<Leftover>, LeftoverError> {
    let mut found = Vec::new();
    for family in IpFamily::ALL {
        let tables = table_names(kernel, family)?;
        if tables.iter().any(|t| t == KUBE_PROXY_TABLE) {
            found.push(Leftover::NftTable {
                family,
                name: KUBE_PROXY_TABLE.to_owned(),
            });
        }
        for table in IPTABLES_TABLES {
            if !tables.iter().any(|t| t == table) {
                continue;
            }
            let chains = kube_chains(kernel, family, table)?;
            if !chains.is_empty() {
                found.push(Leftover::IptablesNftChains {
                    family,
                    table: table.to_owned(),
                    chains,
                });
            }
        }
        let legacy = legacy_tables(family)?;
        if !legacy.is_empty() {
            found.push(Leftover::LegacyIptables {
                family,
                tables: legacy,
            });
        }
    }
    Ok(found)
}

/// A rule as far as removal cares: where it is, its handle, the chains it jumps or goes to.
struct RuleRef {
    chain: String,
    handle: u64,
    targets: Vec<String>,
}

fn rules_of(
    kernel: &mut NetlinkKernel,
    family: IpFamily,
    table: &str,
) -> Result<Vec<RuleRef>, NftError> {
    let mut out = Vec::new();
    for r in kernel.dump_raw(nfproto(family), GETRULE, Some(table))? {
        let (mut t, mut chain, mut handle) = (String::new(), String::new(), None);
        let mut targets = Vec::new();
        for (ty, p, _) in Attrs::new(&r) {
            match ty & NLA_TYPE_MASK {
                RULE_TABLE => t = cstr(p),
                RULE_CHAIN => chain = cstr(p),
                RULE_HANDLE => handle = p.get(..8).and_then(|b| b.try_into().ok()),
                RULE_EXPRESSIONS => {
                    for (_, e, _) in Attrs::new(p) {
                        // iptables-nft encodes `-j CHAIN` and `-g CHAIN` as immediates.
                        targets.extend(wire::expr::decode(e).chain_ref());
                    }
                }
                _ => {}
            }
        }
        if t != table {
            continue;
        }
        if let Some(h) = handle {
            out.push(RuleRef {
                chain,
                handle: u64::from_be_bytes(h),
                targets,
            });
        }
    }
    Ok(out)
}

fn table_attrs(table: &str) -> Vec<u8> {
    let mut a = Vec::new();
    put_str(&mut a, TABLE_NAME, table);
    a
}

fn chain_attrs(table: &str, chain: &str) -> Vec<u8> {
    let mut a = Vec::new();
    put_str(&mut a, CHAIN_TABLE, table);
    put_str(&mut a, CHAIN_NAME, chain);
    a
}

/// DELRULE attributes that flush one chain. NFTA_RULE_CHAIN is attribute 2 (attribute 3 is
/// the handle): a DELRULE without a chain flushes every chain of the table.
fn flush_attrs(table: &str, chain: &str) -> Vec<u8> {
    let mut a = Vec::new();
    put_str(&mut a, RULE_TABLE, table);
    put_str(&mut a, RULE_CHAIN, chain);
    a
}

/// [`remove`] with a given netlink kernel.
pub fn remove_with(
    kernel: &mut NetlinkKernel,
    leftovers: &[Leftover],
) -> Result<Removed, LeftoverError> {
    let mut done = Removed::default();
    for family in IpFamily::ALL {
        let fam = nfproto(family);
        let kw = family_keyword(family);
        let (mut jumps, mut flushes, mut chains, mut tables) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for l in leftovers {
            match l {
                // Gone since detection: nothing to do.
                Leftover::NftTable { family: f, name }
                    if *f == family && table_names(kernel, family)?.contains(name) =>
                {
                    tables.push(RawMsg {
                        ty: DELTABLE,
                        flags: 0,
                        family: fam,
                        attrs: table_attrs(name),
                        op: "delete table",
                        object: format!("table {kw} {name}"),
                    });
                }
                Leftover::IptablesNftChains {
                    family: f, table, ..
                } if *f == family => {
                    let doomed = kube_chains(kernel, family, table)?;
                    if doomed.is_empty() {
                        continue;
                    }
                    // Rules elsewhere in the table that jump to a doomed chain go first: a
                    // referenced chain cannot be deleted (EBUSY).
                    for r in rules_of(kernel, family, table)? {
                        if doomed.contains(&r.chain)
                            || !r.targets.iter().any(|t| doomed.contains(t))
                        {
                            continue;
                        }
                        let mut attrs = Vec::new();
                        put_str(&mut attrs, RULE_TABLE, table);
                        put_str(&mut attrs, RULE_CHAIN, &r.chain);
                        put_attr(&mut attrs, RULE_HANDLE, &r.handle.to_be_bytes());
                        jumps.push(RawMsg {
                            ty: DELRULE,
                            flags: 0,
                            family: fam,
                            attrs,
                            op: "delete rule",
                            object: format!(
                                "rule handle {} of chain {} in table {kw} {table}",
                                r.handle, r.chain
                            ),
                        });
                    }
                    for c in &doomed {
                        let object = format!("chain {c} of table {kw} {table}");
                        // DELRULE without a handle flushes the chain.
                        flushes.push(RawMsg {
                            ty: DELRULE,
                            flags: 0,
                            family: fam,
                            attrs: flush_attrs(table, c),
                            op: "flush chain",
                            object: object.clone(),
                        });
                        chains.push(RawMsg {
                            ty: DELCHAIN,
                            flags: 0,
                            family: fam,
                            attrs: chain_attrs(table, c),
                            op: "delete chain",
                            object,
                        });
                    }
                }
                Leftover::LegacyIptables { family: f, .. } if *f == family => {
                    done.skipped.push(l.clone());
                }
                _ => {}
            }
        }
        let (n_jumps, n_chains, n_tables) = (jumps.len(), chains.len(), tables.len());
        // Order matters inside the transaction: jumps, then every flush (chains jump to each
        // other), then the chains, then the tables.
        let mut msgs = jumps;
        msgs.extend(flushes);
        msgs.extend(chains);
        msgs.extend(tables);
        kernel.transact_raw(&msgs)?;
        done.jump_rules += n_jumps;
        done.chains += n_chains;
        done.tables += n_tables;
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubelet_canaries_are_not_kube_proxy_chains() {
        assert!(is_kube_chain("KUBE-SERVICES"));
        assert!(is_kube_chain("KUBE-SVC-ABCDEF"));
        assert!(!is_kube_chain("KUBE-KUBELET-CANARY"));
        assert!(!is_kube_chain("KUBE-IPTABLES-HINT"));
        assert!(!is_kube_chain("PREROUTING"));
        assert!(!is_kube_chain("kube-services"));
    }

    #[test]
    fn leftovers_describe_themselves() {
        let l = Leftover::IptablesNftChains {
            family: IpFamily::V4,
            table: "nat".into(),
            chains: (0..7).map(|i| format!("KUBE-SVC-{i}")).collect(),
        };
        assert_eq!(
            l.to_string(),
            "7 KUBE-* chain(s) in iptables-nft table ip nat (kube-proxy iptables mode): \
             KUBE-SVC-0, KUBE-SVC-1, KUBE-SVC-2, KUBE-SVC-3, KUBE-SVC-4, …"
        );
        let l = Leftover::LegacyIptables {
            family: IpFamily::V6,
            tables: vec!["filter".into(), "nat".into()],
        };
        assert!(
            l.to_string()
                .starts_with("legacy ip6tables tables are loaded (filter, nat)")
        );
    }
}
