//! The effective configuration and how it is merged: flag > `NODEPROXY_*` environment > config
//! file (TOML) > default, for every setting, with the source of each value kept for
//! `--print-config`.
//!
//! The order is fixed and the same for every setting because a config file once silently
//! overrode `--hostname-override` in production (DESIGN.md §1): a lower source is consulted for a
//! setting only when no higher source gave it. Every value, whatever its source, goes through the
//! same validation, so an error always names the setting, the value, where it came from and what
//! would be valid.
//!
//! Settings are declared once, in `config/settings.rs`; `load.rs` merges the sources,
//! `values.rs` and `duration.rs` parse values, `render.rs` writes everything that is generated
//! from the declarations.

mod duration;
mod kube_proxy;
mod load;
mod render;
mod settings;
mod values;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;

pub use crate::cli::Mode;
use crate::model::IpFamily;
pub use crate::ruleset::NodePortAddresses;
use crate::ruleset::{DetectLocal, Settings};
pub use kube_proxy::migration_tables;
pub use load::{Provenance, Source, load, unknown_env_vars};
use load::{describe_unknown_keys, valid_keys};
pub use render::{command, readme_table, render_default_file, render_effective};
pub use settings::{Config, Field};
use values::shorten;

/// `--healthz-bind-address` default: all IPv4 addresses, kube-proxy's port.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 10256);
/// `--metrics-bind-address` default: loopback only, kube-proxy's port.
pub const DEFAULT_METRICS_BIND_ADDRESS: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10249);
/// `--min-sync-period` default.
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);
/// `--sync-period` default.
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);
/// `--lock-file` default.
/// In a directory of its own: the systemd unit's `RuntimeDirectory=nodeproxy` (the unit's
/// sandbox makes the rest of /run read-only) and the DaemonSet's hostPath, so a pod and a
/// unit on one node lock the same file.
pub const DEFAULT_LOCK_FILE: &str = "/run/nodeproxy/nodeproxy.lock";

impl Config {
    /// The packet mark value with only the masquerade bit set.
    pub fn masquerade_mark(&self) -> u32 {
        1u32 << (self.masquerade_bit & 31)
    }

    /// How local traffic is detected. `load` already resolved the default (see the field);
    /// this is the accessor to use, so callers do not depend on that.
    pub fn detect_local_mode(&self) -> DetectLocalMode {
        self.detect_local_mode
    }

    /// kube-proxy's health timeout: the health check fails when no sync succeeded for twice
    /// the sync period.
    pub fn health_timeout(&self) -> Duration {
        self.sync_period.saturating_mul(2)
    }

    /// The API client's request rate.
    pub fn request_rate(&self) -> crate::source::watch::RequestRate {
        crate::source::watch::RequestRate {
            qps: self.kube_api_qps.0,
            burst: self.kube_api_burst,
        }
    }

    /// The conntrack settings for `node_setup`.
    pub fn conntrack(&self) -> crate::node_setup::Conntrack {
        crate::node_setup::Conntrack {
            max_per_core: self.conntrack_max_per_core,
            min: self.conntrack_min,
            tcp_established_timeout: self.conntrack_tcp_timeout_established,
            tcp_close_wait_timeout: self.conntrack_tcp_timeout_close_wait,
            tcp_be_liberal: self.conntrack_tcp_be_liberal,
            udp_timeout: self.conntrack_udp_timeout,
            udp_stream_timeout: self.conntrack_udp_timeout_stream,
        }
    }

    /// The service CIDR of one family, if given.
    pub fn service_cidr_of(&self, family: IpFamily) -> Option<IpNet> {
        self.service_cidr
            .iter()
            .copied()
            .find(|net| IpFamily::of(&net.addr()) == family)
    }
}

/// `--detect-local-mode`: how traffic from pods on this node is told apart from other traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetectLocalMode {
    /// `ClusterCIDR`: the source address is in `--cluster-cidr`.
    ClusterCidr,
    /// `NodeCIDR`: the source address is in the Node object's `spec.podCIDRs`.
    NodeCidr,
    /// `BridgeInterface`: the packet arrives on `--pod-bridge-interface`.
    BridgeInterface,
    /// `InterfaceNamePrefix`: the packet arrives on an interface named with
    /// `--pod-interface-name-prefix`.
    InterfaceNamePrefix,
}

impl DetectLocalMode {
    pub const ALL: [DetectLocalMode; 4] = [
        DetectLocalMode::ClusterCidr,
        DetectLocalMode::NodeCidr,
        DetectLocalMode::BridgeInterface,
        DetectLocalMode::InterfaceNamePrefix,
    ];

    /// The mode used when none is given: `ClusterCIDR` when cluster CIDRs are configured, else
    /// `NodeCIDR` (the Node's podCIDRs).
    pub fn default_for(cluster_cidr: &[IpNet]) -> DetectLocalMode {
        if cluster_cidr.is_empty() {
            DetectLocalMode::NodeCidr
        } else {
            DetectLocalMode::ClusterCidr
        }
    }

    /// The spelling kube-proxy uses.
    pub fn as_str(self) -> &'static str {
        match self {
            DetectLocalMode::ClusterCidr => "ClusterCIDR",
            DetectLocalMode::NodeCidr => "NodeCIDR",
            DetectLocalMode::BridgeInterface => "BridgeInterface",
            DetectLocalMode::InterfaceNamePrefix => "InterfaceNamePrefix",
        }
    }

    /// Parses kube-proxy's spelling, case-insensitively.
    fn parse(text: &str) -> Option<DetectLocalMode> {
        DetectLocalMode::ALL
            .into_iter()
            .find(|mode| mode.as_str().eq_ignore_ascii_case(text.trim()))
    }
}

/// `--table-ownership`: nftables table ownership (kernel 6.9+ for the `persist` flag).
///
/// `Auto` (the default) uses it where the kernel supports it: while nodeproxy runs no other
/// process can change or delete its tables (a firewall reload's `nft flush ruleset` included),
/// and they stay in place, unowned, when it exits. The price: an orphaned table carries the
/// `persist` flag, which `nft` before 1.1 prints as an empty `flags` line, so `nft list ruleset`
/// output no longer loads with `nft -f` on such hosts. `Off` creates ordinary tables, which
/// anyone may change (nodeproxy repairs them at its next sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableOwnership {
    Auto,
    Off,
}

/// `--kube-api-qps`: requests per second, a positive finite number (the parser checks), so
/// equality by value is an equivalence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Qps(pub f64);

impl Eq for Qps {}

/// `--log-format`: how log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl Config {
    /// The node's name: `hostname_override` if set, else the host name, lowercased and trimmed.
    ///
    /// Never returns an empty name: locality is decided by node name, and an empty one would
    /// silently match no endpoint (the `externalTrafficPolicy: Local` outage of DESIGN.md §1).
    pub fn node_name(&self) -> Result<String, ConfigError> {
        node_name_from(self.hostname_override.as_deref(), || {
            nix::unistd::gethostname().map_err(|errno| errno.to_string())
        })
    }
}

/// `Config::node_name` with the host-name lookup injected, so the logic is testable without
/// depending on the test machine's host name.
fn node_name_from(
    hostname_override: Option<&str>,
    hostname: impl FnOnce() -> Result<OsString, String>,
) -> Result<String, ConfigError> {
    // `Config`'s fields are public, so normalise again rather than trust that `load` built it.
    if let Some(name) = hostname_override.map(normalize_hostname)
        && !name.is_empty()
    {
        return Ok(name);
    }
    let raw = hostname().map_err(|error| {
        ConfigError::NodeName(format!(
            "gethostname failed ({error}); set --hostname-override"
        ))
    })?;
    let Some(raw) = raw.to_str() else {
        return Err(ConfigError::NodeName(format!(
            "the host name {raw:?} is not UTF-8; set --hostname-override"
        )));
    };
    let name = normalize_hostname(raw);
    if name.is_empty() {
        return Err(ConfigError::NodeName(
            "the host name is empty; set --hostname-override".to_string(),
        ));
    }
    Ok(name)
}

fn normalize_hostname(raw: &str) -> String {
    raw.trim().to_lowercase()
}

/// The environment variable naming the config file (the `--config` flag wins over it).
pub const CONFIG_ENV_VAR: &str = "NODEPROXY_CONFIG";

/// Everything `load` decided: what to do, with which configuration, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub mode: Mode,
    pub config: Config,
    pub provenance: Provenance,
    /// Log verbosity from `-v` (counted) / `--v N`; the higher of the two.
    pub verbosity: u8,
    /// `--allow-empty`: an input without any Service may be programmed.
    pub allow_empty: bool,
    /// `--max-input-size`: the most bytes read from each `--from-file` file.
    pub max_input_bytes: u64,
    /// What the command line or the config file asked for that nodeproxy does not do (kube-proxy
    /// flags and fields without effect), one line each, to be logged.
    pub warnings: Vec<String>,
}

/// `--max-input-size` default.
pub use crate::source::file::DEFAULT_MAX_FILE_BYTES as DEFAULT_MAX_INPUT_BYTES;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The command line is malformed (unknown flag, missing value, two mode flags, ...);
    /// carries clap's rendered message.
    #[error("{0}")]
    Usage(String),
    /// `--help` or `--version` was asked for: print this text to stdout and exit 0.
    #[error("{0}")]
    HelpOrVersion(String),
    #[error("cannot read config file {} (from {origin})", .path.display())]
    ReadFile {
        path: PathBuf,
        origin: String,
        #[source]
        error: std::io::Error,
    },
    #[error("config file {} is not valid TOML: {message}", .path.display())]
    ParseFile { path: PathBuf, message: String },
    #[error(
        "config file {}: {}; valid keys are: {}",
        .path.display(),
        describe_unknown_keys(.keys),
        valid_keys()
    )]
    UnknownKey { path: PathBuf, keys: Vec<String> },
    #[error(
        "kube-proxy config file {}: unknown {} `{}`; KubeProxyConfiguration ({}) has no such \
         field",
        .path.display(),
        if .fields.len() == 1 { "field" } else { "fields" },
        .fields.join("`, `"),
        kube_proxy::API_VERSION
    )]
    UnknownKubeProxyField { path: PathBuf, fields: Vec<String> },
    /// A value that does not parse or is out of range. `origin` is `Source::describe`.
    #[error("invalid {key} `{}` from {origin}: {expected}", shorten(.value))]
    Invalid {
        key: &'static str,
        value: String,
        origin: String,
        expected: String,
    },
    #[error("cannot determine the node name: {0}")]
    NodeName(String),
}

impl ConfigError {
    /// The process exit status for this error: 0 for help/version (not a failure), 1 when the
    /// host could not tell its name (a runtime failure), 2 for usage and configuration errors.
    pub fn exit_code(&self) -> u8 {
        match self {
            ConfigError::HelpOrVersion(_) => 0,
            ConfigError::NodeName(_) => 1,
            _ => 2,
        }
    }
}

/// Warnings for cluster CIDRs that contain ClusterIPs: a sign that the service network was
/// given where the pod network belongs (DESIGN.md §1).
///
/// `cluster_ips` is `(service, ClusterIP)` pairs, the service shown as `namespace/name` so the
/// message names one the operator will recognise (formatted only for the message: at 50k
/// Services, formatting every name up front took 16 ms of `--once`). One message per
/// offending CIDR, naming the first ClusterIP found and counting the others, so a large
/// cluster does not flood the log.
pub fn overlapping_cluster_cidr<S: fmt::Display>(
    config: &Config,
    cluster_ips: &[(S, IpAddr)],
) -> Vec<String> {
    let mut messages = Vec::new();
    for cidr in &config.cluster_cidr {
        let inside: BTreeMap<IpAddr, &S> = cluster_ips
            .iter()
            .filter(|(_, ip)| cidr.contains(ip))
            .map(|(service, ip)| (*ip, service))
            .collect();
        let Some((ip, service)) = inside.iter().next() else {
            continue;
        };
        let others = match inside.len() - 1 {
            0 => String::new(),
            1 => " (and 1 other ClusterIP)".to_string(),
            n => format!(" (and {n} other ClusterIPs)"),
        };
        messages.push(format!(
            "--cluster-cidr {cidr} contains ClusterIP {ip} of {service}{others}: the cluster \
             CIDR must be the pod network, not the service network. Whether traffic to a \
             ClusterIP comes from a pod is decided by its source address, which is a pod IP and \
             never a ClusterIP, so with this value traffic from pods would not be recognised as \
             cluster-internal and would be masqueraded (hiding client addresses), and the \
             masquerade decision for other traffic would rest on the wrong network. Set \
             --cluster-cidr to the pod CIDRs, or leave it unset to use the Node's \
             spec.podCIDRs"
        ));
    }
    messages
}

/// The builder's settings: the configuration with the node name resolved. Built here, so the
/// builder knows nothing of the configuration's form.
impl Settings {
    /// The settings `config` asks for on the node named `node_name`.
    pub fn new(config: &Config, node_name: String) -> Settings {
        let detect_local = match config.detect_local_mode() {
            DetectLocalMode::ClusterCidr => DetectLocal::ClusterCidr,
            DetectLocalMode::NodeCidr => DetectLocal::NodeCidr,
            // Config validation requires the parameter with its mode; an empty one yields no
            // detector (see `local_match`), never a match on every interface.
            DetectLocalMode::BridgeInterface => DetectLocal::BridgeInterface(
                config.pod_bridge_interface.clone().unwrap_or_default(),
            ),
            DetectLocalMode::InterfaceNamePrefix => DetectLocal::InterfaceNamePrefix(
                config.pod_interface_name_prefix.clone().unwrap_or_default(),
            ),
        };
        Settings {
            node_name,
            cluster_cidrs: config.cluster_cidr.clone(),
            masquerade_all: config.masquerade_all,
            mark: config.masquerade_mark(),
            nodeport_addresses: config.nodeport_addresses.clone(),
            detect_local,
            service_cidrs: config.service_cidr.clone(),
            own_tables: false,
        }
    }
}

#[cfg(test)]
mod tests;
