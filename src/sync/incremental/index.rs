//! Where each origin's applied elements are: per origin, the runs of neighbouring keys it
//! holds in each set, so that a change finds the changed Services' old elements in what they
//! touch instead of walking every applied element.
//!
//! Keys are copied once per run (not per element) into one buffer: an index from Service to
//! every element key cost ~30 ms and 2.7 MB per full sync at 10k Services × 10 endpoints
//! (145k allocations); a port's endpoints are neighbours in key order, so runs are few. A run
//! is a key range, and the applied set may gain other origins' keys inside it later (a
//! hairpin key of another Service, say): every element found is checked against the origin,
//! so a range can only hold more candidates, never hide one of ours (the keys of an unchanged
//! Service are never touched by a change sync).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::ops::Bound;
use std::sync::Arc;

use crate::address_hash::AddressHasher;
use crate::model::{IpFamily, ServicePortName};
use crate::nft::{WireElem, WireTable};

/// A run of neighbouring keys of one origin in one set.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// Index into [`ElementIndex::sets`].
    set: u32,
    /// Offsets of the first and last key in [`ElementIndex::keys`]; both keys are `len` bytes.
    first: u32,
    last: u32,
    len: u32,
}

/// An origin's address (`Arc::as_ptr(..).addr()`): a plain number, so that the index is
/// `Send` with the syncer.
pub(super) type OriginAddr = usize;

/// Garbage tolerated beyond the live keys before compacting. None in unit tests, so that the
/// random incremental-versus-full test compacts all the time.
pub(in crate::sync) const SLACK: usize = if cfg!(test) { 0 } else { 64 << 10 };

type ByOrigin = HashMap<OriginAddr, Vec<Run>, BuildHasherDefault<AddressHasher>>;

/// Runs of keys per origin (by the origin's address, which the baseline's held `Arc`s keep
/// unique).
#[derive(Debug, Default)]
pub(in crate::sync) struct ElementIndex {
    sets: Vec<(IpFamily, String)>,
    /// Per family, set name → index into `sets`.
    set_ids: Vec<(IpFamily, HashMap<String, u32>)>,
    keys: Vec<u8>,
    /// Bytes of `keys` that live runs use; the rest is left by removed runs.
    live: usize,
    runs: ByOrigin,
}

impl ElementIndex {
    /// Starts a run for `origin` at `key` in the set `id`; `false` if the key cannot be held
    /// (offsets past 4 GiB), and then no run may be extended from it.
    fn note(&mut self, id: u32, origin: OriginAddr, key: &[u8]) -> bool {
        let Ok(len) = u32::try_from(key.len()) else {
            return false;
        };
        let Some(at) = self.push_key(key) else {
            return false;
        };
        self.runs.entry(origin).or_default().push(Run {
            set: id,
            first: at,
            last: at,
            len,
        });
        true
    }

    /// Ends `origin`'s last run at `key` (already known to follow the run's first key with no
    /// other element in between).
    fn extend(&mut self, origin: OriginAddr, key: &[u8]) {
        let Some(at) = self.push_key(key) else {
            return;
        };
        if let Some(run) = self.runs.get_mut(&origin).and_then(|r| r.last_mut()) {
            let old = run.last;
            run.last = at;
            if old != run.first {
                // The previous last key is garbage now.
                self.live -= run.len as usize;
            }
        }
    }

    fn set_id(&mut self, family: IpFamily, set: &str) -> u32 {
        let at = match self.set_ids.iter().position(|(f, _)| *f == family) {
            Some(at) => at,
            None => {
                self.set_ids.push((family, HashMap::new()));
                self.set_ids.len() - 1
            }
        };
        let Some((_, ids)) = self.set_ids.get_mut(at) else {
            return u32::MAX;
        };
        if let Some(id) = ids.get(set) {
            return *id;
        }
        let id = u32::try_from(self.sets.len()).unwrap_or(u32::MAX);
        self.sets.push((family, set.to_owned()));
        ids.insert(set.to_owned(), id);
        id
    }

    fn push_key(&mut self, key: &[u8]) -> Option<u32> {
        // Offsets are u32 to keep runs small; 4 GiB of keys is far beyond any table.
        let at = u32::try_from(self.keys.len()).ok()?;
        u32::try_from(self.keys.len() + key.len()).ok()?;
        self.keys.extend_from_slice(key);
        self.live += key.len();
        Some(at)
    }

    fn key(&self, at: u32, len: u32) -> &[u8] {
        let (at, len) = (at as usize, len as usize);
        self.keys.get(at..at + len).unwrap_or_default()
    }

    /// A cursor that indexes the elements of set `name` of `family`'s table as they are
    /// walked in key order ([`SetRuns::push`]), so that the baseline's one walk over the
    /// applied elements also builds the index.
    pub(super) fn set_runs<'k>(&mut self, family: IpFamily, name: &str) -> SetRuns<'_, 'k> {
        let id = self.set_id(family, name);
        SetRuns {
            index: self,
            id,
            prev: 0,
            pending: None,
        }
    }

    /// Indexes elements committed by a change sync: one run per element (a change touches
    /// few, and whether two of them are neighbours in the applied set is not known here).
    pub(super) fn add_elements<'a>(
        &mut self,
        family: IpFamily,
        elements: impl IntoIterator<Item = (&'a str, &'a [u8], &'a WireElem)>,
    ) {
        for (set, key, elem) in elements {
            if let Some(origin) = &elem.origin {
                let id = self.set_id(family, set);
                // A key that cannot be held leaves its element out of the index only while
                // the key buffer is past 4 GiB: never in practice.
                self.note(id, address(origin), key);
            }
        }
        self.compact_if_sparse();
    }

    /// Forgets `origin`'s runs (its Service was rebuilt).
    pub(super) fn remove(&mut self, origin: OriginAddr) {
        for run in self.runs.remove(&origin).into_iter().flatten() {
            self.live -= run.len as usize;
            if run.last != run.first {
                self.live -= run.len as usize;
            }
        }
    }

    /// Calls `found` with every element of `table` (the applied table of `family`) whose
    /// origin is `origin`, with its set's name.
    pub(super) fn elements_of<'t>(
        &self,
        family: IpFamily,
        table: &'t WireTable,
        origin: OriginAddr,
        mut found: impl FnMut(&'t str, &'t [u8], &'t WireElem),
    ) {
        for run in self.runs.get(&origin).into_iter().flatten() {
            let Some((f, name)) = self.sets.get(run.set as usize) else {
                continue;
            };
            if *f != family {
                continue;
            }
            let Some((name, set)) = table.sets.get_key_value(name) else {
                continue;
            };
            let first = self.key(run.first, run.len);
            let last = self.key(run.last, run.len);
            if first > last {
                // Only a corrupt run; `range` would panic on it.
                continue;
            }
            let range = set
                .elements
                .range::<[u8], _>((Bound::Included(first), Bound::Included(last)));
            for (key, elem) in range {
                if elem.origin.as_ref().is_some_and(|o| address(o) == origin) {
                    found(name, key, elem);
                }
            }
        }
    }

    /// Copies the live runs' keys into a new buffer once removed runs left more garbage than
    /// live keys, so that a daemon applying change syncs for days holds what it indexes.
    fn compact_if_sparse(&mut self) {
        if self.keys.len() <= 2 * self.live + SLACK {
            return;
        }
        let mut keys = Vec::with_capacity(self.live);
        for runs in self.runs.values_mut() {
            for run in runs {
                let (first, last, len) = (run.first as usize, run.last as usize, run.len as usize);
                let at = keys.len();
                keys.extend_from_slice(self.keys.get(first..first + len).unwrap_or_default());
                if last == first {
                    run.first = u32::try_from(at).unwrap_or(u32::MAX);
                    run.last = run.first;
                } else {
                    let end = keys.len();
                    keys.extend_from_slice(self.keys.get(last..last + len).unwrap_or_default());
                    run.first = u32::try_from(at).unwrap_or(u32::MAX);
                    run.last = u32::try_from(end).unwrap_or(u32::MAX);
                }
            }
        }
        self.live = keys.len();
        self.keys = keys;
    }

    /// Frees the capacity that growing by doubling left in the keys and runs.
    pub(super) fn shrink_to_fit(&mut self) {
        self.keys.shrink_to_fit();
        for runs in self.runs.values_mut() {
            runs.shrink_to_fit();
        }
    }

    /// Capacity beyond the length of the keys and the runs (see `Baseline::spare_capacity`).
    #[cfg(test)]
    pub(in crate::sync) fn spare_capacity(&self) -> usize {
        let runs: usize = self.runs.values().map(|r| r.capacity() - r.len()).sum();
        self.keys.capacity() - self.keys.len() + runs
    }

    /// Bytes held, for the tests that check compaction.
    #[cfg(test)]
    pub(in crate::sync) fn key_bytes(&self) -> usize {
        self.keys.len()
    }
}

/// Indexes one set's elements in key order (see [`ElementIndex::set_runs`]).
pub(super) struct SetRuns<'i, 'k> {
    index: &'i mut ElementIndex,
    id: u32,
    /// The origin whose run the previous element started or continued (0: none, or a run
    /// that could not be noted).
    prev: OriginAddr,
    /// The last key of `prev`'s run so far, when it is not the run's first.
    pending: Option<&'k [u8]>,
}

impl<'k> SetRuns<'_, 'k> {
    /// The next element in key order: its origin's address (0: built for no Service) and key.
    /// Returns whether `origin` is new to the index.
    pub(super) fn push(&mut self, origin: OriginAddr, key: &'k [u8]) -> bool {
        if origin == self.prev && origin != 0 {
            self.pending = Some(key);
            return false;
        }
        self.end_run();
        if origin == 0 {
            self.prev = 0;
            return false;
        }
        let new = !self.index.runs.contains_key(&origin);
        self.prev = if self.index.note(self.id, origin, key) {
            origin
        } else {
            0
        };
        new
    }

    fn end_run(&mut self) {
        if let Some(last) = self.pending.take() {
            self.index.extend(self.prev, last);
        }
    }
}

impl Drop for SetRuns<'_, '_> {
    fn drop(&mut self) {
        self.end_run();
    }
}

/// The address that identifies `origin` in the index.
pub(super) fn address(origin: &Arc<ServicePortName>) -> OriginAddr {
    Arc::as_ptr(origin).addr()
}
