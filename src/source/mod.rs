//! Where cluster objects come from: the results every source hands to the rest of the proxy.
//!
//! A source produces a [`model::ClusterState`] plus reports: objects that failed validation
//! ([`Rejected`]) and objects it deliberately did not use (`ignored`). Only a source that cannot
//! produce anything at all (a file that cannot be read or parsed) fails with [`SourceError`].

pub mod file;
pub mod watch;

use std::path::PathBuf;

use crate::model::{self, Rejected};

pub use file::{load_files, load_files_limited};

/// What a source read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Loaded {
    /// The valid objects nodeproxy uses.
    pub state: model::ClusterState,
    /// Objects that failed validation; they are not in `state`.
    pub rejected: Vec<Rejected>,
    /// Objects read but not used, each with the reason, e.g.
    /// `ConfigMap kube-system/foo: kind not used by nodeproxy`.
    pub ignored: Vec<String>,
    /// Notes worth a warning: an object defined twice, whose earlier definition is replaced.
    pub replaced: Vec<String>,
    /// Parts left out of objects that are used: an externalIP, load-balancer IP or endpoint at
    /// a special address (loopback, link-local, …).
    pub dropped: Vec<Rejected>,
}

/// A source that produced nothing usable. The binary exits with status 2 on it.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("{}: cannot read", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{}: larger than {max_bytes} bytes (--max-input-size): not read further",
        path.display()
    )]
    TooLarge { path: PathBuf, max_bytes: u64 },
    /// `line` and `column` are 1-based; 0 when the parser did not say where.
    /// `message` is the parser's, which may quote the input: shown through
    /// [`model::printable`].
    #[error(
        "{}{}: cannot parse as {format}: {}",
        path.display(),
        position(*line, *column),
        model::printable(message)
    )]
    Parse {
        path: PathBuf,
        format: &'static str,
        line: usize,
        column: usize,
        message: String,
    },
}

/// `:line:column` in the compiler convention, so that editors and terminals can jump to it.
fn position(line: usize, column: usize) -> String {
    match (line, column) {
        (0, _) => String::new(),
        (l, 0) => format!(":{l}"),
        (l, c) => format!(":{l}:{c}"),
    }
}

#[cfg(test)]
mod tests;
