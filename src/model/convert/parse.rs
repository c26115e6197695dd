//! Address and CIDR parsing as the API server accepts them (leading zeros included), for the
//! conversion and the configuration alike.

use super::*;

/// Parses an IP address the way Kubernetes' `ParseIPSloppy` does (leading zeros in IPv4 octets
/// are decimal), and returns IPv4-mapped IPv6 addresses as IPv4. Surrounding whitespace is not
/// accepted: the API never writes it and Go's parser rejects it.
pub fn parse_ip(raw: &str) -> Option<IpAddr> {
    let ip = match raw.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => parse_ip_leading_zeros(raw)?,
    };
    Some(match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    })
}

/// The legacy forms Rust's strict parser refuses: `010.000.000.001`, and the same as the
/// trailing dotted quad of an IPv6 address.
pub(super) fn parse_ip_leading_zeros(raw: &str) -> Option<IpAddr> {
    match raw.rfind(':') {
        None => parse_v4_sloppy(raw).map(IpAddr::V4),
        Some(colon) => {
            let (head, quad) = raw.split_at(colon + 1);
            let v4 = parse_v4_sloppy(quad)?;
            format!("{head}{v4}").parse().ok()
        }
    }
}

pub(super) fn parse_v4_sloppy(raw: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = raw.split('.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let digits = part.trim_start_matches('0');
        *octet = if digits.is_empty() {
            0
        } else {
            digits.parse().ok()?
        };
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Ipv4Addr::from(octets))
}

/// Parses a CIDR like `ParseCIDRSloppy`: surrounding spaces are trimmed (they appear in
/// hand-written `loadBalancerSourceRanges`), leading zeros are decimal, and host bits are
/// cleared, so `192.0.2.7/24` is `192.0.2.0/24`.
pub fn parse_cidr(raw: &str) -> Option<ipnet::IpNet> {
    let (addr, prefix) = raw.trim().split_once('/')?;
    if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let prefix: u8 = prefix.parse().ok()?;
    let addr = match addr.parse::<IpAddr>() {
        Ok(ip) => ip,
        Err(_) => parse_ip_leading_zeros(addr)?,
    };
    ipnet::IpNet::new(addr, prefix).ok().map(|n| n.trunc())
}
