//! `reject` (`nft_reject.c`): answers with an ICMP error instead of dropping silently.

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "reject",
    nested: &[],
};

const REJECT_TYPE: u16 = 1;
const REJECT_ICMP_CODE: u16 = 2;

const NFT_REJECT_ICMP_UNREACH: u32 = 0;
/// `ICMP_PORT_UNREACH` and `ICMPV6_PORT_UNREACH` (`linux/icmp.h`, `linux/icmpv6.h`).
const ICMP_PORT_UNREACH: u8 = 3;
const ICMPV6_PORT_UNREACH: u8 = 4;

/// `reject` as nft lowers it for ip and ip6 tables: ICMP port unreachable. The code is a u8
/// attribute.
pub(crate) fn port_unreachable(family: IpFamily) -> WireExpr {
    let code = match family {
        IpFamily::V4 => ICMP_PORT_UNREACH,
        IpFamily::V6 => ICMPV6_PORT_UNREACH,
    };
    WireExpr::new(
        KIND.name,
        vec![
            (REJECT_TYPE, be(NFT_REJECT_ICMP_UNREACH)),
            (REJECT_ICMP_CODE, vec![code]),
        ],
    )
}
