//! Namespace traffic lab: nodes, pods and an external client wired in network namespaces.
//!
//! Used from integration tests with `mod lab;`. A [`Lab`] builds its own set of network
//! namespaces (names unique per process and per lab, so tests may run in parallel) and removes
//! every one of them, and every process it started in them, when it is dropped — also when the
//! test panics.
//!
//! Topology (all addresses from documentation ranges):
//!
//! ```text
//!                 lan namespace: bridge br0 (no address, no route)
//!        ┌──────────────────────────┼──────────────────────────┐
//!   node-a eth0                node-b eth0                client eth0
//!   192.0.2.11/24              192.0.2.12/24              192.0.2.100/24
//!   2001:db8::11/64            2001:db8::12/64            2001:db8::100/64
//!    │          │                    │
//!  pod-a1     pod-a2               pod-b1        (veth pairs; pod /32 and /128 routed by the node)
//!  .10        .11                  .130          198.51.100.0/25 on node-a, .128/25 on node-b
//!  a::10      a::11                b::130        2001:db8:a::/64 on node-a, 2001:db8:b::/64 on node-b
//! ```
//!
//! Running: `cargo test --test lab_sanity --test traffic` as root (tests fail, never skip,
//! without root). Tools: iproute2 (`ip`, `ss`), socat, nftables, iputils-ping, coreutils.
//!
//! Safety: nothing is ever created in, connected to or changed in the namespace the tests run
//! in. Veth pairs are created inside a lab namespace with their peer placed directly into
//! another lab namespace, so not even a transient interface appears in the root namespace.

// This module is compiled into several test crates, each using only part of it.
#![allow(dead_code)]
// A test harness reports broken preconditions by panicking: that is how a test fails.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a client waits for an answer before calling it a timeout.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The LAN gateway the nodes' default routes point at. Nothing answers on it: it only exists so
/// that nodes have a default route, as real nodes do (needed to route a locally generated packet
/// to a ClusterIP before DNAT, and for proxy ARP on the pod veths).
pub const LAN_GW_V4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
pub const LAN_GW_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);

/// The link-local next hop pods use for their default route, as CNI plugins (e.g. Calico) do;
/// the node side answers for it by proxy ARP (IPv4) or owns it as a link-local address (IPv6).
const POD_GW_V4: &str = "169.254.1.1";
const POD_GW_V6: &str = "fe80::1";

/// The namespaces of a lab, by role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Ns {
    Lan,
    NodeA,
    NodeB,
    Client,
    PodA1,
    PodA2,
    PodB1,
}

impl Ns {
    /// Creation order: the LAN first, then nodes and client, then pods (which hang off nodes).
    pub const ALL: [Ns; 7] = [
        Ns::Lan,
        Ns::NodeA,
        Ns::NodeB,
        Ns::Client,
        Ns::PodA1,
        Ns::PodA2,
        Ns::PodB1,
    ];

    /// The role name; also the suffix of the namespace name and, for nodes, the Kubernetes
    /// node name used in fixtures.
    pub fn role(self) -> &'static str {
        match self {
            Ns::Lan => "lan",
            Ns::NodeA => "node-a",
            Ns::NodeB => "node-b",
            Ns::Client => "client",
            Ns::PodA1 => "pod-a1",
            Ns::PodA2 => "pod-a2",
            Ns::PodB1 => "pod-b1",
        }
    }

    /// The namespace's IPv4 address (a node's InternalIP, a pod IP, the client's address).
    pub fn v4(self) -> Ipv4Addr {
        match self {
            Ns::Lan => panic!("the lan namespace has no address"),
            Ns::NodeA => Ipv4Addr::new(192, 0, 2, 11),
            Ns::NodeB => Ipv4Addr::new(192, 0, 2, 12),
            Ns::Client => Ipv4Addr::new(192, 0, 2, 100),
            Ns::PodA1 => Ipv4Addr::new(198, 51, 100, 10),
            Ns::PodA2 => Ipv4Addr::new(198, 51, 100, 11),
            Ns::PodB1 => Ipv4Addr::new(198, 51, 100, 130),
        }
    }

    /// The namespace's IPv6 address.
    pub fn v6(self) -> Ipv6Addr {
        let last = match self {
            Ns::Lan => panic!("the lan namespace has no address"),
            Ns::NodeA => return Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x11),
            Ns::NodeB => return Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x12),
            Ns::Client => return Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x100),
            Ns::PodA1 => (0xa, 0x10),
            Ns::PodA2 => (0xa, 0x11),
            Ns::PodB1 => (0xb, 0x130),
        };
        Ipv6Addr::new(0x2001, 0xdb8, last.0, 0, 0, 0, 0, last.1)
    }

    /// The namespace's address of the given family, as an [`IpAddr`].
    pub fn addr(self, v6: bool) -> IpAddr {
        if v6 {
            IpAddr::V6(self.v6())
        } else {
            IpAddr::V4(self.v4())
        }
    }

    /// The node a pod runs on.
    fn node(self) -> Option<Ns> {
        match self {
            Ns::PodA1 | Ns::PodA2 => Some(Ns::NodeA),
            Ns::PodB1 => Some(Ns::NodeB),
            _ => None,
        }
    }
}

/// A transport protocol for servers and requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

/// Fails the test (never skips it) unless it runs as root with the tools the lab needs and can
/// create a network namespace. Every lab test calls this first, through [`Lab::new`].
pub fn require_privileges() {
    let status = std::fs::read_to_string("/proc/self/status")
        .expect("lab: cannot read /proc/self/status to check the effective uid");
    let euid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1))
        .unwrap_or("?");
    assert_eq!(
        euid, "0",
        "lab: traffic tests must run as root (effective uid is {euid}); they create network \
         namespaces. Run them as root, e.g. in the CI container; they never skip themselves."
    );
    for tool in ["ip", "socat", "ss", "nft", "ping", "timeout"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            found,
            "lab: `{tool}` is not installed (Debian: apt-get install -y iproute2 socat nftables iputils-ping)"
        );
    }
    // Probe namespace creation with a name of our own, so a lab never starts half-built because
    // of a missing capability (e.g. an unprivileged container).
    let probe = format!(
        "np{}-probe{}",
        std::process::id(),
        NEXT_LAB.fetch_add(1, Ordering::Relaxed)
    );
    let out = run(&["ip", "netns", "add", &probe]);
    let created = out.status.success();
    let _ = run(&["ip", "netns", "del", &probe]);
    assert!(
        created,
        "lab: cannot create a network namespace (`ip netns add {probe}`): {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Runs a command in the current (test) namespace and returns its output.
fn run(args: &[&str]) -> Output {
    Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("lab: cannot run {args:?}: {e}"))
}

/// Renders a command's output for an assertion message.
pub fn describe(out: &Output) -> String {
    format!(
        "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim_end(),
        String::from_utf8_lossy(&out.stderr).trim_end()
    )
}

static NEXT_LAB: AtomicUsize = AtomicUsize::new(0);

/// A set of network namespaces wired as two nodes with pods, and an external client.
pub struct Lab {
    prefix: String,
    /// Namespaces created so far, in creation order; Drop deletes exactly these.
    created: Vec<Ns>,
    servers: Vec<Child>,
}

impl Lab {
    /// Checks privileges, then builds the whole topology. Panics (failing the test) if anything
    /// cannot be set up; whatever was already created is removed by Drop during the unwind.
    pub fn new() -> Lab {
        require_privileges();
        let n = NEXT_LAB.fetch_add(1, Ordering::Relaxed);
        let mut lab = Lab {
            prefix: format!("np{}-{}", std::process::id(), n),
            created: Vec::new(),
            servers: Vec::new(),
        };
        lab.build();
        lab
    }

    /// The full name of a namespace of this lab, e.g. `np4242-0-node-a`.
    pub fn ns(&self, ns: Ns) -> String {
        format!("{}-{}", self.prefix, ns.role())
    }

    /// The node lock of nodeproxy runs in a namespace (`NODEPROXY_LOCK_FILE` for [`Lab::exec`]).
    pub fn lock_file(&self, ns: Ns) -> PathBuf {
        std::env::temp_dir().join(format!("{}.lock", self.ns(ns)))
    }

    /// The names of every namespace this lab created.
    pub fn ns_names(&self) -> Vec<String> {
        self.created.iter().map(|&ns| self.ns(ns)).collect()
    }

    /// Runs a command inside a namespace of the lab.
    pub fn exec(&self, ns: Ns, args: &[&str]) -> Output {
        let name = self.ns(ns);
        Command::new("ip")
            .args(["netns", "exec", &name])
            .args(args)
            // Each namespace is a node of its own, so each has its own node lock; the default
            // path is shared by every test running at the same time.
            .env("NODEPROXY_LOCK_FILE", self.lock_file(ns))
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("lab: cannot run {args:?} in {name}: {e}"))
    }

    /// Runs a command inside a namespace and panics with its output unless it succeeds.
    pub fn exec_ok(&self, ns: Ns, args: &[&str]) -> String {
        let out = self.exec(ns, args);
        assert!(
            out.status.success(),
            "lab: {args:?} in {} failed: {}",
            self.ns(ns),
            describe(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `ip <args>` against a namespace (`ip -n`, no extra process inside it).
    fn ip(&self, ns: Ns, args: &[&str]) {
        let name = self.ns(ns);
        let mut full = vec!["ip", "-n", name.as_str()];
        full.extend_from_slice(args);
        let out = run(&full);
        assert!(
            out.status.success(),
            "lab: {full:?} failed: {}",
            describe(&out)
        );
    }

    /// Sets `key=value` sysctls inside a namespace. Written straight to /proc/sys (which shows
    /// the writer's network namespace) so the lab needs no procps.
    fn sysctl(&self, ns: Ns, settings: &[&str]) {
        let script: Vec<String> = settings
            .iter()
            .map(|kv| {
                let (key, value) = kv.split_once('=').expect("sysctl setting is key=value");
                format!("echo {value} > /proc/sys/{}", key.replace('.', "/"))
            })
            .collect();
        self.exec_ok(ns, &["sh", "-e", "-c", &script.join("\n")]);
    }

    fn build(&mut self) {
        for ns in Ns::ALL {
            let name = self.ns(ns);
            let out = run(&["ip", "netns", "add", &name]);
            assert!(
                out.status.success(),
                "lab: ip netns add {name} failed: {}",
                describe(&out)
            );
            self.created.push(ns);
            self.ip(ns, &["link", "set", "lo", "up"]);
            // Set before any interface exists, so every interface inherits them. A new netns
            // inherits IPv4 settings from the host, so spell out what the lab relies on.
            // No DAD: addresses are usable at once, no sleeping for IPv6 to settle.
            let mut settings = vec![
                "net.ipv6.conf.all.accept_dad=0",
                "net.ipv6.conf.default.accept_dad=0",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ];
            // Only nodes route; the lan namespace is a plain bridge and pods/client are hosts.
            if matches!(ns, Ns::NodeA | Ns::NodeB) {
                settings.extend([
                    "net.ipv4.ip_forward=1",
                    "net.ipv6.conf.all.forwarding=1",
                    "net.ipv6.conf.default.forwarding=1",
                ]);
            } else {
                settings.extend(["net.ipv4.ip_forward=0", "net.ipv6.conf.all.forwarding=0"]);
            }
            self.sysctl(ns, &settings);
        }

        // The LAN: a bridge without addresses. Multicast snooping off so IPv6 neighbour
        // discovery is flooded without waiting for a querier.
        self.ip(
            Ns::Lan,
            &[
                "link",
                "add",
                "br0",
                "type",
                "bridge",
                "mcast_snooping",
                "0",
            ],
        );
        self.ip(Ns::Lan, &["link", "set", "br0", "up"]);
        for host in [Ns::NodeA, Ns::NodeB, Ns::Client] {
            let peer_ns = self.ns(host);
            // The bridge port is named after the host it leads to; the host side is eth0.
            self.ip(
                Ns::Lan,
                &[
                    "link",
                    "add",
                    host.role(),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    &peer_ns,
                ],
            );
            self.ip(
                Ns::Lan,
                &["link", "set", host.role(), "master", "br0", "up"],
            );
            let v4 = format!("{}/24", host.v4());
            let v6 = format!("{}/64", host.v6());
            self.ip(host, &["addr", "add", &v4, "dev", "eth0"]);
            self.ip(host, &["-6", "addr", "add", &v6, "dev", "eth0", "nodad"]);
            self.ip(host, &["link", "set", "eth0", "up"]);
        }

        // Nodes: a default route to the (absent) LAN router, and the other node's pod CIDRs via
        // the other node's LAN address.
        for (node, other, other_v4, other_v6) in [
            (Ns::NodeA, Ns::NodeB, "198.51.100.128/25", "2001:db8:b::/64"),
            (Ns::NodeB, Ns::NodeA, "198.51.100.0/25", "2001:db8:a::/64"),
        ] {
            let gw4 = LAN_GW_V4.to_string();
            let gw6 = LAN_GW_V6.to_string();
            let o4 = other.v4().to_string();
            let o6 = other.v6().to_string();
            self.ip(
                node,
                &["route", "add", "default", "via", &gw4, "dev", "eth0"],
            );
            self.ip(
                node,
                &["-6", "route", "add", "default", "via", &gw6, "dev", "eth0"],
            );
            self.ip(node, &["route", "add", other_v4, "via", &o4, "dev", "eth0"]);
            self.ip(
                node,
                &["-6", "route", "add", other_v6, "via", &o6, "dev", "eth0"],
            );
        }

        // Pods, CNI style: /32 and /128 on the pod's eth0, default route via a link-local next
        // hop, and a host route on the node pointing at the pod's veth.
        for pod in [Ns::PodA1, Ns::PodA2, Ns::PodB1] {
            let node = pod.node().expect("every pod has a node");
            let pod_ns = self.ns(pod);
            let veth = pod.role();
            self.ip(
                node,
                &[
                    "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", &pod_ns,
                ],
            );
            // Proxy ARP lets the node answer for the pod's 169.254.1.1 next hop without owning
            // an IPv4 address on the veth (so masquerade picks the node's LAN address). Without
            // proxy_delay=0 the kernel delays proxied answers by up to 0.8 s, randomly.
            self.sysctl(
                node,
                &[
                    &format!("net.ipv4.conf.{veth}.proxy_arp=1"),
                    &format!("net.ipv4.neigh.{veth}.proxy_delay=0"),
                ],
            );
            self.ip(
                node,
                &[
                    "-6",
                    "addr",
                    "add",
                    &format!("{POD_GW_V6}/64"),
                    "dev",
                    veth,
                    "nodad",
                ],
            );
            self.ip(node, &["link", "set", veth, "up"]);
            let p4 = pod.v4().to_string();
            let p6 = pod.v6().to_string();
            self.ip(
                node,
                &[
                    "route",
                    "add",
                    &format!("{p4}/32"),
                    "dev",
                    veth,
                    "scope",
                    "link",
                ],
            );
            self.ip(
                node,
                &["-6", "route", "add", &format!("{p6}/128"), "dev", veth],
            );

            self.ip(pod, &["addr", "add", &format!("{p4}/32"), "dev", "eth0"]);
            self.ip(
                pod,
                &[
                    "-6",
                    "addr",
                    "add",
                    &format!("{p6}/128"),
                    "dev",
                    "eth0",
                    "nodad",
                ],
            );
            self.ip(pod, &["link", "set", "eth0", "up"]);
            self.ip(
                pod,
                &["route", "add", POD_GW_V4, "dev", "eth0", "scope", "link"],
            );
            self.ip(
                pod,
                &["route", "add", "default", "via", POD_GW_V4, "dev", "eth0"],
            );
            self.ip(
                pod,
                &[
                    "-6", "route", "add", "default", "via", POD_GW_V6, "dev", "eth0",
                ],
            );
        }
    }

    /// Adds an extra address to a namespace's LAN interface (e.g. a node IP that is not a
    /// NodePort address).
    pub fn add_lan_address(&self, ns: Ns, cidr: &str) {
        let mut args = vec!["addr", "add", cidr, "dev", "eth0"];
        if cidr.contains(':') {
            args.push("nodad");
        }
        self.ip(ns, &args);
    }

    /// Starts a socat server in `ns` answering `<name> <peer address>` on `port`, over both IPv4
    /// and IPv6, and waits until both listeners are bound. Killed when the lab drops.
    pub fn spawn_server(&mut self, ns: Ns, proto: Proto, port: u16, name: &str) {
        assert!(
            !name.is_empty() && !name.contains(|c: char| c.is_whitespace() || c == ','),
            "lab: server name {name:?} must be one word without commas"
        );
        // The reply is one line: the server's name, then the source address it saw. For UDP the
        // shell first drains the datagram socat feeds it: if echo exited before socat wrote the
        // datagram, socat would die of EPIPE without sending the answer (seen ~1 in 10 runs).
        // TCP clients send nothing, so the TCP reply must not wait for input.
        let reply = match proto {
            Proto::Tcp => format!("SYSTEM:echo {name} $SOCAT_PEERADDR"),
            Proto::Udp => format!("SYSTEM:cat >/dev/null; echo {name} $SOCAT_PEERADDR"),
        };
        let listens = match proto {
            Proto::Tcp => [
                format!("TCP4-LISTEN:{port},fork,reuseaddr"),
                format!("TCP6-LISTEN:{port},fork,reuseaddr,ipv6only=1"),
            ],
            Proto::Udp => [
                format!("UDP4-RECVFROM:{port},fork"),
                format!("UDP6-RECVFROM:{port},fork,ipv6only=1"),
            ],
        };
        for listen in &listens {
            let child = Command::new("ip")
                .args(["netns", "exec", &self.ns(ns), "socat", listen, &reply])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("lab: cannot start socat {listen}: {e}"));
            self.servers.push(child);
        }
        self.wait_listening(ns, proto, port);
    }

    /// Polls `ss` until both an IPv4 and an IPv6 socket are bound on the port (bounded).
    fn wait_listening(&mut self, ns: Ns, proto: Proto, port: u16) {
        let flag = match proto {
            Proto::Tcp => "-Hltn",
            Proto::Udp => "-Hlun",
        };
        let filter = format!("sport = :{port}");
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let out = self.exec(ns, &["ss", flag, &filter]);
            let listing = String::from_utf8_lossy(&out.stdout).into_owned();
            let bound = listing.lines().filter(|l| !l.trim().is_empty()).count();
            if bound >= 2 {
                return;
            }
            // A server that died (e.g. port already taken) will never listen: say why.
            for child in &mut self.servers {
                if let Ok(Some(status)) = child.try_wait() {
                    let mut err = String::new();
                    if let Some(mut stderr) = child.stderr.take() {
                        let _ = std::io::Read::read_to_string(&mut stderr, &mut err);
                    }
                    panic!(
                        "lab: a socat server in {} exited ({status}): {}",
                        self.ns(ns),
                        err.trim()
                    );
                }
            }
            assert!(
                Instant::now() < deadline,
                "lab: no {proto:?} listener on port {port} in {} after 3 s; ss shows:\n{listing}",
                self.ns(ns)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends one request from `from` to `addr:port` and returns `(server name, peer address the
    /// server saw)`, or an error: `"connection refused"` (RST or ICMP port unreachable),
    /// `"timeout"` (no answer within [`REQUEST_TIMEOUT`]), or another socat error text.
    pub fn request(
        &self,
        from: Ns,
        proto: Proto,
        addr: IpAddr,
        port: u16,
    ) -> Result<(String, String), String> {
        self.request_from(from, None, proto, addr, port)
    }

    /// Like [`Lab::request`], from source address `src` (one of `from`'s addresses, e.g. added
    /// with [`Lab::add_lan_address`]) when given: several clients in one namespace.
    pub fn request_from(
        &self,
        from: Ns,
        src: Option<IpAddr>,
        proto: Proto,
        addr: IpAddr,
        port: u16,
    ) -> Result<(String, String), String> {
        let mut target = match (proto, addr) {
            (Proto::Tcp, IpAddr::V4(a)) => format!("TCP4:{a}:{port},connect-timeout=2"),
            (Proto::Tcp, IpAddr::V6(a)) => format!("TCP6:[{a}]:{port},connect-timeout=2"),
            (Proto::Udp, IpAddr::V4(a)) => format!("UDP4:{a}:{port}"),
            (Proto::Udp, IpAddr::V6(a)) => format!("UDP6:[{a}]:{port}"),
        };
        match src {
            Some(IpAddr::V4(s)) => target.push_str(&format!(",bind={s}")),
            Some(IpAddr::V6(s)) => target.push_str(&format!(",bind=[{s}]")),
            None => {}
        }
        // -T bounds socat's own life should this process fail to kill it.
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns(from), "socat", "-T", "5"])
            .args(["STDIO", &target])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("lab: cannot start socat client: {e}"));
        // Stdin stays open until we are done: closing it would make socat half-close and, for
        // UDP, stop waiting for the answer. UDP needs a datagram to carry the request.
        let mut stdin = child.stdin.take().expect("piped stdin");
        if proto == Proto::Udp {
            let _ = stdin.write_all(b"ping\n");
            let _ = stdin.flush();
        }
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let answer = rx.recv_timeout(REQUEST_TIMEOUT);
        let _ = child.kill();
        drop(stdin);
        let output = child.wait_with_output();
        let _ = reader.join();
        let line = match answer {
            Ok(line) => line,
            Err(_) => return Err("timeout".to_string()),
        };
        if line.trim().is_empty() {
            // EOF without an answer: socat failed; its message says why.
            let stderr = output
                .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
                .unwrap_or_default();
            return Err(classify_error(&stderr));
        }
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or_default().to_string();
        // socat prints IPv6 peers bracketed and fully expanded; normalise to the canonical form
        // so tests can compare with `Ipv6Addr::to_string()`.
        let raw = words
            .next()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let peer = raw
            .parse::<IpAddr>()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| raw.to_string());
        Ok((name, peer))
    }

    /// `nft list ruleset` of a namespace, for failure messages.
    pub fn ruleset(&self, ns: Ns) -> String {
        let out = self.exec(ns, &["nft", "list", "ruleset"]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

/// Maps socat's error text to the lab's error vocabulary.
fn classify_error(stderr: &str) -> String {
    let lower = stderr.to_lowercase();
    if lower.contains("connection refused") {
        "connection refused".to_string()
    } else if lower.contains("timed out") {
        "timeout".to_string()
    } else if lower.contains("no route to host") {
        "no route to host".to_string()
    } else if lower.contains("network is unreachable") {
        "network unreachable".to_string()
    } else {
        format!("client failed: {}", stderr.trim())
    }
}

impl Drop for Lab {
    /// Kills every process in the lab's namespaces and deletes the namespaces. Never panics
    /// (it may run during a panic's unwind): problems are reported on stderr.
    fn drop(&mut self) {
        for child in &mut self.servers {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Forked socat children, nodeproxy runs that hung, anything else started inside: all of
        // them live in our namespaces, so `ip netns pids` finds exactly the processes we started.
        for &ns in self.created.iter().rev() {
            let name = self.ns(ns);
            if let Ok(out) = Command::new("ip").args(["netns", "pids", &name]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).output();
                }
            }
        }
        for &ns in self.created.iter().rev() {
            let _ = std::fs::remove_file(self.lock_file(ns));
            let name = self.ns(ns);
            match Command::new("ip").args(["netns", "del", &name]).output() {
                Ok(out) if out.status.success() => {}
                Ok(out) => eprintln!("lab: ip netns del {name} failed: {}", describe(&out)),
                Err(e) => eprintln!("lab: cannot run ip netns del {name}: {e}"),
            }
        }
    }
}
