//! Kernel readback of every golden: `nodeproxy --once` in a fresh network namespace, then `nft
//! list table` must equal the golden rendering.
//!
//! Normalisation: inside an `elements = { … }` list, element order and line wrapping are
//! ignored, because nft prints verdict maps in the kernel's hash order; and the table's
//! ownership decoration is removed (see `common::netns::strip_ownership`): `--once` leaves its tables
//! orphaned where the kernel supports table ownership, and the rendering never shows ownership
//! (see `render_table`). That decoration is checked on its own, against the table flags read
//! back. Everything else — chains, rules, set types, comments, element keys, data and comments —
//! must match to the byte.

// Tests fail by panicking; that is their job.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::netns::{in_netns, lock_file_for_this_netns, nft, nft_load, strip_ownership};
use nodeproxy::model::IpFamily;
use nodeproxy::nft::NetlinkKernel;
use nodeproxy::nft::owner::Ownership;
use nodeproxy::nft::probe::{TABLE_F_OWNER, TABLE_F_PERSIST, probe_ownership};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn args_of(case: &str) -> Vec<String> {
    let path = root().join(format!("tests/fixtures/golden/{case}.args"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("{}", path.display()));
    text.split_whitespace().map(String::from).collect()
}

fn fixture(case: &str) -> PathBuf {
    root().join(format!("tests/fixtures/golden/{case}.yaml"))
}

fn golden(case: &str) -> String {
    let path = root().join(format!("tests/golden/{case}.nft"));
    std::fs::read_to_string(&path).unwrap_or_else(|_| panic!("{}", path.display()))
}

/// Runs `nodeproxy --once` for a fixture in the current (test) namespace; returns stderr.
fn once(case: &str) -> String {
    run_once(&fixture(case), &args_of(case))
}

fn before_of(case: &str) -> PathBuf {
    root().join(format!("tests/fixtures/golden/before/{case}.yaml"))
}

/// Like [`once`], first programming the case's previous state (`before/<case>.yaml`) when it
/// has one: the golden of such a case is what the second run makes of the first's table.
fn once_over_before(case: &str) -> String {
    let before = before_of(case);
    if before.exists() {
        run_once(&before, &args_of(case));
    }
    once(case)
}

fn run_once(input: &Path, args: &[String]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .env("NODEPROXY_LOCK_FILE", lock_file_for_this_netns())
        .arg("--once")
        .args(args)
        .arg("--from-file")
        .arg(input)
        .output()
        .expect("run nodeproxy");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "nodeproxy --once failed:\n{stderr}");
    stderr
}

fn listed() -> String {
    let mut text = nft(&["list", "table", "ip", "nodeproxy"]);
    text.push_str(&nft(&["list", "table", "ip6", "nodeproxy"]));
    text
}

/// See the module comment: sorts and unwraps element lists, drops the ownership decoration,
/// leaves everything else as is.
fn normalise(text: &str) -> String {
    let text = strip_ownership(text);
    let mut lines: Vec<String> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("\t\t\t     ")
            && let Some(last) = lines.last_mut()
        {
            last.push(' ');
            last.push_str(rest);
            continue;
        }
        lines.push(line.to_string());
    }
    lines
        .into_iter()
        .map(|line| match line.split_once("elements = { ") {
            Some((indent, rest)) => {
                let inner = rest.strip_suffix(" }").unwrap_or(rest);
                let mut elements: Vec<&str> = inner.split(',').map(str::trim).collect();
                elements.sort_unstable();
                format!("{indent}elements = {{ {} }}", elements.join(", "))
            }
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A normalised listing as the sorted list of its tables' objects (each table's header and each
/// set, map and chain block, with the table it is in).
fn objects(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut table = String::new();
    let mut block = String::new();
    for line in text.lines() {
        let starts_object = line.starts_with("table ")
            || ["\tset ", "\tmap ", "\tchain "]
                .iter()
                .any(|p| line.starts_with(p));
        // The table's closing brace ends its last object.
        if (starts_object || line == "}") && !block.trim().is_empty() {
            out.push(format!("{table}: {}", block.trim_end()));
            block.clear();
        }
        if line == "}" {
            continue;
        }
        if line.starts_with("table ") {
            table = line.to_string();
        }
        block.push_str(line);
        block.push('\n');
    }
    if !block.trim().is_empty() {
        out.push(format!("{table}: {}", block.trim_end()));
    }
    out.sort();
    out
}

fn cases() -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(root().join("tests/fixtures/golden"))
        .expect("fixtures")
        .filter_map(|e| {
            let p = e.ok()?.path();
            let stem = p.file_stem()?.to_string_lossy().into_owned();
            (p.extension()? == "yaml").then_some(stem)
        })
        .collect();
    out.sort();
    assert!(out.len() >= 5, "fixtures missing");
    out
}

/// The flags of both our tables, and whether the kernel supports owned tables.
fn table_flags() -> (Vec<Option<u32>>, bool) {
    let mut k = NetlinkKernel::new().unwrap();
    let owned = probe_ownership(&mut k).unwrap() == Ownership::Owned;
    let flags = IpFamily::ALL
        .iter()
        .map(|&f| k.table_info(f, "nodeproxy").unwrap().map(|i| i.flags))
        .collect();
    (flags, owned)
}

#[test]
fn every_golden_programmed_through_netlink_lists_back_as_rendered() {
    for case in cases() {
        let case2 = case.clone();
        let (first, second, listing, (flags, owned)) = in_netns(move || {
            let first = once_over_before(&case2);
            let listing = listed();
            let flags = table_flags();
            let second = once(&case2);
            (first, second, listing, flags)
        });
        // Over a previous state's table, the objects the second run adds come after the ones
        // that were there (the kernel lists in creation order): compare as sets of objects.
        let (have, want) = if before_of(&case).exists() {
            (
                objects(&normalise(&listing)).join("\n"),
                objects(&normalise(&golden(&case))).join("\n"),
            )
        } else {
            (normalise(&listing), normalise(&golden(&case)))
        };
        assert_eq!(
            have, want,
            "{case}: kernel listing differs from the golden\n{first}"
        );
        // `--once` exited: its tables are orphans (persist, no owner) where the kernel supports
        // ownership, so that the daemon can take them over; plain tables elsewhere.
        let want = if owned { TABLE_F_PERSIST } else { 0 };
        assert_eq!(flags, vec![Some(want), Some(want)], "{case}");
        assert_eq!(flags[0].unwrap_or(0) & TABLE_F_OWNER, 0);
        // Re-applying the same state sends nothing but the take-over of the two orphans
        // (BATCH_BEGIN, NEWTABLE, BATCH_END each).
        let nothing = if owned {
            "0 element(s) added, 0 removed, 0 chain(s) rewritten; took over 2 orphaned \
             table(s); 6 message(s),"
        } else {
            "0 element(s) added, 0 removed, 0 chain(s) rewritten; 0 message(s), 0 bytes"
        };
        assert!(
            second.contains(nothing),
            "{case}: re-applying the same state must change nothing:\n{second}"
        );
    }
}

/// An upgrade: the `affinity` case as a version that keyed NodePort affinity slots by node
/// address wrote it (`tests/data/affinity-nodeport-by-address.nft`, that version's golden, with
/// `nodeport-affinity-…` chains that map elements reference) must converge to today's golden.
#[test]
fn affinity_with_nodeport_slots_keyed_by_node_address_converges_to_the_golden() {
    upgrade_converges(
        include_str!("data/affinity-nodeport-by-address.nft"),
        "chain nodeport-affinity-10800s-pick-3",
        "affinity",
    );
}

/// Loads `old` (an older version's table, holding `marker`) with nft, runs `--once` for
/// `case` over it, and checks that the table then holds the case's golden objects.
fn upgrade_converges(old: &'static str, marker: &'static str, case: &'static str) {
    let (log, listing) = in_netns(move || {
        nft_load(old);
        assert!(listed().contains(marker));
        let log = once(case);
        (log, listed())
    });
    assert_eq!(
        objects(&normalise(&listing)).join("\n"),
        objects(&normalise(&golden(case))).join("\n"),
        "the upgraded table differs from the golden\n{log}"
    );
}

/// An upgrade: the `affinity-all` case (both families, Local policy, NodePorts on every
/// address) as the slot layout wrote it (`tests/data/affinity-all-slots.nft`, that version's
/// golden: `affinity-<T>s-pick-<k>` chains that map elements reference, slot sets and maps)
/// must converge to today's golden in one `--once`.
#[test]
fn affinity_with_slot_objects_converges_to_the_golden() {
    upgrade_converges(
        include_str!("data/affinity-all-slots.nft"),
        "set affinity-slot-0 {",
        "affinity-all",
    );
}

#[test]
fn switching_between_states_converges_to_exactly_the_new_golden() {
    let order = [
        "clusterip",
        "nodeport",
        "dualstack",
        "multiport",
        "clusterip",
    ];
    let listings = in_netns(move || {
        // Foreign objects inside our table must be removed by the next apply.
        let mut listings = Vec::new();
        for (i, case) in order.iter().enumerate() {
            if i == 1 {
                nft(&["add", "chain", "ip", "nodeproxy", "intruder"]);
                nft(&["add", "rule", "ip", "nodeproxy", "intruder", "counter"]);
                nft(&[
                    "add",
                    "element",
                    "ip",
                    "nodeproxy",
                    "cluster-ips",
                    "{ 192.0.2.99 }",
                ]);
            }
            once(case);
            listings.push((case.to_string(), listed()));
        }
        listings
    });
    for (case, listing) in listings {
        assert!(!listing.contains("intruder") && !listing.contains("192.0.2.99"));
        assert_eq!(
            normalise(&listing),
            normalise(&golden(&case)),
            "{case}: did not converge to its golden"
        );
    }
}

#[test]
fn cleanup_removes_our_tables_and_nothing_else() {
    let (ours, all) = in_netns(|| {
        once("clusterip");
        let sealed = nft(&["list", "tables"]);
        assert!(sealed.contains("table ip nodeproxy-seal\n"), "{sealed}");
        nft(&["add", "table", "inet", "other"]);
        nft(&["add", "table", "ip", "nodeproxy-not"]);
        let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
            .env("NODEPROXY_LOCK_FILE", lock_file_for_this_netns())
            .arg("--cleanup")
            .output()
            .expect("run nodeproxy");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let tables = nft(&["list", "tables"]);
        (tables.clone(), tables)
    });
    assert!(!ours.contains("table ip nodeproxy\n") && !ours.contains("table ip6 nodeproxy\n"));
    assert!(!ours.contains("nodeproxy-seal"), "the seal stayed:\n{ours}");
    assert!(all.contains("table inet other") && all.contains("table ip nodeproxy-not"));
}

#[test]
fn ownership_decoration_is_stripped_exactly() {
    let plain = "table ip nodeproxy {\n\tcomment \"c\"\n\tset a {\n\t}\n}\n";
    let owned = "table ip nodeproxy { # progname nodeproxy\n\tflags owner\n\tcomment \"c\"\n\n\tset a {\n\t}\n}\n";
    let orphan = "table ip nodeproxy {\n\tflags \n\tcomment \"c\"\n\n\tset a {\n\t}\n}\n";
    assert_eq!(strip_ownership(owned), plain);
    assert_eq!(strip_ownership(orphan), plain);
    assert_eq!(strip_ownership(plain), plain);
    // Only the table's own flags line goes: a set's flags stay.
    let set_flags = "table ip t {\n\tset a {\n\t\tflags interval\n\t}\n}\n";
    assert_eq!(strip_ownership(set_flags), set_flags);
    // A blank line is only dropped after a flags line.
    let blank = "table ip t {\n\tcomment \"c\"\n\n\tset a {\n\t}\n}\n";
    assert_eq!(strip_ownership(blank), blank);
}

#[test]
fn objects_ignore_only_the_order_of_whole_objects() {
    let a = "table ip t {\n\tset a {\n\t\tx\n\t}\n\n\tchain b {\n\t\ty\n\t}\n}";
    let b = "table ip t {\n\tchain b {\n\t\ty\n\t}\n\n\tset a {\n\t\tx\n\t}\n}";
    assert_eq!(objects(a), objects(b));
    assert_ne!(objects(a), objects(&a.replace("\t\tx", "\t\tz")));
    assert_ne!(objects(a), objects(&a.replace("table ip t", "table ip6 t")));
}

#[test]
fn normalisation_only_ignores_element_order() {
    let a = "\t\telements = { 1 : a,\n\t\t\t     2 : b }\n\tchain x {";
    let b = "\t\telements = { 2 : b, 1 : a }\n\tchain x {";
    assert_eq!(normalise(a), normalise(b));
    assert_ne!(
        normalise(a),
        normalise("\t\telements = { 2 : b, 1 : c }\n\tchain x {")
    );
    assert_ne!(
        normalise(a),
        normalise("\t\telements = { 1 : a, 2 : b }\n\tchain y {")
    );
}
