//! The netlink backend: one nfnetlink batch per transaction, sent with one `send`, replies
//! collected without waiting for acks that never come; dumps of our table.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use netlink_sys::Socket;
use nix::sys::socket::{setsockopt, sockopt};

use super::diff::{Op, Plan};
use super::owner::{Holder, TableInfo, describe_owner};
use super::uapi::*;
use super::wire::{
    self, WireChain, WireData, WireElem, WireExpr, WireHook, WireRule, WireSet, WireTable,
    expr_attr_type, nfproto,
};
use super::{ApplyStats, Kernel, NftError, RejectedOp, ReplyKind};
use crate::model::{IpFamily, ServicePortName};
use crate::netlink::*;

/// Element lists are split so that each message's element nest stays well below the 16-bit
/// attribute length limit.
const ELEMS_PER_MSG_MAX: usize = 1000;
const ELEM_NEST_BYTES_MAX: usize = 32 * 1024;

/// Never wait longer than this for replies after a send (the kernel queues every reply inside
/// `sendmsg`, so this only bounds pathological cases).
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

fn io_err(context: &str) -> impl FnOnce(io::Error) -> NftError + '_ {
    move |source| NftError::Io {
        context: context.to_owned(),
        source,
    }
}

/// Which op (and which part of it) one message of a batch carries.
struct LedgerEntry {
    seq: u32,
    op: usize,
    /// Offset of the message in the batch buffer.
    start: usize,
    /// For element messages: the range of the op's elements in this message.
    elems: (usize, usize),
}

/// One encoded batch and the ledger mapping each message back to its op.
pub struct Batch {
    pub buf: Vec<u8>,
    ledger: Vec<LedgerEntry>,
    end_seq: u32,
    pub messages: usize,
}

/// Encodes `ops` as one batch: BATCH_BEGIN, the ops, BATCH_END (the only message with an ack
/// request; acking every message would overflow the receive buffer at scale).
pub fn encode_batch(
    family: IpFamily,
    table: &str,
    ops: &[Op<'_>],
    first_seq: u32,
) -> Result<Batch, NftError> {
    let fam = nfproto(family);
    let mut b = Batch {
        buf: Vec::with_capacity(4096),
        ledger: Vec::new(),
        end_seq: 0,
        messages: 0,
    };
    let mut seq = first_seq;
    let s = begin_msg(
        &mut b.buf,
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
    );
    end(&mut b.buf, s)?;
    // Pre-size for element-heavy batches (~67 bytes per element at 10k services, with comments)
    // so that the buffer is not reallocated: one doubling of a 10 MB batch briefly holds 30 MB.
    let n_elems: usize = ops
        .iter()
        .map(|o| match o {
            Op::AddElems { elems, .. } | Op::DelElems { elems, .. } => elems.len(),
            _ => 0,
        })
        .sum();
    b.buf.reserve(n_elems * 80);
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::AddElems { set, elems, .. } | Op::DelElems { set, elems, .. } => {
                let (ty, flags) = if matches!(op, Op::AddElems { .. }) {
                    // Not NLM_F_EXCL: adding an element that exists with the same data is then a
                    // no-op. A read-back can miss elements (a set dump that overlaps the
                    // rhashtable's deferred resize after a bulk insert skips some, and the
                    // kernel does not flag the dump as interrupted; seen on 6.18 with 100k
                    // elements), and such a miss must not fail the transaction.
                    (NEWSETELEM, NLM_F_CREATE)
                } else {
                    (DELSETELEM, 0)
                };
                let mut at = 0;
                while at < elems.len() {
                    seq += 1;
                    let start =
                        begin_msg(&mut b.buf, nft_type(ty), NLM_F_REQUEST | flags, seq, fam, 0);
                    put_str(&mut b.buf, ELEM_LIST_TABLE, table);
                    put_str(&mut b.buf, ELEM_LIST_SET, set);
                    let nest = nest_begin(&mut b.buf, ELEM_LIST_ELEMENTS | NLA_F_NESTED);
                    let first = at;
                    while at < elems.len()
                        && at - first < ELEMS_PER_MSG_MAX
                        && b.buf.len() - nest < ELEM_NEST_BYTES_MAX
                    {
                        let (key, e) = elems[at];
                        encode_elem(&mut b.buf, key, e, ty == NEWSETELEM);
                        at += 1;
                    }
                    nest_end(&mut b.buf, nest).map_err(|_| too_long("element list"))?;
                    end(&mut b.buf, start)?;
                    b.ledger.push(LedgerEntry {
                        seq,
                        op: i,
                        start,
                        elems: (first, at),
                    });
                }
            }
            _ => {
                seq += 1;
                let start = encode_op(&mut b.buf, fam, table, op, seq)?;
                b.ledger.push(LedgerEntry {
                    seq,
                    op: i,
                    start,
                    elems: (0, 0),
                });
            }
        }
    }
    seq += 1;
    b.end_seq = seq;
    let s = begin_msg(
        &mut b.buf,
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
    );
    end(&mut b.buf, s)?;
    b.messages = b.ledger.len() + 2;
    Ok(b)
}

fn too_long(what: &str) -> NftError {
    NftError::Protocol(format!("{what} too long for a netlink attribute"))
}

fn end(buf: &mut [u8], start: usize) -> Result<(), NftError> {
    end_msg(buf, start).map_err(|_| too_long("message"))
}

fn encode_elem(buf: &mut Vec<u8>, key: &[u8], e: &WireElem, with_data: bool) {
    let el = nest_begin(buf, LIST_ELEM | NLA_F_NESTED);
    let k = nest_begin(buf, ELEM_KEY | NLA_F_NESTED);
    put_attr(buf, DATA_VALUE, key);
    let _ = nest_end(buf, k);
    // A range element is identified by both ends, also when it is deleted.
    if let Some(end) = &e.key_end {
        let k = nest_begin(buf, ELEM_KEY_END | NLA_F_NESTED);
        put_attr(buf, DATA_VALUE, end);
        let _ = nest_end(buf, k);
    }
    if with_data {
        if let Some(d) = &e.data {
            let n = nest_begin(buf, ELEM_DATA | NLA_F_NESTED);
            wire::encode_data(d, buf);
            let _ = nest_end(buf, n);
        }
        if let Some(u) = &e.userdata {
            put_attr(buf, ELEM_USERDATA, u);
        }
    }
    // An element is at most a few hundred bytes: its nests cannot overflow.
    let _ = nest_end(buf, el);
}

fn encode_op(
    buf: &mut Vec<u8>,
    fam: u8,
    table: &str,
    op: &Op<'_>,
    seq: u32,
) -> Result<usize, NftError> {
    let start;
    match op {
        Op::AddTable { flags, userdata } => {
            start = begin_msg(
                buf,
                nft_type(NEWTABLE),
                NLM_F_REQUEST | NLM_F_CREATE,
                seq,
                fam,
                0,
            );
            put_str(buf, TABLE_NAME, table);
            put_u32_be(buf, TABLE_FLAGS, *flags);
            if !userdata.is_empty() {
                put_attr(buf, TABLE_USERDATA, userdata);
            }
        }
        Op::UpdateTable { flags } => {
            start = begin_msg(buf, nft_type(NEWTABLE), NLM_F_REQUEST, seq, fam, 0);
            put_str(buf, TABLE_NAME, table);
            put_u32_be(buf, TABLE_FLAGS, *flags);
        }
        Op::AddChain { name, chain } => {
            start = begin_msg(
                buf,
                nft_type(NEWCHAIN),
                NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL,
                seq,
                fam,
                0,
            );
            put_str(buf, CHAIN_TABLE, table);
            put_str(buf, CHAIN_NAME, name);
            if let Some(h) = &chain.hook {
                let n = nest_begin(buf, CHAIN_HOOK | NLA_F_NESTED);
                put_u32_be(buf, HOOK_HOOKNUM, h.hooknum);
                put_u32_be(buf, HOOK_PRIORITY, h.priority.cast_unsigned());
                let _ = nest_end(buf, n);
                put_u32_be(buf, CHAIN_POLICY, h.policy);
                put_str(buf, CHAIN_TYPE, &h.kind);
            }
            if !chain.userdata.is_empty() {
                put_attr(buf, CHAIN_USERDATA, &chain.userdata);
            }
        }
        Op::DelChain { name } => {
            start = begin_msg(buf, nft_type(DELCHAIN), NLM_F_REQUEST, seq, fam, 0);
            put_str(buf, CHAIN_TABLE, table);
            put_str(buf, CHAIN_NAME, name);
        }
        Op::FlushChain { name } => {
            start = begin_msg(buf, nft_type(DELRULE), NLM_F_REQUEST, seq, fam, 0);
            put_str(buf, RULE_TABLE, table);
            put_str(buf, RULE_CHAIN, name);
        }
        Op::AddRule { chain, rule, .. } => {
            start = begin_msg(
                buf,
                nft_type(NEWRULE),
                NLM_F_REQUEST | NLM_F_CREATE | NLM_F_APPEND,
                seq,
                fam,
                0,
            );
            put_str(buf, RULE_TABLE, table);
            put_str(buf, RULE_CHAIN, chain);
            let list = nest_begin(buf, RULE_EXPRESSIONS | NLA_F_NESTED);
            for e in &rule.exprs {
                let el = nest_begin(buf, LIST_ELEM | NLA_F_NESTED);
                put_str(buf, EXPR_NAME, &e.name);
                let d = nest_begin(buf, EXPR_DATA | NLA_F_NESTED);
                for (ty, v) in &e.attrs {
                    put_attr(buf, expr_attr_type(&e.name, *ty), v);
                }
                nest_end(buf, d).map_err(|_| too_long("expression"))?;
                nest_end(buf, el).map_err(|_| too_long("expression"))?;
            }
            nest_end(buf, list).map_err(|_| too_long("rule"))?;
        }
        Op::AddSet { name, set } => {
            start = begin_msg(
                buf,
                nft_type(NEWSET),
                NLM_F_REQUEST | NLM_F_CREATE | NLM_F_EXCL,
                seq,
                fam,
                0,
            );
            put_str(buf, SET_TABLE, table);
            put_str(buf, SET_NAME, name);
            // NFTA_SET_ID is mandatory (the kernel returns EINVAL without it); it only needs
            // to be unique within the batch, and we reference sets by name.
            put_u32_be(buf, SET_ID, seq);
            put_u32_be(buf, SET_FLAGS, set.flags);
            put_u32_be(buf, SET_KEY_TYPE, set.key_type);
            put_u32_be(buf, SET_KEY_LEN, set.key_len);
            if let Some(t) = set.data_type {
                put_u32_be(buf, SET_DATA_TYPE, t);
            }
            if let Some(l) = set.data_len {
                put_u32_be(buf, SET_DATA_LEN, l);
            }
            if !set.concat.is_empty() {
                let desc = nest_begin(buf, SET_DESC | NLA_F_NESTED);
                let list = nest_begin(buf, SET_DESC_CONCAT | NLA_F_NESTED);
                for len in &set.concat {
                    let el = nest_begin(buf, LIST_ELEM | NLA_F_NESTED);
                    put_u32_be(buf, SET_FIELD_LEN, *len);
                    let _ = nest_end(buf, el);
                }
                // At most a handful of fields.
                let _ = nest_end(buf, list);
                let _ = nest_end(buf, desc);
            }
            if !set.userdata.is_empty() {
                put_attr(buf, SET_USERDATA, &set.userdata);
            }
        }
        Op::DelSet { name } => {
            start = begin_msg(buf, nft_type(DELSET), NLM_F_REQUEST, seq, fam, 0);
            put_str(buf, SET_TABLE, table);
            put_str(buf, SET_NAME, name);
        }
        Op::AddElems { .. } | Op::DelElems { .. } => {
            return Err(NftError::Protocol(
                "element ops are encoded by encode_batch".into(),
            ));
        }
    }
    end(buf, start)?;
    Ok(start)
}

/// Describes the object an op (or the element at `elem`) works on, and the Service behind it.
fn describe(
    plan_table: &str,
    op: &Op<'_>,
    elem: Option<usize>,
    range: (usize, usize),
) -> (String, Option<ServicePortName>) {
    match op {
        Op::AddTable { .. } | Op::UpdateTable { .. } => (plan_table.to_owned(), None),
        Op::AddChain { name, .. } | Op::DelChain { name } | Op::FlushChain { name } => {
            (format!("chain {name} of {plan_table}"), None)
        }
        Op::AddRule { chain, index, .. } => (
            format!("rule {} of chain {chain} of {plan_table}", index + 1),
            None,
        ),
        Op::AddSet { name, set } => (set.describe(name, plan_table), None),
        Op::DelSet { name } => (format!("set {name} of {plan_table}"), None),
        Op::AddElems { set, def, elems } | Op::DelElems { set, def, elems } => {
            let what = def.describe(set, plan_table);
            match elem.and_then(|i| elems.get(i)) {
                Some((k, e)) => {
                    let mut s = format!("element {}", def.format_key(k));
                    if let Some(d) = &e.data {
                        s.push_str(&format!(" : {}", format_data(def, d)));
                    }
                    (format!("{s} in {what}"), e.origin.as_deref().cloned())
                }
                None => {
                    let (a, b) = range;
                    let first = elems
                        .get(a)
                        .map(|(k, _)| def.format_key(k))
                        .unwrap_or_default();
                    let origin = if b - a == 1 {
                        elems.get(a).and_then(|e| e.1.origin.as_deref().cloned())
                    } else {
                        None
                    };
                    (
                        format!("{} element(s) starting at {first} in {what}", b - a),
                        origin,
                    )
                }
            }
        }
    }
}

fn format_data(def: &WireSet, d: &WireData) -> String {
    match d {
        WireData::Value(v) => wire::format_concat(def.data_type.unwrap_or(0), v),
        WireData::Verdict { code, chain } => {
            let word = match *code {
                NF_ACCEPT => "accept",
                NF_DROP => "drop",
                NFT_JUMP => "jump",
                NFT_GOTO => "goto",
                NFT_RETURN => "return",
                NFT_CONTINUE => "continue",
                _ => "verdict",
            };
            match chain {
                Some(c) => format!("{word} {c}"),
                None => word.to_owned(),
            }
        }
    }
}

/// Finds which element of an element message the ext-ack offset points into.
fn elem_at_offset(batch: &[u8], msg_start: usize, offset: u32) -> Option<usize> {
    let msg = batch.get(msg_start..)?;
    let len = ne_u32(msg)? as usize;
    let attrs_start = NLMSG_HDRLEN + NFGEN_HDRLEN;
    let attrs = msg.get(attrs_start..len)?;
    for (ty, payload, at) in Attrs::new(attrs) {
        if ty & NLA_TYPE_MASK == ELEM_LIST_ELEMENTS {
            let base = attrs_start + at + 4;
            for (i, (_, p, eat)) in Attrs::new(payload).enumerate() {
                let s = base + eat;
                if (offset as usize) >= s && (offset as usize) < s + 4 + p.len() {
                    return Some(i);
                }
            }
        }
    }
    None
}

/// The netlink backend.
pub struct NetlinkKernel {
    sock: Socket,
    /// Our socket's netlink port id: what the kernel records as the owner of a table we create
    /// or claim with `NFT_TABLE_F_OWNER`.
    port: u32,
    seq: u32,
    rbuf: Vec<u8>,
}

/// A table's name and header from a GETTABLE dump.
struct TableHeader {
    name: String,
    info: TableInfo,
    userdata: Vec<u8>,
}

impl NetlinkKernel {
    pub fn new() -> Result<NetlinkKernel, NftError> {
        let (sock, seq) = open_socket(RECV_TIMEOUT).map_err(|(context, source)| NftError::Io {
            context: context.into(),
            source,
        })?;
        sock.set_ext_ack(true)
            .map_err(io_err("set NETLINK_EXT_ACK"))?;
        // Room for many error replies and for dump batches.
        let _ = setsockopt(&sock, sockopt::RcvBufForce, &(8 << 20));
        let mut addr = netlink_sys::SocketAddr::new(0, 0);
        sock.get_address(&mut addr)
            .map_err(io_err("getsockname of the netlink socket"))?;
        Ok(NetlinkKernel {
            sock,
            port: addr.port_number(),
            seq,
            rbuf: Vec::with_capacity(1 << 20),
        })
    }

    fn next_seq(&mut self, n: usize) -> u32 {
        let s = self.seq.wrapping_add(1);
        self.seq = self.seq.wrapping_add(len_u32(n).wrapping_add(2));
        s
    }

    fn recv(&mut self, flags: i32) -> io::Result<usize> {
        self.rbuf.clear();
        self.rbuf.reserve(1 << 20);
        self.sock.recv(&mut self.rbuf, flags)
    }

    /// Sends one transaction and collects every error the kernel reports.
    fn send_batch(
        &mut self,
        plan: &Plan<'_>,
        ops: &[Op<'_>],
        phase: u8,
        stats: &mut ApplyStats,
    ) -> Result<(), NftError> {
        if ops.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        let n_msgs_hint = ops.len();
        let seq0 = self.next_seq(n_msgs_hint);
        let batch = encode_batch(plan.family, &plan.table, ops, seq0)?;
        // Keep our seq counter past every message of this batch.
        self.seq = batch.end_seq.wrapping_add(1);
        stats.encode += t0.elapsed();
        stats.messages += batch.messages;
        stats.bytes += batch.buf.len();

        let t1 = Instant::now();
        // The whole batch must fit the send buffer or the kernel returns EMSGSIZE; the kernel
        // doubles the value and subtracts its own overhead, so ask for the size plus slack.
        let want = batch
            .buf
            .len()
            .saturating_add(1 << 16)
            .min(i32::MAX as usize);
        setsockopt(&self.sock, sockopt::SndBufForce, &want).map_err(|e| NftError::Io {
            context: "set SO_SNDBUFFORCE (needs CAP_NET_ADMIN)".into(),
            source: e.into(),
        })?;
        let sent = self
            .sock
            .send(&batch.buf, 0)
            .map_err(io_err("send nftables batch"))?;
        if sent != batch.buf.len() {
            return Err(NftError::Protocol(format!(
                "short send: {sent} of {} bytes",
                batch.buf.len()
            )));
        }
        let first = batch.ledger.first().map(|l| l.seq).unwrap_or(seq0);
        let mut errors = Vec::new();
        let mut end_acked = false;
        let mut unknown = None;
        // nfnetlink processes the whole batch inside sendmsg and queues every reply there, so
        // everything is already waiting: read without blocking until the socket is empty. On
        // success, kernels ≥ 6.10 ack BATCH_END; on failure nothing acks it.
        loop {
            match self.recv(nix::libc::MSG_DONTWAIT) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(nix::libc::ENOBUFS) => {
                    unknown =
                        Some("receive buffer overflowed (ENOBUFS): replies were lost".to_owned());
                    continue;
                }
                Err(e) => {
                    return Err(NftError::Io {
                        context: "receive nftables replies".into(),
                        source: e,
                    });
                }
            }
            for m in messages(&self.rbuf) {
                if m.ty != NLMSG_ERROR {
                    continue;
                }
                let Some(code) = m.error_code() else {
                    continue;
                };
                // The echoed request header tells which message failed.
                let Some(req) = m.payload.get(4..20) else {
                    continue;
                };
                let req_seq = ne_u32(&req[8..]).unwrap_or(0);
                if code == 0 {
                    if req_seq == batch.end_seq {
                        end_acked = true;
                    }
                    continue;
                }
                let (msg_text, offset) = parse_ext_ack(m.flags, m.payload);
                let entry = batch.ledger.iter().find(|l| l.seq == req_seq);
                let (op_kind, object, origin) = match entry {
                    Some(l) => {
                        let op = &ops[l.op];
                        let elem = match (op, offset) {
                            (Op::AddElems { .. } | Op::DelElems { .. }, Some(off)) => {
                                elem_at_offset(&batch.buf, l.start, off).map(|i| l.elems.0 + i)
                            }
                            (Op::AddElems { .. } | Op::DelElems { .. }, None)
                                if l.elems.1 - l.elems.0 == 1 =>
                            {
                                Some(l.elems.0)
                            }
                            _ => None,
                        };
                        let (object, origin) = describe(&plan.table_desc(), op, elem, l.elems);
                        (op.kind(), object, origin)
                    }
                    None if req_seq < first || req_seq >= batch.end_seq => (
                        "batch",
                        format!("transaction on {}", plan.table_desc()),
                        None,
                    ),
                    None => ("unknown", format!("message seq {req_seq}"), None),
                };
                errors.push(RejectedOp {
                    op: op_kind,
                    object,
                    origin,
                    errno: io::Error::from_raw_os_error(-code),
                    ext_ack: msg_text,
                    ext_ack_offset: offset,
                    phase,
                });
            }
        }
        stats.kernel += t1.elapsed();
        if errors.iter().any(is_eperm) {
            return Err(self.denied(plan.family, &plan.table));
        }
        if !errors.is_empty() {
            return Err(NftError::Rejected { errors });
        }
        if let Some(u) = unknown {
            return Err(NftError::Unknown(u));
        }
        // Kernels before 6.10 do not ack BATCH_END at all: no error is success there.
        stats.batch_end_acked |= end_acked;
        Ok(())
    }

    /// Sends a dump request and returns every reply message's payload (after the netlink
    /// header). `Ok(None)` when the kernel answers ENOENT.
    fn dump(
        &mut self,
        fam: u8,
        ty: u16,
        attrs: &[(u16, &str)],
    ) -> Result<Option<Vec<Vec<u8>>>, NftError> {
        let seq = self.next_seq(1);
        let mut req = Vec::with_capacity(64);
        let s = begin_msg(
            &mut req,
            nft_type(ty),
            NLM_F_REQUEST | NLM_F_DUMP,
            seq,
            fam,
            0,
        );
        for (t, v) in attrs {
            put_str(&mut req, *t, v);
        }
        end(&mut req, s)?;
        self.sock
            .send(&req, 0)
            .map_err(io_err("send dump request"))?;
        let mut out = Vec::new();
        loop {
            self.recv(0).map_err(io_err("receive dump"))?;
            let mut done = false;
            for m in messages(&self.rbuf) {
                if m.seq != seq {
                    continue;
                }
                if m.flags & NLM_F_DUMP_INTR != 0 {
                    return Err(NftError::Interrupted);
                }
                match m.ty {
                    NLMSG_DONE => done = true,
                    NLMSG_ERROR => {
                        let code = m.error_code().unwrap_or(0);
                        let errno = io::Error::from_raw_os_error(-code);
                        if code != 0 && ReplyKind::of(&errno) == ReplyKind::NotFound {
                            return Ok(None);
                        }
                        if code != 0 {
                            return Err(NftError::Io {
                                context: format!("dump nftables message type {ty}"),
                                source: errno,
                            });
                        }
                        done = true;
                    }
                    _ => out.push(m.payload.get(NFGEN_HDRLEN..).unwrap_or_default().to_vec()),
                }
            }
            if done {
                return Ok(Some(out));
            }
        }
    }

    /// The headers of every table of `family`.
    fn table_headers(&mut self, family: IpFamily) -> Result<Vec<TableHeader>, NftError> {
        let Some(tables) = self.dump(nfproto(family), GETTABLE, &[])? else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(tables.len());
        for t in &tables {
            let mut h = TableHeader {
                name: String::new(),
                info: TableInfo {
                    flags: 0,
                    owner: None,
                },
                userdata: Vec::new(),
            };
            for (ty, p, _) in Attrs::new(t) {
                match ty & NLA_TYPE_MASK {
                    TABLE_NAME => h.name = cstr(p),
                    TABLE_FLAGS => h.info.flags = be_u32(p).unwrap_or(0),
                    TABLE_OWNER => h.info.owner = be_u32(p),
                    TABLE_USERDATA => h.userdata = p.to_vec(),
                    _ => {}
                }
            }
            out.push(h);
        }
        Ok(out)
    }

    /// Our socket's netlink port id (the owner id of tables we own).
    pub fn port_id(&self) -> u32 {
        self.port
    }

    /// The header of table `name` of `family` (cheap: no chains, sets or elements); `None` when
    /// it does not exist.
    pub fn table_info(
        &mut self,
        family: IpFamily,
        name: &str,
    ) -> Result<Option<TableInfo>, NftError> {
        for _ in 0..5 {
            match self.table_headers(family) {
                Err(NftError::Interrupted) => continue,
                Err(e) => return Err(e),
                Ok(hs) => return Ok(hs.into_iter().find(|h| h.name == name).map(|h| h.info)),
            }
        }
        Err(NftError::Interrupted)
    }

    /// The error for an EPERM on `table`: who owns it, if anyone.
    fn denied(&mut self, family: IpFamily, table: &str) -> NftError {
        let owner = match self.table_info(family, table) {
            Ok(Some(info)) => match info.holder(self.port) {
                Holder::Other(port) => Some(describe_owner(port)),
                _ => None,
            },
            _ => None,
        };
        NftError::Denied {
            table: format!("table {} {table}", wire::family_keyword(family)),
            owner,
        }
    }

    fn read_table_once(
        &mut self,
        family: IpFamily,
        name: &str,
    ) -> Result<Option<WireTable>, NftError> {
        let fam = nfproto(family);
        let Some(header) = self
            .table_headers(family)?
            .into_iter()
            .find(|h| h.name == name)
        else {
            return Ok(None);
        };
        let mut w = WireTable::new(family, name);
        w.flags = header.info.flags;
        if header.info.holder(self.port) != Holder::Us {
            w.flags &= !TABLE_F_OWNER;
        }
        w.userdata = header.userdata;

        for c in self
            .dump(fam, GETCHAIN, &[(CHAIN_TABLE, name)])?
            .unwrap_or_default()
        {
            let (mut tname, mut cname) = (String::new(), String::new());
            let mut chain = WireChain::default();
            let mut hook: Option<WireHook> = None;
            let (mut policy, mut kind) = (None, None);
            for (ty, p, _) in Attrs::new(&c) {
                match ty & NLA_TYPE_MASK {
                    CHAIN_TABLE => tname = cstr(p),
                    CHAIN_NAME => cname = cstr(p),
                    CHAIN_HOOK => {
                        let mut h = WireHook {
                            hooknum: 0,
                            priority: 0,
                            kind: String::new(),
                            policy: 0,
                        };
                        for (t, q, _) in Attrs::new(p) {
                            match t & NLA_TYPE_MASK {
                                HOOK_HOOKNUM => h.hooknum = be_u32(q).unwrap_or(0),
                                HOOK_PRIORITY => h.priority = be_u32(q).unwrap_or(0) as i32,
                                _ => {}
                            }
                        }
                        hook = Some(h);
                    }
                    CHAIN_POLICY => policy = be_u32(p),
                    CHAIN_TYPE => kind = Some(cstr(p)),
                    CHAIN_USERDATA => chain.userdata = p.to_vec(),
                    _ => {}
                }
            }
            if tname != name {
                continue;
            }
            if let Some(mut h) = hook {
                h.policy = policy.unwrap_or(0);
                h.kind = kind.unwrap_or_default();
                chain.hook = Some(h);
            }
            w.add_chain(&cname, chain);
        }

        for r in self
            .dump(fam, GETRULE, &[(RULE_TABLE, name)])?
            .unwrap_or_default()
        {
            let (mut tname, mut cname) = (String::new(), String::new());
            let mut rule = WireRule::default();
            for (ty, p, _) in Attrs::new(&r) {
                match ty & NLA_TYPE_MASK {
                    RULE_TABLE => tname = cstr(p),
                    RULE_CHAIN => cname = cstr(p),
                    RULE_EXPRESSIONS => {
                        for (_, e, _) in Attrs::new(p) {
                            rule.exprs.push(parse_expr(e));
                        }
                    }
                    _ => {}
                }
            }
            if tname != name {
                continue;
            }
            if let Some(c) = w.chains.get_mut(&cname) {
                c.rules.push(rule);
            }
        }

        let mut chain_names: BTreeMap<String, Arc<str>> = BTreeMap::new();
        let sets = self
            .dump(fam, GETSET, &[(SET_TABLE, name)])?
            .unwrap_or_default();
        for s in sets {
            let (mut tname, mut sname) = (String::new(), String::new());
            let mut set = WireSet {
                flags: 0,
                key_type: 0,
                key_len: 0,
                data_type: None,
                data_len: None,
                userdata: Vec::new(),
                concat: Vec::new(),
                elements: BTreeMap::new(),
            };
            for (ty, p, _) in Attrs::new(&s) {
                match ty & NLA_TYPE_MASK {
                    SET_TABLE => tname = cstr(p),
                    SET_NAME => sname = cstr(p),
                    SET_FLAGS => set.flags = be_u32(p).unwrap_or(0),
                    SET_KEY_TYPE => set.key_type = be_u32(p).unwrap_or(0),
                    SET_KEY_LEN => set.key_len = be_u32(p).unwrap_or(0),
                    SET_DATA_TYPE => set.data_type = be_u32(p),
                    SET_DATA_LEN => set.data_len = be_u32(p),
                    SET_USERDATA => set.userdata = p.to_vec(),
                    SET_DESC => set.concat = parse_desc_concat(p),
                    _ => {}
                }
            }
            if tname != name {
                continue;
            }
            // The packet path owns a dynamic set's elements (affinity entries): they are not
            // ours to compare or remove, and there may be many.
            if set.is_dynamic() {
                w.add_set(&sname, set);
                continue;
            }
            let elems = self
                .dump(
                    fam,
                    GETSETELEM,
                    &[(ELEM_LIST_TABLE, name), (ELEM_LIST_SET, &sname)],
                )?
                .unwrap_or_default();
            let mut comments = HashMap::new();
            for m in elems {
                for (ty, p, _) in Attrs::new(&m) {
                    if ty & NLA_TYPE_MASK != ELEM_LIST_ELEMENTS {
                        continue;
                    }
                    for (_, e, _) in Attrs::new(p) {
                        if let Some((k, el)) = parse_elem(e, &mut chain_names, &mut comments) {
                            set.elements.insert(k, el);
                        }
                    }
                }
            }
            w.add_set(&sname, set);
        }
        Ok(Some(w))
    }
}

/// Runs every decoder of kernel replies over arbitrary bytes, as `read_table`, `dump` and the
/// error path would meet them: netlink framing, error codes and extended acks, attributes, set
/// elements, rule expressions and concatenation descriptions at any nesting. For the fuzz
/// target `netlink_decode` and its corpus test; returns how much was decoded, so that nothing
/// is optimised away. Must never panic.
#[doc(hidden)]
pub fn decode_any(data: &[u8]) -> usize {
    let mut decoded = 0;
    let mut chains = BTreeMap::new();
    let mut comments = HashMap::new();
    for m in messages(data) {
        decoded += 1;
        let _ = m.error_code();
        let (text, offset) = parse_ext_ack(m.flags, m.payload);
        decoded += text.map_or(0, |t| t.len()) + offset.map_or(0, |_| 1);
        let attrs = m.payload.get(NFGEN_HDRLEN..).unwrap_or_default();
        for (_, p, _) in Attrs::new(attrs) {
            decoded += parse_desc_concat(p).len();
            decoded += cstr(p).len();
            for (_, e, _) in Attrs::new(p) {
                if parse_elem(e, &mut chains, &mut comments).is_some() {
                    decoded += 1;
                }
                decoded += parse_expr(e).name.len();
                for (_, inner, _) in Attrs::new(e) {
                    if parse_elem(inner, &mut chains, &mut comments).is_some() {
                        decoded += 1;
                    }
                }
            }
        }
    }
    decoded
}

fn parse_ext_ack(flags: u16, payload: &[u8]) -> (Option<String>, Option<u32>) {
    if flags & NLM_F_ACK_TLVS == 0 {
        return (None, None);
    }
    // error code, then the echoed request: its header only when capped.
    let echoed = if flags & NLM_F_CAPPED != 0 {
        NLMSG_HDRLEN
    } else {
        payload
            .get(4..8)
            .and_then(ne_u32)
            .map(|l| l as usize)
            .unwrap_or(NLMSG_HDRLEN)
    };
    let start = 4 + ((echoed + 3) & !3);
    let (mut text, mut off) = (None, None);
    for (ty, p, _) in Attrs::new(payload.get(start..).unwrap_or_default()) {
        match ty & NLA_TYPE_MASK {
            NLMSGERR_ATTR_MSG => text = Some(cstr(p)).filter(|s| !s.is_empty()),
            NLMSGERR_ATTR_OFFS => off = ne_u32(p),
            _ => {}
        }
    }
    (text, off)
}

/// Parses one NFTA_LIST_ELEM of a rule's expressions into the canonical form.
fn parse_expr(e: &[u8]) -> WireExpr {
    let mut name = String::new();
    let mut attrs = Vec::new();
    for (ty, p, _) in Attrs::new(e) {
        match ty & NLA_TYPE_MASK {
            EXPR_NAME => name = cstr(p),
            EXPR_DATA => {
                for (t, q, _) in Attrs::new(p) {
                    attrs.push((t & NLA_TYPE_MASK, q.to_vec()));
                }
            }
            _ => {}
        }
    }
    // Data nests: normalize to the form the kernel dumps (verdict nest without NLA_F_NESTED),
    // which is also the form lowering produces.
    for (t, v) in attrs.iter_mut() {
        if WireExpr::is_nested(&name, *t)
            && let Some(d) = wire::parse_data(v)
        {
            let mut n = Vec::new();
            wire::encode_data(&d, &mut n);
            *v = n;
        }
    }
    WireExpr::new(&name, attrs)
}

/// The field lengths of `NFTA_SET_DESC_CONCAT` in a set's description.
fn parse_desc_concat(desc: &[u8]) -> Vec<u32> {
    let mut lens = Vec::new();
    for (ty, p, _) in Attrs::new(desc) {
        if ty & NLA_TYPE_MASK != SET_DESC_CONCAT {
            continue;
        }
        for (_, field, _) in Attrs::new(p) {
            for (t, q, _) in Attrs::new(field) {
                if t & NLA_TYPE_MASK == SET_FIELD_LEN
                    && let Some(len) = be_u32(q)
                {
                    lens.push(len);
                }
            }
        }
    }
    lens
}

/// Parses one element of a dump. `chains` and `comments` intern goto targets and comments: a
/// table at 10k services holds hundreds of thousands of elements sharing a few thousand.
fn parse_elem(
    e: &[u8],
    chains: &mut BTreeMap<String, Arc<str>>,
    comments: &mut HashMap<Box<[u8]>, Arc<[u8]>>,
) -> Option<(Box<[u8]>, WireElem)> {
    let mut key = None;
    let mut elem = WireElem {
        key_end: None,
        data: None,
        userdata: None,
        origin: None,
    };
    for (ty, p, _) in Attrs::new(e) {
        match ty & NLA_TYPE_MASK {
            ELEM_KEY => {
                if let Some(WireData::Value(v)) = wire::parse_data(p) {
                    key = Some(v);
                }
            }
            ELEM_KEY_END => {
                if let Some(WireData::Value(v)) = wire::parse_data(p) {
                    elem.key_end = Some(v);
                }
            }
            ELEM_DATA => {
                elem.data = wire::parse_data(p).map(|d| match d {
                    WireData::Verdict {
                        code,
                        chain: Some(c),
                    } => {
                        let c = chains.entry(c.to_string()).or_insert(c).clone();
                        WireData::Verdict {
                            code,
                            chain: Some(c),
                        }
                    }
                    d => d,
                });
            }
            ELEM_USERDATA => {
                elem.userdata = Some(match comments.get(p) {
                    Some(shared) => shared.clone(),
                    None => {
                        let shared: Arc<[u8]> = Arc::from(p);
                        comments.insert(p.into(), shared.clone());
                        shared
                    }
                });
            }
            _ => {}
        }
    }
    Some((key?, elem))
}

impl Kernel for NetlinkKernel {
    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError> {
        // A dump interrupted by a concurrent change is retried (NLM_F_DUMP_INTR).
        let mut last = NftError::Interrupted;
        for _ in 0..5 {
            match self.read_table_once(family, name) {
                Err(NftError::Interrupted) => last = NftError::Interrupted,
                r => return r,
            }
        }
        Err(last)
    }

    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError> {
        let mut stats = ApplyStats::default();
        let before = self.generation()?;
        self.send_batch(plan, &plan.phase1, 1, &mut stats)?;
        self.send_batch(plan, &plan.phase2, 2, &mut stats)?;
        let after = self.generation()?;
        // Each committed batch moves the generation by exactly one (nf_tables_commit bumps
        // `base_seq` once); any other step means another process committed in between.
        let ours = [&plan.phase1, &plan.phase2]
            .iter()
            .filter(|ops| !ops.is_empty())
            .count();
        let ours = len_u32(ours);
        stats.generation = (after == before.wrapping_add(ours)).then_some((before, after));
        Ok(stats)
    }

    fn generation(&mut self) -> Result<u32, NftError> {
        let seq = self.next_seq(1);
        let mut req = Vec::with_capacity(32);
        let s = begin_msg(
            &mut req,
            nft_type(GETGEN),
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
            0,
            0,
        );
        end(&mut req, s)?;
        self.sock
            .send(&req, 0)
            .map_err(io_err("send the ruleset generation request"))?;
        let mut found = None;
        loop {
            self.recv(0)
                .map_err(io_err("receive the ruleset generation"))?;
            for m in messages(&self.rbuf) {
                if m.seq != seq {
                    continue;
                }
                if m.ty == nft_type(NEWGEN) {
                    let attrs = m.payload.get(NFGEN_HDRLEN..).unwrap_or_default();
                    for (ty, p, _) in Attrs::new(attrs) {
                        if ty & NLA_TYPE_MASK == GEN_ID {
                            found = be_u32(p);
                        }
                    }
                } else if m.ty == NLMSG_ERROR {
                    let code = m.error_code().unwrap_or(0);
                    if code != 0 {
                        return Err(NftError::Io {
                            context: "read the ruleset generation".into(),
                            source: io::Error::from_raw_os_error(-code),
                        });
                    }
                    return found.ok_or_else(|| NftError::Io {
                        context: "read the ruleset generation".into(),
                        source: io::Error::new(
                            io::ErrorKind::InvalidData,
                            "the kernel's NEWGEN reply carried no NFTA_GEN_ID",
                        ),
                    });
                }
            }
        }
    }

    fn delete_tables(&mut self, name: &str) -> Result<usize, NftError> {
        // A table someone else deletes between our read and our transaction fails it with
        // ENOENT: read again and retry.
        let mut last = None;
        for _ in 0..3 {
            let mut msgs = Vec::new();
            for family in IpFamily::ALL {
                if self.table_info(family, name)?.is_none() {
                    continue;
                }
                let mut attrs = Vec::new();
                put_str(&mut attrs, TABLE_NAME, name);
                msgs.push(RawMsg {
                    ty: DELTABLE,
                    flags: 0,
                    family: nfproto(family),
                    attrs,
                    op: "delete table",
                    object: format!("table {} {name}", wire::family_keyword(family)),
                });
            }
            match self.transact_raw(&msgs) {
                Ok(()) => return Ok(msgs.len()),
                Err(NftError::Rejected { errors }) => {
                    if let Some(e) = errors.iter().find(|e| is_eperm(e)) {
                        let family = if e.object.starts_with("table ip6 ") {
                            IpFamily::V6
                        } else {
                            IpFamily::V4
                        };
                        return Err(self.denied(family, name));
                    }
                    if !errors.iter().all(|e| e.kind() == ReplyKind::NotFound) {
                        return Err(NftError::Rejected { errors });
                    }
                    last = Some(NftError::Rejected { errors });
                }
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(NftError::Interrupted))
    }
}

fn is_eperm(e: &RejectedOp) -> bool {
    e.kind() == ReplyKind::Permission
}

/// One message of a raw transaction (objects outside our table, e.g. another proxy's leftovers).
#[derive(Debug, Clone)]
pub struct RawMsg {
    /// nf_tables message type (`NFT_MSG_DELRULE`, …).
    pub ty: u16,
    /// Flags besides `NLM_F_REQUEST`.
    pub flags: u16,
    /// `NFPROTO_*` of the object.
    pub family: u8,
    /// The encoded attributes.
    pub attrs: Vec<u8>,
    /// For errors: `delete chain`, …
    pub op: &'static str,
    /// For errors: `chain KUBE-SERVICES of table ip nat`.
    pub object: String,
}

/// Raw access for sibling modules that work on tables other than ours.
impl NetlinkKernel {
    /// Dumps every object of nftables message type `ty` (GETTABLE, GETCHAIN, GETRULE, …) of the
    /// family, of table `table` only when given; each reply message's attributes. A dump
    /// interrupted by a concurrent change (NLM_F_DUMP_INTR) is retried.
    pub fn dump_raw(
        &mut self,
        family: u8,
        ty: u16,
        table: Option<&str>,
    ) -> Result<Vec<Vec<u8>>, NftError> {
        // NFTA_{CHAIN,RULE,SET}_TABLE are all attribute 1.
        let attrs: Vec<(u16, &str)> = table.map(|t| (1, t)).into_iter().collect();
        for _ in 0..5 {
            match self.dump(family, ty, &attrs) {
                Err(NftError::Interrupted) => continue,
                r => return r.map(Option::unwrap_or_default),
            }
        }
        Err(NftError::Interrupted)
    }

    /// Sends `msgs` as one atomic transaction; every message the kernel refuses is reported.
    pub fn transact_raw(&mut self, msgs: &[RawMsg]) -> Result<(), NftError> {
        if msgs.is_empty() {
            return Ok(());
        }
        let first = self.next_seq(msgs.len());
        let mut buf = Vec::new();
        let s = begin_msg(
            &mut buf,
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            first,
            0,
            NFNL_SUBSYS_NFTABLES,
        );
        end(&mut buf, s)?;
        for (i, m) in msgs.iter().enumerate() {
            let s = begin_msg(
                &mut buf,
                nft_type(m.ty),
                NLM_F_REQUEST | m.flags,
                first.wrapping_add(1).wrapping_add(len_u32(i)),
                m.family,
                0,
            );
            buf.extend_from_slice(&m.attrs);
            end(&mut buf, s)?;
        }
        let end_seq = first.wrapping_add(1).wrapping_add(len_u32(msgs.len()));
        self.seq = end_seq.wrapping_add(1);
        let s = begin_msg(
            &mut buf,
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST | NLM_F_ACK,
            end_seq,
            0,
            NFNL_SUBSYS_NFTABLES,
        );
        end(&mut buf, s)?;
        let want = buf.len().saturating_add(1 << 16).min(i32::MAX as usize);
        setsockopt(&self.sock, sockopt::SndBufForce, &want).map_err(|e| NftError::Io {
            context: "set SO_SNDBUFFORCE (needs CAP_NET_ADMIN)".into(),
            source: e.into(),
        })?;
        self.sock
            .send(&buf, 0)
            .map_err(io_err("send nftables batch"))?;
        let mut errors = Vec::new();
        // As in send_batch: every reply is queued inside sendmsg.
        loop {
            match self.recv(nix::libc::MSG_DONTWAIT) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(io_err("receive nftables replies")(e)),
            }
            for m in messages(&self.rbuf) {
                if m.ty != NLMSG_ERROR {
                    continue;
                }
                let code = m.error_code().unwrap_or(0);
                if code == 0 {
                    continue;
                }
                let req_seq = m.payload.get(12..16).and_then(ne_u32).unwrap_or(0);
                let (ext_ack, ext_ack_offset) = parse_ext_ack(m.flags, m.payload);
                let idx = req_seq.wrapping_sub(first).wrapping_sub(1) as usize;
                let (op, object) = match msgs.get(idx) {
                    Some(r) => (r.op, r.object.clone()),
                    None => ("batch", format!("message seq {req_seq}")),
                };
                errors.push(RejectedOp {
                    op,
                    object,
                    origin: None,
                    errno: io::Error::from_raw_os_error(-code),
                    ext_ack,
                    ext_ack_offset,
                    phase: 1,
                });
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(NftError::Rejected { errors })
        }
    }
}
