//! `fib` (`nft_fib.c`): looks an address up in the routing table; ours ask whether it is local.

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "fib",
    nested: &[],
};

const FIB_DREG: u16 = 1;
const FIB_RESULT: u16 = 2;
const FIB_FLAGS: u16 = 3;

const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
const NFTA_FIB_F_SADDR: u32 = 1;
const NFTA_FIB_F_DADDR: u32 = 2;
/// `RTN_LOCAL`: the address type `local`.
const RTN_LOCAL: u32 = 2;

/// `fib <field> type local`, as nft 1.0.6 encodes it:
/// `[ fib <field> type => reg 1 ] [ cmp eq reg 1 0x00000002 ]`.
pub(crate) fn is_local(field: AddrField) -> [WireExpr; 2] {
    let flag = match field {
        AddrField::Saddr => NFTA_FIB_F_SADDR,
        AddrField::Daddr => NFTA_FIB_F_DADDR,
    };
    [
        WireExpr::new(
            KIND.name,
            vec![
                (FIB_DREG, be(NFT_REG_1)),
                (FIB_RESULT, be(NFT_FIB_RESULT_ADDRTYPE)),
                (FIB_FLAGS, be(flag)),
            ],
        ),
        // The address type is a u32 result: compared host-endian.
        cmp::compare(cmp::NFT_CMP_EQ, &RTN_LOCAL.to_ne_bytes()),
    ]
}
