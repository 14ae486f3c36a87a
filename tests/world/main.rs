//! Whole-world tests: several ranks train together and are checked against references.
//! One test binary, so Burn is linked once.

mod api;
mod common;
mod equivalence;
mod failure;
mod memory;
