//! Unit tests of lowering, diff and the fake kernel.
