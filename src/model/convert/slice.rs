//! EndpointSlices: the slice's ports, its endpoints (first address only, like kube-proxy),
//! their conditions, node, zone and topology hints, each field checked.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

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
    endpoint_slice_noting(s, &mut Vec::new(), &mut NameTable::default())
}

/// What the conversion reads of an EndpointSlice. One conversion serves k8s-openapi's type (the
/// watch, and file items that need it) and the file reader's decoding of a list item's text
/// (`source::file::slice`), which borrows each endpoint's address and node from the text
/// instead of allocating k8s-openapi's strings for them and freeing them again after the
/// conversion: the endpoints are most of an input's objects.
pub trait SliceObject {
    type Endpoint: EndpointObject;
    fn metadata(&self) -> &ObjectMeta;
    /// `addressType`, empty when absent (as k8s-openapi reads it).
    fn address_type(&self) -> &str;
    fn ports(&self) -> &[discovery::EndpointPort];
    fn endpoints(&self) -> &[Self::Endpoint];
}

/// What the conversion reads of one endpoint of a slice.
pub trait EndpointObject {
    /// `addresses[0]`; kube-proxy reads no other.
    fn first_address(&self) -> Option<&str>;
    fn conditions(&self) -> Option<&discovery::EndpointConditions>;
    fn node_name(&self) -> Option<&str>;
    fn zone(&self) -> Option<&str>;
    fn hints(&self) -> Option<&discovery::EndpointHints>;
}

impl SliceObject for discovery::EndpointSlice {
    type Endpoint = discovery::Endpoint;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn address_type(&self) -> &str {
        &self.address_type
    }

    fn ports(&self) -> &[discovery::EndpointPort] {
        self.ports.as_deref().unwrap_or_default()
    }

    fn endpoints(&self) -> &[discovery::Endpoint] {
        &self.endpoints
    }
}

impl EndpointObject for discovery::Endpoint {
    fn first_address(&self) -> Option<&str> {
        self.addresses.first().map(String::as_str)
    }

    fn conditions(&self) -> Option<&discovery::EndpointConditions> {
        self.conditions.as_ref()
    }

    fn node_name(&self) -> Option<&str> {
        self.node_name.as_deref()
    }

    fn zone(&self) -> Option<&str> {
        self.zone.as_deref()
    }

    fn hints(&self) -> Option<&discovery::EndpointHints> {
        self.hints.as_ref()
    }
}

/// A field report for something left out of an object that is otherwise used.
pub(super) fn dropped_report(mut report: Rejected) -> Rejected {
    report
        .reason
        .push_str(" (left out; the rest of the object is used)");
    report
}

/// [`endpoint_slice`], pushing onto `dropped` a report for each endpoint left out while the
/// rest of the slice is used (one at a special address), and sharing the endpoints' node and
/// zone through `table`.
pub fn endpoint_slice_noting(
    s: &impl SliceObject,
    dropped: &mut Vec<Rejected>,
    table: &mut NameTable,
) -> Result<Option<EndpointSlice>, Rejected> {
    let name = names("EndpointSlice", s.metadata())?;
    let ctx = Ctx {
        kind: "EndpointSlice",
        namespace: Some(name.namespace()),
        name: name.name(),
    };
    if ignored_slice_reason(s).is_some() {
        return Ok(None);
    }

    let address_type = s.address_type();
    let family = match address_type {
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
        .metadata()
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
    let service = ServiceName::new(name.namespace(), service_name);

    // Sized up front: a vector grown by `push` holds four ports (128 bytes for one port's 32),
    // kept for as long as the model holds the slice.
    let mut ports = Vec::with_capacity(s.ports().len());
    for (i, p) in s.ports().iter().enumerate() {
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

    let mut endpoints = Vec::with_capacity(s.endpoints().len());
    for (i, ep) in s.endpoints().iter().enumerate() {
        let Some(raw) = ep.first_address() else {
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
                raw,
                format!(
                    "an {} address in a slice of addressType {address_type}; valid: \
                     {address_type} addresses only",
                    IpFamily::of(&addr),
                ),
            ));
        }
        let cond = ep.conditions();
        let conditions = Conditions {
            ready: cond.and_then(|c| c.ready).unwrap_or(true),
            serving: cond.and_then(|c| c.serving).unwrap_or(true),
            terminating: cond.and_then(|c| c.terminating).unwrap_or(false),
        };
        let hints = ep.hints();
        let node_name = ep.node_name();
        let zone = ep.zone();
        if let Some(node_name) = node_name {
            check_text(&ctx, format_args!("endpoints[{i}].nodeName"), node_name)?;
        }
        if let Some(zone) = zone {
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
            locality: Locality::with_hints(
                table.locality(
                    node_name.filter(|n| !n.is_empty()),
                    zone.filter(|z| !z.is_empty()),
                ),
                Hints::new(
                    hints
                        .and_then(|h| h.for_zones.as_ref())
                        .map(|z| z.iter().map(|z| z.name.clone()).collect())
                        .unwrap_or_default(),
                    hints
                        .and_then(|h| h.for_nodes.as_ref())
                        .map(|n| n.iter().map(|n| n.name.clone()).collect())
                        .unwrap_or_default(),
                ),
            ),
        });
    }

    Ok(Some(EndpointSlice {
        name,
        service,
        family,
        ports: ports.into_boxed_slice(),
        endpoints: endpoints.into_boxed_slice(),
    }))
}
