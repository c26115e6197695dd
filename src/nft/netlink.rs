//! The netlink backend: one nfnetlink batch per transaction, sent with one `send`, replies
//! collected without waiting for acks that never come; dumps of our table. Encoding the batch
//! (`encode`), sending it and draining the replies (`transact`, the one loop for our plans and
//! raw transactions alike), decoding replies (`decode`) and raw access to other tables (`raw`)
//! are its parts.

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
    self, WireChain, WireData, WireElem, WireHook, WireRule, WireSet, WireTable, nfproto,
};
use super::{ApplyStats, Kernel, NftError, RejectedOp, ReplyKind, SEAL_TABLE, udata};
use crate::model::{IpFamily, ServicePortName};
use crate::netlink::*;

mod decode;
mod encode;
mod raw;
#[cfg(test)]
mod tests;
mod transact;

pub use decode::decode_any;
use decode::*;
use encode::*;
pub use encode::{Batch, encode_batch};
pub use raw::RawMsg;
use transact::*;

/// Never wait longer than this for replies after a send (the kernel queues every reply inside
/// `sendmsg`, so this only bounds pathological cases).
const RECV_TIMEOUT: Duration = Duration::from_secs(5);

fn io_err(context: &str) -> impl FnOnce(io::Error) -> NftError + '_ {
    move |source| NftError::Io {
        context: context.to_owned(),
        source,
    }
}

/// The netlink backend.
pub struct NetlinkKernel {
    sock: Socket,
    /// Our socket's netlink port id: what the kernel records as the owner of a table we create
    /// or claim with `NFT_TABLE_F_OWNER`.
    port: u32,
    seq: u32,
    rbuf: Vec<u8>,
    /// The ruleset generation when this handle was opened.
    opened_at: u32,
    /// Transactions this handle committed since (probes, claims, syncs, seals): with
    /// `opened_at`, whether anyone else committed since ([`Kernel::generation_at_open`]).
    commits: u32,
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
        let mut kernel = NetlinkKernel {
            sock,
            port: addr.port_number(),
            seq,
            rbuf: Vec::with_capacity(1 << 20),
            opened_at: 0,
            commits: 0,
        };
        kernel.opened_at = kernel.generation()?;
        Ok(kernel)
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

    /// One read of our table; without `elements`, its sets come back empty.
    fn read_table_once(
        &mut self,
        family: IpFamily,
        name: &str,
        elements: bool,
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
                            rule.exprs.push(wire::expr::decode(e));
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

        let mut chain_names: BTreeMap<String, wire::ChainName> = BTreeMap::new();
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
                size: None,
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
                    SET_DESC => (set.size, set.concat) = parse_desc(p),
                    _ => {}
                }
            }
            if tname != name {
                continue;
            }
            // The packet path owns a dynamic set's elements (affinity entries): they are not
            // ours to compare or remove, and there may be many.
            if set.is_dynamic() || !elements {
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

impl NetlinkKernel {
    fn read_table_retrying(
        &mut self,
        family: IpFamily,
        name: &str,
        elements: bool,
    ) -> Result<Option<WireTable>, NftError> {
        // A dump interrupted by a concurrent change is retried (NLM_F_DUMP_INTR).
        let mut last = NftError::Interrupted;
        for _ in 0..5 {
            match self.read_table_once(family, name, elements) {
                Err(NftError::Interrupted) => last = NftError::Interrupted,
                r => return r,
            }
        }
        Err(last)
    }
}

impl Kernel for NetlinkKernel {
    fn read_table(&mut self, family: IpFamily, name: &str) -> Result<Option<WireTable>, NftError> {
        self.read_table_retrying(family, name, true)
    }

    fn read_table_definitions(
        &mut self,
        family: IpFamily,
        name: &str,
    ) -> Result<Option<WireTable>, NftError> {
        self.read_table_retrying(family, name, false)
    }

    fn generation_at_open(&mut self) -> Result<Option<u32>, NftError> {
        let now = self.generation()?;
        Ok((now == self.opened_at.wrapping_add(self.commits)).then_some(self.opened_at))
    }

    fn read_seal(&mut self) -> Result<Option<String>, NftError> {
        Ok(self
            .table_headers(IpFamily::V4)?
            .into_iter()
            .find(|h| h.name == SEAL_TABLE)
            .and_then(|h| udata::parse_comment(&h.userdata)))
    }

    fn write_seal(&mut self, text: &str) -> Result<(), NftError> {
        let object = format!("table ip {SEAL_TABLE}");
        let mut msgs = Vec::new();
        if self.table_info(IpFamily::V4, SEAL_TABLE)?.is_some() {
            let mut attrs = Vec::new();
            put_str(&mut attrs, TABLE_NAME, SEAL_TABLE);
            msgs.push(RawMsg {
                ty: DELTABLE,
                flags: 0,
                family: nfproto(IpFamily::V4),
                attrs,
                op: "delete table",
                object: object.clone(),
            });
        }
        let mut attrs = Vec::new();
        put_str(&mut attrs, TABLE_NAME, SEAL_TABLE);
        put_attr(&mut attrs, TABLE_USERDATA, &udata::comment(text));
        msgs.push(RawMsg {
            ty: NEWTABLE,
            flags: NLM_F_CREATE,
            family: nfproto(IpFamily::V4),
            attrs,
            op: "add table",
            object,
        });
        self.transact_raw(&msgs)
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
