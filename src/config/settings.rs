//! Every setting, declared once: its field, type, default, parser, flag shape and help. The
//! `Config` struct, the `Field` list, the flags, environment variables, config keys,
//! `--print-config`, the packaged default file and the README table are all generated from
//! these declarations.
//!
//! Adding a setting: one entry below (and a parser in `values.rs` if no existing one fits);
//! `cargo test` then says which documentation to regenerate.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;

use super::values::{self as v, Input, ToToml as _};
use super::{
    DEFAULT_HEALTHZ_BIND_ADDRESS, DEFAULT_LOCK_FILE, DEFAULT_METRICS_BIND_ADDRESS,
    DEFAULT_MIN_SYNC_PERIOD, DEFAULT_SYNC_PERIOD, DetectLocalMode, LogFormat, NodePortAddresses,
    Qps, TableOwnership,
};

/// How a setting's flag takes its value on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArgKind {
    /// `--flag VALUE`.
    Text,
    /// `--flag` alone means true; `--flag=false` is the only way to give a value, so a bare
    /// boolean flag never swallows the next word (kube-proxy's boolean flags behave so too).
    Bool,
    /// A value that may start with `-`: a signed number, or a duration (whose parser then says
    /// durations cannot be negative) rather than clap's "unexpected argument".
    Signed,
    /// One path; empty is allowed (it means unset), which clap's `PathBuf` parser rejects.
    Path,
    /// A repeatable path (`--from-file A --from-file B`; comma-separated in the environment).
    Paths,
}

/// What a declaration says about a setting besides its type, default and parser.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub arg: ArgKind,
    /// The flag's value placeholder in `--help`, e.g. `CIDR[,CIDR]`.
    pub value_name: &'static str,
    /// The help text (the declaration's doc comment), one paragraph.
    pub help: &'static str,
    /// The default as `--help` and the README describe it, when the rendered default value is
    /// not the whole story (`detect_local_mode`'s depends on `cluster_cidr`).
    pub default_text: Option<&'static str>,
    /// `--print-config`'s note when the value is empty (what empty means).
    pub unset_note: Option<&'static str>,
    /// How the environment variable's value differs from the flag's, if it does.
    pub env_note: Option<&'static str>,
    /// kube-proxy's other spellings of the flag (`iptables-sync-period`), accepted as aliases.
    pub kube_flags: &'static [&'static str],
    /// The `KubeProxyConfiguration` field with the same meaning, if there is one.
    pub kube_field: Option<KubeField>,
}

/// A `KubeProxyConfiguration` (v1alpha1) field, by its dotted JSON path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KubeField {
    pub path: &'static str,
    /// A pointer field (`*int32` upstream): only `null` means "default", so an explicit 0 is a
    /// value. Other fields are defaulted when they hold their type's zero value (`""`, `0`,
    /// `false`, `0s`, `[]`), as kube-proxy's `SetDefaults_KubeProxyConfiguration` does.
    pub pointer: bool,
}

const fn kube(path: &'static str) -> Option<KubeField> {
    Some(KubeField {
        path,
        pointer: false,
    })
}

const fn pointer(path: &'static str) -> Option<KubeField> {
    Some(KubeField {
        path,
        pointer: true,
    })
}

const TEXT: Spec = Spec {
    arg: ArgKind::Text,
    value_name: "VALUE",
    help: "",
    default_text: None,
    unset_note: None,
    env_note: None,
    kube_flags: &[],
    kube_field: None,
};

/// Declares the settings: `Variant field: Type = default, parser, Spec { … }`, under the
/// setting's help as its doc comment.
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])+
        $variant:ident $field:ident : $ty:ty = $default:expr, $parse:path, $spec:expr;
    )+) => {
        /// The effective configuration after merging all sources; one field per setting, as
        /// declared in `config/settings.rs`.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct Config {
            $($(#[doc = $doc])+ pub $field: $ty,)+
        }

        impl Default for Config {
            fn default() -> Config {
                Config { $($field: $default,)+ }
            }
        }

        /// One setting, named in every source by `key`, `flag` and `env_var`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Field { $($variant,)+ }

        impl Field {
            /// Every setting, in declaration order (also the `--print-config` order).
            pub const ALL: &'static [Field] = &[$(Field::$variant,)+];

            /// The config-file key, which is also the field's name in `Config`.
            pub fn key(self) -> &'static str {
                match self { $(Field::$variant => stringify!($field),)+ }
            }

            /// The declaration's details.
            pub fn spec(self) -> &'static Spec {
                match self {
                    $(Field::$variant => {
                        const SPEC: Spec = Spec { help: concat!($($doc),+), ..$spec };
                        &SPEC
                    })+
                }
            }
        }

        /// Validates one raw value of `field` and stores it in `config`.
        pub(super) fn apply(config: &mut Config, field: Field, input: &Input) -> Result<(), String> {
            match field { $(Field::$variant => config.$field = $parse(input)?,)+ }
            Ok(())
        }

        /// A field's effective value as a TOML value.
        pub(super) fn toml_value(config: &Config, field: Field) -> toml::Value {
            match field { $(Field::$variant => config.$field.to_toml(),)+ }
        }
    };
}

settings! {
    /// Use this name instead of the host name as the node's name: it decides which endpoints are
    /// local and which Node object is ours (trimmed, lowercased; empty means unset).
    HostnameOverride hostname_override: Option<String> = None, v::hostname,
        Spec { value_name: "NAME", default_text: Some("host name"), kube_field: kube("hostnameOverride"),
               unset_note: Some("unset: the host name is used"), ..TEXT };
    /// The kubeconfig file used to reach the API server (empty means unset).
    Kubeconfig kubeconfig: Option<PathBuf> = None, v::optional_path,
        Spec { arg: ArgKind::Path, value_name: "FILE", kube_field: kube("clientConnection.kubeconfig"),
               ..TEXT };
    /// The API server's URL (http:// or https://); overrides the kubeconfig's.
    Master master: Option<String> = None, v::api_url,
        Spec { value_name: "URL", ..TEXT };
    /// The average rate of requests to the API server (per second, > 0), as kube-proxy's
    /// client: a list or watch takes one request (a list's later pages none), Events one each.
    KubeApiQps kube_api_qps: Qps = Qps(5.0), v::qps,
        Spec { value_name: "QPS", kube_field: kube("clientConnection.qps"), ..TEXT };
    /// How many requests to the API server may go out at once before --kube-api-qps applies.
    KubeApiBurst kube_api_burst: u32 = 10, v::burst,
        Spec { value_name: "N", kube_field: kube("clientConnection.burst"), ..TEXT };
    /// Pod network CIDRs, comma-separated, at most one per family (an IPv4,IPv6 pair for
    /// dual-stack). Traffic to ClusterIPs from outside them is masqueraded.
    ClusterCidr cluster_cidr: Vec<IpNet> = Vec::new(), v::pod_cidrs,
        Spec { value_name: "CIDR[,CIDR]", kube_field: kube("clusterCIDR"), ..TEXT };
    /// Service IP ranges, comma-separated, at most one per family. Traffic to unallocated IPs
    /// inside them is dropped. Unset: the cluster's ServiceCIDR objects give them.
    ServiceCidr service_cidr: Vec<IpNet> = Vec::new(), v::service_cidrs,
        Spec { value_name: "CIDR[,CIDR]", ..TEXT };
    /// How traffic from local pods is recognised: ClusterCIDR (source in --cluster-cidr),
    /// NodeCIDR (source in the Node's podCIDRs), BridgeInterface (arrives on
    /// --pod-bridge-interface) or InterfaceNamePrefix (arrives on an interface named with
    /// --pod-interface-name-prefix); case-insensitive.
    DetectLocalMode detect_local_mode: DetectLocalMode = DetectLocalMode::default_for(&[]),
        v::detect_local_mode,
        Spec { value_name: "MODE", kube_field: kube("detectLocalMode"),
               default_text: Some("ClusterCIDR when cluster_cidr is set, else NodeCIDR"), ..TEXT };
    /// The bridge local pods are attached to (for --detect-local-mode=BridgeInterface; 1 to 15
    /// bytes, no '/', ':' or whitespace).
    PodBridgeInterface pod_bridge_interface: Option<String> = None, v::bridge_interface,
        Spec { value_name: "NAME", kube_field: kube("detectLocal.bridgeInterface"), ..TEXT };
    /// The name prefix of local pod interfaces (for --detect-local-mode=InterfaceNamePrefix;
    /// 1 to 15 bytes).
    PodInterfaceNamePrefix pod_interface_name_prefix: Option<String> = None,
        v::interface_prefix,
        Spec { value_name: "PREFIX", kube_field: kube("detectLocal.interfaceNamePrefix"), ..TEXT };
    /// Masquerade all traffic to ClusterIPs. Also accepts --masquerade-all=true|false.
    MasqueradeAll masquerade_all: bool = false, v::boolean,
        Spec { arg: ArgKind::Bool, value_name: "BOOL", kube_field: kube("nftables.masqueradeAll"),
               ..TEXT };
    /// The packet mark bit (0..=31) used to flag packets for masquerade.
    MasqueradeBit masquerade_bit: u8 = 14, v::masquerade_bit,
        Spec { value_name: "N", kube_flags: &["iptables-masquerade-bit"],
               kube_field: pointer("nftables.masqueradeBit"),
               ..TEXT };
    /// Which local addresses answer NodePorts, comma-separated: `primary` (the Node object's
    /// first InternalIP of each family, kube-proxy's nftables default), `all` (any local
    /// address except loopback), and CIDRs (selecting the Node object's InternalIP/ExternalIP
    /// addresses inside them; 0.0.0.0/0 or ::/0: all of that family). Empty means `primary`;
    /// `localhost` is not supported.
    NodePortAddresses nodeport_addresses: NodePortAddresses = NodePortAddresses::default(),
        v::nodeport_addresses,
        Spec { value_name: "VALUE[,VALUE]", kube_field: kube("nodePortAddresses"), ..TEXT };
    /// Where the health check server listens; empty disables it.
    HealthzBindAddress healthz_bind_address: Option<SocketAddr> =
        Some(DEFAULT_HEALTHZ_BIND_ADDRESS), v::healthz_address,
        Spec { value_name: "ADDR:PORT", unset_note: Some("disabled"),
               kube_field: kube("healthzBindAddress"), ..TEXT };
    /// Where the metrics server listens; empty disables it. It must not share the health
    /// check's port.
    MetricsBindAddress metrics_bind_address: Option<SocketAddr> =
        Some(DEFAULT_METRICS_BIND_ADDRESS), v::metrics_address,
        Spec { value_name: "ADDR:PORT", unset_note: Some("disabled"),
               kube_field: kube("metricsBindAddress"), ..TEXT };
    /// Exit when the health check or metrics server cannot bind its address, instead of
    /// logging it and retrying. Also accepts --bind-address-hard-fail=true|false.
    BindAddressHardFail bind_address_hard_fail: bool = false, v::boolean,
        Spec { arg: ArgKind::Bool, value_name: "BOOL", kube_field: kube("bindAddressHardFail"),
               ..TEXT };
    /// The shortest time between two syncs of the ruleset (at most --sync-period). Durations
    /// are written as kube-proxy writes them: 500ms, 2s, 1h30m, 1.5s, 0.
    MinSyncPeriod min_sync_period: Duration = DEFAULT_MIN_SYNC_PERIOD, v::duration,
        Spec { arg: ArgKind::Signed, value_name: "DURATION",
               kube_flags: &["iptables-min-sync-period"], kube_field: kube("nftables.minSyncPeriod"),
               ..TEXT };
    /// The longest time between two syncs of the ruleset (> 0); the health check fails after
    /// twice this without a successful sync.
    SyncPeriod sync_period: Duration = DEFAULT_SYNC_PERIOD, v::positive_period,
        Spec { arg: ArgKind::Signed, value_name: "DURATION",
               kube_flags: &["iptables-sync-period"], kube_field: kube("nftables.syncPeriod"),
               ..TEXT };
    /// The file locked so that only one nodeproxy runs on the node.
    LockFile lock_file: PathBuf = PathBuf::from(DEFAULT_LOCK_FILE), v::lock_file,
        Spec { arg: ArgKind::Path, value_name: "PATH", ..TEXT };
    /// nf_conntrack_max per CPU: the table is raised to this times the CPUs (at most 1048576),
    /// or to --conntrack-min if that is more; 0 leaves it and the hash size alone. Applied at
    /// start-up and by --init-only, written only when it would grow.
    ConntrackMaxPerCore conntrack_max_per_core: u32 = 32 * 1024, v::count,
        Spec { value_name: "N", kube_field: pointer("conntrack.maxPerCore"), ..TEXT };
    /// The least nf_conntrack_max to set, whatever the CPU count (with
    /// --conntrack-max-per-core > 0).
    ConntrackMin conntrack_min: u32 = 128 * 1024, v::count,
        Spec { value_name: "N", kube_field: pointer("conntrack.min"), ..TEXT };
    /// nf_conntrack_tcp_timeout_established: how long an idle established TCP connection is
    /// tracked; 0 leaves the kernel's value.
    ConntrackTcpTimeoutEstablished conntrack_tcp_timeout_established: Duration =
        Duration::from_secs(24 * 3600), v::duration,
        Spec { arg: ArgKind::Signed, value_name: "DURATION",
               kube_field: pointer("conntrack.tcpEstablishedTimeout"), ..TEXT };
    /// nf_conntrack_tcp_timeout_close_wait: how long a TCP connection in CLOSE_WAIT is
    /// tracked; 0 leaves the kernel's value.
    ConntrackTcpTimeoutCloseWait conntrack_tcp_timeout_close_wait: Duration =
        Duration::from_secs(3600), v::duration,
        Spec { arg: ArgKind::Signed, value_name: "DURATION",
               kube_field: pointer("conntrack.tcpCloseWaitTimeout"), ..TEXT };
    /// Set nf_conntrack_tcp_be_liberal, so that out-of-window TCP packets are not marked
    /// INVALID. Also accepts --conntrack-tcp-be-liberal=true|false.
    ConntrackTcpBeLiberal conntrack_tcp_be_liberal: bool = false, v::boolean,
        Spec { arg: ArgKind::Bool, value_name: "BOOL", kube_field: kube("conntrack.tcpBeLiberal"),
               ..TEXT };
    /// nf_conntrack_udp_timeout: how long an unreplied UDP flow is tracked; 0 leaves the
    /// kernel's value.
    ConntrackUdpTimeout conntrack_udp_timeout: Duration = Duration::ZERO, v::duration,
        Spec { arg: ArgKind::Signed, value_name: "DURATION",
               kube_field: kube("conntrack.udpTimeout"), ..TEXT };
    /// nf_conntrack_udp_timeout_stream: how long an assured UDP flow is tracked; 0 leaves the
    /// kernel's value.
    ConntrackUdpTimeoutStream conntrack_udp_timeout_stream: Duration = Duration::ZERO,
        v::duration,
        Spec { arg: ArgKind::Signed, value_name: "DURATION",
               kube_field: kube("conntrack.udpStreamTimeout"), ..TEXT };
    /// The process's oom_score_adj (-1000..=1000), set at start-up when it differs; lowering
    /// it needs CAP_SYS_RESOURCE, and a refusal is logged at info level, as kube-proxy does.
    OomScoreAdj oom_score_adj: i32 = -999, v::oom_score_adj,
        Spec { arg: ArgKind::Signed, value_name: "N", kube_field: pointer("oomScoreAdj"),
               ..TEXT };
    /// Remove what kube-proxy programmed. Also accepts --cleanup-kube-proxy=true|false.
    CleanupKubeProxy cleanup_kube_proxy: bool = false, v::boolean,
        Spec { arg: ArgKind::Bool, value_name: "BOOL", ..TEXT };
    /// Read Services/EndpointSlices/Nodes from this YAML/JSON file instead of the API server
    /// (repeatable).
    FromFile from_file: Vec<PathBuf> = Vec::new(), v::paths,
        Spec { arg: ArgKind::Paths, value_name: "PATH", env_note: Some("comma-separated"),
               ..TEXT };
    /// Log format: `text` or `json` (logs go to stderr).
    LogFormat log_format: LogFormat = LogFormat::Text, v::log_format,
        Spec { value_name: "FORMAT", kube_flags: &["logging-format"],
               kube_field: kube("logging.format"), ..TEXT };
    /// nftables table ownership: `auto` (where the kernel supports it, 6.9+: no other process
    /// can change the tables while nodeproxy runs, and they stay when it exits; `nft` before
    /// 1.1 then prints an orphaned table with an empty `flags` line, which `nft -f` cannot load
    /// back) or `off` (ordinary tables, repaired at the next sync if changed).
    TableOwnership table_ownership: TableOwnership = TableOwnership::Auto, v::table_ownership,
        Spec { value_name: "auto|off", ..TEXT };
}

impl Field {
    /// The command-line flag, as kube-proxy spells it: `--` and the key with dashes.
    pub fn flag(self) -> String {
        format!("--{}", self.key().replace('_', "-"))
    }

    /// The environment variable: `NODEPROXY_` and the key in upper case.
    pub fn env_var(self) -> String {
        format!("NODEPROXY_{}", self.key().to_ascii_uppercase())
    }

    /// The help text without the doc comments' line structure.
    pub fn help(self) -> String {
        self.spec()
            .help
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The default as documentation shows it, or `None` when there is none (an empty value).
    pub fn default_text(self) -> Option<String> {
        if let Some(text) = self.spec().default_text {
            return Some(text.to_string());
        }
        match toml_value(&Config::default(), self) {
            toml::Value::String(text) if text.is_empty() => None,
            toml::Value::Array(items) if items.is_empty() => None,
            toml::Value::String(text) => Some(text),
            other => Some(other.to_string()),
        }
    }
}

/// A field's effective value in TOML syntax, so `--print-config` output is a config file.
pub(super) fn render_value(config: &Config, field: Field) -> String {
    toml_value(config, field).to_string()
}
