//! A LoRA run's checkpoint written back as the whole model with its adapters merged
//! (`zerotrain consolidate --format hf --merge`): each adapted weight becomes
//! `W + scaling * B A` (transposed for GPT-2's Conv1D, which stores `[in, out]`), in the
//! stored dtype, a Hugging Face folder `transformers` loads without PEFT. The frozen base
//! comes from the base model's folder (a checkpoint keeps only what trains), the adapters
//! and `modules_to_save` from the checkpoint; the folder is written one tensor at a time,
//! so no more of the base is in memory at once than its largest tensor.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use zerotrain::nn::lora::LoraConfig;
use zerotrain_checkpoint::{Checkpoint, LayoutEntry};
use zerotrain_precision::Precision;

use super::export::{Exported, shards, sibling, stored_dtype, write_folder};
use super::parameter_names;
use crate::hf::files::TensorFiles;
use crate::hf::{CONFIG_FILE, Family};

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
    let (ckpt, config, source) = super::export::open(dir, tag, out, source)?;
    let Some(lora) = crate::hf::peft::trained_lora(&ckpt)? else {
        bail!("--merge merges a LoRA run's adapters; {} was not trained with zerotrain.lora", ckpt.dir().display());
    };
    let manifest = ckpt.manifest();
    let conv = matches!(config.family, Family::Gpt2(_));
    let trained: BTreeMap<&str, &LayoutEntry> = manifest.layout.iter().map(|e| (e.path.as_str(), e)).collect();
    let base = Base::of(&lora, conv, manifest.client_state[super::base::KEY].clone())?;
    let tensors = parameter_names(&config);
    let mut used = 0;
    for (name, shape) in &tensors {
        let held = match trained.get(name.as_str()) {
            Some(e) => Some((e.shape.iter().map(|&d| d as usize).collect(), "the checkpoint".to_string())),
            None => base.shape(name),
        };
        match held {
            None => bail!(
                "neither the checkpoint nor the base {} holds tensor `{name}`, which {CONFIG_FILE} needs",
                base.dir
            ),
            Some((s, from)) if s != *shape => {
                bail!("{from}: tensor `{name}` has shape {s:?}; {CONFIG_FILE} needs {shape:?}")
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
            None => base.read(name)?,
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

/// The frozen base a LoRA run adapted: the checkpoint keeps only what trains, so its
/// weights come from the folder the run recorded (`base_model_name_or_path`, which
/// `zerotrain train` sets to the `hf_dir` it read).
struct Base {
    dir: String,
    files: std::sync::Arc<TensorFiles>,
    alias: fn(&str) -> Option<String>,
    /// The fingerprint the checkpoint recorded of the base it trained on.
    recorded: serde_json::Value,
}

impl Base {
    fn of(lora: &LoraConfig, gpt2: bool, recorded: serde_json::Value) -> anyhow::Result<Self> {
        let named = lora.provenance.get("base_model_name_or_path").and_then(|v| v.as_str()).filter(|s| !s.is_empty());
        let Some(dir) = named else {
            bail!(
                "the run records no base model (zerotrain.lora.base_model_name_or_path): a checkpoint holds only what \
                 trains, and --merge reads the frozen weights from the base's folder (a model from model.hf_config is \
                 drawn, not kept: export its adapters with --format peft)"
            );
        };
        let files = TensorFiles::open(Path::new(dir))
            .with_context(|| format!("--merge reads the frozen weights from the base model {dir}"))?;
        let alias: fn(&str) -> Option<String> = if gpt2 { crate::gpt2::alias } else { |_| None };
        Ok(Self { dir: dir.to_string(), files, alias, recorded })
    }

    fn entry(&self, name: &str) -> Option<&crate::hf::files::TensorEntry> {
        self.files.get(name).or_else(|| (self.alias)(name).and_then(|a| self.files.get(&a)))
    }

    /// The shape of the base's tensor `name` and where it is, if it has one.
    fn shape(&self, name: &str) -> Option<(Vec<usize>, String)> {
        let entry = self.entry(name)?;
        Some((entry.shape.clone(), self.files.file_of(entry).display().to_string()))
    }

    /// The base's tensor `name`, checked against the checkpoint's fingerprint of it.
    fn read(&self, name: &str) -> anyhow::Result<Vec<f32>> {
        let entry = self.entry(name).expect("checked by shape");
        let crc = crc32fast::hash(self.files.bytes(entry));
        let now = serde_json::json!({ "tensors": { name: crc } });
        let then = match self.recorded["tensors"].get(name) {
            Some(recorded) => serde_json::json!({ "tensors": { name: recorded } }),
            None => serde_json::Value::Null,
        };
        super::base::check(&then, &now)
            .map_err(|e| anyhow::anyhow!("{} ({}): {e}", self.dir, self.files.file_of(entry).display()))?;
        Ok(self.files.read_f32(entry))
    }
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
