//! `meta` (`nft_meta.c`): packet metadata (mark, layer-4 protocol, input interface) loaded into
//! a register, or the mark set from one.

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "meta",
    nested: &[],
};

const META_DREG: u16 = 1;
const META_KEY: u16 = 2;
const META_SREG: u16 = 3;

pub(crate) const NFT_META_MARK: u32 = 3;
pub(crate) const NFT_META_IIFNAME: u32 = 6;
pub(crate) const NFT_META_L4PROTO: u32 = 16;

/// `IFNAMSIZ`: `meta iifname` loads the name as 16 NUL-padded bytes.
pub(crate) const IFNAMSIZ: usize = 16;

/// Loads `key` into register `dreg`.
pub(crate) fn load(key: u32, dreg: u32) -> WireExpr {
    WireExpr::new(KIND.name, vec![(META_KEY, be(key)), (META_DREG, be(dreg))])
}

/// Sets `key` from register `sreg`.
pub(crate) fn set(key: u32, sreg: u32) -> WireExpr {
    WireExpr::new(KIND.name, vec![(META_KEY, be(key)), (META_SREG, be(sreg))])
}
