//! Helpers for the black-box tests (most live in `tests/common/mod.rs`)
//! and the benchmark binaries.

pub mod envoy;
pub mod sim_cache;
