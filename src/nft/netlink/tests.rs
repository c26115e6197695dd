//! Unit tests of the batch encoding against the decoding of dumps.

use super::*;

/// The payloads of every `NFTA_SET_DESC` in the NEWSET message of `set`.
fn descs_of(set: &WireSet) -> Vec<Vec<u8>> {
    let mut buf = Vec::new();
    let op = Op::AddSet { name: "s", set };
    encode_op(&mut buf, NFPROTO_IPV4, "nodeproxy", &op, 1).unwrap();
    let msg = messages(&buf).next().unwrap();
    Attrs::new(&msg.payload[NFGEN_HDRLEN..])
        .filter(|(ty, _, _)| ty & NLA_TYPE_MASK == SET_DESC)
        .map(|(_, p, _)| p.to_vec())
        .collect()
}

fn set(size: Option<u32>, concat: Vec<u32>) -> WireSet {
    WireSet {
        flags: 0,
        key_type: 7,
        key_len: 4,
        data_type: None,
        data_len: None,
        userdata: Vec::new(),
        concat,
        size,
        elements: BTreeMap::new(),
    }
}

#[test]
fn a_sets_size_and_concatenation_share_one_description_and_decode_back() {
    assert!(descs_of(&set(None, vec![])).is_empty());
    for (size, concat) in [
        (Some(2048), vec![]),
        (None, vec![4, 4]),
        (Some(65535), vec![4, 4, 4]),
    ] {
        let descs = descs_of(&set(size, concat.clone()));
        assert_eq!(descs.len(), 1, "one NFTA_SET_DESC: {size:?} {concat:?}");
        assert_eq!(parse_desc(&descs[0]), (size, concat));
    }
}
