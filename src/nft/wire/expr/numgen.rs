//! `numgen` (`nft_numgen.c`): a random number below a modulus, to pick an endpoint.

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "numgen",
    nested: &[],
};

const NG_DREG: u16 = 1;
const NG_MODULUS: u16 = 2;
const NG_TYPE: u16 = 3;
const NG_OFFSET: u16 = 4;

const NFT_NG_RANDOM: u32 = 1;

/// `numgen random mod <modulus>` into register `dreg`, a host-endian u32.
pub(crate) fn random(dreg: u32, modulus: u32) -> WireExpr {
    WireExpr::new(
        KIND.name,
        vec![
            (NG_DREG, be(dreg)),
            (NG_MODULUS, be(modulus)),
            (NG_TYPE, be(NFT_NG_RANDOM)),
            (NG_OFFSET, be(0)),
        ],
    )
}
