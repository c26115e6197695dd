//! Kernel tests of kube-proxy leftover detection and removal, in a fresh network namespace
//! with `nft` building the leftovers (as kube-proxy and iptables-nft would) and as the oracle.
//! Needs root; fails (never skips) without it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::netns::{in_netns, nft, nft_load};
use nodeproxy::model::IpFamily;
use nodeproxy::nft::leftovers::{Leftover, detect, remove};

/// iptables-nft style tables: base chains named as iptables names them, KUBE-* chains jumping
/// to each other, plus things that must survive.
const SETUP: &str = r#"
table ip kube-proxy {
    chain services { }
}
table ip6 kube-proxy { }
table ip nat {
    chain PREROUTING {
        type nat hook prerouting priority -100; policy accept;
        counter
        jump KUBE-SERVICES
        ip daddr 192.0.2.1 counter
    }
    chain OUTPUT {
        type nat hook output priority -100; policy accept;
        jump KUBE-SERVICES
    }
    chain KUBE-SERVICES {
        ip daddr 203.0.113.10 jump KUBE-SVC-ABC
    }
    chain KUBE-SVC-ABC {
        goto KUBE-SEP-XYZ
    }
    chain KUBE-SEP-XYZ { }
    chain KUBE-KUBELET-CANARY { }
    chain CUSTOM {
        counter
    }
}
table ip filter {
    chain INPUT {
        type filter hook input priority 0; policy accept;
        counter
    }
    chain KUBE-FIREWALL { }
}
table ip6 nat {
    chain KUBE-SERVICES { }
    chain POSTROUTING {
        type nat hook postrouting priority 100; policy accept;
        jump KUBE-SERVICES
    }
}
table ip keep {
    chain KUBE-NOT-IPTABLES { }
}
"#;

fn without_legacy(l: Vec<Leftover>) -> Vec<Leftover> {
    l.into_iter()
        .filter(|l| !matches!(l, Leftover::LegacyIptables { .. }))
        .collect()
}

#[test]
fn kube_proxy_tables_and_iptables_nft_chains_are_found_and_removed() {
    in_netns(|| {
        nft_load(SETUP);
        let found = detect().unwrap();
        let expected = vec![
            Leftover::NftTable {
                family: IpFamily::V4,
                name: "kube-proxy".into(),
            },
            Leftover::IptablesNftChains {
                family: IpFamily::V4,
                table: "nat".into(),
                chains: vec![
                    "KUBE-SEP-XYZ".into(),
                    "KUBE-SERVICES".into(),
                    "KUBE-SVC-ABC".into(),
                ],
            },
            Leftover::IptablesNftChains {
                family: IpFamily::V4,
                table: "filter".into(),
                chains: vec!["KUBE-FIREWALL".into()],
            },
            Leftover::NftTable {
                family: IpFamily::V6,
                name: "kube-proxy".into(),
            },
            Leftover::IptablesNftChains {
                family: IpFamily::V6,
                table: "nat".into(),
                chains: vec!["KUBE-SERVICES".into()],
            },
        ];
        assert_eq!(without_legacy(found.clone()), expected);
        // Legacy tables are reported exactly when the namespace has some.
        let legacy4 =
            std::fs::read_to_string("/proc/thread-self/net/ip_tables_names").unwrap_or_default();
        assert_eq!(
            found.iter().any(|l| matches!(
                l,
                Leftover::LegacyIptables {
                    family: IpFamily::V4,
                    ..
                }
            )),
            !legacy4.trim().is_empty()
        );

        let removed = remove(&found).unwrap();
        assert_eq!(removed.tables, 2);
        assert_eq!(removed.chains, 5);
        // PREROUTING and OUTPUT in ip nat, POSTROUTING in ip6 nat.
        assert_eq!(removed.jump_rules, 3);

        assert_eq!(without_legacy(detect().unwrap()), vec![]);
        let ruleset = nft(&["list", "ruleset"]);
        assert!(!ruleset.contains("kube-proxy"), "{ruleset}");
        assert!(!ruleset.contains("KUBE-SERVICES"), "{ruleset}");
        assert!(!ruleset.contains("KUBE-SVC"), "{ruleset}");
        // Everything else survives: base chains with their other rules, other chains, the
        // kubelet canary, and a native table that merely uses a KUBE- name.
        let nat = nft(&["list", "table", "ip", "nat"]);
        assert!(nat.contains("chain PREROUTING"), "{nat}");
        assert!(nat.contains("ip daddr 192.0.2.1 counter"), "{nat}");
        assert_eq!(nat.matches("counter packets").count(), 3, "{nat}");
        assert!(nat.contains("chain OUTPUT"), "{nat}");
        assert!(nat.contains("chain CUSTOM"), "{nat}");
        assert!(nat.contains("chain KUBE-KUBELET-CANARY"), "{nat}");
        let filter = nft(&["list", "table", "ip", "filter"]);
        assert!(filter.contains("chain INPUT"), "{filter}");
        assert!(!filter.contains("KUBE-FIREWALL"), "{filter}");
        let nat6 = nft(&["list", "table", "ip6", "nat"]);
        assert!(nat6.contains("chain POSTROUTING"), "{nat6}");
        let keep = nft(&["list", "table", "ip", "keep"]);
        assert!(keep.contains("chain KUBE-NOT-IPTABLES"), "{keep}");

        // Removing again is a no-op.
        let again = remove(&found).unwrap();
        assert_eq!((again.tables, again.chains, again.jump_rules), (0, 0, 0));
    });
}

#[test]
fn a_clean_namespace_has_no_leftovers() {
    in_netns(|| {
        nft_load(
            "table ip nodeproxy {\n chain x {\n }\n}\n\
             table ip nat {\n chain POSTROUTING {\n  type nat hook postrouting priority 100;\n }\n}\n",
        );
        assert_eq!(without_legacy(detect().unwrap()), vec![]);
    });
}
