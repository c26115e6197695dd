//! Sending one batch and draining its replies: the one loop every transaction goes through
//! (a plan's phases and raw transactions alike), where lost replies (ENOBUFS) are noticed and
//! each NACK is attributed to the message that caused it.

use super::*;

/// The operation, the object and the Service behind one message of a batch, for its NACK.
pub(super) type Blame = (&'static str, String, Option<ServicePortName>);

/// The replies to one batch.
pub(super) struct Replies {
    /// Every NACK, attributed.
    errors: Vec<RejectedOp>,
    /// BATCH_END was acked: kernels ≥ 6.10 do so on success, earlier ones never.
    end_acked: bool,
    /// The receive buffer overflowed (ENOBUFS) and some replies were lost.
    lost: bool,
}

impl Replies {
    /// The transaction's outcome: every NACK if there was one (a lost reply may have been one
    /// more), else lost replies as an unknown outcome; on success, whether BATCH_END was acked.
    pub(super) fn outcome(self) -> Result<bool, NftError> {
        if !self.errors.is_empty() {
            return Err(NftError::Rejected {
                errors: self.errors,
            });
        }
        if self.lost {
            return Err(NftError::Unknown(
                "receive buffer overflowed (ENOBUFS): replies were lost".to_owned(),
            ));
        }
        Ok(self.end_acked)
    }
}

impl NetlinkKernel {
    /// Sends the framed batch `buf` (whose BATCH_END has sequence number `end_seq`) with one
    /// `send` and collects every reply. `blame` names the message a NACK echoes: its sequence
    /// number (`None` when the reply echoes no header) and the ext-ack offset into it.
    pub(super) fn send_and_drain(
        &mut self,
        buf: &[u8],
        end_seq: u32,
        phase: u8,
        blame: impl Fn(Option<u32>, Option<u32>) -> Blame,
    ) -> Result<Replies, NftError> {
        // Keep our seq counter past every message of this batch.
        self.seq = end_seq.wrapping_add(1);
        // The whole batch must fit the send buffer or the kernel returns EMSGSIZE; the kernel
        // doubles the value and subtracts its own overhead, so ask for the size plus slack.
        let want = buf.len().saturating_add(1 << 16).min(i32::MAX as usize);
        setsockopt(&self.sock, sockopt::SndBufForce, &want).map_err(|e| NftError::Io {
            context: "set SO_SNDBUFFORCE (needs CAP_NET_ADMIN)".into(),
            source: e.into(),
        })?;
        let sent = self
            .sock
            .send(buf, 0)
            .map_err(io_err("send nftables batch"))?;
        if sent != buf.len() {
            return Err(NftError::Protocol(format!(
                "short send: {sent} of {} bytes",
                buf.len()
            )));
        }
        let mut replies = Replies {
            errors: Vec::new(),
            end_acked: false,
            lost: false,
        };
        // nfnetlink processes the whole batch inside sendmsg and queues every reply there, so
        // everything is already waiting: read without blocking until the socket is empty. An
        // overflow drops replies but not the ones still queued: keep reading.
        loop {
            match self.recv(nix::libc::MSG_DONTWAIT) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(nix::libc::ENOBUFS) => {
                    replies.lost = true;
                    continue;
                }
                Err(e) => return Err(io_err("receive nftables replies")(e)),
            }
            for m in messages(&self.rbuf) {
                if m.ty != NLMSG_ERROR {
                    continue;
                }
                let Some(code) = m.error_code() else {
                    continue;
                };
                // The echoed request header (after the error code) tells which message it is.
                let req_seq = m
                    .payload
                    .get(4..NLMSG_HDRLEN + 4)
                    .and_then(|h| ne_u32(&h[8..]));
                if code == 0 {
                    replies.end_acked |= req_seq == Some(end_seq);
                    continue;
                }
                let (ext_ack, ext_ack_offset) = parse_ext_ack(m.flags, m.payload);
                let (op, object, origin) = blame(req_seq, ext_ack_offset);
                replies.errors.push(RejectedOp {
                    op,
                    object,
                    origin,
                    errno: io::Error::from_raw_os_error(-code),
                    ext_ack,
                    ext_ack_offset,
                    phase,
                });
            }
        }
        Ok(replies)
    }

    /// Sends one phase of a plan as one transaction and collects every error the kernel
    /// reports, each naming its operation, object and Service.
    pub(super) fn send_batch(
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
        let seq0 = self.next_seq(ops.len());
        let batch = encode_batch(plan.family, &plan.table, ops, seq0)?;
        stats.encode += t0.elapsed();
        stats.messages += batch.messages;
        stats.bytes += batch.buf.len();

        let t1 = Instant::now();
        let first = batch.ledger.first().map(|l| l.seq).unwrap_or(seq0);
        let table_desc = plan.table_desc();
        let blame = |req_seq: Option<u32>, offset: Option<u32>| -> Blame {
            let Some(seq) = req_seq else {
                return ("batch", format!("transaction on {table_desc}"), None);
            };
            match batch.ledger.iter().find(|l| l.seq == seq) {
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
                    let (object, origin) = describe(&table_desc, op, elem, l.elems);
                    (op.kind(), object, origin)
                }
                None if seq < first || seq >= batch.end_seq => {
                    ("batch", format!("transaction on {table_desc}"), None)
                }
                None => ("unknown", format!("message seq {seq}"), None),
            }
        };
        let replies = self.send_and_drain(&batch.buf, batch.end_seq, phase, blame);
        stats.kernel += t1.elapsed();
        match replies?.outcome() {
            Ok(end_acked) => {
                self.commits = self.commits.wrapping_add(1);
                // Kernels before 6.10 do not ack BATCH_END at all: no error is success there.
                stats.batch_end_acked |= end_acked;
                Ok(())
            }
            Err(NftError::Rejected { errors }) if errors.iter().any(is_eperm) => {
                Err(self.denied(plan.family, &plan.table))
            }
            Err(e) => Err(e),
        }
    }
}
