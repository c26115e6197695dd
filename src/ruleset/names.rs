//! Names and comments of every kernel object nodeproxy creates, in one place.
//!
//! The table is ours, so names carry no `nodeproxy-` prefix. They follow upstream kube-proxy's
//! names where the object means the same thing, so operators who know `kube-proxy`'s table can
//! read ours.

/// Our table, in both the `ip` and `ip6` families.
pub const TABLE: &str = "nodeproxy";
pub const TABLE_COMMENT: &str = "rules for nodeproxy";

pub const NAT_PREROUTING: &str = "nat-prerouting";
pub const NAT_OUTPUT: &str = "nat-output";
pub const NAT_POSTROUTING: &str = "nat-postrouting";
pub const FILTER_INPUT: &str = "filter-input";
pub const FILTER_FORWARD: &str = "filter-forward";
pub const FILTER_OUTPUT: &str = "filter-output";

pub const SERVICES: &str = "services";
pub const MASQUERADING: &str = "masquerading";
pub const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
pub const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
pub const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
pub const REJECT_CHAIN: &str = "reject-chain";

pub const CLUSTER_IPS: &str = "cluster-ips";
pub const NODEPORT_IPS: &str = "nodeport-ips";
pub const SERVICE_IPS: &str = "service-ips";
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
pub const HAIRPIN_CONNECTIONS: &str = "hairpin-connections";

/// Static chains that external traffic (externalIPs, LoadBalancer IPs, NodePorts) is sent to by
/// its traffic policy; they pick the endpoint list (cluster-wide or local) by source.
pub const EXTERNAL_CLUSTER: &str = "external-cluster";
pub const EXTERNAL_LOCAL: &str = "external-local";
pub const NODEPORT_CLUSTER: &str = "nodeport-cluster";
pub const NODEPORT_LOCAL: &str = "nodeport-local";

/// External address . protocol . port → `goto pick-<k>` (cluster-wide endpoints).
pub const EXTERNAL_PICKS: &str = "external-picks";
/// External address . protocol . port → `goto local-pick-<k>` (this node's endpoints).
pub const EXTERNAL_LOCAL_PICKS: &str = "external-local-picks";
/// Protocol . NodePort → `goto nodeport-pick-<k>` (cluster-wide endpoints).
pub const NODEPORT_PICKS: &str = "nodeport-picks";
/// Protocol . NodePort → `goto nodeport-local-pick-<k>` (this node's endpoints).
pub const NODEPORT_LOCAL_PICKS: &str = "nodeport-local-picks";

// loadBalancerSourceRanges (build/firewall.rs).
pub const FILTER_PREROUTING_PRE_DNAT: &str = "filter-prerouting-pre-dnat";
pub const FILTER_OUTPUT_PRE_DNAT: &str = "filter-output-pre-dnat";
pub const FIREWALL_CHECK: &str = "firewall-check";
pub const FIREWALL_IPS: &str = "firewall-ips";
pub const FIREWALL_ALLOW: &str = "firewall-allow";

// ClientIP session affinity (build/affinity.rs). Each path has its own objects, named by its
// prefix: service-address traffic (ClusterIPs, external and LoadBalancer IPs) to the
// cluster-wide endpoints, keyed by `address . protocol . port`, under `affinity-`; NodePort
// traffic, which may arrive on any NodePort address, by `protocol . NodePort` alone, under
// `affinity-nodeport-`; and the same two for outside traffic to this node's endpoints under
// `externalTrafficPolicy: Local`, under `affinity-local-` and `affinity-nodeport-local-`.
// (Versions that keyed NodePorts by node address had chains named `nodeport-affinity-…`, and
// the slot layout after them `…-slot-<i>` objects and `<prefix><T>s-pick-<k>` chains: new
// names let an upgrade drop those as stale objects, where reusing a name with another comment
// would need the chain recreated while map elements reference it.)

/// Prefix of the affinity objects of service-address traffic to cluster-wide endpoints.
pub const AFFINITY: &str = "affinity-";
/// Prefix of the affinity objects of NodePort traffic to cluster-wide endpoints.
pub const AFFINITY_NODEPORT: &str = "affinity-nodeport-";
/// Prefix of the affinity objects of external-address traffic to this node's endpoints.
pub const AFFINITY_LOCAL: &str = "affinity-local-";
/// Prefix of the affinity objects of NodePort traffic to this node's endpoints.
pub const AFFINITY_NODEPORT_LOCAL: &str = "affinity-nodeport-local-";

/// The dynamic map `client . service key` → the endpoint address the client is pinned to.
pub fn affinity_pins(prefix: &str) -> String {
    format!("{prefix}pins")
}

/// The map `service key . endpoint address` → `endpoint address . port` of the endpoints of
/// services with affinity.
pub fn affinity_endpoints(prefix: &str) -> String {
    format!("{prefix}endpoints")
}

/// The map `service key . index` → endpoint address of services with affinity.
pub fn affinity_pick(prefix: &str) -> String {
    format!("{prefix}pick")
}

/// The chain that follows a client's pin (timeout `timeout`) while its endpoint exists.
pub fn affinity_pinned_chain(prefix: &str, timeout: u32) -> String {
    format!("{prefix}pinned-{timeout}s")
}

/// The chain for services with `k` endpoints and affinity timeout `timeout`: the client's
/// pinned endpoint, or one at random. (The slot layout before it named its chains
/// `<prefix><T>s-pick-<k>`: a new name lets an upgrade replace those as stale objects, where
/// reusing one with another comment would need the chain recreated while map elements
/// reference it, which the kernel refuses with EBUSY.)
pub fn affinity_pick_chain(prefix: &str, timeout: u32, k: usize) -> String {
    format!("{prefix}pick-{k}-pin-{timeout}s")
}

/// The chain that DNATs ClusterIP traffic to one of `k` endpoints.
pub fn pick_chain(k: usize) -> String {
    format!("pick-{k}")
}

/// The map `pick-<k>` reads: service address . protocol . port . slot → endpoint.
pub fn pick_map(k: usize) -> String {
    format!("pick-{k}-endpoints")
}

/// The chain that DNATs external-address traffic to one of `k` endpoints on this node.
pub fn local_pick_chain(k: usize) -> String {
    format!("local-pick-{k}")
}

/// The map `local-pick-<k>` reads: external address . protocol . port . slot → endpoint.
pub fn local_pick_map(k: usize) -> String {
    format!("local-pick-{k}-endpoints")
}

/// The chain that DNATs NodePort traffic to one of `k` endpoints on this node.
pub fn nodeport_local_pick_chain(k: usize) -> String {
    format!("nodeport-local-pick-{k}")
}

/// The map `nodeport-local-pick-<k>` reads: protocol . node port . slot → endpoint.
pub fn nodeport_local_pick_map(k: usize) -> String {
    format!("nodeport-local-pick-{k}-endpoints")
}

/// The chain that DNATs NodePort traffic to one of `k` (cluster-wide) endpoints.
pub fn nodeport_pick_chain(k: usize) -> String {
    format!("nodeport-pick-{k}")
}

/// The map `nodeport-pick-<k>` reads: protocol . node port . slot → endpoint.
pub fn nodeport_pick_map(k: usize) -> String {
    format!("nodeport-pick-{k}-endpoints")
}

/// The maps whose keys begin the keys of endpoints map `set`'s elements, if `set` is one
/// (`[nodeport-][local-]pick-<k>-endpoints`): a Service's address . protocol . port, or
/// protocol . NodePort, before the slot. Elements of endpoints maps carry no comment; the
/// Service-level element with that key in one of these maps names their Service.
pub fn endpoint_owner_maps(set: &str) -> Option<&'static [&'static str]> {
    const ADDRESSES: &[&str] = &[SERVICE_IPS, EXTERNAL_PICKS, EXTERNAL_LOCAL_PICKS];
    const NODEPORTS: &[&str] = &[SERVICE_NODEPORTS, NODEPORT_PICKS, NODEPORT_LOCAL_PICKS];
    let pick = set.strip_suffix("-endpoints")?;
    let (maps, k) = if let Some(k) = pick
        .strip_prefix("nodeport-local-pick-")
        .or_else(|| pick.strip_prefix("nodeport-pick-"))
    {
        (NODEPORTS, k)
    } else {
        let k = pick
            .strip_prefix("local-pick-")
            .or_else(|| pick.strip_prefix("pick-"))?;
        (ADDRESSES, k)
    };
    (!k.is_empty() && k.bytes().all(|b| b.is_ascii_digit())).then_some(maps)
}

/// nft stores comments in userdata and refuses longer ones (NFT_USERDATA_MAXLEN is 256 for the
/// whole userdata; nft itself caps comments at 128 bytes).
pub const COMMENT_MAX: usize = 128;

/// Truncates a comment to what nft accepts, on a character boundary.
pub fn comment(text: &str) -> &str {
    let mut end = text.len().min(COMMENT_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_maps_name_the_maps_their_keys_begin_with() {
        for k in [1, 10, 256] {
            for map in [pick_map(k), local_pick_map(k)] {
                assert_eq!(
                    endpoint_owner_maps(&map),
                    Some(&[SERVICE_IPS, EXTERNAL_PICKS, EXTERNAL_LOCAL_PICKS][..]),
                    "{map}"
                );
            }
            for map in [nodeport_pick_map(k), nodeport_local_pick_map(k)] {
                assert_eq!(
                    endpoint_owner_maps(&map),
                    Some(&[SERVICE_NODEPORTS, NODEPORT_PICKS, NODEPORT_LOCAL_PICKS][..]),
                    "{map}"
                );
            }
        }
        // Affinity's maps keep their comments; they are not endpoints maps in this sense.
        for prefix in [
            AFFINITY,
            AFFINITY_NODEPORT,
            AFFINITY_LOCAL,
            AFFINITY_NODEPORT_LOCAL,
        ] {
            assert_eq!(endpoint_owner_maps(&affinity_endpoints(prefix)), None);
            assert_eq!(endpoint_owner_maps(&affinity_pick(prefix)), None);
        }
        for other in [SERVICE_IPS, "pick--endpoints", "pick-x-endpoints", "pick-1"] {
            assert_eq!(endpoint_owner_maps(other), None, "{other}");
        }
    }

    #[test]
    fn a_comment_is_cut_to_what_nft_accepts_on_a_character_boundary() {
        assert_eq!(comment("shop/web:http"), "shop/web:http");
        let long = "n".repeat(200);
        assert_eq!(comment(&long), &long[..COMMENT_MAX]);
        // A two-byte character across the limit is left out whole.
        let straddling = format!("{}é", "n".repeat(COMMENT_MAX - 1));
        assert_eq!(comment(&straddling), &straddling[..COMMENT_MAX - 1]);
        let exact = "n".repeat(COMMENT_MAX);
        assert_eq!(comment(&exact), exact);
    }
}
