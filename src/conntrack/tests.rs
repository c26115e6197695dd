//! Unit tests of the stale-flow decision and of entry parsing (no kernel).

use super::*;
use netlink_packet_core::Emitable;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn flow(dst: &str, dport: u16, reply_src: &str) -> Flow {
    Flow {
        src: ip("192.0.2.100"),
        sport: 40000,
        dst: ip(dst),
        dport,
        reply_src: ip(reply_src),
        reply_sport: 5353,
    }
}

fn dns() -> UdpService {
    UdpService {
        ips: vec![
            ip("203.0.113.11"),
            ip("203.0.113.200"),
            ip("2001:db8:ff::11"),
        ],
        port: 53,
        node_port: Some(30053),
        serving_endpoints: vec![ip("198.51.100.11"), ip("2001:db8:a::11")],
    }
}

#[test]
fn a_flow_answered_by_a_serving_endpoint_is_kept() {
    let m = StaleMatcher::new(IpFamily::V4, &[dns()]);
    assert!(!m.is_stale(&flow("203.0.113.11", 53, "198.51.100.11")));
    // externalIP / LB IP of the same service
    assert!(!m.is_stale(&flow("203.0.113.200", 53, "198.51.100.11")));
}

#[test]
fn a_flow_answered_by_a_gone_endpoint_is_stale() {
    let m = StaleMatcher::new(IpFamily::V4, &[dns()]);
    assert!(m.is_stale(&flow("203.0.113.11", 53, "198.51.100.130")));
    assert!(m.is_stale(&flow("203.0.113.200", 53, "198.51.100.130")));
}

#[test]
fn a_flow_that_was_never_natted_is_stale() {
    // Sent while the service had no endpoints: the reply source is the service IP itself.
    let m = StaleMatcher::new(IpFamily::V4, &[dns()]);
    assert!(m.is_stale(&flow("203.0.113.11", 53, "203.0.113.11")));
}

#[test]
fn other_ports_and_addresses_are_not_touched() {
    let m = StaleMatcher::new(IpFamily::V4, &[dns()]);
    assert!(!m.is_stale(&flow("203.0.113.11", 54, "198.51.100.130")));
    assert!(!m.is_stale(&flow("203.0.113.12", 53, "198.51.100.130")));
}

#[test]
fn node_ports_match_by_port_on_any_destination() {
    let m = StaleMatcher::new(IpFamily::V4, &[dns()]);
    assert!(m.is_stale(&flow("192.0.2.11", 30053, "198.51.100.130")));
    assert!(m.is_stale(&flow("192.0.2.12", 30053, "192.0.2.12")));
    assert!(!m.is_stale(&flow("192.0.2.11", 30053, "198.51.100.11")));
    assert!(!m.is_stale(&flow("192.0.2.11", 30054, "198.51.100.130")));
}

#[test]
fn a_service_without_serving_endpoints_makes_every_flow_stale() {
    let mut s = dns();
    s.serving_endpoints.clear();
    let m = StaleMatcher::new(IpFamily::V4, &[s]);
    assert!(m.is_stale(&flow("203.0.113.11", 53, "198.51.100.11")));
}

#[test]
fn addresses_of_the_other_family_are_ignored() {
    let m = StaleMatcher::new(IpFamily::V6, &[dns()]);
    assert!(!m.is_stale(&flow("203.0.113.11", 53, "198.51.100.130")));
    assert!(m.is_stale(&flow("2001:db8:ff::11", 53, "2001:db8:b::130")));
    assert!(!m.is_stale(&flow("2001:db8:ff::11", 53, "2001:db8:a::11")));
    // An IPv4 endpoint never serves an IPv6 flow, even by mistake in the input.
    let mut s = dns();
    s.serving_endpoints = vec![ip("198.51.100.11")];
    let m = StaleMatcher::new(IpFamily::V6, &[s]);
    assert!(m.is_stale(&flow("2001:db8:ff::11", 53, "2001:db8:a::11")));
}

#[test]
fn services_sharing_an_ip_and_port_keep_the_union() {
    let mut other = dns();
    other.serving_endpoints = vec![ip("198.51.100.130")];
    other.node_port = None;
    let m = StaleMatcher::new(IpFamily::V4, &[dns(), other]);
    assert!(!m.is_stale(&flow("203.0.113.11", 53, "198.51.100.11")));
    assert!(!m.is_stale(&flow("203.0.113.11", 53, "198.51.100.130")));
}

#[test]
fn no_services_means_nothing_to_dump() {
    assert!(StaleMatcher::new(IpFamily::V4, &[]).is_empty());
    assert!(
        StaleMatcher::new(
            IpFamily::V6,
            &[UdpService {
                ips: vec![ip("203.0.113.1")],
                port: 53,
                node_port: None,
                serving_endpoints: vec![],
            }]
        )
        .is_empty()
    );
}

fn tuple(src: &str, dst: &str, proto: Protocol, sport: u16, dport: u16) -> Vec<Tuple> {
    vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(ip(src)),
            IPTuple::DestinationAddress(ip(dst)),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(proto),
            ProtoTuple::SourcePort(sport),
            ProtoTuple::DestinationPort(dport),
        ]),
    ]
}

fn entry(proto: Protocol) -> Vec<ConntrackAttribute> {
    vec![
        ConntrackAttribute::CtaTupleOrig(tuple("192.0.2.100", "203.0.113.11", proto, 40000, 53)),
        ConntrackAttribute::CtaTupleReply(tuple(
            "198.51.100.11",
            "192.0.2.100",
            proto,
            5353,
            40000,
        )),
        ConntrackAttribute::CtaTimeout(30),
        ConntrackAttribute::Other(netlink_packet_core::DefaultNla::new(
            CTA_ID,
            7u32.to_be_bytes().to_vec(),
        )),
        ConntrackAttribute::Other(netlink_packet_core::DefaultNla::new(
            CTA_ZONE,
            3u16.to_be_bytes().to_vec(),
        )),
    ]
}

#[test]
fn a_udp_entry_yields_its_flow_and_the_attributes_that_identify_it() {
    let d = doomed_of(entry(Protocol::Udp)).expect("udp entry");
    assert_eq!(
        d.flow,
        Flow {
            src: ip("192.0.2.100"),
            sport: 40000,
            dst: ip("203.0.113.11"),
            dport: 53,
            reply_src: ip("198.51.100.11"),
            reply_sport: 5353,
        }
    );
    // Original tuple, id and zone; not the reply tuple or the timeout.
    let kinds: Vec<u16> = d.attrs.iter().map(netlink_packet_core::Nla::kind).collect();
    assert_eq!(kinds, vec![CTA_TUPLE_ORIG, CTA_ID, CTA_ZONE]);
    assert_eq!(
        d.flow.to_string(),
        "udp flow 192.0.2.100:40000 -> 203.0.113.11:53 (replies from 198.51.100.11:5353)"
    );
}

#[test]
fn tcp_entries_are_never_candidates() {
    assert!(doomed_of(entry(Protocol::Tcp)).is_none());
}

#[test]
fn the_raw_udp_prefilter_agrees_with_the_parser() {
    for (proto, udp) in [(Protocol::Udp, true), (Protocol::Tcp, false)] {
        let attrs = entry(proto);
        let mut buf = vec![0u8; attrs.as_slice().buffer_len()];
        attrs.as_slice().emit(&mut buf);
        assert_eq!(raw_is_udp(&buf), udp, "{proto:?}");
    }
}
