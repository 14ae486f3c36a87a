//! A LoRA run's checkpoint written back as the whole model with its adapters merged
//! (`zerotrain consolidate --format hf --merge`): each adapted weight becomes
//! `W + scaling * B A` (transposed for GPT-2's Conv1D, which stores `[in, out]`), in the
//! stored dtype, a Hugging Face folder `transformers` loads without PEFT. The frozen base
//! comes from the checkpoint (its buffers), the adapters and `modules_to_save` from its
//! trained parameters; the folder is written one tensor at a time, so no more of the base is
//! in memory at once than its largest tensor.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use zerotrain::nn::lora::LoraConfig;
use zerotrain_checkpoint::{Checkpoint, LayoutEntry};
use zerotrain_precision::Precision;

use super::export::{Exported, shards, sibling, stored_dtype, write_folder};
use super::parameter_names;
use crate::hf::{CONFIG_FILE, Family, HfConfig};

/// Writes the checkpoint `<dir>/<tag>` (or `latest`'s) of a run trained with
/// `zerotrain.lora` as a Hugging Face folder `out`, adapters merged (module docs); dtype,
/// shards and `source` as [`export`](super::export::export) takes them.
pub fn export_merged(
    dir: &Path,
    tag: Option<&str>,
    out: &Path,
    dtype: Option<Precision>,
    max_shard_bytes: u64,
    source: Option<&Path>,
) -> anyhow::Result<Exported> {
    if out.exists() {
        bail!("{} exists: give a new folder for the export", out.display());
    }
    let ckpt = Checkpoint::open(dir, tag)?;
    let manifest = ckpt.manifest();
    let Some(lora_json) = manifest.config.get("lora").filter(|l| !l.is_null()) else {
        bail!("--merge merges a LoRA run's adapters; {} was not trained with zerotrain.lora", ckpt.dir().display());
    };
    let lora = LoraConfig::from_json(lora_json, &format!("{}'s config", ckpt.dir().display()), "zerotrain.lora")?;
    if source.is_none() {
        super::companions::verify(dir, tag, &super::companions::FILES)?;
    }
    let source = source.unwrap_or(dir);
    let config = HfConfig::read(&source.join(CONFIG_FILE))
        .context("the export needs the model's config.json (zerotrain train puts it in the checkpoints' folder)")?;
    let conv = matches!(config.family, Family::Gpt2(_));
    let trained: BTreeMap<&str, &LayoutEntry> = manifest.layout.iter().map(|e| (e.path.as_str(), e)).collect();
    let frozen: BTreeMap<&str, &LayoutEntry> =
        manifest.buffers.iter().flat_map(|b| &b.layout).map(|e| (e.path.as_str(), e)).collect();
    let tensors = parameter_names(&config);
    let mut used = 0;
    for (name, shape) in &tensors {
        let held = trained.get(name.as_str()).or_else(|| frozen.get(name.as_str()));
        match held {
            None => bail!("the checkpoint holds no tensor `{name}`, which {CONFIG_FILE} needs"),
            Some(e) if e.shape.iter().map(|&d| d as usize).ne(shape.iter().copied()) => {
                bail!("the checkpoint's tensor `{name}` has shape {:?}; {CONFIG_FILE} needs {shape:?}", e.shape)
            }
            Some(_) => {}
        }
        used += usize::from(trained.contains_key(name.as_str()));
        used += 2 * usize::from(factors(&trained, name).is_some());
    }
    if used != trained.len() {
        let stray = manifest.layout.iter().find(|e| {
            let base = e.path.rsplit_once(".adapter.").map(|(m, _)| format!("{m}.weight"));
            !tensors.iter().any(|(n, _)| *n == e.path || base.as_deref() == Some(n))
        });
        bail!("the checkpoint's tensor `{}` has no place in the model", stray.map_or("?", |e| e.path.as_str()));
    }
    let dtype = dtype.unwrap_or_else(|| stored_dtype(&config.json));
    let layout: Vec<LayoutEntry> = tensors
        .iter()
        .map(|(name, shape)| LayoutEntry {
            path: name.clone(),
            shape: shape.iter().map(|&d| d as u64).collect(),
            offset: 0,
        })
        .collect();
    let groups = shards(&layout, dtype.bytes_per_elem() as u64, max_shard_bytes);
    let value = |name: &str| -> anyhow::Result<Vec<f32>> {
        let mut values = match trained.get(name) {
            Some(entry) => read_master(&ckpt, entry)?,
            None => ckpt.read_buffer(frozen[name])?,
        };
        if let Some((a, b)) = factors(&trained, name) {
            let module = name.trim_end_matches(".weight");
            let r = a.shape[0] as usize;
            let scaling = lora.scaling_of(module, r).map_err(anyhow::Error::msg)? as f32;
            let (a_values, b_values) = (read_master(&ckpt, a)?, read_master(&ckpt, b)?);
            let (d_in, d_out) = (a.shape[1] as usize, b.shape[0] as usize);
            for o in 0..d_out {
                for i in 0..d_in {
                    let delta: f32 = (0..r).map(|k| b_values[o * r + k] * a_values[k * d_in + i]).sum();
                    // Dense stores [out, in]; Conv1D [in, out].
                    let at = if conv { i * d_out + o } else { o * d_in + i };
                    values[at] += scaling * delta;
                }
            }
        }
        Ok(values)
    };
    let write = |group: &[LayoutEntry], path: &Path| -> anyhow::Result<()> {
        let specs: Vec<(String, Vec<usize>)> =
            group.iter().map(|e| (e.path.clone(), e.shape.iter().map(|&d| d as usize).collect())).collect();
        let mut failure = None;
        let written = zerotrain_checkpoint::write_computed(path, &specs, dtype, &[("format", "pt".into())], |i| {
            value(&specs[i].0).map_err(|e| {
                let message = e.to_string();
                failure = Some(e);
                zerotrain_checkpoint::CheckpointError::Mismatch(message)
            })
        });
        match (written, failure) {
            (_, Some(e)) => Err(e),
            (Err(e), None) => Err(e.into()),
            (Ok(_), None) => Ok(()),
        }
    };
    let partial = sibling(out, ".partial")?;
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let written = write_folder(&write, &config, source, &partial, &groups, dtype).and_then(|exported| {
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

/// The adapter factors (A, B) the checkpoint trained for the weight `name`, if any.
fn factors<'a>(trained: &BTreeMap<&str, &'a LayoutEntry>, name: &str) -> Option<(&'a LayoutEntry, &'a LayoutEntry)> {
    let module = name.strip_suffix(".weight")?;
    let a = trained.get(format!("{module}.adapter.a").as_str())?;
    let b = trained.get(format!("{module}.adapter.b").as_str())?;
    Some((a, b))
}

/// A trained tensor's fp32 master values.
fn read_master(ckpt: &Checkpoint, entry: &LayoutEntry) -> anyhow::Result<Vec<f32>> {
    let n = entry.shape.iter().product::<u64>();
    let mut values = vec![0.0; n as usize];
    ckpt.read_range("master", entry.offset..entry.offset + n, &mut values)?;
    Ok(values)
}
