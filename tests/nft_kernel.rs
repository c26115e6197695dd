//! Kernel tests of `nft`: program a fresh network namespace through netlink, read back, and use
//! the `nft` tool as the oracle. Needs root; fails (never skips) without it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;

use common::netns::{in_netns, nft, nft_load};
use common::sample;
use nodeproxy::model::IpFamily;
use nodeproxy::nft::uapi::{TABLE_F_OWNED, TABLE_F_PERSIST};
use nodeproxy::nft::{
    self, FakeKernel, Kernel, NetlinkKernel, NftError, WireData, WireElem, diff, lower,
};
use nodeproxy::ruleset::{self, Atom, ElemData, Ruleset, Settings};
use nodeproxy::sync::{Incremental, Syncer};

/// `nft list table` of the sample tables, reviewed by hand (nft 1.0.6 formatting).
const EXPECTED_IP: &str = include_str!("data/sample-ip.nft");
const EXPECTED_IP6: &str = include_str!("data/sample-ip6.nft");

fn ruleset() -> Ruleset {
    Ruleset {
        tables: vec![sample::table(IpFamily::V4), sample::table(IpFamily::V6)],
    }
}

fn list(family: &str) -> String {
    nft(&["list", "table", family, "nodeproxy"])
}

fn assert_kernel_holds(k: &mut NetlinkKernel, rs: &Ruleset) {
    for t in &rs.tables {
        let want = lower(t).unwrap();
        let got = k
            .read_table(t.family, "nodeproxy")
            .unwrap()
            .expect("table exists");
        for (n, c) in &want.chains {
            assert_eq!(Some(c), got.chains.get(n), "chain {n} ({:?})", t.family);
        }
        for (n, s) in &want.sets {
            assert_eq!(Some(s), got.sets.get(n), "set {n} ({:?})", t.family);
        }
        assert_eq!(want, got, "{:?}", t.family);
    }
}

#[test]
fn sample_round_trips_and_lists_as_nft_prints_it() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        let rs = ruleset();
        let rep = nft::sync(&mut k, rs.clone()).unwrap();
        assert_eq!(rep.tables, 2);
        assert!(rep.elements_added > 20, "{rep:?}");
        assert_kernel_holds(&mut k, &rs);
        // After an intended change of the sample: `UPDATE_SAMPLE=1`, then review the diff
        // (`nft_loaded_text_reads_back_as_lowered` then checks nft's bytecode for it).
        if std::env::var_os("UPDATE_SAMPLE").is_some() {
            let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data");
            std::fs::write(format!("{data}/sample-ip.nft"), list("ip")).unwrap();
            std::fs::write(format!("{data}/sample-ip6.nft"), list("ip6")).unwrap();
            return;
        }
        assert_eq!(list("ip"), EXPECTED_IP);
        assert_eq!(list("ip6"), EXPECTED_IP6);
        // Re-applying the same state sends nothing.
        let again = nft::sync(&mut k, rs.clone()).unwrap();
        assert_eq!(again.empty_plans, 2, "{again:?}");
        assert_eq!(again.messages, 0);
    });
}

#[test]
fn nft_loaded_text_reads_back_as_lowered() {
    // The same ruleset loaded by nft itself: bytecode, set types and userdata must be what we
    // lower, byte for byte.
    in_netns(|| {
        nft_load(EXPECTED_IP);
        nft_load(EXPECTED_IP6);
        let mut k = NetlinkKernel::new().unwrap();
        assert_kernel_holds(&mut k, &ruleset());
        assert_eq!(nft::sync(&mut k, ruleset()).unwrap().messages, 0);
    });
}

#[test]
fn converges_and_removes_foreign_objects() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        nft::sync(&mut k, ruleset()).unwrap();
        // Someone else adds objects to our table.
        nft(&["add", "chain", "ip", "nodeproxy", "foreign"]);
        nft(&[
            "add",
            "rule",
            "ip",
            "nodeproxy",
            "foreign",
            "jump",
            "pick-1",
        ]);
        nft(&[
            "add",
            "set",
            "ip",
            "nodeproxy",
            "junk",
            "{ type ipv4_addr; }",
        ]);
        nft(&[
            "add",
            "element",
            "ip",
            "nodeproxy",
            "cluster-ips",
            "{ 10.96.9.9 }",
        ]);
        nft(&[
            "add",
            "element",
            "ip",
            "nodeproxy",
            "service-ips",
            "{ 10.96.9.9 . tcp . 1 : goto dispatch }",
        ]);

        // A changed desired state: one service endpoint replaced, one element removed, a chain
        // and a set (with the rule using it) gone, a chain's rules changed.
        let mut rs = ruleset();
        let t = &mut rs.tables[0];
        let eps = t.sets.iter_mut().find(|s| s.name == "eps-k2").unwrap();
        eps.elements[1].data = Some(ElemData::Value(
            [Atom::Addr("10.244.3.7".parse().unwrap()), Atom::Port(53)].into(),
        ));
        let cips = t.sets.iter_mut().find(|s| s.name == "cluster-ips").unwrap();
        cips.elements.remove(1);
        t.sets.retain(|s| s.name != "endpoints-plain");
        t.chains.retain(|c| c.name != "dispatch");
        let masq = t
            .chains
            .iter_mut()
            .find(|c| c.name == "masquerading")
            .unwrap();
        masq.rules.pop();

        let rep = nft::sync(&mut k, rs.clone()).unwrap();
        assert!(rep.elements_removed >= 4, "{rep:?}");
        assert_kernel_holds(&mut k, &rs);
        let text = list("ip");
        for gone in [
            "foreign",
            "junk",
            "10.96.9.9",
            "endpoints-plain",
            "chain dispatch",
            "10.244.2.6",
        ] {
            assert!(!text.contains(gone), "{gone} left over:\n{text}");
        }
        assert!(text.contains("10.244.3.7 . 53"), "{text}");
        assert_eq!(nft::sync(&mut k, rs.clone()).unwrap().messages, 0);
    });
}

#[test]
fn poison_transaction_is_rejected_naming_the_service() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        let rs = ruleset();
        nft::sync(&mut k, rs.clone()).unwrap();
        let before = list("ip");

        let current = k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap();
        let mut desired = lower(&rs.tables[0]).unwrap();
        // A service element whose goto targets a chain that does not exist, among good changes.
        let svc = desired.sets.get_mut("service-ips").unwrap();
        svc.elements.insert(
            vec![10, 96, 0, 99, 6, 0, 0, 0, 0, 80, 0, 0].into(),
            WireElem::new(
                None,
                Some(WireData::verdict(
                    -4,
                    Some(std::sync::Arc::new("no-such-chain".into())),
                )),
                None,
                Some(std::sync::Arc::new(sample::spn("poison", "web", "http"))),
            ),
        );
        let cips = desired.sets.get_mut("cluster-ips").unwrap();
        cips.elements.insert(
            vec![10, 96, 0, 99].into(),
            WireElem::new(None, None, None, None),
        );
        let plan = diff(Some(&current), &desired);
        let err = k.apply(&plan).unwrap_err();
        let NftError::Rejected { errors } = &err else {
            panic!("unexpected error {err}")
        };
        assert_eq!(errors.len(), 1, "{err}");
        let e = &errors[0];
        assert_eq!(e.errno.raw_os_error(), Some(2), "{err}");
        assert_eq!(
            e.object,
            "element 10.96.0.99 . tcp . 80 : goto no-such-chain in map service-ips of table ip nodeproxy"
        );
        assert_eq!(
            e.origin.as_ref().map(|o| o.to_string()).as_deref(),
            Some("poison/web:http")
        );
        let msg = err.to_string();
        assert!(
            msg.contains("poison/web:http") && msg.contains("service-ips"),
            "{msg}"
        );
        // Atomic: nothing of the transaction happened.
        assert_eq!(list("ip"), before);
    });
}

#[test]
fn delete_tables_removes_only_ours() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        nft::sync(&mut k, ruleset()).unwrap();
        nft(&["add", "table", "inet", "other"]);
        nft(&["add", "table", "ip", "nodeproxy-not"]);
        assert_eq!(k.delete_tables("nodeproxy").unwrap(), 2);
        let tables = nft(&["list", "tables"]);
        assert_eq!(tables, "table inet other\ntable ip nodeproxy-not\n");
        // Nothing left to delete is fine.
        assert_eq!(k.delete_tables("nodeproxy").unwrap(), 0);
    });
}

/// The ruleset generation moves with every committed transaction, ours or another process's,
/// and stays put otherwise: what lets periodic verification skip the read-back of a table
/// nobody touched.
#[test]
fn generation_moves_with_every_commit_and_only_then() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        let g0 = k.generation().unwrap();
        assert_eq!(k.generation().unwrap(), g0, "reading changes nothing");
        nft::sync(&mut k, ruleset()).unwrap();
        let g1 = k.generation().unwrap();
        assert_ne!(g1, g0, "our transaction moves it");
        // A sync with nothing to do sends nothing, so the generation stays.
        nft::sync(&mut k, ruleset()).unwrap();
        assert_eq!(k.generation().unwrap(), g1);
        let _ = k.read_table(IpFamily::V4, "nodeproxy").unwrap();
        assert_eq!(k.generation().unwrap(), g1, "dumps are not commits");
        // Someone else's change to an unrelated table counts too.
        nft(&["add", "table", "inet", "other"]);
        let g2 = k.generation().unwrap();
        assert_ne!(g2, g1);
        nft(&["flush", "ruleset"]);
        let g3 = k.generation().unwrap();
        assert_ne!(g3, g2);
        // An apply on its own reports the generations around its transaction.
        let rs = ruleset();
        let want = lower(rs.table(IpFamily::V4).unwrap()).unwrap();
        let have = k.read_table(IpFamily::V4, "nodeproxy").unwrap();
        let plan = diff(have.as_ref(), &want);
        let stats = k.apply(&plan).unwrap();
        let (before, after) = stats.generation.expect("nobody else committed");
        assert_eq!(before, g3);
        assert_eq!(after, k.generation().unwrap());
        assert_ne!(after, before);
    });
}

fn owned_ruleset() -> Ruleset {
    let mut rs = ruleset();
    for t in &mut rs.tables {
        t.owned = true;
    }
    rs
}

fn flags(k: &mut NetlinkKernel) -> Vec<Option<(u32, Option<u32>)>> {
    IpFamily::ALL
        .iter()
        .map(|&f| {
            k.table_info(f, "nodeproxy")
                .unwrap()
                .map(|i| (i.flags, i.owner))
        })
        .collect()
}

#[test]
fn an_owned_table_reads_as_an_orphan_to_others_who_are_denied_naming_the_owner() {
    in_netns(|| {
        let mut owner = NetlinkKernel::new().unwrap();
        // The ip table owned, the ip6 one not: a deletion of both must delete neither.
        let mut rs = owned_ruleset();
        rs.tables[1].owned = false;
        nft::sync(&mut owner, rs.clone()).unwrap();
        let port = owner.port_id();
        assert_eq!(
            flags(&mut owner),
            vec![Some((TABLE_F_OWNED, Some(port))), Some((0, None))]
        );
        // The owner reads its flags back as it wrote them: nothing to do.
        assert_eq!(nft::sync(&mut owner, rs).unwrap().messages, 0);
        let before = list("ip");

        let mut other = NetlinkKernel::new().unwrap();
        let got = other
            .read_table(IpFamily::V4, "nodeproxy")
            .unwrap()
            .unwrap();
        assert_eq!(
            got.flags, TABLE_F_PERSIST,
            "someone else's table reads as an orphan"
        );
        // So a sync tries to claim it, and the kernel's EPERM names the owner.
        let err = nft::sync(&mut other, owned_ruleset()).unwrap_err();
        let NftError::Denied { table, owner: who } = &err else {
            panic!("expected Denied, got {err}");
        };
        assert_eq!(table, "table ip nodeproxy");
        assert!(
            who.as_deref()
                .is_some_and(|w| w.contains(&format!("netlink port {port}"))),
            "{err}"
        );
        assert!(
            err.to_string().contains("owned by another process"),
            "{err}"
        );
        // Deleting is refused, atomically: the unowned ip6 table stays too.
        let err = other.delete_tables("nodeproxy").unwrap_err();
        assert!(matches!(err, NftError::Denied { .. }), "{err}");
        assert_eq!(flags(&mut other).iter().flatten().count(), 2);
        assert_eq!(list("ip"), before);
    });
}

#[test]
fn an_orphan_is_taken_over_by_the_next_sync_without_other_changes() {
    in_netns(|| {
        let mut first = NetlinkKernel::new().unwrap();
        nft::sync(&mut first, owned_ruleset()).unwrap();
        drop(first);
        let mut second = NetlinkKernel::new().unwrap();
        assert_eq!(flags(&mut second), vec![Some((TABLE_F_PERSIST, None)); 2]);
        assert_kernel_holds_modulo_flags(&mut second, &owned_ruleset());
        let rep = nft::sync(&mut second, owned_ruleset()).unwrap();
        assert_eq!(rep.tables_claimed, 2, "{rep}");
        assert_eq!((rep.elements_added, rep.elements_removed), (0, 0), "{rep}");
        // BATCH_BEGIN, NEWTABLE, BATCH_END per table: nothing else.
        assert_eq!(rep.messages, 6, "{rep}");
        let port = second.port_id();
        assert_eq!(
            flags(&mut second),
            vec![Some((TABLE_F_OWNED, Some(port))); 2]
        );
        assert_kernel_holds(&mut second, &owned_ruleset());
    });
}

#[test]
fn a_table_created_without_persist_stays_unowned() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        nft::sync(&mut k, ruleset()).unwrap();
        // The kernel refuses to add ownership to it (EOPNOTSUPP), so the diff does not try.
        let rep = nft::sync(&mut k, owned_ruleset()).unwrap();
        assert_eq!((rep.messages, rep.tables_claimed), (0, 0), "{rep}");
        assert_eq!(flags(&mut k), vec![Some((0, None)); 2]);
    });
}

/// Like [`assert_kernel_holds`], but for an orphan: the flags differ from the owned tables'.
fn assert_kernel_holds_modulo_flags(k: &mut NetlinkKernel, rs: &Ruleset) {
    for t in &rs.tables {
        let want = lower(t).unwrap();
        let mut got = k.read_table(t.family, "nodeproxy").unwrap().unwrap();
        got.flags = want.flags;
        assert_eq!(want, got, "{:?}", t.family);
    }
}

#[test]
fn a_100k_element_table_loads_and_one_changed_element_is_one_delete_and_one_add() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        let mut rs = ruleset();
        rs.tables.truncate(1);
        let t = &mut rs.tables[0];
        let eps = t.sets.iter_mut().find(|s| s.name == "eps-k2").unwrap();
        let base = eps.elements[0].clone();
        eps.elements.clear();
        for i in 0..50_000u32 {
            for slot in 0..2u32 {
                let mut e = base.clone();
                let ip = std::net::Ipv4Addr::from(0x0a60_0000 + i);
                e.key = [
                    Atom::Addr(ip.into()),
                    Atom::Proto(nodeproxy::model::Protocol::Tcp),
                    Atom::Port(80),
                    Atom::Int(slot),
                ]
                .into();
                eps.elements.push(e);
            }
        }
        let rep = nft::sync(&mut k, rs.clone()).unwrap();
        eprintln!("100k elements: {rep:?}");
        // Right after a bulk insert the kernel resizes the set's hash table in a deferred
        // worker, and a dump that overlaps the resize can skip elements without being flagged
        // as interrupted (6.18). That is why element adds are idempotent; here, read until the
        // resize is over (bounded) to check that everything was programmed.
        let mut counts = Vec::new();
        for _ in 0..20 {
            let got = k.read_table(IpFamily::V4, "nodeproxy").unwrap().unwrap();
            counts.push(got.sets["eps-k2"].elements.len());
            if counts.last() == Some(&100_000) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert_eq!(
            counts.last(),
            Some(&100_000),
            "element counts read back: {counts:?}"
        );
        // One element changed: exactly one delete and one add.
        let mut rs2 = rs.clone();
        let eps = rs2.tables[0]
            .sets
            .iter_mut()
            .find(|s| s.name == "eps-k2")
            .unwrap();
        eps.elements[7].data = Some(ElemData::Value(
            [Atom::Addr("10.1.1.1".parse().unwrap()), Atom::Port(1)].into(),
        ));
        let rep2 = nft::sync(&mut k, rs2.clone()).unwrap();
        eprintln!("1 change: {rep2:?}");
        assert_eq!((rep2.elements_added, rep2.elements_removed), (1, 1));
    });
}

/// The incremental sync against the kernel: golden fixtures (ranges in interval sets, affinity,
/// NodePort affinity under `--nodeport-addresses all`, dual stack, traffic policies), each
/// Service deleted, put back and with an endpoint's readiness flipped; after each step our
/// tables read back as the full build lowers them.
#[test]
fn incremental_syncs_leave_the_kernel_as_a_full_build_describes_it() {
    in_netns(|| {
        let mut incremental = 0;
        for case in [
            "source-ranges",
            "affinity",
            "affinity-all",
            "dualstack",
            "policies",
        ] {
            let (original, settings) = golden_case(case);
            let mut k = NetlinkKernel::new().unwrap();
            k.delete_tables("nodeproxy").unwrap();
            let mut syncer = Syncer::new(k);
            syncer.sync(&original, &settings, false).unwrap();
            // What full syncs alone make of the same steps.
            let mut reference = Syncer::new(FakeKernel::new());
            reference.sync(&original, &settings, false).unwrap();
            for svc in original.services.keys() {
                let changed = BTreeSet::from([svc.clone()]);
                let mut deleted = original.clone();
                deleted.services.remove(svc);
                let mut flipped = original.clone();
                if let Some(ep) = flipped
                    .slices
                    .values_mut()
                    .find(|s| &s.service == svc)
                    .and_then(|s| s.endpoints.first_mut())
                {
                    ep.conditions.ready = !ep.conditions.ready;
                }
                for st in [deleted, original.clone(), flipped, original.clone()] {
                    match syncer
                        .sync_changed(&st.subset(&changed), &changed, &settings)
                        .unwrap()
                    {
                        Incremental::Done(_) => incremental += 1,
                        Incremental::NeedsFull(reason) => {
                            assert!(!reason.contains("rejected"), "{case} {svc}: {reason}");
                            syncer.sync(&st, &settings, false).unwrap();
                        }
                    }
                    reference.sync(&st, &settings, false).unwrap();
                    for table in ruleset::build(&st, &settings).tables {
                        let want = reference
                            .kernel()
                            .read_table(table.family, "nodeproxy")
                            .unwrap()
                            .expect("table exists");
                        let got = syncer
                            .kernel()
                            .read_table(table.family, "nodeproxy")
                            .unwrap()
                            .expect("table exists");
                        assert!(
                            want == got,
                            "{case}: {svc}: {:?} table differs from the full build",
                            table.family
                        );
                    }
                }
            }
        }
        assert!(incremental >= 10, "only {incremental} incremental syncs");
    });
}

/// ClusterIP Services `bulk-<i>` for each `i` of `range`, one endpoint each: one element each
/// in `cluster-ips`, `service-ips` and `pick-1-endpoints`.
fn add_bulk(
    st: &mut nodeproxy::model::ClusterState,
    range: std::ops::Range<u32>,
) -> BTreeSet<nodeproxy::model::ServiceName> {
    use nodeproxy::model::*;
    let mut names = BTreeSet::new();
    for i in range {
        let svc_name = ServiceName::new("ns", &format!("bulk-{i}"));
        let svc = Service {
            cluster_ips: vec![std::net::Ipv4Addr::from(0x0a60_0000 + i).into()],
            ports: vec![ServicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: None,
            }],
            ..Service::new(svc_name.clone())
        };
        let slice = EndpointSlice {
            name: ServiceName::new("ns", &format!("bulk-{i}-1")),
            service: svc_name.clone(),
            family: IpFamily::V4,
            ports: vec![SlicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 8080,
            }]
            .into(),
            endpoints: vec![SliceEndpoint {
                addr: std::net::Ipv4Addr::from(0x0ac9_0000 + i).into(),
                conditions: Conditions {
                    ready: true,
                    serving: true,
                    terminating: false,
                },
                locality: Locality::of(Some("node-b".into()), None),
            }]
            .into(),
        };
        st.slices.insert(slice.name.clone(), slice);
        st.services.insert(svc_name.clone(), svc);
        names.insert(svc_name);
    }
    names
}

/// The `size` lines of nft text, in order.
fn size_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.trim_start().starts_with("size "))
        .map(str::to_owned)
        .collect()
}

/// Hash sets of more than 1000 elements are created with a size, which `nft list` shows where
/// `--dry-run` renders it; the kernel dumps it back as we sent it, so verification finds no
/// drift; and past 3/4 of it the full path recreates the sets with the next size.
#[test]
fn a_big_set_is_created_with_its_size_and_grows_past_three_quarters() {
    in_netns(|| {
        let settings = Settings::new(&nodeproxy::config::Config::default(), "node-a".into());
        let mut st = nodeproxy::model::ClusterState::default();
        add_bulk(&mut st, 0..1001);
        let mut syncer = Syncer::new(NetlinkKernel::new().unwrap());
        syncer.sync(&st, &settings, false).unwrap();
        let sizes = |syncer: &mut Syncer<NetlinkKernel>| {
            let t = syncer
                .kernel()
                .read_table(IpFamily::V4, "nodeproxy")
                .unwrap()
                .unwrap();
            ["cluster-ips", "service-ips", "pick-1-endpoints"]
                .map(|n| (t.sets[n].elements.len(), t.sets[n].size))
        };
        assert_eq!(sizes(&mut syncer), [(1001, Some(2048)); 3]);
        let rendered = ruleset::render::render(&ruleset::build(&st, &settings));
        let listed = list("ip") + &list("ip6");
        assert_eq!(size_lines(&listed), size_lines(&rendered));
        assert_eq!(size_lines(&listed), vec!["\t\tsize 2048"; 3]);
        let out = syncer.sync(&st, &settings, true).unwrap();
        assert!(!out.drift_repaired, "{out}");
        assert_eq!(out.report.messages, 0, "{out}");

        // Change syncs keep the size up to 3/4 of it...
        let changed = add_bulk(&mut st, 1001..1536);
        let Incremental::Done(_) = syncer
            .sync_changed(&st.subset(&changed), &changed, &settings)
            .unwrap()
        else {
            panic!("expected a change sync");
        };
        assert_eq!(sizes(&mut syncer), [(1536, Some(2048)); 3]);
        // ... and one more element takes the full path, which recreates the sets.
        let changed = add_bulk(&mut st, 1536..1537);
        let Incremental::NeedsFull(_) = syncer
            .sync_changed(&st.subset(&changed), &changed, &settings)
            .unwrap()
        else {
            panic!("expected the full path");
        };
        syncer.sync(&st, &settings, false).unwrap();
        assert_eq!(sizes(&mut syncer), [(1537, Some(4096)); 3]);
        assert_eq!(size_lines(&list("ip")), vec!["\t\tsize 4096"; 3]);
        let out = syncer.sync(&st, &settings, true).unwrap();
        assert!(!out.drift_repaired, "{out}");
        assert_eq!(out.report.messages, 0, "{out}");
    });
}

/// The cluster and settings of a golden fixture (`tests/fixtures/golden/<case>.yaml`).
fn golden_case(case: &str) -> (nodeproxy::model::ClusterState, Settings) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden");
    let args = std::fs::read_to_string(dir.join(format!("{case}.args"))).unwrap();
    let argv = ["nodeproxy".to_string()]
        .into_iter()
        .chain(args.split_whitespace().map(String::from))
        .map(std::ffi::OsString::from);
    let config = nodeproxy::config::load(argv, &|_| None).unwrap().config;
    let settings = Settings::new(&config, config.node_name().unwrap());
    let state = nodeproxy::source::file::load_files(&[dir.join(format!("{case}.yaml"))])
        .unwrap()
        .state;
    (state, settings)
}

/// Both of our tables as a fresh kernel gets them from a full build of `state`.
fn tables_of(state: &nodeproxy::model::ClusterState, settings: &Settings) -> Vec<nft::WireTable> {
    let mut reference = Syncer::new(FakeKernel::new());
    reference.sync(state, settings, false).unwrap();
    IpFamily::ALL
        .iter()
        .map(|&f| {
            reference
                .kernel()
                .read_table(f, "nodeproxy")
                .unwrap()
                .unwrap()
        })
        .collect()
}

fn kernel_tables() -> Vec<nft::WireTable> {
    let mut k = NetlinkKernel::new().unwrap();
    IpFamily::ALL
        .iter()
        .map(|&f| k.read_table(f, "nodeproxy").unwrap().unwrap())
        .collect()
}

#[test]
fn a_sealed_restart_adopts_both_tables_and_any_commit_since_makes_it_read_back() {
    in_netns(|| {
        for case in ["dualstack", "affinity-all"] {
            let (state, settings) = golden_case(case);
            let mut k = NetlinkKernel::new().unwrap();
            k.delete_tables("nodeproxy").unwrap();
            let mut first = Syncer::new(k);
            first.sync(&state, &settings, false).unwrap();
            assert!(first.seal().unwrap(), "{case}");
            drop(first);
            let seal = nft(&["list", "table", "ip", nft::SEAL_TABLE]);
            assert!(seal.contains("comment \"seal-v1 boot="), "{seal}");

            // Nothing changed since: both tables adopted, nothing sent.
            let mut second = Syncer::new(NetlinkKernel::new().unwrap());
            let out = second.sync(&state, &settings, false).unwrap();
            assert_eq!(out.report.tables_adopted, 2, "{case}: {out}");
            assert_eq!(out.report.messages, 0, "{case}: {out}");
            // What it believes it applied is what the kernel holds.
            let verified = second.sync(&state, &settings, true).unwrap();
            assert!(
                !verified.drift_repaired && verified.report.messages == 0,
                "{case}: {verified}"
            );
            assert!(second.seal().unwrap());
            drop(second);
            let want = kernel_tables();
            assert!(want == tables_of(&state, &settings), "{case}");

            // Someone else's change to an element of ours: read back and repaired.
            nft(&["flush", "set", "ip", "nodeproxy", "cluster-ips"]);
            let mut third = Syncer::new(NetlinkKernel::new().unwrap());
            let out = third.sync(&state, &settings, false).unwrap();
            assert_eq!(out.report.tables_adopted, 0, "{case}: {out}");
            assert!(out.report.elements_added > 0, "{case}: {out}");
            assert!(kernel_tables() == want, "{case}: repaired");
            assert!(third.seal().unwrap());
            drop(third);

            // Anyone's commit, on a table of theirs: read back (nothing to repair).
            nft(&["add", "table", "inet", "someone-else"]);
            let mut fourth = Syncer::new(NetlinkKernel::new().unwrap());
            let out = fourth.sync(&state, &settings, false).unwrap();
            assert_eq!(out.report.tables_adopted, 0, "{case}: {out}");
            assert_eq!(out.report.messages, 0, "{case}: {out}");
            nft(&["delete", "table", "inet", "someone-else"]);
        }
    });
}
