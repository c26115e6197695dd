//! Benchmarks of the pure pipeline at 10k services × 10 endpoints: building the ruleset from the
//! model, rendering nft text, lowering to the wire form, and diffing (no change / two endpoints
//! changed); and one sync after two EndpointSlices changed (the first endpoint of two
//! Services), full (`Syncer::sync`) against incremental (`Syncer::sync_changed`). The kernel
//! side is measured by `scripts/bench-kernel.sh`: here the kernel accepts every plan without
//! doing anything, so a sync's time is its user-space time.
//!
//! Run: `cargo bench --bench ruleset` (`-- "two slices changed/"` for the sync comparison);
//! `NP_SERVICES` and `NP_ENDPOINTS` set the size (default 10000 × 10).

// A benchmark aborts on broken setup; there is nothing to recover.
#![allow(clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};

use criterion::{Criterion, criterion_group, criterion_main};
use nodeproxy::config::Config;
use nodeproxy::model::{
    ClusterState, Conditions, EndpointSlice, IpFamily, Locality, Node, Protocol, Service,
    ServiceName, ServicePort, SliceEndpoint, SlicePort,
};
use nodeproxy::nft::{self, ApplyStats, Kernel, NftError, Plan, WireTable};
use nodeproxy::ruleset::{self, Settings};
use nodeproxy::sync::{Incremental, Syncer};

/// Services and endpoints per Service: `NP_SERVICES`, `NP_ENDPOINTS` (10000 × 10).
fn size() -> (u32, u32) {
    let var = |name: &str, default: u32| {
        std::env::var(name)
            .ok()
            .map_or(default, |v| v.parse().expect("a number"))
    };
    (var("NP_SERVICES", 10_000), var("NP_ENDPOINTS", 10))
}

fn label(services: u32, endpoints: u32) -> String {
    format!("{}k services x {endpoints} endpoints", services / 1000)
}

fn name(ns: String, name: String) -> ServiceName {
    ServiceName::new(&ns, &name)
}

/// The same shape as `examples/gen_cluster.rs`: every fourth service has a NodePort, endpoints
/// spread over 1000 nodes.
fn cluster(services: u32, endpoints: u32, changed_endpoint: bool) -> ClusterState {
    let mut state = ClusterState::default();
    state.nodes.insert(
        "node-a".into(),
        Node {
            name: "node-a".into(),
            internal_ips: vec![IpAddr::V4(Ipv4Addr::new(192, 0, 2, 11))],
            ..Node::default()
        },
    );
    for s in 0..services {
        let svc_name = name(format!("ns{}", s % 100), format!("svc{s}"));
        let service = Service {
            cluster_ips: vec![IpAddr::V4(Ipv4Addr::from(0x0A60_0001 + s))],
            ports: vec![ServicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 80,
                node_port: u16::try_from(s / 4)
                    .ok()
                    .filter(|p| s.is_multiple_of(4) && *p < 2768)
                    .map(|p| 30000 + p),
            }],
            ..Service::new(svc_name.clone())
        };
        let eps = (0..endpoints)
            .map(|e| {
                let slot = s * endpoints + e;
                let mut addr = 0x0A80_0000 + slot;
                // The first endpoint of svc1 and svc2: neither has a NodePort, which at 50k
                // Services wrap around their range and collide (taking the full path).
                if changed_endpoint && e == 0 && (s == 1 || s == 2) {
                    addr = 0x0AFF_FF00 + s;
                }
                SliceEndpoint {
                    addr: IpAddr::V4(Ipv4Addr::from(addr)),
                    conditions: Conditions {
                        ready: true,
                        serving: true,
                        terminating: false,
                    },
                    locality: Locality::of(
                        Some(if slot.is_multiple_of(1000) {
                            "node-a".into()
                        } else {
                            format!("node-{}", slot % 1000).into()
                        }),
                        None,
                    ),
                }
            })
            .collect();
        let slice = EndpointSlice {
            name: name(svc_name.namespace().to_owned(), format!("svc{s}-abcde")),
            service: svc_name.clone(),
            family: IpFamily::V4,
            ports: vec![SlicePort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 8080,
            }]
            .into(),
            endpoints: eps,
        };
        state.slices.insert(slice.name.clone(), slice);
        state.services.insert(svc_name, service);
    }
    state
}

fn settings() -> Settings {
    let config = Config {
        cluster_cidr: vec!["10.128.0.0/9".parse().expect("cidr")],
        ..Config::default()
    };
    Settings::new(&config, "node-a".into())
}

fn pipeline(c: &mut Criterion) {
    let (services, endpoints) = size();
    let state = cluster(services, endpoints, false);
    let changed = cluster(services, endpoints, true);
    let settings = settings();
    let ruleset = ruleset::build(&state, &settings);
    let v4 = ruleset.table(IpFamily::V4).expect("ip table");
    let wire = nft::lower(v4).expect("lower");
    let changed_wire = nft::lower(
        ruleset::build(&changed, &settings)
            .table(IpFamily::V4)
            .expect("ip table"),
    )
    .expect("lower");

    let mut group = c.benchmark_group(label(services, endpoints));
    group.sample_size(10);
    group.bench_function("build", |b| {
        b.iter(|| ruleset::build(black_box(&state), &settings))
    });
    group.bench_function("render", |b| {
        b.iter(|| ruleset::render::render(black_box(&ruleset)))
    });
    group.bench_function("lower ip table", |b| b.iter(|| nft::lower(black_box(v4))));
    group.bench_function("diff, nothing changed", |b| {
        b.iter(|| nft::diff(Some(black_box(&wire)), &wire).is_empty())
    });
    group.bench_function("diff, two endpoints changed", |b| {
        b.iter(|| nft::diff(Some(black_box(&wire)), &changed_wire).elements_added())
    });
    group.finish();
}

/// A kernel that takes every plan and holds nothing: the syncer's own cost, without the fake
/// kernel's copy of the whole table per transaction (which alone takes longer than an
/// incremental sync).
struct NullKernel;

impl Kernel for NullKernel {
    fn read_table(&mut self, _: IpFamily, _: &str) -> Result<Option<WireTable>, NftError> {
        Ok(None)
    }

    fn apply(&mut self, plan: &Plan<'_>) -> Result<ApplyStats, NftError> {
        Ok(ApplyStats {
            messages: plan.phase1.len() + plan.phase2.len(),
            ..ApplyStats::default()
        })
    }

    fn delete_tables(&mut self, _: &str) -> Result<usize, NftError> {
        Ok(0)
    }

    fn generation(&mut self) -> Result<u32, NftError> {
        Ok(0)
    }
}

/// One sync after the first endpoint of two services changed (back and forth, so that every
/// iteration has a change to apply), full and incremental.
fn sync(c: &mut Criterion) {
    let (services, endpoints) = size();
    let states = [
        cluster(services, endpoints, false),
        cluster(services, endpoints, true),
    ];
    let settings = settings();
    let changed: BTreeSet<ServiceName> = [
        name("ns1".into(), "svc1".into()),
        name("ns2".into(), "svc2".into()),
    ]
    .into();
    let scoped = [states[0].subset(&changed), states[1].subset(&changed)];

    let mut group = c.benchmark_group(format!(
        "{}, two slices changed",
        label(services, endpoints)
    ));
    group.sample_size(10);
    let mut full = Syncer::new(NullKernel);
    full.sync(&states[0], &settings, false).expect("first sync");
    let mut i = 0;
    group.bench_function("full sync", |b| {
        b.iter(|| {
            i += 1;
            full.sync(&states[i % 2], &settings, false).expect("sync")
        })
    });
    drop(full);

    let mut inc = Syncer::new(NullKernel);
    inc.sync(&states[0], &settings, false).expect("first sync");
    let mut i = 0;
    group.bench_function("incremental sync", |b| {
        b.iter(|| {
            i += 1;
            match inc
                .sync_changed(&scoped[i % 2], &changed, &settings)
                .expect("sync")
            {
                Incremental::Done(out) => *out,
                Incremental::NeedsFull(reason) => panic!("not incremental: {reason}"),
            }
        })
    });
    group.finish();
}

criterion_group!(benches, pipeline, sync);
criterion_main!(benches);
