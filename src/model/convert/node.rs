//! The proxy's own Node: its addresses, pod CIDRs, zone label, and whether it is being
//! deleted or drained by the cluster autoscaler.

use super::*;

/// Converts a Node.
pub fn node(n: &core::Node) -> Result<Node, Rejected> {
    let name = n.metadata.name.clone().unwrap_or_default();
    let ctx = Ctx {
        kind: "Node",
        namespace: None,
        name: &name,
    };
    if name.is_empty() {
        return Err(ctx.reject("metadata.name", "", "missing; every Node needs a name"));
    }
    check_text(&ctx, "metadata.name", &name)?;
    let labels: Option<&BTreeMap<String, String>> = n.metadata.labels.as_ref();
    if let Some(zone) = labels.and_then(|l| l.get(LABEL_ZONE)) {
        check_text(&ctx, &format!("metadata.labels[\"{LABEL_ZONE}\"]"), zone)?;
    }

    let mut internal_ips = Vec::new();
    let mut external_ips = Vec::new();
    let addresses = n.status.as_ref().and_then(|s| s.addresses.as_ref());
    for (i, a) in addresses.into_iter().flatten().enumerate() {
        let list = match a.type_.as_str() {
            "InternalIP" => &mut internal_ips,
            "ExternalIP" => &mut external_ips,
            // Hostname, InternalDNS, ExternalDNS: names, not used for proxying.
            _ => continue,
        };
        list.push(ip_field(
            &ctx,
            &format!("status.addresses[{i}].address"),
            &a.address,
        )?);
    }

    let spec = n.spec.as_ref();
    let listed = spec
        .and_then(|s| s.pod_cidrs.as_deref())
        .unwrap_or_default();
    let (raw_cidrs, field): (Vec<&str>, &str) = if listed.is_empty() {
        (
            spec.and_then(|s| s.pod_cidr.as_deref())
                .filter(|c| !c.is_empty())
                .into_iter()
                .collect(),
            "spec.podCIDR",
        )
    } else {
        (listed.iter().map(String::as_str).collect(), "spec.podCIDRs")
    };
    let mut pod_cidrs = Vec::with_capacity(raw_cidrs.len());
    for (i, raw) in raw_cidrs.iter().enumerate() {
        let Some(net) = parse_cidr(raw) else {
            let path = if listed.is_empty() {
                field.to_owned()
            } else {
                format!("{field}[{i}]")
            };
            return Err(ctx.reject(
                path,
                *raw,
                "not a CIDR; valid: an IPv4 or IPv6 prefix such as 10.244.1.0/24",
            ));
        };
        pod_cidrs.push(net);
    }

    Ok(Node {
        name,
        internal_ips,
        external_ips,
        pod_cidrs,
        zone: labels
            .and_then(|l| l.get(LABEL_ZONE))
            .filter(|z| !z.is_empty())
            .cloned(),
        deleting: n.metadata.deletion_timestamp.is_some(),
        to_be_deleted: spec
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED)),
    })
}
