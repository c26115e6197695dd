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
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use clap::Parser as _;
use ipnet::IpNet;

pub use crate::cli::Mode;
use crate::cli::{Cli, Command};
use crate::explain;
use crate::model::IpFamily;

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
    ClusterCidr,
    MasqueradeAll,
    MasqueradeBit,
    NodePortAddresses,
    FromFile,
    LogFormat,
}

impl Field {
    /// Every field, in `Config` order (also the `--print-config` order).
    pub const ALL: [Field; 7] = [
        Field::HostnameOverride,
        Field::ClusterCidr,
        Field::MasqueradeAll,
        Field::MasqueradeBit,
        Field::NodePortAddresses,
        Field::FromFile,
        Field::LogFormat,
    ];

    /// The config-file key (the flag name in snake_case).
    pub fn key(self) -> &'static str {
        match self {
            Field::HostnameOverride => "hostname_override",
            Field::ClusterCidr => "cluster_cidr",
            Field::MasqueradeAll => "masquerade_all",
            Field::MasqueradeBit => "masquerade_bit",
            Field::NodePortAddresses => "nodeport_addresses",
            Field::FromFile => "from_file",
            Field::LogFormat => "log_format",
        }
    }

    /// The command-line flag, as kube-proxy spells it.
    pub fn flag(self) -> &'static str {
        match self {
            Field::HostnameOverride => "--hostname-override",
            Field::ClusterCidr => "--cluster-cidr",
            Field::MasqueradeAll => "--masquerade-all",
            Field::MasqueradeBit => "--masquerade-bit",
            Field::NodePortAddresses => "--nodeport-addresses",
            Field::FromFile => "--from-file",
            Field::LogFormat => "--log-format",
        }
    }

    /// The environment variable: `NODEPROXY_` and the key in upper case.
    pub fn env_var(self) -> &'static str {
        match self {
            Field::HostnameOverride => "NODEPROXY_HOSTNAME_OVERRIDE",
            Field::ClusterCidr => "NODEPROXY_CLUSTER_CIDR",
            Field::MasqueradeAll => "NODEPROXY_MASQUERADE_ALL",
            Field::MasqueradeBit => "NODEPROXY_MASQUERADE_BIT",
            Field::NodePortAddresses => "NODEPROXY_NODEPORT_ADDRESSES",
            Field::FromFile => "NODEPROXY_FROM_FILE",
            Field::LogFormat => "NODEPROXY_LOG_FORMAT",
        }
    }
}

/// The environment variable naming the config file (the `--config` flag wins over it).
pub const CONFIG_ENV_VAR: &str = "NODEPROXY_CONFIG";

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
    pub cluster_cidr: Source,
    pub masquerade_all: Source,
    pub masquerade_bit: Source,
    pub nodeport_addresses: Source,
    pub from_file: Source,
    pub log_format: Source,
}

impl Default for Provenance {
    fn default() -> Provenance {
        Provenance {
            config_file: None,
            hostname_override: Source::Default,
            cluster_cidr: Source::Default,
            masquerade_all: Source::Default,
            masquerade_bit: Source::Default,
            nodeport_addresses: Source::Default,
            from_file: Source::Default,
            log_format: Source::Default,
        }
    }
}

impl Provenance {
    /// The source of one field.
    pub fn of(&self, field: Field) -> &Source {
        match field {
            Field::HostnameOverride => &self.hostname_override,
            Field::ClusterCidr => &self.cluster_cidr,
            Field::MasqueradeAll => &self.masquerade_all,
            Field::MasqueradeBit => &self.masquerade_bit,
            Field::NodePortAddresses => &self.nodeport_addresses,
            Field::FromFile => &self.from_file,
            Field::LogFormat => &self.log_format,
        }
    }

    fn of_mut(&mut self, field: Field) -> &mut Source {
        match field {
            Field::HostnameOverride => &mut self.hostname_override,
            Field::ClusterCidr => &mut self.cluster_cidr,
            Field::MasqueradeAll => &mut self.masquerade_all,
            Field::MasqueradeBit => &mut self.masquerade_bit,
            Field::NodePortAddresses => &mut self.nodeport_addresses,
            Field::FromFile => &mut self.from_file,
            Field::LogFormat => &mut self.log_format,
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
    #[error("invalid {key} `{value}` from {origin}: {expected}")]
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
    for c in key.trim_start_matches('-').chars() {
        match c {
            '-' => out.push('_'),
            c if c.is_ascii_uppercase() => {
                out.push('_');
                out.push(c.to_ascii_lowercase());
            }
            c => out.push(c),
        }
    }
    // kube-proxy's YAML spells it `nodePortAddresses`, our key has no underscore after "node".
    out.replace("node_port", "nodeport")
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

    Ok(Loaded {
        mode: resolve_mode(&cli)?,
        config,
        provenance,
        verbosity: cli.verbosity(),
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
    /// Repeated `--from-file` flags.
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
    match field {
        Field::HostnameOverride => text(&cli.hostname_override),
        Field::ClusterCidr => text(&cli.cluster_cidr),
        Field::MasqueradeAll => text(&cli.masquerade_all),
        Field::MasqueradeBit => text(&cli.masquerade_bit),
        Field::NodePortAddresses => text(&cli.nodeport_addresses),
        Field::FromFile => (!cli.from_file.is_empty()).then(|| Input::Paths(cli.from_file.clone())),
        Field::LogFormat => text(&cli.log_format),
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
        Field::ClusterCidr => {
            let items = list(input).map_err(invalid)?;
            config.cluster_cidr = parse_cluster_cidr(&items).map_err(invalid)?;
        }
        Field::MasqueradeAll => {
            config.masquerade_all = parse_bool(input).map_err(invalid)?;
        }
        Field::MasqueradeBit => {
            config.masquerade_bit = parse_masquerade_bit(input).map_err(invalid)?;
        }
        Field::NodePortAddresses => {
            let items = list(input).map_err(invalid)?;
            if items != ["primary"] {
                return Err(invalid(
                    "only `primary` is supported in this version (the Node's primary \
                     InternalIP of each family)"
                        .to_string(),
                ));
            }
            config.nodeport_addresses = NodePortAddresses::Primary;
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

fn parse_cluster_cidr(items: &[String]) -> Result<Vec<IpNet>, String> {
    let mut cidrs: Vec<IpNet> = Vec::new();
    for item in items {
        let cidr: IpNet = match item.parse() {
            Ok(cidr) => cidr,
            Err(_) if item.parse::<IpAddr>().is_ok() => {
                return Err(format!(
                    "`{item}` is an address, not a CIDR; write the pod network with its prefix \
                     length, e.g. 10.244.0.0/16"
                ));
            }
            Err(_) => {
                return Err(format!(
                    "`{item}` is not a CIDR; expected e.g. 10.244.0.0/16 or \
                     10.244.0.0/16,fd00:10:244::/56"
                ));
            }
        };
        // A CIDR with host bits set is usually a node or pod address pasted by mistake; say
        // so rather than silently widening it.
        if cidr != cidr.trunc() {
            return Err(format!(
                "`{item}` has host bits set; did you mean {}?",
                cidr.trunc()
            ));
        }
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

/// A field's effective value in TOML syntax, so `render_effective` output is a config file.
fn render_value(config: &Config, field: Field) -> String {
    let string = |text: &str| toml::Value::String(text.to_string()).to_string();
    let strings = |items: Vec<String>| {
        toml::Value::Array(items.into_iter().map(toml::Value::String).collect()).to_string()
    };
    match field {
        // TOML has no null; an empty string reads back as unset.
        Field::HostnameOverride => string(config.hostname_override.as_deref().unwrap_or("")),
        Field::ClusterCidr => strings(config.cluster_cidr.iter().map(IpNet::to_string).collect()),
        Field::MasqueradeAll => config.masquerade_all.to_string(),
        Field::MasqueradeBit => config.masquerade_bit.to_string(),
        Field::NodePortAddresses => match config.nodeport_addresses {
            NodePortAddresses::Primary => string("primary"),
        },
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
        // Only one value is valid, so for this field the sources are what tells them apart.
        Case {
            field: Field::NodePortAddresses,
            flag: &["--nodeport-addresses", "primary"],
            flag_value: "\"primary\"",
            env: "primary",
            env_value: "\"primary\"",
            file: "nodeport_addresses = \"primary\"",
            file_value: "\"primary\"",
            default_value: "\"primary\"",
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
    fn nodeport_addresses_other_than_primary_are_rejected() {
        let message = err(&["--nodeport-addresses", "10.0.0.0/8"], &[], None);
        assert!(
            message.contains("only `primary` is supported in this version"),
            "{message}"
        );
        assert!(message.contains("10.0.0.0/8"), "{message}");
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
}
