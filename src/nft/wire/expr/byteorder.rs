//! `byteorder` (`nft_byteorder.c`): converts a register between host and network order; nft
//! emits one we must mirror (see [`hton_l4proto`]).

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "byteorder",
    nested: &[],
};

const BYTEORDER_SREG: u16 = 1;
const BYTEORDER_DREG: u16 = 2;
const BYTEORDER_OP: u16 = 3;
const BYTEORDER_LEN: u16 = 4;
const BYTEORDER_SIZE: u16 = 5;

const NFT_BYTEORDER_HTON: u32 = 1;

/// The `byteorder` nft 1.0.6 puts after the one-byte `meta l4proto` load of a concatenation of
/// ranges: `hton(reg, size 2, len 1)`. The kernel converts len/size = 0 words, a no-op, but the
/// rule only lists back as nft's with it.
pub(crate) fn hton_l4proto(reg: u32) -> WireExpr {
    const LEN: u32 = 1;
    const SIZE: u32 = 2;
    WireExpr::new(
        KIND.name,
        vec![
            (BYTEORDER_SREG, be(reg)),
            (BYTEORDER_DREG, be(reg)),
            (BYTEORDER_OP, be(NFT_BYTEORDER_HTON)),
            (BYTEORDER_LEN, be(LEN)),
            (BYTEORDER_SIZE, be(SIZE)),
        ],
    )
}
