//! `NFTA_DATA` nests, the kernel's one encoding of a value or a verdict wherever it carries
//! one: set element keys and data, `cmp` and `bitwise` operands, `immediate` verdicts.

use super::*;

/// An NFTA_DATA nest's payload holding a value.
pub(super) fn data_value(bytes: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(bytes.len() + 4);
    put_attr(&mut v, DATA_VALUE, bytes);
    v
}

/// An NFTA_DATA nest's payload holding a verdict. The kernel dumps the verdict nest without
/// `NLA_F_NESTED` (`nft_verdict_dump` uses `nla_nest_start_noflag`), so we send it that way too.
pub(super) fn data_verdict(code: i32, chain: Option<&str>) -> Vec<u8> {
    let mut inner = Vec::new();
    put_u32_be(&mut inner, VERDICT_CODE, code.cast_unsigned());
    if let Some(c) = chain {
        put_str(&mut inner, VERDICT_CHAIN, c);
    }
    let mut v = Vec::with_capacity(inner.len() + 4);
    put_attr(&mut v, DATA_VERDICT, &inner);
    v
}

/// An NFTA_DATA nest payload as read, before anything is allocated for it.
pub(crate) enum Parsed<'a> {
    Value(&'a [u8]),
    Verdict { code: i32, chain: Option<String> },
}

/// Parses an NFTA_DATA nest payload.
pub(crate) fn parse_nest(b: &[u8]) -> Option<Parsed<'_>> {
    for (ty, p, _) in crate::netlink::Attrs::new(b) {
        match ty & crate::netlink::NLA_TYPE_MASK {
            DATA_VALUE => return Some(Parsed::Value(p)),
            DATA_VERDICT => {
                let mut code = None;
                let mut chain = None;
                for (t, q, _) in crate::netlink::Attrs::new(p) {
                    match t & crate::netlink::NLA_TYPE_MASK {
                        VERDICT_CODE => code = crate::netlink::be_u32(q).map(|c| c as i32),
                        VERDICT_CHAIN => chain = Some(crate::netlink::cstr(q)),
                        _ => {}
                    }
                }
                return Some(Parsed::Verdict { code: code?, chain });
            }
            _ => {}
        }
    }
    None
}

/// Parses an NFTA_DATA nest payload.
pub fn parse_data(b: &[u8]) -> Option<WireData> {
    Some(match parse_nest(b)? {
        Parsed::Value(v) => WireData::value(v),
        Parsed::Verdict { code, chain } => WireData::verdict(code, chain.map(Arc::new)),
    })
}

/// Parses an NFTA_DATA nest payload holding a value (an element's key); `None` for a verdict.
pub fn parse_value(b: &[u8]) -> Option<ElemBytes> {
    match parse_nest(b)? {
        Parsed::Value(v) => Some(v.into()),
        Parsed::Verdict { .. } => None,
    }
}

/// Encodes `WireData` as an NFTA_DATA nest payload.
pub fn encode_data(d: &WireData, out: &mut Vec<u8>) {
    match d.get() {
        DataRef::Value(v) => put_attr(out, DATA_VALUE, v),
        DataRef::Verdict { code, chain } => {
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

/// The verdict code (`NF_*`, `NFT_*`) and target chain of a ruleset verdict.
pub(super) fn verdict_code(v: &Verdict) -> (i32, Option<&str>) {
    match v {
        Verdict::Accept => (NF_ACCEPT, None),
        Verdict::Drop => (NF_DROP, None),
        Verdict::Jump(c) => (NFT_JUMP, Some(c)),
        Verdict::Goto(c) => (NFT_GOTO, Some(c)),
        Verdict::Return => (NFT_RETURN, None),
    }
}
