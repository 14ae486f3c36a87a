//! `bench/gpu/verify.sh --lease` on a machine without a GPU: the dry run a GPU lease is
//! prepared with. The report opens with the plan (each part and its limit, and the planned
//! total within the lease's 420 s) before anything is checked, then checks the bundle (what
//! a run needs, within what one call carries) and says each part skipped, in seconds. A
//! bundle that lacks a binary, is over 62 MiB or is missing fails the dry run by name.
//! The bundles here are made in the test (two small files standing in for the binaries):
//! what is checked is the script's own behaviour; `bench/gpu/bundle.sh` checks the real
//! bundle's size as it builds it.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::scratch;

/// A bundle in `dir/bundle` whose binaries archive holds `binaries` (small stand-ins).
fn bundle(dir: &Path, binaries: &[&str]) -> PathBuf {
    let (bins, out) = (dir.join("bins"), dir.join("bundle"));
    std::fs::create_dir_all(&bins).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    for b in binaries {
        std::fs::write(bins.join(b), format!("stand-in for {b}\n")).unwrap();
    }
    let archive = out.join("bins.tar.xz");
    let script = format!("tar -C {:?} -cf - {} | xz -0 > {:?}", bins, binaries.join(" "), archive);
    assert!(Command::new("bash").args(["-c", &script]).status().unwrap().success());
    std::fs::write(out.join("paths"), "repo=/nowhere\nzerotrain=/nowhere/zerotrain\n").unwrap();
    std::fs::write(out.join("commit"), "0123456789abcdef0123456789abcdef01234567\n").unwrap();
    out
}

/// The dry run against `bundle`, with an `nvidia-smi` that finds no GPU first on the path:
/// its exit status and report.
fn dry_run(dir: &Path, bundle: &Path) -> (bool, String) {
    let fake = dir.join("path");
    std::fs::create_dir_all(&fake).unwrap();
    let smi = fake.join("nvidia-smi");
    std::fs::write(&smi, "#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices were found' >&2\nexit 9\n").unwrap();
    let mut mode = std::fs::metadata(&smi).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut mode, 0o755);
    std::fs::set_permissions(&smi, mode).unwrap();
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let path = format!("{}:{}", fake.display(), std::env::var("PATH").unwrap_or_default());
    let status = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/gpu/verify.sh"))
        .arg("--lease")
        .env("PATH", path)
        .env("BUNDLE", bundle)
        .env("OUT", &out)
        .output()
        .expect("bash runs");
    let report = std::fs::read_to_string(out.join("report.md")).unwrap_or_default();
    assert_eq!(report, String::from_utf8_lossy(&status.stdout), "the report is what it printed");
    (status.status.success(), report)
}

#[test]
fn the_lease_dry_run_plans_checks_the_bundle_and_skips_every_part() {
    let dir = scratch("lease-ok");
    let (ok, report) = dry_run(&dir, &bundle(&dir, &["zerotrain", "world"]));
    assert!(ok, "{report}");
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines[0], "# zerotrain GPU lease run", "{report}");
    // The plan: each part with its limit, before the bundle is looked at.
    let plan: Vec<(&str, u64)> = lines
        .iter()
        .take_while(|l| !l.starts_with("planned total"))
        .filter_map(|l| l.strip_prefix("- "))
        .map(|l| {
            let (name, rest) = l.split_once(": ").unwrap();
            (name, rest.split(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("no limit in {l}")))
        })
        .collect();
    let names: Vec<&str> = plan.iter().map(|p| p.0).collect();
    assert_eq!(names, ["ranks", "speed", "pytorch", "profile", "families", "families-pytorch", "rest"]);
    let total: u64 = plan.iter().map(|p| p.1).sum();
    let planned = lines.iter().position(|l| l.starts_with("planned total: ")).expect("a planned total");
    assert!(lines[planned].starts_with(&format!("planned total: {total} s")), "{}", lines[planned]);
    assert!(total <= 420, "{total} s planned");
    let checked = lines.iter().position(|l| l.starts_with("bundle: ")).expect("the bundle checked");
    assert!(planned < checked, "{report}");
    assert!(lines[checked].contains("binaries: world zerotrain"), "{}", lines[checked]);
    for name in names {
        assert!(lines.contains(&format!("- {name}: skipped (no GPU)").as_str()), "{name}: {report}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_lease_bundle_missing_a_binary_or_too_large_or_absent_fails_by_name() {
    let dir = scratch("lease-bad");
    let (ok, report) = dry_run(&dir, &bundle(&dir, &["zerotrain"]));
    assert!(!ok && report.contains("bins.tar.xz holds no world"), "{report}");
    assert!(!report.contains("skipped"), "{report}");
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = scratch("lease-large");
    let out = bundle(&dir, &["zerotrain", "world"]);
    // 63 MiB of apparent size (sparse): over what one call carries beside the repository.
    let big = std::fs::File::create(out.join("tuned.tgz")).unwrap();
    big.set_len(63 * 1024 * 1024).unwrap();
    let (ok, report) = dry_run(&dir, &out);
    assert!(!ok && report.contains("over the 65011712"), "{report}");
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = scratch("lease-absent");
    let (ok, report) = dry_run(&dir, &dir.join("no-bundle"));
    assert!(!ok && report.contains("lacks commit paths bins.tar.xz"), "{report}");
    assert!(report.starts_with("# zerotrain GPU lease run") && report.contains("planned total: "), "{report}");
    std::fs::remove_dir_all(&dir).unwrap();
}
