//! The validated cluster model: what the proxy needs to know about Services, endpoints and its Node.
//!
//! Nothing below this module knows Kubernetes API types; `convert` is the one place that reads
//! them, validates them and turns invalid objects into [`Rejected`] reports.

pub mod convert;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::hash::BuildHasherDefault;
use std::net::IpAddr;
use std::sync::Arc;

use crate::address_hash::AddressHasher;

/// An IP family. Each family gets its own nftables table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    pub fn of(addr: &IpAddr) -> IpFamily {
        match addr {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        })
    }
}

/// A transport protocol a Service port can use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// The IANA protocol number, as `meta l4proto` sees it.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }

    /// The protocol with this IANA number, if it is one Services use.
    pub fn from_number(n: u8) -> Option<Protocol> {
        match n {
            6 => Some(Protocol::Tcp),
            17 => Some(Protocol::Udp),
            132 => Some(Protocol::Sctp),
            _ => None,
        }
    }

    /// The nft keyword (`tcp`, `udp`, `sctp`).
    pub fn keyword(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.keyword())
    }
}

/// `namespace/name` of a Service (or of an EndpointSlice), as one shared text.
///
/// A name is held many times over: the model's key and object, a slice's Service, every claim,
/// origin and index entry of the daemon's baseline. As two `String`s each copy was 48 bytes
/// and two allocations; as one `Arc<str>` a copy is 24 bytes and no allocation. `text` is
/// `namespace/name`; `namespace_len` marks the split, since nothing stops a name read from a
/// file from holding a `/` itself (`convert::check_text`), so the split is part of the
/// identity. Ordered as the pair (namespace, name), as the two fields were.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ServiceName {
    text: Arc<str>,
    namespace_len: usize,
}

impl ServiceName {
    pub fn new(namespace: &str, name: &str) -> ServiceName {
        let mut text = String::with_capacity(namespace.len() + 1 + name.len());
        text.push_str(namespace);
        text.push('/');
        text.push_str(name);
        ServiceName {
            text: text.into(),
            namespace_len: namespace.len(),
        }
    }

    pub fn namespace(&self) -> &str {
        self.text.get(..self.namespace_len).unwrap_or_default()
    }

    pub fn name(&self) -> &str {
        self.text.get(self.namespace_len + 1..).unwrap_or_default()
    }
}

impl Ord for ServiceName {
    fn cmp(&self, other: &ServiceName) -> std::cmp::Ordering {
        (self.namespace(), self.name()).cmp(&(other.namespace(), other.name()))
    }
}

impl PartialOrd for ServiceName {
    fn partial_cmp(&self, other: &ServiceName) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Debug for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServiceName")
            .field("namespace", &self.namespace())
            .field("name", &self.name())
            .finish()
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// One port of one Service: `ns/name:portname` (kube-proxy's `ServicePortName`). The port
/// name is empty for single-port Services, which then display as `ns/name` plus the protocol
/// and number to stay unambiguous.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    pub service: ServiceName,
    pub port: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.service, f)?;
        f.write_str(":")?;
        if self.port.is_empty() {
            fmt::Display::fmt(&self.protocol, f)
        } else {
            f.write_str(&self.port)
        }
    }
}

/// Traffic policy (`externalTrafficPolicy` / `internalTrafficPolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrafficPolicy {
    #[default]
    Cluster,
    Local,
}

/// A Service port as the proxy needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePort {
    /// The port's name in the Service spec ("" when unnamed).
    pub name: String,
    pub protocol: Protocol,
    /// The port the Service listens on (on its ClusterIPs, external IPs and LB IPs).
    pub port: u16,
    /// Allocated NodePort, if any.
    pub node_port: Option<u16>,
}

/// A Service that the proxy implements (not headless, not ExternalName, not owned by another
/// proxy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub name: ServiceName,
    /// `spec.clusterIPs` (or `spec.clusterIP`), at most one per family, in spec order.
    pub cluster_ips: Vec<IpAddr>,
    pub ports: Vec<ServicePort>,
    /// `spec.externalIPs`.
    pub external_ips: Rare<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` entries in VIP mode (hostname-only and `ipMode:
    /// Proxy` entries are dropped at conversion).
    pub load_balancer_ips: Rare<IpAddr>,
    pub load_balancer_source_ranges: Rare<ipnet::IpNet>,
    pub external_traffic_policy: TrafficPolicy,
    pub internal_traffic_policy: TrafficPolicy,
    /// `spec.healthCheckNodePort`.
    pub health_check_node_port: Option<u16>,
    /// `ClientIP` session affinity timeout in seconds; `None` when affinity is off.
    pub session_affinity_timeout: Option<u32>,
    /// `metadata.creationTimestamp` in seconds since the epoch, if the object carries one: of
    /// two Services claiming one address and port, the older keeps it (after the kind of
    /// address; see `ruleset::build::Claims`).
    pub created: Option<i64>,
    /// `metadata.uid`: the Events recorded about the Service name it, since `kubectl describe`
    /// finds a live object's Events by its uid.
    pub uid: Option<Uid>,
}

/// A list that is empty in nearly every Service (its external IPs, load-balancer IPs and
/// source ranges): one pointer, and no allocation while empty, against a `Vec`'s three words.
/// The model's Services sit in B-tree leaves of eleven: with three `Vec`s here a Service was 200
/// bytes and a leaf 2,480 (jemalloc's 2,560-byte class), with these 152 and 1,952 (the
/// 2,048-byte class), 0.5 KiB less per leaf of a map of Services (docs/performance.md, "A
/// Service in 152 bytes, a slice in 88"). Read as a slice.
#[derive(Clone, PartialEq, Eq)]
// The second indirection is the point: `Box<[T]>` would be two words.
#[allow(clippy::box_collection)]
pub struct Rare<T>(Option<Box<Vec<T>>>);

impl<T> Default for Rare<T> {
    fn default() -> Rare<T> {
        Rare(None)
    }
}

impl<T> std::ops::Deref for Rare<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        self.0.as_deref().map_or(&[], Vec::as_slice)
    }
}

impl<T> From<Vec<T>> for Rare<T> {
    fn from(items: Vec<T>) -> Rare<T> {
        Rare((!items.is_empty()).then(|| Box::new(items)))
    }
}

impl<T> FromIterator<T> for Rare<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Rare<T> {
        Rare::from(items.into_iter().collect::<Vec<T>>())
    }
}

impl<'a, T> IntoIterator for &'a Rare<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<T: PartialEq> PartialEq<Vec<T>> for Rare<T> {
    fn eq(&self, other: &Vec<T>) -> bool {
        **self == **other
    }
}

impl<T: fmt::Debug> fmt::Debug for Rare<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// A Service's `metadata.uid`. API servers hand out UUIDs in their canonical text (36
/// characters, lowercase hex in groups of 8-4-4-4-12), held here as their 16 bytes: as a
/// `Box<str>` every Service of a real cluster held a 48-byte allocation for it, 0.46 MiB of the
/// daemon at 10k Services, inside the 40 MiB target's last half MiB (docs/performance.md). Any
/// other text is kept as it is, so that Events name the object exactly as the API server does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Uid {
    Uuid([u8; 16]),
    Text(Box<str>),
}

impl Uid {
    pub fn new(text: &str) -> Uid {
        Uid::canonical(text).map_or_else(|| Uid::Text(text.into()), Uid::Uuid)
    }

    /// The bytes of a UUID in canonical text; `None` for any other text (upper case included,
    /// which would not print back the same).
    fn canonical(text: &str) -> Option<[u8; 16]> {
        const DASHES: [usize; 4] = [8, 13, 18, 23];
        let bytes = text.as_bytes();
        if bytes.len() != 36 || DASHES.iter().any(|&at| bytes.get(at) != Some(&b'-')) {
            return None;
        }
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut digits = bytes
            .iter()
            .enumerate()
            .filter(|(at, _)| !DASHES.contains(at))
            .map(|(_, &c)| digit(c));
        let mut uuid = [0; 16];
        for byte in &mut uuid {
            *byte = (digits.next()?? << 4) | digits.next()??;
        }
        Some(uuid)
    }
}

impl fmt::Display for Uid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Uid::Uuid(bytes) => {
                for (at, byte) in bytes.iter().enumerate() {
                    if matches!(at, 4 | 6 | 8 | 10) {
                        f.write_str("-")?;
                    }
                    write!(f, "{byte:02x}")?;
                }
                Ok(())
            }
            Uid::Text(text) => f.write_str(text),
        }
    }
}

impl Service {
    /// A Service named `name` and nothing else: no address, no port, `Cluster` traffic
    /// policies, no affinity, no creation time. What tests, benchmarks and fuzzers build theirs
    /// from, setting only what they mean: `Service { ports, ..Service::new(name) }`.
    pub fn new(name: ServiceName) -> Service {
        Service {
            name,
            cluster_ips: Vec::new(),
            ports: Vec::new(),
            external_ips: Rare::default(),
            load_balancer_ips: Rare::default(),
            load_balancer_source_ranges: Rare::default(),
            external_traffic_policy: TrafficPolicy::Cluster,
            internal_traffic_policy: TrafficPolicy::Cluster,
            health_check_node_port: None,
            session_affinity_timeout: None,
            created: None,
            uid: None,
        }
    }

    pub fn port_name(&self, port: &ServicePort) -> ServicePortName {
        ServicePortName {
            service: self.name.clone(),
            port: port.name.clone(),
            protocol: port.protocol,
        }
    }

    /// The ClusterIP of `family`, if the Service has one.
    pub fn cluster_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.cluster_ips
            .iter()
            .copied()
            .find(|ip| IpFamily::of(ip) == family)
    }
}

/// Endpoint readiness as EndpointSlice conditions report it, with nil already resolved the way
/// kube-proxy resolves it (ready/serving nil → true, terminating nil → false).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conditions {
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

/// One endpoint of one Service port: an address from an EndpointSlice and the port number
/// matched by name and protocol. Borrows from the slice, so that computing the endpoints of 10k
/// Services allocates no strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint<'a> {
    pub addr: IpAddr,
    pub port: u16,
    pub conditions: Conditions,
    /// `endpoint.nodeName`, if set.
    pub node_name: Option<&'a str>,
    /// `endpoint.zone`, if set.
    pub zone: Option<&'a str>,
    /// `hints.forZones[].name`.
    pub zone_hints: &'a [String],
    /// `hints.forNodes[].name`.
    pub node_hints: &'a [String],
}

/// An EndpointSlice reduced to what the proxy uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSlice {
    /// `namespace/name` of the slice itself.
    pub name: ServiceName,
    /// The Service it belongs to (label `kubernetes.io/service-name`).
    pub service: ServiceName,
    pub family: IpFamily,
    /// Ports of the slice: (name, protocol, port number). This and `endpoints` are fixed once
    /// converted, so boxed slices: a word less each than a `Vec`, which keeps a B-tree leaf of
    /// eleven slices in jemalloc's 1,280-byte class (docs/performance.md, "A Service in 152
    /// bytes, a slice in 88").
    pub ports: Box<[SlicePort]>,
    /// Endpoints; only `addresses[0]` of each API endpoint is kept, like kube-proxy.
    pub endpoints: Box<[SliceEndpoint]>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// One endpoint of a slice: 32 bytes (120 when its strings were `String`s), and a cluster has
/// far more endpoints than anything else. Its node, zone and hints are one [`Locality`] behind
/// a thin pointer, shared by the endpoints of a node unless they carry hints (set only with
/// topology-aware routing). A second pointer for the hints made it 40 bytes, which put the
/// vector of a slice of ten endpoints in jemalloc's 448-byte class instead of 320.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub addr: IpAddr,
    pub conditions: Conditions,
    /// `nodeName`, `zone` and `hints`; `None` when the endpoint has none of them.
    pub locality: Option<Arc<Locality>>,
}

/// Where an endpoint runs: its `nodeName` and `zone`, and its `hints`. A node is in one zone,
/// so the endpoints of a node without hints share one of these (see [`NameTable`]); an
/// endpoint with hints has its own.
#[derive(Debug, PartialEq, Eq)]
pub struct Locality {
    pub node_name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    /// `None` when there are no hints; see [`Hints::new`].
    pub hints: Option<Box<Hints>>,
}

impl Locality {
    /// The locality of an endpoint naming `node_name` and `zone`, without hints, shared with
    /// nothing (the conversion shares them through [`NameTable::locality`]); `None` when it
    /// names neither.
    pub fn of(node_name: Option<Arc<str>>, zone: Option<Arc<str>>) -> Option<Arc<Locality>> {
        (node_name.is_some() || zone.is_some()).then(|| {
            Arc::new(Locality {
                node_name,
                zone,
                hints: None,
            })
        })
    }

    /// `located` (node and zone, whatever hints it had) with `hints`: `located` itself, still
    /// shared, when there are none; otherwise a locality of the endpoint's own.
    pub fn with_hints(
        located: Option<Arc<Locality>>,
        hints: Option<Box<Hints>>,
    ) -> Option<Arc<Locality>> {
        let Some(hints) = hints else {
            return match located {
                Some(l) if l.hints.is_some() => Locality::of(l.node_name.clone(), l.zone.clone()),
                other => other,
            };
        };
        let (node_name, zone) =
            located.map_or((None, None), |l| (l.node_name.clone(), l.zone.clone()));
        Some(Arc::new(Locality {
            node_name,
            zone,
            hints: Some(hints),
        }))
    }
}

/// Node and zone names, and their pairs, as the endpoints hold them: each once per table,
/// however many endpoints name them. A cluster has a hundred or more endpoints per node
/// (kubelet's default limit is 110 pods), and a node's name is often 30-50 bytes
/// (`ip-10-0-12-34.us-west-2.compute.internal`), which a string per endpoint held 100k times
/// at 10k Services × 10 endpoints. A converting thread keeps one table. What no endpoint
/// holds any more is dropped when the table has doubled since it was last pruned, so a stream
/// of made-up names costs at most twice what the model holds.
#[derive(Debug, Default)]
pub struct NameTable {
    names: std::collections::HashSet<Arc<str>>,
    /// The pairs, by the addresses of their texts in `names` (0 for none): a pair holds its
    /// texts, so no other text can take their addresses while it is here.
    localities: HashMap<(usize, usize), Arc<Locality>, BuildHasherDefault<AddressHasher>>,
    /// How many names and pairs the table held after it was last pruned.
    pruned_to: usize,
}

impl NameTable {
    /// Pruning starts at this many names and pairs: below it, the table is small whatever it
    /// holds.
    const PRUNE_FROM: usize = 1024;

    /// The locality naming `node_name` and `zone`, shared with every earlier request for the
    /// same pair; `None` when it names neither.
    pub fn locality(
        &mut self,
        node_name: Option<&str>,
        zone: Option<&str>,
    ) -> Option<Arc<Locality>> {
        if node_name.is_none() && zone.is_none() {
            return None;
        }
        if self.len() >= (2 * self.pruned_to).max(Self::PRUNE_FROM) {
            // Held only by the table: no endpoint names them any more. Pairs first, since
            // they hold names.
            self.localities.retain(|_, l| Arc::strong_count(l) > 1);
            self.names.retain(|n| Arc::strong_count(n) > 1);
            self.pruned_to = self.len();
        }
        let node_name = node_name.map(|n| self.name(n));
        let zone = zone.map(|z| self.name(z));
        let address = |n: &Option<Arc<str>>| n.as_ref().map_or(0, |n| Arc::as_ptr(n).addr());
        let key = (address(&node_name), address(&zone));
        let locality = self.localities.entry(key).or_insert_with(|| {
            Arc::new(Locality {
                node_name,
                zone,
                hints: None,
            })
        });
        Some(Arc::clone(locality))
    }

    /// `name`, shared with every earlier request for the same text.
    fn name(&mut self, name: &str) -> Arc<str> {
        if let Some(held) = self.names.get(name) {
            return Arc::clone(held);
        }
        let name: Arc<str> = Arc::from(name);
        self.names.insert(Arc::clone(&name));
        name
    }

    /// How many names and pairs the table holds.
    fn len(&self) -> usize {
        self.names.len() + self.localities.len()
    }
}

/// An endpoint's `hints`, when it has any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hints {
    /// `hints.forZones[].name`.
    pub zones: Vec<String>,
    /// `hints.forNodes[].name`.
    pub nodes: Vec<String>,
}

impl Hints {
    /// The hints of an endpoint: `None` when both lists are empty, so that an endpoint without
    /// hints has one representation.
    pub fn new(zones: Vec<String>, nodes: Vec<String>) -> Option<Box<Hints>> {
        if zones.is_empty() && nodes.is_empty() {
            None
        } else {
            Some(Box::new(Hints { zones, nodes }))
        }
    }
}

impl SliceEndpoint {
    /// `nodeName`.
    pub fn node_name(&self) -> Option<&str> {
        self.locality.as_ref()?.node_name.as_deref()
    }

    /// `zone`.
    pub fn zone(&self) -> Option<&str> {
        self.locality.as_ref()?.zone.as_deref()
    }

    /// `hints`, when it has any.
    pub fn hints(&self) -> Option<&Hints> {
        self.locality.as_ref()?.hints.as_deref()
    }

    /// `hints.forZones[].name`.
    pub fn zone_hints(&self) -> &[String] {
        self.hints().map_or(&[], |h| &h.zones)
    }

    /// `hints.forNodes[].name`.
    pub fn node_hints(&self) -> &[String] {
        self.hints().map_or(&[], |h| &h.nodes)
    }

    /// Replaces the endpoint's hints, keeping its node and zone.
    pub fn set_hints(&mut self, hints: Option<Box<Hints>>) {
        self.locality = Locality::with_hints(self.locality.take(), hints);
    }
}

/// The proxy's own Node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Node {
    pub name: String,
    /// `status.addresses` of type InternalIP, in order.
    pub internal_ips: Vec<IpAddr>,
    /// `status.addresses` of type ExternalIP, in order.
    pub external_ips: Vec<IpAddr>,
    /// `spec.podCIDRs` (or `spec.podCIDR`).
    pub pod_cidrs: Vec<ipnet::IpNet>,
    /// Label `topology.kubernetes.io/zone`.
    pub zone: Option<String>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// Taint `ToBeDeletedByClusterAutoscaler` is present.
    pub to_be_deleted: bool,
}

impl Node {
    /// The node's primary IP of `family`: its first InternalIP of that family (kube-proxy's
    /// `primary` NodePort address).
    pub fn primary_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.internal_ips
            .iter()
            .copied()
            .find(|ip| IpFamily::of(ip) == family)
    }

    /// Whether `ip` is one of the node's addresses (an InternalIP or ExternalIP).
    pub fn owns(&self, ip: &IpAddr) -> bool {
        self.internal_ips.contains(ip) || self.external_ips.contains(ip)
    }
}

/// EndpointSlices by the Service they belong to ([`ClusterState::slices_by_service`]).
pub type SlicesByService<'a> = HashMap<&'a ServiceName, Vec<&'a EndpointSlice>>;

/// Everything the ruleset is built from. Keyed maps keep iteration deterministic.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterState {
    pub services: BTreeMap<ServiceName, Service>,
    /// EndpointSlices keyed by their own `namespace/name`.
    pub slices: BTreeMap<ServiceName, EndpointSlice>,
    /// Nodes by name (the proxy uses only its own).
    pub nodes: BTreeMap<String, Node>,
    /// ServiceCIDR objects by name: the ranges ClusterIPs are allocated from (at most one per
    /// family each). `--service-cidr`, when given, replaces them.
    pub service_cidrs: BTreeMap<String, Vec<ipnet::IpNet>>,
}

/// An API object that failed validation: it does not exist downstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// `Service ns/name`, `EndpointSlice ns/name`, `Node name`, or the kind and index for an
    /// object without a readable name.
    pub object: String,
    /// The field path, e.g. `spec.ports[1].port`.
    pub field: String,
    /// The offending value as written.
    pub value: String,
    /// Why it is invalid, and what would be valid.
    pub reason: String,
}

impl fmt::Display for Rejected {
    /// Every part may hold text from the object, so each is shown through [`printable`]: a
    /// newline in a name must not start a forged log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} = \"{}\": {}",
            printable(&self.object),
            printable(&self.field),
            printable(&self.value),
            printable(&self.reason)
        )
    }
}

/// The most characters of one piece of object text a message shows; longer text is cut and
/// marked. Kubernetes names are at most 253 characters.
const PRINTABLE_MAX: usize = 253;

/// Text from a cluster object as messages show it: control characters (newline, CR, ESC, NUL,
/// …) escaped as `\n`, `\u{1b}`, so that they can neither forge a log line nor drive a
/// terminal, and cut after [`PRINTABLE_MAX`] characters.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    let clean = !text.chars().any(char::is_control);
    if clean && text.len() <= PRINTABLE_MAX {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == PRINTABLE_MAX {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

impl ClusterState {
    /// EndpointSlices grouped by the Service they belong to. Build it once per computation:
    /// looking slices up per Service port would be quadratic at 10k Services.
    pub fn slices_by_service(&self) -> SlicesByService<'_> {
        // Sized for a Service per slice (usually close): grown by doubling, every key was
        // hashed again at each step.
        let mut index: SlicesByService<'_> = HashMap::with_capacity(self.slices.len());
        for slice in self.slices.values() {
            index.entry(&slice.service).or_default().push(slice);
        }
        index
    }

    /// The part of the state that the ruleset elements of `services` are built from: those
    /// Services (the ones that exist), all their EndpointSlices, every Node and ServiceCIDR.
    /// A slice belongs to a Service of its own namespace (`convert/slice.rs` names the Service
    /// from the slice's namespace and label), so only the changed Services' namespaces are
    /// walked: a pass over every slice was ~1 ms of each change sync at 10k Services.
    pub fn subset(&self, services: &BTreeSet<ServiceName>) -> ClusterState {
        let mut slices = BTreeMap::new();
        let namespaces: BTreeSet<&str> = services.iter().map(|n| n.namespace()).collect();
        for namespace in namespaces {
            let first = ServiceName::new(namespace, "");
            let in_namespace = self
                .slices
                .range(first..)
                .take_while(|(name, _)| name.namespace() == namespace);
            for (name, slice) in in_namespace {
                if services.contains(&slice.service) {
                    slices.insert(name.clone(), slice.clone());
                }
            }
        }
        ClusterState {
            services: services
                .iter()
                .filter_map(|name| Some((name.clone(), self.services.get(name)?.clone())))
                .collect(),
            slices,
            nodes: self.nodes.clone(),
            service_cidrs: self.service_cidrs.clone(),
        }
    }
}

/// The endpoints of one Service port, merged across its slices and de-duplicated, in a stable
/// order (by address, then port).
pub fn endpoints_for<'a>(slices: &[&'a EndpointSlice], port: &ServicePort) -> Vec<Endpoint<'a>> {
    let mut found: Vec<Endpoint<'a>> = Vec::new();
    for slice in slices {
        let Some(sp) = slice
            .ports
            .iter()
            .find(|p| p.name == port.name && p.protocol == port.protocol)
        else {
            continue;
        };
        found.extend(slice.endpoints.iter().map(|ep| Endpoint {
            addr: ep.addr,
            port: sp.port,
            conditions: ep.conditions,
            node_name: ep.node_name(),
            zone: ep.zone(),
            zone_hints: ep.zone_hints(),
            node_hints: ep.node_hints(),
        }));
    }
    // The same address can appear in two slices while the controller moves it; keep one copy,
    // preferring the one that is not terminating, as kube-proxy's EndpointSliceCache does.
    found.sort_by_key(|ep| (ep.addr, ep.port, ep.conditions.terminating));
    found.dedup_by_key(|ep| (ep.addr, ep.port));
    found
}

#[cfg(test)]
mod tests;
