//! Where cluster objects come from.
