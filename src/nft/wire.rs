//! The encoded ("wire") form of our table, and the lowering from the ruleset IR.
//!
//! A `WireTable` holds exactly what the kernel dumps back for our objects (expression attributes
//! as bytes, element keys as the concatenated, padded key bytes), so the diff compares what was
//! read from the kernel with what we want in one representation and cannot drift from it.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::fmt::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use super::NftError;
use super::uapi::*;
use super::udata;
use crate::model::{IpFamily, Protocol, ServicePortName};
use crate::netlink::{NLA_F_NESTED, len_u32, put_attr, put_str, put_u32_be};
use crate::ruleset::{
    AddrField, Atom, Atoms, BaseChain, ChainType, Comment, ElemData, Element, Hook, KeyField, Rule,
    Set, SetData, SetKind, Stmt, Table, Verdict,
};

/// Our table as the kernel holds it. Creation order is kept for building, not compared.
#[derive(Debug, Clone)]
pub struct WireTable {
    pub family: IpFamily,
    pub name: String,
    pub userdata: Vec<u8>,
    pub flags: u32,
    pub chains: BTreeMap<String, WireChain>,
    pub sets: BTreeMap<String, WireSet>,
    /// Chain names in creation order.
    pub chain_order: Vec<String>,
    /// Set names in creation order.
    pub set_order: Vec<String>,
}

impl PartialEq for WireTable {
    fn eq(&self, o: &Self) -> bool {
        self.family == o.family
            && self.name == o.name
            && self.userdata == o.userdata
            && self.flags == o.flags
            && self.chains == o.chains
            && self.sets == o.sets
    }
}
impl Eq for WireTable {}

impl WireTable {
    pub fn new(family: IpFamily, name: &str) -> WireTable {
        WireTable {
            family,
            name: name.to_owned(),
            userdata: Vec::new(),
            flags: 0,
            chains: BTreeMap::new(),
            sets: BTreeMap::new(),
            chain_order: Vec::new(),
            set_order: Vec::new(),
        }
    }

    /// `table ip nodeproxy`
    pub fn describe(&self) -> String {
        format!("table {} {}", family_keyword(self.family), self.name)
    }

    pub fn add_chain(&mut self, name: &str, chain: WireChain) {
        if self.chains.insert(name.to_owned(), chain).is_none() {
            self.chain_order.push(name.to_owned());
        }
    }

    pub fn add_set(&mut self, name: &str, set: WireSet) {
        if self.sets.insert(name.to_owned(), set).is_none() {
            self.set_order.push(name.to_owned());
        }
    }

    /// Chain names in creation order, followed by any not listed there.
    pub fn chains_ordered(&self) -> impl Iterator<Item = (&str, &WireChain)> {
        ordered(&self.chain_order, &self.chains)
    }

    pub fn sets_ordered(&self) -> impl Iterator<Item = (&str, &WireSet)> {
        ordered(&self.set_order, &self.sets)
    }
}

fn ordered<'a, T>(
    order: &'a [String],
    map: &'a BTreeMap<String, T>,
) -> impl Iterator<Item = (&'a str, &'a T)> {
    let listed = order.iter().filter_map(|n| map.get_key_value(n.as_str()));
    let rest = map.iter().filter(move |(n, _)| !order.contains(n));
    listed.chain(rest).map(|(n, v)| (n.as_str(), v))
}

pub fn family_keyword(f: IpFamily) -> &'static str {
    match f {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// `NFPROTO_IPV4` / `NFPROTO_IPV6`, the nfgenmsg family of our tables.
pub fn nfproto(f: IpFamily) -> u8 {
    match f {
        IpFamily::V4 => NFPROTO_IPV4,
        IpFamily::V6 => NFPROTO_IPV6,
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireHook {
    pub hooknum: u32,
    pub priority: i32,
    /// `filter` / `nat`.
    pub kind: String,
    /// Always `NF_ACCEPT` for ours.
    pub policy: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WireChain {
    pub hook: Option<WireHook>,
    pub userdata: Vec<u8>,
    pub rules: Vec<WireRule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WireRule {
    pub exprs: Vec<WireExpr>,
}

/// One expression as the kernel dumps it: its name and its attributes (type without flags,
/// payload bytes), sorted by type. Nested payloads are in the kernel's dump form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireExpr {
    pub name: String,
    pub attrs: Vec<(u16, Vec<u8>)>,
}

impl WireExpr {
    pub fn new(name: &str, mut attrs: Vec<(u16, Vec<u8>)>) -> WireExpr {
        attrs.sort_by_key(|a| a.0);
        WireExpr {
            name: name.to_owned(),
            attrs,
        }
    }

    pub fn attr(&self, ty: u16) -> Option<&[u8]> {
        self.attrs
            .iter()
            .find(|a| a.0 == ty)
            .map(|a| a.1.as_slice())
    }

    /// The set this expression looks up, if it is a lookup.
    pub fn set_ref(&self) -> Option<String> {
        expr::lookup::set_of(self)
    }

    /// The set this expression adds to from the packet path (`update @set`), if it is a dynset.
    pub fn updated_set(&self) -> Option<String> {
        expr::dynset::set_of(self)
    }

    /// The chain this expression jumps or goes to, if it is such an immediate.
    pub fn chain_ref(&self) -> Option<String> {
        expr::immediate::chain_of(self)
    }
}

impl WireRule {
    pub fn set_refs(&self) -> impl Iterator<Item = String> + '_ {
        self.exprs.iter().filter_map(WireExpr::set_ref)
    }
    pub fn chain_refs(&self) -> impl Iterator<Item = String> + '_ {
        self.exprs.iter().filter_map(WireExpr::chain_ref)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireSet {
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    pub data_type: Option<u32>,
    pub data_len: Option<u32>,
    pub userdata: Vec<u8>,
    /// Field lengths of a concatenation of ranges (`NFTA_SET_DESC_CONCAT`); empty otherwise.
    pub concat: Vec<u32>,
    /// The declared size (`NFTA_SET_DESC_SIZE`), which is also the kernel's maximum number of
    /// elements; `None` for none. See [`size_sets`].
    pub size: Option<u32>,
    pub elements: BTreeMap<ElemBytes, WireElem>,
}

impl WireSet {
    /// Same set definition (everything but the elements)?
    pub fn same_definition(&self, o: &WireSet) -> bool {
        self.same_definition_but_size(o) && self.size == o.size
    }

    /// Same definition, whatever the sizes?
    pub fn same_definition_but_size(&self, o: &WireSet) -> bool {
        self.flags == o.flags
            && self.key_type == o.key_type
            && self.key_len == o.key_len
            && self.data_type == o.data_type
            && self.data_len == o.data_len
            && self.userdata == o.userdata
            && self.concat == o.concat
    }

    /// A hash set of exact keys written by us: the only kind whose size follows its elements.
    pub fn is_plain_hash(&self) -> bool {
        self.flags & (SET_F_INTERVAL | SET_F_EVAL | SET_F_TIMEOUT) == 0
    }

    /// A dynamic set: the packet path owns its elements, so they are never compared or written.
    pub fn is_dynamic(&self) -> bool {
        self.flags & SET_F_EVAL != 0
    }

    pub fn is_map(&self) -> bool {
        self.flags & SET_F_MAP != 0
    }

    /// `map service-ips of table ip nodeproxy`
    pub fn describe(&self, name: &str, table: &str) -> String {
        format!(
            "{} {name} of {table}",
            if self.is_map() { "map" } else { "set" }
        )
    }

    /// Formats key bytes the way nft prints them: `10.96.0.10 . tcp . 80`.
    pub fn format_key(&self, key: &[u8]) -> String {
        format_concat(self.key_type, key)
    }

    /// Formats an element's data the way nft prints it: `198.51.100.10 . 8080`, `goto pick-2`.
    pub fn format_data(&self, data: &WireData) -> String {
        match data.get() {
            DataRef::Value(v) => format_concat(self.data_type.unwrap_or(0), v),
            DataRef::Verdict { code, chain } => {
                let word = match code {
                    NF_ACCEPT => "accept",
                    NF_DROP => "drop",
                    NFT_JUMP => "jump",
                    NFT_GOTO => "goto",
                    NFT_RETURN => "return",
                    NFT_CONTINUE => "continue",
                    _ => "verdict",
                };
                match chain {
                    Some(c) => format!("{word} {c}"),
                    None => word.to_owned(),
                }
            }
        }
    }
}

/// An element of a set, without its key (which is the element map's). 32 bytes, so that an
/// element map's B-tree leaf of eleven keys and elements fits jemalloc's 640-byte class: at
/// 10k Services × 10 endpoints the 150k elements of a table are most of what the daemon keeps.
#[derive(Clone)]
pub struct WireElem {
    body: Body,
    /// Shared: the elements of one Service port carry the same comment. A thin pointer (an
    /// `Arc<[u8]>` is two words), for the element's size.
    pub userdata: Option<Arc<Vec<u8>>>,
    /// The Service port the element was built for; never sent, not compared.
    pub origin: Option<Arc<ServicePortName>>,
}

/// An element's data and, in interval sets, the last key of its range
/// (`NFTA_SET_ELEM_KEY_END`): 16 bytes, the data's own size. Range elements are few (our
/// tables have none at 10k Services), so they hold both behind one pointer.
#[derive(Clone)]
enum Body {
    Plain(Option<WireData>),
    Range(Box<(ElemBytes, Option<WireData>)>),
}

impl WireElem {
    pub fn new(
        key_end: Option<ElemBytes>,
        data: Option<WireData>,
        userdata: Option<Arc<Vec<u8>>>,
        origin: Option<Arc<ServicePortName>>,
    ) -> WireElem {
        let body = match key_end {
            None => Body::Plain(data),
            Some(end) => Body::Range(Box::new((end, data))),
        };
        WireElem {
            body,
            userdata,
            origin,
        }
    }

    pub fn data(&self) -> Option<&WireData> {
        match &self.body {
            Body::Plain(data) => data.as_ref(),
            Body::Range(range) => range.1.as_ref(),
        }
    }

    /// The last key of a range element, in interval sets.
    pub fn key_end(&self) -> Option<&ElemBytes> {
        match &self.body {
            Body::Plain(_) => None,
            Body::Range(range) => Some(&range.0),
        }
    }

    /// The verdict's chain, if the data is a verdict that jumps or goes to one.
    pub fn chain(&self) -> Option<&str> {
        self.data().and_then(WireData::chain)
    }

    pub fn set_data(&mut self, data: Option<WireData>) {
        match &mut self.body {
            Body::Plain(d) => *d = data,
            Body::Range(range) => range.1 = data,
        }
    }

    pub fn set_key_end(&mut self, key_end: Option<ElemBytes>) {
        let data = match std::mem::replace(&mut self.body, Body::Plain(None)) {
            Body::Plain(data) => data,
            Body::Range(range) => range.1,
        };
        *self = WireElem::new(key_end, data, self.userdata.take(), self.origin.take());
    }
}

impl PartialEq for WireElem {
    fn eq(&self, o: &Self) -> bool {
        self.key_end() == o.key_end() && self.data() == o.data() && self.userdata == o.userdata
    }
}
impl Eq for WireElem {}

impl fmt::Debug for WireElem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WireElem")
            .field("key_end", &self.key_end())
            .field("data", &self.data())
            .field("userdata", &self.userdata)
            .field("origin", &self.origin)
            .finish()
    }
}

mod atoms;
mod bytes;
mod data;
pub(crate) mod expr;
mod lower;
mod size;

use atoms::*;
pub(crate) use atoms::{addr_offset, concat_type};
pub use atoms::{decode_atoms, format_concat, hex};
pub use bytes::{ChainName, DataRef, ElemBytes, WireData};
use data::*;
pub(crate) use data::{Parsed, parse_nest};
pub use data::{encode_data, parse_data, parse_value};
pub use expr::kind_names;
#[cfg(test)]
pub(in crate::nft) use lower::SPLIT_MIN_ELEMENTS;
pub use lower::{lower, lower_owned};
pub use size::size_sets;
