//! `payload` (`nft_payload.c`): loads bytes of a packet header into a register.

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "payload",
    nested: &[],
};

const PAYLOAD_DREG: u16 = 1;
const PAYLOAD_BASE: u16 = 2;
const PAYLOAD_OFFSET: u16 = 3;
const PAYLOAD_LEN: u16 = 4;

/// `NFT_PAYLOAD_NETWORK_HEADER` and `NFT_PAYLOAD_TRANSPORT_HEADER`: where an offset counts from.
pub(crate) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub(crate) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;

/// Where `th dport` sits in the transport header: TCP, UDP and SCTP all put the destination
/// port at bytes 2..4.
pub(crate) const TH_DPORT_OFFSET: u32 = 2;
pub(crate) const TH_DPORT_LEN: u32 = 2;

/// Loads `len` bytes at `offset` from header `base` into register `dreg`.
pub(crate) fn load(dreg: u32, base: u32, offset: u32, len: u32) -> WireExpr {
    WireExpr::new(
        KIND.name,
        vec![
            (PAYLOAD_DREG, be(dreg)),
            (PAYLOAD_BASE, be(base)),
            (PAYLOAD_OFFSET, be(offset)),
            (PAYLOAD_LEN, be(len)),
        ],
    )
}
