//! Whole-world tests: several ranks train together and are checked against references.
//! One test binary, so Burn is linked once.

mod api;
mod buffers;
mod checkpoint;
mod comm;
mod common;
mod dropout;
mod equivalence;
mod failure;
mod frozen;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu;
mod handles;
mod init;
mod memory;
mod mixed;
mod offload;
mod overflow;
mod pipeline;
mod qlora;
mod replicas;
mod tiers;
mod torn;
mod units;

/// The README's minimal example, compiled and run as part of the suite.
#[path = "../../examples/minimal.rs"]
#[allow(dead_code)] // its `main` is the example's entry point, unused here
mod minimal_example;

#[test]
fn the_minimal_example_trains() {
    let file = std::env::temp_dir().join(format!("zerotrain-minimal-test-{}.safetensors", std::process::id()));
    let (first, last) = minimal_example::train(&file);
    assert!(last < first / 5.0, "loss {first} -> {last}");
    assert!(std::fs::metadata(&file).unwrap().len() > 0);
    std::fs::remove_file(&file).unwrap();
}

/// A library program that resolved its config without `detect_mpirun` (the minimal
/// example) is stopped by `launch` inside a 3-process mpirun job instead of training 3
/// independent copies. This test binary runs the example again as its own child, with
/// mpirun's environment (so the program checked is the one this build compiled).
#[test]
fn the_minimal_example_refuses_a_plan_made_without_mpirun_inside_an_mpirun_job() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "minimal_example_under_mpirun_child", "--nocapture"])
        .env("OMPI_COMM_WORLD_RANK", "0")
        .env("OMPI_COMM_WORLD_SIZE", "3")
        .output()
        .unwrap();
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("mpirun started 3 processes but the plan was resolved for 2 ranks"), "{all}");
}

#[test]
#[ignore = "the child process of the_minimal_example_refuses_a_plan_made_without_mpirun_inside_an_mpirun_job"]
fn minimal_example_under_mpirun_child() {
    // Refused before it trains: nothing is written.
    minimal_example::train(&std::env::temp_dir().join("zerotrain-minimal-never-written.safetensors"));
}
