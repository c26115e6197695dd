//! `--from-file`: reads Services, EndpointSlices and Nodes from YAML or JSON files as
//! `kubectl get services,endpointslices,nodes -A -o yaml` (or `-o json`) prints them.
//!
//! A file is a `List` with `items`, several YAML documents (each of which may be a `List`), a
//! stream of JSON values, or a single object. A syntax error is fatal, since nothing after it
//! can be trusted; otherwise each object is checked on its own and either used, ignored with a
//! reason, or rejected with the field that is wrong, so that one bad object never hides the
//! others.
//!
//! Reading streams: the `items` of a list are parsed one at a time into a generic value (in a
//! JSON file, an item of a kind nodeproxy reads is kept as its text instead: [`raw`]), which
//! is checked, converted to the model and dropped, so memory holds the file's text, at most
//! [`QUEUE`] items waiting to be converted and the converted objects, never the whole tree.
//! kubectl prints `items` before `kind`, so every document whose `items` is an array is read as
//! a list; if its `kind` turns out not to name a list, what its items gave is taken back and
//! the document is parsed again as one object.
//!
//! Two threads: one parses the text into items, the other checks and converts them, through a
//! short queue; when the queue is full the parsing thread converts the item itself, and the
//! two parts are merged in file order at the end. Reading 10k Services × 10 endpoints from
//! JSON took ~161 ms on one thread, ~131 on two through values, ~103 from the items' text with
//! the work shared (medians of ten `--once` re-applies, docs/performance.md).

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
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::{Loaded, SourceError};
use crate::model::{self, NameTable, Rejected, convert};

mod objects;
mod raw;
mod slice;
mod strict;

use objects::*;
use raw::*;
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
    load(true, |reader| {
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
    load(true, |reader| {
        reader.path = name;
        reader.read(text)
    })
}

/// [`load_text`] with every item of a JSON list read through a generic value, as YAML's are:
/// what the items read straight from their text ([`raw`]) must equal, for the tests and the
/// fuzz target `file_reader` to compare.
#[doc(hidden)]
pub fn load_text_through_values(name: &Path, text: &str) -> Result<Loaded, SourceError> {
    load(false, |reader| {
        reader.path = name;
        reader.read(text)
    })
}

/// How many parsed items may wait for the converting thread.
const QUEUE: usize = 64;

/// Runs `read` on this thread with a [`Reader`] whose items a second thread converts (this one
/// converting those that find the queue full), then merges what they gave in file order.
fn load<'p>(
    raw_items: bool,
    read: impl FnOnce(&mut Reader<'p>) -> Result<(), SourceError>,
) -> Result<Loaded, SourceError> {
    std::thread::scope(|scope| {
        let (jobs, queue) = std::sync::mpsc::sync_channel::<(u64, Job<'p>)>(QUEUE);
        let (done, converted) = std::sync::mpsc::channel();
        scope.spawn(move || {
            let mut names = NameTable::default();
            let entries: Vec<_> = queue
                .into_iter()
                .map(|(seq, job)| (seq, job.run(&mut names)))
                .collect();
            let _ = done.send(entries);
        });
        let mut reader = Reader {
            path: Path::new(""),
            ordinal: 0,
            sent: 0,
            raw_items,
            raw: false,
            seq: 0,
            own: Vec::new(),
            names: NameTable::default(),
            jobs,
        };
        let result = read(&mut reader);
        let Reader { own, jobs, .. } = reader;
        // Ends the converting thread's queue.
        drop(jobs);
        result?;
        // Nothing arrives only if the converting thread panicked: the scope then raises that
        // panic as it ends, so this empty list is never used.
        let theirs = converted.recv().unwrap_or_default();
        Ok(assemble(in_file_order(own, theirs)))
    })
}

/// What each thread's part gave, in the order the jobs were handed out (their sequence
/// numbers, in increasing order in each list): the entries, with what was taken back removed.
fn in_file_order<E>(own: Vec<(u64, Done<E>)>, theirs: Vec<(u64, E)>) -> Vec<Option<E>> {
    let mut entries = Vec::with_capacity(own.len() + theirs.len());
    let mut theirs = theirs.into_iter().peekable();
    for (seq, done) in own {
        while let Some((_, entry)) = theirs.next_if(|(s, _)| *s < seq) {
            entries.push(Some(entry));
        }
        match done {
            Done::Entry(entry) => entries.push(Some(entry)),
            Done::TakeBack(from) => entries.truncate(from),
        }
    }
    entries.extend(theirs.map(|(_, entry)| Some(entry)));
    entries
}

/// An object to check and convert, in file order.
enum Job<'p> {
    Item(Origin<'p>, Value),
    /// An item's text, checked, of a kind nodeproxy reads, with the name its metadata gives.
    Raw(Origin<'p>, Box<RawValue>, Kind, Option<String>),
}

impl<'p> Job<'p> {
    fn run(self, names: &mut NameTable) -> Entry<'p> {
        match self {
            Job::Item(origin, value) => read_item(origin, value, names),
            Job::Raw(origin, raw, kind, name) => read_raw(origin, &raw, kind, name, names),
        }
    }
}

/// What the parsing thread did itself, in file order.
enum Done<E> {
    /// A job it converted because the queue was full.
    Entry(E),
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
    /// Whether JSON list items may be read straight from their text ([`raw`]).
    raw_items: bool,
    /// Whether the current file's list items are.
    raw: bool,
    /// The next job's sequence number.
    seq: u64,
    /// What this thread did itself, with sequence numbers.
    own: Vec<(u64, Done<Entry<'p>>)>,
    /// The shared nodes and zones of the endpoints this thread converts (the converting thread
    /// has its own).
    names: NameTable,
    jobs: std::sync::mpsc::SyncSender<(u64, Job<'p>)>,
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
        if !is_json {
            return self.read_yaml(text);
        }
        let (first_sent, first_ordinal) = (self.sent, self.ordinal);
        self.raw = self.raw_items;
        let read = self.read_json(text);
        if !std::mem::replace(&mut self.raw, false) || read.is_ok() {
            return read;
        }
        // An error, or an item whose check failed: read through values, the error and its
        // position are exactly what that reading reports (skipping an item into its text
        // words some syntax errors differently).
        self.take_back(first_sent);
        self.ordinal = first_ordinal;
        self.read_json(text)
    }

    /// Reads the top-level JSON documents of one file.
    fn read_json(&mut self, text: &str) -> Result<(), SourceError> {
        let mut again = Reparser::new(text, true);
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
        Ok(())
    }

    /// Reads the YAML documents of one file.
    fn read_yaml(&mut self, text: &str) -> Result<(), SourceError> {
        let mut again = Reparser::new(text, false);
        for (index, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
            let doc = Shape::Document(self)
                .deserialize(doc)
                .map_err(|e| yaml_error(self.path, &e))?;
            self.finish(doc, index, &mut again)?;
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
        let origin = self.next_origin();
        self.send(Job::Item(origin, value));
    }

    /// Takes in one list item's text ([`raw`]): handed over as text when its scan is clean and
    /// it is of a kind nodeproxy reads, as a value otherwise. `false` when the file should be
    /// read again through values: a key repeated, or an item that may read differently alone
    /// than in its file.
    fn raw_item(&mut self, raw: Box<RawValue>) -> bool {
        let fast = match check(&raw) {
            Scan::Repeated => return false,
            Scan::Clean(head) => head
                .kind()
                .map(|kind| (kind, head.name(kind.cluster_scoped()))),
            Scan::Unsure => None,
        };
        if let Some((kind, name)) = fast {
            let origin = self.next_origin();
            self.send(Job::Raw(origin, raw, kind, name));
            return true;
        }
        match serde_json::from_str::<Strict>(raw.get()) {
            Ok(Strict(value)) if depth(&value) <= MAX_DEPTH => {
                flatten(value, &mut |v| self.item(v));
                true
            }
            _ => false,
        }
    }

    /// Where the next object of the current file is.
    fn next_origin(&mut self) -> Origin<'p> {
        self.ordinal += 1;
        Origin {
            path: self.path,
            ordinal: self.ordinal,
        }
    }

    /// Hands `job` to the converting thread, or converts it here when the queue is full: the
    /// thread that is ahead takes its share of the other's work.
    fn send(&mut self, job: Job<'p>) {
        self.sent += 1;
        let seq = self.next_seq();
        match self.jobs.try_send((seq, job)) {
            Ok(()) => {}
            Err(std::sync::mpsc::TrySendError::Full((seq, job))) => {
                self.own.push((seq, Done::Entry(job.run(&mut self.names))));
            }
            // The converting thread stops early only by panicking, which the scope raises.
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {}
        }
    }

    fn next_seq(&mut self) -> u64 {
        let seq = self.seq;
        self.seq += 1;
        seq
    }

    /// Takes back the items handed over from index `from` on.
    fn take_back(&mut self, from: usize) {
        self.sent = from;
        let seq = self.next_seq();
        self.own.push((seq, Done::TakeBack(from)));
    }
}

#[cfg(test)]
mod tests;
