//! kube-proxy compatibility: its flags that are not nodeproxy settings (accepted, each with one
//! warning saying why it has no effect), and its `KubeProxyConfiguration` file (v1alpha1, YAML
//! or JSON), mapped field by field onto the settings that mean the same.
//!
//! The field list follows upstream's `staging/src/k8s.io/kube-proxy/config/v1alpha1/types.go`;
//! a field not in it is an error, as kube-proxy decodes strictly.

use std::collections::BTreeMap;
use std::path::Path;

use clap::{Arg, ArgAction};

use super::ConfigError;
use super::settings::Field;
use super::values::single_line;

/// A kube-proxy flag nodeproxy accepts without acting on it.
pub struct Inert {
    pub flag: &'static str,
    /// Whether it is a boolean flag (`--flag` or `--flag=false`), as opposed to one that takes
    /// a value.
    pub boolean: bool,
    /// Why it has no effect in nodeproxy, and what to do instead.
    pub why: &'static str,
}

const NO_IPVS: &str = "nodeproxy has no IPVS mode; it always programs nftables";
const UNBUFFERED: &str = "nodeproxy writes log lines unbuffered to stderr";

/// kube-proxy's flags (its `--help` as of 1.34) that are not nodeproxy settings or mode flags,
/// in alphabetical order. The others are settings (`config/settings.rs`, with their kube-proxy
/// spellings as aliases) or nodeproxy's own flags of the same name (`--cleanup`, `--config`,
/// `-v`/`--v`, `--help`, `--version`).
pub const INERT_FLAGS: &[Inert] = &[
    Inert {
        flag: "bind-address",
        boolean: false,
        why: "nodeproxy takes the node's primary addresses from its Node object",
    },
    Inert {
        flag: "config-sync-period",
        boolean: false,
        why: "nodeproxy's watches do not re-list on a timer; they resume after an error, and \
              the kernel is verified every --sync-period",
    },
    Inert {
        flag: "feature-gates",
        boolean: false,
        why: "nodeproxy implements the behaviour of the current release's default gates",
    },
    Inert {
        flag: "healthz-port",
        boolean: false,
        why: "deprecated in kube-proxy; use --healthz-bind-address",
    },
    Inert {
        flag: "iptables-localhost-nodeports",
        boolean: true,
        why: "NodePorts on loopback addresses are not supported (as in kube-proxy's nftables \
              mode)",
    },
    Inert {
        flag: "ipvs-exclude-cidrs",
        boolean: false,
        why: NO_IPVS,
    },
    Inert {
        flag: "ipvs-min-sync-period",
        boolean: false,
        why: NO_IPVS,
    },
    Inert {
        flag: "ipvs-scheduler",
        boolean: false,
        why: NO_IPVS,
    },
    Inert {
        flag: "ipvs-strict-arp",
        boolean: true,
        why: NO_IPVS,
    },
    Inert {
        flag: "ipvs-sync-period",
        boolean: false,
        why: NO_IPVS,
    },
    Inert {
        flag: "ipvs-tcp-timeout",
        boolean: false,
        why: NO_IPVS,
    },
    Inert {
        flag: "ipvs-tcpfin-timeout",
        boolean: false,
        why: NO_IPVS,
    },
    Inert {
        flag: "ipvs-udp-timeout",
        boolean: false,
        why: NO_IPVS,
    },
    Inert {
        flag: "kube-api-content-type",
        boolean: false,
        why: "nodeproxy talks JSON to the API server",
    },
    Inert {
        flag: "log-flush-frequency",
        boolean: false,
        why: UNBUFFERED,
    },
    Inert {
        flag: "log-json-info-buffer-size",
        boolean: false,
        why: UNBUFFERED,
    },
    Inert {
        flag: "log-json-split-stream",
        boolean: true,
        why: UNBUFFERED,
    },
    Inert {
        flag: "log-text-info-buffer-size",
        boolean: false,
        why: UNBUFFERED,
    },
    Inert {
        flag: "log-text-split-stream",
        boolean: true,
        why: UNBUFFERED,
    },
    Inert {
        flag: "metrics-port",
        boolean: false,
        why: "deprecated in kube-proxy; use --metrics-bind-address",
    },
    Inert {
        flag: "profiling",
        boolean: true,
        why: "nodeproxy serves no pprof endpoint",
    },
    Inert {
        flag: "proxy-mode",
        boolean: false,
        why: "nodeproxy always programs nftables (kube-proxy's nftables mode)",
    },
    Inert {
        flag: "proxy-port-range",
        boolean: false,
        why: "unused since the userspace proxy was removed (in kube-proxy too)",
    },
    Inert {
        flag: "show-hidden-metrics-for-version",
        boolean: false,
        why: "nodeproxy hides no metrics",
    },
    Inert {
        flag: "vmodule",
        boolean: false,
        why: "per-module log levels are set with NODEPROXY_LOG (a tracing filter, e.g. \
              nodeproxy::sync=debug)",
    },
    Inert {
        flag: "windows-service",
        boolean: true,
        why: "Windows only",
    },
];

/// Every flag of kube-proxy's `--help` (1.34, Linux, without the generic `-h`), for the
/// migration table and the test that nodeproxy accepts each.
pub const KUBE_PROXY_FLAGS: &[&str] = &[
    "bind-address",
    "bind-address-hard-fail",
    "cleanup",
    "cluster-cidr",
    "config",
    "config-sync-period",
    "conntrack-max-per-core",
    "conntrack-min",
    "conntrack-tcp-be-liberal",
    "conntrack-tcp-timeout-close-wait",
    "conntrack-tcp-timeout-established",
    "conntrack-udp-timeout",
    "conntrack-udp-timeout-stream",
    "detect-local-mode",
    "feature-gates",
    "healthz-bind-address",
    "hostname-override",
    "init-only",
    "iptables-localhost-nodeports",
    "iptables-masquerade-bit",
    "iptables-min-sync-period",
    "iptables-sync-period",
    "ipvs-exclude-cidrs",
    "ipvs-min-sync-period",
    "ipvs-scheduler",
    "ipvs-strict-arp",
    "ipvs-sync-period",
    "ipvs-tcp-timeout",
    "ipvs-tcpfin-timeout",
    "ipvs-udp-timeout",
    "kube-api-burst",
    "kube-api-content-type",
    "kube-api-qps",
    "kubeconfig",
    "log-flush-frequency",
    "log-json-info-buffer-size",
    "log-json-split-stream",
    "log-text-info-buffer-size",
    "log-text-split-stream",
    "logging-format",
    "masquerade-all",
    "master",
    "metrics-bind-address",
    "nodeport-addresses",
    "oom-score-adj",
    "pod-bridge-interface",
    "pod-interface-name-prefix",
    "profiling",
    "proxy-mode",
    "proxy-port-range",
    "show-hidden-metrics-for-version",
    "v",
    "version",
    "vmodule",
    "write-config-to",
];

/// nodeproxy's own flags that kube-proxy has too, with what they do here.
const SHARED_MODE_FLAGS: &[(&str, &str)] = &[
    (
        "cleanup",
        "`--cleanup`: removes nodeproxy's tables (`--cleanup-kube-proxy` removes kube-proxy's)",
    ),
    (
        "config",
        "`--config`: nodeproxy's TOML or kube-proxy's `KubeProxyConfiguration`; flags and the environment still win",
    ),
    (
        "init-only",
        "`--init-only`: the conntrack sysctls, then exit (1 if one was refused)",
    ),
    ("v", "`--v` / `-v`; `NODEPROXY_LOG` takes a tracing filter"),
    ("version", "`--version` (version, commit, target)"),
    (
        "write-config-to",
        "`--write-config-to`: writes nodeproxy's effective TOML (what `--print-config` prints)",
    ),
];

/// What nodeproxy does with a kube-proxy flag, for the migration table.
fn flag_use(flag: &str) -> String {
    let long = format!("--{flag}");
    if let Some(field) = Field::ALL.iter().find(|f| f.flag() == long) {
        return format!("setting `{}`", field.key());
    }
    if let Some(field) = Field::ALL
        .iter()
        .find(|f| f.spec().kube_flags.contains(&flag))
    {
        return format!("same as `{}` (setting `{}`)", field.flag(), field.key());
    }
    if let Some((_, text)) = SHARED_MODE_FLAGS.iter().find(|(f, _)| *f == flag) {
        return (*text).to_string();
    }
    match INERT_FLAGS.iter().find(|i| i.flag == flag) {
        Some(inert) if flag == "proxy-mode" => {
            format!("`nftables` accepted; any other mode warns: {}", inert.why)
        }
        Some(inert) => format!("accepted, warns, no effect: {}", inert.why),
        None => "**not accepted**".to_string(),
    }
}

/// docs/migrating-from-kube-proxy.md's tables: every kube-proxy flag and every
/// `KubeProxyConfiguration` field, and what nodeproxy does with it (tests/docs.rs checks the
/// document holds exactly this).
pub fn migration_tables() -> String {
    let mut out = String::from("| kube-proxy flag | nodeproxy |\n|---|---|\n");
    for flag in KUBE_PROXY_FLAGS {
        out.push_str(&format!("| `--{flag}` | {} |\n", flag_use(flag)));
    }
    let mut fields: Vec<(&str, String)> = Field::ALL
        .iter()
        .filter_map(|f| {
            let kube = f.spec().kube_field?;
            Some((kube.path, format!("setting `{}`", f.key())))
        })
        .chain(INERT_FIELDS.iter().map(|(path, _, why)| {
            (
                *path,
                format!("accepted; warns unless kube-proxy's default: {why}"),
            )
        }))
        .chain([
            (
                "mode",
                "`\"\"` or `nftables`; any other mode warns: nodeproxy always programs nftables"
                    .to_string(),
            ),
            (
                "logging.verbosity",
                "`-v` level, unless `-v`/`--v` is given".to_string(),
            ),
        ])
        .collect();
    fields.sort();
    out.push_str("\n| `KubeProxyConfiguration` field | nodeproxy |\n|---|---|\n");
    for (path, meaning) in fields {
        out.push_str(&format!("| `{path}` | {meaning} |\n"));
    }
    out
}

/// The id of an inert flag's clap argument (distinct from every setting's key).
fn inert_id(flag: &str) -> String {
    format!("kube-proxy {flag}")
}

/// The inert flags as hidden, global clap arguments: `--help` stays about what nodeproxy does,
/// and docs/migrating-from-kube-proxy.md lists them.
pub fn inert_args() -> impl Iterator<Item = Arg> {
    INERT_FLAGS.iter().map(|inert| {
        let arg = Arg::new(inert_id(inert.flag))
            .long(inert.flag)
            .hide(true)
            .global(true)
            // The last value wins, as with pflag.
            .action(ArgAction::Set)
            .overrides_with(inert_id(inert.flag));
        if inert.boolean {
            arg.num_args(0..=1)
                .require_equals(true)
                .default_missing_value("true")
        } else {
            // `--oom-score-adj -999`: a negative number is a value, not a flag.
            arg.allow_hyphen_values(true)
        }
    })
}

/// One warning per inert flag given on the command line. `--proxy-mode nftables` (or empty)
/// asks for what nodeproxy does, so it is not warned about.
pub fn inert_flag_warnings(matches: &clap::ArgMatches) -> Vec<String> {
    INERT_FLAGS
        .iter()
        .filter_map(|inert| {
            let value = matches.get_one::<String>(&inert_id(inert.flag))?;
            if inert.flag == "proxy-mode" && matches!(value.trim(), "" | "nftables") {
                return None;
            }
            Some(format!(
                "kube-proxy flag --{}={} has no effect in nodeproxy: {}",
                inert.flag,
                single_line(value),
                inert.why
            ))
        })
        .collect()
}

/// What a `KubeProxyConfiguration` field means to nodeproxy.
enum Meaning {
    /// A setting (`Spec::kube_field`).
    Setting(Field),
    /// `logging.verbosity`: the `-v` level.
    Verbosity,
    /// `mode`: fine when empty or `nftables`, else warned about.
    Mode,
    /// Accepted; a value other than its zero value or kube-proxy's default (the first) is warned
    /// about, saying why (the second).
    Inert(&'static str, &'static str),
}

const IPTABLES_FIELD: &str = "an iptables-mode field; nodeproxy reads nftables.* (or the flag)";
const WINDOWS: &str = "Windows only";

/// The fields nodeproxy has no setting for: path, kube-proxy's default (as YAML; a file written
/// by `kube-proxy --write-config-to` spells every default out, and asking for kube-proxy's
/// default of an iptables or client setting asks for nothing nodeproxy would do differently),
/// and why nodeproxy does not act on it. `featureGates`, a map, is one field.
const INERT_FIELDS: &[(&str, &str, &str)] = &[
    (
        "featureGates",
        "{}",
        "nodeproxy implements the behaviour of the current release's default gates",
    ),
    (
        "clientConnection.acceptContentTypes",
        "",
        "nodeproxy talks JSON to the API server",
    ),
    (
        "clientConnection.contentType",
        "application/vnd.kubernetes.protobuf",
        "nodeproxy talks JSON to the API server",
    ),
    ("logging.flushFrequency", "5s", UNBUFFERED),
    (
        "logging.vmodule",
        "",
        "per-module log levels are set with NODEPROXY_LOG",
    ),
    ("logging.options.json.infoBufferSize", "0", UNBUFFERED),
    ("logging.options.json.splitStream", "false", UNBUFFERED),
    ("logging.options.text.infoBufferSize", "0", UNBUFFERED),
    ("logging.options.text.splitStream", "false", UNBUFFERED),
    (
        "bindAddress",
        "0.0.0.0",
        "nodeproxy takes the node's primary addresses from its Node object",
    ),
    (
        "enableProfiling",
        "false",
        "nodeproxy serves no pprof endpoint",
    ),
    (
        "showHiddenMetricsForVersion",
        "",
        "nodeproxy hides no metrics",
    ),
    ("iptables.masqueradeBit", "14", IPTABLES_FIELD),
    ("iptables.masqueradeAll", "false", IPTABLES_FIELD),
    ("iptables.localhostNodePorts", "true", IPTABLES_FIELD),
    ("iptables.snatNodeInternalIP", "false", IPTABLES_FIELD),
    ("iptables.syncPeriod", "30s", IPTABLES_FIELD),
    ("iptables.minSyncPeriod", "1s", IPTABLES_FIELD),
    ("ipvs.syncPeriod", "30s", NO_IPVS),
    ("ipvs.minSyncPeriod", "0s", NO_IPVS),
    ("ipvs.scheduler", "", NO_IPVS),
    ("ipvs.excludeCIDRs", "[]", NO_IPVS),
    ("ipvs.strictARP", "false", NO_IPVS),
    ("ipvs.tcpTimeout", "0s", NO_IPVS),
    ("ipvs.tcpFinTimeout", "0s", NO_IPVS),
    ("ipvs.udpTimeout", "0s", NO_IPVS),
    ("winkernel.networkName", "", WINDOWS),
    ("winkernel.sourceVip", "", WINDOWS),
    ("winkernel.enableDSR", "false", WINDOWS),
    ("winkernel.rootHnsEndpointName", "", WINDOWS),
    ("winkernel.forwardHealthCheckVip", "false", WINDOWS),
    ("windowsRunAsService", "false", WINDOWS),
    (
        "configSyncPeriod",
        "15m",
        "nodeproxy's watches do not re-list on a timer",
    ),
    (
        "portRange",
        "",
        "unused since the userspace proxy was removed (in kube-proxy too)",
    ),
];

/// Whether `value` asks for nothing: `null`, its type's zero value, or kube-proxy's `default`
/// (durations compared as durations: `15m0s` is `15m`).
fn is_default(value: &serde_yaml_ng::Value, default: &str) -> bool {
    if given(value, false).is_none() {
        return true;
    }
    let Ok(default) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(default) else {
        return false;
    };
    if *value == default {
        return true;
    }
    let duration = |v: &serde_yaml_ng::Value| {
        v.as_str()
            .and_then(|text| super::duration::parse_duration(text).ok())
    };
    matches!((duration(value), duration(&default)), (Some(a), Some(b)) if a == b)
}

/// The meaning of the field at `path`, or `None` for a field kube-proxy does not have.
fn meaning(path: &str) -> Option<(Meaning, bool)> {
    if let Some(field) = Field::ALL
        .iter()
        .find(|field| field.spec().kube_field.is_some_and(|k| k.path == path))
    {
        let pointer = field.spec().kube_field.is_some_and(|k| k.pointer);
        return Some((Meaning::Setting(*field), pointer));
    }
    match path {
        "logging.verbosity" => return Some((Meaning::Verbosity, false)),
        "mode" => return Some((Meaning::Mode, false)),
        _ => {}
    }
    INERT_FIELDS
        .iter()
        .find(|(field, _, _)| path == *field)
        .map(|(_, default, why)| (Meaning::Inert(default, why), false))
}

/// The group and version kube-proxy's configuration file declares.
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
const KIND: &str = "KubeProxyConfiguration";

/// A `KubeProxyConfiguration`, read: the values of settings by field, with the path each came
/// from, and what the file asks for that nodeproxy does not do.
#[derive(Debug, Default)]
pub struct KubeProxyFile {
    pub values: BTreeMap<Field, (toml::Value, &'static str)>,
    pub verbosity: Option<u8>,
    pub warnings: Vec<String>,
}

/// `Some` when `text` is a kube-proxy configuration (its `apiVersion` is kube-proxy's group or
/// its `kind` is `KubeProxyConfiguration`), `None` when it is something else (nodeproxy's TOML).
pub fn parse(path: &Path, text: &str) -> Option<Result<KubeProxyFile, ConfigError>> {
    let document: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).ok()?;
    let mapping = document.as_mapping()?;
    let api_version = mapping.get("apiVersion").and_then(|v| v.as_str());
    let kind = mapping.get("kind").and_then(|v| v.as_str());
    let ours = api_version.is_some_and(|v| v.starts_with("kubeproxy.config.k8s.io/"))
        || kind == Some(KIND);
    if !ours {
        return None;
    }
    let invalid = |message: String| ConfigError::ParseFile {
        path: path.to_path_buf(),
        message,
    };
    if api_version != Some(API_VERSION) || kind != Some(KIND) {
        return Some(Err(invalid(format!(
            "a kube-proxy configuration must have apiVersion: {API_VERSION} and kind: {KIND} \
             (found apiVersion: {}, kind: {})",
            single_line(api_version.unwrap_or("none")),
            single_line(kind.unwrap_or("none"))
        ))));
    }
    let mut file = KubeProxyFile::default();
    let mut unknown = Vec::new();
    walk(mapping, "", &mut file, &mut unknown);
    if !unknown.is_empty() {
        return Some(Err(ConfigError::UnknownKubeProxyField {
            path: path.to_path_buf(),
            fields: unknown,
        }));
    }
    Some(Ok(file))
}

/// How many unknown fields an error names.
const MAX_UNKNOWN_NAMED: usize = 10;

/// Visits every leaf of the mapping (`featureGates` is a leaf as a whole), sorting it into
/// settings, warnings and unknown fields.
fn walk(
    mapping: &serde_yaml_ng::Mapping,
    prefix: &str,
    file: &mut KubeProxyFile,
    unknown: &mut Vec<String>,
) {
    for (key, value) in mapping {
        let key = key
            .as_str()
            .map_or_else(|| format!("{key:?}"), str::to_string);
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        if prefix.is_empty() && (key == "apiVersion" || key == "kind") {
            continue;
        }
        match meaning(&path) {
            Some((Meaning::Setting(field), pointer)) => {
                if let Some(value) = given(value, pointer) {
                    let path = field.spec().kube_field.map_or("", |k| k.path);
                    file.values.insert(field, (value, path));
                }
            }
            Some((Meaning::Verbosity, _)) => {
                file.verbosity = value.as_u64().map(|v| u8::try_from(v).unwrap_or(u8::MAX));
            }
            Some((Meaning::Mode, _)) => {
                let mode = value.as_str().unwrap_or_default();
                if !matches!(mode, "" | "nftables") {
                    file.warnings.push(format!(
                        "kube-proxy config field mode: {} has no effect in nodeproxy: it always \
                         programs nftables (kube-proxy's nftables mode)",
                        single_line(mode)
                    ));
                }
            }
            Some((Meaning::Inert(default, why), _)) => {
                if !is_default(value, default) {
                    file.warnings.push(format!(
                        "kube-proxy config field {path} has no effect in nodeproxy: {why}"
                    ));
                }
            }
            None => match value.as_mapping() {
                // A section (`nftables`, `clientConnection`): its fields decide.
                Some(inner) if is_section(&path) => walk(inner, &path, file, unknown),
                // The error names a few; a file of garbage must not make a megabyte message.
                _ if unknown.len() < MAX_UNKNOWN_NAMED => unknown.push(single_line(&path)),
                _ => {}
            },
        }
    }
}

/// Whether some known field lies under `path`.
fn is_section(path: &str) -> bool {
    let prefix = format!("{path}.");
    Field::ALL.iter().any(|f| {
        f.spec()
            .kube_field
            .is_some_and(|k| k.path.starts_with(&prefix))
    }) || INERT_FIELDS.iter().any(|(f, _, _)| f.starts_with(&prefix))
        || "logging.verbosity".starts_with(&prefix)
}

/// The value as a setting input, or `None` when kube-proxy would default it: `null` always,
/// and a zero value (`""`, `0`, `false`, `0s`, `[]`, `{}`) unless the field is a pointer.
/// Upstream: `pkg/proxy/apis/config/v1alpha1/defaults.go`.
fn given(value: &serde_yaml_ng::Value, pointer: bool) -> Option<toml::Value> {
    use serde_yaml_ng::Value as Y;
    let zero = match value {
        Y::Null => return None,
        Y::Bool(b) => !b,
        Y::Number(n) => n.as_f64() == Some(0.0),
        Y::String(s) => s.is_empty() || s == "0s" || s == "0",
        Y::Sequence(items) => items.is_empty(),
        Y::Mapping(map) => map.is_empty(),
        Y::Tagged(_) => false,
    };
    if zero && !pointer {
        return None;
    }
    Some(to_toml(value))
}

fn to_toml(value: &serde_yaml_ng::Value) -> toml::Value {
    use serde_yaml_ng::Value as Y;
    match value {
        Y::Bool(b) => toml::Value::Boolean(*b),
        Y::Number(n) => match n.as_i64() {
            Some(i) => toml::Value::Integer(i),
            None => toml::Value::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Y::String(s) => toml::Value::String(s.clone()),
        Y::Sequence(items) => toml::Value::Array(items.iter().map(to_toml).collect()),
        // Mappings, tags and null are no setting's shape; the parser's error names the type.
        Y::Mapping(_) => toml::Value::Table(toml::Table::new()),
        Y::Null | Y::Tagged(_) => toml::Value::String(format!("{value:?}")),
    }
}

#[cfg(test)]
mod tests;
