//! `dynset` (`nft_dynset.c`): adds the key in register 1 to a dynamic set from the packet path,
//! or deletes it (ClientIP affinity's pins).

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "dynset",
    nested: &[],
};

const DYNSET_SET_NAME: u16 = 1;
const DYNSET_OP: u16 = 3;
const DYNSET_SREG_KEY: u16 = 4;
const DYNSET_SREG_DATA: u16 = 5;
const DYNSET_TIMEOUT: u16 = 6;
const DYNSET_FLAGS: u16 = 9;

pub(crate) const NFT_DYNSET_OP_UPDATE: u32 = 1;
/// Kernel 5.4.
pub(crate) const NFT_DYNSET_OP_DELETE: u32 = 2;

/// `update @set { key timeout <timeout_ms> }` (`: data` in `data_reg` for a map), as the kernel
/// dumps it back.
pub(crate) fn update(set: &str, timeout_ms: u64, data_reg: Option<u32>) -> WireExpr {
    with_data(as_dumped(set, NFT_DYNSET_OP_UPDATE, timeout_ms), data_reg)
}

/// `delete @set { key }` (`: data` in `data_reg` for a map), as the kernel dumps it back.
pub(crate) fn delete(set: &str, data_reg: Option<u32>) -> WireExpr {
    // The kernel dumps a timeout (0) for every dynset, whatever its operation.
    with_data(as_dumped(set, NFT_DYNSET_OP_DELETE, 0), data_reg)
}

fn with_data(e: WireExpr, data_reg: Option<u32>) -> WireExpr {
    match data_reg {
        None => e,
        Some(reg) => {
            let mut attrs = e.attrs;
            attrs.push((DYNSET_SREG_DATA, be(reg)));
            WireExpr::new(KIND.name, attrs)
        }
    }
}

/// A dynset as nft 1.0.6 sends it: no NFTA_DYNSET_FLAGS (the capability probe's form).
pub(crate) fn as_sent_by_nft(set: &str, op: u32, timeout_ms: u64) -> WireExpr {
    WireExpr::new(KIND.name, attrs(set, op, timeout_ms))
}

/// The kernel dumps the flags of every dynset, so ours carry them (0) to compare equal.
fn as_dumped(set: &str, op: u32, timeout_ms: u64) -> WireExpr {
    let mut attrs = attrs(set, op, timeout_ms);
    attrs.push((DYNSET_FLAGS, be(0)));
    WireExpr::new(KIND.name, attrs)
}

/// The timeout is in milliseconds, a 64-bit value.
fn attrs(set: &str, op: u32, timeout_ms: u64) -> Vec<(u16, Vec<u8>)> {
    vec![
        (DYNSET_SET_NAME, cstring(set)),
        (DYNSET_OP, be(op)),
        (DYNSET_SREG_KEY, be(NFT_REG_1)),
        (DYNSET_TIMEOUT, timeout_ms.to_be_bytes().to_vec()),
    ]
}

/// The set `e` adds to or deletes from, if it is a dynset.
pub(crate) fn set_of(e: &WireExpr) -> Option<String> {
    string_attr(e, &KIND, DYNSET_SET_NAME)
}
