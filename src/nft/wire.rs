//! The encoded ("wire") form of our table, and the lowering from the ruleset IR.
//!
//! A `WireTable` holds exactly what the kernel dumps back for our objects (expression attributes
//! as bytes, element keys as the concatenated, padded key bytes), so the diff compares what was
//! read from the kernel with what we want in one representation and cannot drift from it.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use super::NftError;
use super::uapi::*;
use super::udata;
use crate::model::{IpFamily, Protocol, ServicePortName};
use crate::netlink::{NLA_F_NESTED, len_u32, put_attr, put_str, put_u32_be};
use crate::ruleset::{
    AddrField, Atom, BaseChain, ChainType, ElemData, Element, Hook, KeyField, Rule, Set, SetData,
    SetKind, Stmt, Table, Verdict,
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
        IpFamily::V4 => 2,
        IpFamily::V6 => 10,
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

    /// Whether attribute `ty` of this expression is a nest (sent with `NLA_F_NESTED`).
    pub fn is_nested(name: &str, ty: u16) -> bool {
        matches!(
            (name, ty),
            ("cmp", 3) | ("bitwise", 4) | ("bitwise", 5) | ("immediate", 2)
        )
    }

    /// The set this expression looks up, if it is a lookup.
    pub fn set_ref(&self) -> Option<String> {
        if self.name == "lookup" {
            self.attr(LOOKUP_SET).map(crate::netlink::cstr)
        } else {
            None
        }
    }

    /// The set this expression adds to from the packet path (`update @set`), if it is a dynset.
    pub fn updated_set(&self) -> Option<String> {
        if self.name == "dynset" {
            self.attr(DYNSET_SET_NAME).map(crate::netlink::cstr)
        } else {
            None
        }
    }

    /// The chain this expression jumps or goes to, if it is such an immediate.
    pub fn chain_ref(&self) -> Option<String> {
        if self.name != "immediate" {
            return None;
        }
        match parse_data(self.attr(IMMEDIATE_DATA)?)? {
            WireData::Verdict { chain, .. } => chain.map(|c| c.to_string()),
            WireData::Value(_) => None,
        }
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
    pub elements: BTreeMap<Box<[u8]>, WireElem>,
}

impl WireSet {
    /// Same set definition (everything but the elements)?
    pub fn same_definition(&self, o: &WireSet) -> bool {
        self.flags == o.flags
            && self.key_type == o.key_type
            && self.key_len == o.key_len
            && self.data_type == o.data_type
            && self.data_len == o.data_len
            && self.userdata == o.userdata
            && self.concat == o.concat
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
}

#[derive(Debug, Clone)]
pub struct WireElem {
    /// The last key of a range element (`NFTA_SET_ELEM_KEY_END`), in interval sets.
    pub key_end: Option<Box<[u8]>>,
    pub data: Option<WireData>,
    /// Shared: the elements of one Service port carry the same comment.
    pub userdata: Option<Arc<[u8]>>,
    /// The Service port the element was built for; never sent, not compared.
    pub origin: Option<Arc<ServicePortName>>,
}

impl PartialEq for WireElem {
    fn eq(&self, o: &Self) -> bool {
        self.key_end == o.key_end && self.data == o.data && self.userdata == o.userdata
    }
}
impl Eq for WireElem {}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireData {
    Value(Box<[u8]>),
    Verdict { code: i32, chain: Option<Arc<str>> },
}

impl WireData {
    pub fn chain(&self) -> Option<&str> {
        match self {
            WireData::Verdict { chain: Some(c), .. } => Some(c),
            _ => None,
        }
    }
}

// ---- expression attribute numbers (linux/netfilter/nf_tables.h) ----
const PAYLOAD_DREG: u16 = 1;
const PAYLOAD_BASE: u16 = 2;
const PAYLOAD_OFFSET: u16 = 3;
const PAYLOAD_LEN: u16 = 4;
const META_DREG: u16 = 1;
const META_KEY: u16 = 2;
const META_SREG: u16 = 3;
const CMP_SREG: u16 = 1;
const CMP_OP: u16 = 2;
const CMP_DATA: u16 = 3;
const BITWISE_SREG: u16 = 1;
const BITWISE_DREG: u16 = 2;
const BITWISE_LEN: u16 = 3;
const BITWISE_MASK: u16 = 4;
const BITWISE_XOR: u16 = 5;
const BITWISE_OP: u16 = 6;
pub const LOOKUP_SET: u16 = 1;
const LOOKUP_SREG: u16 = 2;
const LOOKUP_DREG: u16 = 3;
const LOOKUP_FLAGS: u16 = 5;
const IMMEDIATE_DREG: u16 = 1;
pub const IMMEDIATE_DATA: u16 = 2;
const NG_DREG: u16 = 1;
const NG_MODULUS: u16 = 2;
const NG_TYPE: u16 = 3;
const NG_OFFSET: u16 = 4;
const NAT_TYPE: u16 = 1;
const NAT_FAMILY: u16 = 2;
const NAT_REG_ADDR_MIN: u16 = 3;
const NAT_REG_ADDR_MAX: u16 = 4;
const NAT_REG_PROTO_MIN: u16 = 5;
const NAT_REG_PROTO_MAX: u16 = 6;
const NAT_FLAGS: u16 = 7;
const MASQ_FLAGS: u16 = 1;
const REJECT_TYPE: u16 = 1;
const REJECT_ICMP_CODE: u16 = 2;
const CT_DREG: u16 = 1;
const CT_KEY: u16 = 2;
const FIB_DREG: u16 = 1;
const FIB_RESULT: u16 = 2;
const FIB_FLAGS: u16 = 3;
const BYTEORDER_SREG: u16 = 1;
const BYTEORDER_DREG: u16 = 2;
const BYTEORDER_OP: u16 = 3;
const BYTEORDER_LEN: u16 = 4;
const BYTEORDER_SIZE: u16 = 5;
const DYNSET_SET_NAME: u16 = 1;
const DYNSET_OP: u16 = 3;
const DYNSET_SREG_KEY: u16 = 4;
const DYNSET_TIMEOUT: u16 = 6;
const DYNSET_FLAGS: u16 = 9;
const NFT_DYNSET_OP_UPDATE: u32 = 1;
const NFT_DYNSET_OP_DELETE: u32 = 2;
const NFT_BYTEORDER_HTON: u32 = 1;
/// `NFT_LOOKUP_F_INV`: the lookup matches when the key is absent.
const NFT_LOOKUP_F_INV: u32 = 1;

const NFT_META_MARK: u32 = 3;
const NFT_META_L4PROTO: u32 = 16;
const NFT_META_IIFNAME: u32 = 6;
/// `NFT_FIB_RESULT_ADDRTYPE`, `NFTA_FIB_F_SADDR`, `NFTA_FIB_F_DADDR`, and `RTN_LOCAL` (the
/// address type `local`, compared host-endian).
const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
const NFTA_FIB_F_SADDR: u32 = 1;
const NFTA_FIB_F_DADDR: u32 = 2;
const RTN_LOCAL: u32 = 2;
/// `IFNAMSIZ`: nft compares an exact interface name as 16 NUL-padded bytes.
const IFNAMSIZ: usize = 16;
const NFT_CT_STATE: u32 = 0;
const NFT_CT_STATUS: u32 = 2;
const NFT_CMP_EQ: u32 = 0;
const NFT_CMP_NEQ: u32 = 1;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFT_NG_RANDOM: u32 = 1;
const NFT_NAT_DNAT: u32 = 1;
const NF_NAT_RANGE_MAP_IPS: u32 = 0x1;
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;
const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;
const NFT_REJECT_ICMP_UNREACH: u32 = 0;
/// ICMP_PORT_UNREACH (3) and ICMPV6_PORT_UNREACH (4); NFTA_REJECT_ICMP_CODE is a u8 attribute.
const ICMP_PORT_UNREACH: u8 = 3;
const ICMPV6_PORT_UNREACH: u8 = 4;
/// `ct state new` bit and `IPS_DST_NAT`.
const CT_STATE_NEW: u32 = 0x8;
const IPS_DST_NAT: u32 = 0x20;

fn be(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

/// Register numbers as the kernel dumps them (`nft_dump_register`): a 32-bit register that
/// starts a 16-byte register is reported as that register (NFT_REG_1..4), others as
/// NFT_REG32_xx. `word` counts 32-bit words from the start of NFT_REG_1.
fn reg(word: u32) -> u32 {
    if word.is_multiple_of(4) {
        1 + word / 4
    } else {
        8 + word
    }
}

/// An NFTA_DATA nest's payload holding a value.
fn data_value(bytes: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(bytes.len() + 4);
    put_attr(&mut v, DATA_VALUE, bytes);
    v
}

/// An NFTA_DATA nest's payload holding a verdict. The kernel dumps the verdict nest without
/// `NLA_F_NESTED` (`nft_verdict_dump` uses `nla_nest_start_noflag`), so we send it that way too.
fn data_verdict(code: i32, chain: Option<&str>) -> Vec<u8> {
    let mut inner = Vec::new();
    put_u32_be(&mut inner, VERDICT_CODE, code.cast_unsigned());
    if let Some(c) = chain {
        put_str(&mut inner, VERDICT_CHAIN, c);
    }
    let mut v = Vec::with_capacity(inner.len() + 4);
    put_attr(&mut v, DATA_VERDICT, &inner);
    v
}

/// Parses an NFTA_DATA nest payload.
pub fn parse_data(b: &[u8]) -> Option<WireData> {
    for (ty, p, _) in crate::netlink::Attrs::new(b) {
        match ty & crate::netlink::NLA_TYPE_MASK {
            DATA_VALUE => return Some(WireData::Value(p.into())),
            DATA_VERDICT => {
                let mut code = None;
                let mut chain = None;
                for (t, q, _) in crate::netlink::Attrs::new(p) {
                    match t & crate::netlink::NLA_TYPE_MASK {
                        VERDICT_CODE => code = crate::netlink::be_u32(q).map(|c| c as i32),
                        VERDICT_CHAIN => chain = Some(Arc::from(crate::netlink::cstr(q).as_str())),
                        _ => {}
                    }
                }
                return Some(WireData::Verdict { code: code?, chain });
            }
            _ => {}
        }
    }
    None
}

/// Encodes `WireData` as an NFTA_DATA nest payload.
pub fn encode_data(d: &WireData, out: &mut Vec<u8>) {
    match d {
        WireData::Value(v) => put_attr(out, DATA_VALUE, v),
        WireData::Verdict { code, chain } => {
            let start = crate::netlink::nest_begin(out, DATA_VERDICT);
            put_u32_be(out, VERDICT_CODE, code.cast_unsigned());
            if let Some(c) = chain {
                put_str(out, VERDICT_CHAIN, c);
            }
            // A verdict nest is a few dozen bytes.
            let _ = crate::netlink::nest_end(out, start);
        }
    }
}

// ---- key fields ----

struct FieldInfo {
    /// nft datatype id.
    type_id: u32,
    /// Length in bytes before padding.
    len: u32,
}

fn field_info(family: IpFamily, f: KeyField) -> FieldInfo {
    match f {
        KeyField::Saddr | KeyField::Daddr => match family {
            IpFamily::V4 => FieldInfo { type_id: 7, len: 4 },
            IpFamily::V6 => FieldInfo {
                type_id: 8,
                len: 16,
            },
        },
        KeyField::L4Proto => FieldInfo {
            type_id: 12,
            len: 1,
        },
        KeyField::ThDport => FieldInfo {
            type_id: 13,
            len: 2,
        },
        // numgen is an `integer` of 32 bits, host byte order.
        KeyField::Numgen { .. } => FieldInfo { type_id: 4, len: 4 },
    }
}

fn pad4(n: u32) -> u32 {
    (n + 3) & !3
}

/// [`pad4`] of a byte length.
fn pad4_len(n: usize) -> usize {
    (n + 3) & !3
}

/// (type id, length) of a key or data concatenation: sub-type ids shifted by 6 bits each, the
/// first field most significant; each field padded to 4 bytes unless it is the only one.
fn concat_type(family: IpFamily, fields: &[KeyField]) -> (u32, u32) {
    let mut ty = 0u32;
    let mut len = 0u32;
    for f in fields {
        let i = field_info(family, *f);
        ty = (ty << 6) | i.type_id;
        len += if fields.len() == 1 {
            i.len
        } else {
            pad4(i.len)
        };
    }
    (ty, len)
}

fn addr_offset(family: IpFamily, field: AddrField) -> u32 {
    match (family, field) {
        (IpFamily::V4, AddrField::Saddr) => 12,
        (IpFamily::V4, AddrField::Daddr) => 16,
        (IpFamily::V6, AddrField::Saddr) => 8,
        (IpFamily::V6, AddrField::Daddr) => 24,
    }
}

fn payload(dreg: u32, base: u32, offset: u32, len: u32) -> WireExpr {
    WireExpr::new(
        "payload",
        vec![
            (PAYLOAD_DREG, be(dreg)),
            (PAYLOAD_BASE, be(base)),
            (PAYLOAD_OFFSET, be(offset)),
            (PAYLOAD_LEN, be(len)),
        ],
    )
}

fn meta_load(key: u32, dreg: u32) -> WireExpr {
    WireExpr::new("meta", vec![(META_KEY, be(key)), (META_DREG, be(dreg))])
}

fn cmp(op: u32, data: &[u8]) -> WireExpr {
    WireExpr::new(
        "cmp",
        vec![
            (CMP_SREG, be(1)),
            (CMP_OP, be(op)),
            (CMP_DATA, data_value(data)),
        ],
    )
}

/// `reg 1 = (reg 1 & mask) ^ xor`. The kernel (≥ 5.x) dumps NFTA_BITWISE_OP (boolean = 0)
/// although nft does not send it; we send it so the dump matches.
fn bitwise(mask: &[u8], xor: &[u8]) -> WireExpr {
    WireExpr::new(
        "bitwise",
        vec![
            (BITWISE_SREG, be(1)),
            (BITWISE_DREG, be(1)),
            (BITWISE_LEN, be(len_u32(mask.len()))),
            (BITWISE_OP, be(0)),
            (BITWISE_MASK, data_value(mask)),
            (BITWISE_XOR, data_value(xor)),
        ],
    )
}

fn ct_load(key: u32) -> WireExpr {
    WireExpr::new("ct", vec![(CT_KEY, be(key)), (CT_DREG, be(1))])
}

/// Loads the key fields into consecutive registers from NFT_REG_1; returns the words used.
fn load_key(family: IpFamily, key: &[KeyField], out: &mut Vec<WireExpr>) -> u32 {
    load_key_for(family, key, false, out)
}

/// Like [`load_key`]; for a lookup in a concatenation of ranges, nft 1.0.6 follows the
/// one-byte `meta l4proto` load with `byteorder hton(size 2, len 1)` (a no-op in the kernel:
/// it converts len/size = 0 words), so we emit it too, or the rule would not list back as nft's.
fn load_key_for(
    family: IpFamily,
    key: &[KeyField],
    interval: bool,
    out: &mut Vec<WireExpr>,
) -> u32 {
    let mut word = 0u32;
    for f in key {
        let r = reg(word);
        let info = field_info(family, *f);
        let expr = match f {
            KeyField::Saddr => payload(
                r,
                NFT_PAYLOAD_NETWORK_HEADER,
                addr_offset(family, AddrField::Saddr),
                info.len,
            ),
            KeyField::Daddr => payload(
                r,
                NFT_PAYLOAD_NETWORK_HEADER,
                addr_offset(family, AddrField::Daddr),
                info.len,
            ),
            KeyField::L4Proto if interval && key.len() > 1 => {
                out.push(meta_load(NFT_META_L4PROTO, r));
                WireExpr::new(
                    "byteorder",
                    vec![
                        (BYTEORDER_SREG, be(r)),
                        (BYTEORDER_DREG, be(r)),
                        (BYTEORDER_OP, be(NFT_BYTEORDER_HTON)),
                        (BYTEORDER_LEN, be(1)),
                        (BYTEORDER_SIZE, be(2)),
                    ],
                )
            }
            KeyField::L4Proto => meta_load(NFT_META_L4PROTO, r),
            KeyField::ThDport => payload(r, NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2),
            KeyField::Numgen { modulus } => WireExpr::new(
                "numgen",
                vec![
                    (NG_DREG, be(r)),
                    (NG_MODULUS, be(*modulus)),
                    (NG_TYPE, be(NFT_NG_RANDOM)),
                    (NG_OFFSET, be(0)),
                ],
            ),
        };
        out.push(expr);
        word += pad4(info.len) / 4;
    }
    word
}

fn lookup(set: &str, dreg: Option<u32>) -> WireExpr {
    lookup_flags(set, dreg, 0)
}

fn cstring(s: &str) -> Vec<u8> {
    let mut name = s.as_bytes().to_vec();
    name.push(0);
    name
}

fn lookup_flags(set: &str, dreg: Option<u32>, flags: u32) -> WireExpr {
    let mut attrs = vec![
        (LOOKUP_SET, cstring(set)),
        (LOOKUP_SREG, be(1)),
        (LOOKUP_FLAGS, be(flags)),
    ];
    if let Some(d) = dreg {
        attrs.push((LOOKUP_DREG, be(d)));
    }
    WireExpr::new("lookup", attrs)
}

fn verdict_code(v: &Verdict) -> (i32, Option<&str>) {
    match v {
        Verdict::Accept => (NF_ACCEPT, None),
        Verdict::Drop => (NF_DROP, None),
        Verdict::Jump(c) => (NFT_JUMP, Some(c)),
        Verdict::Goto(c) => (NFT_GOTO, Some(c)),
        Verdict::Return => (NFT_RETURN, None),
    }
}

/// The bytes nft compares for a prefix match, and the mask when the prefix is not byte-aligned:
/// nft loads only the prefix bytes for /8, /16, …, and the whole address plus a bitwise mask
/// otherwise (verified with `nft --debug=netlink`, nft 1.0.6).
fn prefix_match(
    family: IpFamily,
    field: AddrField,
    negate: bool,
    net: &ipnet::IpNet,
) -> Vec<WireExpr> {
    let addr: Vec<u8> = match net.network() {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let plen = net.prefix_len() as usize;
    let op = if negate { NFT_CMP_NEQ } else { NFT_CMP_EQ };
    let off = addr_offset(family, field);
    if plen.is_multiple_of(8) && plen > 0 {
        let n = plen / 8;
        vec![
            payload(1, NFT_PAYLOAD_NETWORK_HEADER, off, len_u32(n)),
            cmp(op, &addr[..n]),
        ]
    } else {
        let mask: Vec<u8> = match net.netmask() {
            IpAddr::V4(m) => m.octets().to_vec(),
            IpAddr::V6(m) => m.octets().to_vec(),
        };
        let zero = vec![0u8; addr.len()];
        vec![
            payload(1, NFT_PAYLOAD_NETWORK_HEADER, off, len_u32(addr.len())),
            bitwise(&mask, &zero),
            cmp(op, &addr),
        ]
    }
}

fn lower_stmt(
    family: IpFamily,
    table: &Table,
    stmt: &Stmt,
    out: &mut Vec<WireExpr>,
) -> Result<(), String> {
    let z = 0u32.to_ne_bytes();
    match stmt {
        Stmt::CtStateNew | Stmt::CtStatusDnat => {
            let (key, bit) = if matches!(stmt, Stmt::CtStateNew) {
                (NFT_CT_STATE, CT_STATE_NEW)
            } else {
                (NFT_CT_STATUS, IPS_DST_NAT)
            };
            out.push(ct_load(key));
            out.push(bitwise(&bit.to_ne_bytes(), &z));
            out.push(cmp(NFT_CMP_NEQ, &z));
        }
        Stmt::AddrMatch { field, negate, net } => {
            if IpFamily::of(&net.addr()) != family {
                return Err(format!("address match {net} in a table of family {family}"));
            }
            out.extend(prefix_match(family, *field, *negate, net));
        }
        Stmt::InSet { key, set } | Stmt::Vmap { key, map: set } => {
            check_set_key(family, table, set, key)?;
            let interval = table.set(set).is_some_and(|s| s.kind == SetKind::Interval);
            load_key_for(family, key, interval, out);
            let dreg = matches!(stmt, Stmt::Vmap { .. }).then_some(0);
            out.push(lookup(set, dreg));
        }
        Stmt::NotInSet { key, set } => {
            check_set_key(family, table, set, key)?;
            let interval = table.set(set).is_some_and(|s| s.kind == SetKind::Interval);
            load_key_for(family, key, interval, out);
            out.push(lookup_flags(set, None, NFT_LOOKUP_F_INV));
        }
        Stmt::UpdateSet {
            key,
            set,
            timeout_secs,
        } => {
            check_set_key(family, table, set, key)?;
            if table.set(set).is_none_or(|s| s.kind != SetKind::Dynamic) {
                return Err(format!("update of @{set}, which is not a dynamic set"));
            }
            load_key(family, key, out);
            // The kernel dumps the timeout in milliseconds as a 64-bit value, and the flags.
            let ms = u64::from(*timeout_secs) * 1000;
            out.push(WireExpr::new(
                "dynset",
                vec![
                    (DYNSET_SET_NAME, cstring(set)),
                    (DYNSET_OP, be(NFT_DYNSET_OP_UPDATE)),
                    (DYNSET_SREG_KEY, be(1)),
                    (DYNSET_TIMEOUT, ms.to_be_bytes().to_vec()),
                    (DYNSET_FLAGS, be(0)),
                ],
            ));
        }
        Stmt::DeleteFromSet { key, set } => {
            check_set_key(family, table, set, key)?;
            if table.set(set).is_none_or(|s| s.kind != SetKind::Dynamic) {
                return Err(format!("delete from @{set}, which is not a dynamic set"));
            }
            load_key(family, key, out);
            // The kernel dumps a timeout (0) and flags for every dynset, whatever its operation.
            out.push(WireExpr::new(
                "dynset",
                vec![
                    (DYNSET_SET_NAME, cstring(set)),
                    (DYNSET_OP, be(NFT_DYNSET_OP_DELETE)),
                    (DYNSET_SREG_KEY, be(1)),
                    (DYNSET_TIMEOUT, 0u64.to_be_bytes().to_vec()),
                    (DYNSET_FLAGS, be(0)),
                ],
            ));
        }
        Stmt::RandomIs { modulus, value } => {
            out.push(WireExpr::new(
                "numgen",
                vec![
                    (NG_DREG, be(1)),
                    (NG_MODULUS, be(*modulus)),
                    (NG_TYPE, be(NFT_NG_RANDOM)),
                    (NG_OFFSET, be(0)),
                ],
            ));
            // numgen writes a host-endian u32.
            out.push(cmp(NFT_CMP_EQ, &value.to_ne_bytes()));
        }
        Stmt::MarkTest { mask } => {
            out.push(meta_load(NFT_META_MARK, 1));
            out.push(bitwise(&mask.to_ne_bytes(), &z));
            out.push(cmp(NFT_CMP_NEQ, &z));
        }
        Stmt::MarkOr(bits) | Stmt::MarkXor(bits) => {
            // nft expresses `mark | b` as `(mark & ~b) ^ b` and `mark ^ b` as `(mark & ~0) ^ b`.
            let mask = if matches!(stmt, Stmt::MarkOr(_)) {
                !bits
            } else {
                u32::MAX
            };
            out.push(meta_load(NFT_META_MARK, 1));
            out.push(bitwise(&mask.to_ne_bytes(), &bits.to_ne_bytes()));
            out.push(WireExpr::new(
                "meta",
                vec![(META_KEY, be(NFT_META_MARK)), (META_SREG, be(1))],
            ));
        }
        Stmt::DnatMap { key, map } => {
            check_set_key(family, table, map, key)?;
            let data = match table.set(map).and_then(|s| s.data.as_ref()) {
                Some(SetData::Value(fields)) => fields.clone(),
                _ => return Err(format!("dnat map @{map} is not a map to address (. port)")),
            };
            load_key(family, key, out);
            out.push(lookup(map, Some(1)));
            let addr_words = pad4(field_info(family, KeyField::Daddr).len) / 4;
            let mut attrs = vec![
                (NAT_TYPE, be(NFT_NAT_DNAT)),
                (NAT_FAMILY, be(u32::from(nfproto(family)))),
                (NAT_REG_ADDR_MIN, be(1)),
                (NAT_REG_ADDR_MAX, be(1)),
            ];
            let mut flags = NF_NAT_RANGE_MAP_IPS;
            if data.contains(&KeyField::ThDport) {
                attrs.push((NAT_REG_PROTO_MIN, be(reg(addr_words))));
                attrs.push((NAT_REG_PROTO_MAX, be(reg(addr_words))));
                flags |= NF_NAT_RANGE_PROTO_SPECIFIED;
            }
            attrs.push((NAT_FLAGS, be(flags)));
            out.push(WireExpr::new("nat", attrs));
        }
        Stmt::Masquerade { fully_random } => {
            let attrs = if *fully_random {
                vec![(MASQ_FLAGS, be(NF_NAT_RANGE_PROTO_RANDOM_FULLY))]
            } else {
                Vec::new()
            };
            out.push(WireExpr::new("masq", attrs));
        }
        Stmt::Reject => {
            let code = match family {
                IpFamily::V4 => ICMP_PORT_UNREACH,
                IpFamily::V6 => ICMPV6_PORT_UNREACH,
            };
            out.push(WireExpr::new(
                "reject",
                vec![
                    (REJECT_TYPE, be(NFT_REJECT_ICMP_UNREACH)),
                    (REJECT_ICMP_CODE, vec![code]),
                ],
            ));
        }
        Stmt::FibLocal { field } => {
            let flag = match field {
                AddrField::Saddr => NFTA_FIB_F_SADDR,
                AddrField::Daddr => NFTA_FIB_F_DADDR,
            };
            out.push(WireExpr::new(
                "fib",
                vec![
                    (FIB_DREG, be(1)),
                    (FIB_RESULT, be(NFT_FIB_RESULT_ADDRTYPE)),
                    (FIB_FLAGS, be(flag)),
                ],
            ));
            out.push(cmp(NFT_CMP_EQ, &RTN_LOCAL.to_ne_bytes()));
        }
        Stmt::Iifname {
            name,
            prefix,
            negate,
        } => {
            // nft compares a wildcard name by its prefix bytes only, and an exact name as the
            // whole NUL-padded IFNAMSIZ buffer (so "eth0" does not match "eth01").
            let bytes = name.as_bytes();
            if bytes.len() >= IFNAMSIZ || (bytes.is_empty() && *prefix) {
                return Err(format!("interface name {name:?} is not 1 to 15 bytes"));
            }
            let mut data = bytes.to_vec();
            if !*prefix {
                data.resize(IFNAMSIZ, 0);
            }
            let op = if *negate { NFT_CMP_NEQ } else { NFT_CMP_EQ };
            out.push(meta_load(NFT_META_IIFNAME, 1));
            out.push(cmp(op, &data));
        }
        Stmt::Verdict(v) => {
            let (code, chain) = verdict_code(v);
            out.push(WireExpr::new(
                "immediate",
                vec![
                    (IMMEDIATE_DREG, be(0)),
                    (IMMEDIATE_DATA, data_verdict(code, chain)),
                ],
            ));
        }
    }
    Ok(())
}

fn check_set_key(
    family: IpFamily,
    table: &Table,
    set: &str,
    key: &[KeyField],
) -> Result<(), String> {
    let Some(s) = table.set(set) else {
        return Err(format!("references missing set @{set}"));
    };
    if concat_type(family, &s.key) != concat_type(family, key) {
        return Err(format!("key does not match the type of @{set}"));
    }
    Ok(())
}

fn hook_of(b: &BaseChain) -> WireHook {
    let hooknum = match b.hook {
        Hook::Prerouting => 0,
        Hook::Input => 1,
        Hook::Forward => 2,
        Hook::Output => 3,
        Hook::Postrouting => 4,
    };
    let kind = match b.kind {
        ChainType::Filter => "filter",
        ChainType::Nat => "nat",
    };
    WireHook {
        hooknum,
        priority: b.priority,
        kind: kind.to_owned(),
        policy: NF_ACCEPT as u32,
    }
}

/// Encodes one key or data atom list (padded to 4 bytes per field when concatenated).
fn encode_atoms(
    family: IpFamily,
    fields: &[KeyField],
    atoms: &[Atom],
) -> Result<Box<[u8]>, String> {
    encode_atoms_at(family, fields, atoms, false)
}

/// Encodes the first (`end` false) or last (`end` true) key of a range element: ranges
/// ([`Atom::Net`]) contribute their first or last address, other atoms themselves.
fn encode_atoms_at(
    family: IpFamily,
    fields: &[KeyField],
    atoms: &[Atom],
    end: bool,
) -> Result<Box<[u8]>, String> {
    if fields.len() != atoms.len() {
        return Err(format!(
            "has {} fields, its set has {}",
            atoms.len(),
            fields.len()
        ));
    }
    let concat = fields.len() > 1;
    let mut out = Vec::with_capacity(fields.len() * 4 + 12);
    for (f, a) in fields.iter().zip(atoms) {
        let start = out.len();
        match (f, a, family) {
            (KeyField::Saddr | KeyField::Daddr, Atom::Addr(IpAddr::V4(ip)), IpFamily::V4) => {
                out.extend_from_slice(&ip.octets())
            }
            (KeyField::Saddr | KeyField::Daddr, Atom::Addr(IpAddr::V6(ip)), IpFamily::V6) => {
                out.extend_from_slice(&ip.octets())
            }
            (KeyField::L4Proto, Atom::Proto(p), _) => out.push(p.number()),
            (KeyField::ThDport, Atom::Port(p), _) => out.extend_from_slice(&p.to_be_bytes()),
            (KeyField::Numgen { .. }, Atom::Int(i), _) => out.extend_from_slice(&i.to_ne_bytes()),
            (KeyField::Saddr | KeyField::Daddr, Atom::Net(net), _)
                if IpFamily::of(&net.addr()) == family =>
            {
                let addr = if end { net.broadcast() } else { net.network() };
                match addr {
                    IpAddr::V4(ip) => out.extend_from_slice(&ip.octets()),
                    IpAddr::V6(ip) => out.extend_from_slice(&ip.octets()),
                }
            }
            _ => return Err(format!("value {a:?} does not fit field {f:?}")),
        }
        if concat {
            let l = out.len() - start;
            out.resize(start + pad4_len(l), 0);
        }
    }
    Ok(out.into_boxed_slice())
}

/// The inverse of [`encode_atoms`] for exact values (no ranges): the atoms `bytes` hold for
/// `fields`, or `None` when they do not have that shape (wrong length, a protocol no Service
/// uses). Reads back what nodeproxy wrote, e.g. the affinity slot maps.
pub fn decode_atoms(family: IpFamily, fields: &[KeyField], bytes: &[u8]) -> Option<Vec<Atom>> {
    let concat = fields.len() > 1;
    let mut pos = 0usize;
    let mut out = Vec::with_capacity(fields.len());
    for f in fields {
        let len = field_info(family, *f).len as usize;
        let b = bytes.get(pos..pos + len)?;
        out.push(match f {
            KeyField::Saddr | KeyField::Daddr => match family {
                IpFamily::V4 => {
                    Atom::Addr(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(b).ok()?)))
                }
                IpFamily::V6 => {
                    Atom::Addr(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?)))
                }
            },
            KeyField::L4Proto => Atom::Proto(Protocol::from_number(*b.first()?)?),
            KeyField::ThDport => Atom::Port(u16::from_be_bytes(b.try_into().ok()?)),
            KeyField::Numgen { .. } => Atom::Int(u32::from_ne_bytes(b.try_into().ok()?)),
        });
        pos += if concat { pad4_len(len) } else { len };
    }
    (pos == bytes.len()).then_some(out)
}

/// Lowers a set's definition and `elements` (the set's own, borrowed or moved out of it: when
/// moved, each IR element is freed as soon as it is encoded, which keeps the peak memory of a
/// 10k-service sync at one copy of the elements instead of two).
fn lower_set<E: Borrow<Element>>(
    family: IpFamily,
    table_desc: &str,
    set: &Set,
    elements: impl IntoIterator<Item = E>,
    chains: &mut HashMap<String, Arc<str>>,
) -> Result<WireSet, NftError> {
    let obj = || {
        format!(
            "{} {} of {table_desc}",
            if set.data.is_some() { "map" } else { "set" },
            set.name
        )
    };
    let (key_type, key_len) = concat_type(family, &set.key);
    let interval = set.kind == SetKind::Interval;
    // The kernel keeps single-field intervals as pairs of elements (start, end flag); only
    // concatenations of ranges (one element with KEY_END) are supported here.
    if interval && set.key.len() < 2 {
        return Err(NftError::Invalid {
            object: obj(),
            reason: "interval sets must have a concatenated key".into(),
            origin: None,
        });
    }
    let kind_flags = match set.kind {
        SetKind::Hash => 0,
        SetKind::Interval => SET_F_INTERVAL | SET_F_CONCAT,
        SetKind::Dynamic => SET_F_TIMEOUT | SET_F_EVAL,
    };
    let concat = if interval {
        set.key.iter().map(|f| field_info(family, *f).len).collect()
    } else {
        Vec::new()
    };
    let (flags, data_type, data_len) = match &set.data {
        None => (0, None, None),
        Some(SetData::Verdict) => (SET_F_MAP, Some(DATA_TYPE_VERDICT), Some(VERDICT_DATA_LEN)),
        Some(SetData::Value(fields)) => {
            let (t, l) = concat_type(family, fields);
            (SET_F_MAP, Some(t), Some(l))
        }
    };
    let mut wire_elements = BTreeMap::new();
    let mut comments: HashMap<Arc<str>, Arc<[u8]>> = HashMap::new();
    for e in elements {
        let e = e.borrow();
        let bad = |reason: String| NftError::Invalid {
            object: format!("element {:?} in {}", e.key, obj()),
            reason,
            origin: e.origin.as_deref().cloned().map(Box::new),
        };
        let key = encode_atoms(family, &set.key, &e.key).map_err(bad)?;
        let key_end = if interval {
            Some(encode_atoms_at(family, &set.key, &e.key, true).map_err(bad)?)
        } else {
            None
        };
        let data = match (&set.data, &e.data) {
            (None, None) => None,
            (Some(SetData::Verdict), Some(ElemData::Verdict(v))) => {
                let (code, chain) = verdict_code(v);
                let chain = chain.map(|c| {
                    chains
                        .entry(c.to_owned())
                        .or_insert_with(|| Arc::from(c))
                        .clone()
                });
                Some(WireData::Verdict { code, chain })
            }
            (Some(SetData::Value(fields)), Some(ElemData::Value(atoms))) => Some(WireData::Value(
                encode_atoms(family, fields, atoms).map_err(bad)?,
            )),
            _ => return Err(bad("element data does not match the set's data type".into())),
        };
        let userdata = e.comment.as_ref().filter(|c| !c.is_empty()).map(|c| {
            comments
                .entry(c.clone())
                .or_insert_with(|| Arc::from(udata::comment(c)))
                .clone()
        });
        let elem = WireElem {
            key_end,
            data,
            userdata,
            origin: e.origin.clone(),
        };
        if wire_elements.insert(key, elem).is_some() {
            return Err(bad("duplicate key".into()));
        }
    }
    Ok(WireSet {
        flags: flags | kind_flags,
        key_type,
        key_len,
        data_type,
        data_len,
        userdata: udata::set_udata(family, set),
        concat,
        elements: wire_elements,
    })
}

fn lower_rule(family: IpFamily, table: &Table, rule: &Rule) -> Result<WireRule, String> {
    let mut exprs = Vec::new();
    for s in &rule.stmts {
        lower_stmt(family, table, s, &mut exprs)?;
    }
    Ok(WireRule { exprs })
}

/// Lowers one table of the IR to its wire form. Pure; fails only on an IR that cannot be
/// expressed (a key that does not match its set, a reference to a missing set).
pub fn lower(table: &Table) -> Result<WireTable, NftError> {
    let mut next = 0;
    lower_impl(table, |_| {
        next += 1;
        table
            .sets
            .get(next - 1)
            .into_iter()
            .flat_map(|s| s.elements.iter())
    })
}

/// Like [`lower`], but consumes the table and frees its elements as they are encoded.
pub fn lower_owned(mut table: Table) -> Result<WireTable, NftError> {
    let mut element_lists: Vec<Vec<Element>> = table
        .sets
        .iter_mut()
        .map(|s| std::mem::take(&mut s.elements))
        .collect();
    element_lists.reverse();
    lower_impl(&table, |_| element_lists.pop().unwrap_or_default())
}

fn lower_impl<E: Borrow<Element>, I: IntoIterator<Item = E>>(
    table: &Table,
    mut elements_of: impl FnMut(&Set) -> I,
) -> Result<WireTable, NftError> {
    let family = table.family;
    let mut w = WireTable::new(family, &table.name);
    let desc = w.describe();
    w.userdata = udata::comment(&table.comment);
    if table.owned {
        w.flags = TABLE_F_OWNED;
    }
    let mut chain_names: HashMap<String, Arc<str>> = HashMap::new();
    for set in &table.sets {
        let ws = lower_set(family, &desc, set, elements_of(set), &mut chain_names)?;
        w.add_set(&set.name, ws);
    }
    for c in &table.chains {
        let mut rules = Vec::with_capacity(c.rules.len());
        for (i, r) in c.rules.iter().enumerate() {
            rules.push(
                lower_rule(family, table, r).map_err(|reason| NftError::Invalid {
                    object: format!("rule {} of chain {} in {desc}", i + 1, c.name),
                    reason,
                    origin: None,
                })?,
            );
        }
        let chain = WireChain {
            hook: c.base.as_ref().map(hook_of),
            userdata: udata::comment(&c.comment),
            rules,
        };
        w.add_chain(&c.name, chain);
    }
    Ok(w)
}

// ---- formatting keys for error messages ----

fn proto_name(p: u8) -> String {
    match p {
        6 => "tcp".into(),
        17 => "udp".into(),
        132 => "sctp".into(),
        n => n.to_string(),
    }
}

/// Formats concatenated key or data bytes given the set's (concat) type id.
pub fn format_concat(type_id: u32, bytes: &[u8]) -> String {
    let mut ids = Vec::new();
    let mut t = type_id;
    while t != 0 && ids.len() < 8 {
        ids.push(t & 0x3f);
        t >>= 6;
    }
    ids.reverse();
    let concat = ids.len() > 1;
    let mut out = String::new();
    let mut pos = 0usize;
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            out.push_str(" . ");
        }
        let len = match id {
            7 => 4,
            8 => 16,
            12 => 1,
            13 => 2,
            _ => 4,
        };
        let Some(b) = bytes.get(pos..pos + len) else {
            let _ = write!(out, "0x{}", hex(&bytes[pos.min(bytes.len())..]));
            return out;
        };
        match id {
            7 => {
                let _ = write!(out, "{}", Ipv4Addr::new(b[0], b[1], b[2], b[3]));
            }
            8 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(b);
                let _ = write!(out, "{}", Ipv6Addr::from(a));
            }
            12 => out.push_str(&proto_name(b[0])),
            13 => {
                let _ = write!(out, "{}", u16::from_be_bytes([b[0], b[1]]));
            }
            _ => {
                let _ = write!(out, "{}", u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        pos += if concat { len.div_ceil(4) * 4 } else { len };
    }
    if ids.is_empty() {
        out = format!("0x{}", hex(bytes));
    }
    out
}

pub fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// Builds NEST flags for sending an expression attribute.
pub fn expr_attr_type(name: &str, ty: u16) -> u16 {
    if WireExpr::is_nested(name, ty) {
        ty | NLA_F_NESTED
    } else {
        ty
    }
}
