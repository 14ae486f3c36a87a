//! A Burn program that depends on `zerotrain = { default-features = false }` gets the
//! library alone: this builds a scratch crate outside the workspace whose `main.rs` is
//! `examples/minimal.rs`, runs it, and checks its dependency tree has no application crate.
//!
//! The scratch crate shares this build's target directory and copies the workspace's
//! profiles and lock file, so Burn is not compiled a second time.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Crates only the application (`cli` feature) may bring in.
const APPLICATION_ONLY: &[&str] = &["clap", "indicatif", "plotters", "ctrlc", "anyhow"];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The target directory this test binary was built in (`<target>/debug/deps/<exe>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.ancestors().nth(3).expect("<target>/<profile>/deps/<exe>").to_path_buf()
}

/// Writes the scratch crate into `dir`: the example as its program, `zerotrain` without
/// default features, Burn as the workspace pins it, and the workspace's build profiles.
fn write_scratch_crate(dir: &Path) {
    let manifest = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    let burn = manifest.lines().find(|l| l.starts_with("burn = ")).expect("the workspace pins burn");
    let profiles = &manifest[manifest.find("\n[profile.").expect("the workspace has build profiles")..];
    let toml = format!(
        "[package]\nname = \"scratch\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
         [workspace]\n\n[dependencies]\nzerotrain = {{ path = {:?}, default-features = false }}\n{burn}\n{profiles}",
        repo().display().to_string()
    );
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(dir.join("Cargo.toml"), toml).unwrap();
    std::fs::copy(repo().join("Cargo.lock"), dir.join("Cargo.lock")).unwrap();
    std::fs::copy(repo().join("examples/minimal.rs"), dir.join("src/main.rs")).unwrap();
}

fn cargo(dir: &Path, args: &[&str]) -> std::process::Output {
    let out = Command::new(env!("CARGO"))
        .args(args)
        .args(["--offline", "--quiet"])
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target_dir())
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo {args:?} in {}:\n{}\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn a_crate_depending_on_the_library_alone_builds_runs_and_pulls_no_application_crate() {
    let dir = std::env::temp_dir().join(format!("zerotrain-scratch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_scratch_crate(&dir);

    let tree = cargo(&dir, &["tree", "--edges", "normal", "--prefix", "none", "--format", "{p}"]);
    let tree = String::from_utf8_lossy(&tree.stdout);
    let crates: Vec<&str> = tree.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert!(crates.contains(&"zerotrain") && crates.contains(&"burn"), "{tree}");
    let found: Vec<&&str> = APPLICATION_ONLY.iter().filter(|name| crates.contains(name)).collect();
    assert!(found.is_empty(), "the library alone depends on {found:?}:\n{tree}");

    let run = cargo(&dir, &["run"]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    // "300 steps on 2 ranks at ZeRO stage 3 (...): loss A -> B", and B well below A.
    let line = stdout.lines().find(|l| l.contains("steps on 2 ranks")).unwrap_or_else(|| panic!("{stdout}"));
    let losses: Vec<f32> = line.rsplit(": loss ").next().unwrap().split(" -> ").map(|v| v.parse().unwrap()).collect();
    assert!(losses[1] < losses[0] / 4.0, "{line}");
    // The model it saved through `zerotrain::Precision` alone: 2 bytes a value.
    let model = stdout.lines().find_map(|l| l.strip_prefix("model: ")).unwrap_or_else(|| panic!("{stdout}"));
    let bytes = std::fs::read(model).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert!(String::from_utf8_lossy(&bytes[8..8 + header]).contains("BF16"), "{model}");
    std::fs::remove_file(model).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
