//! Tests of the seal's text and digest.
use super::*;
use crate::nft::wire::ElemBytes;
use crate::nft::{WireElem, WireSet};
use std::collections::BTreeMap;
use std::sync::Arc;

fn seal() -> Seal {
    Seal {
        boot: "6a4d94f353e44e19a7e3bb9dc3c3d06d".into(),
        generation: u32::MAX,
        salt: 0x0123_4567_89ab_cdef,
        digests: vec![(IpFamily::V4, u64::MAX), (IpFamily::V6, 7)],
    }
}

#[test]
fn a_seal_renders_within_a_comment_and_parses_back() {
    let s = seal();
    let text = s.render().unwrap();
    assert!(
        text.len() < COMMENT_MAX,
        "{} characters: {text}",
        text.len()
    );
    assert_eq!(Seal::parse(&text), Some(s));
    assert_eq!(
        text,
        "seal-v1 boot=6a4d94f353e44e19a7e3bb9dc3c3d06d gen=4294967295 salt=0123456789abcdef \
         ip=ffffffffffffffff ip6=0000000000000007 end"
    );
}

#[test]
fn anything_but_a_whole_seal_of_this_version_is_refused() {
    let text = seal().render().unwrap();
    // Every truncation (a comment cut at nft's limit, say) is refused, not misread.
    for end in 0..text.len() {
        assert_eq!(Seal::parse(&text[..end]), None, "{:?}", &text[..end]);
    }
    for bad in [
        text.replacen("seal-v1", "seal-v2", 1),
        text.replacen("gen=", "generation=", 1),
        text.replacen("ip6=", "ip=", 1),
        text.replacen("ip6=", "inet=", 1),
        text.replacen("boot=6a", "boot=6A", 1),
        text.replacen("salt=01", "salt=+1", 1),
        format!("{text} "),
        format!("{text} end"),
        format!("{text} ip=0000000000000000"),
        text.replacen(" end", " ip=0000000000000000 end", 1),
        "managed by someone else".to_owned(),
    ] {
        assert_eq!(Seal::parse(&bad), None, "{bad}");
    }
}

#[test]
fn the_boot_id_is_this_kernels_without_dashes() {
    let id = boot_id().expect("/proc/sys/kernel/random/boot_id is readable");
    let raw = std::fs::read_to_string(BOOT_ID).unwrap();
    assert_eq!(id, raw.trim().replace('-', ""));
}

fn table() -> WireTable {
    let mut t = WireTable::new(IpFamily::V4, "nodeproxy");
    let comment = Arc::new(b"ns/a:http".to_vec());
    let mut elements = BTreeMap::new();
    for i in 0..3u8 {
        elements.insert(
            ElemBytes::from(vec![10, 96, 0, i]),
            WireElem::new(
                None,
                Some(WireData::verdict(-4, Some(Arc::new("pick-1".into())))),
                Some(comment.clone()),
                None,
            ),
        );
    }
    let set = |elements| WireSet {
        flags: 0,
        key_type: 7,
        key_len: 4,
        data_type: None,
        data_len: None,
        userdata: Vec::new(),
        concat: Vec::new(),
        size: None,
        elements,
    };
    t.add_set("service-ips", set(elements.clone()));
    t.add_set("cluster-ips", set(elements));
    t
}

#[test]
fn the_digest_covers_every_element_field_and_set_name_but_no_dynamic_set() {
    let t = table();
    let d = digest(&t, 1);
    assert_eq!(digest(&t.clone(), 1), d, "deterministic");
    assert_ne!(digest(&t, 2), d, "salted");
    let changed = |f: &dyn Fn(&mut WireTable)| {
        let mut c = t.clone();
        f(&mut c);
        digest(&c, 1)
    };
    fn first(c: &mut WireTable) -> &mut WireElem {
        c.sets
            .get_mut("cluster-ips")
            .unwrap()
            .elements
            .values_mut()
            .next()
            .unwrap()
    }
    assert_ne!(
        changed(&|c| {
            let s = c.sets.get_mut("cluster-ips").unwrap();
            let (k, e) = s.elements.pop_first().unwrap();
            let mut k = k.to_vec();
            k[3] = 9;
            s.elements.insert(ElemBytes::from(k), e);
        }),
        d,
        "a key"
    );
    assert_ne!(
        changed(&|c| first(c).set_key_end(Some(ElemBytes::from(vec![10, 96, 0, 0])))),
        d,
        "a key end"
    );
    assert_ne!(
        changed(&|c| first(c).set_data(Some(WireData::value(&[1])))),
        d,
        "data"
    );
    assert_ne!(
        changed(
            &|c| first(c).set_data(Some(WireData::verdict(-4, Some(Arc::new("pick-2".into())))))
        ),
        d,
        "a verdict's chain"
    );
    assert_ne!(changed(&|c| first(c).userdata = None), d, "a comment");
    assert_ne!(
        changed(&|c| {
            let s = c.sets.remove("service-ips").unwrap();
            c.sets.insert("service-ipz".into(), s);
        }),
        d,
        "a set's name"
    );
    // Origins are ours, never in the kernel: not part of it. Nor are a dynamic set's elements.
    assert_eq!(
        changed(
            &|c| first(c).origin = Some(Arc::new(crate::model::ServicePortName {
                service: crate::model::ServiceName::new("ns", "a"),
                port: "http".into(),
                protocol: crate::model::Protocol::Tcp,
            }))
        ),
        d
    );
    let dynamic = |elements: usize| {
        let mut c = t.clone();
        let mut s = c.sets["cluster-ips"].clone();
        s.flags |= crate::nft::uapi::SET_F_EVAL;
        s.elements = s.elements.into_iter().take(elements).collect();
        c.add_set("pins", s);
        digest(&c, 1)
    };
    assert_eq!(dynamic(0), d);
    assert_eq!(dynamic(3), d);
}

#[test]
fn fill_gives_the_definitions_the_wanted_elements_only_when_the_sets_are_the_same() {
    let want = table();
    let mut have = want.clone();
    for s in have.sets.values_mut() {
        s.elements.clear();
    }
    let mut filled = have.clone();
    assert!(fill(&mut filled, &want));
    assert_eq!(filled, want);
    let mut extra = have.clone();
    extra.add_set("other", extra.sets["cluster-ips"].clone());
    assert!(!fill(&mut extra, &want));
    let mut missing = have;
    missing.sets.remove("cluster-ips");
    assert!(!fill(&mut missing, &want));
}
