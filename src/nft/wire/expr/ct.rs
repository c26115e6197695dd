//! `ct` (`nft_ct.c`): loads a connection's tracking state or status into register 1, or the
//! original direction's destination address into a register.

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "ct",
    nested: &[],
};

const CT_DREG: u16 = 1;
const CT_KEY: u16 = 2;
/// `NFTA_CT_DIRECTION`, a u8.
const CT_DIRECTION: u16 = 3;

pub(crate) const NFT_CT_STATE: u32 = 0;
pub(crate) const NFT_CT_STATUS: u32 = 2;
/// `NFT_CT_DST_IP` and `NFT_CT_DST_IP6`: the destination address of one direction, of a fixed
/// family (what nft 1.0.6 uses for `ct original ip daddr`; kernel 4.17).
const NFT_CT_DST_IP: u32 = 20;
const NFT_CT_DST_IP6: u32 = 22;
/// `IP_CT_DIR_ORIGINAL`.
const IP_CT_DIR_ORIGINAL: u8 = 0;

/// The `new` bit of `ct state` (`NF_CT_STATE_BIT(IP_CT_NEW)`).
pub(crate) const CT_STATE_NEW: u32 = 0x8;
/// `IPS_DST_NAT` of `ct status` (`linux/netfilter/nf_conntrack_common.h`).
pub(crate) const IPS_DST_NAT: u32 = 0x20;

/// Loads `key` into register 1.
pub(crate) fn load(key: u32) -> WireExpr {
    WireExpr::new(KIND.name, vec![(CT_KEY, be(key)), (CT_DREG, be(NFT_REG_1))])
}

/// `ct original ip daddr` (`ip6` for `v6`) into register `dreg`.
pub(crate) fn load_original_daddr(v6: bool, dreg: u32) -> WireExpr {
    let key = if v6 { NFT_CT_DST_IP6 } else { NFT_CT_DST_IP };
    WireExpr::new(
        KIND.name,
        vec![
            (CT_KEY, be(key)),
            (CT_DREG, be(dreg)),
            (CT_DIRECTION, vec![IP_CT_DIR_ORIGINAL]),
        ],
    )
}
