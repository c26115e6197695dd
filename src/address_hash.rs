//! A hasher for addresses of this process's own allocations: the keys of the caches that share
//! an element's origin or comment, or an endpoint's locality, by pointer.

/// Hashes addresses of this process's own allocations with a multiplication each: such
/// addresses are distinct and no input's to choose, and SipHash per element was a visible part
/// of a full sync (the daemon's element index), of lowering (comments) and of reading
/// EndpointSlices (`model::NameTable`'s pairs of names).
#[derive(Default)]
pub struct AddressHasher(u64);

impl std::hash::Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    // Mixed into what came before, for keys of more than one address; a single address (the
    // state starts at 0) hashes as it always did.
    fn write_usize(&mut self, n: usize) {
        self.0 = (self.0 ^ n as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .rotate_left(26);
    }
}

#[cfg(test)]
mod tests;
