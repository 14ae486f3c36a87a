//! A zerotrain checkpoint of a Hugging Face family written back as a Hugging Face folder
//! (`zerotrain consolidate --format hf`): `config.json`, the weights in safetensors shards
//! of at most a given size (one `model.safetensors`, or `model-0000i-of-0000n.safetensors`
//! and `model.safetensors.index.json`), and the tokenizer files. The checkpoint's module
//! paths are the tensor names already; every one is checked against the config.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde_json::Value;
use zerotrain_checkpoint::{Checkpoint, LayoutEntry};
use zerotrain_precision::Precision;

use super::parameter_names;
use crate::hf::files::{INDEX_FILE, SINGLE_FILE};
use crate::hf::{CONFIG_FILE, GENERATION_CONFIG_FILE, HfConfig, TOKENIZER_COMPANIONS, TOKENIZER_FILE};

/// Files of a checkpoint folder copied as they are, when the source has them.
const TOKENIZER_FILES: [&str; 4] =
    [TOKENIZER_FILE, TOKENIZER_COMPANIONS[0], TOKENIZER_COMPANIONS[1], GENERATION_CONFIG_FILE];

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The safetensors files, in order.
    pub shards: Vec<PathBuf>,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of weights written.
    pub bytes: u64,
    /// Their dtype.
    pub dtype: Precision,
}

/// Writes the checkpoint `<dir>/<tag>` (or `latest`'s) as a Hugging Face folder `out`, in
/// `dtype` (default: the config's `dtype` or `torch_dtype`, else f32), shards of at most
/// `max_shard_bytes` (a larger tensor gets a shard of its own, as in `transformers`).
/// `config.json` and the tokenizer files come from `source` (default: `dir`, where
/// `zerotrain train` puts them). `out` must not exist; it appears whole or not at all.
pub fn export(
    dir: &Path,
    tag: Option<&str>,
    out: &Path,
    dtype: Option<Precision>,
    max_shard_bytes: u64,
    source: Option<&Path>,
) -> anyhow::Result<Exported> {
    let (ckpt, config, source) = open(dir, tag, out, source)?;
    let config_file = source.join(CONFIG_FILE);
    if crate::hf::peft::trained_lora(&ckpt)?.is_some() {
        bail!(
            "{} is a LoRA run's checkpoint (its parameters are adapters): --format peft writes the adapters, --merge \
             the whole model with them merged",
            ckpt.dir().display()
        );
    }
    let layout = &ckpt.manifest().layout;
    check_layout(layout, &config, &config_file)?;
    if ckpt.manifest().buffers.is_some() {
        bail!("{}: the checkpoint holds buffers, which no Hugging Face family here has", ckpt.dir().display());
    }
    let dtype = dtype.unwrap_or_else(|| stored_dtype(&config.json));
    let groups = shards(layout, dtype.bytes_per_elem() as u64, max_shard_bytes);
    let partial = sibling(out, ".partial")?;
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let write = |group: &[LayoutEntry], path: &Path| -> anyhow::Result<()> {
        zerotrain_checkpoint::write_parameters(&ckpt, group, path, dtype, &[("format", "pt".to_string())])?;
        Ok(())
    };
    let written = write_folder(&write, &config, source, &partial, &groups, dtype);
    let written = written.and_then(|exported| {
        std::fs::rename(&partial, out)
            .with_context(|| format!("cannot rename {} to {}", partial.display(), out.display()))?;
        Ok(Exported {
            shards: exported.shards.iter().map(|s| out.join(s.file_name().expect("a file"))).collect(),
            ..exported
        })
    });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    written
}

/// The checkpoint `<dir>/<tag>` an export reads, the model's `config.json` and the folder
/// holding it (`source`, default `dir`, whose files are then checked against what the
/// checkpoint recorded); an error where `out` exists.
pub(super) fn open<'a>(
    dir: &'a Path,
    tag: Option<&str>,
    out: &Path,
    source: Option<&'a Path>,
) -> anyhow::Result<(Checkpoint, HfConfig, &'a Path)> {
    if out.exists() {
        bail!("{} exists: give a new folder for the export", out.display());
    }
    let ckpt = Checkpoint::open(dir, tag)?;
    if source.is_none() {
        super::companions::verify(dir, tag, &super::companions::FILES)?;
    }
    let source = source.unwrap_or(dir);
    let config = HfConfig::read(&source.join(CONFIG_FILE)).context(
        "the export needs the model's config.json (zerotrain train puts it in the checkpoints' folder; or give \
         --hf-config DIR)",
    )?;
    Ok((ckpt, config, source))
}

/// The checkpoint's parameters are exactly the config's, shape for shape.
fn check_layout(layout: &[LayoutEntry], config: &HfConfig, config_file: &Path) -> anyhow::Result<()> {
    let tensors = crate::hf::size::ModelSize::of(config).tensors;
    if tensors != layout.len() as u64 {
        bail!(
            "{} describes a model of {tensors} tensors ({} layers); the checkpoint holds {}",
            config_file.display(),
            config.num_layers(),
            layout.len()
        );
    }
    let expected: BTreeMap<String, Vec<usize>> = parameter_names(config).into_iter().collect();
    for entry in layout {
        let shape: Vec<usize> = entry.shape.iter().map(|&d| d as usize).collect();
        match expected.get(&entry.path) {
            None => bail!(
                "the checkpoint's tensor `{}` has no place in the model {} describes",
                entry.path,
                config_file.display()
            ),
            Some(s) if *s != shape => bail!(
                "the checkpoint's tensor `{}` has shape {shape:?}; {} needs {s:?}",
                entry.path,
                config_file.display()
            ),
            Some(_) => {}
        }
    }
    if let Some(missing) = expected.keys().find(|name| !layout.iter().any(|e| &e.path == *name)) {
        bail!("the checkpoint has no tensor `{missing}`, which {} needs", config_file.display());
    }
    Ok(())
}

/// The layout cut, in order, into groups of at most `max_bytes` (a larger tensor alone).
pub(super) fn shards(layout: &[LayoutEntry], elem_bytes: u64, max_bytes: u64) -> Vec<Vec<LayoutEntry>> {
    let mut groups: Vec<Vec<LayoutEntry>> = Vec::new();
    let mut size = 0;
    for entry in layout {
        let bytes = entry.shape.iter().product::<u64>() * elem_bytes;
        if groups.is_empty() || size + bytes > max_bytes && size > 0 {
            groups.push(Vec::new());
            size = 0;
        }
        groups.last_mut().expect("pushed").push(entry.clone());
        size += bytes;
    }
    groups
}

/// Writes a Hugging Face folder: each group of tensors by `write` as one safetensors shard
/// (and the index where there are several), `config.json` saying `dtype`, and the
/// tokenizer files of `source`.
pub(super) fn write_folder(
    write: &dyn Fn(&[LayoutEntry], &Path) -> anyhow::Result<()>,
    config: &HfConfig,
    source: &Path,
    folder: &Path,
    groups: &[Vec<LayoutEntry>],
    dtype: Precision,
) -> anyhow::Result<Exported> {
    let n = groups.len();
    let (mut shards, mut weight_map, mut bytes) = (Vec::new(), BTreeMap::new(), 0u64);
    for (i, group) in groups.iter().enumerate() {
        let name = if n == 1 { SINGLE_FILE.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
        let path = folder.join(&name);
        write(group, &path)?;
        bytes += group.iter().map(|e| e.shape.iter().product::<u64>() * dtype.bytes_per_elem() as u64).sum::<u64>();
        weight_map.extend(group.iter().map(|e| (e.path.clone(), name.clone())));
        shards.push(path);
    }
    if n > 1 {
        let index = serde_json::json!({"metadata": {"total_size": bytes}, "weight_map": weight_map});
        write_atomically(&folder.join(INDEX_FILE), serde_json::to_string_pretty(&index)?.as_bytes())?;
    }
    let json = with_stored_dtype(config.json.clone(), dtype);
    write_atomically(&folder.join(CONFIG_FILE), serde_json::to_string_pretty(&json)?.as_bytes())?;
    for file in TOKENIZER_FILES {
        let from = source.join(file);
        if from.exists() {
            std::fs::copy(&from, folder.join(file)).with_context(|| format!("cannot copy {}", from.display()))?;
        }
    }
    Ok(Exported { shards, tensors: weight_map.len(), bytes, dtype })
}

/// The dtype a `config.json` says its tensors are stored in: `dtype` (`transformers` 5) or
/// `torch_dtype` (before it); f32 where it names neither.
pub fn stored_dtype(json: &Value) -> Precision {
    match DTYPE_KEYS.iter().find_map(|key| json.get(*key)?.as_str()) {
        Some("bfloat16") => Precision::Bf16,
        Some("float16") => Precision::Fp16,
        _ => Precision::Fp32,
    }
}

/// The keys a `config.json` names its stored dtype under, newest first.
const DTYPE_KEYS: [&str; 2] = ["dtype", "torch_dtype"];

/// `json` saying its tensors are stored in `dtype`, under each of [`DTYPE_KEYS`] it has (a
/// file keeps its own layout), or under `torch_dtype`, which every version reads, where it
/// has neither.
fn with_stored_dtype(mut json: Value, dtype: Precision) -> Value {
    let name = Value::String(
        match dtype {
            Precision::Fp32 => "float32",
            Precision::Fp16 => "float16",
            Precision::Bf16 => "bfloat16",
        }
        .into(),
    );
    let present: Vec<&str> = DTYPE_KEYS.into_iter().filter(|key| json.get(*key).is_some()).collect();
    for key in if present.is_empty() { vec!["torch_dtype"] } else { present } {
        json[key] = name.clone();
    }
    json
}

/// `path` with `suffix` added to its name.
pub(super) fn sibling(path: &Path, suffix: &str) -> anyhow::Result<PathBuf> {
    let name = path.file_name().with_context(|| format!("{} is not a folder name", path.display()))?;
    let mut name = name.to_owned();
    name.push(suffix);
    Ok(path.with_file_name(name))
}

/// Writes `bytes` to `path` through `<path>.<pid>.partial` and a rename.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    // Named by the process: every process of an MPI job writes the same companion files
    // into one checkpoints folder, and a shared partial name let one process rename away
    // the file another was about to rename.
    let partial = sibling(path, &format!(".{}.partial", std::process::id()))?;
    std::fs::write(&partial, bytes).with_context(|| format!("cannot write {}", partial.display()))?;
    std::fs::rename(&partial, path)
        .with_context(|| format!("cannot rename {} to {}", partial.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_stored_dtype_is_read_and_written_under_the_files_own_key() {
        let v5 = json!({"model_type": "llama", "dtype": "bfloat16"});
        let v4 = json!({"model_type": "llama", "torch_dtype": "float16"});
        assert_eq!((stored_dtype(&v5), stored_dtype(&v4)), (Precision::Bf16, Precision::Fp16));
        assert_eq!(stored_dtype(&json!({"dtype": "bfloat16", "torch_dtype": "float32"})), Precision::Bf16);
        assert_eq!(stored_dtype(&json!({"model_type": "gpt2"})), Precision::Fp32);
        assert_eq!(with_stored_dtype(v5, Precision::Fp32), json!({"model_type": "llama", "dtype": "float32"}));
        assert_eq!(with_stored_dtype(v4, Precision::Bf16), json!({"model_type": "llama", "torch_dtype": "bfloat16"}));
        let both = with_stored_dtype(json!({"dtype": "bfloat16", "torch_dtype": "bfloat16"}), Precision::Fp16);
        assert_eq!(both, json!({"dtype": "float16", "torch_dtype": "float16"}));
        assert_eq!(with_stored_dtype(json!({}), Precision::Bf16), json!({"torch_dtype": "bfloat16"}));
    }
}
