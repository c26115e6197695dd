//! `nat` (`nft_nat.c`): destination NAT to the address (and port) a map lookup left in the
//! registers. The `NF_NAT_RANGE_*` flags (`linux/netfilter/nf_nat.h`) are `masq`'s too.

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "nat",
    nested: &[],
};

const NAT_TYPE: u16 = 1;
const NAT_FAMILY: u16 = 2;
const NAT_REG_ADDR_MIN: u16 = 3;
const NAT_REG_ADDR_MAX: u16 = 4;
const NAT_REG_PROTO_MIN: u16 = 5;
const NAT_REG_PROTO_MAX: u16 = 6;
const NAT_FLAGS: u16 = 7;

const NFT_NAT_DNAT: u32 = 1;

const NF_NAT_RANGE_MAP_IPS: u32 = 0x1;
const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;
pub(crate) const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;

/// `dnat <family> to <addr from addr_reg> [: <port from proto_reg>]`.
pub(crate) fn dnat(family: IpFamily, addr_reg: u32, proto_reg: Option<u32>) -> WireExpr {
    let mut attrs = vec![
        (NAT_TYPE, be(NFT_NAT_DNAT)),
        (NAT_FAMILY, be(u32::from(nfproto(family)))),
        (NAT_REG_ADDR_MIN, be(addr_reg)),
        (NAT_REG_ADDR_MAX, be(addr_reg)),
    ];
    let mut flags = NF_NAT_RANGE_MAP_IPS;
    if let Some(r) = proto_reg {
        attrs.push((NAT_REG_PROTO_MIN, be(r)));
        attrs.push((NAT_REG_PROTO_MAX, be(r)));
        flags |= NF_NAT_RANGE_PROTO_SPECIFIED;
    }
    attrs.push((NAT_FLAGS, be(flags)));
    WireExpr::new(KIND.name, attrs)
}
