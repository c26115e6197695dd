//! Command-line definition (clap): the mode flags, the subcommands and the flags that are not
//! settings. `config::command` adds one flag per setting from the settings' declarations.
//!
//! Values are taken as plain strings here and validated in `config`, so a bad value reads the
//! same whether it came from a flag, the environment or the config file (each error names the
//! field, the value and where it came from). The `NODEPROXY_*` environment is deliberately NOT
//! wired through clap's `env` attribute: clap would read the real process environment, and
//! `config::load` takes the environment as a closure so tests stay hermetic.

use std::path::PathBuf;

use clap::{ArgAction, ArgGroup, Args, Parser, Subcommand};

use crate::explain::Query;

/// What the process should do, chosen by at most one mode flag or a subcommand.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// `--write-config-to FILE`: write what `--print-config` prints to FILE, then exit.
    WriteConfig(PathBuf),
    /// `--init-only`: the privileged node set-up (conntrack sysctls), then exit.
    InitOnly,
    /// `explain SRC DST:PORT/PROTO`: print the path of one packet through the `--dry-run`
    /// ruleset.
    Explain(Query),
    /// `diff`: print what a sync of the input would change in the kernel's tables, per
    /// Service, without changing anything.
    Diff,
}

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

    /// Write what --print-config prints (nodeproxy's TOML, which --config reads) to FILE, then
    /// exit.
    #[arg(long, value_name = "FILE", group = "mode")]
    pub write_config_to: Option<PathBuf>,

    /// Do the privileged node set-up (the conntrack sysctls) and exit, for a privileged init
    /// container in front of a main container with only NET_ADMIN. Exits 1 when a setting
    /// could not be applied.
    #[arg(long, group = "mode")]
    pub init_only: bool,

    /// Read settings from this TOML file; flags and NODEPROXY_* variables override it.
    /// [env: NODEPROXY_CONFIG]
    #[arg(long, value_name = "FILE", global = true)]
    pub config: Option<PathBuf>,

    /// With --once, --dry-run, explain or diff: accept an input that holds no Service at all.
    /// Without it such an input (an empty file, a failed `kubectl get > file`, `---`, `null`)
    /// is an error, since programming it would remove every Service rule on the node.
    #[arg(long, global = true)]
    pub allow_empty: bool,

    /// The most bytes read from each --from-file file: a number of bytes, or one with a
    /// suffix Ki, Mi or Gi (powers of 1024). A larger file is an error. [default: 1Gi]
    #[arg(long, value_name = "SIZE", global = true)]
    pub max_input_size: Option<String>,

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
    /// Show what a sync of the input would change in nodeproxy's tables, per Service:
    /// elements, chains, sets and maps added (+), removed (-) or changed (~). Reads the
    /// kernel's tables, changes nothing, takes no lock. Exit status: 0 no change, 1 changes,
    /// 2 error.
    Diff,
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
    /// The mode chosen by the (mutually exclusive, enforced by clap) mode flags. The
    /// subcommands are resolved by `config::load`, which validates `explain`'s arguments.
    pub fn mode(&self) -> Mode {
        if self.dry_run {
            Mode::DryRun
        } else if self.once {
            Mode::Once
        } else if self.cleanup {
            Mode::Cleanup
        } else if self.print_config {
            Mode::PrintConfig
        } else if let Some(path) = &self.write_config_to {
            Mode::WriteConfig(path.clone())
        } else if self.init_only {
            Mode::InitOnly
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
}
