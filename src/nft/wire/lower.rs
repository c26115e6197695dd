//! Lowering the ruleset IR to the wire form: statements to expressions, sets with their
//! elements, rules, chains and the table.

use super::expr::bitwise;
use super::expr::cmp::{self, NFT_CMP_EQ, NFT_CMP_NEQ};
use super::expr::ct::{self, CT_STATE_NEW, IPS_DST_NAT, NFT_CT_STATE, NFT_CT_STATUS};
use super::expr::lookup;
use super::expr::meta::{self, IFNAMSIZ, NFT_META_IIFNAME, NFT_META_L4PROTO, NFT_META_MARK};
use super::expr::payload::{
    self, NFT_PAYLOAD_NETWORK_HEADER, NFT_PAYLOAD_TRANSPORT_HEADER, TH_DPORT_LEN, TH_DPORT_OFFSET,
};
use super::expr::{
    NFT_REG_1, NFT_REG_VERDICT, byteorder, dynset, fib, hash, immediate, masq, nat, numgen, reg,
    reject,
};
use super::*;
use std::hash::BuildHasherDefault;

use crate::address_hash::AddressHasher;

/// Loads the key fields into consecutive registers from NFT_REG_1; returns the words used.
pub(super) fn load_key(family: IpFamily, key: &[KeyField], out: &mut Vec<WireExpr>) -> u32 {
    load_key_for(family, key, false, out)
}

/// Like [`load_key`]; for a lookup in a concatenation of ranges (`interval`), with the
/// `byteorder` nft 1.0.6 puts after `meta l4proto` there (see [`byteorder::hton_l4proto`]).
pub(super) fn load_key_for(
    family: IpFamily,
    key: &[KeyField],
    interval: bool,
    out: &mut Vec<WireExpr>,
) -> u32 {
    load_key_at(family, key, interval, 0, HASH_INPUT_IN_LOOKUP, out)
}

/// Where nft 1.0.6 loads the fields a `jhash` of a key hashes: from word 6 (`NFT_REG32_06`) in
/// a lookup's key, from word 4 (`NFT_REG_2`) in a set statement's (`--debug=netlink`, IPv6
/// affinity pins of 24 and 40 bytes alike). Ours must be the same bytecode, or a table nft
/// loaded from `--dry-run`'s text would read back as different.
const HASH_INPUT_IN_LOOKUP: u32 = 6;
const HASH_INPUT_IN_STATEMENT: u32 = 4;

/// Loads the key fields into consecutive registers from word `start`, the fields of a `jhash`
/// from word `hash_at`; returns the word after the key.
fn load_key_at(
    family: IpFamily,
    key: &[KeyField],
    interval: bool,
    start: u32,
    hash_at: u32,
    out: &mut Vec<WireExpr>,
) -> u32 {
    let mut word = start;
    for f in key {
        let r = reg(word);
        let info = field_info(family, *f);
        let v6 = family == IpFamily::V6;
        let expr = match f {
            KeyField::Saddr => {
                let offset = addr_offset(family, AddrField::Saddr);
                payload::load(r, NFT_PAYLOAD_NETWORK_HEADER, offset, info.len)
            }
            KeyField::Daddr => {
                let offset = addr_offset(family, AddrField::Daddr);
                payload::load(r, NFT_PAYLOAD_NETWORK_HEADER, offset, info.len)
            }
            KeyField::CtOrigDaddr => ct::load_original_daddr(v6, r),
            KeyField::L4Proto if interval && key.len() > 1 => {
                out.push(meta::load(NFT_META_L4PROTO, r));
                byteorder::hton_l4proto(r)
            }
            KeyField::L4Proto => meta::load(NFT_META_L4PROTO, r),
            KeyField::ThDport => payload::load(
                r,
                NFT_PAYLOAD_TRANSPORT_HEADER,
                TH_DPORT_OFFSET,
                TH_DPORT_LEN,
            ),
            KeyField::Numgen { modulus } => numgen::random(r, *modulus),
            KeyField::Jhash { input, seed } => {
                // The hashed fields are loaded again for each hash, clear of the hashes
                // already written (words 0 and 1), as nft does.
                let (_, len) = concat_type(family, input.fields());
                load_key_at(family, input.fields(), false, hash_at, hash_at, out);
                hash::jhash(reg(hash_at), len, crate::ruleset::JHASH_MODULUS, *seed, r)
            }
        };
        out.push(expr);
        word += pad4(info.len) / 4;
    }
    word
}

/// The first word of the 16-byte register after a key that ends before word `end`: where nft
/// puts the data of a set statement.
fn data_word(end: u32) -> u32 {
    end.div_ceil(4) * 4
}

/// Writes register NFT_REG_1 (an address of `family`) over the packet's destination address.
fn write_daddr(family: IpFamily, out: &mut Vec<WireExpr>) {
    let len = field_info(family, KeyField::Daddr).len;
    let offset = addr_offset(family, AddrField::Daddr);
    out.push(payload::write_daddr(
        family == IpFamily::V6,
        NFT_REG_1,
        offset,
        len,
    ));
}

/// Checks that a set statement's `data` is what dynamic set `set` holds (none for a set).
fn check_dynamic(
    family: IpFamily,
    table: &Table,
    set: &str,
    data: Option<KeyField>,
) -> Result<(), String> {
    let Some(s) = table.set(set).filter(|s| s.kind == SetKind::Dynamic) else {
        return Err(format!(
            "update or delete of @{set}, which is not a dynamic set"
        ));
    };
    let declared = match &s.data {
        None => None,
        Some(SetData::Value(fields)) => Some(concat_type(family, fields)),
        Some(SetData::Verdict) => return Err(format!("@{set} is a verdict map")),
    };
    if declared != data.map(|d| concat_type(family, &[d])) {
        return Err(format!(
            "the data written does not match the data type of @{set}"
        ));
    }
    Ok(())
}

/// The bytes nft compares for a prefix match, and the mask when the prefix is not byte-aligned:
/// nft loads only the prefix bytes for /8, /16, …, and the whole address plus a bitwise mask
/// otherwise (verified with `nft --debug=netlink`, nft 1.0.6).
pub(super) fn prefix_match(
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
            payload::load(NFT_REG_1, NFT_PAYLOAD_NETWORK_HEADER, off, len_u32(n)),
            cmp::compare(op, &addr[..n]),
        ]
    } else {
        let mask: Vec<u8> = match net.netmask() {
            IpAddr::V4(m) => m.octets().to_vec(),
            IpAddr::V6(m) => m.octets().to_vec(),
        };
        let zero = vec![0u8; addr.len()];
        vec![
            payload::load(
                NFT_REG_1,
                NFT_PAYLOAD_NETWORK_HEADER,
                off,
                len_u32(addr.len()),
            ),
            bitwise::mask_xor(&mask, &zero),
            cmp::compare(op, &addr),
        ]
    }
}

pub(super) fn lower_stmt(
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
            out.push(ct::load(key));
            out.push(bitwise::mask_xor(&bit.to_ne_bytes(), &z));
            out.push(cmp::compare(NFT_CMP_NEQ, &z));
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
            let dreg = matches!(stmt, Stmt::Vmap { .. }).then_some(NFT_REG_VERDICT);
            out.push(lookup::lookup(set, dreg));
        }
        Stmt::NotInSet { key, set } => {
            check_set_key(family, table, set, key)?;
            let interval = table.set(set).is_some_and(|s| s.kind == SetKind::Interval);
            load_key_for(family, key, interval, out);
            out.push(lookup::absent(set));
        }
        Stmt::UpdateSet { key, set, data, .. } | Stmt::DeleteFromSet { key, set, data } => {
            check_set_key(family, table, set, key)?;
            check_dynamic(family, table, set, *data)?;
            let end = load_key_at(family, key, false, 0, HASH_INPUT_IN_STATEMENT, out);
            let data_reg = data.map(|d| {
                let at = data_word(end);
                load_key_at(family, &[d], false, at, at, out);
                reg(at)
            });
            out.push(match stmt {
                Stmt::UpdateSet { timeout_secs, .. } => {
                    dynset::update(set, u64::from(*timeout_secs) * 1000, data_reg)
                }
                _ => dynset::delete(set, data_reg),
            });
        }
        Stmt::DaddrFromMap { key, map } => {
            check_set_key(family, table, map, key)?;
            match table.set(map).and_then(|s| s.data.as_ref()) {
                Some(SetData::Value(fields))
                    if concat_type(family, fields) == concat_type(family, &[KeyField::Daddr]) => {}
                _ => return Err(format!("@{map} is not a map to an address")),
            }
            load_key(family, key, out);
            out.push(lookup::lookup(map, Some(NFT_REG_1)));
            write_daddr(family, out);
        }
        Stmt::DaddrRestore => {
            out.push(ct::load_original_daddr(family == IpFamily::V6, NFT_REG_1));
            write_daddr(family, out);
        }
        Stmt::RandomIs { modulus, value } => {
            out.push(numgen::random(NFT_REG_1, *modulus));
            // numgen writes a host-endian u32.
            out.push(cmp::compare(NFT_CMP_EQ, &value.to_ne_bytes()));
        }
        Stmt::MarkTest { mask } => {
            out.push(meta::load(NFT_META_MARK, NFT_REG_1));
            out.push(bitwise::mask_xor(&mask.to_ne_bytes(), &z));
            out.push(cmp::compare(NFT_CMP_NEQ, &z));
        }
        Stmt::MarkOr(bits) | Stmt::MarkXor(bits) => {
            // nft expresses `mark | b` as `(mark & ~b) ^ b` and `mark ^ b` as `(mark & ~0) ^ b`.
            let mask = if matches!(stmt, Stmt::MarkOr(_)) {
                !bits
            } else {
                u32::MAX
            };
            out.push(meta::load(NFT_META_MARK, NFT_REG_1));
            out.push(bitwise::mask_xor(&mask.to_ne_bytes(), &bits.to_ne_bytes()));
            out.push(meta::set(NFT_META_MARK, NFT_REG_1));
        }
        Stmt::DnatMap { key, map } => {
            check_set_key(family, table, map, key)?;
            let data = match table.set(map).and_then(|s| s.data.as_ref()) {
                Some(SetData::Value(fields)) => fields.clone(),
                _ => return Err(format!("dnat map @{map} is not a map to address (. port)")),
            };
            load_key(family, key, out);
            out.push(lookup::lookup(map, Some(NFT_REG_1)));
            // The port follows the address in the registers the lookup wrote.
            let addr_words = pad4(field_info(family, KeyField::Daddr).len) / 4;
            let proto_reg = data.contains(&KeyField::ThDport).then(|| reg(addr_words));
            out.push(nat::dnat(family, NFT_REG_1, proto_reg));
        }
        Stmt::Masquerade { fully_random } => {
            out.push(masq::masquerade(*fully_random));
        }
        Stmt::Reject => {
            out.push(reject::port_unreachable(family));
        }
        Stmt::FibLocal { field } => {
            out.extend(fib::is_local(*field));
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
            out.push(meta::load(NFT_META_IIFNAME, NFT_REG_1));
            out.push(cmp::compare(op, &data));
        }
        Stmt::Verdict(v) => {
            let (code, chain) = verdict_code(v);
            out.push(immediate::verdict(code, chain));
        }
    }
    Ok(())
}

pub(super) fn check_set_key(
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

pub(super) fn hook_of(b: &BaseChain) -> WireHook {
    let hooknum = match b.hook {
        Hook::Prerouting => NF_INET_PRE_ROUTING,
        Hook::Input => NF_INET_LOCAL_IN,
        Hook::Forward => NF_INET_FORWARD,
        Hook::Output => NF_INET_LOCAL_OUT,
        Hook::Postrouting => NF_INET_POST_ROUTING,
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

/// Lowers a set's definition and `elements` (the set's own, borrowed or moved out of it: when
/// moved, each IR element is freed as soon as it is encoded, which keeps the peak memory of a
/// 10k-service sync at one copy of the elements instead of two).
pub(super) fn lower_set<E: Borrow<Element>>(
    family: IpFamily,
    table_desc: &str,
    set: &Set,
    elements: impl IntoIterator<Item = E>,
    shared: &mut Shared,
) -> Result<WireSet, NftError> {
    let mut ws = set_definition(family, table_desc, set)?;
    let elements = elements.into_iter();
    let mut wire_elements = Elements::with_capacity(elements.size_hint().0);
    lower_elements(
        family,
        table_desc,
        set,
        elements,
        shared,
        &mut wire_elements,
    )?;
    ws.elements = wire_elements.into_map();
    Ok(ws)
}

/// What a set or map is called in an error.
fn set_object(table_desc: &str, set: &Set) -> String {
    format!(
        "{} {} of {table_desc}",
        if set.data.is_some() { "map" } else { "set" },
        set.name
    )
}

/// A set's definition, without its elements.
fn set_definition(family: IpFamily, table_desc: &str, set: &Set) -> Result<WireSet, NftError> {
    let (key_type, key_len) = concat_type(family, &set.key);
    let interval = set.kind == SetKind::Interval;
    // The kernel keeps single-field intervals as pairs of elements (start, end flag); only
    // concatenations of ranges (one element with KEY_END) are supported here.
    if interval && set.key.len() < 2 {
        return Err(NftError::Invalid {
            object: set_object(table_desc, set),
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
    Ok(WireSet {
        flags: flags | kind_flags,
        key_type,
        key_len,
        data_type,
        data_len,
        userdata: udata::set_udata(family, set),
        concat,
        // What a fresh kernel gets; `size_sets` adjusts it to the table the kernel holds.
        size: set.fresh_size(),
        elements: BTreeMap::new(),
    })
}

/// What the elements of one table share as they are lowered, looked up rather than made per
/// element: a verdict's chain name, and a comment's userdata.
#[derive(Default)]
pub(super) struct Shared {
    chains: HashMap<String, ChainName>,
    /// By the address of the comment's text, which the build shares among a Service port's
    /// elements (kept alive here, so that no other text takes its address meanwhile).
    comments: HashMap<usize, SharedComment, BuildHasherDefault<AddressHasher>>,
}

/// A comment's text and its userdata.
type SharedComment = (Comment, Arc<Vec<u8>>);

impl Shared {
    /// The userdata of comment `text`, made once per table: per set, as it was, each Service
    /// port's comment was encoded again in every set it has elements in (udata::comment was a
    /// fifth of lowering's instructions at 50k Services).
    fn comment(&mut self, text: &Comment) -> Arc<Vec<u8>> {
        let at = text.addr();
        match self.comments.get(&at) {
            Some((_, shared)) => shared.clone(),
            None => {
                let shared = Arc::new(udata::comment(text));
                self.comments.insert(at, (text.clone(), shared.clone()));
                shared
            }
        }
    }
}

/// Encodes `elements` of `set` into `out`, in order, and stops at the first one that cannot be
/// encoded (those before it stay in `out`).
fn lower_elements<E: Borrow<Element>>(
    family: IpFamily,
    table_desc: &str,
    set: &Set,
    elements: impl IntoIterator<Item = E>,
    shared: &mut Shared,
    out: &mut Elements,
) -> Result<(), NftError> {
    let interval = set.kind == SetKind::Interval;
    let mut last_comment: Option<SharedComment> = None;
    let mut scratch = Vec::with_capacity(64);
    for e in elements {
        let e = e.borrow();
        let bad = |reason: String| NftError::Invalid {
            object: format!("element {:?} in {}", e.key, set_object(table_desc, set)),
            reason,
            origin: e.origin.as_deref().cloned().map(Box::new),
        };
        let key = encode_atoms(&mut scratch, family, &set.key, &e.key).map_err(bad)?;
        let key_end = if interval {
            Some(encode_atoms_at(&mut scratch, family, &set.key, &e.key, true).map_err(bad)?)
        } else {
            None
        };
        let data = match (&set.data, &e.data) {
            (None, None) => None,
            (Some(SetData::Verdict), Some(ElemData::Verdict(v))) => {
                let (code, chain) = verdict_code(v);
                // Looked up before inserting: `entry` would take an owned name, an
                // allocation per element.
                let chain = chain.map(|c| match shared.chains.get(c) {
                    Some(name) => name.clone(),
                    None => {
                        let name = ChainName::new(c.to_owned());
                        shared.chains.insert(c.to_owned(), name.clone());
                        name
                    }
                });
                Some(WireData::verdict(code, chain))
            }
            (Some(SetData::Value(fields)), Some(ElemData::Value(atoms))) => Some(WireData::value(
                &encode_atoms(&mut scratch, family, fields, atoms).map_err(bad)?,
            )),
            _ => return Err(bad("element data does not match the set's data type".into())),
        };
        let userdata = e.comment.as_ref().filter(|c| !c.is_empty()).map(|c| {
            // A Service port's elements are next to each other in most maps (sorted by the
            // Service's address), and share one comment: the last one is checked first.
            if let Some((text, userdata)) = &last_comment
                && text.same(c)
            {
                return userdata.clone();
            }
            let userdata = shared.comment(c);
            last_comment = Some((c.clone(), userdata.clone()));
            userdata
        });
        let elem = WireElem::new(key_end, data, userdata, e.origin.clone());
        if !out.insert(key, elem) {
            return Err(bad("duplicate key".into()));
        }
    }
    Ok(())
}

/// A set's elements as they are lowered. Keys usually come in ascending order (the IR's
/// elements are sorted, and most keys encode in the same order); those are kept in a vector
/// and built into the map in one go, which fills its nodes: inserted one by one, ascending
/// keys leave each B-tree leaf about half full (6 of 11 slots), and the applied tables the
/// daemon keeps were ~40 % larger for it.
enum Elements {
    Ascending(Vec<(ElemBytes, WireElem)>),
    Map(BTreeMap<ElemBytes, WireElem>),
}

impl Default for Elements {
    fn default() -> Elements {
        Elements::Ascending(Vec::new())
    }
}

impl Elements {
    /// Room for `n` elements in ascending order, allocated once: grown by doubling, the
    /// vector of a 100k-element map left its earlier buffers (1.75 and 3.5 MiB at 10k
    /// Services x 10) freed but resident, as jemalloc keeps freed pages for its decay time,
    /// while the start-up peak was reached.
    fn with_capacity(n: usize) -> Elements {
        Elements::Ascending(Vec::with_capacity(n))
    }

    /// Adds an element; `false` if its key is already there.
    fn insert(&mut self, key: ElemBytes, elem: WireElem) -> bool {
        match self {
            Elements::Ascending(v) if v.last().is_none_or(|(last, _)| *last < key) => {
                v.push((key, elem));
                true
            }
            Elements::Ascending(v) => {
                let mut m: BTreeMap<_, _> = std::mem::take(v).into_iter().collect();
                let fresh = m.insert(key, elem).is_none();
                *self = Elements::Map(m);
                fresh
            }
            Elements::Map(m) => m.insert(key, elem).is_none(),
        }
    }

    /// Adds the elements `later` holds, lowered from the elements that follow this one's. A
    /// key already here is returned with its element; when `later` is a map, the one returned
    /// is the smallest such key, not necessarily the first in the IR's order.
    fn append(&mut self, later: Elements) -> Result<(), Box<(ElemBytes, WireElem)>> {
        let later = match (&mut *self, later) {
            (Elements::Ascending(v), Elements::Ascending(w))
                if v.last().zip(w.first()).is_none_or(|((l, _), (f, _))| l < f) =>
            {
                if v.is_empty() {
                    *v = w;
                } else {
                    v.extend(w);
                }
                return Ok(());
            }
            (_, Elements::Ascending(w)) => w,
            (_, Elements::Map(m)) => m.into_iter().collect(),
        };
        for (key, elem) in later {
            if self.contains(&key) {
                return Err(Box::new((key, elem)));
            }
            self.insert(key, elem);
        }
        Ok(())
    }

    fn contains(&self, key: &ElemBytes) -> bool {
        match self {
            Elements::Ascending(v) => v.binary_search_by(|(k, _)| k.cmp(key)).is_ok(),
            Elements::Map(m) => m.contains_key(key),
        }
    }

    fn into_map(self) -> BTreeMap<ElemBytes, WireElem> {
        match self {
            Elements::Ascending(v) => v.into_iter().collect(),
            Elements::Map(m) => m,
        }
    }
}

pub(super) fn lower_rule(family: IpFamily, table: &Table, rule: &Rule) -> Result<WireRule, String> {
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

/// From this many elements in a table on, [`lower_owned`] encodes them on two threads. Below
/// it, a thread's start (tens of microseconds) is not worth it: the incremental path lowers
/// tables of a few Services.
pub(in crate::nft) const SPLIT_MIN_ELEMENTS: usize = 16_384;

/// Like [`lower`], but consumes the table and frees its elements as they are encoded.
///
/// A table of at least [`SPLIT_MIN_ELEMENTS`] elements is encoded by two threads, each freeing
/// what it encodes: the first half of its elements (in set order) on this one, the second half
/// on a helper. The result is [`lower`]'s, errors included, except for one case no valid IR
/// reaches: two elements encoding to the same key, one in each half, are named by the encoded
/// key instead of the IR's. At 10k Services × 10 endpoints (145k elements, 100k of them in
/// one map, which the halves share) lowering takes ~36 instead of ~50 ms on the 2-core
/// machine of `docs/performance.md`: the halves take about the same time, but the shared map
/// is built from its two halves on this thread afterwards.
pub fn lower_owned(mut table: Table) -> Result<WireTable, NftError> {
    let mut lists: Vec<Vec<Element>> = table
        .sets
        .iter_mut()
        .map(|s| std::mem::take(&mut s.elements))
        .collect();
    let total: usize = lists.iter().map(Vec::len).sum();
    if total >= SPLIT_MIN_ELEMENTS {
        return lower_split(&table, lists, total);
    }
    lists.reverse();
    lower_impl(&table, |_| lists.pop().unwrap_or_default())
}

/// [`lower_owned`] on two threads.
fn lower_split(
    table: &Table,
    mut lists: Vec<Vec<Element>>,
    total: usize,
) -> Result<WireTable, NftError> {
    let family = table.family;
    let mut w = table_shell(table);
    let desc = w.describe();
    // The set the halves meet in, and how many of its elements the first half has: the second
    // half starts inside that set (at its first element at the latest), so its first list is
    // never empty.
    let mut before = 0;
    let Some((meet, head_len)) = lists.iter().enumerate().find_map(|(i, l)| {
        let at = total / 2 - before;
        before += l.len();
        (at < l.len()).then_some((i, at))
    }) else {
        lists.reverse();
        return lower_impl(table, |_| lists.pop().unwrap_or_default());
    };
    // The set the halves meet in is shared: each half takes its elements out of its part of
    // the list, so that neither copies it.
    let mut shared = std::mem::take(&mut lists[meet]);
    let later: Vec<Vec<Element>> = lists.drain(meet + 1..).collect();
    lists.pop();
    let (head_part, tail_part) = shared.split_at_mut(head_len);
    // The first half's vector of the shared set has room for both halves, which are joined
    // into it.
    let shared_len = head_part.len() + tail_part.len();
    let tail_len = tail_part.len();
    let head_work: Vec<Part<'_>> = lists
        .into_iter()
        .map(Part::Whole)
        .chain([Part::Share(head_part, shared_len)])
        .collect();
    let tail_work: Vec<Part<'_>> = [Part::Share(tail_part, tail_len)]
        .into_iter()
        .chain(later.into_iter().map(Part::Whole))
        .collect();
    let head_sets = &table.sets[..=meet];
    let tail_sets = &table.sets[meet..];
    // Taken by the helper; left for this thread if the helper cannot be started.
    let tail = std::sync::Mutex::new(Some(tail_work));
    let (head, tail) = std::thread::scope(|scope| {
        let helper = std::thread::Builder::new()
            .name("nodeproxy-lower".into())
            .spawn_scoped(scope, || lower_run(family, &desc, tail_sets, take(&tail)));
        let head = lower_run(family, &desc, head_sets, head_work);
        let tail = match helper {
            Ok(helper) => helper
                .join()
                .unwrap_or_else(|panicked| std::panic::resume_unwind(panicked)),
            Err(_) => lower_run(family, &desc, tail_sets, take(&tail)),
        };
        (head, tail)
    });
    drop(shared);
    let (mut sets, head_result) = head;
    // The first half's failure comes first in the elements' order; then a key of the second
    // half already in the first; then the second half's own failure.
    head_result?;
    let (tail_sets_done, tail_result) = tail;
    let mut tail_done = tail_sets_done.into_iter();
    if let (Some((_, joined)), Some((_, later))) = (sets.last_mut(), tail_done.next()) {
        joined.append(later).map_err(|taken| {
            let (key, elem) = *taken;
            NftError::Invalid {
                object: format!(
                    "element {} in {}",
                    hex(&key),
                    set_object(&desc, &table.sets[meet])
                ),
                reason: "duplicate key".into(),
                origin: elem.origin.as_deref().cloned().map(Box::new),
            }
        })?;
    }
    tail_result?;
    sets.extend(tail_done);
    for (set, (mut ws, elements)) in table.sets.iter().zip(sets) {
        ws.elements = elements.into_map();
        w.add_set(&set.name, ws);
    }
    add_chains(table, &desc, &mut w)?;
    Ok(w)
}

/// The second half's work, for whichever thread lowers it.
fn take<'e>(tail: &std::sync::Mutex<Option<Vec<Part<'e>>>>) -> Vec<Part<'e>> {
    tail.lock()
        .map(|mut t| t.take())
        .unwrap_or_else(|poisoned| poisoned.into_inner().take())
        .unwrap_or_default()
}

/// What one half of [`lower_split`] lowered, set by set, and how it ended.
type Run = (Vec<(WireSet, Elements)>, Result<(), NftError>);

/// The elements of one set that one half of [`lower_split`] lowers.
enum Part<'e> {
    Whole(Vec<Element>),
    /// Part of the list of the set the halves meet in: each element is taken out (and freed once
    /// encoded), the list's buffer goes when both halves are done. Then the room to make for
    /// the lowered elements.
    Share(&'e mut [Element], usize),
}

/// Lowers the definitions of `sets` and, in order, the elements of each from `parts` (one per
/// set); stops at the first failure, keeping what was lowered before it.
fn lower_run(family: IpFamily, desc: &str, sets: &[Set], parts: Vec<Part<'_>>) -> Run {
    let mut shared = Shared::default();
    let mut done = Vec::with_capacity(parts.len());
    for (set, part) in sets.iter().zip(parts) {
        let ws = match set_definition(family, desc, set) {
            Ok(ws) => ws,
            Err(e) => return (done, Err(e)),
        };
        let mut elements = Elements::with_capacity(match &part {
            Part::Whole(list) => list.len(),
            Part::Share(_, room) => *room,
        });
        let out = &mut elements;
        let result = match part {
            Part::Whole(list) => {
                let result = lower_elements(family, desc, set, list, &mut shared, out);
                // Built into the set's map here, on this half's thread; a shared set's
                // halves are joined first.
                *out = Elements::Map(std::mem::take(out).into_map());
                result
            }
            Part::Share(list, _) => {
                let list = list.iter_mut().map(std::mem::take);
                lower_elements(family, desc, set, list, &mut shared, out)
            }
        };
        done.push((ws, elements));
        if result.is_err() {
            return (done, result);
        }
    }
    (done, Ok(()))
}

/// The wire table of `table` without its sets and chains.
fn table_shell(table: &Table) -> WireTable {
    let mut w = WireTable::new(table.family, &table.name);
    w.userdata = udata::comment(&table.comment);
    if table.owned {
        w.flags = TABLE_F_OWNED;
    }
    w
}

pub(super) fn lower_impl<E: Borrow<Element>, I: IntoIterator<Item = E>>(
    table: &Table,
    mut elements_of: impl FnMut(&Set) -> I,
) -> Result<WireTable, NftError> {
    let mut w = table_shell(table);
    let desc = w.describe();
    let mut shared = Shared::default();
    for set in &table.sets {
        let ws = lower_set(table.family, &desc, set, elements_of(set), &mut shared)?;
        w.add_set(&set.name, ws);
    }
    add_chains(table, &desc, &mut w)?;
    Ok(w)
}

/// Lowers the chains of `table` into `w`.
fn add_chains(table: &Table, desc: &str, w: &mut WireTable) -> Result<(), NftError> {
    for c in &table.chains {
        let mut rules = Vec::with_capacity(c.rules.len());
        for (i, r) in c.rules.iter().enumerate() {
            rules.push(
                lower_rule(table.family, table, r).map_err(|reason| NftError::Invalid {
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
    Ok(())
}
