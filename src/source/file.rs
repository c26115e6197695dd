//! `--from-file`: reads Services, EndpointSlices and Nodes from YAML or JSON files as
//! `kubectl get services,endpointslices,nodes -A -o yaml` (or `-o json`) prints them.
//!
//! A file is a `List` with `items`, several YAML documents (each of which may be a `List`), a
//! stream of JSON values, or a single object. Reading happens in two steps so that one bad object
//! never hides the others: first every file is parsed into generic values (a syntax error is
//! fatal, since nothing after it can be trusted), then each object is checked on its own and
//! either used, ignored with a reason, or rejected with the field that is wrong.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::{Loaded, SourceError};
use crate::model::{Rejected, convert};

/// Reads every file in order and merges what they hold. When the same object (kind, namespace
/// and name) appears more than once, the last definition wins and the earlier ones are noted in
/// `ignored`.
pub fn load_files(paths: &[PathBuf]) -> Result<Loaded, SourceError> {
    let mut items = Vec::new();
    for path in paths {
        let text = std::fs::read_to_string(path).map_err(|source| SourceError::Read {
            path: path.clone(),
            source,
        })?;
        let mut ordinal = 0;
        for doc in parse(path, &text)? {
            flatten(doc, &mut |value| {
                ordinal += 1;
                items.push((Origin { path, ordinal }, value));
            });
        }
    }
    Ok(assemble(items))
}

/// Where an object was read: its file and its 1-based position among the file's objects.
#[derive(Clone, Copy)]
struct Origin<'a> {
    path: &'a Path,
    ordinal: usize,
}

impl fmt::Display for Origin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, item {}", self.path.display(), self.ordinal)
    }
}

/// Parses a whole file into its top-level documents. `.json` files go through serde_json, whose
/// positions are exact for JSON; everything else is YAML (of which JSON is a subset).
fn parse(path: &Path, text: &str) -> Result<Vec<Value>, SourceError> {
    // Editors on Windows like to start files with a byte-order mark; neither parser wants it.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let is_json = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("json"));
    let mut docs = Vec::new();
    if is_json {
        for doc in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
            docs.push(doc.map_err(|e| SourceError::Parse {
                path: path.to_owned(),
                format: "JSON",
                line: e.line(),
                column: e.column(),
                message: strip_position(&e.to_string(), e.line(), e.column()),
            })?);
        }
    } else {
        for doc in serde_yaml_ng::Deserializer::from_str(text) {
            docs.push(Value::deserialize(doc).map_err(|e| {
                let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
                SourceError::Parse {
                    path: path.to_owned(),
                    format: "YAML",
                    line,
                    column,
                    message: strip_position(&e.to_string(), line, column),
                }
            })?);
        }
    }
    Ok(docs)
}

/// Both parsers put " at line L column C" into their messages; [`SourceError`] shows the
/// position in front instead. Other positions in the message (libyaml adds where the enclosing
/// construct started) stay.
fn strip_position(message: &str, line: usize, column: usize) -> String {
    message.replacen(&format!(" at line {line} column {column}"), "", 1)
}

/// Unpacks `List` objects (`kind: List`, or a typed list such as `ServiceList`) into their
/// items; empty YAML documents (a stray `---`) are skipped.
fn flatten(value: Value, out: &mut dyn FnMut(Value)) {
    if value.is_null() {
        return;
    }
    let is_list = value
        .get("kind")
        .and_then(Value::as_str)
        .is_some_and(|k| k.ends_with("List"))
        && value.get("items").is_some_and(Value::is_array);
    if !is_list {
        out(value);
        return;
    }
    if let Value::Object(mut map) = value
        && let Some(Value::Array(items)) = map.remove("items")
    {
        for item in items {
            flatten(item, out);
        }
    }
}

/// The kinds nodeproxy reads, with the apiVersion it understands for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    fn from_name(kind: &str) -> Option<Kind> {
        match kind {
            "Service" => Some(Kind::Service),
            "EndpointSlice" => Some(Kind::EndpointSlice),
            "Node" => Some(Kind::Node),
            _ => None,
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
        }
    }
}

/// An object of a kind nodeproxy reads, waiting to be converted.
struct Pending<'a> {
    origin: Origin<'a>,
    kind: Kind,
    /// `Kind ns/name` (or `Kind name`), or the origin when the name is unreadable.
    label: String,
    /// Whether `label` holds a name; if not, it replaces the nameless object in reports.
    named: bool,
    value: Value,
}

impl Pending<'_> {
    fn reject(&self, mut r: Rejected, loaded: &mut Loaded) {
        if !self.named {
            r.object.clone_from(&self.label);
        }
        loaded.rejected.push(r);
    }
}

fn assemble(items: Vec<(Origin<'_>, Value)>) -> Loaded {
    let mut loaded = Loaded::default();
    let mut pending: Vec<Option<Pending<'_>>> = Vec::with_capacity(items.len());
    let mut seen: HashMap<(Kind, String), usize> = HashMap::new();

    for (origin, value) in items {
        let Some(kind) = classify(&origin, &value, &mut loaded) else {
            continue;
        };
        let name = object_name(&value, kind == Kind::Node);
        let named = name.is_some();
        let label = match &name {
            Some(n) => format!("{} {n}", kind.name()),
            None => format!("{} ({origin})", kind.name()),
        };
        if let Some(name) = name {
            let index = pending.len();
            if let Some(earlier) = seen.insert((kind, name), index)
                && let Some(slot) = pending.get_mut(earlier)
                && let Some(old) = slot.take()
            {
                loaded.ignored.push(format!(
                    "{label}: defined again in {origin}; the definition in {} is replaced",
                    old.origin
                ));
            }
        }
        pending.push(Some(Pending {
            origin,
            kind,
            label,
            named,
            value,
        }));
    }

    for p in pending.into_iter().flatten() {
        match p.kind {
            Kind::Service => {
                let Some(svc) = decode::<core::Service>(&p, &mut loaded) else {
                    continue;
                };
                match convert::service(&svc) {
                    Ok(Some(s)) => {
                        loaded.state.services.insert(s.name.clone(), s);
                    }
                    Ok(None) => {
                        let why = convert::ignored_service_reason(&svc).unwrap_or("not proxied");
                        loaded.ignored.push(format!("{}: {why}", p.label));
                    }
                    Err(r) => p.reject(r, &mut loaded),
                }
            }
            Kind::EndpointSlice => {
                let Some(slice) = decode::<discovery::EndpointSlice>(&p, &mut loaded) else {
                    continue;
                };
                match convert::endpoint_slice(&slice) {
                    Ok(Some(s)) => {
                        loaded.state.slices.insert(s.name.clone(), s);
                    }
                    Ok(None) => {
                        let why = convert::ignored_slice_reason(&slice).unwrap_or("not used");
                        loaded.ignored.push(format!("{}: {why}", p.label));
                    }
                    Err(r) => p.reject(r, &mut loaded),
                }
            }
            Kind::Node => {
                let Some(node) = decode::<core::Node>(&p, &mut loaded) else {
                    continue;
                };
                match convert::node(&node) {
                    Ok(n) => {
                        loaded.state.nodes.insert(n.name.clone(), n);
                    }
                    Err(r) => p.reject(r, &mut loaded),
                }
            }
        }
    }
    loaded
}

/// Decides from `apiVersion` and `kind` alone whether the object is one nodeproxy reads; notes
/// the others in `ignored` (or `rejected`, when the item is not a Kubernetes object at all).
fn classify(origin: &Origin<'_>, value: &Value, loaded: &mut Loaded) -> Option<Kind> {
    let reject = |field: &str, value: String, reason: &str| Rejected {
        object: format!("object ({origin})"),
        field: field.to_owned(),
        value,
        reason: reason.to_owned(),
    };
    let Some(map) = value.as_object() else {
        loaded.rejected.push(reject(
            "",
            abbreviate(value),
            "not a Kubernetes object; valid: a mapping with apiVersion, kind and metadata",
        ));
        return None;
    };
    let Some(kind_name) = map.get("kind").and_then(Value::as_str) else {
        loaded.rejected.push(reject(
            "kind",
            map.get("kind").map(abbreviate).unwrap_or_default(),
            "missing or not a string; valid: Service, EndpointSlice, Node (others are ignored)",
        ));
        return None;
    };
    let api_version = map
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let label = match object_name(value, false) {
        Some(n) => format!("{kind_name} {n}"),
        None => format!("{kind_name} ({origin})"),
    };
    let Some(kind) = Kind::from_name(kind_name) else {
        loaded
            .ignored
            .push(format!("{label}: kind not used by nodeproxy (in {origin})"));
        return None;
    };
    if api_version != kind.api_version() {
        loaded.ignored.push(format!(
            "{label}: apiVersion {api_version:?} not used by nodeproxy; valid: {} (in {origin})",
            kind.api_version()
        ));
        return None;
    }
    Some(kind)
}

/// `namespace/name`, or just `name` for cluster-scoped objects (or when no namespace is written),
/// if the metadata holds a name.
fn object_name(value: &Value, cluster_scoped: bool) -> Option<String> {
    let meta = value.get("metadata")?;
    let name = meta.get("name")?.as_str().filter(|n| !n.is_empty())?;
    Some(match meta.get("namespace").and_then(Value::as_str) {
        Some(ns) if !ns.is_empty() && !cluster_scoped => format!("{ns}/{name}"),
        _ => name.to_owned(),
    })
}

/// A short rendering of a value for reports: enough to recognise it, never a whole object.
fn abbreviate(value: &Value) -> String {
    const MAX: usize = 60;
    let text = match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if text.chars().count() <= MAX {
        return text;
    }
    let mut short: String = text.chars().take(MAX).collect();
    short.push('…');
    short
}

/// Deserializes the generic value into the k8s-openapi type; a mismatch with the schema is a
/// [`Rejected`] for this object alone.
fn decode<T: Schema>(p: &Pending<'_>, loaded: &mut Loaded) -> Option<T> {
    match T::deserialize(&p.value) {
        Ok(obj) => Some(obj),
        Err(_) => {
            let (field, value, reason) = T::locate(&p.value).unwrap_or_else(|| {
                (
                    String::new(),
                    String::new(),
                    "does not match the Kubernetes schema".to_owned(),
                )
            });
            loaded.rejected.push(Rejected {
                object: p.label.clone(),
                field,
                value,
                reason,
            });
            None
        }
    }
}

/// A k8s-openapi type whose deserialization errors can be traced to a field path.
///
/// serde's errors from a generic value carry no path, so [`locate`](Schema::locate) retries the
/// object's parts, deepest first, each against its own k8s-openapi type; the first part that
/// fails on its own is where the error is.
trait Schema: DeserializeOwned {
    fn locate(v: &Value) -> Option<(String, String, String)>;
}

impl Schema for core::Service {
    fn locate(v: &Value) -> Option<(String, String, String)> {
        each::<core::ServicePort>(v, &["spec", "ports"], "spec.ports")
            .or_else(|| {
                each::<core::LoadBalancerIngress>(
                    v,
                    &["status", "loadBalancer", "ingress"],
                    "status.loadBalancer.ingress",
                )
            })
            .or_else(|| {
                part::<core::ClientIPConfig>(
                    v,
                    &["spec", "sessionAffinityConfig", "clientIP"],
                    "spec.sessionAffinityConfig.clientIP",
                )
            })
            .or_else(|| part::<ObjectMeta>(v, &["metadata"], "metadata"))
            .or_else(|| part::<core::ServiceSpec>(v, &["spec"], "spec"))
            .or_else(|| part::<core::ServiceStatus>(v, &["status"], "status"))
            .or_else(|| pinpoint::<Self>(v, ""))
    }
}

impl Schema for discovery::EndpointSlice {
    fn locate(v: &Value) -> Option<(String, String, String)> {
        let endpoints = lookup(v, &["endpoints"]).and_then(Value::as_array);
        endpoints
            .into_iter()
            .flatten()
            .enumerate()
            .find_map(|(i, ep)| {
                let path = format!("endpoints[{i}]");
                part::<discovery::EndpointConditions>(
                    ep,
                    &["conditions"],
                    &format!("{path}.conditions"),
                )
                .or_else(|| {
                    part::<discovery::EndpointHints>(ep, &["hints"], &format!("{path}.hints"))
                })
                .or_else(|| pinpoint::<discovery::Endpoint>(ep, &path))
            })
            .or_else(|| each::<discovery::EndpointPort>(v, &["ports"], "ports"))
            .or_else(|| part::<ObjectMeta>(v, &["metadata"], "metadata"))
            .or_else(|| pinpoint::<Self>(v, ""))
    }
}

impl Schema for core::Node {
    fn locate(v: &Value) -> Option<(String, String, String)> {
        each::<core::NodeAddress>(v, &["status", "addresses"], "status.addresses")
            .or_else(|| each::<core::Taint>(v, &["spec", "taints"], "spec.taints"))
            .or_else(|| part::<ObjectMeta>(v, &["metadata"], "metadata"))
            .or_else(|| part::<core::NodeSpec>(v, &["spec"], "spec"))
            .or_else(|| part::<core::NodeStatus>(v, &["status"], "status"))
            .or_else(|| pinpoint::<Self>(v, ""))
    }
}

fn lookup<'v>(v: &'v Value, keys: &[&str]) -> Option<&'v Value> {
    keys.iter().try_fold(v, |v, k| v.get(k))
}

/// Checks the sub-object at `keys` (absent or null counts as valid: every such part is optional).
fn part<T: DeserializeOwned>(
    v: &Value,
    keys: &[&str],
    path: &str,
) -> Option<(String, String, String)> {
    let sub = lookup(v, keys).filter(|s| !s.is_null())?;
    pinpoint::<T>(sub, path)
}

/// Checks each element of the array at `keys`.
fn each<T: DeserializeOwned>(
    v: &Value,
    keys: &[&str],
    path: &str,
) -> Option<(String, String, String)> {
    let items = lookup(v, keys)?.as_array()?;
    items
        .iter()
        .enumerate()
        .find_map(|(i, item)| pinpoint::<T>(item, &format!("{path}[{i}]")))
}

fn deser_error<T: DeserializeOwned>(v: &Value) -> Option<String> {
    T::deserialize(v).err().map(|e| e.to_string())
}

/// If `v` does not deserialize as `T`, the field (under `path`) that is wrong, its value, and
/// serde's reason. A missing field is named by serde; for any other error the culprit is the
/// key whose removal changes the error, since serde reports the first bad key it meets and
/// removing an innocent key leaves that report unchanged.
fn pinpoint<T: DeserializeOwned>(v: &Value, path: &str) -> Option<(String, String, String)> {
    let err = deser_error::<T>(v)?;
    let join = |key: &str| {
        if path.is_empty() {
            key.to_owned()
        } else {
            format!("{path}.{key}")
        }
    };
    if let Some(missing) = err
        .strip_prefix("missing field `")
        .and_then(|rest| rest.strip_suffix('`'))
    {
        return Some((
            join(missing),
            String::new(),
            "missing; this field is required".to_owned(),
        ));
    }
    let culprit = v.as_object().and_then(|map| {
        map.iter().find(|(key, _)| {
            let mut without: Map<String, Value> = map.clone();
            without.remove(key.as_str());
            deser_error::<T>(&Value::Object(without)).as_deref() != Some(err.as_str())
        })
    });
    Some(match culprit {
        Some((key, value)) => (join(key), abbreviate(value), err),
        None => (path.to_owned(), abbreviate(v), err),
    })
}
