//! Encoding a plan's operations into one nfnetlink batch, with the ledger that maps each
//! message back to its operation (and elements) so that an error names the object.

use super::*;

/// Element lists are split so that each message's element nest stays well below the 16-bit
/// attribute length limit.
pub(super) const ELEMS_PER_MSG_MAX: usize = 1000;
pub(super) const ELEM_NEST_BYTES_MAX: usize = 32 * 1024;

/// Which op (and which part of it) one message of a batch carries.
pub(super) struct LedgerEntry {
    pub(super) seq: u32,
    pub(super) op: usize,
    /// Offset of the message in the batch buffer.
    pub(super) start: usize,
    /// For element messages: the range of the op's elements in this message.
    pub(super) elems: (usize, usize),
}

/// One encoded batch and the ledger mapping each message back to its op.
pub struct Batch {
    pub buf: Vec<u8>,
    pub(super) ledger: Vec<LedgerEntry>,
    pub(super) end_seq: u32,
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
    begin_batch(&mut b.buf, seq)?;
    // Pre-size for element-heavy batches (~47 bytes per element at 10k services, where the
    // endpoints maps' elements carry no comment, ~67 for one with a comment) so that the buffer
    // is not reallocated: one doubling of a 10 MB batch briefly holds 30 MB. What is reserved
    // and never written is never touched, so it costs address space, not resident memory.
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
    end_batch(&mut b.buf, seq)?;
    b.messages = b.ledger.len() + 2;
    Ok(b)
}

/// Opens a batch in `buf`: BATCH_BEGIN with sequence number `seq`.
pub(super) fn begin_batch(buf: &mut Vec<u8>, seq: u32) -> Result<(), NftError> {
    let s = begin_msg(
        buf,
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
    );
    end(buf, s)
}

/// Closes a batch in `buf`: BATCH_END with sequence number `seq`, the only message with an ack
/// request (acking every message would overflow the receive buffer at scale).
pub(super) fn end_batch(buf: &mut Vec<u8>, seq: u32) -> Result<(), NftError> {
    let s = begin_msg(
        buf,
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        0,
        NFNL_SUBSYS_NFTABLES,
    );
    end(buf, s)
}

pub(super) fn too_long(what: &str) -> NftError {
    NftError::Protocol(format!("{what} too long for a netlink attribute"))
}

pub(super) fn end(buf: &mut [u8], start: usize) -> Result<(), NftError> {
    end_msg(buf, start).map_err(|_| too_long("message"))
}

pub(super) fn encode_elem(buf: &mut Vec<u8>, key: &[u8], e: &WireElem, with_data: bool) {
    let el = nest_begin(buf, LIST_ELEM | NLA_F_NESTED);
    let k = nest_begin(buf, ELEM_KEY | NLA_F_NESTED);
    put_attr(buf, DATA_VALUE, key);
    let _ = nest_end(buf, k);
    // A range element is identified by both ends, also when it is deleted.
    if let Some(end) = e.key_end() {
        let k = nest_begin(buf, ELEM_KEY_END | NLA_F_NESTED);
        put_attr(buf, DATA_VALUE, end);
        let _ = nest_end(buf, k);
    }
    if with_data {
        if let Some(d) = e.data() {
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

pub(super) fn encode_op(
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
                    put_attr(buf, wire::expr::attr_type(&e.name, *ty), v);
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
            // One description holds both: the kernel parses a single NFTA_SET_DESC.
            if set.size.is_some() || !set.concat.is_empty() {
                let desc = nest_begin(buf, SET_DESC | NLA_F_NESTED);
                if let Some(size) = set.size {
                    put_u32_be(buf, SET_DESC_SIZE, size);
                }
                if !set.concat.is_empty() {
                    let list = nest_begin(buf, SET_DESC_CONCAT | NLA_F_NESTED);
                    for len in &set.concat {
                        let el = nest_begin(buf, LIST_ELEM | NLA_F_NESTED);
                        put_u32_be(buf, SET_FIELD_LEN, *len);
                        let _ = nest_end(buf, el);
                    }
                    // At most a handful of fields.
                    let _ = nest_end(buf, list);
                }
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
pub(super) fn describe(
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
                    if let Some(d) = e.data() {
                        s.push_str(&format!(" : {}", def.format_data(d)));
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

/// Finds which element of an element message the ext-ack offset points into.
pub(super) fn elem_at_offset(batch: &[u8], msg_start: usize, offset: u32) -> Option<usize> {
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
