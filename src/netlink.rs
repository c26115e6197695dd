//! The netlink transport shared by nf_tables and ctnetlink: the netfilter socket, message and
//! attribute primitives that write straight into one batch buffer (no per-message allocation),
//! and walking the attributes of received messages.
//!
//! Everything here is host-endian netlink framing; nftables payload attributes are big-endian
//! and are encoded by the callers.

use std::io;
use std::time::Duration;

use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};
use nix::sys::socket::{setsockopt, sockopt};

pub const NLMSG_HDRLEN: usize = 16;
pub const NFGEN_HDRLEN: usize = 4;
pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_TYPE_MASK: u16 = 0x3fff;

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_MULTI: u16 = 0x2;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_DUMP_INTR: u16 = 0x10;
pub const NLM_F_DUMP: u16 = 0x300;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_APPEND: u16 = 0x800;

pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
/// `NLM_F_ACK_TLVS` in an error message's flags: extended ack attributes follow.
pub const NLM_F_ACK_TLVS: u16 = 0x200;
/// `NLM_F_CAPPED`: the echoed request is truncated to its header.
pub const NLM_F_CAPPED: u16 = 0x100;
pub const NLMSGERR_ATTR_MSG: u16 = 1;
pub const NLMSGERR_ATTR_OFFS: u16 = 2;

pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub const NFNL_MSG_BATCH_END: u16 = 0x11;

/// The nlmsg type of an nftables message.
pub const fn nft_type(msg: u16) -> u16 {
    (NFNL_SUBSYS_NFTABLES << 8) | msg
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// An attribute, nest or message grew past what its 16-bit (or 32-bit) length can express.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLong;

/// Appends one netlink message (header + nfgenmsg) and returns its start offset; finish it with
/// [`end_msg`].
pub fn begin_msg(
    buf: &mut Vec<u8>,
    ty: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
) -> usize {
    let start = buf.len();
    buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched by end_msg
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
    buf.push(family);
    buf.push(0); // NFNETLINK_V0
    buf.extend_from_slice(&res_id.to_be_bytes());
    start
}

pub fn end_msg(buf: &mut [u8], start: usize) -> Result<(), TooLong> {
    let len = u32::try_from(buf.len() - start).map_err(|_| TooLong)?;
    buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    Ok(())
}

/// A length or count in a 32-bit netlink field (lengths of keys, masks and payloads, message
/// counts, sequence offsets). Ours are small by construction; one that did not fit would be
/// saturated, and the kernel would reject the message rather than read a wrapped value.
pub fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// An attribute's `nla_len`, saturated like [`len_u32`]: a leaf attribute over 64 KiB is
/// malformed either way, and the kernel rejects the message.
fn attr_len(n: usize) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
}

pub fn put_attr(buf: &mut Vec<u8>, ty: u16, data: &[u8]) {
    // Callers never put more than a few hundred bytes in a leaf attribute; nests are checked.
    let len = attr_len(4 + data.len());
    buf.extend_from_slice(&len.to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(data);
    buf.resize(align4(buf.len()), 0);
}

pub fn put_u32_be(buf: &mut Vec<u8>, ty: u16, v: u32) {
    put_attr(buf, ty, &v.to_be_bytes());
}

/// A NUL-terminated string attribute, as the kernel expects names.
pub fn put_str(buf: &mut Vec<u8>, ty: u16, s: &str) {
    let len = attr_len(4 + s.len() + 1);
    buf.extend_from_slice(&len.to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(s.as_bytes());
    buf.push(0);
    buf.resize(align4(buf.len()), 0);
}

pub fn nest_begin(buf: &mut Vec<u8>, ty: u16) -> usize {
    let pos = buf.len();
    buf.extend_from_slice(&0u16.to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    pos
}

pub fn nest_end(buf: &mut [u8], pos: usize) -> Result<(), TooLong> {
    let len = u16::try_from(buf.len() - pos).map_err(|_| TooLong)?;
    buf[pos..pos + 2].copy_from_slice(&len.to_ne_bytes());
    Ok(())
}

/// Iterates over the attributes in `data`: `(type as sent, payload, offset of the attribute
/// header within data)`. Stops at the first malformed attribute.
pub struct Attrs<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Attrs<'a> {
    pub fn new(data: &'a [u8]) -> Attrs<'a> {
        Attrs { data, pos: 0 }
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = (u16, &'a [u8], usize);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.data.get(self.pos..)?;
        if rest.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let ty = u16::from_ne_bytes([rest[2], rest[3]]);
        if len < 4 || len > rest.len() {
            return None;
        }
        let at = self.pos;
        self.pos += align4(len);
        Some((ty, &rest[4..len], at))
    }
}

pub fn be_u32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

pub fn ne_u32(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

/// A NUL-terminated (or not) string attribute payload.
pub fn cstr(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// One received netlink message.
pub struct Msg<'a> {
    pub ty: u16,
    pub flags: u16,
    pub seq: u32,
    /// Everything after the 16-byte netlink header.
    pub payload: &'a [u8],
}

impl Msg<'_> {
    /// The error code of an `NLMSG_ERROR` message (0 for an ack, `-errno` for an error).
    pub fn error_code(&self) -> Option<i32> {
        self.payload
            .get(..4)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// Splits a received datagram into messages.
pub fn messages(data: &[u8]) -> impl Iterator<Item = Msg<'_>> {
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        let rest = data.get(pos..)?;
        if rest.len() < NLMSG_HDRLEN {
            return None;
        }
        let len = ne_u32(rest)? as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            return None;
        }
        let ty = u16::from_ne_bytes([rest[4], rest[5]]);
        let flags = u16::from_ne_bytes([rest[6], rest[7]]);
        let seq = ne_u32(&rest[8..])?;
        pos += align4(len);
        Some(Msg {
            ty,
            flags,
            seq,
            payload: &rest[NLMSG_HDRLEN..len],
        })
    })
}

/// Opens a bound `NETLINK_NETFILTER` socket with a receive timeout (a reply that never comes
/// must not hang the caller) and `NETLINK_CAP_ACK` (errors echo only the failing message's
/// header, not the whole message), plus an initial sequence number. Shared by the nftables
/// writer and the conntrack reconciler.
pub fn open_socket(recv_timeout: Duration) -> Result<(Socket, u32), (&'static str, io::Error)> {
    let mut sock =
        Socket::new(NETLINK_NETFILTER).map_err(|e| ("open netfilter netlink socket", e))?;
    sock.bind_auto().map_err(|e| ("bind netlink socket", e))?;
    sock.set_cap_ack(true)
        .map_err(|e| ("set NETLINK_CAP_ACK", e))?;
    let secs = i64::try_from(recv_timeout.as_secs()).unwrap_or(i64::MAX);
    let tv = nix::sys::time::TimeVal::new(secs, 0);
    setsockopt(&sock, sockopt::ReceiveTimeout, &tv).map_err(|e| ("set SO_RCVTIMEO", e.into()))?;
    let seq = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        // The low 32 bits of the clock's seconds: the seed only keeps runs' sequence numbers apart.
        .map(|d| u32::try_from(d.as_secs() & u64::from(u32::MAX)).unwrap_or(0))
        .unwrap_or(1);
    Ok((sock, seq))
}
