//! Packet-path tests (DESIGN §7 tier 3): the rulesets the builder makes for the golden fixtures,
//! evaluated for the situations of reference §2 (which connections are DNATed where, rejected,
//! dropped by source ranges, masqueraded, pinned by session affinity), plus the `explain`
//! command line end to end.
//!
//! Expectations are stated in terms of the cluster objects, not of the ruleset's layout, so a
//! builder change that keeps behaviour passes and one that changes behaviour fails.

// Tests fail by panicking; that is their job.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;

use nodeproxy::config::{self, Config, DetectLocalMode};
use nodeproxy::explain;
use nodeproxy::model::{ClusterState, IpFamily, Protocol, TrafficPolicy, endpoints_for};
use nodeproxy::ruleset::categorize::{NodeView, categorize};
use nodeproxy::ruleset::eval::{self, Fate, Origin, Packet, Route, Trace};
use nodeproxy::ruleset::{self, Ruleset, Settings};
use nodeproxy::source;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fixture built exactly as `--dry-run` builds it.
struct Built {
    name: String,
    config: Config,
    state: ClusterState,
    settings: Settings,
    ruleset: Ruleset,
    node_addrs: Vec<IpAddr>,
}

fn build(name: &str, path: &Path, args: &[String]) -> Built {
    let mut argv = vec!["nodeproxy".to_string(), "--dry-run".to_string()];
    argv.extend(args.iter().cloned());
    argv.push("--from-file".into());
    argv.push(path.to_string_lossy().into_owned());
    let no_env = |_: &str| None;
    let loaded = config::load(argv.iter().map(Into::into), &no_env).expect("fixture args");
    let input = source::file::load_files(&loaded.config.from_file).expect("fixture parses");
    let settings = Settings::new(&loaded.config, loaded.config.node_name().unwrap());
    let ruleset = ruleset::build(&input.state, &settings);
    let node_addrs = explain::node_addresses(&input.state, &settings.node_name);
    Built {
        name: name.to_string(),
        config: loaded.config,
        state: input.state,
        settings,
        ruleset,
        node_addrs,
    }
}

fn fixture(name: &str) -> Built {
    let dir = root().join("tests/fixtures/golden");
    let args = std::fs::read_to_string(dir.join(format!("{name}.args"))).unwrap();
    let args: Vec<String> = args.split_whitespace().map(String::from).collect();
    build(name, &dir.join(format!("{name}.yaml")), &args)
}

/// Every golden fixture, and the example cluster with the arguments its golden uses.
fn all_fixtures() -> Vec<Built> {
    let dir = root().join("tests/fixtures/golden");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("yaml"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut out: Vec<Built> = names.iter().map(|n| fixture(n)).collect();
    out.push(build(
        "example-cluster",
        &root().join("examples/cluster.yaml"),
        &"--hostname-override node-a --cluster-cidr 10.244.0.0/16,fd00:10:244::/48"
            .split_whitespace()
            .map(String::from)
            .collect::<Vec<_>>(),
    ));
    assert!(out.len() >= 6, "expected the golden fixtures");
    out
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn sock(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

fn run(b: &Built, src: &str, dst: &str, proto: Protocol, origin: Origin) -> Trace {
    let dst = sock(dst);
    eval::evaluate(
        &b.ruleset,
        &b.node_addrs,
        Packet {
            src: ip(src),
            dst: dst.ip(),
            proto,
            dport: dst.port(),
            origin,
            iif: None,
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", b.name))
}

/// What a connection should come to.
#[derive(Debug)]
enum Expect<'a> {
    /// DNATed to exactly these targets, accepted; masqueraded on the branches listed in
    /// `masq` (`All` for every branch).
    Dnat {
        targets: &'a [&'a str],
        masq: Masq<'a>,
    },
    Reject,
    /// Not translated and accepted: the ruleset leaves it alone.
    Untouched,
}

#[derive(Debug)]
enum Masq<'a> {
    None,
    All,
    Only(&'a [&'a str]),
}

fn check(b: &Built, src: &str, dst: &str, proto: Protocol, origin: Origin, expect: Expect<'_>) {
    let t = run(b, src, dst, proto, origin);
    let what = format!("{}: {origin:?} {src} -> {dst}/{proto}", b.name);
    match expect {
        Expect::Dnat { targets, masq } => {
            let want: Vec<SocketAddr> = {
                let mut v: Vec<SocketAddr> = targets.iter().map(|t| sock(t)).collect();
                v.sort();
                v
            };
            assert_eq!(t.dnat_targets(), want, "{what}: DNAT targets");
            assert_eq!(t.fate(), Some(Fate::Accept), "{what}: fate");
            for branch in &t.branches {
                let target = branch.dnat.as_ref().unwrap().target;
                let want_masq = match &masq {
                    Masq::None => false,
                    Masq::All => true,
                    Masq::Only(only) => only.iter().any(|o| sock(o) == target),
                };
                assert_eq!(
                    branch.masquerade.is_some(),
                    want_masq,
                    "{what}: masquerade of the branch to {target}: {:?}",
                    branch.masquerade
                );
            }
        }
        Expect::Reject => {
            assert_eq!(t.fate(), Some(Fate::Reject), "{what}: {:?}", t.branches);
            assert!(t.dnat_targets().is_empty(), "{what}: DNATed");
        }
        Expect::Untouched => {
            assert_eq!(t.fate(), Some(Fate::Accept), "{what}");
            assert!(t.dnat_targets().is_empty(), "{what}: DNATed");
            assert_eq!(t.masqueraded(), Some(false), "{what}: masqueraded");
        }
    }
}

use Origin::{External, Host, Pod};
use Protocol::{Sctp, Tcp, Udp};

#[test]
fn clusterip_paths() {
    let b = fixture("clusterip");
    // Ready endpoints only (198.51.100.11 is not ready; .131 has no conditions: ready).
    let eps = [
        "198.51.100.10:8080",
        "198.51.100.130:8080",
        "198.51.100.131:8080",
    ];
    // A pod keeps its source address...
    check(
        &b,
        "198.51.100.20",
        "203.0.113.20:80",
        Tcp,
        Pod,
        Expect::Dnat {
            targets: &eps,
            masq: Masq::None,
        },
    );
    // ...except when it reaches itself (hairpin): only that branch is masqueraded.
    check(
        &b,
        "198.51.100.10",
        "203.0.113.20:80",
        Tcp,
        Pod,
        Expect::Dnat {
            targets: &eps,
            masq: Masq::Only(&["198.51.100.10:8080"]),
        },
    );
    // Outside the cluster CIDR: the node itself, and a client routing the service range to us.
    check(
        &b,
        "192.0.2.11",
        "203.0.113.20:80",
        Tcp,
        Host,
        Expect::Dnat {
            targets: &eps,
            masq: Masq::All,
        },
    );
    check(
        &b,
        "203.0.113.99",
        "203.0.113.20:80",
        Tcp,
        External,
        Expect::Dnat {
            targets: &eps,
            masq: Masq::All,
        },
    );
    // A port the Service does not define, from a pod and from the host.
    check(
        &b,
        "198.51.100.20",
        "203.0.113.20:81",
        Tcp,
        Pod,
        Expect::Reject,
    );
    check(
        &b,
        "192.0.2.11",
        "203.0.113.20:80",
        Udp,
        Host,
        Expect::Reject,
    );
    // An address that is no ClusterIP is none of our business.
    check(
        &b,
        "198.51.100.20",
        "203.0.113.21:80",
        Tcp,
        Pod,
        Expect::Untouched,
    );
}

#[test]
fn nodeport_paths() {
    let b = fixture("nodeport");
    let web = ["198.51.100.10:8080", "198.51.100.130:8080"];
    // NodePort on the node's primary IP: DNAT and masquerade, from outside and from the host.
    check(
        &b,
        "203.0.113.99",
        "192.0.2.11:30080",
        Tcp,
        External,
        Expect::Dnat {
            targets: &web,
            masq: Masq::All,
        },
    );
    check(
        &b,
        "192.0.2.11",
        "192.0.2.11:30080",
        Tcp,
        Host,
        Expect::Dnat {
            targets: &web,
            masq: Masq::All,
        },
    );
    check(
        &b,
        "203.0.113.99",
        "192.0.2.11:31868",
        Sctp,
        External,
        Expect::Dnat {
            targets: &["198.51.100.140:3868"],
            masq: Masq::All,
        },
    );
    // The same NodePort on another of the node's addresses is not a NodePort address.
    check(
        &b,
        "203.0.113.99",
        "203.0.113.111:30080",
        Tcp,
        External,
        Expect::Untouched,
    );
    // A NodePort number nobody uses, and a NodePort on the wrong protocol.
    check(
        &b,
        "203.0.113.99",
        "192.0.2.11:30081",
        Tcp,
        External,
        Expect::Untouched,
    );
    check(
        &b,
        "203.0.113.99",
        "192.0.2.11:30080",
        Udp,
        External,
        Expect::Untouched,
    );
    // No (ready) endpoints: ClusterIP and NodePort reject, from everywhere.
    check(
        &b,
        "198.51.100.20",
        "203.0.113.30:80",
        Tcp,
        Pod,
        Expect::Reject,
    );
    check(
        &b,
        "192.0.2.11",
        "203.0.113.30:80",
        Tcp,
        Host,
        Expect::Reject,
    );
    check(
        &b,
        "203.0.113.99",
        "192.0.2.11:30090",
        Tcp,
        External,
        Expect::Reject,
    );
    check(
        &b,
        "192.0.2.11",
        "192.0.2.11:30090",
        Tcp,
        Host,
        Expect::Reject,
    );
    // The NodePort of a Service without endpoints on another address: untouched.
    check(
        &b,
        "203.0.113.99",
        "203.0.113.111:30090",
        Tcp,
        External,
        Expect::Untouched,
    );
}

/// `trafficDistribution` works through the hints the EndpointSlice controller writes, as in
/// kube-proxy: the field itself is not read. On node-b (zone-b): `PreferClose` and
/// `PreferSameZone` keep to the zone's endpoints, `PreferSameNode` to the node's.
#[test]
fn traffic_distribution_is_followed_through_the_slices_hints() {
    let b = fixture("policies");
    let from_pod = |dst: &str, targets: &[&str]| {
        check(
            &b,
            "198.51.100.20",
            dst,
            Tcp,
            Pod,
            Expect::Dnat {
                targets,
                masq: Masq::None,
            },
        );
    };
    from_pod("203.0.113.46:80", &["198.51.100.130:8080"]);
    from_pod("203.0.113.47:80", &["198.51.100.130:8080"]);
    from_pod(
        "203.0.113.48:80",
        &["198.51.100.130:8080", "198.51.100.131:8080"],
    );
}

#[test]
fn masquerade_all_masquerades_pod_traffic_too() {
    let b = fixture("ignored");
    assert!(b.config.masquerade_all);
    check(
        &b,
        "198.51.100.20",
        "203.0.113.20:80",
        Tcp,
        Pod,
        Expect::Dnat {
            targets: &["198.51.100.10:8080"],
            masq: Masq::All,
        },
    );
    // A Service for another proxy and a headless one are not programmed.
    check(
        &b,
        "198.51.100.20",
        "203.0.113.50:80",
        Tcp,
        Pod,
        Expect::Untouched,
    );
}

#[test]
fn multiport_dnats_each_port_to_its_target_port() {
    let b = fixture("multiport");
    let eps = |port: u16| -> Vec<String> {
        ["198.51.100.10", "198.51.100.130", "198.51.100.131"]
            .iter()
            .map(|a| format!("{a}:{port}"))
            .collect()
    };
    for (port, proto, target) in [(53, Udp, 5353), (53, Tcp, 5354), (9153, Tcp, 9153)] {
        let want = eps(target);
        let want: Vec<&str> = want.iter().map(String::as_str).collect();
        check(
            &b,
            "198.51.100.20",
            &format!("203.0.113.10:{port}"),
            proto,
            Pod,
            Expect::Dnat {
                targets: &want,
                masq: Masq::None,
            },
        );
    }
    check(
        &b,
        "198.51.100.20",
        "203.0.113.10:53",
        Sctp,
        Pod,
        Expect::Reject,
    );
}

#[test]
fn ipv6_paths() {
    let b = fixture("dualstack");
    let web6 = ["[2001:db8:a::10]:8080", "[2001:db8:b::10]:8080"];
    check(
        &b,
        "2001:db8:a::99",
        "[2001:db8:ffff::20]:80",
        Tcp,
        Pod,
        Expect::Dnat {
            targets: &web6,
            masq: Masq::None,
        },
    );
    check(
        &b,
        "2001:db8:a::10",
        "[2001:db8:ffff::20]:80",
        Tcp,
        Pod,
        Expect::Dnat {
            targets: &web6,
            masq: Masq::Only(&["[2001:db8:a::10]:8080"]),
        },
    );
    check(
        &b,
        "2001:db8::11",
        "[2001:db8:ffff::20]:80",
        Tcp,
        Host,
        Expect::Dnat {
            targets: &web6,
            masq: Masq::All,
        },
    );
    check(
        &b,
        "2001:db8:ffff::99",
        "[2001:db8::11]:30080",
        Tcp,
        External,
        Expect::Dnat {
            targets: &web6,
            masq: Masq::All,
        },
    );
    check(
        &b,
        "2001:db8:a::99",
        "[2001:db8:ffff::20]:81",
        Tcp,
        Pod,
        Expect::Reject,
    );
    check(
        &b,
        "2001:db8:a::99",
        "[2001:db8:ffff::30]:53",
        Udp,
        Pod,
        Expect::Dnat {
            targets: &["[2001:db8:b::53]:53"],
            masq: Masq::None,
        },
    );
    // The IPv4 side of the same Service is unaffected by the IPv6 table and vice versa.
    check(
        &b,
        "198.51.100.20",
        "203.0.113.20:80",
        Tcp,
        Pod,
        Expect::Dnat {
            targets: &["198.51.100.10:8080"],
            masq: Masq::None,
        },
    );
}

/// What a connection must come to, stated from the Service objects and the configuration.
#[derive(Debug, Clone)]
enum Want {
    /// DNATed to exactly these endpoints and accepted.
    Dnat {
        targets: BTreeSet<SocketAddr>,
        /// Masqueraded (except on branches delivered to this node itself: they never reach
        /// postrouting), or on none.
        masq: bool,
        pin: Pin,
    },
    /// Never DNATed: dropped or rejected.
    Refused(Fate),
}

/// What ClientIP session affinity does to the same client's next connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pin {
    /// It goes to the endpoint the first one went to, whichever that was.
    Pinned,
    /// Nothing is pinned (the Service has no affinity): no dynamic set is written.
    Nothing,
}

/// Where a connection comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Source {
    Pod,
    Host,
    Outside,
    /// From outside, with an LB IP of the Service as source address (a "VIP-like" load
    /// balancer looping node traffic back).
    Vip,
}

/// Tallies of what the sweep checked, so that it cannot pass by checking nothing.
#[derive(Debug, Default)]
struct Tally {
    paths: usize,
    by_kind: std::collections::BTreeMap<&'static str, usize>,
}

impl Tally {
    fn count(&mut self, kind: &'static str) {
        *self.by_kind.entry(kind).or_default() += 1;
    }

    fn at_least(&self, kind: &str, n: usize) {
        let got = self.by_kind.get(kind).copied().unwrap_or(0);
        assert!(
            got >= n,
            "the sweep checked {got} {kind} paths, expected >= {n}: {self:?}"
        );
    }
}

/// Evaluates one connection and asserts `want`; with `Pin::Pinned`, also each branch's
/// follow-up connection from the same client.
fn expect_path(b: &Built, what: &str, pkt: Packet, want: &Want, tally: &mut Tally) {
    let t = eval::evaluate(&b.ruleset, &b.node_addrs, pkt.clone())
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    tally.paths += 1;
    match want {
        Want::Refused(fate) => {
            assert_eq!(t.fate(), Some(*fate), "{what}: {:?}", t.branches);
            assert!(t.dnat_targets().is_empty(), "{what}: DNATed");
        }
        Want::Dnat { targets, masq, pin } => {
            let got: BTreeSet<SocketAddr> = t.dnat_targets().into_iter().collect();
            assert_eq!(&got, targets, "{what}: DNAT targets");
            assert_eq!(t.fate(), Some(Fate::Accept), "{what}: fate");
            for branch in &t.branches {
                let delivered_here = branch.route == Some(Route::Input);
                assert_eq!(
                    branch.masquerade.is_some(),
                    *masq && !delivered_here,
                    "{what}: masquerade of the branch to {:?} (route {:?})",
                    branch.dnat.as_ref().map(|d| d.target),
                    branch.route
                );
                match pin {
                    Pin::Pinned => {
                        let target = branch.dnat.as_ref().unwrap().target;
                        let next = eval::evaluate_with(
                            &b.ruleset,
                            &b.node_addrs,
                            pkt.clone(),
                            &branch.dynamic,
                        )
                        .unwrap();
                        assert_eq!(
                            next.dnat_targets(),
                            [target],
                            "{what}: the client's next connection after one to {target}"
                        );
                        assert_eq!(next.fate(), Some(Fate::Accept), "{what}: next connection");
                        tally.count("pinned");
                    }
                    Pin::Nothing => {
                        assert!(
                            branch.dynamic.values().all(BTreeMap::is_empty),
                            "{what}: pinned without affinity: {:?}",
                            branch.dynamic
                        );
                    }
                }
            }
        }
    }
}

/// Whether `--detect-local-mode` counts `src` arriving on `iif` as a pod of this node; `None`
/// when it has nothing to match for the family (then no rule asks).
fn from_local_pod(b: &Built, family: IpFamily, src: IpAddr, iif: Option<&str>) -> Option<bool> {
    let node = b.state.nodes.get(&b.settings.node_name);
    let in_first = |nets: &[ipnet::IpNet]| {
        nets.iter()
            .find(|n| IpFamily::of(&n.addr()) == family)
            .map(|n| n.contains(&src))
    };
    match b.config.detect_local_mode() {
        DetectLocalMode::ClusterCidr => in_first(&b.config.cluster_cidr),
        DetectLocalMode::NodeCidr => node.and_then(|n| in_first(&n.pod_cidrs)),
        DetectLocalMode::BridgeInterface => b
            .config
            .pod_bridge_interface
            .as_deref()
            .filter(|n| !n.is_empty())
            .map(|name| iif.unwrap_or("") == name),
        DetectLocalMode::InterfaceNamePrefix => b
            .config
            .pod_interface_name_prefix
            .as_deref()
            .filter(|n| !n.is_empty())
            .map(|prefix| iif.unwrap_or("").starts_with(prefix)),
    }
}

/// Table-driven over every fixture, every Service port and every address it answers on
/// (ClusterIP, each externalIP and LoadBalancer ingress IP, the NodePort on the node's primary
/// address), from a pod, from the node itself and from outside. The expectation is computed
/// from the objects (reference §2.3–§2.13): the endpoints each traffic policy may use (from
/// `categorize`, whose rules are unit-tested on their own) or, when that list is empty, reject
/// (no endpoints anywhere) or drop (a Local policy without local endpoints); masquerade as §2.10
/// says; loadBalancerSourceRanges dropping sources outside the ranges before anything else, LB
/// IPs only, with the LB IPs themselves allowed when the node's IP is inside a range; pods and
/// the node short-circuited to all endpoints under externalTrafficPolicy Local; and ClientIP
/// affinity sending the client's next connection where its first went.
#[test]
fn every_service_port_of_every_fixture_behaves_as_its_objects_say() {
    let mut tally = Tally::default();
    for b in all_fixtures() {
        let slices = b.state.slices_by_service();
        let node = b.state.nodes.get(&b.settings.node_name);
        let view = NodeView {
            name: &b.settings.node_name,
            zone: node.and_then(|n| n.zone.as_deref()),
        };
        // Pods arrive over the pod bridge or a pod interface, others over eth0; the
        // interface-based local detectors need one.
        let pod_iif = b
            .config
            .pod_bridge_interface
            .clone()
            .or_else(|| {
                b.config
                    .pod_interface_name_prefix
                    .as_ref()
                    .map(|p| format!("{p}0"))
            })
            .unwrap_or_else(|| "veth0".to_string());
        for svc in b.state.services.values() {
            let svc_slices = slices.get(&svc.name).map(Vec::as_slice).unwrap_or_default();
            for family in IpFamily::ALL {
                let Some(cluster_ip) = svc.cluster_ip(family) else {
                    continue;
                };
                let (pod_src, outside_src) = sources(&b, family);
                let node_ip = node.and_then(|n| n.primary_ip(family));
                let lb_ips: Vec<IpAddr> = svc
                    .load_balancer_ips
                    .iter()
                    .copied()
                    .filter(|ip| IpFamily::of(ip) == family)
                    .collect();
                // kube-proxy (pkg/proxy/serviceport.go, newBaseServiceInfo) keeps the ranges of
                // the port's family only, and none left or a zero-length prefix among them
                // means no restriction.
                let mut ranges: Vec<ipnet::IpNet> = svc
                    .load_balancer_source_ranges
                    .iter()
                    .copied()
                    .filter(|r| IpFamily::of(&r.addr()) == family)
                    .collect();
                if ranges.iter().any(|r| r.prefix_len() == 0) {
                    ranges.clear();
                }
                if !svc.load_balancer_source_ranges.is_empty() && ranges.is_empty() {
                    tally.count("source-ranges-of-no-effect");
                }
                let ranges = &ranges;
                // §2.3: sources outside the ranges are dropped; the LB IPs themselves are
                // allowed when the node's IP is inside a range.
                let lb_allows = |src: IpAddr| {
                    ranges.iter().any(|r| r.contains(&src))
                        || (node_ip.is_some_and(|n| ranges.iter().any(|r| r.contains(&n)))
                            && lb_ips.contains(&src))
                };
                let affinity = svc.session_affinity_timeout.is_some();
                // Every path pins under affinity, the Local-policy list of outside traffic too.
                let pin = if affinity { Pin::Pinned } else { Pin::Nothing };
                for port in &svc.ports {
                    let eps: Vec<_> = endpoints_for(svc_slices, port)
                        .into_iter()
                        .filter(|ep| IpFamily::of(&ep.addr) == family)
                        .collect();
                    let cat = categorize(&eps, &view);
                    let addrs = |list: &[nodeproxy::model::Endpoint<'_>]| -> BTreeSet<SocketAddr> {
                        list.iter()
                            .map(|ep| SocketAddr::new(ep.addr, ep.port))
                            .collect()
                    };
                    let cluster = addrs(&cat.cluster);
                    let local = addrs(&cat.local);
                    let internal = match svc.internal_traffic_policy {
                        TrafficPolicy::Cluster => cluster.clone(),
                        TrafficPolicy::Local => local.clone(),
                    };
                    let unserved = if cat.has_endpoints {
                        Fate::Drop
                    } else {
                        Fate::Reject
                    };
                    let served = |list: &BTreeSet<SocketAddr>, masq: bool, pin: Pin| {
                        if !cat.has_endpoints {
                            Want::Refused(Fate::Reject)
                        } else if list.is_empty() {
                            Want::Refused(unserved)
                        } else {
                            Want::Dnat {
                                targets: list.clone(),
                                masq,
                                pin,
                            }
                        }
                    };
                    let pkt = |src: IpAddr, dst: SocketAddr, from: Source| Packet {
                        src,
                        dst: dst.ip(),
                        proto: port.protocol,
                        dport: dst.port(),
                        origin: match from {
                            Source::Pod => Pod,
                            Source::Host => Host,
                            Source::Outside | Source::Vip => External,
                        },
                        iif: match from {
                            Source::Pod => Some(pod_iif.clone()),
                            Source::Outside | Source::Vip => Some("eth0".to_string()),
                            Source::Host => None,
                        },
                    };
                    let mut from: Vec<(Source, IpAddr)> =
                        vec![(Source::Pod, pod_src), (Source::Outside, outside_src)];
                    if let Some(ip) = node_ip {
                        from.push((Source::Host, ip));
                    }
                    // Whether the local-traffic detector calls a source a pod of this node.
                    let is_pod = |kind: Source, src: IpAddr| {
                        let p = pkt(src, SocketAddr::new(cluster_ip, port.port), kind);
                        from_local_pod(&b, family, src, p.iif.as_deref()) == Some(true)
                    };
                    let what = format!(
                        "{}: {} port {}/{}",
                        b.name, svc.name, port.port, port.protocol
                    );

                    // ClusterIP (§2.1, §2.7, §2.10): internalTrafficPolicy picks the list;
                    // sources the detector does not call pods are masqueraded, all of them with
                    // masquerade-all.
                    let dst = SocketAddr::new(cluster_ip, port.port);
                    for &(kind, src) in &from {
                        let p = pkt(src, dst, kind);
                        let not_pod =
                            from_local_pod(&b, family, src, p.iif.as_deref()) == Some(false);
                        let want = served(&internal, b.config.masquerade_all || not_pod, pin);
                        expect_path(
                            &b,
                            &format!("{what}: ClusterIP from {kind:?} {src}"),
                            p,
                            &want,
                            &mut tally,
                        );
                        tally.count("clusterip");
                    }

                    // externalTrafficPolicy for external addresses and NodePorts (§2.5): Cluster
                    // masquerades everyone to all endpoints; Local sends pods (unmasqueraded)
                    // and the node itself (masqueraded) to all endpoints, and everyone else to
                    // this node's endpoints with the client address kept, or drops.
                    let external_want = |kind: Source, src: IpAddr| match svc
                        .external_traffic_policy
                    {
                        TrafficPolicy::Cluster => served(&cluster, true, pin),
                        TrafficPolicy::Local if is_pod(kind, src) => served(&cluster, false, pin),
                        TrafficPolicy::Local if b.node_addrs.contains(&src) => {
                            served(&cluster, true, pin)
                        }
                        TrafficPolicy::Local => served(&local, false, pin),
                    };
                    // Outside traffic to this node's endpoints, pinned (counted, so that the
                    // sweep cannot pass without checking a Local-policy pin).
                    let count_local_pin =
                        |tally: &mut Tally, kind: Source, src: IpAddr, want: &Want| {
                            if svc.external_traffic_policy == TrafficPolicy::Local
                                && !is_pod(kind, src)
                                && !b.node_addrs.contains(&src)
                                && matches!(
                                    want,
                                    Want::Dnat {
                                        pin: Pin::Pinned,
                                        ..
                                    }
                                )
                            {
                                tally.count("pinned-local");
                            }
                        };

                    // externalIPs and LoadBalancer ingress IPs (§2.3, §2.4).
                    let vips = svc
                        .external_ips
                        .iter()
                        .map(|ip| (*ip, false))
                        .chain(lb_ips.iter().map(|ip| (*ip, true)))
                        .filter(|(ip, _)| IpFamily::of(ip) == family);
                    for (vip, is_lb) in vips {
                        let filtered = is_lb && !ranges.is_empty();
                        let dst = SocketAddr::new(vip, port.port);
                        let mut vip_from = from.clone();
                        if filtered {
                            vip_from.push((Source::Vip, vip));
                        }
                        for (kind, src) in vip_from {
                            let want = if filtered && !lb_allows(src) {
                                tally.count("source-range-dropped");
                                Want::Refused(Fate::Drop)
                            } else {
                                if filtered {
                                    tally.count("source-range-allowed");
                                }
                                if filtered && !ranges.iter().any(|r| r.contains(&src)) {
                                    tally.count("allowed-as-lb-ip");
                                }
                                external_want(kind, src)
                            };
                            count_local_pin(&mut tally, kind, src, &want);
                            let label = if is_lb { "LB IP" } else { "external IP" };
                            expect_path(
                                &b,
                                &format!("{what}: {label} {vip} from {kind:?} {src}"),
                                pkt(src, dst, kind),
                                &want,
                                &mut tally,
                            );
                            tally.count(match (kind, svc.external_traffic_policy) {
                                (Source::Pod, TrafficPolicy::Cluster) => "vip-pod-cluster",
                                (Source::Pod, TrafficPolicy::Local) => "vip-pod-local",
                                (Source::Host, TrafficPolicy::Cluster) => "vip-host-cluster",
                                (Source::Host, TrafficPolicy::Local) => "vip-host-local",
                                (_, TrafficPolicy::Cluster) => "vip-outside-cluster",
                                (_, TrafficPolicy::Local) => "vip-outside-local",
                            });
                        }
                    }

                    // The NodePort on each of the node's addresses that answer it (§2.2;
                    // every one with `all`), never filtered by source ranges.
                    let Some(node_port) = port.node_port else {
                        continue;
                    };
                    let np_addrs: Vec<IpAddr> = b
                        .node_addrs
                        .iter()
                        .copied()
                        .filter(|a| IpFamily::of(a) == family && !a.is_loopback())
                        .filter(|a| {
                            b.settings
                                .nodeport_addresses
                                .selects(*a, Some(*a) == node_ip)
                        })
                        .collect();
                    for &addr in &np_addrs {
                        let dst = SocketAddr::new(addr, node_port);
                        for &(kind, src) in &from {
                            let want = external_want(kind, src);
                            count_local_pin(&mut tally, kind, src, &want);
                            expect_path(
                                &b,
                                &format!("{what}: NodePort {dst} from {kind:?} {src}"),
                                pkt(src, dst, kind),
                                &want,
                                &mut tally,
                            );
                            tally.count("nodeport");
                            if b.settings.nodeport_addresses.all_of(family) {
                                tally.count("nodeport-all");
                            }
                            // A NodePort pin holds whichever node address the client uses next.
                            let Want::Dnat {
                                pin: Pin::Pinned, ..
                            } = want
                            else {
                                continue;
                            };
                            for &other in np_addrs.iter().filter(|&&o| o != addr) {
                                let first =
                                    eval::evaluate(&b.ruleset, &b.node_addrs, pkt(src, dst, kind))
                                        .unwrap();
                                for branch in &first.branches {
                                    let target = branch.dnat.as_ref().unwrap().target;
                                    let next = eval::evaluate_with(
                                        &b.ruleset,
                                        &b.node_addrs,
                                        pkt(src, SocketAddr::new(other, node_port), kind),
                                        &branch.dynamic,
                                    )
                                    .unwrap();
                                    assert_eq!(
                                        next.dnat_targets(),
                                        [target],
                                        "{what}: NodePort pinned via {addr} from {kind:?} {src}, \
                                         next connection via {other}"
                                    );
                                    tally.count("nodeport-pinned-across-addresses");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // What the fixtures hold today (a new fixture only adds): every path kind is exercised.
    tally.at_least("clusterip", 120);
    tally.at_least("nodeport", 45);
    for (kind, n) in [
        ("vip-pod-cluster", 10),
        ("vip-pod-local", 4),
        ("vip-host-cluster", 10),
        ("vip-host-local", 4),
        ("vip-outside-cluster", 10),
        ("vip-outside-local", 4),
        ("source-range-dropped", 5),
        ("source-range-allowed", 8),
        ("allowed-as-lb-ip", 2),
        ("source-ranges-of-no-effect", 2),
        ("pinned", 50),
        ("pinned-local", 3),
        ("nodeport-all", 10),
        ("nodeport-pinned-across-addresses", 10),
    ] {
        tally.at_least(kind, n);
    }
}

/// A pod source (inside the family's cluster CIDR when there is one, and never an endpoint)
/// and an off-cluster source, for `family`.
fn sources(b: &Built, family: IpFamily) -> (IpAddr, IpAddr) {
    let cidr = b
        .settings
        .cluster_cidrs
        .iter()
        .find(|n| IpFamily::of(&n.addr()) == family);
    match family {
        IpFamily::V4 => (
            cidr.and_then(|n| n.hosts().nth(250))
                .unwrap_or(ip("198.51.100.250")),
            ip("192.0.2.200"),
        ),
        IpFamily::V6 => (
            cidr.and_then(|n| n.hosts().nth(250))
                .unwrap_or(ip("2001:db8:a::fa")),
            ip("2001:db8:ffff:ffff::1"),
        ),
    }
}

fn explain_cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_nodeproxy"))
        .current_dir(root())
        .env_remove("NODEPROXY_CONFIG")
        .env("NODEPROXY_LOG", "warn")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn explain_prints_the_path_of_a_pod_dns_query_on_the_example_cluster() {
    let (code, out, err) = explain_cli(&[
        "explain",
        "--from-file",
        "examples/cluster.yaml",
        "--hostname-override",
        "node-a",
        "--cluster-cidr",
        "10.244.0.0/16",
        "10.244.1.5",
        "10.96.0.10:53/udp",
    ]);
    assert_eq!(code, 0, "stderr: {err}");
    for line in [
        "packet: 10.244.1.5 -> 10.96.0.10:53/udp, new connection from a pod on this node",
        "prerouting: nat-prerouting (type nat, priority -100)",
        "  [services] ip daddr . meta l4proto . th dport vmap @service-ips",
        "@service-ips: 10.96.0.10 . udp . 53 : goto pick-2  (kube-system/kube-dns:dns)",
        "DNAT candidates (2):",
        "  10.244.1.2:53  (kube-system/kube-dns:dns)",
        "  10.244.2.2:53  (kube-system/kube-dns:dns)",
        "forward: filter-forward (type filter, priority 0)",
        "verdict: accept",
        "masquerade: no",
    ] {
        assert!(out.contains(line), "missing {line:?} in:\n{out}");
    }
}

#[test]
fn explain_says_why_host_traffic_is_masqueraded_and_why_a_nodeport_is_rejected() {
    let base = [
        "explain",
        "--from-file",
        "examples/cluster.yaml",
        "--hostname-override",
        "node-a",
        "--cluster-cidr",
        "10.244.0.0/16",
    ];
    let mut args = base.to_vec();
    args.extend(["192.0.2.11", "10.96.0.10:53/udp"]);
    let (code, out, err) = explain_cli(&args);
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.contains("from this node's own processes"), "{out}");
    assert!(out.contains("output: nat-output"), "{out}");
    assert!(
        out.contains("masquerade: yes: marked by `ip daddr @cluster-ips ip saddr != 10.244.0.0/16"),
        "{out}"
    );
    let mut args = base.to_vec();
    args.extend(["--from", "external", "203.0.113.7", "192.0.2.11:30090/tcp"]);
    let (code, out, err) = explain_cli(&args);
    assert_eq!(code, 0, "stderr: {err}");
    assert!(
        out.contains("verdict: reject (ICMP port unreachable) by `reject` in reject-chain"),
        "{out}"
    );
    assert!(
        out.contains("@no-endpoint-nodeports: tcp . 30090 : goto reject-chain  (shop/checkout"),
        "{out}"
    );
    assert!(out.contains("DNAT: none"), "{out}");
}

#[test]
fn explain_rejects_bad_arguments_with_exit_2() {
    let (code, _, err) = explain_cli(&[
        "explain",
        "--from-file",
        "examples/cluster.yaml",
        "10.244.1.5",
        "[fd00::10]:53/udp",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("same address family"), "{err}");
    let (code, _, err) = explain_cli(&["explain", "10.244.1.5", "10.96.0.10:53/icmp"]);
    assert_eq!(code, 2);
    assert!(err.contains("tcp, udp or sctp"), "{err}");
    let (code, _, err) = explain_cli(&["--dry-run", "explain", "10.244.1.5", "10.96.0.10:53"]);
    assert_eq!(code, 2);
    assert!(err.contains("cannot be combined"), "{err}");
}
