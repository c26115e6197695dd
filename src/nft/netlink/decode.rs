//! Decoding what the kernel sends back: extended acks, rule expressions, set descriptions
//! (size, concatenation) and elements of a dump.

use super::*;
use crate::nft::ElemBytes;
use crate::nft::wire::{ChainName, Parsed};

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
            let (size, lens) = parse_desc(p);
            decoded += lens.len() + usize::from(size.is_some());
            decoded += cstr(p).len();
            for (_, e, _) in Attrs::new(p) {
                if parse_elem(e, &mut chains, &mut comments).is_some() {
                    decoded += 1;
                }
                decoded += wire::expr::decode(e).name.len();
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

pub(super) fn parse_ext_ack(flags: u16, payload: &[u8]) -> (Option<String>, Option<u32>) {
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

/// A set's description (`NFTA_SET_DESC`): its size (`NFTA_SET_DESC_SIZE`), and the field
/// lengths of `NFTA_SET_DESC_CONCAT`.
pub(super) fn parse_desc(desc: &[u8]) -> (Option<u32>, Vec<u32>) {
    let mut size = None;
    let mut lens = Vec::new();
    for (ty, p, _) in Attrs::new(desc) {
        match ty & NLA_TYPE_MASK {
            SET_DESC_SIZE => {
                size = be_u32(p);
                continue;
            }
            SET_DESC_CONCAT => {}
            _ => continue,
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
    (size, lens)
}

/// Parses one element of a dump. `chains` and `comments` intern goto targets and comments: a
/// table at 10k services holds hundreds of thousands of elements sharing a few thousand.
pub(super) fn parse_elem(
    e: &[u8],
    chains: &mut BTreeMap<String, ChainName>,
    comments: &mut HashMap<Box<[u8]>, Arc<Vec<u8>>>,
) -> Option<(ElemBytes, WireElem)> {
    let mut key = None;
    let (mut key_end, mut data, mut userdata) = (None, None, None);
    for (ty, p, _) in Attrs::new(e) {
        match ty & NLA_TYPE_MASK {
            ELEM_KEY => {
                if let Some(v) = wire::parse_value(p) {
                    key = Some(v);
                }
            }
            ELEM_KEY_END => {
                if let Some(v) = wire::parse_value(p) {
                    key_end = Some(v);
                }
            }
            ELEM_DATA => {
                data = wire::parse_nest(p).map(|d| match d {
                    Parsed::Value(v) => WireData::value(v),
                    Parsed::Verdict { code, chain } => {
                        let chain = chain.map(|c| {
                            let shared = chains.entry(c);
                            shared
                                .or_insert_with_key(|c| ChainName::new(c.clone()))
                                .clone()
                        });
                        WireData::verdict(code, chain)
                    }
                });
            }
            ELEM_USERDATA => {
                userdata = Some(match comments.get(p) {
                    Some(shared) => shared.clone(),
                    None => {
                        let shared = Arc::new(p.to_vec());
                        comments.insert(p.into(), shared.clone());
                        shared
                    }
                });
            }
            _ => {}
        }
    }
    Some((key?, WireElem::new(key_end, data, userdata, None)))
}
