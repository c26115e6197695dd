//! Kernel tests of the probe's failure path, in a fresh network namespace (root required).

use super::*;

/// Runs `f` on a thread in a new network namespace (the namespace dies with the thread).
fn in_netns<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .expect("unshare(CLONE_NEWNET): kernel tests need root");
        f()
    })
    .join()
    .unwrap_or_else(|p| std::panic::resume_unwind(p))
}

fn build_bogus(family: IpFamily, p: &str) -> Result<WireTable, NftError> {
    raw_rule_chain(
        family,
        format!("{p}-bogus"),
        vec![WireExpr::new(
            "nodeproxybogus",
            vec![(1, 1u32.to_be_bytes().to_vec())],
        )],
    )
}

#[test]
fn an_expression_the_kernel_does_not_know_is_reported_missing_and_the_table_removed() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        let probes = [
            Probe {
                feature: "meta mark",
                config: |_| "CONFIG_NF_TABLES",
                build: build_mark,
            },
            Probe {
                feature: "bogus expression",
                config: |_| "CONFIG_NODEPROXY_BOGUS",
                build: build_bogus,
            },
            Probe {
                feature: "fib",
                config: |_| "CONFIG_NFT_FIB",
                build: build_fib,
            },
        ];
        let caps = probe_with(&mut k, &probes).unwrap();
        assert_eq!(caps.missing.len(), 2, "{:#?}", caps.missing);
        for (m, family) in caps.missing.iter().zip(IpFamily::ALL) {
            assert_eq!(m.family, family);
            assert_eq!(m.feature, "bogus expression");
            assert_eq!(m.config, "CONFIG_NODEPROXY_BOGUS");
            // The kernel answers ENOENT for an expression type it cannot find or load.
            assert!(m.error.contains("No such file or directory"), "{m}");
            assert!(m.error.contains("p1-bogus"), "names the rule's chain: {m}");
            assert!(m.to_string().starts_with("bogus expression ("), "{m}");
        }
        // Probes after the failing one still ran (fib is present on the test kernel).
        for family in IpFamily::ALL {
            assert!(k.read_table(family, &probe_table_name()).unwrap().is_none());
        }
    });
}

#[test]
fn every_feature_is_present_on_the_test_kernel() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        let caps = probe(&mut k).unwrap();
        assert!(caps.complete(), "{:#?}", caps.missing);
        // 5.12+ and 6.9+; the test kernel is newer.
        assert!(caps.table_owner);
        assert!(caps.table_persist);
        assert_eq!(caps.ownership(), Ownership::Owned);
        assert_eq!(probe_ownership(&mut k).unwrap(), Ownership::Owned);
        for family in IpFamily::ALL {
            assert!(k.read_table(family, &probe_table_name()).unwrap().is_none());
        }
    });
}

#[test]
fn the_probe_objects_read_back_as_the_nft_statements_they_stand_for() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        let name = probe_table_name();
        let caps = run(&mut k, &name, PROBES).unwrap();
        assert!(caps.complete(), "{:#?}", caps.missing);
        let list = |family: &str| {
            let out = std::process::Command::new("nft")
                .args(["list", "table", family, &name])
                .output()
                .expect("nft is installed");
            assert!(out.status.success(), "{out:?}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let v4 = list("ip");
        let v6 = list("ip6");
        // Owned by our socket (nft prints the flag).
        assert!(v4.contains("flags owner"), "{v4}");
        for (text, saddr) in [
            (&v4, "ip saddr 192.0.2.255"),
            (&v6, "ip6 saddr 2001:db8::ff"),
        ] {
            for want in [
                saddr,
                "dnat ip",
                "masquerade fully-random",
                "numgen random mod 2 vmap @p2-slots",
                "fib daddr type local",
                "ct state new ct status dnat accept",
                "reject",
                "vmap @p6-vmap",
                "flags dynamic,timeout",
                "saddr timeout 3h }",
                "meta mark set meta mark | 0x00004000",
            ] {
                let want = if want == "dnat ip" && text == &v6 {
                    "dnat ip6"
                } else {
                    want
                };
                assert!(text.contains(want), "missing {want:?} in\n{text}");
            }
        }
        assert!(
            v4.contains("update @p7-seen { ip saddr timeout 3h }"),
            "{v4}"
        );
        assert!(
            v6.contains("update @p7-seen { ip6 saddr timeout 3h }"),
            "{v6}"
        );
        assert!(v4.contains("delete @p8-seen { ip saddr }"), "{v4}");
        assert!(v6.contains("delete @p8-seen { ip6 saddr }"), "{v6}");
        k.delete_tables(&name).unwrap();
    });
}

/// Expression kinds built into nf_tables itself (`include/net/netfilter/nf_tables_core.h`
/// declares `nft_imm_type`, `nft_cmp_type`, `nft_lookup_type`, `nft_bitwise_type`,
/// `nft_byteorder_type`, `nft_payload_type`, `nft_dynset_type` and `nft_meta_type` among the
/// core types): present wherever nf_tables is, so none needs a probe of its own. The others
/// are modules a kernel may lack (`nft_ct`, `nft_nat`, `nft_numgen`, `nft_fib_*`, ...).
const CORE: [&str; 8] = [
    "immediate",
    "cmp",
    "lookup",
    "bitwise",
    "byteorder",
    "payload",
    "dynset",
    "meta",
];

#[test]
fn every_expression_kind_nodeproxy_programs_is_probed_unless_nf_tables_core_provides_it() {
    let mut probed = std::collections::BTreeSet::new();
    for probe in PROBES {
        for family in IpFamily::ALL {
            let table = (probe.build)(family, "np-probe").unwrap();
            for chain in table.chains.values() {
                for rule in &chain.rules {
                    probed.extend(rule.exprs.iter().map(|e| e.name.clone()));
                }
            }
        }
    }
    let unprobed: Vec<&str> = crate::nft::kind_names()
        .filter(|k| !probed.contains(*k) && !CORE.contains(k))
        .collect();
    assert!(
        unprobed.is_empty(),
        "expression kinds no capability probe builds (add one to PROBES, naming its kernel \
         option): {unprobed:?}; probed: {probed:?}"
    );
}
