//! The input's floor: how long the cheapest conceivable reader of a `kubectl get -o json` list
//! takes, against nodeproxy's own reader of the same file, in alternating rounds.
//!
//! The floor reads the file and decodes only the fields nodeproxy reads, into structs that
//! borrow their strings from the text: no checks, no duplicate-key detection, no conversion into
//! the model, nothing kept. It runs on one thread, and on two: one thread cuts the list into
//! items (borrowed from the text, not copied) and hands them to the second, decoding itself
//! those that find the second's queue full, as nodeproxy's reader shares its work. Below it, serde_json's bare scan of the text
//! (`IgnoredAny`). nodeproxy's reader (`source::file::load_files`) does all of the former on two
//! threads, under the allocator and options the binary has. docs/performance.md uses the floor
//! to bound what a cold `--once` can cost before its one transaction can be sent.
//!
//! Run: `NP_INPUT=file.json cargo bench --bench input_floor` (make the file with
//! `target/release/examples/gen_cluster 10000 10 > file.json`); `NP_ROUNDS` rounds (10).

// A benchmark aborts on broken setup; there is nothing to recover.
#![allow(clippy::expect_used, clippy::panic)]

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use serde::Deserialize;
use serde_json::value::RawValue;

/// The binary's allocator, with the options `.cargo/config.toml` compiles in: nodeproxy's reader
/// allocates for every item, and under glibc's allocator it took 77.7 instead of 63.7 ms at 10k
/// Services × 10 endpoints.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The list, decoded one item at a time: each item is touched and dropped, none kept.
#[derive(Deserialize)]
struct List {
    items: Items,
}

/// What [`touch`] made of every item.
struct Items(usize);

impl<'de> Deserialize<'de> for Items {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Items, D::Error> {
        struct Each;
        impl<'de> serde::de::Visitor<'de> for Each {
            type Value = Items;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of objects")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Items, A::Error> {
                let mut sum = 0;
                while let Some(item) = seq.next_element::<Item<'de>>()? {
                    sum += touch(&item);
                }
                Ok(Items(sum))
            }
        }
        d.deserialize_seq(Each)
    }
}

/// The list with its items cut but not decoded: their text, borrowed.
#[derive(Deserialize)]
struct Cut {
    items: Shared,
}

/// What the two threads made of the items, summed.
struct Shared(usize);

impl<'de> Deserialize<'de> for Shared {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Shared, D::Error> {
        struct Share;
        impl<'de> serde::de::Visitor<'de> for Share {
            type Value = usize;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of objects")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<usize, A::Error> {
                std::thread::scope(|scope| {
                    let (send, receive) = std::sync::mpsc::sync_channel::<&'de RawValue>(64);
                    let other = scope.spawn(move || {
                        receive
                            .into_iter()
                            .map(|raw| decode(raw.get()))
                            .sum::<usize>()
                    });
                    // The second thread takes every item it has room for; this one decodes
                    // those that find its queue full, so neither waits for the other.
                    let mut sum = 0;
                    while let Some(raw) = seq.next_element::<&'de RawValue>()? {
                        if let Err(
                            std::sync::mpsc::TrySendError::Full(raw)
                            | std::sync::mpsc::TrySendError::Disconnected(raw),
                        ) = send.try_send(raw)
                        {
                            sum += decode(raw.get());
                        }
                    }
                    drop(send);
                    Ok(sum + other.join().expect("the second thread decodes"))
                })
            }
        }
        d.deserialize_seq(Share).map(Shared)
    }
}

/// One item's text, decoded as [`Items`] decodes it in place.
fn decode(text: &str) -> usize {
    touch(&serde_json::from_str::<Item<'_>>(text).expect("an item"))
}

/// Every kind in one struct: an internally tagged enum would buffer each item before decoding it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Item<'a> {
    #[serde(borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow)]
    metadata: Meta<'a>,
    #[serde(borrow)]
    spec: Option<Spec<'a>>,
    #[serde(borrow)]
    status: Option<Status<'a>>,
    #[serde(borrow)]
    address_type: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    ports: Vec<SlicePort<'a>>,
    #[serde(borrow, default)]
    endpoints: Vec<Endpoint<'a>>,
}

#[derive(Deserialize)]
struct Meta<'a> {
    #[serde(borrow)]
    namespace: Option<Cow<'a, str>>,
    #[serde(borrow)]
    name: Cow<'a, str>,
    #[serde(borrow)]
    labels: Option<BTreeMap<Cow<'a, str>, Cow<'a, str>>>,
}

/// A Service's spec and a Node's (`podCIDRs`).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec<'a> {
    #[serde(borrow, rename = "type")]
    type_: Option<Cow<'a, str>>,
    #[serde(borrow, rename = "clusterIP")]
    cluster_ip: Option<Cow<'a, str>>,
    #[serde(borrow, rename = "clusterIPs", default)]
    cluster_ips: Vec<Cow<'a, str>>,
    #[serde(borrow, default)]
    ports: Vec<ServicePort<'a>>,
    #[serde(borrow, rename = "externalIPs", default)]
    external_ips: Vec<Cow<'a, str>>,
    #[serde(borrow, default)]
    load_balancer_source_ranges: Vec<Cow<'a, str>>,
    #[serde(borrow)]
    external_traffic_policy: Option<Cow<'a, str>>,
    #[serde(borrow)]
    internal_traffic_policy: Option<Cow<'a, str>>,
    #[serde(borrow)]
    session_affinity: Option<Cow<'a, str>>,
    session_affinity_config: Option<AffinityConfig>,
    health_check_node_port: Option<i32>,
    #[serde(borrow, rename = "podCIDRs", default)]
    pod_cidrs: Vec<Cow<'a, str>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AffinityConfig {
    #[serde(rename = "clientIP")]
    client_ip: Option<ClientIp>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ClientIp {
    timeout_seconds: Option<i32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ServicePort<'a> {
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    protocol: Option<Cow<'a, str>>,
    port: i32,
    node_port: Option<i32>,
}

/// A Service's load-balancer status and a Node's addresses.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Status<'a> {
    #[serde(borrow)]
    load_balancer: Option<LoadBalancer<'a>>,
    #[serde(borrow, default)]
    addresses: Vec<NodeAddress<'a>>,
}

#[derive(Deserialize)]
struct LoadBalancer<'a> {
    #[serde(borrow, default)]
    ingress: Vec<Ingress<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Ingress<'a> {
    #[serde(borrow)]
    ip: Option<Cow<'a, str>>,
    #[serde(borrow)]
    ip_mode: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct NodeAddress<'a> {
    #[serde(borrow, rename = "type")]
    type_: Cow<'a, str>,
    #[serde(borrow)]
    address: Cow<'a, str>,
}

#[derive(Deserialize)]
struct SlicePort<'a> {
    #[serde(borrow)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    protocol: Option<Cow<'a, str>>,
    port: Option<i32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Endpoint<'a> {
    #[serde(borrow)]
    addresses: Vec<Cow<'a, str>>,
    conditions: Option<Conditions>,
    #[serde(borrow)]
    node_name: Option<Cow<'a, str>>,
    #[serde(borrow)]
    zone: Option<Cow<'a, str>>,
    #[serde(borrow)]
    hints: Option<Hints<'a>>,
}

#[derive(Deserialize)]
struct Conditions {
    ready: Option<bool>,
    serving: Option<bool>,
    terminating: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Hints<'a> {
    #[serde(borrow, default)]
    for_zones: Vec<Named<'a>>,
    #[serde(borrow, default)]
    for_nodes: Vec<Named<'a>>,
}

#[derive(Deserialize)]
struct Named<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
}

/// A number that depends on every decoded field, so that none is optimised away.
fn touch(i: &Item<'_>) -> usize {
    let s = |c: &Option<Cow<'_, str>>| c.as_ref().map_or(0, |c| c.len());
    let v = |c: &[Cow<'_, str>]| c.iter().map(|c| c.len()).sum::<usize>();
    let n = |x: Option<i32>| usize::try_from(x.unwrap_or(0)).unwrap_or(0);
    let spec = i.spec.as_ref().map_or(0, |p| {
        s(&p.type_)
            + s(&p.cluster_ip)
            + v(&p.cluster_ips)
            + v(&p.external_ips)
            + v(&p.load_balancer_source_ranges)
            + v(&p.pod_cidrs)
            + s(&p.external_traffic_policy)
            + s(&p.internal_traffic_policy)
            + s(&p.session_affinity)
            + n(p
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds))
            + n(p.health_check_node_port)
            + p.ports
                .iter()
                .map(|p| s(&p.name) + s(&p.protocol) + n(Some(p.port)) + n(p.node_port))
                .sum::<usize>()
    });
    let status = i.status.as_ref().map_or(0, |st| {
        st.load_balancer.as_ref().map_or(0, |lb| {
            lb.ingress
                .iter()
                .map(|g| s(&g.ip) + s(&g.ip_mode))
                .sum::<usize>()
        }) + st
            .addresses
            .iter()
            .map(|a| a.type_.len() + a.address.len())
            .sum::<usize>()
    });
    let endpoints = i
        .endpoints
        .iter()
        .map(|e| {
            v(&e.addresses)
                + e.conditions.as_ref().map_or(0, |c| {
                    usize::from(c.ready.unwrap_or(false))
                        + usize::from(c.serving.unwrap_or(false))
                        + usize::from(c.terminating.unwrap_or(false))
                })
                + s(&e.node_name)
                + s(&e.zone)
                + e.hints.as_ref().map_or(0, |h| {
                    h.for_zones
                        .iter()
                        .chain(&h.for_nodes)
                        .map(|n| n.name.len())
                        .sum::<usize>()
                })
        })
        .sum::<usize>();
    let ports = i
        .ports
        .iter()
        .map(|p| s(&p.name) + s(&p.protocol) + n(p.port))
        .sum::<usize>();
    let meta = &i.metadata;
    let labels = meta.labels.as_ref().map_or(0, |l| {
        l.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
    });
    i.kind.len()
        + meta.name.len()
        + s(&meta.namespace)
        + labels
        + spec
        + status
        + s(&i.address_type)
        + ports
        + endpoints
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Median and minimum, in that order.
fn summary(mut xs: Vec<f64>) -> (f64, f64) {
    xs.sort_by(f64::total_cmp);
    (xs[xs.len() / 2], xs[0])
}

fn main() {
    let Some(input) = std::env::var_os("NP_INPUT").map(PathBuf::from) else {
        panic!("set NP_INPUT to a kubectl-style JSON list (examples/gen_cluster writes one)");
    };
    let rounds: usize = std::env::var("NP_ROUNDS")
        .ok()
        .map(|r| r.parse().expect("NP_ROUNDS is a number"))
        .unwrap_or(10)
        .max(1);
    let bytes = std::fs::metadata(&input)
        .expect("NP_INPUT is readable")
        .len();
    let (mut ours, mut floor, mut floor2, mut scan) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        // Each reader's result is dropped after its time is taken: `--once` keeps what it read.
        let t = Instant::now();
        let loaded =
            nodeproxy::source::file::load_files(std::slice::from_ref(&input)).expect("loads");
        black_box(&loaded);
        ours.push(ms_since(t));
        drop(loaded);

        let t = Instant::now();
        let text = std::fs::read(&input).expect("reads");
        let list: List = serde_json::from_slice(&text).expect("a JSON list");
        black_box(list.items.0);
        floor.push(ms_since(t));
        drop(text);

        let t = Instant::now();
        let text = std::fs::read(&input).expect("reads");
        let cut: Cut = serde_json::from_slice(&text).expect("a JSON list");
        black_box(cut.items.0);
        floor2.push(ms_since(t));

        let t = Instant::now();
        let _: serde::de::IgnoredAny = serde_json::from_slice(&text).expect("JSON");
        scan.push(ms_since(t));
    }
    let (ours, ours_min) = summary(ours);
    let (floor, floor_min) = summary(floor);
    let (floor2, floor2_min) = summary(floor2);
    let (scan, scan_min) = summary(scan);
    println!(
        "input: {} ({bytes} bytes), {rounds} alternating rounds",
        input.display()
    );
    println!("medians (minima), ms:");
    println!("  nodeproxy's reader (load_files, two threads):  {ours:.1} ({ours_min:.1})");
    println!("  floor: read + borrowed decode, one thread:      {floor:.1} ({floor_min:.1})");
    println!("  floor: read + borrowed decode, two threads:     {floor2:.1} ({floor2_min:.1})");
    println!("  serde_json's scan of the text (IgnoredAny):     {scan:.1} ({scan_min:.1})");
    println!(
        "ratio, nodeproxy's reader / floor on two threads: {:.2}",
        ours / floor2
    );
}
