//! The effective configuration and how it is merged: flag > `NODEPROXY_*` environment > config
//! file (TOML) > default, for every field, with the source of each value kept for
//! `--print-config`.

use std::path::PathBuf;

use ipnet::IpNet;

/// The effective configuration after merging all sources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Node name used for endpoint locality and the Node lookup (`--hostname-override`, else
    /// the host name), lowercased.
    pub hostname_override: Option<String>,
    /// `--cluster-cidr`: pod CIDRs, at most one per family. Traffic to a ClusterIP from outside
    /// them is masqueraded.
    pub cluster_cidr: Vec<IpNet>,
    /// `--masquerade-all`: masquerade all traffic to ClusterIPs.
    pub masquerade_all: bool,
    /// `--masquerade-bit`: the packet mark bit (0..=31) used to flag packets for masquerade.
    pub masquerade_bit: u8,
    /// `--nodeport-addresses`.
    pub nodeport_addresses: NodePortAddresses,
    /// `--from-file`: read cluster objects from these files instead of the API server.
    pub from_file: Vec<PathBuf>,
    /// `--log-format`.
    pub log_format: LogFormat,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            hostname_override: None,
            cluster_cidr: Vec::new(),
            masquerade_all: false,
            masquerade_bit: 14,
            nodeport_addresses: NodePortAddresses::Primary,
            from_file: Vec::new(),
            log_format: LogFormat::Text,
        }
    }
}

impl Config {
    /// The packet mark value with only the masquerade bit set.
    pub fn masquerade_mark(&self) -> u32 {
        1u32 << (self.masquerade_bit & 31)
    }
}

/// Which local addresses answer NodePorts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// kube-proxy's nftables default: the Node object's primary InternalIP of each family.
    Primary,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}
