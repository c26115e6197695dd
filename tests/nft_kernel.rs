//! Kernel tests of `nft`: program a fresh network namespace through netlink, read back, and use
//! the `nft` tool as the oracle. Needs root; fails (never skips) without it.

mod common;

use common::netns::{in_netns, nft, nft_load};
use common::sample;
use nodeproxy::model::IpFamily;
use nodeproxy::nft::{self, Kernel, NetlinkKernel, NftError, lower};
use nodeproxy::ruleset::Ruleset;

fn ruleset() -> Ruleset {
    Ruleset { tables: vec![sample::table(IpFamily::V4), sample::table(IpFamily::V6)] }
}

#[test]
fn explore() {
    in_netns(|| {
        let mut k = NetlinkKernel::new().unwrap();
        let rs = ruleset();
        let rep = nft::sync(&mut k, &rs).unwrap();
        eprintln!("{rep:?}");
        println!("{}", nft(&["list", "ruleset"]));
        for t in &rs.tables {
            let want = lower(t).unwrap();
            let got = k.read_table(t.family, "nodeproxy").unwrap().unwrap();
            for (n, c) in &want.chains {
                assert_eq!(Some(c), got.chains.get(n), "chain {n}");
            }
            for (n, s) in &want.sets {
                assert_eq!(Some(s), got.sets.get(n), "set {n}");
            }
            assert_eq!(want, got);
        }
    });
}
