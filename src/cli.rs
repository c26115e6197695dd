//! Command-line definition (clap): the mode flags and the kube-proxy-named options.
//!
//! Values are taken as plain strings here and validated in `config`, so a bad value reads the
//! same whether it came from a flag, the environment or the config file (each error names the
//! field, the value and where it came from). The `NODEPROXY_*` environment is deliberately NOT
//! wired through clap's `env` attribute: clap would read the real process environment, and
//! `config::load` takes the environment as a closure so tests stay hermetic.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{ArgAction, ArgGroup, Args, Parser, Subcommand};

use crate::explain::Query;

/// What the process should do, chosen by at most one mode flag or the `explain` subcommand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// No mode flag: watch the cluster and keep the kernel in sync.
    Run,
    /// `--dry-run`: print the nft ruleset that would be programmed, then exit.
    DryRun,
    /// `--once`: program the kernel once, then exit.
    Once,
    /// `--cleanup`: remove everything nodeproxy programmed, then exit.
    Cleanup,
    /// `--print-config`: print the effective configuration with the source of each value.
    PrintConfig,
    /// `explain SRC DST:PORT/PROTO`: print the path of one packet through the `--dry-run`
    /// ruleset.
    Explain(Query),
}

const AFTER_HELP: &str = "\
Precedence, for every setting: flag > NODEPROXY_* environment variable > config file > default.
A config file never overrides a flag or an environment variable; --print-config shows where
each effective value came from. An environment variable set to the empty string counts as
unset.

Config file: TOML, keys are the flag names in snake_case (hostname_override, kubeconfig,
master, cluster_cidr, service_cidr, detect_local_mode, pod_bridge_interface,
pod_interface_name_prefix, masquerade_all, masquerade_bit, nodeport_addresses,
healthz_bind_address, metrics_bind_address, min_sync_period, sync_period, lock_file,
cleanup_kube_proxy, from_file, log_format, table_ownership). No file is read unless --config (or
NODEPROXY_CONFIG) names one; the conventional path is /etc/nodeproxy/config.toml. Unknown keys
are errors.

Durations are written as kube-proxy writes them: 500ms, 2s, 1m, 1h30m, 1.5s (units ns, us, ms,
s, m, h), or 0.

Exit status: 0 ok, 1 runtime failure, 2 usage or configuration error.";

/// What `--version` prints after the name: the version, the git commit and the target it was
/// built for (recorded by `build.rs`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("NODEPROXY_GIT_COMMIT"),
    ", ",
    env!("NODEPROXY_TARGET"),
    ")"
);

/// `nodeproxy [OPTIONS]`: the raw command line, before merging with environment and file.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "nodeproxy",
    version = VERSION,
    about = "kube-proxy replacement that programs nftables over netlink",
    after_help = AFTER_HELP,
    group(ArgGroup::new("mode").multiple(false))
)]
pub struct Cli {
    /// Print the nft ruleset that would be programmed, then exit.
    #[arg(long, group = "mode")]
    pub dry_run: bool,

    /// Program the kernel once, then exit.
    #[arg(long, group = "mode")]
    pub once: bool,

    /// Remove everything nodeproxy programmed (its own tables), then exit.
    #[arg(long, group = "mode")]
    pub cleanup: bool,

    /// Print the effective configuration, with the source of each value, then exit.
    #[arg(long, group = "mode")]
    pub print_config: bool,

    /// Read settings from this TOML file; flags and NODEPROXY_* variables override it.
    /// [env: NODEPROXY_CONFIG]
    #[arg(long, value_name = "FILE", global = true)]
    pub config: Option<PathBuf>,

    /// Use this name instead of the host name as the node's name (trimmed, lowercased; empty
    /// means unset). [env: NODEPROXY_HOSTNAME_OVERRIDE]
    #[arg(long, value_name = "NAME", global = true)]
    pub hostname_override: Option<String>,

    /// The kubeconfig file used to reach the API server. [env: NODEPROXY_KUBECONFIG]
    // An `OsString`, not a `PathBuf`: clap rejects an empty `PathBuf`, and empty means unset.
    #[arg(long, value_name = "FILE", global = true)]
    pub kubeconfig: Option<OsString>,

    /// The API server's URL (http:// or https://); overrides the kubeconfig's.
    /// [env: NODEPROXY_MASTER]
    #[arg(long, value_name = "URL", global = true)]
    pub master: Option<String>,

    /// Pod network CIDRs, comma-separated, at most one per family (an IPv4,IPv6 pair for
    /// dual-stack). Traffic to ClusterIPs from outside them is masqueraded.
    /// [env: NODEPROXY_CLUSTER_CIDR]
    #[arg(long, value_name = "CIDR[,CIDR]", global = true)]
    pub cluster_cidr: Option<String>,

    /// Service IP ranges, comma-separated, at most one per family. Traffic to unallocated IPs
    /// inside them is dropped. [env: NODEPROXY_SERVICE_CIDR]
    #[arg(long, value_name = "CIDR[,CIDR]", global = true)]
    pub service_cidr: Option<String>,

    /// How traffic from local pods is recognised: ClusterCIDR (source in --cluster-cidr),
    /// NodeCIDR (source in the Node's podCIDRs), BridgeInterface (arrives on
    /// --pod-bridge-interface) or InterfaceNamePrefix (arrives on an interface named with
    /// --pod-interface-name-prefix); case-insensitive. [env: NODEPROXY_DETECT_LOCAL_MODE]
    /// [default: ClusterCIDR if --cluster-cidr is set, else NodeCIDR]
    #[arg(long, value_name = "MODE", global = true)]
    pub detect_local_mode: Option<String>,

    /// The bridge local pods are attached to (for --detect-local-mode=BridgeInterface).
    /// [env: NODEPROXY_POD_BRIDGE_INTERFACE]
    #[arg(long, value_name = "NAME", global = true)]
    pub pod_bridge_interface: Option<String>,

    /// The name prefix of local pod interfaces (for
    /// --detect-local-mode=InterfaceNamePrefix). [env: NODEPROXY_POD_INTERFACE_NAME_PREFIX]
    #[arg(long, value_name = "PREFIX", global = true)]
    pub pod_interface_name_prefix: Option<String>,

    /// Masquerade all traffic to ClusterIPs. Also accepts --masquerade-all=true|false.
    /// [env: NODEPROXY_MASQUERADE_ALL] [default: false]
    // `require_equals` keeps `--masquerade-all` followed by another word from swallowing that
    // word as its value, which is also how kube-proxy's boolean flags behave.
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        global = true
    )]
    pub masquerade_all: Option<String>,

    /// The packet mark bit (0..=31) used to flag packets for masquerade.
    /// [env: NODEPROXY_MASQUERADE_BIT] [default: 14]
    #[arg(long, value_name = "N", global = true)]
    pub masquerade_bit: Option<String>,

    /// Which local addresses answer NodePorts, comma-separated: `primary` (the Node's primary
    /// InternalIP of each family), `all`, and CIDRs (0.0.0.0/0 or ::/0: all of that family).
    /// Empty means `primary`; `localhost` is not supported.
    /// [env: NODEPROXY_NODEPORT_ADDRESSES] [default: primary]
    #[arg(long, value_name = "VALUE[,VALUE]", global = true)]
    pub nodeport_addresses: Option<String>,

    /// Where the health check server listens; empty disables it.
    /// [env: NODEPROXY_HEALTHZ_BIND_ADDRESS] [default: 0.0.0.0:10256]
    #[arg(long, value_name = "ADDR:PORT", global = true)]
    pub healthz_bind_address: Option<String>,

    /// Where the metrics server listens; empty disables it.
    /// [env: NODEPROXY_METRICS_BIND_ADDRESS] [default: 127.0.0.1:10249]
    #[arg(long, value_name = "ADDR:PORT", global = true)]
    pub metrics_bind_address: Option<String>,

    /// The shortest time between two syncs of the ruleset (at most --sync-period).
    /// [env: NODEPROXY_MIN_SYNC_PERIOD] [default: 1s]
    // Hyphen values reach `config`, whose error for `-1s` says durations cannot be negative.
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        global = true
    )]
    pub min_sync_period: Option<String>,

    /// The longest time between two syncs of the ruleset (> 0); the health check fails after
    /// twice this without a successful sync. [env: NODEPROXY_SYNC_PERIOD] [default: 30s]
    #[arg(
        long,
        value_name = "DURATION",
        allow_hyphen_values = true,
        global = true
    )]
    pub sync_period: Option<String>,

    /// The file locked so that only one nodeproxy runs on the node.
    /// [env: NODEPROXY_LOCK_FILE] [default: /run/nodeproxy/nodeproxy.lock]
    #[arg(long, value_name = "PATH", global = true)]
    pub lock_file: Option<OsString>,

    /// Remove what kube-proxy programmed. Also accepts --cleanup-kube-proxy=true|false.
    /// [env: NODEPROXY_CLEANUP_KUBE_PROXY] [default: false]
    #[arg(
        long,
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        global = true
    )]
    pub cleanup_kube_proxy: Option<String>,

    /// Read Services/EndpointSlices/Nodes from this YAML/JSON file instead of the API server
    /// (repeatable). [env: NODEPROXY_FROM_FILE, comma-separated]
    #[arg(long, value_name = "PATH", action = ArgAction::Append, global = true)]
    pub from_file: Vec<PathBuf>,

    /// With --once, --dry-run or explain: accept an input that holds no Service at all.
    /// Without it such an input (an empty file, a failed `kubectl get > file`, `---`, `null`)
    /// is an error, since programming it would remove every Service rule on the node.
    #[arg(long, global = true)]
    pub allow_empty: bool,

    /// The most bytes read from each --from-file file: a number of bytes, or one with a
    /// suffix Ki, Mi or Gi (powers of 1024). A larger file is an error. [default: 1Gi]
    #[arg(long, value_name = "SIZE", global = true)]
    pub max_input_size: Option<String>,

    /// Log format: `text` or `json`. [env: NODEPROXY_LOG_FORMAT] [default: text]
    #[arg(long, value_name = "FORMAT", global = true)]
    pub log_format: Option<String>,

    /// nftables table ownership: `auto` (where the kernel supports it, 6.9+: no other process
    /// can change the tables while nodeproxy runs, and they stay when it exits; `nft` before
    /// 1.1 then prints an orphaned table with an empty `flags` line, which `nft -f` cannot load
    /// back) or `off` (ordinary tables, repaired at the next sync if changed).
    /// [env: NODEPROXY_TABLE_OWNERSHIP] [default: auto]
    #[arg(long, value_name = "auto|off", global = true)]
    pub table_ownership: Option<String>,

    /// More verbose logging; repeat for more (-vv).
    #[arg(short = 'v', action = ArgAction::Count, global = true)]
    pub verbose: u8,

    /// Log verbosity level, as kube-proxy's --v=N. The higher of -v count and --v wins.
    #[arg(long = "v", value_name = "N", global = true)]
    pub v: Option<u8>,

    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Subcommands. The configuration flags are global so they may follow the subcommand, as in
/// `nodeproxy explain --from-file F --cluster-cidr C SRC DST`.
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Show the path of one new connection through the ruleset `--dry-run` prints: hooks and
    /// chains, matching rules, DNAT candidates, masquerade and verdict. Kernel untouched.
    Explain(ExplainArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ExplainArgs {
    /// Source address of the packet.
    #[arg(value_name = "SRC")]
    pub src: String,

    /// Destination: ADDRESS:PORT/PROTO, `[IPv6]:PORT/PROTO` for IPv6; PROTO is tcp, udp or
    /// sctp (default tcp).
    #[arg(value_name = "DST:PORT/PROTO")]
    pub dst: String,

    /// Where the packet comes from: `pod` (a pod on this node), `host` (this node's
    /// processes) or `external`. Default: host if SRC is a node address, pod if it is inside
    /// --cluster-cidr, else external.
    #[arg(long, value_name = "pod|host|external")]
    pub from: Option<String>,
}

impl Cli {
    /// The mode chosen by the (mutually exclusive, enforced by clap) mode flags. `explain` is
    /// resolved by `config::load`, which validates its arguments.
    pub fn mode(&self) -> Mode {
        if self.dry_run {
            Mode::DryRun
        } else if self.once {
            Mode::Once
        } else if self.cleanup {
            Mode::Cleanup
        } else if self.print_config {
            Mode::PrintConfig
        } else {
            Mode::Run
        }
    }

    /// The verbosity from `-v` (counted) and `--v N`; the higher wins so that mixing the two
    /// spellings never lowers what either asked for.
    pub fn verbosity(&self) -> u8 {
        self.verbose.max(self.v.unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Field;
    use clap::CommandFactory;

    #[test]
    fn the_clap_definition_is_internally_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn counted_v_and_long_v_both_set_verbosity() {
        let cli = Cli::try_parse_from(["nodeproxy", "-vvv"]).unwrap();
        assert_eq!(cli.verbosity(), 3);
        let cli = Cli::try_parse_from(["nodeproxy", "--v=4"]).unwrap();
        assert_eq!(cli.verbosity(), 4);
        let cli = Cli::try_parse_from(["nodeproxy", "--v", "2", "-vvvvv"]).unwrap();
        assert_eq!(cli.verbosity(), 5);
    }

    #[test]
    fn mode_flags_are_mutually_exclusive() {
        assert!(Cli::try_parse_from(["nodeproxy", "--dry-run", "--once"]).is_err());
        let cli = Cli::try_parse_from(["nodeproxy", "--cleanup"]).unwrap();
        assert_eq!(cli.mode(), Mode::Cleanup);
        let cli = Cli::try_parse_from(["nodeproxy"]).unwrap();
        assert_eq!(cli.mode(), Mode::Run);
    }

    #[test]
    fn masquerade_all_accepts_bare_and_explicit_values() {
        let cli = Cli::try_parse_from(["nodeproxy", "--masquerade-all"]).unwrap();
        assert_eq!(cli.masquerade_all.as_deref(), Some("true"));
        let cli = Cli::try_parse_from(["nodeproxy", "--masquerade-all=false"]).unwrap();
        assert_eq!(cli.masquerade_all.as_deref(), Some("false"));
        // Without `=`, the next word is not taken as the flag's value.
        let cli = Cli::try_parse_from(["nodeproxy", "--masquerade-all", "--once"]).unwrap();
        assert_eq!(cli.masquerade_all.as_deref(), Some("true"));
        assert_eq!(cli.mode(), Mode::Once);
    }

    #[test]
    fn cleanup_kube_proxy_accepts_bare_and_explicit_values() {
        let cli = Cli::try_parse_from(["nodeproxy", "--cleanup-kube-proxy", "--once"]).unwrap();
        assert_eq!(cli.cleanup_kube_proxy.as_deref(), Some("true"));
        assert_eq!(cli.mode(), Mode::Once);
        let cli = Cli::try_parse_from(["nodeproxy", "--cleanup-kube-proxy=false"]).unwrap();
        assert_eq!(cli.cleanup_kube_proxy.as_deref(), Some("false"));
    }

    #[test]
    fn help_names_every_flag_config_key_and_environment_variable() {
        let help = Cli::command().render_long_help().to_string();
        assert!(
            help.contains("NODEPROXY_CONFIG"),
            "help lacks NODEPROXY_CONFIG:\n{help}"
        );
        for field in Field::ALL {
            for name in [field.flag(), field.key(), field.env_var()] {
                assert!(help.contains(name), "help lacks {name}:\n{help}");
            }
        }
    }
}
