//! ServiceCIDR objects (`networking.k8s.io/v1`, Kubernetes 1.33+): the ranges the API server
//! allocates ClusterIPs from, checked before they can become a drop rule.

use super::*;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1 as networking;

/// The shortest prefixes accepted. A ServiceCIDR becomes "drop traffic to an unallocated
/// address of this range": a hostile or mistaken `0.0.0.0/1` would blackhole half the world, so
/// ranges wider than any real service network (the API server's own allocator takes at most a
/// /12 of IPv4 by default and a /108 of IPv6) are refused rather than trusted.
const MIN_PREFIX_V4: u8 = 8;
const MIN_PREFIX_V6: u8 = 64;

/// The CIDRs of one ServiceCIDR, keyed by its name; a CIDR that is not a plausible service range
/// rejects the whole object (its ranges belong together: one per family).
pub fn service_cidr(obj: &networking::ServiceCIDR) -> Result<(String, Vec<IpNet>), Rejected> {
    let name = obj.metadata.name.clone().unwrap_or_default();
    let ctx = Ctx {
        kind: "ServiceCIDR",
        namespace: None,
        name: &name,
    };
    if name.is_empty() {
        return Err(ctx.reject(
            "metadata.name",
            "",
            "missing; every ServiceCIDR needs a name",
        ));
    }
    check_text(&ctx, "metadata.name", &name)?;
    let raw = obj
        .spec
        .as_ref()
        .and_then(|s| s.cidrs.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut cidrs: Vec<IpNet> = Vec::new();
    for (i, text) in raw.iter().enumerate() {
        let field = format!("spec.cidrs[{i}]");
        let Some(cidr) = parse_cidr(text) else {
            return Err(ctx.reject(
                field,
                text.as_str(),
                "not a CIDR; valid: a service range such as 10.96.0.0/12 or fd00:10:96::/108",
            ));
        };
        let addr = cidr.addr();
        let (min, special) = match cidr {
            IpNet::V4(net) => (
                MIN_PREFIX_V4,
                net.addr().is_loopback() || net.addr().is_multicast() || net.addr().is_link_local(),
            ),
            IpNet::V6(net) => (
                MIN_PREFIX_V6,
                net.addr().is_loopback()
                    || net.addr().is_multicast()
                    || net.addr().is_unicast_link_local(),
            ),
        };
        if cidr.prefix_len() < min {
            return Err(ctx.reject(
                field,
                text.as_str(),
                format!(
                    "wider than /{min}: traffic to every unallocated address of it would be \
                     dropped; valid: a service range such as 10.96.0.0/12 or fd00:10:96::/108"
                ),
            ));
        }
        if special || addr.is_unspecified() {
            return Err(ctx.reject(
                field,
                text.as_str(),
                "a loopback, multicast, link-local or unspecified range cannot hold ClusterIPs",
            ));
        }
        if cidrs.iter().any(|c| c.addr().is_ipv4() == addr.is_ipv4()) {
            return Err(ctx.reject(
                field,
                text.as_str(),
                "a second range of the same family; valid: at most one IPv4 and one IPv6 range",
            ));
        }
        cidrs.push(cidr);
    }
    Ok((name, cidrs))
}
