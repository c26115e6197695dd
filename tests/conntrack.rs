//! Kernel tests of the UDP conntrack reconciler: entries inserted over ctnetlink in a fresh
//! network namespace (with `conntrack -L` as the oracle), and a lab traffic test where a UDP
//! client that keeps its source port sticks to a gone endpoint until the reconciler runs.
//! Needs root; fails (never skips) without it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod lab;

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::process::Command;
use std::time::Duration;

use common::netns::in_netns;
use lab::{Lab, Ns, Proto, describe};
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol, Tuple,
};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterProtoFamily};
use netlink_sys::{Socket, protocols::NETLINK_NETFILTER};
use nodeproxy::conntrack::{UdpService, reconcile_udp};
use nodeproxy::model::IpFamily;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// One entry to insert: original `src:sport -> dst:dport`, replies from `reply_src:reply_sport`.
#[derive(Clone, Copy)]
struct Entry {
    proto: Protocol,
    src: IpAddr,
    sport: u16,
    dst: IpAddr,
    dport: u16,
    reply_src: IpAddr,
    reply_sport: u16,
}

fn udp(src: &str, sport: u16, dst: &str, dport: u16, reply: &str, rport: u16) -> Entry {
    Entry {
        proto: Protocol::Udp,
        src: ip(src),
        sport,
        dst: ip(dst),
        dport,
        reply_src: ip(reply),
        reply_sport: rport,
    }
}

fn tuple(proto: Protocol, src: IpAddr, dst: IpAddr, sport: u16, dport: u16) -> Vec<Tuple> {
    vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(src),
            IPTuple::DestinationAddress(dst),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(proto),
            ProtoTuple::SourcePort(sport),
            ProtoTuple::DestinationPort(dport),
        ]),
    ]
}

/// Inserts entries over ctnetlink (IPCTNL_MSG_CT_NEW), 200 per send, checking every ack.
fn insert(entries: &[Entry]) {
    let mut sock = Socket::new(NETLINK_NETFILTER).unwrap();
    sock.bind_auto().unwrap();
    let mut seq = 0u32;
    for chunk in entries.chunks(200) {
        let mut buf = Vec::new();
        for e in chunk {
            seq += 1;
            let family = match e.src {
                IpAddr::V4(_) => NetfilterProtoFamily::IPv4,
                IpAddr::V6(_) => NetfilterProtoFamily::IPv6,
            };
            let mut hdr = NetlinkHeader::default();
            hdr.flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK;
            hdr.sequence_number = seq;
            let attrs = vec![
                ConntrackAttribute::CtaTupleOrig(tuple(e.proto, e.src, e.dst, e.sport, e.dport)),
                ConntrackAttribute::CtaTupleReply(tuple(
                    e.proto,
                    e.reply_src,
                    e.src,
                    e.reply_sport,
                    e.sport,
                )),
                ConntrackAttribute::CtaTimeout(300),
            ];
            let mut m = NetlinkMessage::new(
                hdr,
                NetlinkPayload::from(NetfilterMessage::new(
                    NetfilterHeader::new(family, 0, 0),
                    ConntrackMessage::New(attrs),
                )),
            );
            m.finalize();
            let at = buf.len();
            buf.resize(at + m.buffer_len(), 0);
            m.serialize(&mut buf[at..]);
        }
        sock.send(&buf, 0).unwrap();
        let mut acks = 0;
        while acks < chunk.len() {
            let mut rbuf = Vec::with_capacity(1 << 16);
            let n = sock.recv(&mut rbuf, 0).unwrap();
            let mut pos = 0;
            while pos + 16 <= n {
                let len = u32::from_ne_bytes(rbuf[pos..pos + 4].try_into().unwrap()) as usize;
                let ty = u16::from_ne_bytes(rbuf[pos + 4..pos + 6].try_into().unwrap());
                assert_eq!(ty, 2, "expected an ack");
                let code = i32::from_ne_bytes(rbuf[pos + 16..pos + 20].try_into().unwrap());
                assert_eq!(code, 0, "conntrack insert failed: errno {}", -code);
                acks += 1;
                pos += (len + 3) & !3;
            }
        }
    }
}

/// `conntrack -L` of one family, sorted lines without the timer column.
fn listing(family: &str) -> Vec<String> {
    let out = Command::new("conntrack")
        .args(["-L", "-f", family])
        .output()
        .expect("conntrack is installed (apt-get install -y conntrack)");
    assert!(out.status.success(), "conntrack -L: {}", describe(&out));
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            // "udp 17 299 src=… " → drop the countdown, which changes while the test runs.
            let mut w: Vec<&str> = l.split_whitespace().collect();
            if w.len() > 2 {
                w.remove(2);
            }
            w.join(" ")
        })
        .collect();
    lines.sort();
    lines
}

fn count(family: &str) -> usize {
    listing(family).len()
}

fn has(lines: &[String], needle: &str) -> bool {
    lines.iter().any(|l| l.contains(needle))
}

#[test]
fn only_stale_udp_entries_are_deleted_in_both_families() {
    in_netns(|| {
        let mut tcp = udp(
            "192.0.2.100",
            40001,
            "203.0.113.11",
            53,
            "198.51.100.130",
            5353,
        );
        tcp.proto = Protocol::Tcp;
        insert(&[
            // stale: answered by an endpoint the service no longer has
            udp(
                "192.0.2.100",
                40000,
                "203.0.113.11",
                53,
                "198.51.100.130",
                5353,
            ),
            // kept: answered by a serving endpoint
            udp(
                "192.0.2.101",
                40000,
                "203.0.113.11",
                53,
                "198.51.100.11",
                5353,
            ),
            // kept: TCP is never flushed
            tcp,
            // kept: another port of the same IP
            udp(
                "192.0.2.100",
                40002,
                "203.0.113.11",
                54,
                "198.51.100.130",
                5353,
            ),
            // stale: never NATed (sent while the service had no endpoints)
            udp("192.0.2.102", 40000, "203.0.113.11", 53, "203.0.113.11", 53),
            // stale: NodePort answered by a gone endpoint
            udp(
                "192.0.2.103",
                40000,
                "192.0.2.11",
                30053,
                "198.51.100.130",
                5353,
            ),
            // kept: NodePort answered by a serving endpoint
            udp(
                "192.0.2.104",
                40000,
                "192.0.2.11",
                30053,
                "198.51.100.11",
                5353,
            ),
            // IPv6: stale and kept
            udp(
                "2001:db8::100",
                40000,
                "2001:db8:ff::11",
                53,
                "2001:db8:b::130",
                5353,
            ),
            udp(
                "2001:db8::101",
                40000,
                "2001:db8:ff::11",
                53,
                "2001:db8:a::11",
                5353,
            ),
        ]);
        // An entry in a non-default conntrack zone is only found with its zone.
        let out = Command::new("conntrack")
            .args([
                "-I",
                "-p",
                "udp",
                "-s",
                "192.0.2.105",
                "-d",
                "203.0.113.11",
                "--sport",
                "40000",
                "--dport",
                "53",
                "-r",
                "198.51.100.130",
                "-q",
                "192.0.2.105",
                "--reply-port-src",
                "5353",
                "--reply-port-dst",
                "40000",
                "-t",
                "300",
                "--zone",
                "7",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "conntrack -I: {}", describe(&out));
        assert_eq!(count("ipv4"), 8);
        assert_eq!(count("ipv6"), 2);

        let services = [UdpService {
            ips: vec![ip("203.0.113.11"), ip("2001:db8:ff::11")],
            port: 53,
            node_port: Some(30053),
            serving_endpoints: vec![ip("198.51.100.11"), ip("2001:db8:a::11")],
        }];
        assert_eq!(reconcile_udp(IpFamily::V4, &services).unwrap(), 4);
        let v4 = listing("ipv4");
        assert_eq!(v4.len(), 4, "{v4:#?}");
        assert!(has(&v4, "src=192.0.2.101 "), "{v4:#?}");
        assert!(has(&v4, "tcp "), "{v4:#?}");
        assert!(has(&v4, "dport=54 "), "{v4:#?}");
        assert!(has(&v4, "src=192.0.2.104 "), "{v4:#?}");
        // IPv6 untouched by the IPv4 pass.
        assert_eq!(count("ipv6"), 2);

        assert_eq!(reconcile_udp(IpFamily::V6, &services).unwrap(), 1);
        let v6 = listing("ipv6");
        assert_eq!(v6.len(), 1, "{v6:#?}");
        assert!(has(&v6, "src=2001:db8::101 "), "{v6:#?}");

        // Idempotent.
        assert_eq!(reconcile_udp(IpFamily::V4, &services).unwrap(), 0);
        assert_eq!(reconcile_udp(IpFamily::V6, &services).unwrap(), 0);
    });
}

#[test]
fn a_large_table_is_streamed_and_deleted_in_batches() {
    in_netns(|| {
        // 20 000 TCP entries (skipped without parsing) and 6 000 UDP entries, 2 500 of them
        // stale: far more than one dump batch or one delete batch.
        let mut entries = Vec::new();
        for i in 0..20_000u32 {
            let mut e = udp("192.0.2.1", 0, "203.0.113.11", 53, "198.51.100.130", 5353);
            e.proto = Protocol::Tcp;
            e.src = IpAddr::from([
                10,
                1,
                u16::try_from(i).unwrap().to_be_bytes()[0],
                u16::try_from(i).unwrap().to_be_bytes()[1],
            ]);
            e.sport = 1024 + (i % 50_000) as u16;
            entries.push(e);
        }
        for i in 0..6_000u32 {
            let reply = if i < 2_500 {
                "198.51.100.130"
            } else {
                "198.51.100.11"
            };
            let mut e = udp("192.0.2.1", 0, "203.0.113.11", 53, reply, 5353);
            e.src = IpAddr::from([
                10,
                2,
                u16::try_from(i).unwrap().to_be_bytes()[0],
                u16::try_from(i).unwrap().to_be_bytes()[1],
            ]);
            e.sport = 2000 + u16::try_from(i).unwrap();
            entries.push(e);
        }
        insert(&entries);
        assert_eq!(count("ipv4"), 26_000);
        let services = [UdpService {
            ips: vec![ip("203.0.113.11")],
            port: 53,
            node_port: None,
            serving_endpoints: vec![ip("198.51.100.11")],
        }];
        let t = std::time::Instant::now();
        assert_eq!(reconcile_udp(IpFamily::V4, &services).unwrap(), 2_500);
        eprintln!("reconciled 26 000 entries in {:?}", t.elapsed());
        let left = listing("ipv4");
        assert_eq!(left.len(), 23_500);
        assert!(!has(&left, "udp 17 src=10.2.0.0 "), "stale entry left");
    });
}

// ---- lab traffic test ----

const NODEPROXY: &str = env!("CARGO_BIN_EXE_nodeproxy");
const CLUSTER_CIDR: &str = "198.51.100.0/24,2001:db8:a::/47";
const CLUSTER_IP: &str = "203.0.113.40";

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/traffic/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

/// Programs both nodes once from `nodes.yaml` and one fixture.
fn program(lab: &Lab, fixture_name: &str) {
    let nodes = fixture("nodes.yaml");
    let svc = fixture(fixture_name);
    for node in [Ns::NodeA, Ns::NodeB] {
        let args = [
            "timeout",
            "30",
            NODEPROXY,
            "--once",
            "--hostname-override",
            node.role(),
            "--cluster-cidr",
            CLUSTER_CIDR,
            "--from-file",
            &nodes,
            "--from-file",
            &svc,
        ];
        let out = lab.exec(node, &args);
        assert!(
            out.status.success(),
            "nodeproxy {fixture_name} on {}: {}",
            node.role(),
            describe(&out)
        );
    }
}

/// Runs `f` on a thread that has entered the named network namespace (`ip netns` name).
fn in_named_netns<R: Send + 'static>(name: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let path = format!("/run/netns/{name}");
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
            .unwrap_or_else(|e| panic!("setns {path}: {e}"));
        f()
    })
    .join()
    .unwrap_or_else(|p| std::panic::resume_unwind(p))
}

/// Sends one datagram to the ClusterIP from the client's fixed port and returns the name of
/// the server that answered, or `None` after a timeout.
fn ask(sock: &UdpSocket, what: &str) -> Option<String> {
    let to = SocketAddr::new(ip(CLUSTER_IP), 53);
    sock.send_to(format!("{what}\n").as_bytes(), to).unwrap();
    let mut buf = [0u8; 512];
    match sock.recv_from(&mut buf) {
        Ok((n, from)) => {
            assert_eq!(from, to, "the reply must come from the ClusterIP (un-DNAT)");
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            text.split_whitespace().next().map(str::to_owned)
        }
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            None
        }
        Err(e) => panic!("recv: {e}"),
    }
}

#[test]
fn a_udp_client_keeping_its_port_follows_a_replaced_endpoint_only_after_reconciliation() {
    let mut lab = Lab::new();
    lab.spawn_server(Ns::PodA2, Proto::Udp, 5353, "a2");
    lab.spawn_server(Ns::PodB1, Proto::Udp, 5353, "b1");
    program(&lab, "ctk-a.yaml");

    // The client socket lives in pod-a1 and keeps source port 40000 for the whole test.
    let sock = in_named_netns(&lab.ns(Ns::PodA1), || {
        let s = UdpSocket::bind("0.0.0.0:40000").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s
    });
    let rules = |lab: &Lab| lab.ruleset(Ns::NodeA);
    assert_eq!(
        ask(&sock, "first").as_deref(),
        Some("a2"),
        "{}",
        rules(&lab)
    );

    // The endpoint moves from pod-a2 to pod-b1.
    program(&lab, "ctk-b.yaml");
    // Without reconciliation the conntrack entry still DNATs to the old endpoint: this is what
    // makes the test meaningful.
    assert_eq!(
        ask(&sock, "stale").as_deref(),
        Some("a2"),
        "the old conntrack entry should still pin the flow to pod-a2{}",
        rules(&lab)
    );

    let services = vec![UdpService {
        ips: vec![ip(CLUSTER_IP)],
        port: 53,
        node_port: None,
        serving_endpoints: vec![Ns::PodB1.addr(false)],
    }];
    let svc = services.clone();
    let deleted = in_named_netns(&lab.ns(Ns::NodeA), move || {
        reconcile_udp(IpFamily::V4, &svc).unwrap()
    });
    assert_eq!(deleted, 1, "exactly the client's flow is stale");

    assert_eq!(
        ask(&sock, "fresh").as_deref(),
        Some("b1"),
        "after reconciliation the next datagram must reach the new endpoint{}",
        rules(&lab)
    );
    // The new flow is answered by a serving endpoint: nothing more to delete.
    let deleted = in_named_netns(&lab.ns(Ns::NodeA), move || {
        reconcile_udp(IpFamily::V4, &services).unwrap()
    });
    assert_eq!(deleted, 0);
}
