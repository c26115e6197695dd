//! Benchmarks of the pure ruleset pipeline.
fn main() {}
