//! Fuzz target: sequences of cluster states synced to the in-memory kernel. Applying the diff
//! from one state to the next yields what a fresh kernel gets, and the incremental path equals
//! the full path (`common/sync_diff.rs` says exactly what is checked).

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "common/sync_diff.rs"]
mod sync_diff;

fuzz_target!(|data: &[u8]| {
    sync_diff::check(data);
});
