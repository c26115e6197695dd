//! Conversion from Kubernetes API objects to the model, with validation.
//!
//! This is the only place that reads k8s-openapi types. Every check here exists so that nothing
//! downstream has to cope with a malformed object: an object that fails a check becomes a
//! [`Rejected`] naming the object, the field and what would be valid, and is left out.
//!
//! Conventions, chosen to read objects the way kube-proxy (Go) does:
//! - A Go zero value means "absent": `nodePort: 0`, `healthCheckNodePort: 0`, `protocol: ""`,
//!   `externalTrafficPolicy: ""` and so on behave exactly as if the field were not written,
//!   because the API server's JSON cannot tell them apart either.
//! - IP addresses are parsed "sloppily" like `netutils.ParseIPSloppy`: IPv4 octets with leading
//!   zeros are read as decimal, and an IPv4-mapped IPv6 address (`::ffff:192.0.2.1`) is an IPv4
//!   address, as Go's `net.IP` and the API's own validation treat it. What is stored is always the
//!   canonical [`IpAddr`].
//! - Objects labelled `service.kubernetes.io/service-proxy-name` or
//!   `service.kubernetes.io/headless` are ignored, whatever their kind: kube-proxy's informers
//!   select against both labels for Services and EndpointSlices alike.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;

use super::{
    Conditions, EndpointSlice, Hints, IpFamily, Locality, NameTable, Node, Protocol, Rejected,
    Service, ServiceName, ServicePort, SliceEndpoint, SlicePort, TrafficPolicy, Uid,
};

/// Objects with this label belong to another proxy.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Set by the EndpointSlice controller on the slices of headless Services.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Names the Service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// The Node label that topology hints are matched against.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
/// The taint cluster-autoscaler puts on a Node it is about to remove.
pub const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";

const DEFAULT_AFFINITY_TIMEOUT: u32 = 10800;
const MAX_AFFINITY_TIMEOUT: u32 = 86400;

/// Builds [`Rejected`] reports for one object, whose name it writes out only when it rejects
/// something: formatted up front, it was two `format!`s per Service and per EndpointSlice on
/// every load and every watch event (with an endpoint's address parsed twice, 4 % of a sealed
/// `--once` re-apply's instructions at 10k Services × 10 endpoints, callgrind).
struct Ctx<'a> {
    kind: &'static str,
    /// `None` for a cluster-scoped object.
    namespace: Option<&'a str>,
    name: &'a str,
}

/// Where in the object a checked value is (`spec.ports[0].port`), written out only when a
/// rejection names it: the endpoints of 10k slices formatted their paths 250,000 times per
/// load before (5 % of a `--once` re-apply's instructions, callgrind).
trait Field: fmt::Display + Copy {}
impl<T: fmt::Display + Copy> Field for T {}

/// A [`Field`] written by a closure, for a path used more than once.
#[derive(Clone, Copy)]
struct Path<F>(F);

impl<F: Fn(&mut fmt::Formatter<'_>) -> fmt::Result> fmt::Display for Path<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        (self.0)(f)
    }
}

impl Ctx<'_> {
    fn object(&self) -> String {
        match self.namespace {
            Some(ns) => format!("{} {ns}/{}", self.kind, self.name),
            None => format!("{} {}", self.kind, self.name),
        }
    }

    fn reject(
        &self,
        field: impl Into<String>,
        value: impl Into<String>,
        reason: impl Into<String>,
    ) -> Rejected {
        Rejected {
            object: self.object(),
            field: field.into(),
            value: value.into(),
            reason: reason.into(),
        }
    }
}

/// Rejects text that no Kubernetes name, label value or zone can hold: control characters
/// (they would reach kernel comments, `--dry-run`, `explain` and logs) or more than 253 bytes.
/// The API server's validation is stricter still; a proxy does not rely on it (files, old API
/// servers).
fn check_text(ctx: &Ctx, field: impl Field, raw: &str) -> Result<(), Rejected> {
    const MAX: usize = 253;
    if raw.chars().any(char::is_control) {
        return Err(ctx.reject(
            field.to_string(),
            raw,
            "contains a control character; valid: a Kubernetes name (letters, digits, '-', '.')",
        ));
    }
    if raw.len() > MAX {
        return Err(ctx.reject(
            field.to_string(),
            raw,
            format!(
                "{} bytes long; valid: at most {MAX} (the longest Kubernetes name)",
                raw.len()
            ),
        ));
    }
    Ok(())
}

/// Why kube-proxy (and so nodeproxy) does not proxy this Service, or `None` if it does. Checked
/// before any validation, so that an ignored Service is never reported as invalid.
pub fn ignored_service_reason(svc: &core::Service) -> Option<&'static str> {
    if let Some(reason) = ignored_by_labels(&svc.metadata) {
        return Some(reason);
    }
    let spec = svc.spec.as_ref()?;
    if spec.type_.as_deref() == Some("ExternalName") {
        return Some("type ExternalName is resolved by DNS, not proxied");
    }
    match first_cluster_ip(spec) {
        None => Some("headless Service (no ClusterIP) is not proxied"),
        Some("None") => Some("headless Service (clusterIP None) is not proxied"),
        Some(_) => None,
    }
}

/// Why this EndpointSlice is not used, or `None` if it is.
pub fn ignored_slice_reason(slice: &impl SliceObject) -> Option<&'static str> {
    if let Some(reason) = ignored_by_labels(slice.metadata()) {
        return Some(reason);
    }
    if slice.address_type() == "FQDN" {
        return Some("addressType FQDN is not proxied");
    }
    None
}

fn ignored_by_labels(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Option<&'static str> {
    let labels = meta.labels.as_ref()?;
    if labels.contains_key(LABEL_SERVICE_PROXY_NAME) {
        return Some("labelled service.kubernetes.io/service-proxy-name: owned by another proxy");
    }
    if labels.contains_key(LABEL_HEADLESS) {
        return Some("labelled service.kubernetes.io/headless: headless, not proxied");
    }
    None
}

/// `spec.clusterIPs[0]`, or `spec.clusterIP` when the list is absent; `None` when neither is set.
fn first_cluster_ip(spec: &core::ServiceSpec) -> Option<&str> {
    match spec.cluster_ips.as_deref() {
        Some([first, ..]) if !first.is_empty() => Some(first.as_str()),
        _ => spec.cluster_ip.as_deref().filter(|ip| !ip.is_empty()),
    }
}

/// What an address of a Service or endpoint must never be, whatever the API server allowed:
/// the class it falls in, or `None` for an ordinary address.
///
/// A ClusterIP of 127.0.0.1 turns every loopback connection on the node into a DNAT to the
/// Service; an unspecified, broadcast or multicast destination is not a connection's; link-local
/// addresses (169.254.0.0/16, fe80::/10) are per-link and include the cloud metadata endpoint.
pub fn special_address(ip: &IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(a) if a.is_unspecified() || a.octets()[0] == 0 => {
            Some("unspecified (0.0.0.0/8)")
        }
        IpAddr::V4(a) if a.is_loopback() => Some("loopback (127.0.0.0/8)"),
        IpAddr::V4(a) if a.is_broadcast() => Some("broadcast (255.255.255.255)"),
        IpAddr::V4(a) if a.is_multicast() => Some("multicast (224.0.0.0/4)"),
        IpAddr::V4(a) if a.is_link_local() => Some("link-local (169.254.0.0/16)"),
        IpAddr::V6(a) if a.is_unspecified() => Some("unspecified (::)"),
        IpAddr::V6(a) if a.is_loopback() => Some("loopback (::1)"),
        IpAddr::V6(a) if a.is_multicast() => Some("multicast (ff00::/8)"),
        IpAddr::V6(a) if a.segments()[0] & 0xffc0 == 0xfe80 => Some("link-local (fe80::/10)"),
        _ => None,
    }
}

/// [`ip_field`] for an address that must also not be [`special_address`].
fn routable_ip_field(ctx: &Ctx, field: impl Field, raw: &str) -> Result<IpAddr, Rejected> {
    let ip = ip_field(ctx, field, raw)?;
    routable(ctx, field, raw, ip)
}

/// `ip` (read from `raw`), unless it is a special address no Service can be reached at.
fn routable(ctx: &Ctx, field: impl Field, raw: &str, ip: IpAddr) -> Result<IpAddr, Rejected> {
    match special_address(&ip) {
        None => Ok(ip),
        Some(class) => Err(ctx.reject(
            field.to_string(),
            raw,
            format!("a {class} address; valid: an address a Service can be reached at"),
        )),
    }
}

/// Converts a Service. `Ok(None)` for Services kube-proxy does not proxy (see
/// [`ignored_service_reason`]).
pub fn service(svc: &core::Service) -> Result<Option<Service>, Rejected> {
    service_noting(svc, &mut Vec::new())
}

/// [`service`], pushing onto `dropped` a report for each address that was left out while the
/// rest of the Service is used (a special externalIP or load-balancer IP).
pub fn service_noting(
    svc: &core::Service,
    dropped: &mut Vec<Rejected>,
) -> Result<Option<Service>, Rejected> {
    let name = names("Service", &svc.metadata)?;
    // The metadata's own strings, which `names` checked and copied into `name`.
    let ctx = Ctx {
        kind: "Service",
        namespace: Some(svc.metadata.namespace.as_deref().unwrap_or_default()),
        name: svc.metadata.name.as_deref().unwrap_or_default(),
    };
    if ignored_service_reason(svc).is_some() {
        return Ok(None);
    }
    let Some(spec) = svc.spec.as_ref() else {
        // ignored_service_reason already returned for a Service without spec (no ClusterIP).
        return Ok(None);
    };

    match spec.type_.as_deref() {
        None | Some("" | "ClusterIP" | "NodePort" | "LoadBalancer") => {}
        Some(other) => {
            return Err(ctx.reject(
                "spec.type",
                other,
                "unknown Service type; valid: ClusterIP, NodePort, LoadBalancer, ExternalName",
            ));
        }
    }

    let cluster_ips = cluster_ips(&ctx, spec)?;
    let ports = service_ports(&ctx, spec)?;

    let mut external_ips = Vec::new();
    for (i, raw) in spec.external_ips.iter().flatten().enumerate() {
        let field = format!("spec.externalIPs[{i}]");
        let ip = ip_field(&ctx, &field, raw)?;
        // One bad address need not take the Service's ClusterIP and other addresses with it.
        match routable_ip_field(&ctx, &field, raw) {
            Ok(_) => external_ips.push(ip),
            Err(report) => dropped.push(dropped_report(report)),
        }
    }

    let mut load_balancer_ips = Vec::new();
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for (i, ing) in ingress.into_iter().flatten().enumerate() {
        // kube-proxy programs only VIP-mode ingress IPs: with ipMode Proxy the load balancer
        // terminates traffic itself, and a hostname-only entry has no IP to match.
        if !matches!(ing.ip_mode.as_deref(), None | Some("" | "VIP")) {
            continue;
        }
        let Some(raw) = ing.ip.as_deref().filter(|ip| !ip.is_empty()) else {
            continue;
        };
        let field = format!("status.loadBalancer.ingress[{i}].ip");
        let ip = ip_field(&ctx, &field, raw)?;
        match routable_ip_field(&ctx, &field, raw) {
            Ok(_) => load_balancer_ips.push(ip),
            Err(report) => dropped.push(dropped_report(report)),
        }
    }

    let mut load_balancer_source_ranges = Vec::new();
    for (i, raw) in spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .enumerate()
    {
        let Some(net) = parse_cidr(raw) else {
            return Err(ctx.reject(
                format!("spec.loadBalancerSourceRanges[{i}]"),
                raw.as_str(),
                "not a CIDR; valid: an IPv4 or IPv6 prefix such as 203.0.113.0/24",
            ));
        };
        load_balancer_source_ranges.push(net);
    }

    let external_traffic_policy = traffic_policy(
        &ctx,
        "spec.externalTrafficPolicy",
        spec.external_traffic_policy.as_deref(),
    )?;
    let internal_traffic_policy = traffic_policy(
        &ctx,
        "spec.internalTrafficPolicy",
        spec.internal_traffic_policy.as_deref(),
    )?;

    let health_check_node_port = match spec.health_check_node_port {
        None | Some(0) => None,
        Some(p) => Some(port_number(&ctx, "spec.healthCheckNodePort", p)?),
    };

    let session_affinity_timeout = session_affinity(&ctx, spec)?;

    Ok(Some(Service {
        name,
        cluster_ips,
        ports,
        external_ips: external_ips.into(),
        load_balancer_ips: load_balancer_ips.into(),
        load_balancer_source_ranges: load_balancer_source_ranges.into(),
        external_traffic_policy,
        internal_traffic_policy,
        health_check_node_port,
        session_affinity_timeout,
        created: svc
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second()),
        // Only Events use it, so a uid no API server would hand out is left out rather than
        // costing the Service its traffic.
        uid: svc
            .metadata
            .uid
            .as_deref()
            .filter(|uid| check_text(&ctx, "metadata.uid", uid).is_ok())
            .map(Uid::new),
    }))
}

/// Namespace and name of a namespaced object; both are required.
fn names(
    kind: &'static str,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Result<ServiceName, Rejected> {
    let name = meta.name.as_deref().unwrap_or_default();
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    let ctx = Ctx {
        kind,
        namespace: Some(namespace),
        name,
    };
    if name.is_empty() {
        return Err(ctx.reject(
            "metadata.name",
            name,
            format!("missing; every {kind} needs a name"),
        ));
    }
    if namespace.is_empty() {
        return Err(ctx.reject(
            "metadata.namespace",
            namespace,
            format!("missing; a {kind} is namespaced (kubectl -A output always includes it)"),
        ));
    }
    check_text(&ctx, "metadata.name", name)?;
    check_text(&ctx, "metadata.namespace", namespace)?;
    Ok(ServiceName::new(namespace, name))
}

fn cluster_ips(ctx: &Ctx, spec: &core::ServiceSpec) -> Result<Vec<IpAddr>, Rejected> {
    let listed = spec.cluster_ips.as_deref().unwrap_or_default();
    let (raw_ips, field): (Vec<&str>, &str) = if listed.is_empty() {
        (
            spec.cluster_ip.as_deref().into_iter().collect(),
            "spec.clusterIP",
        )
    } else {
        (
            listed.iter().map(String::as_str).collect(),
            "spec.clusterIPs",
        )
    };

    let path = |i: usize| {
        if listed.is_empty() {
            field.to_owned()
        } else {
            format!("{field}[{i}]")
        }
    };

    let mut ips: Vec<IpAddr> = Vec::with_capacity(raw_ips.len());
    for (i, raw) in raw_ips.iter().enumerate() {
        let path = path(i);
        let ip = routable_ip_field(ctx, &path, raw)?;
        if let Some(prev) = ips.iter().find(|p| IpFamily::of(p) == IpFamily::of(&ip)) {
            return Err(ctx.reject(
                path,
                *raw,
                format!(
                    "a second {} ClusterIP (already have {prev}); valid: at most one ClusterIP per family",
                    IpFamily::of(&ip)
                ),
            ));
        }
        ips.push(ip);
    }

    // The API keeps clusterIP equal to clusterIPs[0]; if a hand-written file disagrees, nothing
    // says which one the author meant.
    if let (Some(first), Some(single)) = (
        ips.first(),
        spec.cluster_ip.as_deref().filter(|s| !s.is_empty()),
    ) && !listed.is_empty()
        && parse_ip(single) != Some(*first)
    {
        return Err(ctx.reject(
            "spec.clusterIP",
            single,
            format!("differs from spec.clusterIPs[0] ({first}); valid: the same address"),
        ));
    }

    for (i, (family, ip)) in spec
        .ip_families
        .iter()
        .flatten()
        .zip(ips.iter())
        .enumerate()
    {
        let want = match family.as_str() {
            "IPv4" => IpFamily::V4,
            "IPv6" => IpFamily::V6,
            _ => {
                return Err(ctx.reject(
                    format!("spec.ipFamilies[{i}]"),
                    family.as_str(),
                    "unknown IP family; valid: IPv4, IPv6",
                ));
            }
        };
        if want != IpFamily::of(ip) {
            return Err(ctx.reject(
                format!("spec.ipFamilies[{i}]"),
                family.as_str(),
                format!(
                    "does not match the family of {} ({ip} is {}); valid: {}",
                    path(i),
                    IpFamily::of(ip),
                    IpFamily::of(ip)
                ),
            ));
        }
    }
    Ok(ips)
}

fn service_ports(ctx: &Ctx, spec: &core::ServiceSpec) -> Result<Vec<ServicePort>, Rejected> {
    // Sized up front, like a slice's ports: the model keeps the vector as it is.
    let mut ports = Vec::with_capacity(spec.ports.as_ref().map_or(0, Vec::len));
    let mut seen_names = BTreeSet::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let name = p.name.clone().unwrap_or_default();
        check_text(ctx, format_args!("spec.ports[{i}].name"), &name)?;
        // Endpoints are matched to Service ports by name (and protocol); two ports with one name
        // could not be told apart. The API forbids it, so this only catches hand-written files.
        if !seen_names.insert(name.clone()) {
            return Err(ctx.reject(
                format!("spec.ports[{i}].name"),
                name,
                "duplicate port name; valid: a name unique within the Service",
            ));
        }
        let protocol = protocol(
            ctx,
            format_args!("spec.ports[{i}].protocol"),
            p.protocol.as_deref(),
        )?;
        let port = port_number(ctx, format_args!("spec.ports[{i}].port"), p.port)?;
        let node_port = match p.node_port {
            None | Some(0) => None,
            Some(n) => Some(port_number(
                ctx,
                format_args!("spec.ports[{i}].nodePort"),
                n,
            )?),
        };
        ports.push(ServicePort {
            name,
            protocol,
            port,
            node_port,
        });
    }
    Ok(ports)
}

fn session_affinity(ctx: &Ctx, spec: &core::ServiceSpec) -> Result<Option<u32>, Rejected> {
    match spec.session_affinity.as_deref() {
        None | Some("" | "None") => Ok(None),
        Some("ClientIP") => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            match timeout {
                None => Ok(Some(DEFAULT_AFFINITY_TIMEOUT)),
                Some(t) => match u32::try_from(t) {
                    Ok(t) if (1..=MAX_AFFINITY_TIMEOUT).contains(&t) => Ok(Some(t)),
                    _ => Err(ctx.reject(
                        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                        t.to_string(),
                        format!("out of range; valid: 1..={MAX_AFFINITY_TIMEOUT} seconds"),
                    )),
                },
            }
        }
        Some(other) => Err(ctx.reject(
            "spec.sessionAffinity",
            other,
            "unknown session affinity; valid: None, ClientIP",
        )),
    }
}

fn traffic_policy(
    ctx: &Ctx,
    field: impl Field,
    raw: Option<&str>,
) -> Result<TrafficPolicy, Rejected> {
    match raw {
        None | Some("" | "Cluster") => Ok(TrafficPolicy::Cluster),
        Some("Local") => Ok(TrafficPolicy::Local),
        Some(other) => Err(ctx.reject(
            field.to_string(),
            other,
            "unknown traffic policy; valid: Cluster, Local",
        )),
    }
}

fn protocol(ctx: &Ctx, field: impl Field, raw: Option<&str>) -> Result<Protocol, Rejected> {
    match raw {
        None | Some("" | "TCP") => Ok(Protocol::Tcp),
        Some("UDP") => Ok(Protocol::Udp),
        Some("SCTP") => Ok(Protocol::Sctp),
        Some(other) => Err(ctx.reject(
            field.to_string(),
            other,
            "unknown protocol; valid: TCP, UDP, SCTP",
        )),
    }
}

fn port_number(ctx: &Ctx, field: impl Field, raw: i32) -> Result<u16, Rejected> {
    match u16::try_from(raw) {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(ctx.reject(
            field.to_string(),
            raw.to_string(),
            "port out of range; valid: 1..=65535",
        )),
    }
}

fn ip_field(ctx: &Ctx, field: impl Field, raw: &str) -> Result<IpAddr, Rejected> {
    parse_ip(raw).ok_or_else(|| {
        ctx.reject(
            field.to_string(),
            raw,
            "not an IP address; valid: an IPv4 or IPv6 address such as 192.0.2.1 or 2001:db8::1",
        )
    })
}

mod node;
mod parse;
mod service_cidr;
mod slice;

pub use node::node;
pub use parse::{parse_cidr, parse_ip};
pub use service_cidr::service_cidr;
use slice::dropped_report;
pub use slice::{EndpointObject, SliceObject, endpoint_slice, endpoint_slice_noting};

#[cfg(test)]
mod tests;
