//! Integrity benchmarks (filled in below).

fn main() {}
