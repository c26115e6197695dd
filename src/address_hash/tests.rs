//! Unit tests for the address hasher.
use std::collections::HashSet;
use std::hash::{Hash, Hasher};

use super::*;

fn hash(key: impl Hash) -> u64 {
    let mut h = AddressHasher::default();
    key.hash(&mut h);
    h.finish()
}

#[test]
fn pairs_of_addresses_hash_by_both() {
    // Addresses as jemalloc hands them out: aligned, close together.
    let addresses: Vec<usize> = (0..100).map(|i| 0x7f00_1234_5000 + 16 * i).collect();
    let mut seen = HashSet::new();
    for &a in &addresses {
        for &b in &addresses {
            assert!(seen.insert(hash((a, b))), "({a:#x}, {b:#x}) collides");
        }
        // "None" (0) in either place.
        assert!(seen.insert(hash((a, 0usize))));
        assert!(seen.insert(hash((0usize, a))));
    }
    let singles: HashSet<u64> = addresses.iter().map(|&a| hash(a)).collect();
    assert_eq!(singles.len(), addresses.len());
}
