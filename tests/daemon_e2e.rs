//! End to end through the running daemon: the health-check node ports of
//! `externalTrafficPolicy: Local` Services seen from another host, the UDP conntrack reconciler
//! seen by clients that keep their source port, and `/healthz` following the Node's lifecycle.
//!
//! The lab tests (`tests/lab`) run the fake API server (`tests/fakeapi`) and the real binary
//! inside node-a's namespace, as `tests/daemon_restart.rs` does; the Node lifecycle test needs no
//! traffic and runs in a namespace of its own, as `tests/daemon.rs` does. Every wait polls up to
//! `common::daemon::DEADLINE`; nothing asserts how long anything took. Root is required: without
//! it the tests fail, they never skip.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod fakeapi;
mod lab;

use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::daemon::{Daemon, HttpAnswer, get, http_get, wait_for};
use common::netns::{in_named_netns, in_netns};
use fakeapi::{FakeApi, Kind, node, service, slice};
use lab::{Lab, Ns, Proto};
use serde_json::{Value, json};

const CLUSTER_CIDR: &str = "198.51.100.0/24,2001:db8:a::/47";
const DAEMON_ARGS: &[&str] = &[
    "--hostname-override",
    "node-a",
    "--cluster-cidr",
    CLUSTER_CIDR,
];

/// A scratch directory (lock file, daemon log), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("nodeproxy-e2e-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The fake API server and the daemon, both in the namespace of the thread that started them.
/// Fields drop in order: the daemon (its log printed if the test is failing) before the API
/// server, the API server before its runtime.
struct Node {
    daemon: Daemon,
    api: FakeApi,
    _rt: tokio::runtime::Runtime,
    _dir: Scratch,
}

impl Node {
    /// Starts the fake API server, lets `populate` fill it, starts the daemon with `args` and
    /// waits for its first successful sync.
    fn start(test: &str, args: &[&str], populate: impl FnOnce(&FakeApi)) -> Node {
        let dir = Scratch::new(test);
        // Worker threads are created here, so they live in the caller's namespace too.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let api = rt.block_on(FakeApi::start());
        populate(&api);
        let daemon = Daemon::start(api.kubeconfig(), &dir.0, "daemon", args);
        let node = Node {
            daemon,
            api,
            _rt: rt,
            _dir: dir,
        };
        wait_for("the daemon's first sync", || {
            node.daemon
                .last_sync()
                .filter(|&t| t > 0.0)
                .ok_or("no successful sync yet")
        });
        node
    }

    /// The value of a counter or gauge line of `/metrics` (name and labels exactly as printed).
    fn metric(&self, series: &str) -> Option<f64> {
        let (_, text) = get(self.daemon.metrics, "/metrics")?;
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }
}

/// node-a and node-b with their lab addresses and pod CIDRs.
fn lab_nodes(api: &FakeApi) {
    for (name, ip, cidr) in [
        ("node-a", "192.0.2.11", "198.51.100.0/25"),
        ("node-b", "192.0.2.12", "198.51.100.128/25"),
    ] {
        api.apply(
            Kind::Node,
            json!({"metadata": {"name": name},
                   "spec": {"podCIDRs": [cidr]},
                   "status": {"addresses": [{"type": "InternalIP", "address": ip}]}}),
        );
    }
}

/// An IPv4 EndpointSlice with one ready endpoint, the pod `pod` running on node `node_name`.
fn one_endpoint_slice(
    namespace: &str,
    service: &str,
    protocol: &str,
    port: u16,
    pod: Ns,
    node_name: &str,
) -> Value {
    json!({"metadata": {"namespace": namespace, "name": format!("{service}-1"),
                        "labels": {"kubernetes.io/service-name": service}},
           "addressType": "IPv4",
           "ports": [{"name": "p", "protocol": protocol, "port": port}],
           "endpoints": [{"addresses": [pod.v4().to_string()], "conditions": {"ready": true},
                          "nodeName": node_name}]})
}

// ---------------------------------------------------------------------------------------------
// Health-check node ports
// ---------------------------------------------------------------------------------------------

const HC_PORT: u16 = 30500;
const HC_PORT_MOVED: u16 = 30501;

/// A LoadBalancer Service with `externalTrafficPolicy: Local` and health-check node port `hc`.
fn local_lb_service(hc: u16) -> Value {
    json!({"metadata": {"namespace": "shop", "name": "front"},
           "spec": {"type": "LoadBalancer",
                    "clusterIP": "203.0.113.70", "clusterIPs": ["203.0.113.70"],
                    "externalTrafficPolicy": "Local", "healthCheckNodePort": hc,
                    "ports": [{"name": "p", "protocol": "TCP", "port": 80,
                               "targetPort": 8080, "nodePort": 30080}]},
           "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.200"}]}}})
}

/// A GET on node-a's primary address and `port`, from the external client's namespace (as a
/// load balancer's health checker would).
fn check_from_client(lab: &Lab, port: u16) -> std::io::Result<HttpAnswer> {
    let addr = SocketAddr::new(Ns::NodeA.addr(false), port);
    in_named_netns(&lab.ns(Ns::Client), || http_get(addr, "/"))
}

/// Polls the health-check port `port` from the client until it answers `code`.
fn wait_code(lab: &Lab, port: u16, code: u16) -> HttpAnswer {
    wait_for(
        &format!("health-check port {port} answers {code}"),
        || match check_from_client(lab, port) {
            Ok(a) if a.code == code => Ok(a),
            other => Err(other),
        },
    )
}

fn refused(r: &std::io::Result<HttpAnswer>) -> bool {
    matches!(r, Err(e) if e.kind() == ErrorKind::ConnectionRefused)
}

/// Asserts a health-check answer completely: status, weight header, content type, and the JSON
/// body field for field (kube-proxy's `hcPayload`: nothing more, nothing less).
fn assert_health_check(a: &HttpAnswer, code: u16, local_endpoints: u64) {
    assert_eq!(a.code, code, "{a:?}");
    assert_eq!(
        a.header("X-Load-Balancing-Endpoint-Weight"),
        Some(local_endpoints.to_string().as_str()),
        "{a:?}"
    );
    assert_eq!(a.header("Content-Type"), Some("application/json"), "{a:?}");
    let body: Value = serde_json::from_str(&a.body)
        .unwrap_or_else(|e| panic!("the body is not JSON ({e}): {a:?}"));
    assert_eq!(
        body,
        json!({"service": {"namespace": "shop", "name": "front"},
               "localEndpoints": local_endpoints,
               "serviceProxyHealthy": true}),
        "{a:?}"
    );
}

#[test]
fn health_check_node_port_follows_endpoints_port_changes_and_deletion() {
    let lab = Lab::new();
    in_named_netns(&lab.ns(Ns::NodeA), || {
        let node = Node::start("hcnp", DAEMON_ARGS, |api| {
            lab_nodes(api);
            api.apply(Kind::Service, local_lb_service(HC_PORT));
            api.apply(
                Kind::EndpointSlice,
                one_endpoint_slice("shop", "front", "TCP", 8080, Ns::PodA1, "node-a"),
            );
        });

        // One local ready endpoint: healthy, weight 1.
        let a = wait_code(&lab, HC_PORT, 200);
        assert_health_check(&a, 200, 1);

        // The endpoint moves to node-b: no local endpoint, 503, weight 0.
        node.api.apply(
            Kind::EndpointSlice,
            one_endpoint_slice("shop", "front", "TCP", 8080, Ns::PodB1, "node-b"),
        );
        let a = wait_code(&lab, HC_PORT, 503);
        assert_health_check(&a, 503, 0);

        // The Service's health-check node port changes: the old port closes, the new one
        // answers for the same Service.
        node.api
            .apply(Kind::Service, local_lb_service(HC_PORT_MOVED));
        let a = wait_for("the old port is closed and the new one answers", || {
            let old = check_from_client(&lab, HC_PORT);
            let new = check_from_client(&lab, HC_PORT_MOVED);
            match new {
                Ok(a) if refused(&old) => Ok(a),
                new => Err(format!("old port: {old:?}; new port: {new:?}")),
            }
        });
        assert_health_check(&a, 503, 0);
        // The new port follows endpoint changes in place.
        node.api.apply(
            Kind::EndpointSlice,
            one_endpoint_slice("shop", "front", "TCP", 8080, Ns::PodA1, "node-a"),
        );
        let a = wait_code(&lab, HC_PORT_MOVED, 200);
        assert_health_check(&a, 200, 1);

        // The Service is deleted: its port closes.
        assert!(node.api.delete(Kind::Service, "shop", "front"));
        wait_for("the health-check port is closed", || {
            let r = check_from_client(&lab, HC_PORT_MOVED);
            if refused(&r) { Ok(()) } else { Err(r) }
        });
        assert!(refused(&check_from_client(&lab, HC_PORT)));
        drop(node);
    });
    drop(lab);
}

// ---------------------------------------------------------------------------------------------
// UDP conntrack reconciler
// ---------------------------------------------------------------------------------------------

const DNS_IP: &str = "203.0.113.53";
const DNS_PORT: u16 = 53;
const DNS_NODE_PORT: u16 = 30053;
const DNS_TARGET_PORT: u16 = 5353;

fn dns_service() -> Value {
    json!({"metadata": {"namespace": "kube-system", "name": "dns"},
           "spec": {"type": "NodePort", "clusterIP": DNS_IP, "clusterIPs": [DNS_IP],
                    "ports": [{"name": "p", "protocol": "UDP", "port": DNS_PORT,
                               "targetPort": DNS_TARGET_PORT, "nodePort": DNS_NODE_PORT}]}})
}

/// A UDP client socket bound to a fixed port in namespace `ns`, sending to `to`.
struct UdpClient {
    sock: UdpSocket,
    to: SocketAddr,
    what: &'static str,
}

impl UdpClient {
    fn new(lab: &Lab, ns: Ns, port: u16, to: SocketAddr, what: &'static str) -> UdpClient {
        let sock = in_named_netns(&lab.ns(ns), || {
            let s = UdpSocket::bind(("0.0.0.0", port)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            s
        });
        UdpClient { sock, to, what }
    }

    /// Sends one datagram and returns the name of the responder that answered through the address
    /// asked, or why none did. An answer that comes late is read by a later call: harmless,
    /// since callers only poll for a responder's name and every answer names the responder that
    /// really sent it.
    fn ask(&self) -> Result<String, String> {
        self.sock
            .send_to(b"ping\n", self.to)
            .map_err(|e| format!("{}: send: {e}", self.what))?;
        let mut buf = [0u8; 512];
        match self.sock.recv_from(&mut buf) {
            // An answer the old endpoint sends after the reconciler deleted its flow's entry
            // is not un-NATed: it arrives from the endpoint's own address, and a real client
            // (e.g. a DNS resolver) drops it. So does this one; answers that count come from
            // the address asked.
            Ok((_, from)) if from != self.to => Err(format!(
                "{}: an answer from {from}, not from {} (late, after its flow was deleted)",
                self.what, self.to
            )),
            Ok((n, _)) => {
                let text = String::from_utf8_lossy(&buf[..n]);
                Ok(text
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_owned())
            }
            Err(e) => Err(format!("{}: no answer: {e}", self.what)),
        }
    }

    /// Polls until `name` answers; any other responder answering fails the test, unless it is
    /// in `tolerated`.
    fn wait_answer(&self, name: &str, tolerated: &[&str]) {
        wait_for(
            &format!("{} is answered by {name}", self.what),
            || match self.ask() {
                Ok(n) if n == name => Ok(()),
                Ok(n) => {
                    assert!(
                        tolerated.contains(&n.as_str()),
                        "{}: answered by {n}, expected {name}",
                        self.what
                    );
                    Err(format!("answered by {n}"))
                }
                Err(e) => Err(e),
            },
        );
    }
}

/// `nft list table ip nodeproxy` in the calling thread's namespace, or "" without the table.
fn table() -> String {
    let out = Command::new("nft")
        .args(["list", "table", "ip", "nodeproxy"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn udp_clients_keeping_their_port_follow_a_replaced_endpoint() {
    let mut lab = Lab::new();
    // A stays up after it is replaced: the stale flow would keep being answered by it.
    lab.spawn_server(Ns::PodA2, Proto::Udp, DNS_TARGET_PORT, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Udp, DNS_TARGET_PORT, "b1");
    let lab = lab;
    let (a, b) = (Ns::PodA2.v4().to_string(), Ns::PodB1.v4().to_string());
    in_named_netns(&lab.ns(Ns::NodeA), || {
        let node = Node::start("udp", DAEMON_ARGS, |api| {
            lab_nodes(api);
            api.apply(Kind::Service, dns_service());
            api.apply(
                Kind::EndpointSlice,
                one_endpoint_slice(
                    "kube-system",
                    "dns",
                    "UDP",
                    DNS_TARGET_PORT,
                    Ns::PodA2,
                    "node-a",
                ),
            );
        });
        // Nothing is sent before the rules are in place: a datagram to the ClusterIP before
        // that would create an un-NATed entry, which is not the case under test.
        wait_for("the Service and endpoint A are programmed", || {
            let t = table();
            if t.contains(DNS_IP) && t.contains(&a) {
                Ok(())
            } else {
                Err(t)
            }
        });

        // Through the ClusterIP from a pod, and through the NodePort from outside the cluster
        // (masqueraded), each from one fixed source port for the whole test.
        let cluster_ip: IpAddr = DNS_IP.parse().unwrap();
        let pod = UdpClient::new(
            &lab,
            Ns::PodA1,
            40000,
            SocketAddr::new(cluster_ip, DNS_PORT),
            "pod-a1 -> ClusterIP",
        );
        let external = UdpClient::new(
            &lab,
            Ns::Client,
            40001,
            SocketAddr::new(Ns::NodeA.addr(false), DNS_NODE_PORT),
            "client -> NodePort",
        );
        pod.wait_answer("a2", &[]);
        external.wait_answer("a2", &[]);
        assert_eq!(
            node.metric("kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv4\"}")
                .unwrap_or(0.0),
            0.0,
            "nothing was stale yet"
        );

        // Endpoint A is replaced by B. Until the daemon has synced, A still answers; after
        // that only the reconciler can move the flows: their conntrack entries still DNAT to A,
        // and every datagram refreshes them.
        node.api.apply(
            Kind::EndpointSlice,
            one_endpoint_slice(
                "kube-system",
                "dns",
                "UDP",
                DNS_TARGET_PORT,
                Ns::PodB1,
                "node-b",
            ),
        );
        wait_for("endpoint B replaces A in the rules", || {
            let t = table();
            if t.contains(&b) && !t.contains(&a) {
                Ok(())
            } else {
                Err(t)
            }
        });
        pod.wait_answer("b1", &["a2"]);
        external.wait_answer("b1", &["a2"]);
        // Exactly the two clients' flows were stale.
        wait_for("the two deleted entries are counted", || {
            match node
                .metric("kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv4\"}")
            {
                Some(2.0) => Ok(()),
                other => Err(other),
            }
        });
        drop(node);
    });
    drop(lab);
}

// ---------------------------------------------------------------------------------------------
// Node lifecycle and /healthz
// ---------------------------------------------------------------------------------------------

/// `/healthz` or `/livez` on the daemon: the status code and the parsed JSON body.
fn health(d: &Daemon, path: &str) -> Result<(u16, Value), String> {
    let (code, body) = get(d.healthz, path).ok_or_else(|| format!("{path} does not answer"))?;
    let json = serde_json::from_str(&body).map_err(|e| format!("{path}: {e}: {body}"))?;
    Ok((code, json))
}

/// Polls `/healthz` until it answers `code`, then checks its body and that `/livez` answers 200.
fn wait_healthz(d: &Daemon, code: u16, node_eligible: bool) {
    let (_, body) = wait_for(&format!("/healthz answers {code}"), || {
        health(d, "/healthz").and_then(|(c, b)| {
            if c == code {
                Ok((c, b))
            } else {
                Err(format!("{c} {b}"))
            }
        })
    });
    assert_eq!(body["nodeEligible"], json!(node_eligible), "{body}");
    // The rules are fresh whatever the Node: the proxy itself is healthy.
    assert_eq!(body["healthy"], json!(true), "{body}");
    let (livez, body) = health(d, "/livez").unwrap();
    assert_eq!(livez, 200, "/livez must not follow the Node: {body}");
    assert!(body.get("nodeEligible").is_none(), "{body}");
}

fn tainted_node(taints: Value) -> Value {
    let mut n = node("node-a", "192.0.2.10");
    n["spec"]["taints"] = taints;
    n
}

#[test]
fn healthz_follows_the_nodes_deletion_and_autoscaler_taint_livez_does_not() {
    in_netns(|| {
        let out = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .output()
            .unwrap();
        assert!(out.status.success(), "ip link set lo up: {out:?}");
        let node_a = Node::start(
            "node-lifecycle",
            &["--hostname-override", "node-a"],
            |api| {
                api.apply(Kind::Node, node("node-a", "192.0.2.10"));
                api.apply(Kind::Service, service("ns", "web", "10.96.0.10", 80));
                api.apply(
                    Kind::EndpointSlice,
                    slice("ns", "web-1", "web", &["10.244.0.5"], 80),
                );
            },
        );
        let d = &node_a.daemon;
        wait_healthz(d, 200, true);

        // The cluster autoscaler is about to remove the node.
        node_a.api.apply(
            Kind::Node,
            tainted_node(json!([{"key": "ToBeDeletedByClusterAutoscaler",
                                 "value": "1700000000", "effect": "NoSchedule"}])),
        );
        wait_healthz(d, 503, false);

        // It changed its mind; an unrelated taint does not matter.
        node_a.api.apply(
            Kind::Node,
            tainted_node(json!([{"key": "example.com/maintenance", "effect": "NoSchedule"}])),
        );
        wait_healthz(d, 200, true);

        // The Node is being deleted.
        let mut deleting = node("node-a", "192.0.2.10");
        deleting["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
        node_a.api.apply(Kind::Node, deleting);
        wait_healthz(d, 503, false);

        let (_, metrics) = get(d.metrics, "/metrics").unwrap();
        for series in [
            "kubeproxy_proxy_healthz_total{code=\"200\"}",
            "kubeproxy_proxy_healthz_total{code=\"503\"}",
            "kubeproxy_proxy_livez_total{code=\"200\"}",
        ] {
            assert!(metrics.contains(series), "{series} missing:\n{metrics}");
        }
        assert!(
            !metrics.contains("kubeproxy_proxy_livez_total{code=\"503\"}"),
            "{metrics}"
        );
        drop(node_a);
    });
}
