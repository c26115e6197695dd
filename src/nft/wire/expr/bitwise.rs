//! `bitwise` (`nft_bitwise.c`): masks register 1 in place, for prefix, mark and state bit tests
//! and for setting mark bits.

use super::*;

const BITWISE_SREG: u16 = 1;
const BITWISE_DREG: u16 = 2;
const BITWISE_LEN: u16 = 3;
const BITWISE_MASK: u16 = 4;
const BITWISE_XOR: u16 = 5;
const BITWISE_OP: u16 = 6;

pub(crate) const KIND: Kind = Kind {
    name: "bitwise",
    nested: &[BITWISE_MASK, BITWISE_XOR],
};

/// `NFT_BITWISE_BOOL`: `(reg & mask) ^ xor`.
const NFT_BITWISE_BOOL: u32 = 0;

/// `reg 1 = (reg 1 & mask) ^ xor`. The kernel (≥ 5.x) dumps NFTA_BITWISE_OP although nft does
/// not send it; we send it so the dump matches.
pub(crate) fn mask_xor(mask: &[u8], xor: &[u8]) -> WireExpr {
    WireExpr::new(
        KIND.name,
        vec![
            (BITWISE_SREG, be(NFT_REG_1)),
            (BITWISE_DREG, be(NFT_REG_1)),
            (BITWISE_LEN, be(len_u32(mask.len()))),
            (BITWISE_OP, be(NFT_BITWISE_BOOL)),
            (BITWISE_MASK, data_value(mask)),
            (BITWISE_XOR, data_value(xor)),
        ],
    )
}
