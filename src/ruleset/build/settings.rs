//! What the builder needs beyond the cluster state ([`Settings`]): the node, the pod CIDRs,
//! the masquerade mark, which addresses answer NodePorts, how pod traffic is recognised.

use super::*;

/// What `build` needs beyond the cluster state: the configuration with the node name resolved
/// (`Settings::new`, in `config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// This node's name (endpoint locality, which Node object is ours).
    pub node_name: String,
    /// Pod network CIDRs, at most one per family.
    pub cluster_cidrs: Vec<IpNet>,
    pub masquerade_all: bool,
    /// The mark value with only the masquerade bit set.
    pub mark: u32,
    pub nodeport_addresses: NodePortAddresses,
    /// How traffic from pods is recognised (`--detect-local-mode` and its parameter).
    pub detect_local: DetectLocal,
    /// `--service-cidr`: ClusterIP ranges, at most one per family. New connections to an address
    /// in them that no Service holds are dropped.
    pub service_cidrs: Vec<IpNet>,
    /// Our tables are owned by the programming process (see [`super::Table::owned`]). Never
    /// from the configuration: set by the daemon and `--once` when the kernel supports it
    /// (`nft::probe::Ownership`), so `--dry-run` output does not depend on the machine.
    pub own_tables: bool,
}

/// The local-traffic detector (kube-proxy's `--detect-local-mode`): what tells traffic from
/// pods apart from traffic from the node itself and from outside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetectLocal {
    /// The source address is in the cluster CIDR of its family (`Settings::cluster_cidrs`).
    ClusterCidr,
    /// The source address is in this Node's `spec.podCIDRs` (read from the Node object).
    NodeCidr,
    /// The packet arrived on this bridge interface.
    BridgeInterface(String),
    /// The packet arrived on an interface whose name starts with this prefix.
    InterfaceNamePrefix(String),
}

/// `--nodeport-addresses`: which local addresses answer NodePorts. The addresses selected are
/// the union of what each part selects; the default is `primary` alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePortAddresses {
    /// `primary`: the Node object's primary InternalIP of each family (kube-proxy's nftables
    /// default).
    pub primary: bool,
    /// `all`: every local address of both families.
    pub all: bool,
    /// The local addresses inside these CIDRs. `0.0.0.0/0` (or `::/0`) selects every address
    /// of that family.
    pub cidrs: Vec<IpNet>,
}

impl Default for NodePortAddresses {
    fn default() -> NodePortAddresses {
        NodePortAddresses::primary()
    }
}

impl NodePortAddresses {
    /// Only the Node's primary InternalIP of each family.
    pub fn primary() -> NodePortAddresses {
        NodePortAddresses {
            primary: true,
            all: false,
            cidrs: Vec::new(),
        }
    }

    /// Whether this is exactly the default, `primary`.
    pub fn is_primary_only(&self) -> bool {
        self.primary && !self.all && self.cidrs.is_empty()
    }

    /// Whether every local address of `family` answers: `all`, or a `/0` CIDR of the family.
    pub fn all_of(&self, family: IpFamily) -> bool {
        self.all
            || self
                .cidrs
                .iter()
                .any(|net| net.prefix_len() == 0 && IpFamily::of(&net.addr()) == family)
    }

    /// Whether local address `ip` answers NodePorts; `is_primary` says whether it is the
    /// Node's primary InternalIP of its family.
    pub fn selects(&self, ip: IpAddr, is_primary: bool) -> bool {
        (self.primary && is_primary) || self.all || self.cidrs.iter().any(|net| net.contains(&ip))
    }
}

impl Settings {
    pub(super) fn cluster_cidr(&self, family: IpFamily) -> Option<IpNet> {
        first_of(&self.cluster_cidrs, family)
    }

    /// The statement matching traffic from pods (`negate`: traffic not from pods) in the table of
    /// `family`, or `None` when the detector has nothing to match for this family; then the
    /// rules that need it are left out, as kube-proxy does.
    pub(super) fn local_match(
        &self,
        node: Option<&Node>,
        family: IpFamily,
        negate: bool,
    ) -> Option<Stmt> {
        let saddr_in = |net: IpNet| Stmt::AddrMatch {
            field: AddrField::Saddr,
            negate,
            net,
        };
        match &self.detect_local {
            DetectLocal::ClusterCidr => self.cluster_cidr(family).map(saddr_in),
            DetectLocal::NodeCidr => node
                .and_then(|n| first_of(&n.pod_cidrs, family))
                .map(saddr_in),
            DetectLocal::BridgeInterface(name) | DetectLocal::InterfaceNamePrefix(name)
                if name.is_empty() =>
            {
                None
            }
            DetectLocal::BridgeInterface(name) => Some(Stmt::Iifname {
                name: name.clone(),
                prefix: false,
                negate,
            }),
            DetectLocal::InterfaceNamePrefix(name) => Some(Stmt::Iifname {
                name: name.clone(),
                prefix: true,
                negate,
            }),
        }
    }
}

impl Settings {
    /// The service ranges: `--service-cidr` when given, else those of the cluster's ServiceCIDR
    /// objects (sorted, without repeats), as kube-proxy's nftables mode takes them.
    pub fn service_ranges(&self, state: &ClusterState) -> Vec<IpNet> {
        if !self.service_cidrs.is_empty() {
            return self.service_cidrs.clone();
        }
        let ranges: std::collections::BTreeSet<IpNet> =
            state.service_cidrs.values().flatten().copied().collect();
        ranges.into_iter().collect()
    }
}

fn first_of(nets: &[IpNet], family: IpFamily) -> Option<IpNet> {
    nets.iter()
        .copied()
        .find(|net| IpFamily::of(&net.addr()) == family)
}
