//! The sizes of our hash sets, decided against the table the kernel holds.
//!
//! Lowering is pure and gives each set the size a fresh kernel gets
//! ([`crate::ruleset::Set::fresh_size`]). Whether a set keeps the size the kernel holds it with
//! (hysteresis, [`crate::ruleset::hash_set_size`]) needs that table, which only the sync paths
//! have (read back, or last applied): so the decision is here, applied by each full path between
//! getting that table and diffing. A changed size is a changed definition, which the diff turns
//! into a recreated set with its elements and the rules that look it up (`recreate_sets`); the
//! change sync keeps every size and goes the full path when one would change
//! (`sync/incremental.rs`).

use super::WireTable;
use crate::ruleset::hash_set_size;

/// Gives each hash set of `want` its size, given `have`, the table the kernel holds (`None`
/// when it holds none).
pub fn size_sets(want: &mut WireTable, have: Option<&WireTable>) {
    for (name, set) in &mut want.sets {
        if !set.is_plain_hash() {
            continue;
        }
        let held = have.and_then(|h| h.sets.get(name)).and_then(|s| s.size);
        set.size = hash_set_size(set.elements.len(), held);
    }
}
