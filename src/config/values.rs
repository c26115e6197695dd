//! Value parsers: each turns a raw value from a flag, the environment or a file into a typed
//! setting, or says what would be valid; and `ToToml`, how a typed value is written back.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;

use super::duration::{format_duration, parse_duration};
use super::{
    DEFAULT_HEALTHZ_BIND_ADDRESS, DEFAULT_LOCK_FILE, DEFAULT_METRICS_BIND_ADDRESS, DetectLocalMode,
    LogFormat, NodePortAddresses, Qps, TableOwnership,
};

/// A raw value before validation, in the shape its source gives it.
#[derive(Debug, Clone)]
pub enum Input {
    /// A flag or environment value.
    Text(String),
    /// Repeated `--from-file` flags, or the one path of a path-valued flag.
    Paths(Vec<PathBuf>),
    /// A config-file value.
    Toml(toml::Value),
}

impl Input {
    /// The value as the operator wrote it, for error messages.
    pub fn shown(&self) -> String {
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

pub fn boolean(input: &Input) -> Result<bool, String> {
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

pub fn masquerade_bit(input: &Input) -> Result<u8, String> {
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

pub fn paths(input: &Input) -> Result<Vec<PathBuf>, String> {
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
pub fn duration(input: &Input) -> Result<Duration, String> {
    let text = match input {
        Input::Toml(toml::Value::Integer(value)) => value.to_string(),
        _ => scalar_text(input, "a duration string such as \"30s\"")?,
    };
    parse_duration(&text)
}

/// An integer within `range`, from text or a TOML integer.
fn integer(input: &Input, range: std::ops::RangeInclusive<i64>, what: &str) -> Result<i64, String> {
    let expected = || format!("must be {what} from {} to {}", range.start(), range.end());
    let value = match input {
        Input::Text(text) => text.trim().parse().ok(),
        Input::Toml(toml::Value::Integer(value)) => Some(*value),
        Input::Toml(other) => {
            return Err(format!("{}; found a {}", expected(), toml_type(other)));
        }
        Input::Paths(_) => None,
    };
    value.filter(|v| range.contains(v)).ok_or_else(expected)
}

/// A count (kube-proxy's int32 flags: at most 2^31 - 1).
pub fn count(input: &Input) -> Result<u32, String> {
    let value = integer(input, 0..=i64::from(i32::MAX), "an integer")?;
    u32::try_from(value).map_err(|e| e.to_string())
}

pub fn qps(input: &Input) -> Result<Qps, String> {
    const EXPECTED: &str = "must be a positive number of requests per second, e.g. 5 or 0.5";
    let value = match input {
        Input::Text(text) => text.trim().parse::<f64>().ok(),
        Input::Toml(toml::Value::Float(value)) => Some(*value),
        Input::Toml(toml::Value::Integer(value)) => Some(*value as f64),
        Input::Toml(other) => return Err(format!("{EXPECTED}; found a {}", toml_type(other))),
        Input::Paths(_) => None,
    };
    value
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(Qps)
        .ok_or_else(|| EXPECTED.to_string())
}

pub fn burst(input: &Input) -> Result<u32, String> {
    let value = integer(input, 1..=i64::from(i32::MAX), "a number of requests")?;
    u32::try_from(value).map_err(|e| e.to_string())
}

pub fn oom_score_adj(input: &Input) -> Result<i32, String> {
    let value = integer(input, -1000..=1000, "an oom_score_adj")?;
    i32::try_from(value).map_err(|e| e.to_string())
}

pub fn hostname(input: &Input) -> Result<Option<String>, String> {
    let name = super::normalize_hostname(&scalar_text(input, "a string")?);
    if !name.is_empty() {
        check_dns_subdomain(&name)?;
    }
    Ok((!name.is_empty()).then_some(name))
}

/// A path where empty means unset.
pub fn optional_path(input: &Input) -> Result<Option<PathBuf>, String> {
    let path = parse_path(input)?;
    Ok((!path.as_os_str().is_empty()).then_some(path))
}

pub fn api_url(input: &Input) -> Result<Option<String>, String> {
    let url = scalar_text(input, "a string")?;
    let url = url.trim();
    if !url.is_empty() {
        check_http_url(url)?;
    }
    Ok((!url.is_empty()).then(|| url.to_string()))
}

pub fn pod_cidrs(input: &Input) -> Result<Vec<IpNet>, String> {
    parse_cidrs(&list(input)?, &POD_NETWORK)
}

pub fn service_cidrs(input: &Input) -> Result<Vec<IpNet>, String> {
    parse_cidrs(&list(input)?, &SERVICE_NETWORK)
}

pub fn detect_local_mode(input: &Input) -> Result<DetectLocalMode, String> {
    let text = scalar_text(input, "a string")?;
    DetectLocalMode::parse(&text).ok_or_else(|| {
        format!(
            "must be one of {} (case-insensitive)",
            DetectLocalMode::ALL.map(DetectLocalMode::as_str).join(", ")
        )
    })
}

/// An interface name (or, with `prefix`, a name prefix); empty means unset.
fn interface(input: &Input, prefix: bool) -> Result<Option<String>, String> {
    let name = scalar_text(input, "a string")?;
    let name = name.trim();
    if !name.is_empty() {
        check_interface_name(name, prefix)?;
    }
    Ok((!name.is_empty()).then(|| name.to_string()))
}

pub fn bridge_interface(input: &Input) -> Result<Option<String>, String> {
    interface(input, false)
}

pub fn interface_prefix(input: &Input) -> Result<Option<String>, String> {
    interface(input, true)
}

pub fn nodeport_addresses(input: &Input) -> Result<NodePortAddresses, String> {
    parse_nodeport_addresses(&list(input)?)
}

pub fn healthz_address(input: &Input) -> Result<Option<SocketAddr>, String> {
    parse_bind_address(input, DEFAULT_HEALTHZ_BIND_ADDRESS)
}

pub fn metrics_address(input: &Input) -> Result<Option<SocketAddr>, String> {
    parse_bind_address(input, DEFAULT_METRICS_BIND_ADDRESS)
}

/// A duration that must be longer than 0.
pub fn positive_period(input: &Input) -> Result<Duration, String> {
    let period = duration(input)?;
    if period.is_zero() {
        return Err(
            "must be longer than 0 (the longest time between two syncs), e.g. 30s".to_string(),
        );
    }
    Ok(period)
}

pub fn lock_file(input: &Input) -> Result<PathBuf, String> {
    let path = parse_path(input)?;
    if path.as_os_str().is_empty() {
        return Err(format!("must be a file path, e.g. {DEFAULT_LOCK_FILE}"));
    }
    Ok(path)
}

pub fn log_format(input: &Input) -> Result<LogFormat, String> {
    match scalar_text(input, "a string")?.as_str() {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        _ => Err("must be `text` or `json`".to_string()),
    }
}

pub fn table_ownership(input: &Input) -> Result<TableOwnership, String> {
    match scalar_text(input, "a string")?.as_str() {
        "auto" => Ok(TableOwnership::Auto),
        "off" => Ok(TableOwnership::Off),
        _ => Err("must be `auto` or `off`".to_string()),
    }
}

/// A setting's value in TOML, as `--print-config` writes it and the file parsers read it back.
/// TOML has no null: an unset optional value is the empty string, which reads back as unset.
pub trait ToToml {
    fn to_toml(&self) -> toml::Value;
}

fn text(value: impl Into<String>) -> toml::Value {
    toml::Value::String(value.into())
}

impl<T: ToToml> ToToml for Option<T> {
    fn to_toml(&self) -> toml::Value {
        self.as_ref().map_or_else(|| text(""), ToToml::to_toml)
    }
}

impl<T: ToToml> ToToml for Vec<T> {
    fn to_toml(&self) -> toml::Value {
        toml::Value::Array(self.iter().map(ToToml::to_toml).collect())
    }
}

/// `ToToml` for types whose TOML form is given by an expression over `v`.
macro_rules! to_toml {
    ($($ty:ty => |$v:ident| $value:expr;)+) => {$(
        impl ToToml for $ty {
            fn to_toml(&self) -> toml::Value {
                let $v = self;
                $value
            }
        }
    )+};
}

to_toml! {
    String => |v| text(v.as_str());
    PathBuf => |v| text(v.to_string_lossy());
    bool => |v| toml::Value::Boolean(*v);
    u8 => |v| toml::Value::Integer(i64::from(*v));
    u32 => |v| toml::Value::Integer(i64::from(*v));
    i32 => |v| toml::Value::Integer(i64::from(*v));
    Duration => |v| text(format_duration(*v));
    Qps => |v| toml::Value::Float(v.0);
    IpNet => |v| text(v.to_string());
    SocketAddr => |v| text(v.to_string());
    DetectLocalMode => |v| text(v.as_str());
    NodePortAddresses => |v| text(render_nodeport_addresses(v));
    LogFormat => |v| text(match v { LogFormat::Text => "text", LogFormat::Json => "json" });
    TableOwnership => |v| text(match v { TableOwnership::Auto => "auto", TableOwnership::Off => "off" });
}

/// A value as an error message shows it: whole up to 120 characters, else its start and its
/// length, so that a mistaken multi-megabyte value does not flood the terminal or the journal.
pub(super) fn shorten(value: &str) -> String {
    const KEEP: usize = 100;
    if value.chars().count() <= 120 {
        return value.to_string();
    }
    let start: String = value.chars().take(KEEP).collect();
    format!("{start}… ({} bytes in all)", value.len())
}

/// Keeps a path or value on one line in comments and messages; a newline in a `--print-config`
/// comment would end the comment and break the TOML.
pub(super) fn single_line(text: &str) -> String {
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
