//! `hash` (`nft_hash.c`): a Jenkins hash of registers into a register (IPv6 affinity pins).

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "hash",
    nested: &[],
};

const HASH_SREG: u16 = 1;
const HASH_DREG: u16 = 2;
const HASH_LEN: u16 = 3;
const HASH_MODULUS: u16 = 4;
const HASH_SEED: u16 = 5;
const HASH_TYPE: u16 = 7;

/// `NFT_HASH_JENKINS`.
const NFT_HASH_JENKINS: u32 = 0;

/// `jhash <len bytes from sreg> mod <modulus> seed <seed>` into `dreg`, as the kernel dumps it
/// back (an explicit seed is dumped, the offset only when not zero).
pub(crate) fn jhash(sreg: u32, len: u32, modulus: u32, seed: u32, dreg: u32) -> WireExpr {
    WireExpr::new(
        KIND.name,
        vec![
            (HASH_SREG, be(sreg)),
            (HASH_DREG, be(dreg)),
            (HASH_LEN, be(len)),
            (HASH_MODULUS, be(modulus)),
            (HASH_SEED, be(seed)),
            (HASH_TYPE, be(NFT_HASH_JENKINS)),
        ],
    )
}
