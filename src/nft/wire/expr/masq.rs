//! `masq` (`nft_masq.c`): source NAT to the outgoing interface's address.

use super::nat::NF_NAT_RANGE_PROTO_RANDOM_FULLY;
use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "masq",
    nested: &[],
};

const MASQ_FLAGS: u16 = 1;

/// `masquerade`, `fully-random` when asked (then the kernel dumps the flags; otherwise none).
pub(crate) fn masquerade(fully_random: bool) -> WireExpr {
    let attrs = if fully_random {
        vec![(MASQ_FLAGS, be(NF_NAT_RANGE_PROTO_RANDOM_FULLY))]
    } else {
        Vec::new()
    };
    WireExpr::new(KIND.name, attrs)
}
