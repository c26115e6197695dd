//! `lookup` (`nft_lookup.c`): looks the key in register 1 up in a set, or a map whose data goes
//! to a register (the verdict register for a verdict map).

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "lookup",
    nested: &[],
};

const LOOKUP_SET: u16 = 1;
const LOOKUP_SREG: u16 = 2;
const LOOKUP_DREG: u16 = 3;
const LOOKUP_FLAGS: u16 = 5;

/// `NFT_LOOKUP_F_INV`: the lookup matches when the key is absent.
const NFT_LOOKUP_F_INV: u32 = 1;

/// Looks the key up in `set`; with `dreg`, a map lookup writing the data there.
pub(crate) fn lookup(set: &str, dreg: Option<u32>) -> WireExpr {
    with_flags(set, dreg, 0)
}

/// Matches when the key is not in `set`.
pub(crate) fn absent(set: &str) -> WireExpr {
    with_flags(set, None, NFT_LOOKUP_F_INV)
}

/// The kernel dumps the flags of every lookup, so ours carry them (0) to compare equal.
fn with_flags(set: &str, dreg: Option<u32>, flags: u32) -> WireExpr {
    let mut attrs = vec![
        (LOOKUP_SET, cstring(set)),
        (LOOKUP_SREG, be(NFT_REG_1)),
        (LOOKUP_FLAGS, be(flags)),
    ];
    if let Some(d) = dreg {
        attrs.push((LOOKUP_DREG, be(d)));
    }
    WireExpr::new(KIND.name, attrs)
}

/// The set `e` looks up, if it is a lookup.
pub(crate) fn set_of(e: &WireExpr) -> Option<String> {
    string_attr(e, &KIND, LOOKUP_SET)
}
