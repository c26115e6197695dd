//! `--from-file`: reads Services, EndpointSlices and Nodes from YAML or JSON files as
//! `kubectl get services,endpointslices,nodes -A -o yaml` (or `-o json`) prints them.
//!
//! A file is a `List` with `items`, several YAML documents (each of which may be a `List`), a
//! stream of JSON values, or a single object. A syntax error is fatal, since nothing after it
//! can be trusted; otherwise each object is checked on its own and either used, ignored with a
//! reason, or rejected with the field that is wrong, so that one bad object never hides the
//! others.
//!
//! Reading streams: the `items` of a list are parsed one at a time into a generic value, which
//! is checked, converted to the model and dropped before the next item is parsed, so memory
//! holds the file's text, one item's value and the converted objects, never the whole tree.
//! kubectl prints `items` before `kind`, so every document whose `items` is an array is read as
//! a list; if its `kind` turns out not to name a list, what its items gave is taken back and
//! the document is parsed again as one object.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{
    self, DeserializeOwned, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use serde_json::{Map, Value};

use super::{Loaded, SourceError};
use crate::model::{self, Rejected, convert};

/// Reads every file in order and merges what they hold. When the same object (kind, namespace
/// and name) appears more than once, the last definition wins and the earlier ones are noted in
/// `ignored`.
pub fn load_files(paths: &[PathBuf]) -> Result<Loaded, SourceError> {
    load_files_limited(paths, DEFAULT_MAX_FILE_BYTES)
}

/// The most bytes [`load_files`] reads from one file: 1 GiB, about 50 times what
/// `kubectl get -o json` prints for 10k Services × 10 endpoints, yet small enough that
/// `--from-file /dev/zero` fails within seconds instead of filling the memory.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 1 << 30;

/// [`load_files`] with another bound on the size of each file (`--max-input-size`). A file
/// larger than `max_bytes` is an error: reading stops at the bound, so even an endless file
/// (a device, a pipe) costs at most `max_bytes` of memory.
pub fn load_files_limited(paths: &[PathBuf], max_bytes: u64) -> Result<Loaded, SourceError> {
    let mut reader = Reader {
        path: Path::new(""),
        ordinal: 0,
        entries: Vec::new(),
    };
    for path in paths {
        let text = read_bounded(path, max_bytes)?;
        reader.path = path;
        reader.ordinal = 0;
        reader.read(&text)?;
    }
    Ok(assemble(reader.entries))
}

/// Reads objects from text as if it were the file `name` (whose extension picks JSON or YAML):
/// what [`load_files`] does after reading a file. For the fuzz target `file_reader` and its
/// corpus test.
#[doc(hidden)]
pub fn load_text(name: &Path, text: &str) -> Result<Loaded, SourceError> {
    let mut reader = Reader {
        path: name,
        ordinal: 0,
        entries: Vec::new(),
    };
    reader.read(text)?;
    Ok(assemble(reader.entries))
}

/// Reads one file as UTF-8 text, failing once it is longer than `max_bytes`.
fn read_bounded(path: &Path, max_bytes: u64) -> Result<String, SourceError> {
    use std::io::Read as _;
    let read_error = |source| SourceError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    // One byte past the bound tells a file of exactly `max_bytes` from a longer one.
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > max_bytes {
        return Err(SourceError::TooLarge {
            path: path.to_path_buf(),
            max_bytes,
        });
    }
    String::from_utf8(bytes).map_err(|e| {
        read_error(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        ))
    })
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

/// Reads files one after the other, keeping what each object gave in file order.
struct Reader<'p> {
    path: &'p Path,
    /// How many objects of the current file have been read.
    ordinal: usize,
    entries: Vec<Option<Entry<'p>>>,
}

impl<'p> Reader<'p> {
    /// Reads the top-level documents of one file. `.json` files go through serde_json, whose
    /// positions are exact for JSON; everything else is YAML (of which JSON is a subset).
    fn read(&mut self, text: &str) -> Result<(), SourceError> {
        // Editors on Windows like to start files with a byte-order mark; neither parser wants it.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let is_json = self
            .path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let mut again = Reparser::new(text, is_json);
        if is_json {
            let mut de = serde_json::Deserializer::from_str(text);
            let mut index = 0;
            // `end` fails as long as anything but whitespace is left: the next value.
            while de.end().is_err() {
                let doc = Shape::Document(self)
                    .deserialize(&mut de)
                    .map_err(|e| json_error(self.path, &e))?;
                let bare = matches!(
                    doc,
                    Parsed::Value(Value::Null | Value::Bool(_) | Value::Number(_))
                );
                if bare && de.end().is_err() {
                    again.check_bare(self.path, index)?;
                }
                self.finish(doc, index, &mut again)?;
                index += 1;
            }
        } else {
            for (index, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
                let doc = Shape::Document(self)
                    .deserialize(doc)
                    .map_err(|e| yaml_error(self.path, &e))?;
                self.finish(doc, index, &mut again)?;
            }
        }
        Ok(())
    }

    /// Takes in a top-level document once it has been read.
    fn finish(
        &mut self,
        doc: Parsed,
        index: usize,
        again: &mut Reparser<'_>,
    ) -> Result<(), SourceError> {
        match doc {
            Parsed::Value(value) => flatten(value, &mut |v| self.item(v)),
            Parsed::List => {}
            Parsed::NotAList => {
                let value = again.document(self.path, index)?;
                flatten(value, &mut |v| self.item(v));
            }
        }
        Ok(())
    }

    /// Checks and converts one object, keeping only the result.
    fn item(&mut self, value: Value) {
        self.ordinal += 1;
        let origin = Origin {
            path: self.path,
            ordinal: self.ordinal,
        };
        self.entries.push(Some(read_item(origin, value)));
    }
}

fn json_error(path: &Path, e: &serde_json::Error) -> SourceError {
    SourceError::Parse {
        path: path.to_owned(),
        format: "JSON",
        line: e.line(),
        column: e.column(),
        message: strip_position(&e.to_string(), e.line(), e.column()),
    }
}

fn yaml_error(path: &Path, e: &serde_yaml_ng::Error) -> SourceError {
    let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
    SourceError::Parse {
        path: path.to_owned(),
        format: "YAML",
        line,
        column,
        message: strip_position(&e.to_string(), line, column),
    }
}

/// Both parsers put " at line L column C" into their messages; [`SourceError`] shows the
/// position in front instead. Other positions in the message (libyaml adds where the enclosing
/// construct started) stay.
fn strip_position(message: &str, line: usize, column: usize) -> String {
    message.replacen(&format!(" at line {line} column {column}"), "", 1)
}

/// What reading a top-level document, or the `items` of one, gave.
enum Parsed {
    /// The value, as a whole.
    Value(Value),
    /// The items of a list, already taken in one by one.
    List,
    /// A document with an `items` array whose `kind` turned out not to name a list: it is one
    /// object after all, and must be parsed again as a whole.
    NotAList,
}

/// A seed for a value that may be read item by item: a top-level document (which may be a
/// list) or the value of a document's `items`. Anything else about it is read as a generic
/// [`Value`], exactly as `Value::deserialize` would read it.
enum Shape<'r, 'p> {
    Document(&'r mut Reader<'p>),
    Items(&'r mut Reader<'p>),
}

impl<'de> DeserializeSeed<'de> for Shape<'_, '_> {
    type Value = Parsed;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Parsed, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Shape<'_, '_> {
    type Value = Parsed;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Value's own wording, so that errors read as they would without streaming.
        formatter.write_str("any valid JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Parsed, E> {
        Ok(Parsed::Value(Value::Bool(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Parsed, E> {
        Ok(Parsed::Value(Value::Number(v.into())))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Parsed, E> {
        Value::deserialize(de::value::I128Deserializer::new(v)).map(Parsed::Value)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Parsed, E> {
        Ok(Parsed::Value(Value::Number(v.into())))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Parsed, E> {
        Value::deserialize(de::value::U128Deserializer::new(v)).map(Parsed::Value)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Parsed, E> {
        Value::deserialize(de::value::F64Deserializer::new(v)).map(Parsed::Value)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Parsed, E> {
        Ok(Parsed::Value(Value::String(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Parsed, E> {
        Ok(Parsed::Value(Value::String(v)))
    }

    fn visit_none<E: de::Error>(self) -> Result<Parsed, E> {
        Ok(Parsed::Value(Value::Null))
    }

    fn visit_some<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Parsed, D::Error> {
        Strict::deserialize(deserializer).map(|v| Parsed::Value(v.0))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Parsed, E> {
        Ok(Parsed::Value(Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Parsed, A::Error> {
        let Shape::Items(reader) = self else {
            return Strict::deserialize(SeqAccessDeserializer::new(seq))
                .map(|v| Parsed::Value(v.0));
        };
        while let Some(Strict(value)) = seq.next_element::<Strict>()? {
            flatten(value, &mut |v| reader.item(v));
        }
        Ok(Parsed::List)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parsed, A::Error> {
        let Shape::Document(reader) = self else {
            return Strict::deserialize(MapAccessDeserializer::new(map))
                .map(|v| Parsed::Value(v.0));
        };
        let (first_entry, first_ordinal) = (reader.entries.len(), reader.ordinal);
        // Everything but `items`: a few small values.
        let mut rest = Map::new();
        // Whether `items` was an array, read into `reader.entries`.
        let mut listed = false;
        let mut first = true;
        loop {
            let key = if first {
                first = false;
                map.next_key_seed(FirstKey)?
            } else {
                map.next_key::<String>()?
            };
            let Some(key) = key else { break };
            if rest.contains_key(&key) || (key == "items" && listed) {
                return Err(de::Error::custom(duplicate_key(&key)));
            }
            if key != "items" {
                let Strict(value) = map.next_value()?;
                rest.insert(key, value);
                continue;
            }
            match map.next_value_seed(Shape::Items(&mut *reader))? {
                Parsed::Value(value) => {
                    listed = false;
                    rest.insert(key, value);
                }
                Parsed::List | Parsed::NotAList => {
                    listed = true;
                    rest.remove(&key);
                }
            }
        }
        if !listed {
            return Ok(Parsed::Value(Value::Object(rest)));
        }
        let is_list = rest
            .get("kind")
            .and_then(Value::as_str)
            .is_some_and(|k| k.ends_with("List"));
        if is_list {
            return Ok(Parsed::List);
        }
        reader.entries.truncate(first_entry);
        reader.ordinal = first_ordinal;
        Ok(Parsed::NotAList)
    }
}

/// A [`Value`] read as `Value::deserialize` reads it, except that a key repeated within one
/// mapping is an error: serde_json and serde_yaml would keep the last one silently, and two
/// `clusterIP`s or `ports` in one object mean the file is not what its author thinks.
struct Strict(Value);

fn duplicate_key(key: &str) -> String {
    format!(
        "duplicate key `{}` in one mapping (which one is meant?)",
        model::printable(key)
    )
}

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Strict, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any valid JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Value, E> {
        Value::deserialize(de::value::I128Deserializer::new(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        Value::deserialize(de::value::U128Deserializer::new(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Value::deserialize(de::value::F64Deserializer::new(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        Strict::deserialize(deserializer).map(|v| v.0)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(Strict(value)) = seq.next_element()? {
            items.push(value);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if object.contains_key(&key) {
                return Err(de::Error::custom(duplicate_key(&key)));
            }
            let Strict(value) = map.next_value()?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

/// The first key of a mapping, read as `Value` reads it.
struct FirstKey;

impl<'de> DeserializeSeed<'de> for FirstKey {
    type Value = String;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<String, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl Visitor<'_> for FirstKey {
    type Value = String;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a string key")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<String, E> {
        Ok(v)
    }
}

/// Parses single top-level documents of a file again, as whole values, for the rare document
/// that looked like a list but was not one. Documents are asked for in increasing order, so the
/// file is gone through at most once more however many of them there are.
enum Reparser<'t> {
    Json {
        text: &'t str,
        stream: serde_json::StreamDeserializer<'t, serde_json::de::StrRead<'t>, IgnoredAny>,
        next: usize,
    },
    Yaml {
        docs: serde_yaml_ng::Deserializer<'t>,
        next: usize,
    },
}

impl<'t> Reparser<'t> {
    fn new(text: &'t str, is_json: bool) -> Reparser<'t> {
        if is_json {
            Reparser::Json {
                text,
                stream: serde_json::Deserializer::from_str(text).into_iter(),
                next: 0,
            }
        } else {
            Reparser::Yaml {
                docs: serde_yaml_ng::Deserializer::from_str(text),
                next: 0,
            }
        }
    }

    /// The document at `index` (0-based), which must not be before one asked for earlier.
    fn document(&mut self, path: &Path, index: usize) -> Result<Value, SourceError> {
        match self {
            Reparser::Json { text, stream, next } => {
                skip_json(path, stream, next, index)?;
                let rest = text
                    .get(stream.byte_offset()..)
                    .ok_or_else(|| lost(path, "JSON", index))?;
                let Strict(value) =
                    Strict::deserialize(&mut serde_json::Deserializer::from_str(rest))
                        .map_err(|e| json_error(path, &e))?;
                skip_json(path, stream, next, index + 1)?;
                Ok(value)
            }
            Reparser::Yaml { docs, next } => {
                let skip = index
                    .checked_sub(*next)
                    .ok_or_else(|| lost(path, "YAML", index))?;
                let doc = docs.nth(skip).ok_or_else(|| lost(path, "YAML", index))?;
                *next = index + 1;
                Strict::deserialize(doc)
                    .map(|v| v.0)
                    .map_err(|e| yaml_error(path, &e))
            }
        }
    }

    /// For JSON, checks as serde_json's stream of values does that the bare value (a number,
    /// `true`, `false` or `null`) at `index` ends with whitespace or punctuation: `truenull` is
    /// an error, not two values.
    fn check_bare(&mut self, path: &Path, index: usize) -> Result<(), SourceError> {
        match self {
            Reparser::Json { stream, next, .. } => skip_json(path, stream, next, index + 1),
            Reparser::Yaml { .. } => Ok(()),
        }
    }
}

/// Moves `stream`, which is before document `*next`, to document `to`.
fn skip_json<'t>(
    path: &Path,
    stream: &mut serde_json::StreamDeserializer<'t, serde_json::de::StrRead<'t>, IgnoredAny>,
    next: &mut usize,
    to: usize,
) -> Result<(), SourceError> {
    while *next < to {
        stream
            .next()
            .ok_or_else(|| lost(path, "JSON", *next))?
            .map_err(|e| json_error(path, &e))?;
        *next += 1;
    }
    Ok(())
}

/// Reading a document again went wrong: cannot happen, since it was read once already.
fn lost(path: &Path, format: &'static str, index: usize) -> SourceError {
    SourceError::Parse {
        path: path.to_owned(),
        format,
        line: 0,
        column: 0,
        message: format!("document {} cannot be read again", index + 1),
    }
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

/// What one object read from a file gave, kept until every file is read so that a later
/// definition of the same object can replace it.
enum Entry<'a> {
    /// Not an object nodeproxy reads, or not a Kubernetes object at all.
    Report(Report),
    /// A Service, EndpointSlice or Node, converted.
    Object(Object<'a>),
}

enum Report {
    Rejected(Rejected),
    Ignored(String),
}

/// An object of a kind nodeproxy reads, with the result of its conversion.
struct Object<'a> {
    origin: Origin<'a>,
    kind: Kind,
    /// `ns/name` (or `name`), if the metadata holds a name.
    name: Option<String>,
    outcome: Outcome,
    /// Parts left out of a used object (an endpoint at a special address, …).
    dropped: Vec<Rejected>,
}

enum Outcome {
    Service(model::Service),
    Slice(model::EndpointSlice),
    Node(model::Node),
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

    /// Decodes the generic value into the k8s-openapi type and converts that into the model.
    fn convert(&self, value: &Value, dropped: &mut Vec<Rejected>) -> Outcome {
        match self.kind {
            Kind::Service => {
                let svc = match decode::<core::Service>(value, self.label()) {
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
                let slice = match decode::<discovery::EndpointSlice>(value, self.label()) {
                    Ok(slice) => slice,
                    Err(r) => return Outcome::Rejected(r),
                };
                match convert::endpoint_slice_noting(&slice, dropped) {
                    Ok(Some(s)) => Outcome::Slice(s),
                    Ok(None) => Outcome::Ignored(
                        convert::ignored_slice_reason(&slice).unwrap_or("not used"),
                    ),
                    Err(r) => self.reject(r),
                }
            }
            Kind::Node => {
                let node = match decode::<core::Node>(value, self.label()) {
                    Ok(node) => node,
                    Err(r) => return Outcome::Rejected(r),
                };
                match convert::node(&node) {
                    Ok(n) => Outcome::Node(n),
                    Err(r) => self.reject(r),
                }
            }
        }
    }
}

/// Checks one object and converts it if it is one nodeproxy reads; the value is dropped.
fn read_item(origin: Origin<'_>, value: Value) -> Entry<'_> {
    let kind = match classify(&origin, &value) {
        Ok(kind) => kind,
        Err(report) => return Entry::Report(report),
    };
    let mut object = Object {
        origin,
        kind,
        name: object_name(&value, kind == Kind::Node),
        outcome: Outcome::Ignored(""),
        dropped: Vec::new(),
    };
    let mut dropped = Vec::new();
    object.outcome = object.convert(&value, &mut dropped);
    object.dropped = dropped;
    Entry::Object(object)
}

/// Merges what the objects gave, in file order: the reports of objects nodeproxy does not read
/// and the notes on replaced definitions first, then, for each object that was not replaced, its
/// model object or its report.
fn assemble(mut entries: Vec<Option<Entry<'_>>>) -> Loaded {
    let mut loaded = Loaded::default();
    let mut seen: HashMap<(Kind, String), usize> = HashMap::new();

    for index in 0..entries.len() {
        let Some(slot) = entries.get_mut(index) else {
            continue;
        };
        let object = match slot.take() {
            None => continue,
            Some(Entry::Report(Report::Rejected(r))) => {
                loaded.rejected.push(r);
                continue;
            }
            Some(Entry::Report(Report::Ignored(i))) => {
                loaded.ignored.push(i);
                continue;
            }
            Some(Entry::Object(object)) => object,
        };
        if let Some(name) = &object.name
            && let Some(earlier) = seen.insert((object.kind, name.clone()), index)
            && let Some(Some(Entry::Object(old))) = entries.get_mut(earlier).map(Option::take)
        {
            loaded.replaced.push(format!(
                "{}: defined again in {}; the definition in {} is replaced",
                object.label(),
                object.origin,
                old.origin
            ));
        }
        if let Some(slot) = entries.get_mut(index) {
            *slot = Some(Entry::Object(object));
        }
    }

    for entry in entries.into_iter().flatten() {
        let Entry::Object(mut object) = entry else {
            continue;
        };
        loaded.dropped.append(&mut object.dropped);
        match object.outcome {
            Outcome::Service(s) => {
                loaded.state.services.insert(s.name.clone(), s);
            }
            Outcome::Slice(s) => {
                loaded.state.slices.insert(s.name.clone(), s);
            }
            Outcome::Node(n) => {
                loaded.state.nodes.insert(n.name.clone(), n);
            }
            Outcome::Ignored(why) => loaded.ignored.push(format!("{}: {why}", object.label())),
            Outcome::Rejected(r) => loaded.rejected.push(r),
        }
    }
    loaded
}

/// Decides from `apiVersion` and `kind` alone whether the object is one nodeproxy reads; the
/// others are noted as ignored (or rejected, when the item is not a Kubernetes object at all).
fn classify(origin: &Origin<'_>, value: &Value) -> Result<Kind, Report> {
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
            "missing or not a string; valid: Service, EndpointSlice, Node (others are ignored)",
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
/// [`Rejected`] for this object alone, named `label`.
fn decode<T: Schema>(value: &Value, label: String) -> Result<T, Rejected> {
    T::deserialize(value).map_err(|_| {
        let (field, value, reason) = T::locate(value).unwrap_or_else(|| {
            (
                String::new(),
                String::new(),
                "does not match the Kubernetes schema".to_owned(),
            )
        });
        Rejected {
            object: label,
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
