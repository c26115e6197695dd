//! From decoded values to the model: which kind each object is, decoding it strictly
//! against its API schema, and the reports (rejected, ignored, replaced) of the whole input.

use super::*;

/// The kinds nodeproxy reads, with the apiVersion it understands for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
}

impl Kind {
    pub(super) fn from_name(kind: &str) -> Option<Kind> {
        match kind {
            "Service" => Some(Kind::Service),
            "EndpointSlice" => Some(Kind::EndpointSlice),
            "Node" => Some(Kind::Node),
            "ServiceCIDR" => Some(Kind::ServiceCidr),
            _ => None,
        }
    }

    pub(super) fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::ServiceCidr => "networking.k8s.io/v1",
        }
    }

    /// Whether objects of this kind have no namespace.
    pub(super) fn cluster_scoped(self) -> bool {
        matches!(self, Kind::Node | Kind::ServiceCidr)
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }
}

/// What one object read from a file gave, kept until every file is read so that a later
/// definition of the same object can replace it.
pub(super) enum Entry<'a> {
    /// Not an object nodeproxy reads, or not a Kubernetes object at all.
    Report(Report),
    /// A Service, EndpointSlice or Node, converted.
    Object(Object<'a>),
}

pub(super) enum Report {
    Rejected(Rejected),
    Ignored(String),
}

/// An object of a kind nodeproxy reads, with the result of its conversion.
pub(super) struct Object<'a> {
    pub(super) origin: Origin<'a>,
    pub(super) kind: Kind,
    /// `ns/name` (or `name`), if the metadata holds a name.
    pub(super) name: Option<String>,
    pub(super) outcome: Outcome,
    /// Parts left out of a used object (an endpoint at a special address, …).
    pub(super) dropped: Vec<Rejected>,
}

pub(super) enum Outcome {
    Service(model::Service),
    Slice(model::EndpointSlice),
    Node(model::Node),
    ServiceCidr(String, Vec<ipnet::IpNet>),
    /// Valid but not used, for this reason.
    Ignored(&'static str),
    Rejected(Rejected),
}

impl Object<'_> {
    /// `Kind ns/name` (or `Kind name`), or the origin when the name is unreadable.
    fn label(&self) -> String {
        match &self.name {
            Some(n) => format!("{} {}", self.kind.name(), model::printable(n)),
            None => format!("{} ({})", self.kind.name(), self.origin),
        }
    }

    /// A rejection of this object; a nameless object is named by its origin instead.
    fn reject(&self, mut r: Rejected) -> Outcome {
        if self.name.is_none() {
            r.object = self.label();
        }
        Outcome::Rejected(r)
    }

    /// Converts an EndpointSlice, however it was decoded.
    fn slice(
        &self,
        slice: &impl convert::SliceObject,
        dropped: &mut Vec<Rejected>,
        names: &mut NameTable,
    ) -> Outcome {
        match convert::endpoint_slice_noting(slice, dropped, names) {
            Ok(Some(s)) => Outcome::Slice(s),
            Ok(None) => {
                Outcome::Ignored(convert::ignored_slice_reason(slice).unwrap_or("not used"))
            }
            Err(r) => self.reject(r),
        }
    }

    /// Decodes the object into the k8s-openapi type (an EndpointSlice given as text into
    /// `file/slice.rs`'s own, where that decodes it) and converts that into the model.
    fn convert(
        &self,
        value: Source<'_>,
        dropped: &mut Vec<Rejected>,
        names: &mut NameTable,
    ) -> Outcome {
        match self.kind {
            Kind::Service => {
                let svc = match decode::<core::Service>(value, || self.label()) {
                    Ok(svc) => svc,
                    Err(r) => return Outcome::Rejected(r),
                };
                match convert::service_noting(&svc, dropped) {
                    Ok(Some(s)) => Outcome::Service(s),
                    Ok(None) => Outcome::Ignored(
                        convert::ignored_service_reason(&svc).unwrap_or("not proxied"),
                    ),
                    Err(r) => self.reject(r),
                }
            }
            Kind::EndpointSlice => {
                if let Source::Text(text) = value
                    && let Some(slice) = slice::decode(text)
                {
                    return self.slice(&slice, dropped, names);
                }
                let slice = match decode::<discovery::EndpointSlice>(value, || self.label()) {
                    Ok(slice) => slice,
                    Err(r) => return Outcome::Rejected(r),
                };
                self.slice(&slice, dropped, names)
            }
            Kind::Node => {
                let node = match decode::<core::Node>(value, || self.label()) {
                    Ok(node) => node,
                    Err(r) => return Outcome::Rejected(r),
                };
                match convert::node(&node) {
                    Ok(n) => Outcome::Node(n),
                    Err(r) => self.reject(r),
                }
            }
            Kind::ServiceCidr => {
                let obj = match decode::<networking::ServiceCIDR>(value, || self.label()) {
                    Ok(obj) => obj,
                    Err(r) => return Outcome::Rejected(r),
                };
                match convert::service_cidr(&obj) {
                    Ok((name, cidrs)) => Outcome::ServiceCidr(name, cidrs),
                    Err(r) => self.reject(r),
                }
            }
        }
    }
}

/// Checks one object and converts it if it is one nodeproxy reads; the value is dropped.
pub(super) fn read_item<'a>(origin: Origin<'a>, value: Value, names: &mut NameTable) -> Entry<'a> {
    let kind = match classify(&origin, &value) {
        Ok(kind) => kind,
        Err(report) => return Entry::Report(report),
    };
    let name = object_name(&value, kind.cluster_scoped());
    read_object(origin, kind, name, Source::Value(&value), names)
}

/// [`read_item`] for an item's text whose scan found it of `kind`, with `name` from its
/// metadata ([`raw`]).
pub(super) fn read_raw<'a>(
    origin: Origin<'a>,
    raw: &RawValue,
    kind: Kind,
    name: Option<String>,
    names: &mut NameTable,
) -> Entry<'a> {
    #[cfg(test)]
    super::tests::RAW_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    read_object(origin, kind, name, Source::Text(raw.get()), names)
}

/// Converts an object of a kind nodeproxy reads.
fn read_object<'a>(
    origin: Origin<'a>,
    kind: Kind,
    name: Option<String>,
    source: Source<'_>,
    names: &mut NameTable,
) -> Entry<'a> {
    let mut object = Object {
        origin,
        kind,
        name,
        outcome: Outcome::Ignored(""),
        dropped: Vec::new(),
    };
    let mut dropped = Vec::new();
    object.outcome = object.convert(source, &mut dropped, names);
    object.dropped = dropped;
    Entry::Object(object)
}

/// An object to decode: a generic value, or the text of one whose keys are checked ([`raw`]).
#[derive(Clone, Copy)]
pub(super) enum Source<'v> {
    Value(&'v Value),
    Text(&'v str),
}

/// Merges what the objects gave, in file order: the reports of objects nodeproxy does not read
/// and the notes on replaced definitions first, then, for each object that was not replaced, its
/// model object or its report.
pub(super) fn assemble(mut entries: Vec<Option<Entry<'_>>>) -> Loaded {
    let mut loaded = Loaded::default();
    for slot in &mut entries {
        match slot.take_if(|e| matches!(e, Entry::Report(_))) {
            Some(Entry::Report(Report::Rejected(r))) => loaded.rejected.push(r),
            Some(Entry::Report(Report::Ignored(i))) => loaded.ignored.push(i),
            _ => {}
        }
    }
    // A definition is replaced by the next one of the same kind and name, found by sorting
    // references to the names: moving each (large) object out of its slot and back around a
    // map of owned names, then inserting it into a B-tree, took merging to 20-28 ms at 10k
    // Services × 10 endpoints, against ~10 ms this way (`load_files` in a loop).
    let replaced = {
        let mut named: Vec<(Kind, &str, usize)> = entries
            .iter()
            .enumerate()
            .filter_map(|(index, entry)| match entry {
                Some(Entry::Object(o)) => Some((o.kind, o.name.as_deref()?, index)),
                _ => None,
            })
            .collect();
        named.sort_unstable();
        let mut replaced: Vec<(usize, usize)> = named
            .windows(2)
            .filter_map(|w| match w {
                [(kind, name, earlier), (next_kind, next_name, later)]
                    if kind == next_kind && name == next_name =>
                {
                    Some((*later, *earlier))
                }
                _ => None,
            })
            .collect();
        replaced.sort_unstable();
        replaced
    };
    for (later, earlier) in replaced {
        if let Some(Some(Entry::Object(old))) = entries.get_mut(earlier).map(Option::take)
            && let Some(Some(Entry::Object(object))) = entries.get(later)
        {
            loaded.replaced.push(format!(
                "{}: defined again in {}; the definition in {} is replaced",
                object.label(),
                object.origin,
                old.origin
            ));
        }
    }

    // Collected, then built in one go: that fills the B-trees' nodes, which inserts leave
    // partly empty (3.2 of the model's 19.4 MB at 10k Services × 10 endpoints).
    let mut services = Vec::new();
    let mut slices = Vec::new();
    for entry in entries.into_iter().flatten() {
        let Entry::Object(mut object) = entry else {
            continue;
        };
        loaded.dropped.append(&mut object.dropped);
        match object.outcome {
            Outcome::Service(s) => services.push((s.name.clone(), s)),
            Outcome::Slice(s) => slices.push((s.name.clone(), s)),
            Outcome::Node(n) => {
                loaded.state.nodes.insert(n.name.clone(), n);
            }
            Outcome::ServiceCidr(name, cidrs) => {
                loaded.state.service_cidrs.insert(name, cidrs);
            }
            Outcome::Ignored(why) => loaded.ignored.push(format!("{}: {why}", object.label())),
            Outcome::Rejected(r) => loaded.rejected.push(r),
        }
    }
    // `collect` sorts stably and keeps the last of equal keys, as inserting in order did.
    loaded.state.services = services.into_iter().collect();
    loaded.state.slices = slices.into_iter().collect();
    loaded
}

/// Decides from `apiVersion` and `kind` alone whether the object is one nodeproxy reads; the
/// others are noted as ignored (or rejected, when the item is not a Kubernetes object at all).
pub(super) fn classify(origin: &Origin<'_>, value: &Value) -> Result<Kind, Report> {
    let reject = |field: &str, value: String, reason: &str| {
        Report::Rejected(Rejected {
            object: format!("object ({origin})"),
            field: field.to_owned(),
            value,
            reason: reason.to_owned(),
        })
    };
    let Some(map) = value.as_object() else {
        return Err(reject(
            "",
            abbreviate(value),
            "not a Kubernetes object; valid: a mapping with apiVersion, kind and metadata",
        ));
    };
    let Some(kind_name) = map.get("kind").and_then(Value::as_str) else {
        return Err(reject(
            "kind",
            map.get("kind").map(abbreviate).unwrap_or_default(),
            "missing or not a string; valid: Service, EndpointSlice, Node, ServiceCIDR (others \
             are ignored)",
        ));
    };
    let api_version = map
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind_shown = model::printable(kind_name);
    let label = match object_name(value, false) {
        Some(n) => format!("{kind_shown} {}", model::printable(&n)),
        None => format!("{kind_shown} ({origin})"),
    };
    let Some(kind) = Kind::from_name(kind_name) else {
        return Err(Report::Ignored(format!(
            "{label}: kind not used by nodeproxy (in {origin})"
        )));
    };
    if api_version != kind.api_version() {
        return Err(Report::Ignored(format!(
            "{label}: apiVersion \"{}\" not used by nodeproxy; valid: {} (in {origin})",
            model::printable(api_version),
            kind.api_version()
        )));
    }
    Ok(kind)
}
/// `namespace/name`, or just `name` for cluster-scoped objects (or when no namespace is written),
/// if the metadata holds a name.
pub(super) fn object_name(value: &Value, cluster_scoped: bool) -> Option<String> {
    let meta = value.get("metadata")?;
    joined_name(
        meta.get("name")?.as_str()?,
        meta.get("namespace").and_then(Value::as_str),
        cluster_scoped,
    )
}

/// `namespace/name`, or `name` when the object is cluster-scoped or no namespace is written;
/// `None` for an empty name.
pub(super) fn joined_name(
    name: &str,
    namespace: Option<&str>,
    cluster_scoped: bool,
) -> Option<String> {
    if name.is_empty() {
        return None;
    }
    Some(match namespace {
        Some(ns) if !ns.is_empty() && !cluster_scoped => format!("{ns}/{name}"),
        _ => name.to_owned(),
    })
}

/// A short rendering of a value for reports: enough to recognise it, never a whole object.
pub(super) fn abbreviate(value: &Value) -> String {
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

/// Deserializes the object into the k8s-openapi type; a mismatch with the schema is a
/// [`Rejected`] for this object alone, named `label`. Text that does not decode is decoded
/// again as a generic value, which pinpoints the field: what it reports is what an object read
/// as a value gets.
pub(super) fn decode<T: Schema>(
    source: Source<'_>,
    label: impl FnOnce() -> String,
) -> Result<T, Rejected> {
    let value = match source {
        Source::Value(value) => value,
        Source::Text(text) => {
            if let Ok(decoded) = serde_json::from_str::<T>(text) {
                return Ok(decoded);
            }
            // The check read this text already: it parses.
            let value = serde_json::from_str::<Value>(text).unwrap_or(Value::Null);
            return decode(Source::Value(&value), label);
        }
    };
    T::deserialize(value).map_err(|_| {
        let (field, value, reason) = T::locate(value).unwrap_or_else(|| {
            (
                String::new(),
                String::new(),
                "does not match the Kubernetes schema".to_owned(),
            )
        });
        Rejected {
            object: label(),
            field,
            value,
            reason,
        }
    })
}

/// A k8s-openapi type whose deserialization errors can be traced to a field path.
///
/// serde's errors from a generic value carry no path, so [`locate`](Schema::locate) retries the
/// object's parts, deepest first, each against its own k8s-openapi type; the first part that
/// fails on its own is where the error is.
pub(super) trait Schema: DeserializeOwned {
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

impl Schema for networking::ServiceCIDR {
    fn locate(v: &Value) -> Option<(String, String, String)> {
        part::<ObjectMeta>(v, &["metadata"], "metadata")
            .or_else(|| part::<networking::ServiceCIDRSpec>(v, &["spec"], "spec"))
            .or_else(|| pinpoint::<Self>(v, ""))
    }
}

pub(super) fn lookup<'v>(v: &'v Value, keys: &[&str]) -> Option<&'v Value> {
    keys.iter().try_fold(v, |v, k| v.get(k))
}

/// Checks the sub-object at `keys` (absent or null counts as valid: every such part is optional).
pub(super) fn part<T: DeserializeOwned>(
    v: &Value,
    keys: &[&str],
    path: &str,
) -> Option<(String, String, String)> {
    let sub = lookup(v, keys).filter(|s| !s.is_null())?;
    pinpoint::<T>(sub, path)
}

/// Checks each element of the array at `keys`.
pub(super) fn each<T: DeserializeOwned>(
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

pub(super) fn deser_error<T: DeserializeOwned>(v: &Value) -> Option<String> {
    T::deserialize(v).err().map(|e| e.to_string())
}

/// If `v` does not deserialize as `T`, the field (under `path`) that is wrong, its value, and
/// serde's reason. A missing field is named by serde; for any other error the culprit is the
/// key whose removal changes the error, since serde reports the first bad key it meets and
/// removing an innocent key leaves that report unchanged.
pub(super) fn pinpoint<T: DeserializeOwned>(
    v: &Value,
    path: &str,
) -> Option<(String, String, String)> {
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
