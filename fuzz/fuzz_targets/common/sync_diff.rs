//! The `sync_diff` property, shared by the fuzz target and `tests/fuzz_corpus.rs`: bytes decode
//! to a sequence of small cluster states (five Services over shared address, port and NodePort
//! pools, so keys clash; affinity, traffic policies, endpoint conditions), and for each step from
//! state `a` to state `b`, against the in-memory kernel:
//!
//! - the full path (read back or not) leaves the kernel holding exactly what a kernel that never
//!   held `a` gets for `b` (built with the same affinity slots): applying `diff(a, b)` to `a`
//!   yields `b`;
//! - the incremental path, given the Services that changed, leaves the kernel holding what the
//!   full path does, or declines without having sent anything the kernel rejects.

use std::collections::BTreeSet;
use std::fmt::Write;

use nodeproxy::config::Config;
use nodeproxy::model::{ClusterState, ServiceName};
use nodeproxy::nft::{self, FakeKernel};
use nodeproxy::ruleset::{self, Settings};
use nodeproxy::sync::{Incremental, Syncer};

const SERVICES: u8 = 5;

struct Bytes<'a> {
    data: &'a [u8],
    at: usize,
}

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        b
    }

    fn below(&mut self, n: u8) -> u8 {
        self.byte() % n
    }

    fn flag(&mut self) -> bool {
        self.byte() & 1 == 1
    }

    fn left(&self) -> bool {
        self.at < self.data.len()
    }
}

#[derive(Clone, Copy)]
struct Endpoint {
    addr: u8,
    on_node_a: bool,
    ready: bool,
    serving: bool,
    terminating: bool,
}

#[derive(Clone)]
struct Svc {
    kind: u8,
    ip: u8,
    port: u16,
    udp: bool,
    node_port: u8,
    external_ip: Option<u8>,
    lb_ip: Option<u8>,
    affinity: Option<u32>,
    etp_local: bool,
    itp_local: bool,
    endpoints: Vec<Endpoint>,
}

fn endpoint(b: &mut Bytes<'_>) -> Endpoint {
    let flags = b.byte();
    Endpoint {
        addr: b.below(8),
        on_node_a: flags & 1 == 1,
        ready: flags & 2 == 0,
        serving: flags & 4 == 0,
        terminating: flags & 8 == 8,
    }
}

fn svc(b: &mut Bytes<'_>) -> Svc {
    let flags = b.byte();
    let endpoints = (0..b.below(5)).map(|_| endpoint(b)).collect();
    Svc {
        kind: b.below(3),
        ip: b.below(6),
        port: 80 + u16::from(b.below(2)),
        udp: flags & 1 == 1,
        node_port: b.below(3),
        external_ip: (flags & 2 == 2).then(|| b.below(3)),
        lb_ip: (flags & 4 == 4).then(|| b.below(3)),
        affinity: (flags & 8 == 8).then(|| if b.flag() { 10 } else { 10800 }),
        etp_local: flags & 16 == 16,
        itp_local: flags & 32 == 32,
        endpoints,
    }
}

/// One field of one Service changed, or the Service added or removed.
fn mutate(b: &mut Bytes<'_>, state: &mut [Option<Svc>]) {
    let i = usize::from(b.below(SERVICES));
    let Some(s) = &mut state[i] else {
        state[i] = Some(svc(b));
        return;
    };
    match b.below(9) {
        0 => state[i] = None,
        1 => s.kind = b.below(3),
        2 => s.ip = b.below(6),
        3 => s.endpoints.push(endpoint(b)),
        4 => {
            if !s.endpoints.is_empty() {
                let at = usize::from(b.byte()) % s.endpoints.len();
                s.endpoints.remove(at);
            }
        }
        5 => {
            if !s.endpoints.is_empty() {
                let at = usize::from(b.byte()) % s.endpoints.len();
                s.endpoints[at] = endpoint(b);
            }
        }
        6 => s.affinity = if s.affinity.is_some() { None } else { Some(10) },
        7 => s.etp_local = !s.etp_local,
        _ => s.external_ip = if b.flag() { Some(b.below(3)) } else { None },
    }
}

fn yaml(state: &[Option<Svc>]) -> String {
    let mut y = String::from(
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nspec: {podCIDRs: [198.51.100.0/26]}\n\
         status: {addresses: [{type: InternalIP, address: 192.0.2.11}]}\n",
    );
    for (i, s) in state.iter().enumerate() {
        let Some(s) = s else { continue };
        let kind = ["ClusterIP", "NodePort", "LoadBalancer"][usize::from(s.kind)];
        let proto = if s.udp { "UDP" } else { "TCP" };
        let ip = format!("203.0.113.{}", 10 + s.ip);
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{namespace: ns, name: s{i}, \
             creationTimestamp: \"2024-01-0{}T00:00:00Z\"}}\nspec:\n  type: {kind}\n  \
             clusterIP: {ip}\n  clusterIPs: [{ip}]\n  ports: [{{name: p, protocol: {proto}, \
             port: {}, targetPort: 8080{}}}]\n",
            i + 1,
            s.port,
            if s.kind > 0 {
                format!(", nodePort: {}", 30000 + u16::from(s.node_port))
            } else {
                String::new()
            }
        );
        if let Some(e) = s.external_ip {
            let _ = writeln!(y, "  externalIPs: [198.51.100.{}]", 200 + e);
        }
        if let Some(t) = s.affinity {
            let _ = writeln!(
                y,
                "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {t}}}}}"
            );
        }
        if s.etp_local && s.kind > 0 {
            let _ = writeln!(y, "  externalTrafficPolicy: Local");
            if s.kind == 2 {
                let _ = writeln!(y, "  healthCheckNodePort: {}", 32000 + i);
            }
        }
        if s.itp_local {
            let _ = writeln!(y, "  internalTrafficPolicy: Local");
        }
        if let (Some(l), 2) = (s.lb_ip, s.kind) {
            let _ = writeln!(
                y,
                "status: {{loadBalancer: {{ingress: [{{ip: 198.51.100.{}}}]}}}}",
                210 + l
            );
        }
        let _ = write!(
            y,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{namespace: ns, \
             name: s{i}-1, labels: {{kubernetes.io/service-name: s{i}}}}}\naddressType: IPv4\n\
             ports: [{{name: p, protocol: {proto}, port: 8080}}]\nendpoints:\n"
        );
        if s.endpoints.is_empty() {
            y.push_str("  []\n");
        }
        for e in &s.endpoints {
            let _ = writeln!(
                y,
                "  - {{addresses: [198.51.100.{}], nodeName: {}, conditions: {{ready: {}, \
                 serving: {}, terminating: {}}}}}",
                1 + e.addr,
                if e.on_node_a { "node-a" } else { "node-b" },
                e.ready,
                e.serving,
                e.terminating
            );
        }
    }
    y
}

fn settings(variant: u8) -> Settings {
    let mut config = Config {
        cluster_cidr: vec!["198.51.100.0/24".parse().unwrap_or_else(|_| unreachable!())],
        ..Config::default()
    };
    match variant % 3 {
        0 => {}
        1 => {
            config.nodeport_addresses.all = true;
            config.masquerade_all = true;
        }
        _ => {
            config.nodeport_addresses.primary = false;
            config.nodeport_addresses.cidrs =
                vec!["192.0.2.0/24".parse().unwrap_or_else(|_| unreachable!())];
        }
    }
    Settings::new(&config, "node-a".to_string())
}

/// The cluster states the bytes describe (two to five), as the file reader reads them.
fn states(b: &mut Bytes<'_>) -> Vec<ClusterState> {
    let mut state: Vec<Option<Svc>> = (0..usize::from(SERVICES))
        .map(|_| if b.flag() { Some(svc(b)) } else { None })
        .collect();
    let mut out = vec![state.clone()];
    while out.len() < 5 && (out.len() < 2 || b.left()) {
        for _ in 0..=b.below(3) {
            mutate(b, &mut state);
        }
        out.push(state.clone());
    }
    out.iter()
        .map(|s| {
            let text = yaml(s);
            match nodeproxy::source::file::load_text(std::path::Path::new("fuzz.yaml"), &text) {
                Ok(loaded) => loaded.state,
                Err(e) => panic!("the generated input does not parse: {e}\n{text}"),
            }
        })
        .collect()
}

/// The Services whose object or slices differ between `a` and `b`.
fn changed(a: &ClusterState, b: &ClusterState) -> BTreeSet<ServiceName> {
    let mut out = BTreeSet::new();
    for name in a.services.keys().chain(b.services.keys()) {
        if a.services.get(name) != b.services.get(name) {
            out.insert(name.clone());
        }
    }
    for name in a.slices.keys().chain(b.slices.keys()) {
        let (sa, sb) = (a.slices.get(name), b.slices.get(name));
        if sa != sb {
            out.extend(sa.iter().chain(sb.iter()).map(|s| s.service.clone()));
        }
    }
    out
}

/// The first few chains, sets and elements by which two kernels differ.
fn differences(a: &FakeKernel, b: &FakeKernel) -> String {
    let mut out = Vec::new();
    for (k, ta) in &a.tables {
        let Some(tb) = b.tables.get(k) else {
            out.push(format!("{k:?} only in the first"));
            continue;
        };
        for (name, ca) in &ta.chains {
            if tb.chains.get(name) != Some(ca) {
                out.push(format!("{k:?}: chain {name} differs or only in the first"));
            }
        }
        for (name, sa) in &ta.sets {
            let Some(sb) = tb.sets.get(name) else {
                out.push(format!("{k:?}: set {name} only in the first"));
                continue;
            };
            for (key, e) in &sa.elements {
                if sb.elements.get(key) != Some(e) {
                    out.push(format!(
                        "{k:?}: {name}: {} {e:?} vs {:?}",
                        sa.format_key(key),
                        sb.elements.get(key)
                    ));
                }
            }
            for key in sb
                .elements
                .keys()
                .filter(|key| !sa.elements.contains_key(*key))
            {
                out.push(format!(
                    "{k:?}: {name}: {} only in the second",
                    sb.format_key(key)
                ));
            }
        }
        for name in tb.sets.keys().filter(|n| !ta.sets.contains_key(*n)) {
            out.push(format!("{k:?}: set {name} only in the second"));
        }
        for name in tb.chains.keys().filter(|n| !ta.chains.contains_key(*n)) {
            out.push(format!("{k:?}: chain {name} only in the second"));
        }
    }
    out.truncate(12);
    out.join("\n")
}

pub fn check(data: &[u8]) {
    let mut b = Bytes { data, at: 0 };
    let settings = settings(b.byte());
    let states = states(&mut b);
    let mut step = Syncer::new(FakeKernel::new());
    let mut inc = Syncer::new(FakeKernel::new());
    let first = &states[0];
    step.sync(first, &settings, false)
        .unwrap_or_else(|e| panic!("full sync of the first state: {e}"));
    inc.sync(first, &settings, false)
        .unwrap_or_else(|e| panic!("full sync of the first state: {e}"));
    for (i, pair) in states.windows(2).enumerate() {
        let (a, next) = (&pair[0], &pair[1]);
        let desired = ruleset::build(next, &settings);
        let mut fresh = FakeKernel::new();
        nft::sync(&mut fresh, desired).unwrap_or_else(|e| panic!("step {i}: fresh sync: {e}"));

        step.sync(next, &settings, i % 2 == 1)
            .unwrap_or_else(|e| panic!("step {i}: full sync: {e}"));
        assert!(
            step.kernel().tables == fresh.tables,
            "step {i}: the kernel after diff(a, b) differs from a fresh kernel given b:\n{}",
            differences(step.kernel(), &fresh)
        );

        // A restart after a clean exit: the next process adopts on the seal what it wants
        // unchanged (here: all of `next`), reads back what it does not (going back to `a`), and
        // either way ends where a fresh kernel given its state does.
        assert!(
            step.seal()
                .unwrap_or_else(|e| panic!("step {i}: seal: {e}")),
            "step {i}: only our commits, yet no seal"
        );
        let mut kernel = step.kernel().clone();
        kernel.reopen();
        let mut restarted = Syncer::new(kernel);
        let (target, expected) = if i % 2 == 0 {
            (next, fresh.clone())
        } else {
            let mut expected = FakeKernel::new();
            nft::sync(&mut expected, ruleset::build(a, &settings))
                .unwrap_or_else(|e| panic!("step {i}: fresh sync of the earlier state: {e}"));
            (a, expected)
        };
        let out = restarted
            .sync(target, &settings, false)
            .unwrap_or_else(|e| panic!("step {i}: sync after a restart: {e}"));
        if i % 2 == 0 {
            assert_eq!(out.report.tables_adopted, 2, "step {i}: {out}");
        }
        assert!(
            restarted.kernel().tables == expected.tables,
            "step {i}: the kernel after a restart differs from a fresh kernel:\n{}",
            differences(restarted.kernel(), &expected)
        );

        let changed = changed(a, next);
        match inc
            .sync_changed(&next.subset(&changed), &changed, &settings)
            .unwrap_or_else(|e| panic!("step {i}: incremental sync: {e}"))
        {
            Incremental::Done(_) => {}
            Incremental::NeedsFull(reason) => {
                assert!(
                    !reason.contains("rejected"),
                    "step {i}: the kernel rejected an incremental delta: {reason}"
                );
                inc.sync(next, &settings, false)
                    .unwrap_or_else(|e| panic!("step {i}: full sync after declining: {e}"));
            }
        }
        assert!(
            inc.kernel().tables == step.kernel().tables,
            "step {i}: the incremental path's kernel differs from the full path's (changed \
             {changed:?}):\n{}\nstates:\n{a:#?}\n{next:#?}",
            differences(inc.kernel(), step.kernel())
        );
    }
}
