//! Whole-checkpoint tests: corruption anywhere is caught and names its file.
#![allow(clippy::single_range_in_vec_init, reason = "a rank's list of flat ranges often has one")]

use std::path::{Path, PathBuf};

use zerotrain_precision::Precision;

use crate::*;

mod consolidate;

fn temp_root(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!("zt-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    root
}

/// A 2-shard checkpoint of `elems` elements with a master and one optimizer tensor whose
/// values are their flat index (and minus it).
fn write_sample(root: &Path, tag: &str, step: u64, elems: u64) -> Checkpoint {
    let half = elems / 2;
    write_ranges(root, tag, step, elems, &[vec![0..half], vec![half..elems]])
}

/// Like [`write_sample`], rank `r` writing the flat ranges `ranges[r]` (in that order).
fn write_ranges(root: &Path, tag: &str, step: u64, elems: u64, ranges: &[Vec<std::ops::Range<u64>>]) -> Checkpoint {
    let partial = prepare(root, tag).unwrap();
    for (rank, ranges) in ranges.iter().enumerate() {
        let master: Vec<f32> = ranges.iter().flat_map(|r| r.clone()).map(|i| i as f32).collect();
        let optim: Vec<f32> = master.iter().map(|v| -v).collect();
        write_shard(&partial, rank, ranges, &[("master", &master), ("optim.momentum.moment_1", &optim)]).unwrap();
    }
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        tag: tag.into(),
        global_step: step,
        world_size: ranges.len(),
        stage: 2,
        precision: "fp32".into(),
        layout: vec![
            LayoutEntry { path: "big.weight".into(), shape: vec![elems - 10], offset: 0 },
            LayoutEntry { path: "big.bias".into(), shape: vec![2, 5], offset: elems - 10 },
        ],
        tensors: vec!["master".into(), "optim.momentum.moment_1".into()],
        files: vec![],
        buffers: None,
        engine: serde_json::json!({}),
        config: serde_json::json!({}),
        client_state: serde_json::json!({"position": step}),
    };
    commit(root, manifest, None).unwrap();
    Checkpoint::open(root, Some(tag)).unwrap()
}

#[test]
fn ranges_across_shards_read_back_exactly() {
    let root = temp_root("ranges");
    let ckpt = write_sample(&root, "global_step1", 1, 700_000);
    for range in [0..5, 349_998..350_003, 699_990..700_000, 123_456..654_321] {
        let mut out = vec![0.0; (range.end - range.start) as usize];
        ckpt.read_range("optim.momentum.moment_1", range.clone(), &mut out).unwrap();
        assert!(out.iter().zip(range.clone()).all(|(v, i)| *v == -(i as f32)), "{range:?}");
    }
    assert!(ckpt.read_range("master", 699_999..700_001, &mut [0.0; 2]).is_err());
    assert!(ckpt.read_range("optim.nope", 0..1, &mut [0.0]).is_err());
    std::fs::remove_dir_all(&root).unwrap();
}

/// A rank's shards of several units are several ranges of the flat order, in any order:
/// reads across them, and across files, give every element back.
#[test]
fn files_of_several_interleaved_ranges_read_back_exactly() {
    let root = temp_root("interleaved");
    let ranges = [vec![600..1000, 0..100], vec![100..350, 1000..1200], vec![350..600]];
    let ckpt = write_ranges(&root, "global_step1", 1, 1200, &ranges);
    assert_eq!(ckpt.manifest().files[0].ranges, vec![[600, 1000], [0, 100]]);
    for range in [0..1200, 90..110, 599..601, 999..1001, 1199..1200, 350..351] {
        let mut out = vec![0.0; (range.end - range.start) as usize];
        ckpt.read_range("master", range.clone(), &mut out).unwrap();
        assert!(out.iter().zip(range.clone()).all(|(v, i)| *v == i as f32), "{range:?}");
    }
    ckpt.verify().unwrap();
    std::fs::remove_dir_all(&root).unwrap();
}

/// A tensor-parallel rank's slice is many short ranges alternating between files: read
/// range by range (1,000 elements at a time, in order, each tensor in turn, the way
/// `consolidate` and a resume read), every byte comes back and each file is read once,
/// however many ranges come from it (each range opened and reread its file's header and
/// block before: 2 MiB per range, 800 MB here).
#[test]
fn many_short_ranges_read_each_file_once() {
    let root = temp_root("short-ranges");
    let (elems, run) = (400_000u64, 1000u64);
    let ranks: [Vec<_>; 2] =
        [0, 1].map(|r| (0..elems / run).filter(|i| i % 2 == r).map(|i| i * run..(i + 1) * run).collect());
    let ckpt = write_ranges(&root, "global_step1", 1, elems, &ranks);
    let mut out = vec![0.0; run as usize];
    for (tensor, sign) in [("master", 1.0), ("optim.momentum.moment_1", -1.0)] {
        for start in (0..elems).step_by(run as usize) {
            ckpt.read_range(tensor, start..start + run, &mut out).unwrap();
            assert!(out.iter().zip(start..).all(|(v, i)| *v == sign * i as f32), "{tensor} at {start}");
        }
    }
    let files: u64 = ckpt.manifest().files.iter().map(|f| f.size).sum();
    assert!(ckpt.bytes_read() <= files, "{} bytes read from {files} bytes of files", ckpt.bytes_read());
    std::fs::remove_dir_all(&root).unwrap();
}

/// A manifest of format version 1 (each file one range, `start` and `end`) still opens.
#[test]
fn format_version_1_manifests_still_open() {
    let root = temp_root("v1");
    let ckpt = write_sample(&root, "global_step1", 1, 1000);
    let mut json: serde_json::Value = serde_json::to_value(ckpt.manifest()).unwrap();
    json["format_version"] = 1.into();
    for file in json["files"].as_array_mut().unwrap() {
        let [start, end] = [file["ranges"][0][0].clone(), file["ranges"][0][1].clone()];
        let obj = file.as_object_mut().unwrap();
        obj.remove("ranges");
        obj.insert("start".into(), start);
        obj.insert("end".into(), end);
    }
    let v1: Manifest = serde_json::from_value(json).unwrap();
    std::fs::write(ckpt.dir().join("manifest.json"), v1.to_bytes().unwrap()).unwrap();
    let reopened = Checkpoint::open(&root, None).unwrap();
    assert_eq!(reopened.manifest().format_version, 1);
    let mut out = vec![0.0; 20];
    reopened.read_range("master", 490..510, &mut out).unwrap();
    assert_eq!(out, (490..510).map(|i| i as f32).collect::<Vec<_>>());
    // A file record with both forms, or neither, is refused.
    let fields = r#""name":"rank0.safetensors","rank":0,"size":8,"block_bytes":4096,"block_crc32":[0]"#;
    for bad in [format!(r#"{{{fields},"start":0,"end":4,"ranges":[[0,4]]}}"#), format!("{{{fields}}}")] {
        let err = serde_json::from_str::<ShardFile>(&bad).unwrap_err().to_string();
        assert!(err.contains("either `ranges` or `start` and `end`"), "{err}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn every_sampled_byte_flip_and_truncation_is_detected_and_names_the_file() {
    let root = temp_root("flips");
    // 2 x 2 x 350k x 4 bytes: each shard spans three checksum blocks.
    let ckpt = write_sample(&root, "global_step1", 1, 700_000);
    let mut tried = 0;
    for name in ["rank0.safetensors", "rank1.safetensors", "manifest.json"] {
        let path = ckpt.dir().join(name);
        let original = std::fs::read(&path).unwrap();
        let positions: Vec<usize> =
            (0..original.len()).step_by(original.len() / 100 + 1).chain([original.len() - 1]).collect();
        for &pos in &positions {
            let mut bad = original.clone();
            bad[pos] ^= 0x10;
            std::fs::write(&path, &bad).unwrap();
            let err = Checkpoint::open(&root, Some("global_step1")).and_then(|c| c.verify()).unwrap_err().to_string();
            assert!(err.contains(name), "flip at {pos} of {name}: {err}");
            tried += 1;
        }
        for len in [0, original.len() / 2, original.len() - 1] {
            std::fs::write(&path, &original[..len]).unwrap();
            let err = Checkpoint::open(&root, Some("global_step1")).and_then(|c| c.verify()).unwrap_err().to_string();
            assert!(err.contains(name), "truncation to {len} of {name}: {err}");
            tried += 1;
        }
        std::fs::write(&path, &original).unwrap();
    }
    assert!(tried >= 300, "{tried}");
    Checkpoint::open(&root, None).unwrap().verify().unwrap();
    std::fs::remove_file(ckpt.dir().join("rank1.safetensors")).unwrap();
    let err = Checkpoint::open(&root, None).unwrap().verify().unwrap_err().to_string();
    assert!(err.contains("rank1.safetensors") && err.contains("missing"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn tags_are_never_overwritten_and_retention_keeps_the_newest() {
    let root = temp_root("retention");
    write_sample(&root, "global_step1", 1, 100);
    assert!(matches!(prepare(&root, "global_step1"), Err(CheckpointError::Exists { .. })));
    // A complete checkpoint that `latest` does not name (an interrupted save's) is kept aside.
    std::fs::write(root.join(LATEST), "elsewhere").unwrap();
    let partial = prepare(&root, "global_step1").unwrap();
    assert!(partial.exists());
    let aside: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("global_step1.orphaned-"))
        .collect();
    assert_eq!(aside.len(), 1, "the orphan is kept, not deleted");
    std::fs::remove_dir_all(root.join(&aside[0])).unwrap();
    std::fs::remove_dir_all(&partial).unwrap();
    std::fs::write(root.join(LATEST), "global_step1").unwrap();
    assert!(matches!(Checkpoint::open(&root, Some("../global_step1")), Err(CheckpointError::InvalidTag { .. })));
    write_sample(&root, "global_step2", 2, 100);
    let partial = prepare(&root, "global_step3").unwrap();
    write_shard(&partial, 0, &[0..100], &[("master", &[0.0; 100][..])]).unwrap();
    let mut m = Checkpoint::open(&root, None).unwrap().manifest().clone();
    (m.tag, m.global_step, m.tensors) = ("global_step3".into(), 3, vec!["master".into()]);
    commit(&root, m, Some(2)).unwrap();
    let mut tags: Vec<String> = list(&root).unwrap().into_iter().map(|(_, t)| t).collect();
    tags.sort();
    assert_eq!(tags, ["global_step2", "global_step3"]);
    assert_eq!(Checkpoint::open(&root, None).unwrap().manifest().tag, "global_step3");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Regression: two interrupted saves of one tag within a second collided on the orphan's
/// name, and the next save failed with "Directory not empty" until the clock ticked.
#[test]
fn orphans_of_one_tag_get_distinct_names_within_one_second() {
    let root = temp_root("orphans");
    for _ in 0..3 {
        std::fs::create_dir_all(root.join("global_step1")).unwrap();
        std::fs::write(root.join("global_step1/manifest.json"), "left by a killed save").unwrap();
        let partial = prepare(&root, "global_step1").unwrap();
        std::fs::remove_dir(&partial).unwrap();
    }
    let orphans = std::fs::read_dir(&root)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("global_step1.orphaned-"))
        .count();
    assert_eq!(orphans, 3, "each orphan kept under its own name");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Regression: a kill during retention (or a failed save) left a full `<tag>.partial`
/// directory forever.
#[test]
fn the_next_save_removes_what_killed_saves_and_retention_left() {
    let root = temp_root("leftovers");
    write_sample(&root, "global_step1", 1, 100);
    for dir in ["global_step2.partial", "global_step0.deleting"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
        std::fs::write(root.join(dir).join("rank0.safetensors"), vec![0u8; 4096]).unwrap();
    }
    std::fs::write(root.join("latest.partial"), "global_step2").unwrap();
    let partial = prepare(&root, "global_step3").unwrap();
    let mut names: Vec<String> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["global_step1", "global_step3.partial", "latest"]);
    assert!(partial.ends_with("global_step3.partial"));
    Checkpoint::open(&root, None).unwrap().verify().unwrap();
    std::fs::remove_dir_all(&root).unwrap();
}
