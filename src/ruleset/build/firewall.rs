//! `loadBalancerSourceRanges`: traffic to a LoadBalancer IP port of a Service with source ranges
//! is dropped unless its source is in one of the ranges.
//!
//! Data-driven like the rest (DESIGN §3): two static chains and two sets, whatever the number of
//! services. `firewall-ips` holds `LB IP . protocol . port` of every filtered service port;
//! `firewall-allow` is a set of concatenated ranges `LB IP . protocol . port . source range`
//! (`flags interval`, the kernel's pipapo backend). One rule decides:
//!
//! ```text
//! ip daddr . meta l4proto . th dport @firewall-ips
//!     ip daddr . meta l4proto . th dport . ip saddr != @firewall-allow drop
//! ```
//!
//! It runs in filter chains at priority -110 (before DNAT at -100, while the destination is
//! still the LB IP) on prerouting and output, for new connections only. kube-proxy's per-service
//! `firewall-<hash>` chains with anonymous sets cost a chain-graph re-validation per change; here
//! a service's ranges are elements.
//!
//! Only LB IPs are filtered: NodePorts and externalIPs are not (a KEP non-goal, as upstream).
//! When the node's own IP is inside one of the ranges, the LB IPs themselves are allowed sources
//! too: with "VIP-like" load balancers, node → LB IP traffic can come back with the LB IP as
//! source (kube-proxy does the same).

use ipnet::IpNet;

use super::{
    Claims, Contested, Elements, Origin, base, chain, element, jump, keyed, service_key, set,
};
use crate::model::{ClusterState, IpFamily};
use crate::ruleset::names;
use crate::ruleset::{Atom, Atoms, ChainType, Hook, KeyField, SetKind, Stmt, Table, Verdict};

use super::Settings;

/// Before DNAT (-100): the destination is still the LB IP. kube-proxy uses the same priority.
const PRIO_PRE_DNAT: i32 = -110;

/// Adds the firewall sets, chains and elements to `table`.
pub(super) fn add(
    state: &ClusterState,
    settings: &Settings,
    family: IpFamily,
    claims: &Claims<'_>,
    table: &mut Table,
    contested: &mut Contested,
) {
    let mut ips = Elements::new();
    let mut allow = Elements::new();
    let node_ip = state
        .nodes
        .get(&settings.node_name)
        .and_then(|n| n.primary_ip(family));
    for svc in state.services.values() {
        if svc.load_balancer_source_ranges.is_empty() {
            continue;
        }
        let lb_ips: Vec<_> = svc
            .load_balancer_ips
            .iter()
            .copied()
            .filter(|ip| IpFamily::of(ip) == family)
            .collect();
        if lb_ips.is_empty() {
            continue;
        }
        // kube-proxy's rule (pkg/proxy/serviceport.go, newBaseServiceInfo): only the ranges of
        // this family count; if none is left, or one is a zero-length prefix (`0.0.0.0/0`,
        // "allow any"), the port is not restricted in this family. An IPv4 LB IP with only
        // IPv6 ranges is therefore open to every IPv4 client, not closed to all of them.
        let mut ranges: Vec<IpNet> = svc
            .load_balancer_source_ranges
            .iter()
            .copied()
            .filter(|net| IpFamily::of(&net.addr()) == family)
            .map(|net| net.trunc())
            .collect();
        if ranges.is_empty() || ranges.iter().any(|net| net.prefix_len() == 0) {
            continue;
        }
        if node_ip.is_some_and(|ip| ranges.iter().any(|r| r.contains(&ip))) {
            ranges.extend(lb_ips.iter().map(|ip| IpNet::from(*ip)));
        }
        // The kernel refuses overlapping ranges in one set; merged ranges allow the same
        // sources.
        let ranges = IpNet::aggregate(&ranges);
        for port in &svc.ports {
            let origin = Origin::new(svc.port_name(port));
            // An LB IP another Service keeps (its ClusterIP, say) is not this one's to filter.
            for lb in lb_ips
                .iter()
                .filter(|lb| claims.keeps(&svc.name, **lb, port.protocol, port.port))
            {
                let key = [
                    Atom::Addr(*lb),
                    Atom::Proto(port.protocol),
                    Atom::Port(port.port),
                ];
                let packed = Atoms::new(&key);
                for range in &ranges {
                    let k = packed.then(Atom::Net(*range));
                    allow.push(keyed(k, None, &origin));
                }
                ips.push(element(&key, None, &origin));
            }
        }
    }

    // Static objects go before the per-endpoint-count ones (`pick-<k>`…), which come and go:
    // the kernel lists objects in creation order, and a table that was converged from another
    // state must list exactly like one loaded cold.
    let set_at = position_after(
        table.sets.iter().map(|s| s.name.as_str()),
        names::HAIRPIN_CONNECTIONS,
    )
    .unwrap_or(table.sets.len());
    let chain_at = position_after(
        table.chains.iter().map(|c| c.name.as_str()),
        names::REJECT_CHAIN,
    )
    .unwrap_or(table.chains.len());
    let mut sets = Vec::new();
    let mut chains = Vec::new();
    sets.push(set(
        names::FIREWALL_IPS,
        "LB IP . protocol . port of services with loadBalancerSourceRanges",
        service_key(),
        None,
        ips,
        contested,
    ));
    let mut allowed_key = service_key();
    allowed_key.push(KeyField::Saddr);
    let mut allowed = set(
        names::FIREWALL_ALLOW,
        "LB IP . protocol . port . allowed source range (loadBalancerSourceRanges)",
        allowed_key.clone(),
        None,
        allow,
        contested,
    );
    allowed.kind = SetKind::Interval;
    sets.push(allowed);

    let check = vec![Stmt::CtStateNew, jump(names::FIREWALL_CHECK)];
    chains.push(chain(
        names::FILTER_PREROUTING_PRE_DNAT,
        "loadBalancerSourceRanges of traffic arriving at this node, before DNAT",
        base(ChainType::Filter, Hook::Prerouting, PRIO_PRE_DNAT),
        vec![check.clone()],
    ));
    chains.push(chain(
        names::FILTER_OUTPUT_PRE_DNAT,
        "loadBalancerSourceRanges of this node's own traffic, before DNAT",
        base(ChainType::Filter, Hook::Output, PRIO_PRE_DNAT),
        vec![check],
    ));
    chains.push(chain(
        names::FIREWALL_CHECK,
        "drop traffic to LB IPs with source ranges from sources outside them",
        None,
        vec![vec![
            Stmt::InSet {
                key: service_key(),
                set: names::FIREWALL_IPS.to_string(),
            },
            Stmt::NotInSet {
                key: allowed_key,
                set: names::FIREWALL_ALLOW.to_string(),
            },
            Stmt::Verdict(Verdict::Drop),
        ]],
    ));
    table.sets.splice(set_at..set_at, sets);
    table.chains.splice(chain_at..chain_at, chains);
}

/// The index just after `name` in `names`, if it is there.
fn position_after<'a>(mut names: impl Iterator<Item = &'a str>, name: &str) -> Option<usize> {
    names.position(|n| n == name).map(|i| i + 1)
}
