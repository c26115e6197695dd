//! Strict decoding of the input's text: JSON and YAML read into values that reject
//! duplicate keys, errors with their position, and re-reading an item that failed to decode.

use super::*;

pub(super) fn json_error(path: &Path, e: &serde_json::Error) -> SourceError {
    SourceError::Parse {
        path: path.to_owned(),
        format: "JSON",
        line: e.line(),
        column: e.column(),
        message: strip_position(&e.to_string(), e.line(), e.column()),
    }
}

pub(super) fn yaml_error(path: &Path, e: &serde_yaml_ng::Error) -> SourceError {
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
pub(super) fn strip_position(message: &str, line: usize, column: usize) -> String {
    message.replacen(&format!(" at line {line} column {column}"), "", 1)
}

/// What reading a top-level document, or the `items` of one, gave.
pub(super) enum Parsed {
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
pub(super) enum Shape<'r, 'p> {
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
        if reader.raw {
            while let Some(raw) = seq.next_element::<Box<RawValue>>()? {
                if !reader.raw_item(raw) {
                    return Err(de::Error::custom("an item to be read again through values"));
                }
            }
            return Ok(Parsed::List);
        }
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
        let (first_entry, first_ordinal) = (reader.sent, reader.ordinal);
        // Everything but `items`: a few small values.
        let mut rest = Map::new();
        // Whether `items` was an array, its items handed to the converting thread.
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
        reader.take_back(first_entry);
        reader.ordinal = first_ordinal;
        Ok(Parsed::NotAList)
    }
}

/// A [`Value`] read as `Value::deserialize` reads it, except that a key repeated within one
/// mapping is an error: serde_json and serde_yaml would keep the last one silently, and two
/// `clusterIP`s or `ports` in one object mean the file is not what its author thinks.
pub(super) struct Strict(pub(super) Value);

pub(super) fn duplicate_key(key: &str) -> String {
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

pub(super) struct StrictVisitor;

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
            // One search per key, not a lookup and then an insert.
            match object.entry(key) {
                serde_json::map::Entry::Occupied(taken) => {
                    return Err(de::Error::custom(duplicate_key(taken.key())));
                }
                serde_json::map::Entry::Vacant(slot) => {
                    let Strict(value) = map.next_value()?;
                    slot.insert(value);
                }
            }
        }
        Ok(Value::Object(object))
    }
}

/// The first key of a mapping, read as `Value` reads it.
pub(super) struct FirstKey;

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
pub(super) enum Reparser<'t> {
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
    pub(super) fn new(text: &'t str, is_json: bool) -> Reparser<'t> {
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
    pub(super) fn document(&mut self, path: &Path, index: usize) -> Result<Value, SourceError> {
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
    pub(super) fn check_bare(&mut self, path: &Path, index: usize) -> Result<(), SourceError> {
        match self {
            Reparser::Json { stream, next, .. } => skip_json(path, stream, next, index + 1),
            Reparser::Yaml { .. } => Ok(()),
        }
    }
}

/// Moves `stream`, which is before document `*next`, to document `to`.
pub(super) fn skip_json<'t>(
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
pub(super) fn lost(path: &Path, format: &'static str, index: usize) -> SourceError {
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
pub(super) fn flatten(value: Value, out: &mut dyn FnMut(Value)) {
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
