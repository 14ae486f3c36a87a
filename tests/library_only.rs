//! A Burn program that depends on `zerotrain` gets the library alone: this builds a scratch
//! crate outside the workspace whose `main.rs` is `examples/minimal.rs`, runs it, and checks
//! its dependency tree has no application crate. A program that depends on
//! `zerotrain-models` (Hugging Face's families) gets no command-line crate either.
//!
//! The scratch crate shares this build's target directory and copies the workspace's
//! profiles and lock file, so Burn is not compiled a second time.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Crates only the application (`zerotrain-cli`) may bring in.
const APPLICATION_ONLY: &[&str] = &["clap", "indicatif", "plotters", "ctrlc", "anyhow"];

/// Of those, the crates of the command line alone: `zerotrain-models` may use `anyhow`.
const COMMAND_LINE_ONLY: &[&str] = &["clap", "indicatif", "plotters", "ctrlc"];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The target directory this test binary was built in (`<target>/debug/deps/<exe>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.ancestors().nth(3).expect("<target>/<profile>/deps/<exe>").to_path_buf()
}

/// Writes the scratch crate into `dir`: the example as its program, `zerotrain` with its
/// default features, Burn as the workspace pins it, and the workspace's build profiles.
fn write_scratch_crate(dir: &Path) {
    let manifest = std::fs::read_to_string(repo().join("Cargo.toml")).unwrap();
    let burn = manifest.lines().find(|l| l.starts_with("burn = ")).expect("the workspace pins burn");
    let profiles = &manifest[manifest.find("\n[profile.").expect("the workspace has build profiles")..];
    let toml = format!(
        "[package]\nname = \"scratch\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
         [workspace]\n\n[dependencies]\nzerotrain = {{ path = {:?} }}\n{burn}\n{profiles}",
        repo().join("zerotrain").display().to_string()
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

/// The crates a build of `package` alone compiles (`cargo tree -p`, features as that build
/// resolves them), read from the workspace without building anything.
fn tree_of(package: &str) -> Vec<String> {
    let out = cargo(repo(), &["tree", "-p", package, "--edges", "normal", "--prefix", "none", "--format", "{p}"]);
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.split_whitespace().next()).map(String::from).collect()
}

#[test]
fn the_models_crate_pulls_no_command_line_crate() {
    let crates = tree_of("zerotrain-models");
    assert!(["zerotrain", "tokenizers", "memmap2"].iter().all(|c| crates.iter().any(|k| k == c)), "{crates:?}");
    let found: Vec<_> = COMMAND_LINE_ONLY.iter().filter(|name| crates.iter().any(|c| c == *name)).collect();
    assert!(found.is_empty(), "zerotrain-models depends on {found:?}");
    // And the command's own crates are the command's: the tree above is not vacuous.
    let command = tree_of("zerotrain-cli");
    assert!(COMMAND_LINE_ONLY.iter().all(|name| command.iter().any(|c| c == name)), "{command:?}");
}
