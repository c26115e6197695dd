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
        // NFTA_{CHAIN,RULE,SET}_TABLE are one attribute number, so CHAIN_TABLE stands for each.
        const _: () = assert!(CHAIN_TABLE == RULE_TABLE && RULE_TABLE == SET_TABLE);
        let attrs: Vec<(u16, &str)> = table.map(|t| (CHAIN_TABLE, t)).into_iter().collect();
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
        begin_batch(&mut buf, first)?;
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
        end_batch(&mut buf, end_seq)?;
        let blame = |req_seq: Option<u32>, _: Option<u32>| -> Blame {
            // A refusal that does not echo the request names no message: the batch's.
            let Some(seq) = req_seq else {
                return ("batch", "a refusal naming no message".to_owned(), None);
            };
            let idx = seq.wrapping_sub(first).wrapping_sub(1) as usize;
            match msgs.get(idx) {
                Some(r) => (r.op, r.object.clone(), None),
                None => ("batch", format!("message seq {seq}"), None),
            }
        };
        self.send_and_drain(&buf, end_seq, 1, blame)?.outcome()?;
        self.commits = self.commits.wrapping_add(1);
        Ok(())
    }
}
