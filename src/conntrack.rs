//! UDP conntrack reconciler over ctnetlink: deletes UDP flows that still point at endpoints a
//! Service no longer has, as kube-proxy's `CleanStaleEntries` does (no `conntrack` binary).
//!
//! Why: UDP has no connection teardown. A client that keeps its source port (DNS resolvers do)
//! keeps hitting the conntrack entry created by the first datagram, and that entry holds the
//! DNAT to the endpoint chosen back then, even after the endpoint is gone or the Service had no
//! endpoints at all (then the entry is not NATed and the traffic goes nowhere). TCP and SCTP are
//! never touched: they end naturally (kube-proxy behaves the same).
//!
//! The dump streams: each received batch of entries is parsed and dropped, only the entries to
//! delete are kept. Deletes are sent after the dump has finished (deleting while the kernel walks
//! the hash table could make the dump skip entries), many per `send`, each acked.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io;
use std::net::IpAddr;
use std::time::Duration;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
    ParseableParametrized,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::Socket;

use crate::model::IpFamily;
use crate::netlink::{Attrs, NLA_TYPE_MASK, NLMSG_DONE, NLMSG_ERROR, messages};

/// `NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW`: the type of every dumped entry.
const CT_NEW_MSG: u16 = 1 << 8;
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_PROTO_NUM: u16 = 1;
const CTA_ID: u16 = 12;
const CTA_ZONE: u16 = 18;
const IPPROTO_UDP: u8 = 17;

/// Deletes per `send`: each is acked, and 128 acks fit any receive buffer.
const DELETES_PER_SEND: usize = 128;
/// A kernel that stops answering must not hang the proxy's sync loop.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);
/// Receive buffer: the kernel sizes dump batches up to 32 KiB when the reader offers room.
const RECV_BUF: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("conntrack: {context}")]
    Io { context: String, source: io::Error },
    #[error("conntrack: the kernel refused to dump the {family} table")]
    Dump { family: IpFamily, source: io::Error },
    #[error("conntrack: cannot delete {flow}")]
    Delete { flow: String, source: io::Error },
    #[error("conntrack: unexpected netlink data: {0}")]
    Protocol(String),
}

fn io_err(context: &str) -> impl FnOnce(io::Error) -> ConntrackError + '_ {
    move |source| ConntrackError::Io {
        context: context.to_owned(),
        source,
    }
}

/// One UDP Service port of one IP family, as the reconciler needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpService {
    /// ClusterIP, externalIPs and LoadBalancer ingress IPs of this family. Addresses of the
    /// other family are ignored.
    pub ips: Vec<IpAddr>,
    /// The Service port (the destination port clients use on those IPs).
    pub port: u16,
    /// The NodePort, if the Service has one.
    pub node_port: Option<u16>,
    /// IPs of the endpoints that are serving (ready, or terminating but serving): flows whose
    /// replies come from one of these are kept.
    pub serving_endpoints: Vec<IpAddr>,
}

/// The part of a conntrack entry the decision needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    /// Original direction source (the client).
    pub src: IpAddr,
    pub sport: u16,
    /// Original direction destination (a Service IP before DNAT, or a node IP for NodePorts).
    pub dst: IpAddr,
    pub dport: u16,
    /// Reply direction source: the endpoint after DNAT, `dst` itself when not NATed.
    pub reply_src: IpAddr,
    pub reply_sport: u16,
}

impl fmt::Display for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sa = |a: IpAddr, p: u16| std::net::SocketAddr::new(a, p);
        write!(
            f,
            "udp flow {} -> {} (replies from {})",
            sa(self.src, self.sport),
            sa(self.dst, self.dport),
            sa(self.reply_src, self.reply_sport)
        )
    }
}

/// Decides which UDP flows are stale, kube-proxy's rules (`pkg/proxy/conntrack/cleanup.go`):
/// a flow is stale when its original destination is a Service IP and port, or its original
/// destination port is a NodePort, and its reply source is not a serving endpoint of that
/// Service. NodePorts match by port only, whatever the destination address: kube-proxy does the
/// same (a NodePort is open on every local address, and an unrelated flow that is deleted is
/// simply re-created by its next packet).
#[derive(Debug, Default, Clone)]
pub struct StaleMatcher {
    by_service: HashMap<(IpAddr, u16), HashSet<IpAddr>>,
    by_node_port: HashMap<u16, HashSet<IpAddr>>,
}

impl StaleMatcher {
    pub fn new(family: IpFamily, services: &[UdpService]) -> StaleMatcher {
        let mut m = StaleMatcher::default();
        for s in services {
            let eps = || {
                s.serving_endpoints
                    .iter()
                    .copied()
                    .filter(|a| IpFamily::of(a) == family)
            };
            for ip in s.ips.iter().filter(|a| IpFamily::of(a) == family) {
                // Two entries for one IP:port cannot exist for one protocol; should the input
                // hold them anyway, the union keeps every flow either one would keep.
                m.by_service.entry((*ip, s.port)).or_default().extend(eps());
            }
            if let Some(np) = s.node_port.filter(|&p| p != 0) {
                m.by_node_port.entry(np).or_default().extend(eps());
            }
        }
        m
    }

    /// Whether there is nothing to match (then the table need not be dumped).
    pub fn is_empty(&self) -> bool {
        self.by_service.is_empty() && self.by_node_port.is_empty()
    }

    pub fn is_stale(&self, f: &Flow) -> bool {
        if let Some(eps) = self.by_service.get(&(f.dst, f.dport))
            && !eps.contains(&f.reply_src)
        {
            return true;
        }
        if let Some(eps) = self.by_node_port.get(&f.dport)
            && !eps.contains(&f.reply_src)
        {
            return true;
        }
        false
    }
}

/// Deletes the family's UDP conntrack entries that are stale for `services` (see
/// [`StaleMatcher`]); returns how many the kernel deleted. Entries that disappear on their own
/// meanwhile are not errors.
pub fn reconcile_udp(family: IpFamily, services: &[UdpService]) -> Result<usize, ConntrackError> {
    let matcher = StaleMatcher::new(family, services);
    if matcher.is_empty() {
        return Ok(0);
    }
    let mut ct = Ctnetlink::open()?;
    let stale = ct.dump_stale(family, &matcher)?;
    ct.delete(family, &stale)
}

/// An entry to delete: its flow (for messages) and the attributes that identify it.
struct Doomed {
    flow: Flow,
    attrs: Vec<ConntrackAttribute>,
}

struct Ctnetlink {
    sock: Socket,
    seq: u32,
    rbuf: Vec<u8>,
}

fn nf_family(f: IpFamily) -> NetfilterProtoFamily {
    match f {
        IpFamily::V4 => NetfilterProtoFamily::IPv4,
        IpFamily::V6 => NetfilterProtoFamily::IPv6,
    }
}

fn error_code(payload: &[u8]) -> i32 {
    payload
        .get(..4)
        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or(0)
}

/// Whether a raw entry's original tuple is UDP: checked on the bytes so that the (usually far
/// more numerous) TCP entries are skipped without being parsed into owned structures.
fn raw_is_udp(attrs: &[u8]) -> bool {
    Attrs::new(attrs)
        .filter(|(t, _, _)| t & NLA_TYPE_MASK == CTA_TUPLE_ORIG)
        .flat_map(|(_, orig, _)| Attrs::new(orig))
        .filter(|(t, _, _)| t & NLA_TYPE_MASK == CTA_TUPLE_PROTO)
        .flat_map(|(_, proto, _)| Attrs::new(proto))
        .any(|(t, p, _)| t & NLA_TYPE_MASK == CTA_PROTO_NUM && p.first() == Some(&IPPROTO_UDP))
}

fn tuple_parts(tuple: &[Tuple]) -> (Option<IpAddr>, Option<IpAddr>, Option<u16>, Option<u16>) {
    let (mut src, mut dst, mut sport, mut dport) = (None, None, None, None);
    for t in tuple {
        match t {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::SourcePort(v) => sport = Some(*v),
                        ProtoTuple::DestinationPort(v) => dport = Some(*v),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    (src, dst, sport, dport)
}

fn is_udp(tuple: &[Tuple]) -> bool {
    tuple.iter().any(|t| {
        matches!(t, Tuple::Proto(ps) if ps.iter().any(|p| matches!(p, ProtoTuple::Protocol(Protocol::Udp))))
    })
}

/// The flow of a parsed entry and the attributes that identify it for deletion: the original
/// tuple, the zone (entries in a non-default zone are only found with it) and the entry id (the
/// kernel then refuses with ENOENT should a new entry have taken the tuple meanwhile).
fn doomed_of(attrs: Vec<ConntrackAttribute>) -> Option<Doomed> {
    let mut orig = None;
    let mut reply = None;
    let mut keep = Vec::new();
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => orig = Some(t),
            ConntrackAttribute::CtaTupleReply(t) => reply = Some(t),
            ConntrackAttribute::Other(n) if n.kind() == CTA_ZONE || n.kind() == CTA_ID => {
                keep.push(ConntrackAttribute::Other(n))
            }
            _ => {}
        }
    }
    let (orig, reply) = (orig?, reply?);
    if !is_udp(&orig) {
        return None;
    }
    let (src, dst, sport, dport) = tuple_parts(&orig);
    let (reply_src, _, reply_sport, _) = tuple_parts(&reply);
    let flow = Flow {
        src: src?,
        sport: sport?,
        dst: dst?,
        dport: dport?,
        reply_src: reply_src?,
        reply_sport: reply_sport?,
    };
    let mut attrs = vec![ConntrackAttribute::CtaTupleOrig(orig)];
    attrs.extend(keep);
    Some(Doomed { flow, attrs })
}

impl Ctnetlink {
    fn open() -> Result<Ctnetlink, ConntrackError> {
        let (sock, seq) =
            crate::netlink::open_socket(RECV_TIMEOUT).map_err(|(context, source)| {
                ConntrackError::Io {
                    context: context.into(),
                    source,
                }
            })?;
        Ok(Ctnetlink {
            sock,
            seq,
            rbuf: Vec::with_capacity(RECV_BUF),
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    fn recv(&mut self) -> io::Result<usize> {
        self.rbuf.clear();
        self.rbuf.reserve(RECV_BUF);
        self.sock.recv(&mut self.rbuf, 0)
    }

    /// Appends one serialized conntrack request to `out`.
    fn encode(
        out: &mut Vec<u8>,
        family: IpFamily,
        flags: u16,
        seq: u32,
        msg: ConntrackMessage,
    ) -> usize {
        let mut hdr = NetlinkHeader::default();
        hdr.flags = flags;
        hdr.sequence_number = seq;
        let mut m = NetlinkMessage::new(
            hdr,
            NetlinkPayload::from(NetfilterMessage::new(
                NetfilterHeader::new(nf_family(family), 0, 0),
                msg,
            )),
        );
        m.finalize();
        let at = out.len();
        out.resize(at + m.buffer_len(), 0);
        m.serialize(&mut out[at..]);
        m.buffer_len()
    }

    /// Dumps the family's table and returns the stale UDP entries, parsing each received batch
    /// and keeping nothing else.
    fn dump_stale(
        &mut self,
        family: IpFamily,
        matcher: &StaleMatcher,
    ) -> Result<Vec<Doomed>, ConntrackError> {
        let seq = self.next_seq();
        let mut req = Vec::with_capacity(32);
        Self::encode(
            &mut req,
            family,
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            ConntrackMessage::Get(vec![]),
        );
        self.sock
            .send(&req, 0)
            .map_err(io_err("send conntrack dump request"))?;
        let mut doomed = Vec::new();
        loop {
            self.recv().map_err(io_err("receive conntrack dump"))?;
            let mut done = false;
            for m in messages(&self.rbuf) {
                if m.seq != seq {
                    continue;
                }
                match m.ty {
                    NLMSG_DONE => done = true,
                    NLMSG_ERROR => {
                        let code = error_code(m.payload);
                        if code != 0 {
                            return Err(ConntrackError::Dump {
                                family,
                                source: io::Error::from_raw_os_error(-code),
                            });
                        }
                        done = true;
                    }
                    CT_NEW_MSG => {
                        if !raw_is_udp(m.payload.get(4..).unwrap_or_default()) {
                            continue;
                        }
                        let parsed =
                            NetfilterMessage::parse_with_param(m.payload, m.ty).map_err(|e| {
                                ConntrackError::Protocol(format!("conntrack entry: {e}"))
                            })?;
                        let NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)) =
                            parsed.inner
                        else {
                            continue;
                        };
                        if let Some(d) = doomed_of(attrs)
                            && matcher.is_stale(&d.flow)
                        {
                            doomed.push(d);
                        }
                    }
                    _ => {}
                }
            }
            if done {
                return Ok(doomed);
            }
        }
    }

    /// Deletes the entries, [`DELETES_PER_SEND`] per send; returns how many the kernel deleted.
    fn delete(&mut self, family: IpFamily, doomed: &[Doomed]) -> Result<usize, ConntrackError> {
        let mut deleted = 0;
        let mut buf = Vec::with_capacity(DELETES_PER_SEND * 96);
        for chunk in doomed.chunks(DELETES_PER_SEND) {
            buf.clear();
            let first = self.seq.wrapping_add(1);
            for d in chunk {
                let seq = self.next_seq();
                Self::encode(
                    &mut buf,
                    family,
                    NLM_F_REQUEST | NLM_F_ACK,
                    seq,
                    ConntrackMessage::Delete(d.attrs.clone()),
                );
            }
            self.sock
                .send(&buf, 0)
                .map_err(io_err("send conntrack deletes"))?;
            // ctnetlink handles each message of the datagram in order and acks each one.
            let mut pending = chunk.len();
            let mut failure = None;
            while pending > 0 {
                self.recv()
                    .map_err(io_err("receive conntrack delete acks"))?;
                for m in messages(&self.rbuf) {
                    if m.ty != NLMSG_ERROR {
                        continue;
                    }
                    // The ack echoes the request header: its sequence number says which entry.
                    let req_seq = m
                        .payload
                        .get(12..16)
                        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                        .unwrap_or(0);
                    let idx = req_seq.wrapping_sub(first) as usize;
                    let Some(d) = chunk.get(idx) else { continue };
                    pending -= 1;
                    match error_code(m.payload) {
                        0 => deleted += 1,
                        // Expired, or deleted by someone else, since the dump: nothing to do.
                        c if c == -nix::libc::ENOENT => {}
                        c => {
                            failure.get_or_insert(ConntrackError::Delete {
                                flow: d.flow.to_string(),
                                source: io::Error::from_raw_os_error(-c),
                            });
                        }
                    }
                }
            }
            if let Some(e) = failure {
                return Err(e);
            }
        }
        Ok(deleted)
    }
}

#[cfg(test)]
mod tests;
