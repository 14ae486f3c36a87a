use super::*;
use zerotrain_models::text::tokens::TokenFileWriter;

/// A token file of `n` tokens `0, 1, 2, ...` (mod 1000) in documents of 50.
fn counting_file(name: &str, n: u32) -> Arc<TokenFile> {
    let dir = std::env::temp_dir().join(format!("zerotrain-tokendata-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut writer = TokenFileWriter::create(&dir.join("t.tokens"), 1000, 999, 1).unwrap();
    let ids: Vec<u32> = (0..n).map(|i| i % 999).collect();
    for doc in ids.chunks(49) {
        writer.document(doc).unwrap();
    }
    let file = writer.finish(0.05).unwrap();
    file.verify().unwrap();
    Arc::new(file)
}

fn data(file: &Arc<TokenFile>, global_batch: u64) -> TokenData {
    let sampler = Cut::Windows(TokenSampler::new(Arc::clone(file), 8, 7).unwrap());
    TokenData {
        sampler,
        file: Arc::clone(file),
        global_batch,
        base: Mutex::new((0, 0)),
        step_counted: Mutex::new(None),
    }
}

fn rows(batch: LmBatch) -> Vec<Vec<i64>> {
    let [n, w] = batch.tokens.dims();
    let flat = batch.tokens.into_data().convert::<i64>().try_into_vec::<i64>().unwrap();
    (0..n).map(|i| flat[i * w..(i + 1) * w].to_vec()).collect()
}

/// Samples continue where the checkpoint says however the next run splits its batches
/// (ranks, micro-batches) and whatever its global batch; every window is a run of
/// consecutive tokens, and an epoch visits every window once.
#[test]
fn a_resumed_run_draws_the_samples_after_the_recorded_position() {
    let file = counting_file("resume", 4000);
    let device = Device::flex();
    let a = data(&file, 8);
    // Run A: steps 0..6, each global batch of 8 as 2 ranks x 4.
    let mut drawn = Vec::new();
    for step in 0..6 {
        for rank in 0..2 {
            drawn.extend(rows(a.batch(step, rank * 4, 4, &device)));
        }
    }
    let record = a.position(3);
    assert_eq!(record["samples"], 24);
    // Run B resumes after step 3 with a global batch of 4 on one rank.
    let b = data(&file, 4);
    b.resume(&record, 3).unwrap();
    let mut again = Vec::new();
    for step in 3..9 {
        again.extend(rows(b.batch(step, 0, 4, &device)));
    }
    assert_eq!(again, drawn[24..48]);
    assert_eq!(b.position(9)["samples"], 48);
    for row in &drawn {
        let text: Vec<i64> = row.iter().copied().filter(|&t| t != 999).collect();
        assert!(text.windows(2).all(|p| p[1] == (p[0] + 1) % 999), "consecutive but for end tokens: {row:?}");
    }
    let Cut::Windows(windows) = &a.sampler else { unreachable!("a corpus") };
    let n = windows.windows() as u64;
    let mut starts: Vec<usize> = (0..n).map(|k| windows.start(k)).collect();
    starts.sort_unstable();
    assert_eq!(starts, (0..n as usize).map(|w| w * 8).collect::<Vec<_>>(), "one epoch, every window once");
    let other = counting_file("other", 3000);
    let err = data(&other, 8).resume(&record, 3).unwrap_err().to_string();
    assert!(err.contains("the checkpoint was trained on"), "{err}");
}

/// A position read from a damaged manifest is refused for what it is: no record, a
/// malformed one, or one out of range (2^64 - 1 samples once overflowed the sampler).
#[test]
fn a_damaged_position_is_refused_for_what_it_is() {
    let file = counting_file("damaged", 2000);
    let d = data(&file, 8);
    let crc = u64::from(file.checksum());
    let err = |record: serde_json::Value| d.resume(&record, 3).unwrap_err().to_string();
    assert!(err(serde_json::Value::Null).contains("records no position"));
    assert!(err(serde_json::json!({"step": 3})).contains("records no position"));
    assert!(err(serde_json::json!({"checksum": crc, "samples": "24"})).contains("is malformed"));
    assert!(err(serde_json::json!({"checksum": crc, "samples": -1})).contains("is malformed"));
    let far = err(serde_json::json!({"checksum": crc, "samples": u64::MAX}));
    assert!(far.contains("out of range (sample 18446744073709551615"), "{far}");
    d.resume(&serde_json::json!({"checksum": crc, "samples": 1u64 << 48}), 3).unwrap();
    assert_eq!(rows(d.batch(4, 0, 1, &Device::flex())).len(), 1, "the furthest position still samples");
}

/// A text given to `train --data` is tokenized by the first process to ask (under
/// mpirun every process asks at once): the others, and a later run, open the same file
/// instead of writing it again; a changed text is tokenized again.
#[test]
fn a_text_is_tokenized_once_however_many_processes_ask() {
    use std::os::unix::fs::MetadataExt;
    let dir = std::env::temp_dir().join(format!("zerotrain-tokenized-once-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let bpe = zerotrain_models::text::train_byte_level_bpe(["the rank holds a shard"].into_iter(), 300).unwrap();
    bpe.save(dir.join("tokenizer.json"), false).unwrap();
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let text = dir.join("text.txt");
    std::fs::write(&text, "the rank holds a shard\n\n".repeat(400)).unwrap();
    let out = dir.join("run");
    let checksums: Vec<u32> = std::thread::scope(|s| {
        let asks: Vec<_> = (0..3).map(|_| s.spawn(|| tokenized_once(&text, &tokenizer, &out).unwrap())).collect();
        asks.into_iter().map(|a| a.join().unwrap().checksum()).collect()
    });
    assert!(checksums.iter().all(|&c| c == checksums[0]), "{checksums:?}");
    let inode = || std::fs::metadata(out.join("data.tokens")).unwrap().ino();
    let first = inode();
    tokenized_once(&text, &tokenizer, &out).unwrap();
    assert_eq!(inode(), first, "a later run opens the file it finds");
    std::fs::write(&text, "a shard holds the rank\n\n".repeat(300)).unwrap();
    let again = tokenized_once(&text, &tokenizer, &out).unwrap();
    assert_ne!((inode(), again.checksum()), (first, checksums[0]), "another text, another token file");
    std::fs::remove_dir_all(&dir).unwrap();
}
