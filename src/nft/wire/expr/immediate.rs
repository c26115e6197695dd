//! `immediate` (`nft_immediate.c`): writes a constant to a register; ours are verdicts
//! (accept, drop, jump, goto, return), which is also how iptables-nft encodes `-j CHAIN`.

use super::*;

const IMMEDIATE_DREG: u16 = 1;
const IMMEDIATE_DATA: u16 = 2;

pub(crate) const KIND: Kind = Kind {
    name: "immediate",
    nested: &[IMMEDIATE_DATA],
};

/// The verdict `code` (to `chain`, for jump and goto).
pub(crate) fn verdict(code: i32, chain: Option<&str>) -> WireExpr {
    WireExpr::new(
        KIND.name,
        vec![
            (IMMEDIATE_DREG, be(NFT_REG_VERDICT)),
            (IMMEDIATE_DATA, data_verdict(code, chain)),
        ],
    )
}

/// The chain `e` jumps or goes to, if it is such an immediate.
pub(crate) fn chain_of(e: &WireExpr) -> Option<String> {
    if e.name != KIND.name {
        return None;
    }
    match parse_nest(e.attr(IMMEDIATE_DATA)?)? {
        Parsed::Verdict { chain, .. } => chain,
        Parsed::Value(_) => None,
    }
}
