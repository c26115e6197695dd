//! The effective configuration and how it is merged: flag > `NODEPROXY_*` environment > config
//! file (TOML) > default, for every field, with the source of each value kept for
//! `--print-config`.
//!
//! The order is fixed and the same for every field because a config file once silently
//! overrode `--hostname-override` in production (DESIGN.md §1): a lower source is consulted for a
//! field only when no higher source gave it. Every value, whatever its source, goes through the
//! same validation, so an error always names the field, the value, where it came from and what
//! would be valid.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser as _;
use ipnet::IpNet;

pub use crate::cli::Mode;
use crate::cli::{Cli, Command};
use crate::explain;
use crate::model::IpFamily;
pub use crate::ruleset::NodePortAddresses;
use crate::ruleset::{DetectLocal, Settings};

/// The effective configuration after merging all sources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Node name used for endpoint locality and the Node lookup (`--hostname-override`, else
    /// the host name), lowercased.
    pub hostname_override: Option<String>,
    /// `--kubeconfig`: the kubeconfig file used to reach the API server; `None` when unset.
    pub kubeconfig: Option<PathBuf>,
    /// `--master`: the API server URL (http or https), overriding the kubeconfig's.
    pub master: Option<String>,
    /// `--cluster-cidr`: pod CIDRs, at most one per family. Traffic to a ClusterIP from outside
    /// them is masqueraded.
    pub cluster_cidr: Vec<IpNet>,
    /// `--service-cidr`: service IP ranges, at most one per family. Traffic to an unallocated
    /// IP inside them is dropped.
    pub service_cidr: Vec<IpNet>,
    /// `--detect-local-mode`: how traffic from local pods is recognised. Always resolved: when
    /// no source gives it, `load` sets `ClusterCIDR` if `cluster_cidr` is non-empty, else
    /// `NodeCIDR` (its provenance stays `Source::Default`).
    pub detect_local_mode: DetectLocalMode,
    /// `--pod-bridge-interface`: the bridge local pods are attached to (`BridgeInterface`).
    pub pod_bridge_interface: Option<String>,
    /// `--pod-interface-name-prefix`: the name prefix of local pod interfaces
    /// (`InterfaceNamePrefix`).
    pub pod_interface_name_prefix: Option<String>,
    /// `--masquerade-all`: masquerade all traffic to ClusterIPs.
    pub masquerade_all: bool,
    /// `--masquerade-bit`: the packet mark bit (0..=31) used to flag packets for masquerade.
    pub masquerade_bit: u8,
    /// `--nodeport-addresses`.
    pub nodeport_addresses: NodePortAddresses,
    /// `--healthz-bind-address`: where the health check server listens; `None` disables it.
    pub healthz_bind_address: Option<SocketAddr>,
    /// `--metrics-bind-address`: where the metrics server listens; `None` disables it.
    pub metrics_bind_address: Option<SocketAddr>,
    /// `--min-sync-period`: the shortest interval between two syncs of the ruleset.
    pub min_sync_period: Duration,
    /// `--sync-period`: the longest interval between two syncs of the ruleset (> 0).
    pub sync_period: Duration,
    /// `--lock-file`: the file locked so that only one nodeproxy runs on the node.
    pub lock_file: PathBuf,
    /// `--cleanup-kube-proxy`: remove what kube-proxy programmed.
    pub cleanup_kube_proxy: bool,
    /// `--from-file`: read cluster objects from these files instead of the API server.
    pub from_file: Vec<PathBuf>,
    /// `--log-format`.
    pub log_format: LogFormat,
    /// `--table-ownership`: whether our tables are owned by the running process.
    pub table_ownership: TableOwnership,
}

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

impl Default for Config {
    fn default() -> Config {
        let cluster_cidr = Vec::new();
        Config {
            hostname_override: None,
            kubeconfig: None,
            master: None,
            detect_local_mode: DetectLocalMode::default_for(&cluster_cidr),
            cluster_cidr,
            service_cidr: Vec::new(),
            pod_bridge_interface: None,
            pod_interface_name_prefix: None,
            masquerade_all: false,
            masquerade_bit: 14,
            nodeport_addresses: NodePortAddresses::default(),
            healthz_bind_address: Some(DEFAULT_HEALTHZ_BIND_ADDRESS),
            metrics_bind_address: Some(DEFAULT_METRICS_BIND_ADDRESS),
            min_sync_period: DEFAULT_MIN_SYNC_PERIOD,
            sync_period: DEFAULT_SYNC_PERIOD,
            lock_file: PathBuf::from(DEFAULT_LOCK_FILE),
            cleanup_kube_proxy: false,
            from_file: Vec::new(),
            log_format: LogFormat::Text,
            table_ownership: TableOwnership::Auto,
        }
    }
}

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

/// One configurable field; the single table of its names in every source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Field {
    HostnameOverride,
    Kubeconfig,
    Master,
    ClusterCidr,
    ServiceCidr,
    DetectLocalMode,
    PodBridgeInterface,
    PodInterfaceNamePrefix,
    MasqueradeAll,
    MasqueradeBit,
    NodePortAddresses,
    HealthzBindAddress,
    MetricsBindAddress,
    MinSyncPeriod,
    SyncPeriod,
    LockFile,
    CleanupKubeProxy,
    FromFile,
    LogFormat,
    TableOwnership,
}

impl Field {
    /// Every field, in `Config` order (also the `--print-config` order).
    pub const ALL: [Field; 20] = [
        Field::HostnameOverride,
        Field::Kubeconfig,
        Field::Master,
        Field::ClusterCidr,
        Field::ServiceCidr,
        Field::DetectLocalMode,
        Field::PodBridgeInterface,
        Field::PodInterfaceNamePrefix,
        Field::MasqueradeAll,
        Field::MasqueradeBit,
        Field::NodePortAddresses,
        Field::HealthzBindAddress,
        Field::MetricsBindAddress,
        Field::MinSyncPeriod,
        Field::SyncPeriod,
        Field::LockFile,
        Field::CleanupKubeProxy,
        Field::FromFile,
        Field::LogFormat,
        Field::TableOwnership,
    ];

    /// The config-file key (the flag name in snake_case).
    pub fn key(self) -> &'static str {
        match self {
            Field::HostnameOverride => "hostname_override",
            Field::Kubeconfig => "kubeconfig",
            Field::Master => "master",
            Field::ClusterCidr => "cluster_cidr",
            Field::ServiceCidr => "service_cidr",
            Field::DetectLocalMode => "detect_local_mode",
            Field::PodBridgeInterface => "pod_bridge_interface",
            Field::PodInterfaceNamePrefix => "pod_interface_name_prefix",
            Field::MasqueradeAll => "masquerade_all",
            Field::MasqueradeBit => "masquerade_bit",
            Field::NodePortAddresses => "nodeport_addresses",
            Field::HealthzBindAddress => "healthz_bind_address",
            Field::MetricsBindAddress => "metrics_bind_address",
            Field::MinSyncPeriod => "min_sync_period",
            Field::SyncPeriod => "sync_period",
            Field::LockFile => "lock_file",
            Field::CleanupKubeProxy => "cleanup_kube_proxy",
            Field::FromFile => "from_file",
            Field::LogFormat => "log_format",
            Field::TableOwnership => "table_ownership",
        }
    }

    /// The command-line flag, as kube-proxy spells it.
    pub fn flag(self) -> &'static str {
        match self {
            Field::HostnameOverride => "--hostname-override",
            Field::Kubeconfig => "--kubeconfig",
            Field::Master => "--master",
            Field::ClusterCidr => "--cluster-cidr",
            Field::ServiceCidr => "--service-cidr",
            Field::DetectLocalMode => "--detect-local-mode",
            Field::PodBridgeInterface => "--pod-bridge-interface",
            Field::PodInterfaceNamePrefix => "--pod-interface-name-prefix",
            Field::MasqueradeAll => "--masquerade-all",
            Field::MasqueradeBit => "--masquerade-bit",
            Field::NodePortAddresses => "--nodeport-addresses",
            Field::HealthzBindAddress => "--healthz-bind-address",
            Field::MetricsBindAddress => "--metrics-bind-address",
            Field::MinSyncPeriod => "--min-sync-period",
            Field::SyncPeriod => "--sync-period",
            Field::LockFile => "--lock-file",
            Field::CleanupKubeProxy => "--cleanup-kube-proxy",
            Field::FromFile => "--from-file",
            Field::LogFormat => "--log-format",
            Field::TableOwnership => "--table-ownership",
        }
    }

    /// The environment variable: `NODEPROXY_` and the key in upper case.
    pub fn env_var(self) -> &'static str {
        match self {
            Field::HostnameOverride => "NODEPROXY_HOSTNAME_OVERRIDE",
            Field::Kubeconfig => "NODEPROXY_KUBECONFIG",
            Field::Master => "NODEPROXY_MASTER",
            Field::ClusterCidr => "NODEPROXY_CLUSTER_CIDR",
            Field::ServiceCidr => "NODEPROXY_SERVICE_CIDR",
            Field::DetectLocalMode => "NODEPROXY_DETECT_LOCAL_MODE",
            Field::PodBridgeInterface => "NODEPROXY_POD_BRIDGE_INTERFACE",
            Field::PodInterfaceNamePrefix => "NODEPROXY_POD_INTERFACE_NAME_PREFIX",
            Field::MasqueradeAll => "NODEPROXY_MASQUERADE_ALL",
            Field::MasqueradeBit => "NODEPROXY_MASQUERADE_BIT",
            Field::NodePortAddresses => "NODEPROXY_NODEPORT_ADDRESSES",
            Field::HealthzBindAddress => "NODEPROXY_HEALTHZ_BIND_ADDRESS",
            Field::MetricsBindAddress => "NODEPROXY_METRICS_BIND_ADDRESS",
            Field::MinSyncPeriod => "NODEPROXY_MIN_SYNC_PERIOD",
            Field::SyncPeriod => "NODEPROXY_SYNC_PERIOD",
            Field::LockFile => "NODEPROXY_LOCK_FILE",
            Field::CleanupKubeProxy => "NODEPROXY_CLEANUP_KUBE_PROXY",
            Field::FromFile => "NODEPROXY_FROM_FILE",
            Field::LogFormat => "NODEPROXY_LOG_FORMAT",
            Field::TableOwnership => "NODEPROXY_TABLE_OWNERSHIP",
        }
    }
}

/// The environment variable naming the config file (the `--config` flag wins over it).
pub const CONFIG_ENV_VAR: &str = "NODEPROXY_CONFIG";

/// `NODEPROXY_*` variables that are not settings but are read (or set for the unit's command
/// line) all the same.
const OTHER_ENV_VARS: [&str; 4] = [
    CONFIG_ENV_VAR,
    // The log filter (tracing's EnvFilter syntax).
    "NODEPROXY_LOG",
    // The packaged unit expands it into extra command-line flags.
    "NODEPROXY_EXTRA_ARGS",
    crate::notify::HANG_WRITER_ENV,
];

/// One warning for each `NODEPROXY_*` variable in `names` that nodeproxy does not read: a
/// misspelt `NODEPROXY_CLUSTER_CIRD` would otherwise be silently ignored. Names the closest
/// valid variable when one is near.
pub fn unknown_env_vars(names: impl IntoIterator<Item = String>) -> Vec<String> {
    let known: Vec<&str> = Field::ALL
        .iter()
        .map(|f| f.env_var())
        .chain(OTHER_ENV_VARS)
        .collect();
    names
        .into_iter()
        .filter(|name| name.starts_with("NODEPROXY_") && !known.contains(&name.as_str()))
        .map(|name| {
            let closest = known
                .iter()
                .map(|k| (edit_distance(&name, k), *k))
                .min()
                .filter(|(d, _)| *d <= 3)
                .map(|(_, k)| format!(" (did you mean {k}?)"))
                .unwrap_or_default();
            format!(
                "environment variable {} is not one nodeproxy reads; ignored{closest}",
                single_line(&name)
            )
        })
        .collect()
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// Where an effective value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag (the field's `Field::flag`).
    Flag,
    /// An environment variable, by name.
    Env(String),
    /// The config file at this path.
    File(PathBuf),
    /// The built-in default.
    Default,
}

impl Source {
    /// Human description, e.g. `flag --hostname-override`, `env NODEPROXY_CLUSTER_CIDR`,
    /// `file /etc/nodeproxy/config.toml`, `default`. `flag` is the flag the value was given
    /// with, since `Source::Flag` does not carry it.
    pub fn describe(&self, flag: &str) -> String {
        match self {
            Source::Flag => format!("flag {flag}"),
            Source::Env(var) => format!("env {var}"),
            Source::File(path) => format!("file {}", single_line(&path.to_string_lossy())),
            Source::Default => "default".to_string(),
        }
    }
}

/// The source of every effective value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    /// The config file that was read, and what named it (`--config` or `NODEPROXY_CONFIG`).
    pub config_file: Option<(PathBuf, Source)>,
    pub hostname_override: Source,
    pub kubeconfig: Source,
    pub master: Source,
    pub cluster_cidr: Source,
    pub service_cidr: Source,
    pub detect_local_mode: Source,
    pub pod_bridge_interface: Source,
    pub pod_interface_name_prefix: Source,
    pub masquerade_all: Source,
    pub masquerade_bit: Source,
    pub nodeport_addresses: Source,
    pub healthz_bind_address: Source,
    pub metrics_bind_address: Source,
    pub min_sync_period: Source,
    pub sync_period: Source,
    pub lock_file: Source,
    pub cleanup_kube_proxy: Source,
    pub from_file: Source,
    pub log_format: Source,
    pub table_ownership: Source,
}

impl Default for Provenance {
    fn default() -> Provenance {
        Provenance {
            config_file: None,
            hostname_override: Source::Default,
            kubeconfig: Source::Default,
            master: Source::Default,
            cluster_cidr: Source::Default,
            service_cidr: Source::Default,
            detect_local_mode: Source::Default,
            pod_bridge_interface: Source::Default,
            pod_interface_name_prefix: Source::Default,
            masquerade_all: Source::Default,
            masquerade_bit: Source::Default,
            nodeport_addresses: Source::Default,
            healthz_bind_address: Source::Default,
            metrics_bind_address: Source::Default,
            min_sync_period: Source::Default,
            sync_period: Source::Default,
            lock_file: Source::Default,
            cleanup_kube_proxy: Source::Default,
            from_file: Source::Default,
            log_format: Source::Default,
            table_ownership: Source::Default,
        }
    }
}

impl Provenance {
    /// The source of one field.
    pub fn of(&self, field: Field) -> &Source {
        match field {
            Field::HostnameOverride => &self.hostname_override,
            Field::Kubeconfig => &self.kubeconfig,
            Field::Master => &self.master,
            Field::ClusterCidr => &self.cluster_cidr,
            Field::ServiceCidr => &self.service_cidr,
            Field::DetectLocalMode => &self.detect_local_mode,
            Field::PodBridgeInterface => &self.pod_bridge_interface,
            Field::PodInterfaceNamePrefix => &self.pod_interface_name_prefix,
            Field::MasqueradeAll => &self.masquerade_all,
            Field::MasqueradeBit => &self.masquerade_bit,
            Field::NodePortAddresses => &self.nodeport_addresses,
            Field::HealthzBindAddress => &self.healthz_bind_address,
            Field::MetricsBindAddress => &self.metrics_bind_address,
            Field::MinSyncPeriod => &self.min_sync_period,
            Field::SyncPeriod => &self.sync_period,
            Field::LockFile => &self.lock_file,
            Field::CleanupKubeProxy => &self.cleanup_kube_proxy,
            Field::FromFile => &self.from_file,
            Field::LogFormat => &self.log_format,
            Field::TableOwnership => &self.table_ownership,
        }
    }

    fn of_mut(&mut self, field: Field) -> &mut Source {
        match field {
            Field::HostnameOverride => &mut self.hostname_override,
            Field::Kubeconfig => &mut self.kubeconfig,
            Field::Master => &mut self.master,
            Field::ClusterCidr => &mut self.cluster_cidr,
            Field::ServiceCidr => &mut self.service_cidr,
            Field::DetectLocalMode => &mut self.detect_local_mode,
            Field::PodBridgeInterface => &mut self.pod_bridge_interface,
            Field::PodInterfaceNamePrefix => &mut self.pod_interface_name_prefix,
            Field::MasqueradeAll => &mut self.masquerade_all,
            Field::MasqueradeBit => &mut self.masquerade_bit,
            Field::NodePortAddresses => &mut self.nodeport_addresses,
            Field::HealthzBindAddress => &mut self.healthz_bind_address,
            Field::MetricsBindAddress => &mut self.metrics_bind_address,
            Field::MinSyncPeriod => &mut self.min_sync_period,
            Field::SyncPeriod => &mut self.sync_period,
            Field::LockFile => &mut self.lock_file,
            Field::CleanupKubeProxy => &mut self.cleanup_kube_proxy,
            Field::FromFile => &mut self.from_file,
            Field::LogFormat => &mut self.log_format,
            Field::TableOwnership => &mut self.table_ownership,
        }
    }
}

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
}

/// `--max-input-size` default.
pub use crate::source::file::DEFAULT_MAX_FILE_BYTES as DEFAULT_MAX_INPUT_BYTES;

/// Parses `--max-input-size`: bytes, or a number with a binary suffix (`Ki`, `Mi`, `Gi`).
fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, scale) = [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)]
        .iter()
        .find_map(|(suffix, scale)| text.strip_suffix(suffix).map(|d| (d, *scale)))
        .unwrap_or((text, 1));
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

/// Why the configuration could not be loaded. `exit_code` says how the process should end.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The command line is malformed (unknown flag, missing value, two mode flags, ...);
    /// carries clap's rendered message.
    #[error("{0}")]
    Usage(String),
    /// `--help` or `--version` was asked for: print this text to stdout and exit 0.
    #[error("{0}")]
    HelpOrVersion(String),
    #[error("cannot read config file {} (from {origin}): {error}", .path.display())]
    ReadFile {
        path: PathBuf,
        origin: String,
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

fn valid_keys() -> String {
    Field::ALL
        .iter()
        .map(|field| field.key())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Names the unknown keys, with a hint when one is a known key spelled as a flag
/// (`hostname-override`) or as in kube-proxy's YAML (`hostnameOverride`).
fn describe_unknown_keys(keys: &[String]) -> String {
    let described: Vec<String> = keys
        .iter()
        .map(|key| {
            let normalized = snake_case(key);
            match Field::ALL.iter().find(|field| field.key() == normalized) {
                Some(field) => format!("`{key}` (did you mean `{}`?)", field.key()),
                None => format!("`{key}`"),
            }
        })
        .collect();
    let noun = if keys.len() == 1 { "key" } else { "keys" };
    format!("unknown {noun} {}", described.join(", "))
}

fn snake_case(key: &str) -> String {
    let mut out = String::new();
    let mut previous_upper = true;
    for c in key.trim_start_matches('-').chars() {
        match c {
            '-' => out.push('_'),
            // An acronym is one word: `clusterCIDR` is `cluster_cidr`.
            c if c.is_ascii_uppercase() => {
                if !previous_upper && !out.is_empty() {
                    out.push('_');
                }
                out.push(c.to_ascii_lowercase());
            }
            c => out.push(c),
        }
        previous_upper = c.is_ascii_uppercase();
    }
    // kube-proxy's YAML spells it `nodePortAddresses`, our key has no underscore after "node".
    out.replace("node_port", "nodeport")
}

/// A value as an error message shows it: whole up to 120 characters, else its start and its
/// length, so that a mistaken multi-megabyte value does not flood the terminal or the journal.
fn shorten(value: &str) -> String {
    const KEEP: usize = 100;
    if value.chars().count() <= 120 {
        return value.to_string();
    }
    let start: String = value.chars().take(KEEP).collect();
    format!("{start}… ({} bytes in all)", value.len())
}

/// Keeps a path or value on one line in comments and messages; a newline in a `--print-config`
/// comment would end the comment and break the TOML.
fn single_line(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Parses the command line, consults the environment and the config file, and returns the
/// effective configuration with the source of every value.
///
/// `args` is the whole command line including the program name, as `std::env::args_os()`
/// yields it. `env` looks up an environment variable; pass
/// `&|name| std::env::var(name).ok()` in the binary. An empty variable counts as unset, as it
/// commonly comes from an unset template value. The config file is read only when `--config`
/// or `NODEPROXY_CONFIG` names one.
pub fn load(
    args: impl IntoIterator<Item = OsString>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Loaded, ConfigError> {
    load_with(args, env, &|path| std::fs::read_to_string(path))
}

/// `load` with the file system injected, so tests never touch disk.
fn load_with(
    args: impl IntoIterator<Item = OsString>,
    env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&Path) -> std::io::Result<String>,
) -> Result<Loaded, ConfigError> {
    let cli = Cli::try_parse_from(args).map_err(clap_error)?;
    let env = |name: &str| env(name).filter(|value| !value.is_empty());

    let config_file = match (&cli.config, env(CONFIG_ENV_VAR)) {
        (Some(path), _) => Some((path.clone(), Source::Flag)),
        (None, Some(path)) => Some((PathBuf::from(path), Source::Env(CONFIG_ENV_VAR.to_string()))),
        (None, None) => None,
    };
    let file = match &config_file {
        Some((path, origin)) => {
            let text = read_file(path).map_err(|error| ConfigError::ReadFile {
                path: path.clone(),
                origin: origin.describe("--config"),
                error,
            })?;
            Some((path.clone(), parse_file(path, &text)?))
        }
        None => None,
    };

    let mut config = Config::default();
    let mut provenance = Provenance {
        config_file,
        ..Provenance::default()
    };
    for field in Field::ALL {
        let flag = flag_input(&cli, field);
        let Some((input, source)) = choose(field, flag, &env, file.as_ref()) else {
            continue;
        };
        apply(&mut config, field, &input, &source)?;
        *provenance.of_mut(field) = source;
    }
    // The detect-local-mode default depends on the merged cluster CIDR, so it is resolved
    // only now; its source stays `default`.
    if provenance.detect_local_mode == Source::Default {
        config.detect_local_mode = DetectLocalMode::default_for(&config.cluster_cidr);
    }
    validate_combination(&config, &provenance)?;

    let max_input_bytes = match &cli.max_input_size {
        None => DEFAULT_MAX_INPUT_BYTES,
        Some(text) => parse_size(text)
            .filter(|&n| n > 0)
            .ok_or_else(|| ConfigError::Invalid {
                key: "--max-input-size",
                value: single_line(text),
                origin: "the command line".to_string(),
                expected: "must be a positive number of bytes, optionally with a suffix Ki, \
                           Mi or Gi, e.g. 1Gi"
                    .to_string(),
            })?,
    };
    Ok(Loaded {
        mode: resolve_mode(&cli)?,
        config,
        provenance,
        verbosity: cli.verbosity(),
        allow_empty: cli.allow_empty,
        max_input_bytes,
    })
}

/// The mode flag's mode, or `explain` with its arguments validated. `explain` is a
/// subcommand, which clap cannot put in the mode flags' group, so the exclusion is checked here.
fn resolve_mode(cli: &Cli) -> Result<Mode, ConfigError> {
    let Some(Command::Explain(args)) = &cli.command else {
        return Ok(cli.mode());
    };
    if cli.mode() != Mode::Run {
        return Err(ConfigError::Usage(
            "error: `explain` cannot be combined with --dry-run, --once, --cleanup or \
             --print-config\n"
                .to_string(),
        ));
    }
    let invalid = |key: &'static str, value: &str, expected: String| ConfigError::Invalid {
        key,
        value: single_line(value),
        origin: "the explain command line".to_string(),
        expected,
    };
    let src: IpAddr = args.src.parse().map_err(|_| {
        invalid(
            "SRC",
            &args.src,
            "must be an IP address, e.g. 10.244.1.5 or fd00:10:244::5".to_string(),
        )
    })?;
    let (dst, dport, proto) = explain::parse_destination(&args.dst)
        .map_err(|expected| invalid("DST:PORT/PROTO", &args.dst, expected))?;
    if IpFamily::of(&src) != IpFamily::of(&dst) {
        return Err(invalid(
            "DST:PORT/PROTO",
            &args.dst,
            format!("must be of the same address family as SRC {src}"),
        ));
    }
    let from = args
        .from
        .as_deref()
        .map(explain::parse_origin)
        .transpose()
        .map_err(|expected| invalid("--from", args.from.as_deref().unwrap_or(""), expected))?;
    Ok(Mode::Explain(explain::Query {
        src,
        dst,
        dport,
        proto,
        from,
    }))
}

fn clap_error(error: clap::Error) -> ConfigError {
    use clap::error::ErrorKind;
    let text = error.render().to_string();
    match error.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => ConfigError::HelpOrVersion(text),
        _ => ConfigError::Usage(text),
    }
}

/// Parses the config file and rejects unknown keys before any value is looked at, so a typo
/// is reported even when the key would have been shadowed by a flag.
fn parse_file(path: &Path, text: &str) -> Result<toml::Table, ConfigError> {
    let table: toml::Table =
        text.parse()
            .map_err(|error: toml::de::Error| ConfigError::ParseFile {
                path: path.to_path_buf(),
                message: error.to_string().trim_end().to_string(),
            })?;
    let unknown: Vec<String> = table
        .keys()
        .filter(|key| !Field::ALL.iter().any(|field| field.key() == key.as_str()))
        .cloned()
        .collect();
    if !unknown.is_empty() {
        return Err(ConfigError::UnknownKey {
            path: path.to_path_buf(),
            keys: unknown,
        });
    }
    Ok(table)
}

/// A raw value before validation, in the shape its source gives it.
#[derive(Debug, Clone)]
enum Input {
    /// A flag or environment value.
    Text(String),
    /// Repeated `--from-file` flags, or the one path of a path-valued flag.
    Paths(Vec<PathBuf>),
    /// A config-file value.
    Toml(toml::Value),
}

impl Input {
    /// The value as the operator wrote it, for error messages.
    fn shown(&self) -> String {
        match self {
            Input::Text(text) => single_line(text),
            Input::Paths(paths) => single_line(
                &paths
                    .iter()
                    .map(|path| path.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join(","),
            ),
            Input::Toml(value) => single_line(&value.to_string()),
        }
    }
}

fn flag_input(cli: &Cli, field: Field) -> Option<Input> {
    let text = |value: &Option<String>| value.clone().map(Input::Text);
    let path = |value: &Option<OsString>| {
        value
            .clone()
            .map(|path| Input::Paths(vec![PathBuf::from(path)]))
    };
    match field {
        Field::HostnameOverride => text(&cli.hostname_override),
        Field::Kubeconfig => path(&cli.kubeconfig),
        Field::Master => text(&cli.master),
        Field::ClusterCidr => text(&cli.cluster_cidr),
        Field::ServiceCidr => text(&cli.service_cidr),
        Field::DetectLocalMode => text(&cli.detect_local_mode),
        Field::PodBridgeInterface => text(&cli.pod_bridge_interface),
        Field::PodInterfaceNamePrefix => text(&cli.pod_interface_name_prefix),
        Field::MasqueradeAll => text(&cli.masquerade_all),
        Field::MasqueradeBit => text(&cli.masquerade_bit),
        Field::NodePortAddresses => text(&cli.nodeport_addresses),
        Field::HealthzBindAddress => text(&cli.healthz_bind_address),
        Field::MetricsBindAddress => text(&cli.metrics_bind_address),
        Field::MinSyncPeriod => text(&cli.min_sync_period),
        Field::SyncPeriod => text(&cli.sync_period),
        Field::LockFile => path(&cli.lock_file),
        Field::CleanupKubeProxy => text(&cli.cleanup_kube_proxy),
        Field::FromFile => (!cli.from_file.is_empty()).then(|| Input::Paths(cli.from_file.clone())),
        Field::LogFormat => text(&cli.log_format),
        Field::TableOwnership => text(&cli.table_ownership),
    }
}

/// The precedence rule, in one place: flag, else environment, else file; `None` keeps the
/// default.
fn choose(
    field: Field,
    flag: Option<Input>,
    env: &dyn Fn(&str) -> Option<String>,
    file: Option<&(PathBuf, toml::Table)>,
) -> Option<(Input, Source)> {
    if let Some(input) = flag {
        return Some((input, Source::Flag));
    }
    if let Some(value) = env(field.env_var()) {
        return Some((Input::Text(value), Source::Env(field.env_var().to_string())));
    }
    let (path, table) = file?;
    let value = table.get(field.key())?;
    Some((Input::Toml(value.clone()), Source::File(path.clone())))
}

/// Validates one raw value and stores it in `config`.
fn apply(
    config: &mut Config,
    field: Field,
    input: &Input,
    source: &Source,
) -> Result<(), ConfigError> {
    let invalid = |expected: String| ConfigError::Invalid {
        key: field.key(),
        value: input.shown(),
        origin: source.describe(field.flag()),
        expected,
    };
    match field {
        Field::HostnameOverride => {
            let name = normalize_hostname(&scalar_text(input, "a string").map_err(invalid)?);
            if !name.is_empty() {
                check_dns_subdomain(&name).map_err(invalid)?;
            }
            config.hostname_override = (!name.is_empty()).then_some(name);
        }
        Field::Kubeconfig => {
            let path = parse_path(input).map_err(invalid)?;
            config.kubeconfig = (!path.as_os_str().is_empty()).then_some(path);
        }
        Field::Master => {
            let url = scalar_text(input, "a string").map_err(invalid)?;
            let url = url.trim();
            if !url.is_empty() {
                check_http_url(url).map_err(invalid)?;
            }
            config.master = (!url.is_empty()).then(|| url.to_string());
        }
        Field::ClusterCidr => {
            let items = list(input).map_err(invalid)?;
            config.cluster_cidr = parse_cidrs(&items, &POD_NETWORK).map_err(invalid)?;
        }
        Field::ServiceCidr => {
            let items = list(input).map_err(invalid)?;
            config.service_cidr = parse_cidrs(&items, &SERVICE_NETWORK).map_err(invalid)?;
        }
        Field::DetectLocalMode => {
            let text = scalar_text(input, "a string").map_err(invalid)?;
            config.detect_local_mode = DetectLocalMode::parse(&text).ok_or_else(|| {
                invalid(format!(
                    "must be one of {} (case-insensitive)",
                    DetectLocalMode::ALL.map(DetectLocalMode::as_str).join(", ")
                ))
            })?;
        }
        Field::PodBridgeInterface => {
            let name = scalar_text(input, "a string").map_err(invalid)?;
            let name = name.trim();
            if !name.is_empty() {
                check_interface_name(name, false).map_err(invalid)?;
            }
            config.pod_bridge_interface = (!name.is_empty()).then(|| name.to_string());
        }
        Field::PodInterfaceNamePrefix => {
            let prefix = scalar_text(input, "a string").map_err(invalid)?;
            let prefix = prefix.trim();
            if !prefix.is_empty() {
                check_interface_name(prefix, true).map_err(invalid)?;
            }
            config.pod_interface_name_prefix = (!prefix.is_empty()).then(|| prefix.to_string());
        }
        Field::MasqueradeAll => {
            config.masquerade_all = parse_bool(input).map_err(invalid)?;
        }
        Field::MasqueradeBit => {
            config.masquerade_bit = parse_masquerade_bit(input).map_err(invalid)?;
        }
        Field::NodePortAddresses => {
            let items = list(input).map_err(invalid)?;
            config.nodeport_addresses = parse_nodeport_addresses(&items).map_err(invalid)?;
        }
        Field::HealthzBindAddress => {
            config.healthz_bind_address =
                parse_bind_address(input, DEFAULT_HEALTHZ_BIND_ADDRESS).map_err(invalid)?;
        }
        Field::MetricsBindAddress => {
            config.metrics_bind_address =
                parse_bind_address(input, DEFAULT_METRICS_BIND_ADDRESS).map_err(invalid)?;
        }
        Field::MinSyncPeriod => {
            config.min_sync_period = parse_duration_input(input).map_err(invalid)?;
        }
        Field::SyncPeriod => {
            let period = parse_duration_input(input).map_err(invalid)?;
            if period.is_zero() {
                return Err(invalid(
                    "must be longer than 0 (the longest time between two syncs), e.g. 30s"
                        .to_string(),
                ));
            }
            config.sync_period = period;
        }
        Field::LockFile => {
            let path = parse_path(input).map_err(invalid)?;
            if path.as_os_str().is_empty() {
                return Err(invalid(format!(
                    "must be a file path, e.g. {DEFAULT_LOCK_FILE}"
                )));
            }
            config.lock_file = path;
        }
        Field::CleanupKubeProxy => {
            config.cleanup_kube_proxy = parse_bool(input).map_err(invalid)?;
        }
        Field::FromFile => {
            config.from_file = parse_paths(input).map_err(invalid)?;
        }
        Field::LogFormat => {
            config.log_format = match scalar_text(input, "a string").map_err(invalid)?.as_str() {
                "text" => LogFormat::Text,
                "json" => LogFormat::Json,
                _ => return Err(invalid("must be `text` or `json`".to_string())),
            };
        }
        Field::TableOwnership => {
            config.table_ownership = match scalar_text(input, "a string").map_err(invalid)?.as_str()
            {
                "auto" => TableOwnership::Auto,
                "off" => TableOwnership::Off,
                _ => return Err(invalid("must be `auto` or `off`".to_string())),
            };
        }
    }
    Ok(())
}

fn toml_type(value: &toml::Value) -> &'static str {
    value.type_str()
}

/// A single string: flag/env text, or a TOML string.
fn scalar_text(input: &Input, expected: &str) -> Result<String, String> {
    match input {
        Input::Text(text) => Ok(text.clone()),
        Input::Toml(toml::Value::String(text)) => Ok(text.clone()),
        Input::Toml(other) => Err(format!("must be {expected}, not a {}", toml_type(other))),
        Input::Paths(_) => Err(format!("must be {expected}")),
    }
}

/// A list: comma-separated text (flag, env or TOML string) or a TOML array of strings. Items
/// are trimmed and empty items dropped, so `""` means an empty list.
fn list(input: &Input) -> Result<Vec<String>, String> {
    let items: Vec<String> = match input {
        Input::Text(text) | Input::Toml(toml::Value::String(text)) => {
            text.split(',').map(str::to_string).collect()
        }
        Input::Toml(toml::Value::Array(values)) => values
            .iter()
            .map(|value| match value {
                toml::Value::String(text) => Ok(text.clone()),
                other => Err(format!(
                    "must be a comma-separated string or an array of strings; found a {} in the \
                     array",
                    toml_type(other)
                )),
            })
            .collect::<Result<_, _>>()?,
        Input::Toml(other) => {
            return Err(format!(
                "must be a comma-separated string or an array of strings, not a {}",
                toml_type(other)
            ));
        }
        Input::Paths(paths) => paths
            .iter()
            .map(|path| path.to_string_lossy().into_owned())
            .collect(),
    };
    Ok(items
        .iter()
        .map(|item| item.trim())
        .filter(|item| !item.is_empty())
        .map(str::to_string)
        .collect())
}

/// Node names are DNS subdomains (RFC 1123); checking here turns a typo into an error instead
/// of a node that matches no endpoint.
fn check_dns_subdomain(name: &str) -> Result<(), String> {
    const EXPECTED: &str = "a node name must be a DNS subdomain: at most 253 characters, \
                            dot-separated labels of lowercase letters, digits and '-', each \
                            starting and ending with a letter or digit";
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    };
    if name.len() <= 253 && name.split('.').all(label_ok) {
        Ok(())
    } else {
        Err(EXPECTED.to_string())
    }
}

fn parse_bool(input: &Input) -> Result<bool, String> {
    const EXPECTED: &str = "must be true or false";
    match input {
        // The spellings Go's strconv.ParseBool accepts, so kube-proxy flag values carry over.
        Input::Text(text) => match text.trim() {
            "true" | "True" | "TRUE" | "t" | "T" | "1" => Ok(true),
            "false" | "False" | "FALSE" | "f" | "F" | "0" => Ok(false),
            _ => Err(EXPECTED.to_string()),
        },
        Input::Toml(toml::Value::Boolean(value)) => Ok(*value),
        Input::Toml(other) => Err(format!(
            "{EXPECTED} (a TOML boolean, not a {})",
            toml_type(other)
        )),
        Input::Paths(_) => Err(EXPECTED.to_string()),
    }
}

fn parse_masquerade_bit(input: &Input) -> Result<u8, String> {
    const EXPECTED: &str = "must be an integer from 0 to 31 (a bit of the 32-bit packet mark)";
    let value: Option<i64> = match input {
        Input::Text(text) => text.trim().parse().ok(),
        Input::Toml(toml::Value::Integer(value)) => Some(*value),
        Input::Toml(other) => {
            return Err(format!(
                "{EXPECTED}; found a {} instead of an integer",
                toml_type(other)
            ));
        }
        Input::Paths(_) => None,
    };
    value
        .filter(|bit| (0..=31).contains(bit))
        .and_then(|bit| u8::try_from(bit).ok())
        .ok_or_else(|| EXPECTED.to_string())
}

fn parse_paths(input: &Input) -> Result<Vec<PathBuf>, String> {
    let paths: Vec<PathBuf> = match input {
        Input::Paths(paths) => paths.clone(),
        // The environment has no repetition, so it is a comma-separated list.
        Input::Text(text) => text
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(PathBuf::from)
            .collect(),
        // In TOML a single string is unambiguous, so it is one path and never split.
        Input::Toml(toml::Value::String(path)) => vec![PathBuf::from(path)],
        Input::Toml(toml::Value::Array(values)) => values
            .iter()
            .map(|value| match value {
                toml::Value::String(path) => Ok(PathBuf::from(path)),
                other => Err(format!(
                    "must be an array of file paths (strings); found a {}",
                    toml_type(other)
                )),
            })
            .collect::<Result<_, _>>()?,
        Input::Toml(other) => {
            return Err(format!(
                "must be an array of file paths (strings), not a {}",
                toml_type(other)
            ));
        }
    };
    if paths.iter().any(|path| path.as_os_str().is_empty()) {
        return Err("file paths must not be empty".to_string());
    }
    Ok(paths)
}

/// How the CIDRs of one setting are described in error messages.
struct Network {
    /// What to write instead of a bare address.
    address_hint: &'static str,
    /// Valid values, after "expected".
    examples: &'static str,
}

const POD_NETWORK: Network = Network {
    address_hint: "write the pod network with its prefix length, e.g. 10.244.0.0/16",
    examples: "e.g. 10.244.0.0/16 or 10.244.0.0/16,fd00:10:244::/56",
};

const SERVICE_NETWORK: Network = Network {
    address_hint: "write the service network with its prefix length, e.g. 10.96.0.0/12",
    examples: "e.g. 10.96.0.0/12 or 10.96.0.0/12,fd00:10:96::/112",
};

const NODEPORT_NETWORK: Network = Network {
    address_hint: "write a CIDR, e.g. 192.0.2.0/24, or 192.0.2.1/32 for one address",
    examples: "`primary`, `all` or CIDRs such as 192.0.2.0/24, comma-separated",
};

/// One CIDR, rejecting bare addresses and host bits with a suggestion.
fn parse_cidr(item: &str, network: &Network) -> Result<IpNet, String> {
    let cidr: IpNet = match item.parse() {
        Ok(cidr) => cidr,
        Err(_) if item.parse::<IpAddr>().is_ok() => {
            return Err(format!(
                "`{item}` is an address, not a CIDR; {}",
                network.address_hint
            ));
        }
        Err(_) => {
            return Err(format!(
                "`{item}` is not a CIDR; expected {}",
                network.examples
            ));
        }
    };
    // A CIDR with host bits set is usually a node or pod address pasted by mistake; say so
    // rather than silently widening it.
    if cidr != cidr.trunc() {
        return Err(format!(
            "`{item}` has host bits set; did you mean {}?",
            cidr.trunc()
        ));
    }
    Ok(cidr)
}

/// CIDRs, at most one per family (an IPv4,IPv6 dual-stack pair is allowed).
fn parse_cidrs(items: &[String], network: &Network) -> Result<Vec<IpNet>, String> {
    let mut cidrs: Vec<IpNet> = Vec::new();
    for item in items {
        let cidr = parse_cidr(item, network)?;
        if let Some(same) = cidrs
            .iter()
            .find(|other| other.addr().is_ipv4() == cidr.addr().is_ipv4())
        {
            let family = if cidr.addr().is_ipv4() {
                "IPv4"
            } else {
                "IPv6"
            };
            return Err(format!(
                "two {family} CIDRs ({same} and {cidr}); give at most one per family (an \
                 IPv4,IPv6 dual-stack pair is allowed)"
            ));
        }
        cidrs.push(cidr);
    }
    Ok(cidrs)
}

/// `--nodeport-addresses`: `primary`, `all` and CIDRs, comma-separated; empty means `primary`.
fn parse_nodeport_addresses(items: &[String]) -> Result<NodePortAddresses, String> {
    const LOCALHOST: &str = "localhost NodePorts are not supported (nodeproxy, like kube-proxy's \
                             nftables mode, does not accept NodePort traffic on loopback \
                             addresses); use `primary`, `all` or CIDRs of non-loopback addresses";
    if items.is_empty() {
        return Ok(NodePortAddresses::primary());
    }
    let mut addresses = NodePortAddresses {
        primary: false,
        all: false,
        cidrs: Vec::new(),
    };
    for item in items {
        match item.to_ascii_lowercase().as_str() {
            "primary" => addresses.primary = true,
            "all" => addresses.all = true,
            "localhost" => return Err(LOCALHOST.to_string()),
            _ => {
                let cidr = parse_cidr(item, &NODEPORT_NETWORK)?;
                let only_loopback = match cidr {
                    IpNet::V4(net) => net.prefix_len() >= 8 && net.addr().is_loopback(),
                    IpNet::V6(net) => net.prefix_len() == 128 && net.addr().is_loopback(),
                };
                if only_loopback {
                    return Err(format!(
                        "`{item}` holds only loopback addresses: {LOCALHOST}"
                    ));
                }
                addresses.cidrs.push(cidr);
            }
        }
    }
    Ok(addresses)
}

/// The `--nodeport-addresses` syntax of `addresses`: keywords first, then the CIDRs.
fn render_nodeport_addresses(addresses: &NodePortAddresses) -> String {
    let mut items: Vec<String> = Vec::new();
    if addresses.primary {
        items.push("primary".to_string());
    }
    if addresses.all {
        items.push("all".to_string());
    }
    items.extend(addresses.cidrs.iter().map(IpNet::to_string));
    items.join(",")
}

/// A Linux interface name (`IFNAMSIZ` is 16 with the NUL), or a prefix of one.
fn check_interface_name(name: &str, prefix: bool) -> Result<(), String> {
    let bad_char = |c: char| c == '/' || c == ':' || c.is_whitespace() || c.is_control();
    let valid = (1..=15).contains(&name.len())
        && !name.chars().any(bad_char)
        && (prefix || (name != "." && name != ".."));
    if valid {
        Ok(())
    } else if prefix {
        Err(
            "must be a prefix of Linux interface names: 1 to 15 bytes, without '/', ':' or \
             whitespace"
                .to_string(),
        )
    } else {
        Err(
            "must be a Linux interface name: 1 to 15 bytes, without '/', ':' or whitespace, \
             and not `.` or `..`"
                .to_string(),
        )
    }
}

/// One file path. An empty path is returned as such; the caller decides what it means.
fn parse_path(input: &Input) -> Result<PathBuf, String> {
    match input {
        Input::Paths(paths) => match paths.as_slice() {
            [path] => Ok(path.clone()),
            _ => Err("must be one file path".to_string()),
        },
        Input::Text(text) => Ok(PathBuf::from(text.trim())),
        Input::Toml(toml::Value::String(path)) => Ok(PathBuf::from(path)),
        Input::Toml(other) => Err(format!(
            "must be a file path (a string), not a {}",
            toml_type(other)
        )),
    }
}

/// An `http://` or `https://` URL with a host and an optional port (and path).
fn check_http_url(url: &str) -> Result<(), String> {
    const EXPECTED: &str =
        "must be an http:// or https:// URL of the API server, e.g. https://192.0.2.10:6443";
    let fail = |why: &str| Err(format!("{why}; {EXPECTED}"));
    let lower = url.to_ascii_lowercase();
    let Some(scheme) = ["https://", "http://"]
        .into_iter()
        .find(|scheme| lower.starts_with(scheme))
    else {
        return Err(EXPECTED.to_string());
    };
    if url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return fail("a URL has no whitespace");
    }
    let rest = url.get(scheme.len()..).unwrap_or_default();
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    if authority.contains('@') {
        return fail("credentials do not belong in the URL (put them in the kubeconfig)");
    }
    let (host_ok, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let Some((ip, tail)) = bracketed.split_once(']') else {
            return fail("unclosed `[` in the host");
        };
        let port = match tail {
            "" => None,
            _ => match tail.strip_prefix(':') {
                Some(port) => Some(port),
                None => return fail("unexpected text after the IPv6 address"),
            },
        };
        (ip.parse::<Ipv6Addr>().is_ok(), port)
    } else {
        let (host, port) = match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        };
        let host_ok = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
        (host_ok, port)
    };
    if !host_ok {
        return fail("missing or invalid host");
    }
    if let Some(port) = port
        && !port.parse::<u16>().is_ok_and(|port| port != 0)
    {
        return fail("the port must be a number from 1 to 65535");
    }
    Ok(())
}

/// `ADDRESS:PORT`, or empty to disable the server.
fn parse_bind_address(input: &Input, default: SocketAddr) -> Result<Option<SocketAddr>, String> {
    let text = scalar_text(input, "a string such as \"0.0.0.0:10256\"")?;
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let expected = format!(
        "must be ADDRESS:PORT, e.g. {default} or [::]:{}, or empty to disable",
        default.port()
    );
    match text.parse::<SocketAddr>() {
        Ok(address) if address.port() == 0 => Err(format!("port 0 is not allowed; {expected}")),
        Ok(address) => Ok(Some(address)),
        Err(_) => match text.parse::<IpAddr>() {
            Ok(ip) => Err(format!(
                "`{text}` has no port; write ADDRESS:PORT, e.g. {}",
                SocketAddr::new(ip, default.port())
            )),
            Err(_) => Err(expected),
        },
    }
}

/// A duration value: a Go duration string, or a TOML integer (only `0` has no unit).
fn parse_duration_input(input: &Input) -> Result<Duration, String> {
    let text = match input {
        Input::Toml(toml::Value::Integer(value)) => value.to_string(),
        _ => scalar_text(input, "a duration string such as \"30s\"")?,
    };
    parse_duration(&text)
}

const DURATION_SYNTAX: &str = "a duration is a number with a unit, as kube-proxy writes it: \
                               500ms, 2s, 1m, 1h30m, 1.5s (units ns, us, µs, ms, s, m, h), or 0";

/// Parses a duration as Go's `time.ParseDuration` does (kube-proxy's flag syntax), except that
/// negative durations are rejected: `500ms`, `1h30m`, `1.5s`, a bare `0`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.starts_with('-') {
        return Err(format!("must not be negative; {DURATION_SYNTAX}"));
    }
    let text = text.strip_prefix('+').unwrap_or(text);
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.is_empty() {
        return Err(format!("must not be empty; {DURATION_SYNTAX}"));
    }
    let too_long = || format!("is too long (at most 2562047h47m16s); {DURATION_SYNTAX}");
    let mut total: u128 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (whole, after) = rest.split_at(digits(rest));
        let (fraction, after) = match after.strip_prefix('.') {
            Some(after) => after.split_at(digits(after)),
            None => ("", after),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err(format!(
                "`{rest}` does not start with a number; {DURATION_SYNTAX}"
            ));
        }
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let nanos_per_unit: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "" => return Err(format!("`{text}` lacks a unit; {DURATION_SYNTAX}")),
            other => return Err(format!("unknown unit `{other}`; {DURATION_SYNTAX}")),
        };
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| too_long())?
        };
        // Digits beyond nanosecond precision cannot matter; Go drops them too.
        let fraction = fraction.get(..18).unwrap_or(fraction);
        let fraction_nanos = if fraction.is_empty() {
            0
        } else {
            let value: u128 = fraction.parse().map_err(|_| too_long())?;
            let scale = 10u128.pow(u32::try_from(fraction.len()).unwrap_or(18));
            value * nanos_per_unit / scale
        };
        total = whole
            .checked_mul(nanos_per_unit)
            .and_then(|nanos| nanos.checked_add(fraction_nanos))
            .and_then(|nanos| nanos.checked_add(total))
            .ok_or_else(too_long)?;
        rest = after;
    }
    // Go's limit (an int64 of nanoseconds), so a value kube-proxy accepts is accepted here.
    let total = u64::try_from(total)
        .ok()
        .filter(|&nanos| i64::try_from(nanos).is_ok())
        .ok_or_else(too_long)?;
    Ok(Duration::from_nanos(total))
}

/// Writes a duration in Go's syntax, compactly: `0s`, `500ms`, `1.5s`, `1h30m`, `1m5s`.
/// `parse_duration` reads it back to the same value.
fn format_duration(duration: Duration) -> String {
    const SECOND: u128 = 1_000_000_000;
    fn decimal(nanos: u128, unit: u128, unit_digits: usize, suffix: &str) -> String {
        let whole = nanos / unit;
        let fraction = nanos % unit;
        if fraction == 0 {
            format!("{whole}{suffix}")
        } else {
            let fraction = format!("{fraction:0unit_digits$}");
            format!("{whole}.{}{suffix}", fraction.trim_end_matches('0'))
        }
    }
    let nanos = duration.as_nanos();
    match nanos {
        0 => "0s".to_string(),
        1..1_000 => format!("{nanos}ns"),
        1_000..1_000_000 => decimal(nanos, 1_000, 3, "µs"),
        1_000_000..SECOND => decimal(nanos, 1_000_000, 6, "ms"),
        _ => {
            let hours = nanos / (3600 * SECOND);
            let minutes = nanos / (60 * SECOND) % 60;
            let seconds = nanos % (60 * SECOND);
            let mut out = String::new();
            if hours > 0 {
                out.push_str(&format!("{hours}h"));
            }
            if minutes > 0 {
                out.push_str(&format!("{minutes}m"));
            }
            if seconds > 0 {
                out.push_str(&decimal(seconds, SECOND, 9, "s"));
            }
            out
        }
    }
}

/// Whether a server bound to `a` takes the port from one bound to `b`: the same address, or
/// `a` is the wildcard of `b`'s family, or `::` (which on Linux also takes IPv4).
fn bind_overlaps(a: IpAddr, b: IpAddr) -> bool {
    a == b || (a.is_unspecified() && (a.is_ipv6() || a.is_ipv4() == b.is_ipv4()))
}

/// Checks between fields, after merging: each error names both fields and where the value came
/// from.
fn validate_combination(config: &Config, provenance: &Provenance) -> Result<(), ConfigError> {
    let invalid = |field: Field, value: String, expected: String| ConfigError::Invalid {
        key: field.key(),
        value: single_line(&value),
        origin: provenance.of(field).describe(field.flag()),
        expected,
    };
    let mode = config.detect_local_mode;
    let required = match mode {
        DetectLocalMode::ClusterCidr if config.cluster_cidr.is_empty() => Some((
            Field::ClusterCidr,
            "is empty; set --cluster-cidr to the pod network, or use NodeCIDR to use the \
             Node's podCIDRs",
        )),
        DetectLocalMode::BridgeInterface if config.pod_bridge_interface.is_none() => Some((
            Field::PodBridgeInterface,
            "is not set; name the bridge local pods are attached to, e.g. cni0",
        )),
        DetectLocalMode::InterfaceNamePrefix if config.pod_interface_name_prefix.is_none() => {
            Some((
                Field::PodInterfaceNamePrefix,
                "is not set; give the name prefix of local pod interfaces, e.g. veth",
            ))
        }
        _ => None,
    };
    if let Some((needed, why)) = required {
        return Err(invalid(
            Field::DetectLocalMode,
            mode.as_str().to_string(),
            format!(
                "{} requires {} ({}), which {why}",
                mode.as_str(),
                needed.key(),
                needed.flag()
            ),
        ));
    }
    if config.min_sync_period > config.sync_period {
        return Err(invalid(
            Field::MinSyncPeriod,
            format_duration(config.min_sync_period),
            format!(
                "must not be longer than sync_period `{}` (from {})",
                format_duration(config.sync_period),
                provenance
                    .of(Field::SyncPeriod)
                    .describe(Field::SyncPeriod.flag())
            ),
        ));
    }
    if let (Some(healthz), Some(metrics)) =
        (config.healthz_bind_address, config.metrics_bind_address)
        && healthz.port() == metrics.port()
        && (bind_overlaps(healthz.ip(), metrics.ip()) || bind_overlaps(metrics.ip(), healthz.ip()))
    {
        return Err(invalid(
            Field::MetricsBindAddress,
            metrics.to_string(),
            format!(
                "conflicts with healthz_bind_address `{healthz}` (from {}): the two servers \
                 need different ports",
                provenance
                    .of(Field::HealthzBindAddress)
                    .describe(Field::HealthzBindAddress.flag())
            ),
        ));
    }
    Ok(())
}

/// A field's effective value in TOML syntax, so `render_effective` output is a config file.
fn render_value(config: &Config, field: Field) -> String {
    let string = |text: &str| toml::Value::String(text.to_string()).to_string();
    let strings = |items: Vec<String>| {
        toml::Value::Array(items.into_iter().map(toml::Value::String).collect()).to_string()
    };
    let address = |address: Option<SocketAddr>| {
        string(
            &address
                .map(|address| address.to_string())
                .unwrap_or_default(),
        )
    };
    match field {
        // TOML has no null; an empty string reads back as unset.
        Field::HostnameOverride => string(config.hostname_override.as_deref().unwrap_or("")),
        Field::Kubeconfig => string(
            &config
                .kubeconfig
                .as_ref()
                .map(|path| path.to_string_lossy())
                .unwrap_or_default(),
        ),
        Field::Master => string(config.master.as_deref().unwrap_or("")),
        Field::ClusterCidr => strings(config.cluster_cidr.iter().map(IpNet::to_string).collect()),
        Field::ServiceCidr => strings(config.service_cidr.iter().map(IpNet::to_string).collect()),
        Field::DetectLocalMode => string(config.detect_local_mode.as_str()),
        Field::PodBridgeInterface => string(config.pod_bridge_interface.as_deref().unwrap_or("")),
        Field::PodInterfaceNamePrefix => {
            string(config.pod_interface_name_prefix.as_deref().unwrap_or(""))
        }
        Field::MasqueradeAll => config.masquerade_all.to_string(),
        Field::MasqueradeBit => config.masquerade_bit.to_string(),
        Field::NodePortAddresses => string(&render_nodeport_addresses(&config.nodeport_addresses)),
        Field::HealthzBindAddress => address(config.healthz_bind_address),
        Field::MetricsBindAddress => address(config.metrics_bind_address),
        Field::MinSyncPeriod => string(&format_duration(config.min_sync_period)),
        Field::SyncPeriod => string(&format_duration(config.sync_period)),
        Field::LockFile => string(&config.lock_file.to_string_lossy()),
        Field::CleanupKubeProxy => config.cleanup_kube_proxy.to_string(),
        Field::FromFile => strings(
            config
                .from_file
                .iter()
                .map(|path| path.to_string_lossy().into_owned())
                .collect(),
        ),
        Field::LogFormat => string(match config.log_format {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }),
        Field::TableOwnership => string(match config.table_ownership {
            TableOwnership::Auto => "auto",
            TableOwnership::Off => "off",
        }),
    }
}

/// `--print-config`: one `field = value  # source` line per field, in TOML syntax, so the
/// output is itself a valid config file that reproduces the same `Config`.
///
/// Paths that are not UTF-8 are printed lossily and will not round-trip.
pub fn render_effective(config: &Config, provenance: &Provenance) -> String {
    let mut out = String::from(
        "# nodeproxy effective configuration; precedence: flag > env > file > default\n",
    );
    match &provenance.config_file {
        Some((path, origin)) => {
            // Writing to a String cannot fail; the Result is only the fmt::Write signature.
            let _ = writeln!(
                out,
                "# config file: {} (from {})",
                single_line(&path.to_string_lossy()),
                origin.describe("--config")
            );
        }
        None => out.push_str("# config file: none (no --config or NODEPROXY_CONFIG)\n"),
    }
    for field in Field::ALL {
        let source = provenance.of(field).describe(field.flag());
        let note = match field {
            Field::HostnameOverride if config.hostname_override.is_none() => {
                " (unset: the host name is used)"
            }
            Field::DetectLocalMode if provenance.detect_local_mode == Source::Default => {
                " (ClusterCIDR when cluster_cidr is set, else NodeCIDR)"
            }
            Field::HealthzBindAddress if config.healthz_bind_address.is_none() => " (disabled)",
            Field::MetricsBindAddress if config.metrics_bind_address.is_none() => " (disabled)",
            _ => "",
        };
        let _ = writeln!(
            out,
            "{} = {}  # {source}{note}",
            field.key(),
            render_value(config, field)
        );
    }
    out
}

/// The packaged `/etc/nodeproxy/config.toml`: every setting commented out at its default, under
/// its `--help` text. Built from the same field list, defaults and value rendering as
/// `--print-config`, and the help from the clap definition, so the file cannot drift from the
/// binary it ships with. Uncommented as a whole, it loads back to the defaults (tested).
pub fn render_default_file() -> String {
    use clap::CommandFactory as _;
    let command = crate::cli::Cli::command();
    let defaults = Config::default();
    let mut out = String::from(
        "# nodeproxy configuration (TOML). Every setting is shown commented out at its default.\n\
         # Precedence: command-line flag > NODEPROXY_* environment variable > this file > default;\n\
         # `nodeproxy --print-config` shows each effective value and where it came from.\n\
         # Unknown keys are errors.\n",
    );
    for field in Field::ALL {
        let help = command
            .get_arguments()
            .find(|arg| arg.get_id().as_str() == field.key())
            .and_then(|arg| arg.get_long_help().or_else(|| arg.get_help()))
            .map(|help| help.to_string())
            .unwrap_or_default();
        out.push('\n');
        for line in wrap_words(&help, 96) {
            let _ = writeln!(out, "# {line}");
        }
        let _ = writeln!(out, "#{} = {}", field.key(), render_value(&defaults, field));
    }
    out
}

/// `text`'s words in lines of at most `width` characters (a longer word stands alone).
fn wrap_words(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + word.len() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// Warnings for cluster CIDRs that contain ClusterIPs: a sign that the service network was
/// given where the pod network belongs (DESIGN.md §1).
///
/// `cluster_ips` is `(service "namespace/name", ClusterIP)` pairs, so the message can name a
/// service the operator will recognise. One message per offending CIDR, naming the first
/// ClusterIP found and counting the others, so a large cluster does not flood the log.
pub fn overlapping_cluster_cidr(config: &Config, cluster_ips: &[(String, IpAddr)]) -> Vec<String> {
    let mut messages = Vec::new();
    for cidr in &config.cluster_cidr {
        let inside: BTreeMap<IpAddr, &str> = cluster_ips
            .iter()
            .filter(|(_, ip)| cidr.contains(ip))
            .map(|(service, ip)| (*ip, service.as_str()))
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
mod tests {
    use super::*;
    use std::collections::HashMap;

    const FILE: &str = "/etc/nodeproxy/test.toml";

    /// Runs `load` with an in-memory environment and an in-memory config file at `FILE`
    /// (named by `--config` only when `file` is given).
    fn run(args: &[&str], env: &[(&str, &str)], file: Option<&str>) -> Result<Loaded, ConfigError> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut argv: Vec<OsString> = vec!["nodeproxy".into()];
        if file.is_some() {
            argv.push("--config".into());
            argv.push(FILE.into());
        }
        argv.extend(args.iter().map(OsString::from));
        let contents = file.map(str::to_string);
        load_with(argv, &|name| env.get(name).cloned(), &|path| {
            assert_eq!(path, Path::new(FILE));
            contents
                .clone()
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        })
    }

    fn ok(args: &[&str], env: &[(&str, &str)], file: Option<&str>) -> Loaded {
        match run(args, env, file) {
            Ok(loaded) => loaded,
            Err(error) => panic!("load failed: {error}"),
        }
    }

    fn err(args: &[&str], env: &[(&str, &str)], file: Option<&str>) -> String {
        match run(args, env, file) {
            Ok(loaded) => panic!("load unexpectedly succeeded: {loaded:?}"),
            Err(error) => error.to_string(),
        }
    }

    /// Per field: a flag, an env value and a file line, and the TOML rendering each yields.
    struct Case {
        field: Field,
        flag: &'static [&'static str],
        flag_value: &'static str,
        env: &'static str,
        env_value: &'static str,
        file: &'static str,
        file_value: &'static str,
        default_value: &'static str,
    }

    const CASES: &[Case] = &[
        Case {
            field: Field::HostnameOverride,
            flag: &["--hostname-override", "Flag-Node"],
            flag_value: "\"flag-node\"",
            env: "env-node",
            env_value: "\"env-node\"",
            file: "hostname_override = \"file-node\"",
            file_value: "\"file-node\"",
            default_value: "\"\"",
        },
        Case {
            field: Field::Kubeconfig,
            flag: &["--kubeconfig", "/flag/kubeconfig"],
            flag_value: "\"/flag/kubeconfig\"",
            env: "/env/kubeconfig",
            env_value: "\"/env/kubeconfig\"",
            file: "kubeconfig = \"/file/kubeconfig\"",
            file_value: "\"/file/kubeconfig\"",
            default_value: "\"\"",
        },
        Case {
            field: Field::Master,
            flag: &["--master", "https://flag.example:6443"],
            flag_value: "\"https://flag.example:6443\"",
            env: "http://192.0.2.1:8080",
            env_value: "\"http://192.0.2.1:8080\"",
            file: "master = \"https://[2001:db8::1]:6443/\"",
            file_value: "\"https://[2001:db8::1]:6443/\"",
            default_value: "\"\"",
        },
        Case {
            field: Field::ClusterCidr,
            flag: &["--cluster-cidr", "10.1.0.0/16"],
            flag_value: "[\"10.1.0.0/16\"]",
            env: "10.2.0.0/16,fd00:2::/56",
            env_value: "[\"10.2.0.0/16\", \"fd00:2::/56\"]",
            file: "cluster_cidr = [\"10.3.0.0/16\"]",
            file_value: "[\"10.3.0.0/16\"]",
            default_value: "[]",
        },
        Case {
            field: Field::ServiceCidr,
            flag: &["--service-cidr", "10.96.0.0/12"],
            flag_value: "[\"10.96.0.0/12\"]",
            env: "10.97.0.0/16,fd00:10:96::/112",
            env_value: "[\"10.97.0.0/16\", \"fd00:10:96::/112\"]",
            file: "service_cidr = [\"fd00:10:97::/112\"]",
            file_value: "[\"fd00:10:97::/112\"]",
            default_value: "[]",
        },
        Case {
            field: Field::DetectLocalMode,
            flag: &[
                "--detect-local-mode",
                "bridgeinterface",
                "--pod-bridge-interface",
                "cni0",
            ],
            flag_value: "\"BridgeInterface\"",
            env: "NodeCIDR",
            env_value: "\"NodeCIDR\"",
            file: "detect_local_mode = \"ClusterCIDR\"\ncluster_cidr = \"10.244.0.0/16\"",
            file_value: "\"ClusterCIDR\"",
            default_value: "\"NodeCIDR\"",
        },
        Case {
            field: Field::PodBridgeInterface,
            flag: &["--pod-bridge-interface", "br-flag"],
            flag_value: "\"br-flag\"",
            env: "br-env",
            env_value: "\"br-env\"",
            file: "pod_bridge_interface = \"br-file\"",
            file_value: "\"br-file\"",
            default_value: "\"\"",
        },
        Case {
            field: Field::PodInterfaceNamePrefix,
            flag: &["--pod-interface-name-prefix", "vethf"],
            flag_value: "\"vethf\"",
            env: "vethe",
            env_value: "\"vethe\"",
            file: "pod_interface_name_prefix = \"cali\"",
            file_value: "\"cali\"",
            default_value: "\"\"",
        },
        Case {
            field: Field::MasqueradeAll,
            flag: &["--masquerade-all=false"],
            flag_value: "false",
            env: "true",
            env_value: "true",
            file: "masquerade_all = false",
            file_value: "false",
            default_value: "false",
        },
        Case {
            field: Field::MasqueradeBit,
            flag: &["--masquerade-bit", "1"],
            flag_value: "1",
            env: "2",
            env_value: "2",
            file: "masquerade_bit = 3",
            file_value: "3",
            default_value: "14",
        },
        Case {
            field: Field::NodePortAddresses,
            flag: &["--nodeport-addresses", "primary,192.0.2.0/24"],
            flag_value: "\"primary,192.0.2.0/24\"",
            env: "all",
            env_value: "\"all\"",
            file: "nodeport_addresses = [\"10.0.0.0/8\", \"::/0\"]",
            file_value: "\"10.0.0.0/8,::/0\"",
            default_value: "\"primary\"",
        },
        Case {
            field: Field::HealthzBindAddress,
            flag: &["--healthz-bind-address", "127.0.0.1:1"],
            flag_value: "\"127.0.0.1:1\"",
            env: "[::]:10256",
            env_value: "\"[::]:10256\"",
            file: "healthz_bind_address = \"\"",
            file_value: "\"\"",
            default_value: "\"0.0.0.0:10256\"",
        },
        Case {
            field: Field::MetricsBindAddress,
            flag: &["--metrics-bind-address", "0.0.0.0:9100"],
            flag_value: "\"0.0.0.0:9100\"",
            env: "[::1]:10249",
            env_value: "\"[::1]:10249\"",
            file: "metrics_bind_address = \"\"",
            file_value: "\"\"",
            default_value: "\"127.0.0.1:10249\"",
        },
        Case {
            field: Field::MinSyncPeriod,
            flag: &["--min-sync-period", "2s"],
            flag_value: "\"2s\"",
            env: "500ms",
            env_value: "\"500ms\"",
            file: "min_sync_period = 0",
            file_value: "\"0s\"",
            default_value: "\"1s\"",
        },
        Case {
            field: Field::SyncPeriod,
            flag: &["--sync-period", "1m"],
            flag_value: "\"1m\"",
            env: "1h30m",
            env_value: "\"1h30m\"",
            file: "sync_period = \"1.5s\"",
            file_value: "\"1.5s\"",
            default_value: "\"30s\"",
        },
        Case {
            field: Field::LockFile,
            flag: &["--lock-file", "/flag.lock"],
            flag_value: "\"/flag.lock\"",
            env: "/env.lock",
            env_value: "\"/env.lock\"",
            file: "lock_file = \"/file.lock\"",
            file_value: "\"/file.lock\"",
            default_value: "\"/run/nodeproxy/nodeproxy.lock\"",
        },
        Case {
            field: Field::CleanupKubeProxy,
            flag: &["--cleanup-kube-proxy"],
            flag_value: "true",
            env: "false",
            env_value: "false",
            file: "cleanup_kube_proxy = true",
            file_value: "true",
            default_value: "false",
        },
        Case {
            field: Field::FromFile,
            flag: &["--from-file", "/flag/a.yaml", "--from-file", "/flag/b.yaml"],
            flag_value: "[\"/flag/a.yaml\", \"/flag/b.yaml\"]",
            env: "/env/a.yaml,/env/b.yaml",
            env_value: "[\"/env/a.yaml\", \"/env/b.yaml\"]",
            file: "from_file = [\"/file/a.yaml\"]",
            file_value: "[\"/file/a.yaml\"]",
            default_value: "[]",
        },
        Case {
            field: Field::LogFormat,
            flag: &["--log-format", "json"],
            flag_value: "\"json\"",
            env: "text",
            env_value: "\"text\"",
            file: "log_format = \"json\"",
            file_value: "\"json\"",
            default_value: "\"text\"",
        },
        Case {
            field: Field::TableOwnership,
            flag: &["--table-ownership", "off"],
            flag_value: "\"off\"",
            env: "auto",
            env_value: "\"auto\"",
            file: "table_ownership = \"off\"",
            file_value: "\"off\"",
            default_value: "\"auto\"",
        },
    ];

    #[test]
    fn every_field_has_a_precedence_case() {
        let covered: Vec<Field> = CASES.iter().map(|case| case.field).collect();
        assert_eq!(covered, Field::ALL);
    }

    #[test]
    fn a_flag_beats_env_file_and_default_for_every_field() {
        for case in CASES {
            let var = case.field.env_var();
            let loaded = ok(case.flag, &[(var, case.env)], Some(case.file));
            assert_eq!(
                render_value(&loaded.config, case.field),
                case.flag_value,
                "{:?}",
                case.field
            );
            assert_eq!(loaded.provenance.of(case.field), &Source::Flag);
        }
    }

    #[test]
    fn env_beats_file_and_default_for_every_field() {
        for case in CASES {
            let var = case.field.env_var();
            let loaded = ok(&[], &[(var, case.env)], Some(case.file));
            assert_eq!(
                render_value(&loaded.config, case.field),
                case.env_value,
                "{:?}",
                case.field
            );
            assert_eq!(
                loaded.provenance.of(case.field),
                &Source::Env(var.to_string())
            );
        }
    }

    #[test]
    fn file_beats_default_for_every_field() {
        for case in CASES {
            let loaded = ok(&[], &[], Some(case.file));
            assert_eq!(
                render_value(&loaded.config, case.field),
                case.file_value,
                "{:?}",
                case.field
            );
            assert_eq!(
                loaded.provenance.of(case.field),
                &Source::File(PathBuf::from(FILE))
            );
        }
    }

    #[test]
    fn nothing_given_means_the_default_for_every_field() {
        let loaded = ok(&[], &[], None);
        assert_eq!(loaded.config, Config::default());
        assert_eq!(loaded.provenance, Provenance::default());
        assert_eq!(loaded.mode, Mode::Run);
        for case in CASES {
            assert_eq!(render_value(&loaded.config, case.field), case.default_value);
        }
    }

    #[test]
    fn the_packaged_default_file_loads_as_is_and_uncommented_to_the_defaults() {
        let text = render_default_file();
        assert_eq!(ok(&[], &[], Some(&text)).config, Config::default());
        // Every setting is there, commented out, under its help text.
        let uncommented: String = text
            .lines()
            .map(|line| match line.strip_prefix('#') {
                Some(rest)
                    if Field::ALL
                        .iter()
                        .any(|f| rest.starts_with(&format!("{} = ", f.key()))) =>
                {
                    rest
                }
                _ => line,
            })
            .map(|line| format!("{line}\n"))
            .collect();
        for field in Field::ALL {
            assert!(
                uncommented.contains(&format!("\n{} = ", field.key())),
                "{} missing:\n{text}",
                field.key()
            );
        }
        let loaded = ok(&[], &[], Some(&uncommented));
        assert_eq!(loaded.config, Config::default());
        assert!(
            text.contains("# The packet mark bit"),
            "help text missing:\n{text}"
        );
    }

    #[test]
    fn hostname_override_in_a_config_file_does_not_override_the_flag() {
        let file = "hostname_override = \"localhost\"\n";
        let loaded = ok(&["--hostname-override", "worker-7"], &[], Some(file));
        assert_eq!(loaded.config.hostname_override.as_deref(), Some("worker-7"));
        assert_eq!(loaded.provenance.hostname_override, Source::Flag);
        let loaded = ok(
            &[],
            &[("NODEPROXY_HOSTNAME_OVERRIDE", "worker-8")],
            Some(file),
        );
        assert_eq!(loaded.config.hostname_override.as_deref(), Some("worker-8"));
    }

    #[test]
    fn an_empty_environment_variable_counts_as_unset() {
        let loaded = ok(
            &[],
            &[("NODEPROXY_HOSTNAME_OVERRIDE", "")],
            Some("hostname_override = \"from-file\""),
        );
        assert_eq!(
            loaded.config.hostname_override.as_deref(),
            Some("from-file")
        );
    }

    #[test]
    fn hostname_override_is_trimmed_and_lowercased_and_empty_means_unset() {
        let loaded = ok(
            &["--hostname-override", "  Worker-7.Example.COM "],
            &[],
            None,
        );
        assert_eq!(
            loaded.config.hostname_override.as_deref(),
            Some("worker-7.example.com")
        );
        // An explicit empty flag still wins over the file: it unsets the override.
        let loaded = ok(
            &["--hostname-override="],
            &[],
            Some("hostname_override = \"x\""),
        );
        assert_eq!(loaded.config.hostname_override, None);
        assert_eq!(loaded.provenance.hostname_override, Source::Flag);
    }

    #[test]
    fn a_hostname_override_that_is_not_a_dns_name_is_rejected() {
        let message = err(&["--hostname-override", "node 1"], &[], None);
        assert!(message.contains("hostname_override"), "{message}");
        assert!(message.contains("node 1"), "{message}");
        assert!(message.contains("DNS subdomain"), "{message}");
    }

    #[test]
    fn node_name_lowercases_the_override() {
        let config = Config {
            hostname_override: Some("Worker-7".to_string()),
            ..Config::default()
        };
        assert_eq!(config.node_name().unwrap(), "worker-7");
    }

    #[test]
    fn node_name_lowercases_the_host_name_and_is_never_empty() {
        let name = node_name_from(None, || Ok(OsString::from("Host-A\n"))).unwrap();
        assert_eq!(name, "host-a");
        let name = node_name_from(Some("  "), || Ok(OsString::from("HOST"))).unwrap();
        assert_eq!(name, "host");
        assert!(node_name_from(None, || Ok(OsString::new())).is_err());
        assert!(node_name_from(None, || Err("EPERM".to_string())).is_err());
        let real = Config::default().node_name().unwrap();
        assert!(!real.is_empty());
        assert_eq!(real, real.to_lowercase());
    }

    #[test]
    fn an_unknown_config_key_is_an_error_naming_the_key_and_listing_valid_keys() {
        let message = err(&[], &[], Some("hostname = \"a\"\nmasquerade_bit = 14\n"));
        assert!(message.contains("`hostname`"), "{message}");
        assert!(message.contains(FILE), "{message}");
        for field in Field::ALL {
            assert!(message.contains(field.key()), "{message}");
        }
    }

    #[test]
    fn an_unknown_key_spelled_like_a_flag_or_kube_proxy_yaml_gets_a_hint() {
        let message = err(&[], &[], Some("hostname-override = \"a\""));
        assert!(
            message.contains("did you mean `hostname_override`"),
            "{message}"
        );
        let message = err(&[], &[], Some("nodePortAddresses = \"primary\""));
        assert!(
            message.contains("did you mean `nodeport_addresses`"),
            "{message}"
        );
    }

    #[test]
    fn an_unknown_key_is_an_error_even_when_a_flag_sets_every_field() {
        let message = err(
            &["--hostname-override", "a"],
            &[],
            Some("hostname_overide = \"b\""),
        );
        assert!(message.contains("hostname_overide"), "{message}");
    }

    #[test]
    fn an_invalid_flag_value_names_key_value_and_flag() {
        let message = err(&["--masquerade-bit", "32"], &[], None);
        assert!(message.contains("masquerade_bit"), "{message}");
        assert!(message.contains("`32`"), "{message}");
        assert!(message.contains("flag --masquerade-bit"), "{message}");
        assert!(message.contains("0 to 31"), "{message}");
    }

    #[test]
    fn an_invalid_env_value_names_key_value_and_variable() {
        let message = err(&[], &[("NODEPROXY_MASQUERADE_ALL", "yes")], None);
        assert!(message.contains("masquerade_all"), "{message}");
        assert!(message.contains("`yes`"), "{message}");
        assert!(
            message.contains("env NODEPROXY_MASQUERADE_ALL"),
            "{message}"
        );
        assert!(message.contains("true or false"), "{message}");
    }

    #[test]
    fn an_invalid_file_value_names_key_value_and_file() {
        let message = err(&[], &[], Some("cluster_cidr = \"10.0.0.0/33\""));
        assert!(message.contains("cluster_cidr"), "{message}");
        assert!(message.contains("10.0.0.0/33"), "{message}");
        assert!(message.contains(&format!("file {FILE}")), "{message}");
        assert!(message.contains("not a CIDR"), "{message}");
        let message = err(&[], &[], Some("masquerade_bit = \"14\""));
        assert!(message.contains("masquerade_bit `\"14\"`"), "{message}");
        let message = err(&[], &[], Some("log_format = \"yaml\""));
        assert!(message.contains("`text` or `json`"), "{message}");
    }

    #[test]
    fn an_invalid_value_in_a_lower_source_is_ignored_when_a_higher_one_wins() {
        // Only the effective value is validated; a shadowed one cannot affect the node.
        let loaded = ok(
            &["--masquerade-bit", "5"],
            &[("NODEPROXY_MASQUERADE_BIT", "99")],
            Some("masquerade_bit = 77"),
        );
        assert_eq!(loaded.config.masquerade_bit, 5);
    }

    #[test]
    fn a_dual_stack_cluster_cidr_pair_is_accepted() {
        let loaded = ok(
            &["--cluster-cidr", "10.244.0.0/16, fd00:10:244::/56"],
            &[],
            None,
        );
        let expected: Vec<IpNet> = vec![
            "10.244.0.0/16".parse().unwrap(),
            "fd00:10:244::/56".parse().unwrap(),
        ];
        assert_eq!(loaded.config.cluster_cidr, expected);
        let loaded = ok(
            &[],
            &[],
            Some("cluster_cidr = \"10.244.0.0/16,fd00:10:244::/56\""),
        );
        assert_eq!(loaded.config.cluster_cidr, expected);
    }

    #[test]
    fn two_cluster_cidrs_of_the_same_family_are_rejected() {
        let message = err(
            &["--cluster-cidr", "10.244.0.0/16,10.245.0.0/16"],
            &[],
            None,
        );
        assert!(message.contains("two IPv4 CIDRs"), "{message}");
        assert!(message.contains("flag --cluster-cidr"), "{message}");
        let message = err(
            &[],
            &[("NODEPROXY_CLUSTER_CIDR", "fd00::/56,fd01::/56")],
            None,
        );
        assert!(message.contains("two IPv6 CIDRs"), "{message}");
    }

    #[test]
    fn a_cluster_cidr_with_host_bits_or_without_prefix_is_rejected_with_a_suggestion() {
        let message = err(&["--cluster-cidr", "10.244.1.5/16"], &[], None);
        assert!(message.contains("did you mean 10.244.0.0/16"), "{message}");
        let message = err(&["--cluster-cidr", "10.244.1.5"], &[], None);
        assert!(message.contains("an address, not a CIDR"), "{message}");
    }

    #[test]
    fn masquerade_bit_32_is_rejected_and_31_accepted() {
        assert!(err(&["--masquerade-bit", "32"], &[], None).contains("0 to 31"));
        assert!(err(&[], &[], Some("masquerade_bit = 32")).contains("0 to 31"));
        assert!(err(&[], &[], Some("masquerade_bit = -1")).contains("0 to 31"));
        let loaded = ok(&["--masquerade-bit", "31"], &[], None);
        assert_eq!(loaded.config.masquerade_bit, 31);
        assert_eq!(loaded.config.masquerade_mark(), 1 << 31);
    }

    #[test]
    fn field_names_follow_one_scheme() {
        for field in Field::ALL {
            assert_eq!(field.flag(), format!("--{}", field.key().replace('_', "-")));
            assert_eq!(
                field.env_var(),
                format!("NODEPROXY_{}", field.key().to_uppercase())
            );
        }
    }

    #[test]
    fn detect_local_mode_defaults_to_cluster_cidr_when_a_cluster_cidr_is_set_else_node_cidr() {
        assert_eq!(
            Config::default().detect_local_mode(),
            DetectLocalMode::NodeCidr
        );
        let loaded = ok(&[], &[], None);
        assert_eq!(loaded.config.detect_local_mode(), DetectLocalMode::NodeCidr);
        assert_eq!(loaded.provenance.detect_local_mode, Source::Default);
        // The cluster CIDR may come from any source; the default follows the merged value.
        for loaded in [
            ok(&["--cluster-cidr", "10.244.0.0/16"], &[], None),
            ok(&[], &[("NODEPROXY_CLUSTER_CIDR", "fd00:10:244::/56")], None),
            ok(&[], &[], Some("cluster_cidr = \"10.244.0.0/16\"")),
        ] {
            assert_eq!(
                loaded.config.detect_local_mode(),
                DetectLocalMode::ClusterCidr
            );
            assert_eq!(loaded.provenance.detect_local_mode, Source::Default);
        }
        // An explicit mode wins over the derived default.
        let loaded = ok(
            &[
                "--cluster-cidr",
                "10.244.0.0/16",
                "--detect-local-mode",
                "NodeCIDR",
            ],
            &[],
            None,
        );
        assert_eq!(loaded.config.detect_local_mode(), DetectLocalMode::NodeCidr);
        assert_eq!(loaded.provenance.detect_local_mode, Source::Flag);
    }

    #[test]
    fn detect_local_mode_is_case_insensitive_and_an_unknown_mode_lists_the_valid_ones() {
        let loaded = ok(
            &[],
            &[
                ("NODEPROXY_DETECT_LOCAL_MODE", "interfacenameprefix"),
                ("NODEPROXY_POD_INTERFACE_NAME_PREFIX", "veth"),
            ],
            None,
        );
        assert_eq!(
            loaded.config.detect_local_mode(),
            DetectLocalMode::InterfaceNamePrefix
        );
        let message = err(&["--detect-local-mode", "PodCIDR"], &[], None);
        assert!(message.contains("detect_local_mode `PodCIDR`"), "{message}");
        assert!(message.contains("flag --detect-local-mode"), "{message}");
        assert!(
            message.contains("ClusterCIDR, NodeCIDR, BridgeInterface, InterfaceNamePrefix"),
            "{message}"
        );
    }

    #[test]
    fn bridge_interface_mode_without_a_bridge_is_rejected_naming_both_fields() {
        let message = err(&[], &[], Some("detect_local_mode = \"BridgeInterface\""));
        assert!(message.contains("detect_local_mode"), "{message}");
        assert!(message.contains(&format!("file {FILE}")), "{message}");
        assert!(
            message.contains("requires pod_bridge_interface (--pod-bridge-interface)"),
            "{message}"
        );
        let loaded = ok(
            &["--detect-local-mode=BridgeInterface"],
            &[("NODEPROXY_POD_BRIDGE_INTERFACE", "cni0")],
            None,
        );
        assert_eq!(loaded.config.pod_bridge_interface.as_deref(), Some("cni0"));
    }

    #[test]
    fn interface_name_prefix_mode_without_a_prefix_is_rejected_naming_both_fields() {
        let message = err(&["--detect-local-mode", "InterfaceNamePrefix"], &[], None);
        assert!(message.contains("detect_local_mode"), "{message}");
        assert!(
            message.contains("requires pod_interface_name_prefix (--pod-interface-name-prefix)"),
            "{message}"
        );
        // A prefix given without the mode is allowed (and unused).
        let loaded = ok(&["--pod-interface-name-prefix", "veth"], &[], None);
        assert_eq!(loaded.config.detect_local_mode(), DetectLocalMode::NodeCidr);
    }

    #[test]
    fn an_explicit_cluster_cidr_mode_without_a_cluster_cidr_is_rejected_naming_both_fields() {
        let message = err(&[], &[("NODEPROXY_DETECT_LOCAL_MODE", "ClusterCIDR")], None);
        assert!(
            message.contains("detect_local_mode `ClusterCIDR`"),
            "{message}"
        );
        assert!(
            message.contains("env NODEPROXY_DETECT_LOCAL_MODE"),
            "{message}"
        );
        assert!(
            message.contains("requires cluster_cidr (--cluster-cidr)"),
            "{message}"
        );
        let loaded = ok(
            &["--detect-local-mode", "clustercidr"],
            &[("NODEPROXY_CLUSTER_CIDR", "10.244.0.0/16")],
            None,
        );
        assert_eq!(
            loaded.config.detect_local_mode(),
            DetectLocalMode::ClusterCidr
        );
    }

    #[test]
    fn pod_interface_names_must_be_valid_linux_interface_names() {
        for bad in ["a-name-of-16-byt", "a/b", "eth0:1", "br 0", ".", ".."] {
            let message = err(&["--pod-bridge-interface", bad], &[], None);
            assert!(message.contains("pod_bridge_interface"), "{message}");
            assert!(message.contains("1 to 15 bytes"), "{message}");
        }
        for bad in ["sixteen-bytes-xx", "veth/", "cali:"] {
            let message = err(&["--pod-interface-name-prefix", bad], &[], None);
            assert!(message.contains("pod_interface_name_prefix"), "{message}");
            assert!(message.contains("1 to 15 bytes"), "{message}");
        }
        let loaded = ok(
            &[
                "--pod-bridge-interface",
                "fifteen-bytes-x",
                "--pod-interface-name-prefix",
                ".",
            ],
            &[],
            None,
        );
        assert_eq!(
            loaded.config.pod_bridge_interface.as_deref(),
            Some("fifteen-bytes-x")
        );
        assert_eq!(
            loaded.config.pod_interface_name_prefix.as_deref(),
            Some(".")
        );
        // Empty means unset, as for --hostname-override, so `--print-config` output reads back.
        let loaded = ok(
            &["--pod-bridge-interface="],
            &[],
            Some("pod_bridge_interface = \"cni0\""),
        );
        assert_eq!(loaded.config.pod_bridge_interface, None);
        assert_eq!(loaded.provenance.pod_bridge_interface, Source::Flag);
    }

    #[test]
    fn nodeport_addresses_accepts_primary_all_and_cidrs_in_combination() {
        let net = |text: &str| -> IpNet { text.parse().unwrap() };
        let parsed = |value: &str| {
            ok(&["--nodeport-addresses", value], &[], None)
                .config
                .nodeport_addresses
        };
        let addresses = parsed("primary,192.0.2.0/24");
        assert_eq!(
            addresses,
            NodePortAddresses {
                primary: true,
                all: false,
                cidrs: vec![net("192.0.2.0/24")],
            }
        );
        assert!(addresses.selects("198.51.100.1".parse().unwrap(), true));
        assert!(addresses.selects("192.0.2.9".parse().unwrap(), false));
        assert!(!addresses.selects("198.51.100.1".parse().unwrap(), false));
        assert!(!addresses.all_of(IpFamily::V4));

        let addresses = parsed("all");
        assert!(addresses.all && !addresses.primary && addresses.cidrs.is_empty());
        assert!(addresses.all_of(IpFamily::V4) && addresses.all_of(IpFamily::V6));

        let addresses = parsed("0.0.0.0/0");
        assert!(!addresses.primary && !addresses.all);
        assert!(addresses.all_of(IpFamily::V4));
        assert!(!addresses.all_of(IpFamily::V6));
        assert!(parsed("::/0").all_of(IpFamily::V6));

        assert_eq!(parsed("Primary"), NodePortAddresses::primary());
        let loaded = ok(
            &[],
            &[],
            Some("nodeport_addresses = [\"2001:db8::/64\", \"all\"]"),
        );
        assert_eq!(
            loaded.config.nodeport_addresses,
            NodePortAddresses {
                primary: false,
                all: true,
                cidrs: vec![net("2001:db8::/64")],
            }
        );
    }

    #[test]
    fn empty_nodeport_addresses_mean_primary() {
        let loaded = ok(
            &["--nodeport-addresses="],
            &[],
            Some("nodeport_addresses = \"all\""),
        );
        assert!(loaded.config.nodeport_addresses.is_primary_only());
        assert_eq!(loaded.provenance.nodeport_addresses, Source::Flag);
        let loaded = ok(&[], &[], Some("nodeport_addresses = []"));
        assert_eq!(
            loaded.config.nodeport_addresses,
            NodePortAddresses::primary()
        );
    }

    #[test]
    fn localhost_nodeports_are_rejected() {
        for value in ["localhost", "primary,localhost", "127.0.0.0/8", "::1/128"] {
            let message = err(&["--nodeport-addresses", value], &[], None);
            assert!(
                message.contains("localhost NodePorts are not supported"),
                "{message}"
            );
            assert!(message.contains("nodeport_addresses"), "{message}");
        }
    }

    #[test]
    fn a_bad_nodeport_cidr_is_rejected_naming_the_item() {
        let message = err(&["--nodeport-addresses", "primary,192.0.2.0/33"], &[], None);
        assert!(
            message.contains("`192.0.2.0/33` is not a CIDR"),
            "{message}"
        );
        assert!(message.contains("`primary`, `all` or CIDRs"), "{message}");
        assert!(message.contains("flag --nodeport-addresses"), "{message}");
        let message = err(
            &[],
            &[("NODEPROXY_NODEPORT_ADDRESSES", "192.0.2.1/24")],
            None,
        );
        assert!(message.contains("did you mean 192.0.2.0/24"), "{message}");
        let message = err(&[], &[], Some("nodeport_addresses = \"192.0.2.1\""));
        assert!(
            message.contains("192.0.2.1/32 for one address"),
            "{message}"
        );
        let message = err(&[], &[], Some("nodeport_addresses = \"primaryy\""));
        assert!(message.contains("`primaryy` is not a CIDR"), "{message}");
    }

    #[test]
    fn service_cidr_takes_one_cidr_per_family() {
        let loaded = ok(
            &["--service-cidr", "10.96.0.0/12,fd00:10:96::/112"],
            &[],
            None,
        );
        assert_eq!(
            loaded.config.service_cidr_of(IpFamily::V6),
            Some("fd00:10:96::/112".parse().unwrap())
        );
        let message = err(&["--service-cidr", "10.96.0.0/12,10.97.0.0/16"], &[], None);
        assert!(message.contains("service_cidr"), "{message}");
        assert!(message.contains("two IPv4 CIDRs"), "{message}");
        let message = err(&[], &[], Some("service_cidr = \"10.96.0.1\""));
        assert!(message.contains("write the service network"), "{message}");
    }

    #[test]
    fn master_must_be_an_http_or_https_url() {
        for good in [
            "https://api.example.com",
            "HTTPS://10.0.0.1:6443",
            "http://[::1]:8080/prefix",
        ] {
            let loaded = ok(&["--master", good], &[], None);
            assert_eq!(loaded.config.master.as_deref(), Some(good));
        }
        for bad in [
            "10.0.0.1:6443",
            "ftp://host",
            "https://",
            "https://host:99999",
            "https://host:0",
            "https://user:secret@host",
            "https://[::1",
            "https://ho st",
        ] {
            let message = err(&["--master", bad], &[], None);
            assert!(message.contains("master"), "{message}");
            assert!(message.contains("http:// or https:// URL"), "{message}");
        }
        assert_eq!(ok(&["--master="], &[], None).config.master, None);
    }

    #[test]
    fn an_empty_kubeconfig_means_unset_and_an_empty_lock_file_is_rejected() {
        let loaded = ok(&["--kubeconfig="], &[], Some("kubeconfig = \"/k\""));
        assert_eq!(loaded.config.kubeconfig, None);
        let message = err(&[], &[], Some("lock_file = \"\""));
        assert!(message.contains("lock_file"), "{message}");
        assert!(
            message.contains("/run/nodeproxy/nodeproxy.lock"),
            "{message}"
        );
        assert_eq!(
            Config::default().lock_file,
            PathBuf::from("/run/nodeproxy/nodeproxy.lock")
        );
    }

    #[test]
    fn bind_addresses_default_to_kube_proxy_ports_and_empty_disables_them() {
        let config = Config::default();
        assert_eq!(
            config.healthz_bind_address,
            Some("0.0.0.0:10256".parse().unwrap())
        );
        assert_eq!(
            config.metrics_bind_address,
            Some("127.0.0.1:10249".parse().unwrap())
        );
        let loaded = ok(
            &["--healthz-bind-address=", "--metrics-bind-address", ""],
            &[],
            None,
        );
        assert_eq!(loaded.config.healthz_bind_address, None);
        assert_eq!(loaded.config.metrics_bind_address, None);
        let rendered = render_effective(&loaded.config, &loaded.provenance);
        assert!(
            rendered.contains(
                "healthz_bind_address = \"\"  # flag --healthz-bind-address (disabled)\n"
            ),
            "{rendered}"
        );
    }

    #[test]
    fn a_bind_address_without_a_port_or_with_port_0_is_rejected() {
        let message = err(&["--healthz-bind-address", "192.0.2.1"], &[], None);
        assert!(message.contains("healthz_bind_address"), "{message}");
        assert!(message.contains("has no port"), "{message}");
        assert!(message.contains("192.0.2.1:10256"), "{message}");
        let message = err(&[], &[], Some("metrics_bind_address = \"[::]:0\""));
        assert!(message.contains("port 0 is not allowed"), "{message}");
        let message = err(&[], &[], Some("metrics_bind_address = \"nowhere\""));
        assert!(message.contains("ADDRESS:PORT"), "{message}");
    }

    #[test]
    fn healthz_and_metrics_on_the_same_port_are_rejected_naming_both_fields() {
        let message = err(&["--metrics-bind-address", "127.0.0.1:10256"], &[], None);
        assert!(message.contains("metrics_bind_address"), "{message}");
        assert!(
            message.contains("healthz_bind_address `0.0.0.0:10256` (from default)"),
            "{message}"
        );
        // Different families with specific addresses do not collide; `::` takes IPv4 too.
        ok(
            &[
                "--healthz-bind-address",
                "0.0.0.0:9000",
                "--metrics-bind-address",
                "[::1]:9000",
            ],
            &[],
            None,
        );
        err(
            &[
                "--healthz-bind-address",
                "[::]:9000",
                "--metrics-bind-address",
                "127.0.0.1:9000",
            ],
            &[],
            None,
        );
    }

    #[test]
    fn durations_round_trip_in_kube_proxy_syntax() {
        for (text, nanos, printed) in [
            ("1h30m", 5_400_000_000_000, "1h30m"),
            ("500ms", 500_000_000, "500ms"),
            ("1.5s", 1_500_000_000, "1.5s"),
            ("0", 0, "0s"),
            ("0s", 0, "0s"),
            ("90s", 90_000_000_000, "1m30s"),
            ("1h0m5s", 3_605_000_000_000, "1h5s"),
            ("1m0.25s", 60_250_000_000, "1m0.25s"),
            (".5m", 30_000_000_000, "30s"),
            ("2us", 2_000, "2µs"),
            ("1.5µs", 1_500, "1.5µs"),
            ("100ns", 100, "100ns"),
            ("+2s", 2_000_000_000, "2s"),
        ] {
            let parsed = parse_duration(text).unwrap();
            assert_eq!(parsed, Duration::from_nanos(nanos), "{text}");
            assert_eq!(format_duration(parsed), printed, "{text}");
            assert_eq!(parse_duration(printed).unwrap(), parsed, "{text}");
        }
    }

    #[test]
    fn invalid_durations_are_rejected_with_the_syntax() {
        for (text, why) in [
            ("-1s", "must not be negative"),
            ("30", "lacks a unit"),
            ("1d", "unknown unit `d`"),
            ("s", "does not start with a number"),
            ("1.5.5s", "lacks a unit"),
            ("9999999999h", "too long"),
        ] {
            let message = err(&["--sync-period", text], &[], None);
            assert!(message.contains(why), "{text}: {message}");
            assert!(message.contains("sync_period"), "{message}");
            assert!(message.contains("1h30m"), "{message}");
        }
        let message = err(&[], &[], Some("sync_period = 30"));
        assert!(message.contains("lacks a unit"), "{message}");
        let message = err(&[], &[], Some("min_sync_period = true"));
        assert!(message.contains("duration string"), "{message}");
    }

    #[test]
    fn sync_period_must_be_positive_and_min_sync_period_at_most_sync_period() {
        let message = err(&["--sync-period", "0s"], &[], None);
        assert!(message.contains("sync_period `0s`"), "{message}");
        assert!(message.contains("longer than 0"), "{message}");
        let loaded = ok(&["--min-sync-period", "0"], &[], None);
        assert_eq!(loaded.config.min_sync_period, Duration::ZERO);
        let loaded = ok(&["--min-sync-period", "30s"], &[], None);
        assert_eq!(loaded.config.min_sync_period, loaded.config.sync_period);

        let message = err(
            &["--min-sync-period", "1m", "--sync-period", "30s"],
            &[],
            None,
        );
        assert!(message.contains("min_sync_period `1m`"), "{message}");
        assert!(message.contains("flag --min-sync-period"), "{message}");
        assert!(
            message.contains("sync_period `30s` (from flag --sync-period)"),
            "{message}"
        );
        let message = err(&[], &[], Some("min_sync_period = \"31s\""));
        assert!(message.contains(&format!("file {FILE}")), "{message}");
        assert!(message.contains("(from default)"), "{message}");
    }

    #[test]
    fn health_timeout_is_twice_the_sync_period() {
        assert_eq!(Config::default().health_timeout(), Duration::from_secs(60));
        let loaded = ok(&["--sync-period", "1h30m"], &[], None);
        assert_eq!(
            loaded.config.health_timeout(),
            Duration::from_secs(3 * 3600)
        );
    }

    #[test]
    fn cleanup_kube_proxy_accepts_kube_proxy_boolean_spellings() {
        assert!(
            ok(&["--cleanup-kube-proxy"], &[], None)
                .config
                .cleanup_kube_proxy
        );
        assert!(
            ok(&[], &[("NODEPROXY_CLEANUP_KUBE_PROXY", "T")], None)
                .config
                .cleanup_kube_proxy
        );
        let loaded = ok(
            &["--cleanup-kube-proxy=0"],
            &[],
            Some("cleanup_kube_proxy = true"),
        );
        assert!(!loaded.config.cleanup_kube_proxy);
        let message = err(&[], &[], Some("cleanup_kube_proxy = \"yes\""));
        assert!(message.contains("cleanup_kube_proxy"), "{message}");
        assert!(message.contains("TOML boolean"), "{message}");
    }

    #[test]
    fn a_kube_proxy_yaml_key_with_an_acronym_gets_a_hint() {
        for (key, hint) in [
            ("clusterCIDR", "cluster_cidr"),
            ("detectLocalMode", "detect_local_mode"),
            ("healthzBindAddress", "healthz_bind_address"),
            ("syncPeriod", "sync_period"),
        ] {
            let message = err(&[], &[], Some(&format!("{key} = \"x\"")));
            assert!(
                message.contains(&format!("did you mean `{hint}`")),
                "{message}"
            );
        }
    }

    #[test]
    fn masquerade_all_accepts_kube_proxy_boolean_spellings() {
        assert!(ok(&["--masquerade-all"], &[], None).config.masquerade_all);
        assert!(
            ok(&["--masquerade-all=true"], &[], None)
                .config
                .masquerade_all
        );
        let loaded = ok(
            &["--masquerade-all=false"],
            &[],
            Some("masquerade_all = true"),
        );
        assert!(!loaded.config.masquerade_all);
        assert!(
            ok(&[], &[("NODEPROXY_MASQUERADE_ALL", "1")], None)
                .config
                .masquerade_all
        );
        assert!(err(&[], &[], Some("masquerade_all = \"true\"")).contains("TOML boolean"));
    }

    #[test]
    fn from_file_in_the_config_file_may_be_a_single_path() {
        let loaded = ok(&[], &[], Some("from_file = \"/a,b.yaml\""));
        assert_eq!(loaded.config.from_file, vec![PathBuf::from("/a,b.yaml")]);
    }

    #[test]
    fn the_config_file_can_be_named_by_the_environment() {
        let loaded = load_with(
            ["nodeproxy".into()],
            &|name| (name == CONFIG_ENV_VAR).then(|| FILE.to_string()),
            &|_| Ok("log_format = \"json\"".to_string()),
        )
        .unwrap();
        assert_eq!(loaded.config.log_format, LogFormat::Json);
        assert_eq!(
            loaded.provenance.config_file,
            Some((PathBuf::from(FILE), Source::Env(CONFIG_ENV_VAR.to_string())))
        );
    }

    #[test]
    fn a_missing_or_malformed_config_file_is_an_error_naming_the_path() {
        let message = load_with(
            ["nodeproxy".into(), "--config".into(), "/nope.toml".into()],
            &|_| None,
            &|_| Err(std::io::Error::from(std::io::ErrorKind::NotFound)),
        )
        .unwrap_err()
        .to_string();
        assert!(message.contains("/nope.toml"), "{message}");
        assert!(message.contains("flag --config"), "{message}");
        let message = err(&[], &[], Some("masquerade_bit = "));
        assert!(message.contains("not valid TOML"), "{message}");
        assert!(message.contains(FILE), "{message}");
    }

    #[test]
    fn load_reads_a_real_config_file() {
        let path =
            std::env::temp_dir().join(format!("nodeproxy-config-test-{}.toml", std::process::id()));
        std::fs::write(&path, "masquerade_bit = 9\n").unwrap();
        let result = load(
            ["nodeproxy".into(), "--config".into(), path.clone().into()],
            &|_| None,
        );
        std::fs::remove_file(&path).unwrap();
        assert_eq!(result.unwrap().config.masquerade_bit, 9);
    }

    #[test]
    fn print_config_output_parses_back_as_toml_and_reproduces_the_same_config() {
        let loaded = ok(
            &[
                "--hostname-override",
                "Worker-1",
                "--masquerade-all",
                "--from-file",
                "/tmp/with \"quotes\" and \\ backslash.yaml",
            ],
            &[("NODEPROXY_CLUSTER_CIDR", "10.244.0.0/16,fd00::/56")],
            Some("masquerade_bit = 3\nlog_format = \"json\""),
        );
        let rendered = render_effective(&loaded.config, &loaded.provenance);
        assert!(
            rendered.contains("hostname_override = \"worker-1\"  # flag --hostname-override\n"),
            "{rendered}"
        );
        assert!(
            rendered.contains("  # env NODEPROXY_CLUSTER_CIDR\n"),
            "{rendered}"
        );
        assert!(
            rendered.contains(&format!("masquerade_bit = 3  # file {FILE}\n")),
            "{rendered}"
        );
        assert!(rendered.contains("nodeport_addresses = \"primary\"  # default\n"));
        let reloaded = ok(&[], &[], Some(&rendered));
        assert_eq!(reloaded.config, loaded.config);

        // Every new kind of value: durations, bind addresses (one disabled), the derived
        // detect-local-mode default, nodeport keyword/CIDR combinations, optional strings.
        let loaded = ok(
            &[
                "--nodeport-addresses",
                "primary,192.0.2.0/24,::/0",
                "--sync-period",
                "1h30m",
                "--min-sync-period",
                "1.5s",
                "--healthz-bind-address=",
                "--metrics-bind-address",
                "[::1]:9100",
                "--cleanup-kube-proxy",
                "--pod-interface-name-prefix",
                "veth",
            ],
            &[
                ("NODEPROXY_CLUSTER_CIDR", "10.244.0.0/16"),
                ("NODEPROXY_SERVICE_CIDR", "10.96.0.0/12,fd00:10:96::/112"),
                ("NODEPROXY_KUBECONFIG", "/etc/kubernetes/kube-proxy.conf"),
                ("NODEPROXY_MASTER", "https://192.0.2.10:6443"),
            ],
            Some("lock_file = \"/var/lock/np.lock\"\npod_bridge_interface = \"cni0\""),
        );
        let rendered = render_effective(&loaded.config, &loaded.provenance);
        for line in [
            "detect_local_mode = \"ClusterCIDR\"  # default (ClusterCIDR when cluster_cidr is \
             set, else NodeCIDR)\n",
            "nodeport_addresses = \"primary,192.0.2.0/24,::/0\"  # flag --nodeport-addresses\n",
            "sync_period = \"1h30m\"  # flag --sync-period\n",
            "min_sync_period = \"1.5s\"  # flag --min-sync-period\n",
            "healthz_bind_address = \"\"  # flag --healthz-bind-address (disabled)\n",
            "metrics_bind_address = \"[::1]:9100\"  # flag --metrics-bind-address\n",
            "cleanup_kube_proxy = true  # flag --cleanup-kube-proxy\n",
            "master = \"https://192.0.2.10:6443\"  # env NODEPROXY_MASTER\n",
        ] {
            assert!(rendered.contains(line), "{line}\n{rendered}");
        }
        let reloaded = ok(&[], &[], Some(&rendered));
        assert_eq!(reloaded.config, loaded.config);

        let defaults = ok(&[], &[], None);
        let rendered = render_effective(&defaults.config, &defaults.provenance);
        assert!(rendered.contains("# config file: none"), "{rendered}");
        assert_eq!(ok(&[], &[], Some(&rendered)).config, Config::default());
    }

    #[test]
    fn mode_flags_and_verbosity_come_through_load() {
        let loaded = ok(&["--print-config", "-vv"], &[], None);
        assert_eq!(loaded.mode, Mode::PrintConfig);
        assert_eq!(loaded.verbosity, 2);
        assert_eq!(ok(&["--dry-run", "--v=4"], &[], None).mode, Mode::DryRun);
        assert_eq!(ok(&["--once"], &[], None).mode, Mode::Once);
        assert_eq!(ok(&["--cleanup"], &[], None).mode, Mode::Cleanup);
    }

    #[test]
    fn usage_errors_carry_clap_message_and_exit_2() {
        let error = run(&["--no-such-flag"], &[], None).unwrap_err();
        assert!(matches!(error, ConfigError::Usage(_)));
        assert!(error.to_string().contains("--no-such-flag"), "{error}");
        assert_eq!(error.exit_code(), 2);
        let error = run(&["--dry-run", "--cleanup"], &[], None).unwrap_err();
        assert!(matches!(error, ConfigError::Usage(_)), "{error}");
    }

    #[test]
    fn help_and_version_are_not_failures() {
        for flag in ["--help", "--version"] {
            let error = run(&[flag], &[], None).unwrap_err();
            assert!(matches!(error, ConfigError::HelpOrVersion(_)), "{error}");
            assert_eq!(error.exit_code(), 0);
        }
        let help = run(&["--help"], &[], None).unwrap_err().to_string();
        assert!(help.contains("--hostname-override"), "{help}");
        assert!(help.contains("/etc/nodeproxy/config.toml"), "{help}");
    }

    #[test]
    fn a_cluster_cidr_containing_a_cluster_ip_is_reported() {
        let config = Config {
            cluster_cidr: vec![
                "10.96.0.0/12".parse().unwrap(),
                "fd00:10:244::/56".parse().unwrap(),
            ],
            ..Config::default()
        };
        let ips = vec![
            (
                "kube-system/kube-dns".to_string(),
                "10.96.0.10".parse().unwrap(),
            ),
            (
                "default/kubernetes".to_string(),
                "10.96.0.1".parse().unwrap(),
            ),
            ("default/outside".to_string(), "192.0.2.1".parse().unwrap()),
        ];
        let messages = overlapping_cluster_cidr(&config, &ips);
        assert_eq!(messages.len(), 1, "{messages:?}");
        assert!(
            messages[0].starts_with(
                "--cluster-cidr 10.96.0.0/12 contains ClusterIP 10.96.0.1 of default/kubernetes \
                 (and 1 other ClusterIP): the cluster CIDR must be the pod network, not the \
                 service network"
            ),
            "{}",
            messages[0]
        );
        let pods_only = Config {
            cluster_cidr: vec!["10.244.0.0/16".parse().unwrap()],
            ..Config::default()
        };
        assert!(overlapping_cluster_cidr(&pods_only, &ips).is_empty());
    }

    #[test]
    fn unknown_nodeproxy_environment_variables_are_named_with_the_closest_valid_one() {
        let names = [
            "NODEPROXY_CLUSTER_CIRD",
            "NODEPROXY_CLUSTER_CIDR",
            "NODEPROXY_LOG",
            "NODEPROXY_EXTRA_ARGS",
            "NODEPROXY_CONFIG",
            "NODEPROXY_SOMETHING_ELSE_ENTIRELY",
            "PATH",
            "KUBECONFIG",
        ]
        .map(String::from);
        let warnings = unknown_env_vars(names);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].contains("NODEPROXY_CLUSTER_CIRD")
                && warnings[0].contains("did you mean NODEPROXY_CLUSTER_CIDR?"),
            "{warnings:?}"
        );
        assert!(
            warnings[1].contains("NODEPROXY_SOMETHING_ELSE_ENTIRELY")
                && !warnings[1].contains("did you mean"),
            "{warnings:?}"
        );
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }
}
