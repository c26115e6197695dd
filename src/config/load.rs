//! Loading: the command line, the environment and the config file merged by one precedence
//! rule (flag > environment > file > default), with the source of every value kept.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use clap::FromArgMatches as _;

use super::duration::format_duration;
use super::kube_proxy;
use super::settings::{self, ArgKind, Field};
use super::values::{Input, single_line};
use super::{
    CONFIG_ENV_VAR, Config, ConfigError, DEFAULT_MAX_INPUT_BYTES, DetectLocalMode, Loaded, Mode,
};
use crate::cli::{Cli, Command, ExplainArgs};
use crate::explain;
use crate::model::IpFamily;

/// `NODEPROXY_*` variables that are not settings but are read (or set for the unit's command
/// line) all the same.
const OTHER_ENV_VARS: [&str; 5] = [
    CONFIG_ENV_VAR,
    // The log filter (tracing's EnvFilter syntax).
    "NODEPROXY_LOG",
    // The packaged unit expands it into extra command-line flags.
    "NODEPROXY_EXTRA_ARGS",
    crate::notify::HANG_WRITER_ENV,
    crate::nft::fault::REJECT_PORT_ENV,
];

/// One warning for each `NODEPROXY_*` variable in `names` that nodeproxy does not read: a
/// misspelt `NODEPROXY_CLUSTER_CIRD` would otherwise be silently ignored. Names the closest
/// valid variable when one is near.
pub fn unknown_env_vars(names: impl IntoIterator<Item = String>) -> Vec<String> {
    let known: Vec<String> = Field::ALL
        .iter()
        .map(|f| f.env_var())
        .chain(OTHER_ENV_VARS.map(str::to_string))
        .collect();
    names
        .into_iter()
        .filter(|name| name.starts_with("NODEPROXY_") && !known.contains(name))
        .map(|name| {
            let closest = known
                .iter()
                .map(|k| (edit_distance(&name, k), k))
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
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
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
    /// A command-line flag under kube-proxy's other name for it (`--iptables-sync-period`).
    KubeProxyFlag(&'static str),
    /// An environment variable, by name.
    Env(String),
    /// The config file at this path.
    File(PathBuf),
    /// A field of a kube-proxy configuration file.
    KubeProxyFile { path: PathBuf, field: &'static str },
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
            Source::KubeProxyFlag(alias) => {
                format!("flag --{alias} (kube-proxy's name for {flag})")
            }
            Source::Env(var) => format!("env {var}"),
            Source::File(path) => format!("file {}", single_line(&path.to_string_lossy())),
            Source::KubeProxyFile { path, field } => format!(
                "kube-proxy config {}: {field}",
                single_line(&path.to_string_lossy())
            ),
            Source::Default => "default".to_string(),
        }
    }
}

/// The source of every effective value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance {
    /// The config file that was read, and what named it (`--config` or `NODEPROXY_CONFIG`).
    pub config_file: Option<(PathBuf, Source)>,
    /// Every field not given by any source is absent: its source is the default.
    given: BTreeMap<Field, Source>,
}

impl Provenance {
    /// The source of one field.
    pub fn of(&self, field: Field) -> &Source {
        const DEFAULT: &Source = &Source::Default;
        self.given.get(&field).unwrap_or(DEFAULT)
    }
}

/// The most a config file may hold: real ones are a few kilobytes, and `--config /dev/zero`
/// must end in an error, not in memory exhaustion.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

pub(super) fn read_config_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)?;
    if u64::try_from(text.len()).unwrap_or(u64::MAX) > MAX_CONFIG_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {} MiB; a configuration file is a few kilobytes",
            MAX_CONFIG_BYTES >> 20
        )));
    }
    Ok(text)
}

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

pub(super) fn valid_keys() -> String {
    Field::ALL
        .iter()
        .map(|field| field.key())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Names the unknown keys, with a hint when one is a known key spelled as a flag
/// (`hostname-override`) or as in kube-proxy's YAML (`hostnameOverride`).
pub(super) fn describe_unknown_keys(keys: &[String]) -> String {
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
    load_with(args, env, &read_config_file)
}

/// `load` with the file system injected, so tests never touch disk.
pub(super) fn load_with(
    args: impl IntoIterator<Item = OsString>,
    env: &dyn Fn(&str) -> Option<String>,
    read_file: &dyn Fn(&Path) -> std::io::Result<String>,
) -> Result<Loaded, ConfigError> {
    let args = kube_proxy_verbosity(args.into_iter().collect());
    let matches = super::command()
        .try_get_matches_from(&args)
        .map_err(clap_error)?;
    let cli = Cli::from_arg_matches(&matches).map_err(clap_error)?;
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
    for &field in Field::ALL {
        let flag = flag_input(&matches, field);
        let Some((input, mut source)) = choose(field, flag, &env, file.as_ref()) else {
            continue;
        };
        if source == Source::Flag
            && let Some(alias) = used_alias(&args, field)
        {
            source = Source::KubeProxyFlag(alias);
        }
        settings::apply(&mut config, field, &input).map_err(|expected| ConfigError::Invalid {
            key: field.key(),
            value: input.shown(),
            origin: source.describe(&field.flag()),
            expected,
        })?;
        provenance.given.insert(field, source);
    }
    // The detect-local-mode default depends on the merged cluster CIDR, so it is resolved
    // only now; its source stays `default`.
    if *provenance.of(Field::DetectLocalMode) == Source::Default {
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
    let mut warnings = kube_proxy::inert_flag_warnings(&matches);
    let mut verbosity = cli.verbosity();
    if let Some((_, ConfigFile::KubeProxy(kube))) = &file {
        warnings.extend(kube.warnings.iter().cloned());
        // `logging.verbosity` counts only when no -v or --v was given: flags beat the file.
        if cli.verbose == 0 && cli.v.is_none() {
            verbosity = kube.verbosity.unwrap_or(0);
        }
    }
    Ok(Loaded {
        mode: resolve_mode(&cli)?,
        config,
        provenance,
        verbosity,
        warnings,
        allow_empty: cli.allow_empty,
        max_input_bytes,
    })
}

/// The mode flag's mode, `diff`, or `explain` with its arguments validated. Subcommands
/// cannot be put in the mode flags' group by clap, so the exclusion is checked here.
fn resolve_mode(cli: &Cli) -> Result<Mode, ConfigError> {
    let Some(command) = &cli.command else {
        return Ok(cli.mode());
    };
    let name = match command {
        Command::Explain(_) => "explain",
        Command::Diff => "diff",
    };
    if cli.mode() != Mode::Run {
        return Err(ConfigError::Usage(format!(
            "error: `{name}` cannot be combined with --dry-run, --once, --cleanup or \
             --print-config\n"
        )));
    }
    match command {
        Command::Diff => Ok(Mode::Diff),
        Command::Explain(args) => explain_query(args).map(Mode::Explain),
    }
}

/// `explain`'s arguments, checked.
fn explain_query(args: &ExplainArgs) -> Result<explain::Query, ConfigError> {
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
    Ok(explain::Query {
        src,
        dst,
        dport,
        proto,
        from,
    })
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
fn parse_file(path: &Path, text: &str) -> Result<ConfigFile, ConfigError> {
    if let Some(kube_proxy) = kube_proxy::parse(path, text) {
        return kube_proxy.map(ConfigFile::KubeProxy);
    }
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
    Ok(ConfigFile::Toml(table))
}

/// A config file, in either format.
enum ConfigFile {
    Toml(toml::Table),
    KubeProxy(kube_proxy::KubeProxyFile),
}

/// A setting's flag value, in the shape its `ArgKind` gives it.
fn flag_input(matches: &clap::ArgMatches, field: Field) -> Option<Input> {
    let id = field.key();
    match field.spec().arg {
        ArgKind::Text | ArgKind::Bool | ArgKind::Signed => {
            matches.get_one::<String>(id).cloned().map(Input::Text)
        }
        ArgKind::Path => matches
            .get_one::<OsString>(id)
            .map(|path| Input::Paths(vec![PathBuf::from(path)])),
        ArgKind::Paths => matches
            .get_many::<PathBuf>(id)
            .map(|paths| Input::Paths(paths.cloned().collect())),
    }
}

/// kube-proxy's `-v` takes a level (`-v=2`, `-v 2`); nodeproxy's counts (`-vv`). A level is
/// passed on as `--v`, which means the same in both, so kube-proxy's arguments run unchanged.
fn kube_proxy_verbosity(args: Vec<OsString>) -> Vec<OsString> {
    let level = |a: &OsString| {
        a.to_str()
            .is_some_and(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut out = Vec::with_capacity(args.len());
    let mut args = args.into_iter().peekable();
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some(text) if let Some(level) = text.strip_prefix("-v=") => {
                out.push(OsString::from(format!("--v={level}")));
            }
            Some("-v") if args.peek().is_some_and(level) => out.push(OsString::from("--v")),
            _ => out.push(arg),
        }
    }
    out
}

/// The kube-proxy alias `args` gave `field` by, if it was given so: clap does not say which of
/// a flag's names was used, and `--print-config` should name the one the operator wrote.
fn used_alias(args: &[OsString], field: Field) -> Option<&'static str> {
    field.spec().kube_flags.iter().copied().find(|alias| {
        let long = format!("--{alias}");
        args.iter().filter_map(|a| a.to_str()).any(|a| {
            a == long
                || a.strip_prefix(long.as_str())
                    .is_some_and(|rest| rest.starts_with('='))
        })
    })
}

/// The precedence rule, in one place: flag, else environment, else file; `None` keeps the
/// default.
fn choose(
    field: Field,
    flag: Option<Input>,
    env: &dyn Fn(&str) -> Option<String>,
    file: Option<&(PathBuf, ConfigFile)>,
) -> Option<(Input, Source)> {
    if let Some(input) = flag {
        return Some((input, Source::Flag));
    }
    let var = field.env_var();
    if let Some(value) = env(&var) {
        return Some((Input::Text(value), Source::Env(var)));
    }
    let (path, file) = file?;
    match file {
        ConfigFile::Toml(table) => {
            let value = table.get(field.key())?;
            Some((Input::Toml(value.clone()), Source::File(path.clone())))
        }
        ConfigFile::KubeProxy(kube) => {
            let (value, field) = kube.values.get(&field)?;
            let source = Source::KubeProxyFile {
                path: path.clone(),
                field,
            };
            Some((Input::Toml(value.clone()), source))
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
        origin: provenance.of(field).describe(&field.flag()),
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
                    .describe(&Field::SyncPeriod.flag())
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
                    .describe(&Field::HealthzBindAddress.flag())
            ),
        ));
    }
    Ok(())
}
