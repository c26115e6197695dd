//! `ct` (`nft_ct.c`): loads a connection's tracking state or status into register 1.

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "ct",
    nested: &[],
};

const CT_DREG: u16 = 1;
const CT_KEY: u16 = 2;

pub(crate) const NFT_CT_STATE: u32 = 0;
pub(crate) const NFT_CT_STATUS: u32 = 2;

/// The `new` bit of `ct state` (`NF_CT_STATE_BIT(IP_CT_NEW)`).
pub(crate) const CT_STATE_NEW: u32 = 0x8;
/// `IPS_DST_NAT` of `ct status` (`linux/netfilter/nf_conntrack_common.h`).
pub(crate) const IPS_DST_NAT: u32 = 0x20;

/// Loads `key` into register 1.
pub(crate) fn load(key: u32) -> WireExpr {
    WireExpr::new(KIND.name, vec![(CT_KEY, be(key)), (CT_DREG, be(NFT_REG_1))])
}
