//! Token files written, read, verified and refused.

use super::*;

fn dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-tokens-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A file reads back as written; a damaged one, a truncated one or one whose ids
/// exceed its vocabulary (checksum recomputed, as a buggy writer would) is refused.
#[test]
fn token_files_read_back_and_damage_is_refused_by_name() {
    let path = dir("roundtrip").join("t.tokens");
    let mut w = TokenFileWriter::create(&path, 300, 299, 7).unwrap();
    w.document(&[1, 2, 3]).unwrap();
    w.document(&[250, 7]).unwrap();
    w.document(&[8, 299]).unwrap(); // closed already, by a tokenizer that ends every text
    let file = w.finish(0.3).unwrap();
    file.verify().unwrap();
    let tokens = [1, 2, 3, 299, 250, 7, 299, 8, 299];
    assert_eq!((0..file.len()).map(|i| file.token(i)).collect::<Vec<_>>(), tokens);
    assert_eq!((file.documents(), file.train_tokens(), file.vocab_size()), (3, 6, 300));

    let bytes = std::fs::read(&path).unwrap();
    let write = |name: &str, bytes: &[u8]| {
        let p = path.with_file_name(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let mut flipped = bytes.clone();
    flipped[HEADER] ^= 1;
    let err = TokenFile::open(&write("flipped", &flipped)).unwrap().verify().unwrap_err().to_string();
    assert!(err.contains("flipped: checksum mismatch"), "{err}");
    let err = TokenFile::open(&write("short", &bytes[..bytes.len() - 3])).unwrap_err().to_string();
    assert!(err.contains("short: its header does not match its size"), "{err}");
    let mut big = bytes.clone();
    big[HEADER..HEADER + 2].copy_from_slice(&400u16.to_le_bytes());
    let crc = crc32fast::hash(&big[HEADER..]);
    big[48..52].copy_from_slice(&crc.to_le_bytes());
    let err = TokenFile::open(&write("big", &big)).unwrap().verify().unwrap_err().to_string();
    assert!(err.contains("token 0 is id 400, not below its vocabulary size 300"), "{err}");
    let err = TokenFile::open(&write("text", b"hello")).unwrap_err().to_string();
    assert!(err.contains("not a zerotrain token file"), "{err}");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// An id at or beyond the id bound is refused, never wrapped into the width; a file of
/// version 1 (before files recorded their tokenizer) still reads, with no fingerprint.
#[test]
fn ids_beyond_the_bound_are_refused_and_version_1_files_still_read() {
    let path = dir("bound").join("t.tokens");
    let mut w = TokenFileWriter::create(&path, 300, 299, 7).unwrap();
    let err = w.document(&[1, 300]).unwrap_err().to_string();
    assert!(err.contains("id 300 is not below the tokenizer's id bound 300"), "{err}");
    w.document(&[1, 2]).unwrap();
    let file = w.finish(0.0).unwrap();
    assert_eq!(file.fingerprint(), Some(7));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    bytes[56..64].fill(0);
    let old = path.with_file_name("old");
    std::fs::write(&old, &bytes).unwrap();
    let file = TokenFile::open(&old).unwrap();
    file.verify().unwrap();
    assert_eq!((file.fingerprint(), file.token(1)), (None, 2));
    let err = TokenFileWriter::create(&path, 300, 300, 7).err().unwrap().to_string();
    assert!(err.contains("the end token 300 is not below the id bound 300"), "{err}");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// A file of fine-tuning sequences (version 3) keeps each sequence's tokens as given (no
/// end token added), its loss mask bit by bit (across byte boundaries), the sequences'
/// ends, and holds out whole sequences; a documents-only file is version 2 as before, every
/// token counted; a damaged mask fails the checksum.
#[test]
fn sequences_keep_their_masks_and_hold_out_whole() {
    let path = dir("sequences").join("s.tokens");
    let mut w = TokenFileWriter::create(&path, 300, 299, 7).unwrap();
    let masks: [&[bool]; 3] = [
        &[false, false, true, true, true],
        &[false; 3],
        &[true, false, true, true, false, true, true, false, true, true],
    ];
    for (i, mask) in masks.iter().enumerate() {
        let ids: Vec<u32> = (0..mask.len() as u32).map(|t| 10 * i as u32 + t).collect();
        w.sequence(&ids, mask).unwrap();
    }
    assert!(w.sequence(&[1, 2], &[true]).is_err());
    let file = w.finish(0.2).unwrap();
    file.verify().unwrap();
    assert!(file.sequences());
    assert_eq!((file.len(), file.documents()), (18, 3));
    assert_eq!(file.document_ends(), [5, 8, 18]);
    // 20% of 18 is 4 tokens: the split moves back to the last sequence's start.
    assert_eq!(file.train_tokens(), 8);
    let all: Vec<bool> = masks.concat();
    assert_eq!((0..18).map(|i| file.counted(i)).collect::<Vec<_>>(), all);
    assert_eq!(file.counted_in(5..18), 7);
    assert_eq!((0..18).map(|i| file.token(i)).collect::<Vec<_>>()[5..8], [10, 11, 12]);
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 3);
    let mut damaged = bytes.clone();
    *damaged.last_mut().unwrap() ^= 1;
    let damaged_path = dir("sequences").join("damaged.tokens");
    std::fs::write(&damaged_path, &damaged).unwrap();
    assert!(TokenFile::open(&damaged_path).unwrap().verify().unwrap_err().to_string().contains("checksum"));
    let plain = dir("sequences").join("p.tokens");
    let mut w = TokenFileWriter::create(&plain, 300, 299, 7).unwrap();
    w.document(&[1, 2]).unwrap();
    let file = w.finish(0.0).unwrap();
    assert!(!file.sequences() && file.counted(0) && file.counted(2));
    assert_eq!(u32::from_le_bytes(std::fs::read(&plain).unwrap()[8..12].try_into().unwrap()), 2);
}

/// Documents written before the first sequence count every token in the mask (across a
/// byte's boundary), those after it too.
#[test]
fn documents_before_a_sequence_count_whole() {
    let path = dir("mixed").join("m.tokens");
    let mut w = TokenFileWriter::create(&path, 300, 299, 7).unwrap();
    w.document(&[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap(); // ten tokens with the end token
    w.sequence(&[4, 5, 6], &[false, true, false]).unwrap();
    w.document(&[1]).unwrap();
    let file = w.finish(0.0).unwrap();
    let want: Vec<bool> = [vec![true; 10], vec![false, true, false], vec![true; 2]].concat();
    assert_eq!((0..file.len()).map(|i| file.counted(i)).collect::<Vec<_>>(), want);
}
