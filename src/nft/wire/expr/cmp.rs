//! `cmp` (`nft_cmp.c`): compares register 1 with a value; a mismatch ends the rule.

use super::*;

const CMP_SREG: u16 = 1;
const CMP_OP: u16 = 2;
const CMP_DATA: u16 = 3;

pub(crate) const KIND: Kind = Kind {
    name: "cmp",
    nested: &[CMP_DATA],
};

pub(crate) const NFT_CMP_EQ: u32 = 0;
pub(crate) const NFT_CMP_NEQ: u32 = 1;

/// `reg 1 <op> data`.
pub(crate) fn compare(op: u32, data: &[u8]) -> WireExpr {
    WireExpr::new(
        KIND.name,
        vec![
            (CMP_SREG, be(NFT_REG_1)),
            (CMP_OP, be(op)),
            (CMP_DATA, data_value(data)),
        ],
    )
}
