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
//! is checked, converted to the model and dropped, so memory holds the file's text, the values
//! of at most [`QUEUE`] items waiting to be converted and the converted objects, never the
//! whole tree.
//! kubectl prints `items` before `kind`, so every document whose `items` is an array is read as
//! a list; if its `kind` turns out not to name a list, what its items gave is taken back and
//! the document is parsed again as one object.
//!
//! Two threads: one parses the text into values, the other checks and converts them, in file
//! order, through a short queue. The work splits about 57/43 (`perf`), so reading 10k
//! Services × 10 endpoints from JSON takes ~131 instead of ~161 ms.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1 as core;
use k8s_openapi::api::discovery::v1 as discovery;
use k8s_openapi::api::networking::v1 as networking;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{
    self, DeserializeOwned, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor,
};
use serde_json::{Map, Value};

use super::{Loaded, SourceError};
use crate::model::{self, Rejected, convert};

mod objects;
mod strict;

use objects::*;
use strict::*;

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
    load(|reader| {
        for path in paths {
            let text = read_bounded(path, max_bytes)?;
            reader.path = path;
            reader.ordinal = 0;
            reader.read(&text)?;
        }
        Ok(())
    })
}

/// Reads objects from text as if it were the file `name` (whose extension picks JSON or YAML):
/// what [`load_files`] does after reading a file. For the fuzz target `file_reader` and its
/// corpus test.
#[doc(hidden)]
pub fn load_text(name: &Path, text: &str) -> Result<Loaded, SourceError> {
    load(|reader| {
        reader.path = name;
        reader.read(text)
    })
}

/// How many parsed items may wait for the converting thread.
const QUEUE: usize = 64;

/// Runs `read` on this thread with a [`Reader`] whose items a second thread converts, then
/// merges what they gave.
fn load<'p>(
    read: impl FnOnce(&mut Reader<'p>) -> Result<(), SourceError>,
) -> Result<Loaded, SourceError> {
    std::thread::scope(|scope| {
        let (jobs, queue) = std::sync::mpsc::sync_channel::<Job<'p>>(QUEUE);
        let (done, converted) = std::sync::mpsc::channel();
        scope.spawn(move || {
            let mut entries = Vec::new();
            for job in queue {
                match job {
                    Job::Item(origin, value) => entries.push(Some(read_item(origin, value))),
                    Job::TakeBack(from) => entries.truncate(from),
                }
            }
            let _ = done.send(entries);
        });
        let mut reader = Reader {
            path: Path::new(""),
            ordinal: 0,
            sent: 0,
            jobs,
        };
        let result = read(&mut reader);
        // Ends the converting thread's queue.
        drop(reader);
        result?;
        // Nothing arrives only if the converting thread panicked: the scope then raises that
        // panic as it ends, so this empty list is never used.
        let entries = converted.recv().unwrap_or_default();
        Ok(assemble(entries))
    })
}

/// What the parsing thread hands the converting one, in file order.
enum Job<'p> {
    Item(Origin<'p>, Value),
    /// Drops the entries from this index on: a document read as a list that was not one.
    TakeBack(usize),
}

/// Reads one file as UTF-8 text, failing once it is longer than `max_bytes`.
fn read_bounded(path: &Path, max_bytes: u64) -> Result<String, SourceError> {
    use std::io::Read as _;
    let read_error = |source| SourceError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    // Sized from the file's length when it has one within the bound: grown by doubling, a 13 MB
    // file (10k Services × 10 endpoints) was copied about four times over and its fresh pages
    // faulted in again each time, ~7 % of a `--once` re-apply in `perf`. A device or a pipe
    // reports 0 and grows as before; a file that is longer than it said still stops at the
    // bound.
    let expected = file
        .metadata()
        .ok()
        .map(|m| m.len())
        .filter(|&n| n <= max_bytes)
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(0);
    let mut bytes = Vec::with_capacity(expected.saturating_add(1));
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
    /// How many items have been handed over and not taken back.
    sent: usize,
    jobs: std::sync::mpsc::SyncSender<Job<'p>>,
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
        self.sent += 1;
        // The converting thread stops early only by panicking, which the scope raises.
        let _ = self.jobs.send(Job::Item(origin, value));
    }

    /// Takes back the items handed over from index `from` on.
    fn take_back(&mut self, from: usize) {
        self.sent = from;
        let _ = self.jobs.send(Job::TakeBack(from));
    }
}
