//! Unit tests of lowering, diff and the fake kernel.

use super::*;
use crate::model::{Protocol, ServiceName};
use crate::ruleset::*;

fn origin(name: &str) -> ServicePortName {
    ServicePortName {
        service: ServiceName::new("ns", name),
        port: String::new(),
        protocol: Protocol::Tcp,
    }
}

fn svc_elem(last: u8, port: u16, chain: &str) -> Element {
    Element {
        key: [
            Atom::Addr([10, 96, 0, last].into()),
            Atom::Proto(Protocol::Tcp),
            Atom::Port(port),
        ]
        .into(),
        data: Some(ElemData::Verdict(Verdict::Goto(chain.into()))),
        comment: Some(format!("ns/svc{last}").into()),
        origin: Some(std::sync::Arc::new(origin(&format!("svc{last}")))),
    }
}

fn table(elems: Vec<Element>, extra_chain: bool) -> Table {
    let key = vec![KeyField::Daddr, KeyField::L4Proto, KeyField::ThDport];
    let mut chains = vec![
        Chain {
            name: "prerouting".into(),
            comment: String::new(),
            base: Some(BaseChain {
                kind: ChainType::Nat,
                hook: Hook::Prerouting,
                priority: -100,
            }),
            rules: vec![Rule::new(vec![Stmt::Vmap {
                key: key.clone(),
                map: "service-ips".into(),
            }])],
        },
        Chain {
            name: "a".into(),
            comment: String::new(),
            base: None,
            rules: vec![Rule::new(vec![Stmt::Reject])],
        },
    ];
    if extra_chain {
        chains.push(Chain {
            name: "b".into(),
            comment: String::new(),
            base: None,
            rules: vec![],
        });
    }
    Table {
        family: IpFamily::V4,
        name: "nodeproxy".into(),
        comment: "t".into(),
        owned: false,
        sets: vec![Set {
            name: "service-ips".into(),
            comment: String::new(),
            key,
            data: Some(SetData::Verdict),
            typeof_: false,
            kind: Default::default(),
            elements: elems,
        }],
        chains,
    }
}

fn converge(k: &mut FakeKernel, t: &Table) -> SyncReport {
    sync(
        k,
        Ruleset {
            tables: vec![t.clone()],
        },
    )
    .unwrap()
}

#[test]
fn apply_read_diff_is_empty() {
    let mut k = FakeKernel::new();
    let t = table(vec![svc_elem(1, 80, "a"), svc_elem(2, 80, "a")], true);
    converge(&mut k, &t);
    let want = lower(&t).unwrap();
    let got = k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap();
    assert_eq!(got, want);
    assert!(diff(Some(&got), &want).is_empty());
    let before = k.transactions;
    let rep = converge(&mut k, &t);
    assert_eq!(rep.empty_plans, 1);
    assert_eq!(k.transactions, before, "an empty plan sends nothing");
}

/// The elements of a new or recreated set are sent after the rules that look it up: binding a
/// map that already holds elements walks them all in the kernel (`diff.rs`, the fresh table).
#[test]
fn elements_of_new_and_recreated_sets_follow_the_rules_that_bind_them() {
    fn elements_after_rules(plan: &Plan<'_>) {
        let last_rule = plan
            .phase1
            .iter()
            .rposition(|o| matches!(o, Op::AddRule { .. }))
            .expect("the plan adds rules");
        let first_elements = plan
            .phase1
            .iter()
            .position(|o| matches!(o, Op::AddElems { .. }))
            .expect("the plan adds elements");
        assert!(first_elements > last_rule, "{plan:?}");
    }
    let fresh = lower(&table(
        vec![svc_elem(1, 80, "a"), svc_elem(2, 80, "b")],
        true,
    ))
    .unwrap();
    elements_after_rules(&diff(None, &fresh));

    let mut resized = fresh.clone();
    resized.sets.get_mut("service-ips").unwrap().size = Some(4);
    let plan = diff(Some(&fresh), &resized);
    assert!(
        plan.phase1
            .iter()
            .any(|o| matches!(o, Op::DelSet { name } if *name == "service-ips")),
        "a new size is a new set: {plan:?}"
    );
    elements_after_rules(&plan);
    let mut k = FakeKernel::new();
    k.apply(&diff(None, &fresh)).unwrap();
    k.apply(&plan).unwrap();
    assert_eq!(
        k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap(),
        resized
    );
}

#[test]
fn one_changed_element_is_one_delete_and_one_add() {
    let mut k = FakeKernel::new();
    converge(
        &mut k,
        &table(vec![svc_elem(1, 80, "a"), svc_elem(2, 80, "a")], true),
    );
    let t2 = table(vec![svc_elem(1, 80, "a"), svc_elem(2, 80, "b")], true);
    let cur = k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap();
    let want = lower(&t2).unwrap();
    let plan = diff(Some(&cur), &want);
    assert!(plan.phase2.is_empty());
    assert_eq!(plan.phase1.len(), 2, "{plan:?}");
    assert!(matches!(&plan.phase1[0], Op::DelElems { elems, .. } if elems.len() == 1));
    assert!(matches!(&plan.phase1[1], Op::AddElems { elems, .. } if elems.len() == 1));
    k.apply(&plan).unwrap();
    assert_eq!(
        k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap(),
        want
    );
}

#[test]
fn chain_referenced_by_removed_element_is_deleted_in_phase_two() {
    let mut k = FakeKernel::new();
    converge(&mut k, &table(vec![svc_elem(1, 80, "b")], true));
    let t2 = table(vec![], false);
    let cur = k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap();
    let want = lower(&t2).unwrap();
    let plan = diff(Some(&cur), &want);
    assert!(
        matches!(plan.phase2.as_slice(), [Op::DelChain { name: "b" }]),
        "{plan:?}"
    );
    // Both in one transaction: EBUSY (pre-6.2 semantics), and nothing changes.
    let mut single = plan.clone();
    single.phase1.append(&mut single.phase2);
    let mut k2 = k.clone();
    let err = k2.apply(&single).unwrap_err();
    assert!(err.to_string().contains("chain b"), "{err}");
    assert_eq!(
        k2.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap(),
        cur
    );
    k.apply(&plan).unwrap();
    assert_eq!(
        k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap(),
        want
    );
}

#[test]
fn changed_set_type_recreates_set_and_rules() {
    let mut k = FakeKernel::new();
    converge(&mut k, &table(vec![svc_elem(1, 80, "a")], false));
    let mut t2 = table(vec![svc_elem(1, 80, "a")], false);
    t2.sets[0].comment = "now with a comment".into();
    converge(&mut k, &t2);
    assert_eq!(
        k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap(),
        lower(&t2).unwrap()
    );
}

#[test]
fn stale_and_foreign_objects_are_removed() {
    let mut k = FakeKernel::new();
    converge(&mut k, &table(vec![svc_elem(1, 80, "a")], true));
    let t = k
        .tables
        .get_mut(&(IpFamily::V4, "nodeproxy".into()))
        .unwrap();
    t.add_chain("foreign", WireChain::default());
    let mut junk = t.sets["service-ips"].clone();
    junk.elements.clear();
    t.add_set("junk", junk);
    let t2 = table(vec![svc_elem(1, 80, "a")], false);
    converge(&mut k, &t2);
    assert_eq!(
        k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap(),
        lower(&t2).unwrap()
    );
}

#[test]
fn failing_transaction_reports_every_error_and_rolls_back() {
    let mut k = FakeKernel::new();
    converge(&mut k, &table(vec![svc_elem(1, 80, "a")], false));
    let before = k.tables.clone();
    let t2 = table(
        vec![
            svc_elem(1, 80, "a"),
            svc_elem(2, 80, "nope"),
            svc_elem(3, 80, "nope2"),
        ],
        false,
    );
    let want = lower(&t2).unwrap();
    let cur = k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap();
    let err = k.apply(&diff(Some(&cur), &want)).unwrap_err();
    let NftError::Rejected { errors } = err else {
        panic!("{err}")
    };
    assert_eq!(errors.len(), 1); // the fake stops an element op at its first bad element
    assert!(
        errors[0].object.contains("10.96.0.2 . tcp . 80"),
        "{}",
        errors[0]
    );
    assert_eq!(k.tables, before);
}

#[test]
fn lowering_rejects_mismatched_elements_naming_the_service() {
    let mut t = table(vec![svc_elem(1, 80, "a")], false);
    let key = &mut t.sets[0].elements[0].key;
    *key = Atoms::new(&key.atoms()[..key.len() - 1]);
    let err = lower(&t).unwrap_err();
    assert!(err.to_string().contains("ns/svc1"), "{err}");
}

#[test]
fn udata_comment_truncates() {
    let long = "x".repeat(300);
    let u = udata::comment(&long);
    assert_eq!(u.len(), 2 + udata::COMMENT_MAX);
    assert_eq!(
        udata::parse_comment(&u).unwrap().len(),
        udata::COMMENT_MAX - 1
    );
}

#[test]
fn keys_format_like_nft() {
    let t = lower(&table(vec![svc_elem(1, 80, "a")], false)).unwrap();
    let s = &t.sets["service-ips"];
    let (k, _) = s.elements.iter().next().unwrap();
    assert_eq!(s.format_key(k), "10.96.0.1 . tcp . 80");
}

// ---- table ownership ----

use super::diff::table_flags_update;
use super::uapi::{TABLE_F_OWNED, TABLE_F_OWNER, TABLE_F_PERSIST};

fn owned(elems: Vec<Element>) -> Table {
    let mut t = table(elems, false);
    t.owned = true;
    t
}

fn flags_in_kernel(k: &FakeKernel) -> u32 {
    k.tables[&(IpFamily::V4, "nodeproxy".to_string())].flags
}

#[test]
fn table_flags_update_claims_only_orphans() {
    // (current, wanted, what the diff sends)
    let cases = [
        (TABLE_F_PERSIST, TABLE_F_OWNED, Some(TABLE_F_OWNED)),
        (TABLE_F_OWNED, TABLE_F_OWNED, None),
        (0, 0, None),
        // Created without persist: the kernel cannot add it, nor ownership without it.
        (0, TABLE_F_OWNED, None),
        (0, TABLE_F_OWNER, None),
        // An owner never gives up ownership, and persist never changes.
        (TABLE_F_OWNED, 0, None),
        (TABLE_F_OWNED, TABLE_F_OWNER, None),
        (TABLE_F_PERSIST, 0, None),
        (TABLE_F_OWNER, TABLE_F_OWNED, None),
    ];
    for (cur, want, sent) in cases {
        assert_eq!(
            table_flags_update(cur, want),
            sent,
            "from {cur:#x} to {want:#x}"
        );
    }
}

/// Every pair of ownership flags: the diff sends an update exactly when the kernel (as the fake
/// models `nf_tables_updtable`) accepts it, so it never fails a transaction with EOPNOTSUPP and
/// never leaves a possible claim undone.
#[test]
fn table_flags_update_agrees_with_the_kernel_rules() {
    let all = [0, TABLE_F_OWNER, TABLE_F_PERSIST, TABLE_F_OWNED];
    for cur in all {
        for want in all {
            if cur == want {
                continue;
            }
            let mut k = FakeKernel::new();
            let mut w = WireTable::new(IpFamily::V4, "nodeproxy");
            w.flags = cur;
            k.tables_mut().insert((IpFamily::V4, "nodeproxy".into()), w);
            let plan = Plan {
                family: IpFamily::V4,
                table: "nodeproxy".into(),
                phase1: vec![Op::UpdateTable { flags: want }],
                phase2: vec![],
            };
            let accepted = k.apply(&plan).is_ok();
            assert_eq!(
                table_flags_update(cur, want).is_some(),
                accepted,
                "from {cur:#x} to {want:#x}"
            );
        }
    }
}

#[test]
fn an_owned_table_is_created_owned_and_renders_as_an_unowned_one() {
    let t = owned(vec![svc_elem(1, 80, "a")]);
    assert_eq!(lower(&t).unwrap().flags, TABLE_F_OWNED);
    assert_eq!(lower(&table(vec![], false)).unwrap().flags, 0);
    let mut k = FakeKernel::new();
    converge(&mut k, &t);
    assert_eq!(flags_in_kernel(&k), TABLE_F_OWNED);
    let mut unowned = t.clone();
    unowned.owned = false;
    assert_eq!(
        crate::ruleset::render::render_table(&t),
        crate::ruleset::render::render_table(&unowned)
    );
}

#[test]
fn an_orphan_is_claimed_first_in_the_transaction_that_carries_the_changes() {
    let mut k = FakeKernel::new();
    converge(&mut k, &owned(vec![svc_elem(1, 80, "a")]));
    k.owner_exits();
    assert_eq!(
        flags_in_kernel(&k),
        TABLE_F_PERSIST,
        "orphaned, not deleted"
    );
    let before = k.transactions;

    let t2 = owned(vec![svc_elem(1, 80, "a"), svc_elem(2, 80, "a")]);
    let cur = k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap();
    let want = lower(&t2).unwrap();
    let plan = diff(Some(&cur), &want);
    assert!(
        matches!(plan.phase1.as_slice(), [
            Op::UpdateTable { flags: TABLE_F_OWNED },
            Op::AddElems { elems, .. },
        ] if elems.len() == 1),
        "{plan:?}"
    );
    assert!(plan.phase2.is_empty());
    assert_eq!(plan.tables_claimed(), 1);
    let rep = converge(&mut k, &t2);
    assert_eq!(rep.tables_claimed, 1);
    assert_eq!(rep.elements_added, 1);
    assert!(
        rep.to_string().contains("took over 1 orphaned table(s)"),
        "{rep}"
    );
    assert_eq!(k.transactions, before + 1, "one transaction");
    assert_eq!(
        k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap(),
        want
    );
    // Ours now: nothing left to do.
    let again = converge(&mut k, &t2);
    assert_eq!((again.empty_plans, again.tables_claimed), (1, 0));
}

#[test]
fn claiming_an_unchanged_orphan_changes_nothing_else() {
    let t = owned(vec![svc_elem(1, 80, "a")]);
    let mut k = FakeKernel::new();
    converge(&mut k, &t);
    k.owner_exits();
    let cur = k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap();
    let want = lower(&t).unwrap();
    let plan = diff(Some(&cur), &want);
    assert!(
        matches!(
            plan.phase1.as_slice(),
            [Op::UpdateTable {
                flags: TABLE_F_OWNED
            }]
        ),
        "{plan:?}"
    );
    assert!(plan.phase2.is_empty());
}

#[test]
fn a_table_without_persist_stays_unowned_and_syncs() {
    // Left by a nodeproxy without ownership (or loaded with nft -f): same contents, flags 0.
    let mut k = FakeKernel::new();
    converge(&mut k, &table(vec![svc_elem(1, 80, "a")], false));
    let t = owned(vec![svc_elem(1, 80, "a")]);
    let rep = converge(&mut k, &t);
    assert_eq!(
        rep.empty_plans, 1,
        "no impossible flag update is sent: {rep:?}"
    );
    let t2 = owned(vec![svc_elem(1, 80, "a"), svc_elem(2, 80, "a")]);
    let rep = converge(&mut k, &t2);
    assert_eq!((rep.elements_added, rep.tables_claimed), (1, 0));
    assert_eq!(flags_in_kernel(&k), 0);
    // Once deleted, it comes back owned.
    k.delete_tables("nodeproxy").unwrap();
    converge(&mut k, &t2);
    assert_eq!(flags_in_kernel(&k), TABLE_F_OWNED);
}

#[test]
fn an_owned_table_without_persist_vanishes_with_its_owner() {
    // Why `Ownership::NotPersistent` (kernels 5.12 to 6.8) does not use the owner flag.
    let mut k = FakeKernel::new();
    let mut w = WireTable::new(IpFamily::V4, "nodeproxy");
    w.flags = TABLE_F_OWNER;
    k.tables_mut().insert((IpFamily::V4, "nodeproxy".into()), w);
    k.owner_exits();
    assert!(k.read_table(IpFamily::V4, "nodeproxy").unwrap().is_none());
}

#[test]
fn the_fault_switch_makes_the_kernel_refuse_only_the_named_ports_elements() {
    let mut bad = svc_elem(2, 80, "a");
    bad.origin = Some(std::sync::Arc::new(ServicePortName {
        port: "kernel-rejects".into(),
        ..origin("svc2")
    }));
    let t = table(vec![svc_elem(1, 80, "a"), bad], true);
    let want = lower(&t).unwrap();
    let plan = diff(None, &want);

    let mut k = fault::Faulty::new(FakeKernel::new(), Some("kernel-rejects".into()));
    let Err(NftError::Rejected { errors }) = k.apply(&plan) else {
        panic!("the named port's element was accepted")
    };
    assert_eq!(errors.len(), 1);
    // Chain "a" exists: only the rewritten verdict can be missing its chain.
    assert_eq!(errors[0].kind(), ReplyKind::NotFound);
    assert!(
        errors[0].object.contains("10.96.0.2"),
        "{}",
        errors[0].object
    );
    assert!(
        k.inner()
            .read_table(IpFamily::V4, "nodeproxy")
            .unwrap()
            .is_none()
    );

    // Unset, or another name: everything passes through.
    for port in [None, Some(String::new()), Some("http".into())] {
        let mut k = fault::Faulty::new(FakeKernel::new(), port);
        k.apply(&plan).unwrap();
        let got = k
            .inner()
            .read_table(IpFamily::V4, "nodeproxy")
            .unwrap()
            .unwrap();
        assert_eq!(got, want);
    }
}

/// `n` elements of `service-ips` (`10.96.x.y . tcp . 80`), all going to chain `a`.
fn bulk(n: u32) -> Vec<Element> {
    (0..n)
        .map(|i| Element {
            key: [
                Atom::Addr(std::net::Ipv4Addr::from(0x0a60_0000 + i).into()),
                Atom::Proto(Protocol::Tcp),
                Atom::Port(80),
            ]
            .into(),
            data: Some(ElemData::Verdict(Verdict::Goto("a".into()))),
            comment: Some("ns/bulk".into()),
            origin: None,
        })
        .collect()
}

fn size_in_kernel(k: &mut FakeKernel) -> Option<u32> {
    k.read_table(IpFamily::V4, "nodeproxy")
        .unwrap()
        .unwrap()
        .sets["service-ips"]
        .size
}

#[test]
fn hash_set_sizes_keep_the_held_size_within_its_margin() {
    // A fresh kernel: none up to the threshold, then twice the elements to a power of two.
    assert_eq!(hash_set_size(0, None), None);
    assert_eq!(hash_set_size(1000, None), None);
    assert_eq!(hash_set_size(1001, None), Some(2048));
    assert_eq!(hash_set_size(100_000, None), Some(262_144));
    // Kept from 1/8 to 3/4 of the held size, below the threshold too (no flapping there).
    for n in [256, 999, 1001, 1536] {
        assert_eq!(hash_set_size(n, Some(2048)), Some(2048), "{n}");
    }
    // Grown past 3/4 (and past the size itself).
    assert_eq!(hash_set_size(1537, Some(2048)), Some(4096));
    assert_eq!(hash_set_size(5000, Some(2048)), Some(16_384));
    // Shrunk below 1/8: to a smaller size, or none below the threshold.
    assert_eq!(hash_set_size(1500, Some(16_384)), Some(4096));
    assert_eq!(hash_set_size(255, Some(2048)), None);
}

#[test]
fn lowering_sizes_big_hash_sets_and_dynamic_ones() {
    let size_of = |t: &Table, set: &str| lower(t).unwrap().sets[set].size;
    assert_eq!(size_of(&table(bulk(1000), true), "service-ips"), None);
    assert_eq!(size_of(&table(bulk(1001), true), "service-ips"), Some(2048));
    let mut t = table(vec![], true);
    t.sets.push(Set {
        name: "pins".into(),
        comment: String::new(),
        key: vec![KeyField::Saddr],
        data: None,
        typeof_: false,
        elements: vec![],
        kind: SetKind::Dynamic,
    });
    // What the kernel gives a dynamic set anyway, and dumps back.
    assert_eq!(size_of(&t, "pins"), Some(DYNAMIC_SET_SIZE));
}

#[test]
fn a_sync_keeps_the_held_size_until_the_margin_and_then_recreates_the_set() {
    let mut k = FakeKernel::new();
    converge(&mut k, &table(bulk(1001), true));
    assert_eq!(size_in_kernel(&mut k), Some(2048));
    // A fresh kernel would get 4096 for 1536 elements; this one keeps its 2048.
    let t = table(bulk(1536), true);
    let mut want = lower(&t).unwrap();
    assert_eq!(want.sets["service-ips"].size, Some(4096));
    let have = k.read_table(IpFamily::V4, "nodeproxy").unwrap();
    size_sets(&mut want, have.as_ref());
    assert_eq!(want.sets["service-ips"].size, Some(2048));
    let rep = converge(&mut k, &t);
    assert_eq!((rep.elements_added, rep.chains_rewritten), (535, 0));
    assert_eq!(size_in_kernel(&mut k), Some(2048));
    // Past 3/4: the set is recreated with the new size, and the rule looking it up rewritten.
    let rep = converge(&mut k, &table(bulk(1537), true));
    assert_eq!((rep.elements_added, rep.chains_rewritten), (1537, 1));
    assert_eq!(size_in_kernel(&mut k), Some(4096));
    assert_eq!(converge(&mut k, &table(bulk(1537), true)).empty_plans, 1);
}

#[test]
fn the_fake_kernel_refuses_an_element_past_a_sets_size_as_the_kernel_does() {
    let enfile = |e: NftError| match e {
        NftError::Rejected { errors } => errors
            .iter()
            .map(|e| (e.op, e.errno.raw_os_error()))
            .collect::<Vec<_>>(),
        other => panic!("{other}"),
    };
    let sized = |elems: Vec<Element>| {
        let mut w = lower(&table(elems, true)).unwrap();
        w.sets.get_mut("service-ips").unwrap().size = Some(2);
        w
    };
    let mut k = FakeKernel::new();
    let three = sized(vec![
        svc_elem(1, 80, "a"),
        svc_elem(2, 80, "a"),
        svc_elem(3, 80, "a"),
    ]);
    let err = k.apply(&diff(None, &three)).unwrap_err();
    assert_eq!(enfile(err), vec![("add element", Some(nix::libc::ENFILE))]);
    assert!(k.tables.is_empty(), "all or nothing");

    let two = sized(vec![svc_elem(1, 80, "a"), svc_elem(2, 80, "a")]);
    k.apply(&diff(None, &two)).unwrap();
    // Full: a delete and an add in one transaction fit, as the kernel counts them.
    let replaced = sized(vec![svc_elem(1, 80, "a"), svc_elem(2, 80, "b")]);
    k.apply(&diff(Some(&two), &replaced)).unwrap();
    // An element that exists with the same data is not counted again.
    let again = diff(None, &replaced);
    let adds: Vec<Op<'_>> = again
        .phase1
        .into_iter()
        .filter(|o| matches!(o, Op::AddElems { .. }))
        .collect();
    let plan = Plan {
        family: IpFamily::V4,
        table: "nodeproxy".into(),
        phase1: adds,
        phase2: vec![],
    };
    k.apply(&plan).unwrap();
    // One more is past the size.
    let three = sized(vec![
        svc_elem(1, 80, "a"),
        svc_elem(2, 80, "b"),
        svc_elem(3, 80, "a"),
    ]);
    let err = k.apply(&diff(Some(&replaced), &three)).unwrap_err();
    assert_eq!(enfile(err), vec![("add element", Some(nix::libc::ENFILE))]);
}

/// A table of maps like `service-ips` (the first is it), the `i`-th holding `bulk(sizes[i])` with its own
/// addresses (`10.<i>.x.y`) and, from the second on, a comment per 97 elements.
fn split_table(sizes: &[u32]) -> Table {
    let mut t = table(vec![], true);
    let template = t.sets.remove(0);
    for (i, &n) in (0u32..).zip(sizes) {
        let mut elements = bulk(n);
        for (j, e) in elements.iter_mut().enumerate() {
            let j = u32::try_from(j).unwrap();
            let mut key = e.key.to_vec();
            key[0] = Atom::Addr(std::net::Ipv4Addr::from((i << 24) + j).into());
            e.key = key.into();
            if i > 0 {
                e.comment = Some(format!("ns/s{}", j / 97).into());
                e.origin = Some(std::sync::Arc::new(origin(&format!("s{}", j / 97))));
            }
        }
        t.sets.push(Set {
            // The first is the one the table's rule looks up.
            name: if i == 0 {
                template.name.clone()
            } else {
                format!("s{i}")
            },
            elements,
            ..template.clone()
        });
    }
    t
}

/// Whether two lowerings of a table are the same, order of creation and origins included (`==`
/// leaves both out), and sizes as the sync paths give them (`lower_owned` leaves them to
/// `size_sets`).
fn same_lowering(mut a: WireTable, mut b: WireTable) -> bool {
    size_sets(&mut a, None);
    size_sets(&mut b, None);
    a == b && lowered_fully(&a) == lowered_fully(&b)
}

/// Each set's name and its elements' keys and origins, in creation order.
type Contents = Vec<(String, Vec<(Vec<u8>, String)>)>;

fn lowered_fully(w: &WireTable) -> Contents {
    w.sets_ordered()
        .map(|(name, s)| {
            let elements = s.elements.iter().map(|(k, e)| {
                let origin = e.origin.as_ref().map(|o| o.to_string()).unwrap_or_default();
                (k.to_vec(), origin)
            });
            (name.to_owned(), elements.collect())
        })
        .collect()
}

#[test]
fn lowering_on_two_threads_gives_what_one_thread_gives() {
    let half = u32::try_from(wire::SPLIT_MIN_ELEMENTS).unwrap();
    // The halves meet inside the big set, at a set's start, and inside the only set.
    for sizes in [vec![10, half * 2, 7], vec![half, half], vec![half * 3]] {
        let t = split_table(&sizes);
        let one = lower(&t).unwrap();
        let two = lower_owned(t).unwrap();
        assert!(same_lowering(one, two), "{sizes:?}");
    }
    // Keys that do not come in ascending order: in both halves, and only across them (each
    // half ascending, the second's keys below the first's).
    let descending: fn(&mut [Element]) = |e| {
        e.reverse();
        e.swap(1, e.len() / 2 + 1);
    };
    let rotated: fn(&mut [Element]) = |e| e.rotate_left(e.len() / 2);
    for disorder in [descending, rotated] {
        let mut t = split_table(&[half * 2]);
        disorder(&mut t.sets[0].elements);
        let one = lower(&t).unwrap();
        let two = lower_owned(t).unwrap();
        assert!(same_lowering(one, two));
    }
}

#[test]
fn lowering_on_two_threads_fails_on_the_first_bad_element_as_one_thread_does() {
    let n = u32::try_from(wire::SPLIT_MIN_ELEMENTS).unwrap() * 2;
    let break_at = |t: &mut Table, at: usize| {
        let key = &mut t.sets[1].elements[at].key;
        *key = Atoms::new(&key.atoms()[..key.len() - 1]);
    };
    // Bad elements in both halves, and in the second half only.
    for bad in [vec![10, n as usize - 10], vec![n as usize - 10]] {
        let mut t = split_table(&[5, n]);
        for &at in &bad {
            break_at(&mut t, at);
        }
        let one = lower(&t).unwrap_err().to_string();
        let two = lower_owned(t).unwrap_err().to_string();
        assert_eq!(two, one, "{bad:?}");
        assert!(one.contains(&format!("ns/s{}", bad[0] / 97)), "{one}");
    }
    // The same key in each half (which the builder's `finish` never lets through): refused,
    // naming the set and the key.
    let mut t = split_table(&[n]);
    let first = t.sets[0].elements[3].key.clone();
    t.sets[0].elements[n as usize - 3].key = first;
    let one = lower(&t).unwrap_err().to_string();
    let two = lower_owned(t).unwrap_err().to_string();
    for err in [&one, &two] {
        assert!(
            err.contains("duplicate key") && err.contains("map service-ips"),
            "{err}"
        );
    }
    assert!(two.contains("element 000000030600000000500000 "), "{two}");
}

#[test]
fn an_element_keeps_its_data_and_range_end_whichever_is_set_first() {
    let data = Some(WireData::value(&[10, 0, 0, 1, 0, 80, 0, 0]));
    let end = ElemBytes::from(vec![10, 0, 0, 255]);
    let who = Some(std::sync::Arc::new(origin("web")));
    let comment = Some(std::sync::Arc::new(b"ns/web:http".to_vec()));
    let mut e = WireElem::new(None, data.clone(), comment.clone(), who.clone());
    assert_eq!((e.key_end(), e.data()), (None, data.as_ref()));
    e.set_key_end(Some(end.clone()));
    assert_eq!((e.key_end(), e.data()), (Some(&end), data.as_ref()));
    assert_eq!((&e.userdata, &e.origin), (&comment, &who));
    assert_eq!(
        e,
        WireElem::new(Some(end.clone()), data.clone(), comment.clone(), None),
        "the origin is not compared"
    );
    assert_ne!(e, WireElem::new(None, data.clone(), comment.clone(), None));
    e.set_data(None);
    assert_eq!((e.key_end(), e.data(), e.chain()), (Some(&end), None, None));
    e.set_key_end(None);
    assert_eq!(e, WireElem::new(None, None, comment.clone(), None));
    let chain: ChainName = std::sync::Arc::new("pick-web".into());
    e.set_data(Some(WireData::verdict(uapi::NFT_GOTO, Some(chain))));
    assert_eq!((e.key_end(), e.chain()), (None, Some("pick-web")));
    assert_eq!((&e.userdata, &e.origin), (&comment, &who));
}
