//! Expressions as the kernel takes them: the attribute numbers and constants of each
//! expression kind (`linux/netfilter/nf_tables.h`), their builders, which attributes nest, and
//! data and verdict encodings.

use super::*;

// ---- expression attribute numbers (linux/netfilter/nf_tables.h) ----
pub(super) const PAYLOAD_DREG: u16 = 1;
pub(super) const PAYLOAD_BASE: u16 = 2;
pub(super) const PAYLOAD_OFFSET: u16 = 3;
pub(super) const PAYLOAD_LEN: u16 = 4;
pub(super) const META_DREG: u16 = 1;
pub(super) const META_KEY: u16 = 2;
pub(super) const META_SREG: u16 = 3;
pub(super) const CMP_SREG: u16 = 1;
pub(super) const CMP_OP: u16 = 2;
pub(super) const CMP_DATA: u16 = 3;
pub(super) const BITWISE_SREG: u16 = 1;
pub(super) const BITWISE_DREG: u16 = 2;
pub(super) const BITWISE_LEN: u16 = 3;
pub(super) const BITWISE_MASK: u16 = 4;
pub(super) const BITWISE_XOR: u16 = 5;
pub(super) const BITWISE_OP: u16 = 6;
pub const LOOKUP_SET: u16 = 1;
pub(super) const LOOKUP_SREG: u16 = 2;
pub(super) const LOOKUP_DREG: u16 = 3;
pub(super) const LOOKUP_FLAGS: u16 = 5;
pub(super) const IMMEDIATE_DREG: u16 = 1;
pub const IMMEDIATE_DATA: u16 = 2;
pub(super) const NG_DREG: u16 = 1;
pub(super) const NG_MODULUS: u16 = 2;
pub(super) const NG_TYPE: u16 = 3;
pub(super) const NG_OFFSET: u16 = 4;
pub(super) const NAT_TYPE: u16 = 1;
pub(super) const NAT_FAMILY: u16 = 2;
pub(super) const NAT_REG_ADDR_MIN: u16 = 3;
pub(super) const NAT_REG_ADDR_MAX: u16 = 4;
pub(super) const NAT_REG_PROTO_MIN: u16 = 5;
pub(super) const NAT_REG_PROTO_MAX: u16 = 6;
pub(super) const NAT_FLAGS: u16 = 7;
pub(super) const MASQ_FLAGS: u16 = 1;
pub(super) const REJECT_TYPE: u16 = 1;
pub(super) const REJECT_ICMP_CODE: u16 = 2;
pub(super) const CT_DREG: u16 = 1;
pub(super) const CT_KEY: u16 = 2;
pub(super) const FIB_DREG: u16 = 1;
pub(super) const FIB_RESULT: u16 = 2;
pub(super) const FIB_FLAGS: u16 = 3;
pub(super) const BYTEORDER_SREG: u16 = 1;
pub(super) const BYTEORDER_DREG: u16 = 2;
pub(super) const BYTEORDER_OP: u16 = 3;
pub(super) const BYTEORDER_LEN: u16 = 4;
pub(super) const BYTEORDER_SIZE: u16 = 5;
pub(super) const DYNSET_SET_NAME: u16 = 1;
pub(super) const DYNSET_OP: u16 = 3;
pub(super) const DYNSET_SREG_KEY: u16 = 4;
pub(super) const DYNSET_TIMEOUT: u16 = 6;
pub(super) const DYNSET_FLAGS: u16 = 9;
pub(super) const NFT_DYNSET_OP_UPDATE: u32 = 1;
pub(super) const NFT_DYNSET_OP_DELETE: u32 = 2;
pub(super) const NFT_BYTEORDER_HTON: u32 = 1;
/// `NFT_LOOKUP_F_INV`: the lookup matches when the key is absent.
pub(super) const NFT_LOOKUP_F_INV: u32 = 1;

pub(super) const NFT_META_MARK: u32 = 3;
pub(super) const NFT_META_L4PROTO: u32 = 16;
pub(super) const NFT_META_IIFNAME: u32 = 6;
/// `NFT_FIB_RESULT_ADDRTYPE`, `NFTA_FIB_F_SADDR`, `NFTA_FIB_F_DADDR`, and `RTN_LOCAL` (the
/// address type `local`, compared host-endian).
pub(super) const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
pub(super) const NFTA_FIB_F_SADDR: u32 = 1;
pub(super) const NFTA_FIB_F_DADDR: u32 = 2;
pub(super) const RTN_LOCAL: u32 = 2;
/// `IFNAMSIZ`: nft compares an exact interface name as 16 NUL-padded bytes.
pub(super) const IFNAMSIZ: usize = 16;
pub(super) const NFT_CT_STATE: u32 = 0;
pub(super) const NFT_CT_STATUS: u32 = 2;
pub(super) const NFT_CMP_EQ: u32 = 0;
pub(super) const NFT_CMP_NEQ: u32 = 1;
pub(super) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub(super) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
pub(super) const NFT_NG_RANDOM: u32 = 1;
pub(super) const NFT_NAT_DNAT: u32 = 1;
pub(super) const NF_NAT_RANGE_MAP_IPS: u32 = 0x1;
pub(super) const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;
pub(super) const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;
pub(super) const NFT_REJECT_ICMP_UNREACH: u32 = 0;
/// ICMP_PORT_UNREACH (3) and ICMPV6_PORT_UNREACH (4); NFTA_REJECT_ICMP_CODE is a u8 attribute.
pub(super) const ICMP_PORT_UNREACH: u8 = 3;
pub(super) const ICMPV6_PORT_UNREACH: u8 = 4;
/// `ct state new` bit and `IPS_DST_NAT`.
pub(super) const CT_STATE_NEW: u32 = 0x8;
pub(super) const IPS_DST_NAT: u32 = 0x20;

pub(super) fn be(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

/// Register numbers as the kernel dumps them (`nft_dump_register`): a 32-bit register that
/// starts a 16-byte register is reported as that register (NFT_REG_1..4), others as
/// NFT_REG32_xx. `word` counts 32-bit words from the start of NFT_REG_1.
pub(super) fn reg(word: u32) -> u32 {
    if word.is_multiple_of(4) {
        1 + word / 4
    } else {
        8 + word
    }
}

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

pub(super) fn payload(dreg: u32, base: u32, offset: u32, len: u32) -> WireExpr {
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

pub(super) fn meta_load(key: u32, dreg: u32) -> WireExpr {
    WireExpr::new("meta", vec![(META_KEY, be(key)), (META_DREG, be(dreg))])
}

pub(super) fn cmp(op: u32, data: &[u8]) -> WireExpr {
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
pub(super) fn bitwise(mask: &[u8], xor: &[u8]) -> WireExpr {
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

pub(super) fn ct_load(key: u32) -> WireExpr {
    WireExpr::new("ct", vec![(CT_KEY, be(key)), (CT_DREG, be(1))])
}

/// Loads the key fields into consecutive registers from NFT_REG_1; returns the words used.
pub(super) fn load_key(family: IpFamily, key: &[KeyField], out: &mut Vec<WireExpr>) -> u32 {
    load_key_for(family, key, false, out)
}

/// Like [`load_key`]; for a lookup in a concatenation of ranges, nft 1.0.6 follows the
/// one-byte `meta l4proto` load with `byteorder hton(size 2, len 1)` (a no-op in the kernel:
/// it converts len/size = 0 words), so we emit it too, or the rule would not list back as nft's.
pub(super) fn load_key_for(
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

pub(super) fn lookup(set: &str, dreg: Option<u32>) -> WireExpr {
    lookup_flags(set, dreg, 0)
}

pub(super) fn cstring(s: &str) -> Vec<u8> {
    let mut name = s.as_bytes().to_vec();
    name.push(0);
    name
}

pub(super) fn lookup_flags(set: &str, dreg: Option<u32>, flags: u32) -> WireExpr {
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

pub(super) fn verdict_code(v: &Verdict) -> (i32, Option<&str>) {
    match v {
        Verdict::Accept => (NF_ACCEPT, None),
        Verdict::Drop => (NF_DROP, None),
        Verdict::Jump(c) => (NFT_JUMP, Some(c)),
        Verdict::Goto(c) => (NFT_GOTO, Some(c)),
        Verdict::Return => (NFT_RETURN, None),
    }
}

/// Builds NEST flags for sending an expression attribute.
pub fn expr_attr_type(name: &str, ty: u16) -> u16 {
    if WireExpr::is_nested(name, ty) {
        ty | NLA_F_NESTED
    } else {
        ty
    }
}
