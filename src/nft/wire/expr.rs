//! Expressions as the kernel takes them. Each kind lives in its own file under `expr/` with
//! its attribute numbers and constants (`linux/netfilter/nf_tables.h`), its builders and which
//! of its attributes nest, as libnftnl's `src/expr/*.c`; this file holds what they share
//! (registers, the registry the encoder and the read-back decoder consult) and the decoding of
//! one expression of a dumped rule.

use super::*;
use crate::netlink::{Attrs, NLA_TYPE_MASK, cstr};

pub(crate) mod bitwise;
pub(crate) mod byteorder;
pub(crate) mod cmp;
pub(crate) mod ct;
pub(crate) mod dynset;
pub(crate) mod fib;
pub(crate) mod hash;
pub(crate) mod immediate;
pub(crate) mod lookup;
pub(crate) mod masq;
pub(crate) mod meta;
pub(crate) mod nat;
pub(crate) mod numgen;
pub(crate) mod payload;
pub(crate) mod reject;

/// What the encoder and the read-back decoder must know of an expression kind beyond its
/// builders: its name, and which of its attributes are `NFTA_DATA` nests. A nest is sent with
/// `NLA_F_NESTED` and normalised when read back; a kind that nests and is missing here makes
/// the diff see a change on every verification.
pub(crate) struct Kind {
    /// `NFTA_EXPR_NAME`.
    pub(crate) name: &'static str,
    /// The attributes holding an `NFTA_DATA` nest.
    pub(crate) nested: &'static [u16],
}

/// Every kind nodeproxy programs.
const KINDS: [&Kind; 15] = [
    &bitwise::KIND,
    &byteorder::KIND,
    &cmp::KIND,
    &ct::KIND,
    &dynset::KIND,
    &fib::KIND,
    &hash::KIND,
    &immediate::KIND,
    &lookup::KIND,
    &masq::KIND,
    &meta::KIND,
    &nat::KIND,
    &numgen::KIND,
    &payload::KIND,
    &reject::KIND,
];

/// The names of every expression kind nodeproxy programs (`NFTA_EXPR_NAME`): what a capability
/// probe must cover unless nf_tables itself provides it.
pub fn kind_names() -> impl Iterator<Item = &'static str> {
    KINDS.iter().map(|k| k.name)
}

/// Whether attribute `ty` of expression `name` is a nest (sent with `NLA_F_NESTED`).
pub fn is_nested(name: &str, ty: u16) -> bool {
    KINDS
        .iter()
        .any(|k| k.name == name && k.nested.contains(&ty))
}

/// The attribute type to send attribute `ty` of expression `name` with: nests get their flag.
pub fn attr_type(name: &str, ty: u16) -> u16 {
    if is_nested(name, ty) {
        ty | NLA_F_NESTED
    } else {
        ty
    }
}

/// Parses one NFTA_LIST_ELEM of a rule's expressions (ours or another table's) into the
/// canonical form: data nests as the kernel dumps them (a verdict nest without
/// `NLA_F_NESTED`), which is also the form the builders produce.
pub fn decode(e: &[u8]) -> WireExpr {
    let mut name = String::new();
    let mut attrs = Vec::new();
    for (ty, p, _) in Attrs::new(e) {
        match ty & NLA_TYPE_MASK {
            EXPR_NAME => name = cstr(p),
            EXPR_DATA => {
                for (t, q, _) in Attrs::new(p) {
                    attrs.push((t & NLA_TYPE_MASK, q.to_vec()));
                }
            }
            _ => {}
        }
    }
    for (t, v) in attrs.iter_mut() {
        if is_nested(&name, *t)
            && let Some(d) = parse_data(v)
        {
            let mut n = Vec::new();
            encode_data(&d, &mut n);
            *v = n;
        }
    }
    WireExpr::new(&name, attrs)
}

/// String attribute `ty` of `e`, when `e` is of `kind`.
fn string_attr(e: &WireExpr, kind: &Kind, ty: u16) -> Option<String> {
    if e.name == kind.name {
        e.attr(ty).map(cstr)
    } else {
        None
    }
}

/// `NFT_REG_VERDICT`: the register a verdict is written to.
pub(crate) const NFT_REG_VERDICT: u32 = 0;
/// `NFT_REG_1`: the first 16-byte data register, where every key and operand of ours starts.
pub(crate) const NFT_REG_1: u32 = 1;
/// `NFT_REG32_00`: the first 32-bit register, the same storage as `NFT_REG_1`.
const NFT_REG32_00: u32 = 8;

/// Register numbers as the kernel dumps them (`nft_dump_register`): a 32-bit register that
/// starts a 16-byte register is reported as that register (NFT_REG_1..4), others as
/// NFT_REG32_xx. `word` counts 32-bit words from the start of NFT_REG_1.
pub(crate) fn reg(word: u32) -> u32 {
    if word.is_multiple_of(4) {
        NFT_REG_1 + word / 4
    } else {
        NFT_REG32_00 + word
    }
}

/// A big-endian u32 attribute payload, as every numeric expression attribute is sent.
pub(crate) fn be(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

/// A NUL-terminated string attribute payload.
pub(crate) fn cstring(s: &str) -> Vec<u8> {
    let mut name = s.as_bytes().to_vec();
    name.push(0);
    name
}
