//! `payload` (`nft_payload.c`): loads bytes of a packet header into a register, or writes a
//! register into the header (with the checksums the kernel must fix).

use super::*;

pub(crate) const KIND: Kind = Kind {
    name: "payload",
    nested: &[],
};

const PAYLOAD_DREG: u16 = 1;
const PAYLOAD_BASE: u16 = 2;
const PAYLOAD_OFFSET: u16 = 3;
const PAYLOAD_LEN: u16 = 4;
const PAYLOAD_SREG: u16 = 5;
const PAYLOAD_CSUM_TYPE: u16 = 6;
const PAYLOAD_CSUM_OFFSET: u16 = 7;
const PAYLOAD_CSUM_FLAGS: u16 = 8;

/// `NFT_PAYLOAD_CSUM_NONE` and `NFT_PAYLOAD_CSUM_INET` (the IPv4 header checksum, at
/// `csum_offset` of the header written).
const NFT_PAYLOAD_CSUM_NONE: u32 = 0;
const NFT_PAYLOAD_CSUM_INET: u32 = 1;
/// `NFT_PAYLOAD_L4CSUM_PSEUDOHDR`: the address is part of the TCP/UDP pseudo-header, so the
/// kernel updates the transport checksum too (`nft_payload_l4csum_update`).
const NFT_PAYLOAD_L4CSUM_PSEUDOHDR: u32 = 1;
/// Where the IPv4 header checksum sits.
const IPV4_CSUM_OFFSET: u32 = 10;

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

/// Writes register `sreg` over the destination address at `offset` of the network header, as
/// nft 1.0.6 does for `ip daddr set …` (`ip6`: no header checksum): fixing the IPv4 header
/// checksum and the transport pseudo-header checksum.
pub(crate) fn write_daddr(v6: bool, sreg: u32, offset: u32, len: u32) -> WireExpr {
    let (csum_type, csum_offset) = if v6 {
        (NFT_PAYLOAD_CSUM_NONE, 0)
    } else {
        (NFT_PAYLOAD_CSUM_INET, IPV4_CSUM_OFFSET)
    };
    WireExpr::new(
        KIND.name,
        vec![
            (PAYLOAD_SREG, be(sreg)),
            (PAYLOAD_BASE, be(NFT_PAYLOAD_NETWORK_HEADER)),
            (PAYLOAD_OFFSET, be(offset)),
            (PAYLOAD_LEN, be(len)),
            (PAYLOAD_CSUM_TYPE, be(csum_type)),
            (PAYLOAD_CSUM_OFFSET, be(csum_offset)),
            (PAYLOAD_CSUM_FLAGS, be(NFT_PAYLOAD_L4CSUM_PSEUDOHDR)),
        ],
    )
}
