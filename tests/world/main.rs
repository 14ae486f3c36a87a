//! Whole-world tests: several ranks train together and are checked against references.
//! One test binary, so Burn is linked once.

mod api;
mod buffers;
mod checkpoint;
mod comm;
mod common;
mod equivalence;
mod failure;
#[cfg(feature = "wgpu")]
mod gpu;
mod handles;
mod memory;
mod mixed;
mod overflow;
mod pipeline;
mod units;

/// The README's minimal example, compiled and run as part of the suite.
#[path = "../../examples/minimal.rs"]
#[allow(dead_code)] // its `main` is the example's entry point, unused here
mod minimal_example;

#[test]
fn the_minimal_example_trains() {
    let (first, last) = minimal_example::train();
    assert!(last < first / 5.0, "loss {first} -> {last}");
}
