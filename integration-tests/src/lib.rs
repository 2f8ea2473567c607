//! Helpers for the black-box tests: see `tests/common/mod.rs`.
