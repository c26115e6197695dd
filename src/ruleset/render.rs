//! Rendering of the ruleset as nft text, in the layout `nft list table` prints, so that the
//! output of `--dry-run` can be loaded with `nft -f` and compared with what the kernel holds.

use super::{
    AddrField, Atom, BaseChain, Chain, ChainType, ElemData, Element, Hook, KeyField, Rule, Ruleset,
    Set, SetData, SetKind, Stmt, Table, Verdict,
};
use crate::model::IpFamily;
use std::fmt::Write as _;

/// All tables, separated by blank lines.
pub fn render(ruleset: &Ruleset) -> String {
    ruleset
        .tables
        .iter()
        .map(render_table)
        .collect::<Vec<_>>()
        .join("")
}

fn family_keyword(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// One table, exactly as `nft list table <family> <name>` lists it (elements one per line).
///
/// Except for ownership ([`Table::owned`]), which is never rendered: it belongs to the process
/// programming the table, not to the ruleset. `nft list` of an owned table adds a `flags` line
/// and a `# progname` comment naming the owner, both depending on who runs and on the nft
/// version (1.0.6 prints `flags owner`, and `flags` with nothing after it for an orphan, as it
/// does not know persist); and loading `flags owner` with `nft -f` would hand the table to the
/// short-lived nft process. So `--dry-run` output is the same on every machine and loads as an
/// unowned table.
pub fn render_table(table: &Table) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "table {} {} {{",
        family_keyword(table.family),
        table.name
    );
    let _ = writeln!(out, "\tcomment {}", quote(&table.comment));
    let mut blocks: Vec<String> = table
        .sets
        .iter()
        .map(|s| render_set(table.family, s))
        .collect();
    blocks.extend(table.chains.iter().map(|c| render_chain(table.family, c)));
    out.push_str(&blocks.join("\n"));
    out.push_str("}\n");
    out
}

fn quote(text: &str) -> String {
    // nft comments cannot contain a double quote; Kubernetes names never do, but a stray one
    // must not break the whole file.
    format!("\"{}\"", text.replace('"', "'"))
}

fn render_set(family: IpFamily, set: &Set) -> String {
    let mut out = String::new();
    let kind = if set.data.is_some() { "map" } else { "set" };
    let _ = writeln!(out, "\t{kind} {} {{", set.name);
    let _ = writeln!(out, "\t\t{}", set_type(family, set));
    // Where nft 1.0.6 lists it: after the type, before the flags. A hash set's is the one a
    // fresh kernel gets; on a kernel holding the set already, nodeproxy may keep an older one
    // (hysteresis, see `hash_set_size`).
    if let Some(size) = set.fresh_size() {
        let _ = writeln!(out, "\t\tsize {size}");
    }
    match set.kind {
        SetKind::Hash => {}
        SetKind::Interval => {
            let _ = writeln!(out, "\t\tflags interval");
        }
        SetKind::Dynamic => {
            let _ = writeln!(out, "\t\tflags dynamic,timeout");
        }
    }
    if !set.comment.is_empty() {
        let _ = writeln!(out, "\t\tcomment {}", quote(&set.comment));
    }
    if !set.elements.is_empty() {
        let per_line = elements_per_line(family, &set.key);
        let mut text = String::new();
        for (i, elem) in set.elements.iter().enumerate() {
            if i > 0 {
                text.push_str(if i % per_line == 0 {
                    ",\n\t\t\t     "
                } else {
                    ", "
                });
            }
            text.push_str(&render_element(elem));
        }
        let _ = writeln!(out, "\t\telements = {{ {text} }}");
    }
    out.push_str("\t}\n");
    out
}

/// How many elements nft 1.0.6 prints on one line (`calculate_delim` in nft's expression.c):
/// two IPv4 addresses, five small scalars, otherwise one (IPv6 addresses, concatenations).
fn elements_per_line(family: IpFamily, key: &[KeyField]) -> usize {
    match key {
        [KeyField::Saddr | KeyField::Daddr] if family == IpFamily::V4 => 2,
        [KeyField::L4Proto | KeyField::ThDport | KeyField::Numgen { .. }] => 5,
        _ => 1,
    }
}

fn set_type(family: IpFamily, set: &Set) -> String {
    if set.typeof_ {
        let key = key_exprs(family, &set.key);
        match &set.data {
            None => format!("typeof {key}"),
            Some(SetData::Verdict) => format!("typeof {key} : verdict"),
            Some(SetData::Value(fields)) => {
                format!("typeof {key} : {}", key_exprs(family, fields))
            }
        }
    } else {
        let key = datatypes(family, &set.key);
        match &set.data {
            None => format!("type {key}"),
            Some(SetData::Verdict) => format!("type {key} : verdict"),
            Some(SetData::Value(fields)) => format!("type {key} : {}", datatypes(family, fields)),
        }
    }
}

/// The nft datatype name of a key field.
pub fn datatype(family: IpFamily, field: KeyField) -> &'static str {
    match field {
        KeyField::Saddr | KeyField::Daddr => match family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        },
        KeyField::L4Proto => "inet_proto",
        KeyField::ThDport => "inet_service",
        KeyField::Numgen { .. } | KeyField::Jhash { .. } => "integer",
        KeyField::CtOrigDaddr => match family {
            IpFamily::V4 => "ipv4_addr",
            IpFamily::V6 => "ipv6_addr",
        },
    }
}

fn datatypes(family: IpFamily, fields: &[KeyField]) -> String {
    fields
        .iter()
        .map(|f| datatype(family, *f))
        .collect::<Vec<_>>()
        .join(" . ")
}

fn key_expr(family: IpFamily, field: KeyField) -> String {
    let fam = family_keyword(family);
    match field {
        KeyField::Saddr => format!("{fam} saddr"),
        KeyField::Daddr => format!("{fam} daddr"),
        KeyField::L4Proto => "meta l4proto".to_string(),
        KeyField::ThDport => "th dport".to_string(),
        KeyField::Numgen { modulus } => format!("numgen random mod {modulus}"),
        KeyField::CtOrigDaddr => format!("ct original {fam} daddr"),
        KeyField::Jhash { input, seed } => format!(
            "jhash {} mod {} seed {seed:#x}",
            key_exprs(family, input.fields()),
            crate::ruleset::JHASH_MODULUS
        ),
    }
}

fn key_exprs(family: IpFamily, fields: &[KeyField]) -> String {
    fields
        .iter()
        .map(|f| key_expr(family, *f))
        .collect::<Vec<_>>()
        .join(" . ")
}

fn atom(a: &Atom) -> String {
    match a {
        Atom::Addr(addr) => addr.to_string(),
        Atom::Proto(p) => p.keyword().to_string(),
        Atom::Port(p) => p.to_string(),
        Atom::Int(i) => i.to_string(),
        // nft prints a single-address range as the address.
        Atom::Net(net) => {
            let net = net.trunc();
            if net.prefix_len() == net.max_prefix_len() {
                net.addr().to_string()
            } else {
                net.to_string()
            }
        }
    }
}

/// A key or data concatenation as nft prints it (`10.96.0.10 . udp . 53`).
pub fn atoms(values: &[Atom]) -> String {
    values.iter().map(atom).collect::<Vec<_>>().join(" . ")
}

fn render_element(elem: &Element) -> String {
    let mut out = atoms(&elem.key.atoms());
    if let Some(comment) = &elem.comment {
        let _ = write!(out, " comment {}", quote(comment));
    }
    match &elem.data {
        None => {}
        Some(ElemData::Verdict(v)) => {
            let _ = write!(out, " : {}", verdict(v));
        }
        Some(ElemData::Value(values)) => {
            let _ = write!(out, " : {}", atoms(&values.atoms()));
        }
    }
    out
}

/// A verdict as nft prints it (`goto pick-2`).
pub fn verdict(v: &Verdict) -> String {
    match v {
        Verdict::Accept => "accept".to_string(),
        Verdict::Drop => "drop".to_string(),
        Verdict::Jump(chain) => format!("jump {chain}"),
        Verdict::Goto(chain) => format!("goto {chain}"),
        Verdict::Return => "return".to_string(),
    }
}

fn render_chain(family: IpFamily, chain: &Chain) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\tchain {} {{", chain.name);
    if !chain.comment.is_empty() {
        let _ = writeln!(out, "\t\tcomment {}", quote(&chain.comment));
    }
    if let Some(base) = &chain.base {
        let _ = writeln!(out, "\t\t{}", base_chain(base));
    }
    for r in &chain.rules {
        let _ = writeln!(out, "\t\t{}", rule(family, r));
    }
    out.push_str("\t}\n");
    out
}

fn base_chain(base: &BaseChain) -> String {
    let kind = match base.kind {
        ChainType::Filter => "filter",
        ChainType::Nat => "nat",
    };
    let hook = match base.hook {
        Hook::Prerouting => "prerouting",
        Hook::Input => "input",
        Hook::Forward => "forward",
        Hook::Output => "output",
        Hook::Postrouting => "postrouting",
    };
    format!(
        "type {kind} hook {hook} priority {}; policy accept;",
        priority(base)
    )
}

/// nft prints the standard priority names only where they are defined for the family and hook
/// (nft 1.0.6: `dstnat` only on prerouting, `srcnat` only on postrouting).
fn priority(base: &BaseChain) -> String {
    match (base.kind, base.hook, base.priority) {
        (ChainType::Filter, _, 0) => "filter".to_string(),
        (ChainType::Nat, Hook::Prerouting, -100) => "dstnat".to_string(),
        (ChainType::Nat, Hook::Postrouting, 100) => "srcnat".to_string(),
        (ChainType::Filter, Hook::Prerouting, p) if (-110..=-90).contains(&p) => {
            // nft names a priority within 10 of a standard one relative to it (`dstnat - 10`).
            match p + 100 {
                0 => "dstnat".to_string(),
                d if d < 0 => format!("dstnat - {}", -d),
                d => format!("dstnat + {d}"),
            }
        }
        (_, _, p) => p.to_string(),
    }
}

fn addr_match(family: IpFamily, field: AddrField, negate: bool, net: &ipnet::IpNet) -> String {
    let fam = family_keyword(family);
    let field = match field {
        AddrField::Saddr => "saddr",
        AddrField::Daddr => "daddr",
    };
    let op = if negate { "!= " } else { "" };
    let net = net.trunc();
    let value = if net.prefix_len() == net.max_prefix_len() {
        net.addr().to_string()
    } else {
        net.to_string()
    };
    format!("{fam} {field} {op}{value}")
}

/// One rule as `nft list` prints it: its statements separated by spaces.
pub fn rule(family: IpFamily, rule: &Rule) -> String {
    rule.stmts
        .iter()
        .map(|s| stmt(family, s))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One statement as `nft list` prints it (the evaluator's trace uses the same text).
pub fn stmt(family: IpFamily, s: &Stmt) -> String {
    match s {
        Stmt::CtStateNew => "ct state new".to_string(),
        Stmt::CtStatusDnat => "ct status dnat".to_string(),
        Stmt::AddrMatch { field, negate, net } => addr_match(family, *field, *negate, net),
        Stmt::InSet { key, set } => format!("{} @{set}", key_exprs(family, key)),
        Stmt::Vmap { key, map } => format!("{} vmap @{map}", key_exprs(family, key)),
        Stmt::MarkTest { mask } => format!("meta mark & {mask:#010x} != 0x00000000"),
        Stmt::MarkOr(bits) => format!("meta mark set meta mark | {bits:#010x}"),
        Stmt::MarkXor(bits) => format!("meta mark set meta mark ^ {bits:#010x}"),
        Stmt::DnatMap { key, map } => format!(
            "dnat {} to {} map @{map}",
            family_keyword(family),
            key_exprs(family, key)
        ),
        Stmt::Masquerade { fully_random } => {
            if *fully_random {
                "masquerade fully-random".to_string()
            } else {
                "masquerade".to_string()
            }
        }
        Stmt::Reject => "reject".to_string(),
        Stmt::FibLocal { field } => match field {
            AddrField::Saddr => "fib saddr type local".to_string(),
            AddrField::Daddr => "fib daddr type local".to_string(),
        },
        Stmt::Iifname {
            name,
            prefix,
            negate,
        } => {
            let op = if *negate { "!= " } else { "" };
            let star = if *prefix { "*" } else { "" };
            format!("iifname {op}{}", quote(&format!("{name}{star}")))
        }
        Stmt::NotInSet { key, set } => format!("{} != @{set}", key_exprs(family, key)),
        Stmt::UpdateSet {
            key,
            set,
            timeout_secs,
            data,
        } => format!(
            "update @{set} {{ {} timeout {}{} }}",
            key_exprs(family, key),
            duration(*timeout_secs),
            data_suffix(family, *data)
        ),
        Stmt::DeleteFromSet { key, set, data } => format!(
            "delete @{set} {{ {}{} }}",
            key_exprs(family, key),
            data_suffix(family, *data)
        ),
        Stmt::DaddrFromMap { key, map } => format!(
            "{} daddr set {} map @{map}",
            family_keyword(family),
            key_exprs(family, key)
        ),
        Stmt::DaddrRestore => format!(
            "{} daddr set {}",
            family_keyword(family),
            key_expr(family, KeyField::CtOrigDaddr)
        ),
        Stmt::RandomIs { modulus, value } => format!("numgen random mod {modulus} {value}"),
        Stmt::Verdict(v) => verdict(v),
    }
}

/// ` : <data>` of a set statement that writes a map's element.
fn data_suffix(family: IpFamily, data: Option<KeyField>) -> String {
    data.map(|d| format!(" : {}", key_expr(family, d)))
        .unwrap_or_default()
}

/// A duration as nft prints it: `3h`, `1m30s`, `2d`, `0s`.
pub fn duration(secs: u32) -> String {
    if secs == 0 {
        return "0s".to_string();
    }
    let mut out = String::new();
    let mut rest = secs;
    for (unit, len) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        let n = rest / len;
        rest %= len;
        if n > 0 {
            let _ = write!(out, "{n}{unit}");
        }
    }
    out
}
