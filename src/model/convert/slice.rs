//! EndpointSlices: the slice's ports, its endpoints (first address only, like kube-proxy),
//! their conditions, node, zone and topology hints, each field checked.

use super::*;

/// Converts an EndpointSlice. `Ok(None)` for slices kube-proxy does not use (see
/// [`ignored_slice_reason`]).
///
/// A port without a number is skipped, not rejected: kube-proxy skips it too (a nil port is
/// reserved to mean "all ports" and is not implemented), and the other ports remain usable.
/// Likewise an endpoint without any address is skipped. An address that is not an IP of the
/// slice's family rejects the whole slice, since the controller never writes one and the slice
/// is then not trustworthy.
pub fn endpoint_slice(s: &discovery::EndpointSlice) -> Result<Option<EndpointSlice>, Rejected> {
    endpoint_slice_noting(s, &mut Vec::new())
}

/// A field report for something left out of an object that is otherwise used.
pub(super) fn dropped_report(mut report: Rejected) -> Rejected {
    report
        .reason
        .push_str(" (left out; the rest of the object is used)");
    report
}

/// [`endpoint_slice`], pushing onto `dropped` a report for each endpoint left out while the
/// rest of the slice is used (one at a special address).
pub fn endpoint_slice_noting(
    s: &discovery::EndpointSlice,
    dropped: &mut Vec<Rejected>,
) -> Result<Option<EndpointSlice>, Rejected> {
    let name = names("EndpointSlice", &s.metadata)?;
    let ctx = Ctx {
        kind: "EndpointSlice",
        namespace: Some(&name.namespace),
        name: &name.name,
    };
    if ignored_slice_reason(s).is_some() {
        return Ok(None);
    }

    let family = match s.address_type.as_str() {
        "IPv4" => IpFamily::V4,
        "IPv6" => IpFamily::V6,
        other => {
            return Err(ctx.reject(
                "addressType",
                other,
                "unknown address type; valid: IPv4, IPv6, FQDN",
            ));
        }
    };

    let service_name = s
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(LABEL_SERVICE_NAME))
        .map(String::as_str)
        .unwrap_or_default();
    if service_name.is_empty() {
        return Err(ctx.reject(
            format!("metadata.labels[\"{LABEL_SERVICE_NAME}\"]"),
            service_name,
            "missing; valid: the name of the Service this slice belongs to",
        ));
    }
    check_text(
        &ctx,
        format_args!("metadata.labels[\"{LABEL_SERVICE_NAME}\"]"),
        service_name,
    )?;
    let service = ServiceName {
        namespace: name.namespace.clone(),
        name: service_name.to_owned(),
    };

    let mut ports = Vec::new();
    for (i, p) in s.ports.iter().flatten().enumerate() {
        // No port means "all ports" for a selector-less Service, which kube-proxy skips too;
        // a port of 0 is invalid like 65536 (the API server refuses both).
        let Some(number) = p.port else {
            continue;
        };
        if let Some(port_name) = &p.name {
            check_text(&ctx, format_args!("ports[{i}].name"), port_name)?;
        }
        let protocol = protocol(
            &ctx,
            format_args!("ports[{i}].protocol"),
            p.protocol.as_deref(),
        )?;
        let port = port_number(&ctx, format_args!("ports[{i}].port"), number)?;
        ports.push(SlicePort {
            name: p.name.clone().unwrap_or_default(),
            protocol,
            port,
        });
    }

    let mut endpoints = Vec::with_capacity(s.endpoints.len());
    for (i, ep) in s.endpoints.iter().enumerate() {
        let Some(raw) = ep.addresses.first() else {
            continue;
        };
        let field = Path(|f: &mut fmt::Formatter<'_>| write!(f, "endpoints[{i}].addresses[0]"));
        let addr = ip_field(&ctx, field, raw)?;
        if let Err(report) = routable(&ctx, field, raw, addr) {
            dropped.push(dropped_report(report));
            continue;
        }
        if IpFamily::of(&addr) != family {
            return Err(ctx.reject(
                field.to_string(),
                raw.as_str(),
                format!(
                    "an {} address in a slice of addressType {}; valid: {} addresses only",
                    IpFamily::of(&addr),
                    s.address_type,
                    s.address_type
                ),
            ));
        }
        let cond = ep.conditions.as_ref();
        let conditions = Conditions {
            ready: cond.and_then(|c| c.ready).unwrap_or(true),
            serving: cond.and_then(|c| c.serving).unwrap_or(true),
            terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
        };
        let hints = ep.hints.as_ref();
        if let Some(node_name) = &ep.node_name {
            check_text(&ctx, format_args!("endpoints[{i}].nodeName"), node_name)?;
        }
        if let Some(zone) = &ep.zone {
            check_text(&ctx, format_args!("endpoints[{i}].zone"), zone)?;
        }
        for (j, z) in hints
            .and_then(|h| h.for_zones.as_ref())
            .into_iter()
            .flatten()
            .enumerate()
        {
            check_text(
                &ctx,
                format_args!("endpoints[{i}].hints.forZones[{j}].name"),
                &z.name,
            )?;
        }
        for (j, n) in hints
            .and_then(|h| h.for_nodes.as_ref())
            .into_iter()
            .flatten()
            .enumerate()
        {
            check_text(
                &ctx,
                format_args!("endpoints[{i}].hints.forNodes[{j}].name"),
                &n.name,
            )?;
        }
        endpoints.push(SliceEndpoint {
            addr,
            conditions,
            node_name: ep
                .node_name
                .as_deref()
                .filter(|n| !n.is_empty())
                .map(Box::from),
            zone: ep.zone.as_deref().filter(|z| !z.is_empty()).map(Box::from),
            hints: Hints::new(
                hints
                    .and_then(|h| h.for_zones.as_ref())
                    .map(|z| z.iter().map(|z| z.name.clone()).collect())
                    .unwrap_or_default(),
                hints
                    .and_then(|h| h.for_nodes.as_ref())
                    .map(|n| n.iter().map(|n| n.name.clone()).collect())
                    .unwrap_or_default(),
            ),
        });
    }

    Ok(Some(EndpointSlice {
        name,
        service,
        family,
        ports,
        endpoints,
    }))
}
