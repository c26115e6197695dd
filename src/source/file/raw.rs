//! JSON list items read without a generic value: the parsing thread takes each item's text,
//! scans it for repeated keys and for its kind, apiVersion and name, and the converting
//! thread decodes the text straight into its k8s-openapi type.
//!
//! Through a [`Value`], every string of an item was allocated twice (into the value, then into
//! the typed object) and every mapping built as a B-tree and freed again: at 10k Services × 10
//! endpoints, building, decoding and freeing the values was most of reading the input. The
//! result is the same either way, and anything unusual goes the way of the value: an item of a
//! kind nodeproxy does not read (its report names it from the value), a nested list, an item
//! the scan is unsure of (an escape in a key, …), an object that does not match its schema
//! (the value pinpoints the field); and on a repeated key, or
//! any error at all while the file is read this way, the whole file is read again through
//! values, so that the error and its position are exactly what that reading reports (skipping
//! an item into its text words some syntax errors differently). The tests and the fuzz target
//! `file_reader` compare both readings of the same text.

use super::*;

/// What the scan of an item found at its top: `kind` and `apiVersion`, and `name` and
/// `namespace` in its `metadata`, each when it is a string.
#[derive(Default)]
pub(super) struct Head<'de> {
    kind: Option<&'de str>,
    api_version: Option<&'de str>,
    name: Option<&'de str>,
    namespace: Option<&'de str>,
}

impl Head<'_> {
    /// The kind, when the item is one nodeproxy reads at the apiVersion it understands (what
    /// [`classify`] accepts).
    pub(super) fn kind(&self) -> Option<Kind> {
        let kind = Kind::from_name(self.kind?)?;
        (self.api_version.unwrap_or_default() == kind.api_version()).then_some(kind)
    }

    /// What [`object_name`] takes from the same object.
    pub(super) fn name(&self, cluster_scoped: bool) -> Option<String> {
        joined_name(self.name?, self.namespace, cluster_scoped)
    }
}

/// Scans an item's text ([`scan`]) with a fresh list of keys.
pub(super) fn check(raw: &RawValue) -> Scan<'_> {
    scan(raw.get(), &mut Vec::with_capacity(32))
}

/// How deeply `value`'s mappings and arrays nest; an item read through values past
/// [`MAX_DEPTH`] may read differently alone than in its file.
pub(super) fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// What [`scan`] found.
pub(super) enum Scan<'de> {
    Clean(Head<'de>),
    Repeated,
    /// Something the scan leaves to reading through values: an escape in a key or in a string
    /// the [`Head`] takes, a `\u` escape of a surrogate (serde_json's skipping lets a lone one
    /// through, its parsing does not), a number with an exponent or longer than 64 characters
    /// (which skipping lets through out of range), or nesting deeper than [`MAX_DEPTH`].
    Unsure,
}

/// A container the scan is in.
struct Open {
    /// For a mapping, where its keys begin in the scan's list; `None` for an array.
    keys: Option<usize>,
    at: At,
}

/// Checks an item's text as [`Strict`] would read it (no key twice in one mapping) and takes
/// its [`Head`], by hand, over text that serde_json has already found to be JSON (skipping it
/// into a [`RawValue`] validates everything but the surrogates of `\u` escapes and the range
/// of numbers): through serde's visitors the same check cost about as much as building the
/// generic value it replaces (callgrind at 10k Services × 10 endpoints: 362 M instructions,
/// against 228 M for this; the skipping itself is another 196 M).
#[inline(never)]
pub(super) fn scan<'de>(text: &'de str, keys: &mut Vec<&'de str>) -> Scan<'de> {
    let bytes = text.as_bytes();
    let mut head = Head::default();
    let mut open: Vec<Open> = Vec::with_capacity(16);
    // Inside a mapping, whether the next string is a key.
    let mut key_next = false;
    // The [`Head`] slot that the value after the last key fills, if any, and where a mapping
    // there would be.
    let mut pending: Option<Slot> = None;
    let mut child = At::Inside;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'{' | b'[' => {
                if open.len() >= MAX_DEPTH {
                    return Scan::Unsure;
                }
                let at = if open.is_empty() {
                    At::Top
                } else {
                    std::mem::replace(&mut child, At::Inside)
                };
                pending = None;
                key_next = b == b'{';
                open.push(Open {
                    keys: key_next.then_some(keys.len()),
                    at,
                });
                i += 1;
            }
            b'}' | b']' => {
                if let Some(Open {
                    keys: Some(start), ..
                }) = open.pop()
                {
                    let own = keys.get_mut(start..).unwrap_or_default();
                    // Sorted, a repeated key sits next to itself: a mapping with many keys
                    // costs n log n, not n² (a hostile file may hold one with a million).
                    if own.len() > 1 {
                        own.sort_unstable();
                        if own.windows(2).any(|w| w.first() == w.last()) {
                            return Scan::Repeated;
                        }
                    }
                    keys.truncate(start);
                }
                key_next = false;
                child = At::Inside;
                i += 1;
            }
            b',' => {
                key_next = matches!(open.last(), Some(Open { keys: Some(_), .. }));
                i += 1;
            }
            b'"' => {
                let Some((end, escaped)) = string_end(bytes, i + 1) else {
                    return Scan::Unsure;
                };
                let inner = text.get(i + 1..end).unwrap_or_default();
                i = end + 1;
                if key_next {
                    if escaped {
                        return Scan::Unsure;
                    }
                    key_next = false;
                    let at = open.last().map_or(At::Inside, |o| o.at);
                    (pending, child) = match (at, inner) {
                        (At::Top, "kind") => (Some(Slot::Kind), At::Inside),
                        (At::Top, "apiVersion") => (Some(Slot::ApiVersion), At::Inside),
                        (At::Top, "metadata") => (None, At::Metadata),
                        (At::Metadata, "name") => (Some(Slot::Name), At::Inside),
                        (At::Metadata, "namespace") => (Some(Slot::Namespace), At::Inside),
                        _ => (None, At::Inside),
                    };
                    keys.push(inner);
                } else {
                    child = At::Inside;
                    if let Some(slot) = pending.take() {
                        if escaped {
                            return Scan::Unsure;
                        }
                        *head.slot(slot) = Some(inner);
                    }
                }
            }
            b':' | b' ' | b'\t' | b'\n' | b'\r' => i += 1,
            _ => {
                // A number, `true`, `false` or `null`: it ends where punctuation or space does.
                pending = None;
                child = At::Inside;
                let rest = bytes.get(i..).unwrap_or_default();
                let len = rest
                    .iter()
                    .position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                    .unwrap_or(rest.len());
                // Skipping checks a number's syntax, not its range; parsing refuses one that
                // is infinite as an f64 (`1e400`, 400 digits), even in a field no type reads.
                let token = rest.get(..len).unwrap_or_default();
                if b != b't'
                    && b != b'f'
                    && b != b'n'
                    && (len > 64 || token.contains(&b'e') || token.contains(&b'E'))
                {
                    return Scan::Unsure;
                }
                i += len;
            }
        }
    }
    Scan::Clean(head)
}

/// Where the string whose text begins at `from` ends (its closing quote), and whether it holds
/// an escape; `None` for a `\u` escape of a surrogate.
fn string_end(bytes: &[u8], from: usize) -> Option<(usize, bool)> {
    let mut i = from;
    let mut escaped = false;
    loop {
        i = quote_or_backslash(bytes, i)?;
        if bytes.get(i) == Some(&b'"') {
            return Some((i, escaped));
        }
        escaped = true;
        if bytes.get(i + 1) == Some(&b'u') {
            let hex = bytes.get(i + 2..i + 6)?;
            let high = hex.first().map(u8::to_ascii_lowercase);
            let second = hex.get(1).map(u8::to_ascii_lowercase);
            // D800 to DFFF: a surrogate.
            if high == Some(b'd') && matches!(second, Some(b'8'..=b'9' | b'a'..=b'f')) {
                return None;
            }
            i += 6;
        } else {
            i += 2;
        }
    }
}

/// Where the first `"` or `\\` at or after `from` is. Eight bytes at a time: byte by byte,
/// finding the ends of strings was most of the scan.
pub(super) fn quote_or_backslash(bytes: &[u8], from: usize) -> Option<usize> {
    const ONES: u64 = u64::MAX / 255;
    const HIGH: u64 = ONES << 7;
    let mut i = from;
    while let Some(chunk) = bytes.get(i..i + 8) {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let (q, b) = (w ^ (ONES * u64::from(b'"')), w ^ (ONES * u64::from(b'\\')));
        // A byte of `q` or `b` is zero where `w` holds the character; the lowest flagged byte
        // is always a real one (a borrow only flags bytes above it).
        let found = (q.wrapping_sub(ONES) & !q | b.wrapping_sub(ONES) & !b) & HIGH;
        if found != 0 {
            return Some(i + (found.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    Some(
        i + bytes
            .get(i..)?
            .iter()
            .position(|&c| c == b'"' || c == b'\\')?,
    )
}

/// A string of the [`Head`].
#[derive(Clone, Copy)]
enum Slot {
    Kind,
    ApiVersion,
    Name,
    Namespace,
}

impl<'de> Head<'de> {
    fn slot(&mut self, slot: Slot) -> &mut Option<&'de str> {
        match slot {
            Slot::Kind => &mut self.kind,
            Slot::ApiVersion => &mut self.api_version,
            Slot::Name => &mut self.name,
            Slot::Namespace => &mut self.namespace,
        }
    }
}

/// Where a value is in an item, for which of its strings the [`Head`] takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum At {
    Top,
    Metadata,
    Inside,
}

/// The deepest nesting the scan lets through. serde_json refuses a file nested 128 deep, and
/// an item of a list starts two levels down, so an item nested deeper than this may read
/// differently from its text alone than from its file: the file is read through values.
pub(super) const MAX_DEPTH: usize = 100;
