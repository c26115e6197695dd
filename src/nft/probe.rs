//! Capability probe: tries every expression and object kind nodeproxy programs in a throw-away
//! table (`nodeproxy-probe-<pid>`, families ip and ip6), one transaction per feature, so that a
//! kernel built without some nf_tables option is named precisely (feature and CONFIG_ option)
//! at startup instead of failing a whole sync later.
//!
//! Every probe rule starts with a match no packet can satisfy (`ip saddr X ip saddr != X`):
//! the base chains are real (their hooks are registered, as ours will be) but the probe never
//! touches traffic. The table is owned by our netlink socket where the kernel supports
//! `NFT_TABLE_F_OWNER` (5.12+), so it vanishes even if we crash; it is deleted explicitly in any
//! case.

use std::fmt;

use super::diff::{Op, Plan};
use super::owner::Ownership;
use super::uapi::{SET_F_EVAL, SET_F_TIMEOUT};
use super::wire::expr::NFT_REG_1;
use super::wire::expr::dynset::{self, NFT_DYNSET_OP_DELETE, NFT_DYNSET_OP_UPDATE};
use super::wire::expr::payload::{self, NFT_PAYLOAD_NETWORK_HEADER};
use super::wire::{WireExpr, WireSet, WireTable, addr_offset, concat_type, lower};
use super::{Kernel, NetlinkKernel, NftError};
use crate::model::{IpFamily, Protocol};
use crate::ruleset::{
    AddrField, Atom, BaseChain, Chain, ChainType, ElemData, Element, Hook, KeyField, Rule, Set,
    SetData, Stmt, Table, Verdict,
};

pub use super::uapi::{TABLE_F_OWNER, TABLE_F_PERSIST};

/// A feature the kernel refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Missing {
    pub family: IpFamily,
    /// What nodeproxy needs, e.g. `fib`.
    pub feature: &'static str,
    /// The kernel configuration option(s) that provide it.
    pub config: &'static str,
    /// The kernel's answer.
    pub error: String,
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, {}): {}",
            self.feature, self.family, self.config, self.error
        )
    }
}

/// What the kernel supports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// Features the kernel refused, per family; empty when everything works.
    pub missing: Vec<Missing>,
    /// `NFT_TABLE_F_OWNER` is accepted.
    pub table_owner: bool,
    /// `NFT_TABLE_F_PERSIST` (with owner) is accepted.
    pub table_persist: bool,
}

impl Capabilities {
    pub fn complete(&self) -> bool {
        self.missing.is_empty()
    }

    pub fn ownership(&self) -> Ownership {
        Ownership::from_flags(self.table_owner, self.table_persist)
    }
}

/// One feature: how to build its objects, and what provides it in the kernel.
struct Probe {
    feature: &'static str,
    config: fn(IpFamily) -> &'static str,
    /// Builds the feature's sets and chains; names start with `prefix` (unique per probe).
    build: fn(IpFamily, &str) -> Result<WireTable, NftError>,
}

const PROBES: &[Probe] = &[
    Probe {
        feature: "dnat to a concatenated address . port map",
        config: |_| "CONFIG_NFT_NAT",
        build: build_dnat_map,
    },
    Probe {
        feature: "masquerade fully-random",
        config: |_| "CONFIG_NFT_MASQ",
        build: build_masquerade,
    },
    Probe {
        feature: "numgen",
        config: |_| "CONFIG_NFT_NUMGEN",
        build: build_numgen,
    },
    Probe {
        feature: "fib",
        config: |f| match f {
            IpFamily::V4 => "CONFIG_NFT_FIB_IPV4",
            IpFamily::V6 => "CONFIG_NFT_FIB_IPV6",
        },
        build: build_fib,
    },
    Probe {
        feature: "ct state / ct status",
        config: |_| "CONFIG_NFT_CT",
        build: build_ct,
    },
    Probe {
        feature: "reject",
        config: |f| match f {
            IpFamily::V4 => "CONFIG_NFT_REJECT, CONFIG_NFT_REJECT_IPV4",
            IpFamily::V6 => "CONFIG_NFT_REJECT, CONFIG_NFT_REJECT_IPV6",
        },
        build: build_reject,
    },
    Probe {
        feature: "concatenated verdict map",
        config: |_| "CONFIG_NF_TABLES",
        build: build_concat_vmap,
    },
    Probe {
        feature: "dynamic set with timeouts",
        config: |_| "CONFIG_NF_TABLES_SET",
        build: build_dynset,
    },
    Probe {
        // ClientIP affinity deletes stale pins from the packet path (NFT_DYNSET_OP_DELETE,
        // kernel 5.4).
        feature: "deleting from a dynamic set from the packet path",
        config: |_| "CONFIG_NF_TABLES_SET (kernel >= 5.4)",
        build: build_dynset_delete,
    },
    Probe {
        // ClientIP affinity: a map written from the packet path with data, the destination
        // address rewritten from a map and from conntrack (`ct original ip daddr`: kernel
        // 4.17), and IPv6 pins keyed by `jhash`.
        feature: "session affinity (dynamic map with data, address rewrite, ct original, jhash)",
        config: |_| "CONFIG_NF_TABLES_SET, CONFIG_NFT_CT, CONFIG_NFT_HASH (kernel >= 4.17)",
        build: build_affinity,
    },
    Probe {
        feature: "meta mark",
        config: |_| "CONFIG_NF_TABLES",
        build: build_mark,
    },
];

/// Probes the kernel; see the module documentation. Errors only when the probe itself cannot
/// run (no nf_tables at all, netlink failures); refused features are in
/// [`Capabilities::missing`].
pub fn probe(kernel: &mut NetlinkKernel) -> Result<Capabilities, NftError> {
    probe_with(kernel, PROBES)
}

fn probe_table_name() -> String {
    format!("nodeproxy-probe-{}", std::process::id())
}

/// Only the table flags part of [`probe`] (for `--once`, which runs no full probe): which
/// ownership our tables get.
pub fn probe_ownership(kernel: &mut NetlinkKernel) -> Result<Ownership, NftError> {
    let name = probe_table_name();
    let result = table_flags(kernel, &name);
    let cleanup = kernel.delete_tables(&name);
    let (owner, persist) = result?;
    cleanup?;
    Ok(Ownership::from_flags(owner, persist))
}

fn probe_with(kernel: &mut NetlinkKernel, probes: &[Probe]) -> Result<Capabilities, NftError> {
    let name = probe_table_name();
    let result = run(kernel, &name, probes);
    // Always remove the probe tables, also when a probe failed half-way.
    let cleanup = kernel.delete_tables(&name);
    let caps = result?;
    cleanup?;
    Ok(caps)
}

fn table_plan(family: IpFamily, name: &str, flags: u32) -> Plan<'static> {
    Plan {
        family,
        table: name.to_owned(),
        phase1: vec![Op::AddTable {
            flags,
            userdata: &[],
        }],
        phase2: Vec::new(),
    }
}

/// Creates (and deletes again) a table with `flags`; whether the kernel accepted them.
fn table_flags_supported(
    kernel: &mut NetlinkKernel,
    name: &str,
    flags: u32,
) -> Result<bool, NftError> {
    match kernel.apply(&table_plan(IpFamily::V4, name, flags)) {
        Ok(_) => {
            kernel.delete_tables(name)?;
            Ok(true)
        }
        // Unknown table flags: EOPNOTSUPP.
        Err(NftError::Rejected { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `(owner, persist)`: whether the kernel accepts `NFT_TABLE_F_OWNER`, and
/// `NFT_TABLE_F_OWNER | NFT_TABLE_F_PERSIST` (the only way we use persist; kernels before 6.9
/// refuse the unknown flag with EOPNOTSUPP). The persistent probe table is deleted at once; a
/// crash in between would leave it behind, orphaned, for `nft delete table` to remove.
fn table_flags(kernel: &mut NetlinkKernel, name: &str) -> Result<(bool, bool), NftError> {
    let persist = table_flags_supported(kernel, name, TABLE_F_OWNER | TABLE_F_PERSIST)?;
    let owner = persist || table_flags_supported(kernel, name, TABLE_F_OWNER)?;
    Ok((owner, persist))
}

fn run(kernel: &mut NetlinkKernel, name: &str, probes: &[Probe]) -> Result<Capabilities, NftError> {
    let (table_owner, table_persist) = table_flags(kernel, name)?;
    let mut caps = Capabilities {
        table_owner,
        table_persist,
        ..Capabilities::default()
    };
    let flags = if caps.table_owner { TABLE_F_OWNER } else { 0 };
    for family in IpFamily::ALL {
        kernel.apply(&table_plan(family, name, flags))?;
        for (i, p) in probes.iter().enumerate() {
            let objects = (p.build)(family, &format!("p{i}"))?;
            let plan = Plan {
                family,
                table: name.to_owned(),
                phase1: ops_of(&objects),
                phase2: Vec::new(),
            };
            match kernel.apply(&plan) {
                Ok(_) => {}
                Err(NftError::Rejected { errors }) => caps.missing.push(Missing {
                    family,
                    feature: p.feature,
                    config: (p.config)(family),
                    error: errors
                        .iter()
                        .map(|e| e.to_string())
                        .collect::<Vec<_>>()
                        .join("; "),
                }),
                Err(e) => return Err(e),
            }
        }
    }
    Ok(caps)
}

/// The operations creating every set and chain of `w`, then the elements (verdicts may name
/// the chains), then the rules (which may name the sets).
fn ops_of(w: &WireTable) -> Vec<Op<'_>> {
    let mut ops = Vec::new();
    for (name, set) in w.sets_ordered() {
        ops.push(Op::AddSet { name, set });
    }
    for (name, chain) in w.chains_ordered() {
        ops.push(Op::AddChain { name, chain });
    }
    for (name, set) in w.sets_ordered() {
        if !set.elements.is_empty() {
            ops.push(Op::AddElems {
                set: name,
                def: set,
                elems: set.elements.iter().map(|(k, e)| (&k[..], e)).collect(),
            });
        }
    }
    for (name, chain) in w.chains_ordered() {
        for (index, rule) in chain.rules.iter().enumerate() {
            ops.push(Op::AddRule {
                chain: name,
                index,
                rule,
            });
        }
    }
    ops
}

// ---- the probes ----

/// A match no packet satisfies: `ip saddr X ip saddr != X`.
fn never(family: IpFamily) -> Vec<Stmt> {
    let net: ipnet::IpNet = match family {
        IpFamily::V4 => ipnet::IpNet::from(std::net::IpAddr::from([192, 0, 2, 255])),
        IpFamily::V6 => ipnet::IpNet::from(std::net::IpAddr::from([
            0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff,
        ])),
    };
    vec![
        Stmt::AddrMatch {
            field: AddrField::Saddr,
            negate: false,
            net,
        },
        Stmt::AddrMatch {
            field: AddrField::Saddr,
            negate: true,
            net,
        },
    ]
}

fn guarded(family: IpFamily, stmts: Vec<Stmt>) -> Rule {
    let mut all = never(family);
    all.extend(stmts);
    Rule::new(all)
}

fn chain(name: String, base: Option<(ChainType, Hook)>, rules: Vec<Rule>) -> Chain {
    Chain {
        name,
        comment: String::new(),
        base: base.map(|(kind, hook)| BaseChain {
            kind,
            hook,
            priority: 0,
        }),
        rules,
    }
}

fn table(family: IpFamily, sets: Vec<Set>, chains: Vec<Chain>) -> Result<WireTable, NftError> {
    lower(&Table {
        family,
        name: probe_table_name(),
        comment: String::new(),
        owned: false,
        sets,
        chains,
    })
}

fn addr(family: IpFamily, last: u8) -> Atom {
    Atom::Addr(match family {
        IpFamily::V4 => std::net::IpAddr::from([203, 0, 113, last]),
        IpFamily::V6 => std::net::IpAddr::from([
            0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, last,
        ]),
    })
}

fn element(key: Vec<Atom>, data: Option<ElemData>) -> Element {
    Element {
        key: key.into(),
        data,
        comment: None,
        origin: None,
    }
}

fn service_key() -> Vec<KeyField> {
    vec![KeyField::Daddr, KeyField::L4Proto, KeyField::ThDport]
}

fn service_atoms(family: IpFamily) -> Vec<Atom> {
    vec![addr(family, 1), Atom::Proto(Protocol::Udp), Atom::Port(53)]
}

fn build_dnat_map(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    let map = format!("{p}-map");
    let set = Set {
        name: map.clone(),
        comment: String::new(),
        key: service_key(),
        data: Some(SetData::Value(vec![KeyField::Daddr, KeyField::ThDport])),
        typeof_: true,
        elements: vec![element(
            service_atoms(family),
            Some(ElemData::Value([addr(family, 2), Atom::Port(5353)].into())),
        )],
        kind: Default::default(),
    };
    let rule = guarded(
        family,
        vec![Stmt::DnatMap {
            key: service_key(),
            map,
        }],
    );
    table(
        family,
        vec![set],
        vec![chain(
            format!("{p}-dnat"),
            Some((ChainType::Nat, Hook::Prerouting)),
            vec![rule],
        )],
    )
}

fn build_masquerade(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    let rule = guarded(family, vec![Stmt::Masquerade { fully_random: true }]);
    table(
        family,
        vec![],
        vec![chain(
            format!("{p}-masq"),
            Some((ChainType::Nat, Hook::Postrouting)),
            vec![rule],
        )],
    )
}

fn build_numgen(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    let map = format!("{p}-slots");
    let key = vec![KeyField::Numgen { modulus: 2 }];
    let set = Set {
        name: map.clone(),
        comment: String::new(),
        key: key.clone(),
        data: Some(SetData::Verdict),
        typeof_: true,
        elements: (0..2)
            .map(|i| element(vec![Atom::Int(i)], Some(ElemData::Verdict(Verdict::Accept))))
            .collect(),
        kind: Default::default(),
    };
    let rule = guarded(family, vec![Stmt::Vmap { key, map }]);
    table(
        family,
        vec![set],
        vec![chain(
            format!("{p}-numgen"),
            Some((ChainType::Filter, Hook::Prerouting)),
            vec![rule],
        )],
    )
}

fn build_ct(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    let rule = guarded(
        family,
        vec![
            Stmt::CtStateNew,
            Stmt::CtStatusDnat,
            Stmt::Verdict(Verdict::Accept),
        ],
    );
    table(
        family,
        vec![],
        vec![chain(
            format!("{p}-ct"),
            Some((ChainType::Filter, Hook::Prerouting)),
            vec![rule],
        )],
    )
}

fn build_reject(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    // reject is only valid in input, forward and output.
    let rule = guarded(family, vec![Stmt::Reject]);
    table(
        family,
        vec![],
        vec![chain(
            format!("{p}-reject"),
            Some((ChainType::Filter, Hook::Input)),
            vec![rule],
        )],
    )
}

fn build_concat_vmap(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    let map = format!("{p}-vmap");
    let target = format!("{p}-target");
    let set = Set {
        name: map.clone(),
        comment: String::new(),
        key: service_key(),
        data: Some(SetData::Verdict),
        typeof_: false,
        elements: vec![element(
            service_atoms(family),
            Some(ElemData::Verdict(Verdict::Goto(target.as_str().into()))),
        )],
        kind: Default::default(),
    };
    let rule = guarded(
        family,
        vec![Stmt::Vmap {
            key: service_key(),
            map,
        }],
    );
    table(
        family,
        vec![set],
        vec![
            chain(target, None, vec![]),
            chain(
                format!("{p}-vmap"),
                Some((ChainType::Filter, Hook::Prerouting)),
                vec![rule],
            ),
        ],
    )
}

fn build_mark(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    let rule = guarded(
        family,
        vec![Stmt::MarkTest { mask: 0x4000 }, Stmt::MarkOr(0x4000)],
    );
    table(
        family,
        vec![],
        vec![chain(
            format!("{p}-mark"),
            Some((ChainType::Filter, Hook::Prerouting)),
            vec![rule],
        )],
    )
}

/// A guarded filter/prerouting chain whose single rule ends with `exprs` (encodings the IR does
/// not have).
fn raw_rule_chain(
    family: IpFamily,
    name: String,
    exprs: Vec<WireExpr>,
) -> Result<WireTable, NftError> {
    let mut w = table(
        family,
        vec![],
        vec![chain(
            name.clone(),
            Some((ChainType::Filter, Hook::Prerouting)),
            vec![guarded(family, vec![])],
        )],
    )?;
    if let Some(rule) = w.chains.get_mut(&name).and_then(|c| c.rules.first_mut()) {
        rule.exprs.extend(exprs);
    }
    Ok(w)
}

fn build_fib(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    let rule = guarded(
        family,
        vec![Stmt::FibLocal {
            field: AddrField::Daddr,
        }],
    );
    table(
        family,
        vec![],
        vec![chain(
            format!("{p}-fib"),
            Some((ChainType::Filter, Hook::Prerouting)),
            vec![rule],
        )],
    )
}

/// `set S { type ipv4_addr; flags dynamic,timeout; }` and
/// `update @S { ip saddr timeout 3h }`, encoded as nft 1.0.6 does:
/// `[ payload load 4b @ network header + 12 => reg 1 ]`
/// `[ dynset update reg_key 1 set S timeout 10800000ms ]`.
fn build_dynset(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    dynset_probe(family, p, "dynset", NFT_DYNSET_OP_UPDATE)
}

/// Map `<p>-pins` and chain `<p>-affinity`: the statements of an affinity pick chain.
fn build_affinity(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    let pins = format!("{p}-pins");
    let (key, typeof_, pin_key) = match family {
        IpFamily::V4 => (
            vec![KeyField::Saddr, KeyField::Daddr],
            false,
            vec![KeyField::Saddr, KeyField::CtOrigDaddr],
        ),
        IpFamily::V6 => (
            vec![KeyField::Numgen { modulus: 2 }; 2],
            true,
            [1, 2]
                .map(|seed| KeyField::Jhash {
                    input: crate::ruleset::HashInput::ClientServiceAddress,
                    seed,
                })
                .to_vec(),
        ),
    };
    let set = Set {
        name: pins.clone(),
        comment: String::new(),
        key,
        data: Some(SetData::Value(vec![KeyField::Daddr])),
        typeof_,
        elements: Vec::new(),
        kind: crate::ruleset::SetKind::Dynamic,
    };
    let rules = vec![
        guarded(
            family,
            vec![Stmt::DaddrFromMap {
                key: pin_key.clone(),
                map: pins.clone(),
            }],
        ),
        guarded(
            family,
            vec![Stmt::UpdateSet {
                key: pin_key.clone(),
                set: pins.clone(),
                timeout_secs: 10,
                data: Some(KeyField::Daddr),
            }],
        ),
        guarded(
            family,
            vec![Stmt::DeleteFromSet {
                key: pin_key,
                set: pins,
                data: Some(KeyField::Daddr),
            }],
        ),
        guarded(family, vec![Stmt::DaddrRestore]),
    ];
    table(
        family,
        vec![set],
        vec![chain(
            format!("{p}-affinity"),
            Some((ChainType::Nat, Hook::Prerouting)),
            rules,
        )],
    )
}

/// Like [`build_dynset`] with `delete @S { ip saddr }`.
fn build_dynset_delete(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    dynset_probe(family, p, "dynset-delete", NFT_DYNSET_OP_DELETE)
}

/// Set `<p>-seen` and chain `<p>-<chain>`.
fn dynset_probe(family: IpFamily, p: &str, chain: &str, op: u32) -> Result<WireTable, NftError> {
    let set_name = format!("{p}-seen");
    let (key_type, key_len) = concat_type(family, &[KeyField::Saddr]);
    // Only `update` refreshes a timeout; `delete` carries none.
    let timeout_ms: u64 = if op == NFT_DYNSET_OP_UPDATE {
        3 * 3600 * 1000
    } else {
        0
    };
    let exprs = vec![
        payload::load(
            NFT_REG_1,
            NFT_PAYLOAD_NETWORK_HEADER,
            addr_offset(family, AddrField::Saddr),
            key_len,
        ),
        dynset::as_sent_by_nft(&set_name, op, timeout_ms),
    ];
    let mut w = raw_rule_chain(family, format!("{p}-{chain}"), exprs)?;
    w.add_set(
        &set_name,
        WireSet {
            flags: SET_F_TIMEOUT | SET_F_EVAL,
            key_type,
            key_len,
            data_type: None,
            data_len: None,
            userdata: Vec::new(),
            concat: Vec::new(),
            size: None,
            elements: Default::default(),
        },
    );
    Ok(w)
}

#[cfg(test)]
mod tests;
