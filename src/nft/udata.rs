//! nft's userdata TLVs (libnftnl `NFTNL_UDATA_*`): comments on tables, chains, sets and elements,
//! and the set metadata (`type`/`typeof`, byte order) that `nft list` needs to print keys.
//!
//! Format: `u8 type, u8 len, value` without padding; integers host-endian. Reproduced byte for
//! byte from `nft --debug=mnl` (nft 1.0.6) so that `nft list` prints what `render` prints.

use crate::model::IpFamily;
use crate::ruleset::{KeyField, Set, SetData};

/// nft limits comments to 128 bytes (`NFT_USERDATA_MAXLEN` is larger, the parser is not).
pub const COMMENT_MAX: usize = 128;

const SET_KEYBYTEORDER: u8 = 0;
const SET_DATABYTEORDER: u8 = 1;
const SET_KEY_TYPEOF: u8 = 3;
const SET_DATA_TYPEOF: u8 = 4;
const SET_DATA_INTERVAL: u8 = 6;
const SET_COMMENT: u8 = 7;

/// `enum byteorder` in nft.
const BYTEORDER_INVALID: u32 = 0;
const BYTEORDER_HOST: u32 = 1;
const BYTEORDER_BIG: u32 = 2;

/// `enum expr_types` in nft 1.0.6.
const EXPR_VERDICT: u32 = 1;
const EXPR_PAYLOAD: u32 = 7;
const EXPR_META: u32 = 9;
const EXPR_CONCAT: u32 = 13;
const EXPR_NUMGEN: u32 = 23;

fn tlv(out: &mut Vec<u8>, ty: u8, value: &[u8]) {
    // Values here are at most a few hundred bytes; callers keep them under 256.
    out.push(ty);
    out.push(u8::try_from(value.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(&value[..value.len().min(255)]);
}

fn tlv_u32(out: &mut Vec<u8>, ty: u8, v: u32) {
    tlv(out, ty, &v.to_ne_bytes());
}

/// Truncates a comment to nft's limit (on a char boundary) and NUL-terminates it.
fn comment_bytes(text: &str) -> Vec<u8> {
    let mut end = text.len().min(COMMENT_MAX - 1);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut v = Vec::with_capacity(end + 1);
    v.extend_from_slice(&text.as_bytes()[..end]);
    v.push(0);
    v
}

/// The userdata of a table, chain or element with this comment (`NFTNL_UDATA_*_COMMENT` = 0);
/// empty when there is no comment.
pub fn comment(text: &str) -> Vec<u8> {
    if text.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    tlv(&mut out, 0, &comment_bytes(text));
    out
}

/// The comment stored in table/chain/element userdata, if any.
pub fn parse_comment(udata: &[u8]) -> Option<String> {
    let mut pos = 0;
    while pos + 2 <= udata.len() {
        let (ty, len) = (udata[pos], udata[pos + 1] as usize);
        let v = udata.get(pos + 2..pos + 2 + len)?;
        if ty == 0 {
            return Some(crate::netlink::cstr(v));
        }
        pos += 2 + len;
    }
    None
}

fn field_byteorder(f: KeyField) -> u32 {
    match f {
        KeyField::Numgen { .. } | KeyField::Jhash { .. } => BYTEORDER_HOST,
        _ => BYTEORDER_BIG,
    }
}

/// nft's udata for one expression of a `typeof`: `{0: expr type, 1: {expr data}}`.
fn typeof_expr(out: &mut Vec<u8>, family: IpFamily, f: KeyField) {
    let mut data = Vec::new();
    // A set declares a `ct original … daddr` key as the destination address and a `jhash` as
    // a `numgen` (the same types): nft 1.0.6 lists a `typeof jhash …` set by crashing.
    let f = match f {
        KeyField::CtOrigDaddr => KeyField::Daddr,
        KeyField::Jhash { .. } => KeyField::Numgen { modulus: 2 },
        f => f,
    };
    let modulus = match f {
        KeyField::Numgen { modulus } => modulus,
        _ => 2,
    };
    let ty = match f {
        KeyField::Saddr | KeyField::Daddr | KeyField::CtOrigDaddr => {
            // proto desc: ip = 12, ip6 = 13; field: ip saddr 11 / daddr 12, ip6 saddr 8 / daddr 9.
            let (desc, field) = match (family, f) {
                (IpFamily::V4, KeyField::Saddr) => (12, 11),
                (IpFamily::V4, _) => (12, 12),
                (IpFamily::V6, KeyField::Saddr) => (13, 8),
                (IpFamily::V6, _) => (13, 9),
            };
            tlv_u32(&mut data, 0, desc);
            tlv_u32(&mut data, 1, field);
            EXPR_PAYLOAD
        }
        KeyField::ThDport => {
            // proto desc th = 11, field dport = 2.
            tlv_u32(&mut data, 0, 11);
            tlv_u32(&mut data, 1, 2);
            EXPR_PAYLOAD
        }
        KeyField::L4Proto => {
            tlv_u32(&mut data, 0, 16); // NFT_META_L4PROTO
            EXPR_META
        }
        KeyField::Numgen { .. } | KeyField::Jhash { .. } => {
            tlv_u32(&mut data, 0, 1); // NFT_NG_RANDOM
            tlv_u32(&mut data, 1, modulus);
            tlv_u32(&mut data, 2, 0); // offset
            EXPR_NUMGEN
        }
    };
    tlv_u32(out, 0, ty);
    tlv(out, 1, &data);
}

/// `typeof` udata of a key or data: a concat of expressions, or one expression.
fn typeof_of(family: IpFamily, fields: &[KeyField]) -> Vec<u8> {
    let mut out = Vec::new();
    if let [single] = fields {
        typeof_expr(&mut out, family, *single);
        return out;
    }
    let mut list = Vec::new();
    for (i, f) in fields.iter().enumerate() {
        let mut e = Vec::new();
        typeof_expr(&mut e, family, *f);
        tlv(&mut list, u8::try_from(i).unwrap_or(u8::MAX), &e);
    }
    tlv_u32(&mut out, 0, EXPR_CONCAT);
    tlv(&mut out, 1, &list);
    out
}

/// nft 1.0.6 writes a `KEY_TYPEOF` holding an empty concat for concatenated `type` keys.
fn empty_concat() -> Vec<u8> {
    let mut out = Vec::new();
    tlv_u32(&mut out, 0, EXPR_CONCAT);
    tlv(&mut out, 1, &[]);
    out
}

fn byteorder(fields: &[KeyField]) -> u32 {
    match fields {
        [single] => field_byteorder(*single),
        _ => BYTEORDER_INVALID,
    }
}

/// The set userdata nft writes for this set (see the module doc for the observed layouts).
pub fn set_udata(family: IpFamily, set: &Set) -> Vec<u8> {
    let mut out = Vec::new();
    tlv_u32(&mut out, SET_KEYBYTEORDER, byteorder(&set.key));
    if let Some(data) = &set.data {
        let order = match data {
            SetData::Verdict => BYTEORDER_INVALID,
            SetData::Value(fields) => byteorder(fields),
        };
        tlv_u32(&mut out, SET_DATABYTEORDER, order);
    }
    if set.typeof_ {
        tlv(&mut out, SET_KEY_TYPEOF, &typeof_of(family, &set.key));
    } else if set.key.len() > 1 {
        tlv(&mut out, SET_KEY_TYPEOF, &empty_concat());
    }
    // Value maps also carry the data's typeof (an empty concat for a concatenated `type`, as
    // for keys), and every map DATA_INTERVAL = 0 (nft 1.0.6, checked by the kernel tests
    // against maps nft itself created).
    match &set.data {
        Some(SetData::Value(fields)) => {
            if set.typeof_ {
                tlv(&mut out, SET_DATA_TYPEOF, &typeof_of(family, fields));
            } else if fields.len() > 1 {
                tlv(&mut out, SET_DATA_TYPEOF, &empty_concat());
            }
        }
        // A `typeof … : verdict` map describes its data as a verdict expression without data
        // (`{0: EXPR_VERDICT, 1: {}}`); without it nft 1.0.6 lists the key as plain types and
        // asserts (mergesort.c) on the elements.
        Some(SetData::Verdict) if set.typeof_ => {
            let mut verdict = Vec::new();
            tlv_u32(&mut verdict, 0, EXPR_VERDICT);
            tlv(&mut verdict, 1, &[]);
            tlv(&mut out, SET_DATA_TYPEOF, &verdict);
        }
        Some(SetData::Verdict) | None => {}
    }
    if set.data.is_some() {
        tlv_u32(&mut out, SET_DATA_INTERVAL, 0);
    }
    if !set.comment.is_empty() {
        tlv(&mut out, SET_COMMENT, &comment_bytes(&set.comment));
    }
    out
}
