//! Raw transactions and dumps on tables other than ours (kube-proxy's leftovers): the same
//! socket and batch framing, messages built by the caller.

use super::*;

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
