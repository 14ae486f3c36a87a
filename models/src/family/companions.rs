//! The files a Hugging Face family's run keeps beside its checkpoints (`config.json`,
//! `tokenizer.json` and the tokenizer's and generation's configs): every checkpoint's
//! manifest records their checksums, so that a file changed or swapped since cannot score,
//! sample or export as if it were the one the weights were trained with.

use std::path::Path;

use anyhow::bail;
use serde_json::{Map, Value};
use zerotrain_checkpoint::Checkpoint;

/// Every file a run may keep beside its checkpoints.
pub const FILES: [&str; 5] = [
    crate::hf::CONFIG_FILE,
    crate::hf::TOKENIZER_FILE,
    crate::hf::TOKENIZER_COMPANIONS[0],
    crate::hf::TOKENIZER_COMPANIONS[1],
    crate::hf::GENERATION_CONFIG_FILE,
];

/// The key of a checkpoint's client state under which the checksums are recorded.
pub const KEY: &str = "files";

/// The record of `files` (name, contents) a checkpoint keeps: `{name: crc32}`; `Null` for
/// none.
pub fn record(files: &[(String, Vec<u8>)]) -> Value {
    if files.is_empty() {
        return Value::Null;
    }
    let map: Map<String, Value> =
        files.iter().map(|(name, bytes)| (name.clone(), Value::from(crc32fast::hash(bytes)))).collect();
    Value::Object(map)
}

/// The checkpoints' folder `dir` names: `dir` itself, or a run folder's `checkpoints` (what
/// `zerotrain train --out` writes) when `dir` holds no `latest` but that folder does.
pub fn checkpoints_folder(dir: &Path) -> std::path::PathBuf {
    let inner = dir.join("checkpoints");
    if !dir.join(zerotrain_checkpoint::LATEST).exists() && inner.join(zerotrain_checkpoint::LATEST).exists() {
        inner
    } else {
        dir.to_path_buf()
    }
}

/// The checkpoints' folder `--checkpoint DIR` names ([`checkpoints_folder`]), its files
/// beside the checkpoints checked against what the checkpoint `tag` recorded ([`verify`]):
/// what `eval` and `generate` read a checkpoint through.
pub fn checked_folder(dir: &Path, tag: Option<&str>) -> anyhow::Result<std::path::PathBuf> {
    let folder = checkpoints_folder(dir);
    verify(&folder, tag, &FILES)?;
    Ok(folder)
}

/// Checks the files `names` in the checkpoints' folder `dir` against what the checkpoint
/// `tag` (or `latest`'s) recorded of them: a file it recorded must be there and unchanged.
/// A checkpoint that recorded nothing (written before checkpoints recorded them, or by a
/// program of the library's) is not checked.
pub fn verify(dir: &Path, tag: Option<&str>, names: &[&str]) -> anyhow::Result<()> {
    let ckpt = Checkpoint::open(dir, tag)?;
    let Some(recorded) = ckpt.manifest().client_state.get(KEY).and_then(Value::as_object) else { return Ok(()) };
    for &name in names {
        let Some(expected) = recorded.get(name) else { continue };
        let path = dir.join(name);
        let bytes = crate::file_error::read_optional(&path)?;
        let Some(bytes) = bytes else {
            bail!(
                "{} is missing: checkpoint {} was trained with it (the run put it beside its checkpoints)",
                path.display(),
                ckpt.dir().display()
            );
        };
        let crc = u64::from(crc32fast::hash(&bytes));
        if expected.as_u64() != Some(crc) {
            bail!(
                "{} was changed since checkpoint {} was written (checksum {crc:08x}, the checkpoint recorded {}): \
                 the weights were trained with another file; restore it",
                path.display(),
                ckpt.dir().display(),
                expected.as_u64().map_or_else(|| expected.to_string(), |e| format!("{e:08x}"))
            );
        }
    }
    Ok(())
}
