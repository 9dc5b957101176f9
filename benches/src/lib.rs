//! Benchmarks live in benches/benches.
