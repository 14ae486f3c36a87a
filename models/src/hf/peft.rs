//! PEFT's adapter folder: `adapter_config.json` (its `LoraConfig`) and
//! `adapter_model.safetensors`, whose tensors are named by the adapted module's path under
//! `base_model.model.` (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
//! `[r, in]`, `lora_B.weight` `[out, r]`). A module path here is the checkpoint's tensor
//! name, and an adapter's factors are `<module>.adapter.a` and `.b`: the two names map one
//! to one ([`tensor_name`], [`factor_path`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use zerotrain::nn::lora::LoraConfig;

use super::files::TensorFiles;

/// The adapter's config file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The adapter's tensors.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// What PEFT puts before a module's path in its tensor names.
pub const PREFIX: &str = "base_model.model.";

/// PEFT's tensor name of the adapter factor at module path `path` (`<module>.adapter.a`
/// or `.b`); `None` for a path that is no factor.
pub fn tensor_name(path: &str) -> Option<String> {
    let (module, factor) = path.rsplit_once(".adapter.")?;
    let which = match factor {
        "a" => "lora_A",
        "b" => "lora_B",
        _ => return None,
    };
    Some(format!("{PREFIX}{module}.{which}.weight"))
}

/// The module path of PEFT's tensor `name` (the inverse of [`tensor_name`]); a whole
/// module's parameter (`modules_to_save`) maps to its own path.
pub fn factor_path(name: &str) -> Option<String> {
    let rest = name.strip_prefix(PREFIX)?;
    for (which, factor) in [(".lora_A.weight", "a"), (".lora_B.weight", "b")] {
        if let Some(module) = rest.strip_suffix(which) {
            return Some(format!("{module}.adapter.{factor}"));
        }
    }
    Some(rest.to_string())
}

/// An adapter folder PEFT (or `zerotrain consolidate --format peft`) wrote.
#[derive(Debug, Clone)]
pub struct AdapterFolder {
    /// The folder.
    pub dir: PathBuf,
    /// Its `adapter_config.json`, read.
    pub config: Arc<LoraConfig>,
    /// Its tensors.
    pub files: Arc<TensorFiles>,
}

impl AdapterFolder {
    /// Reads `dir`'s two files; an error naming the file that is missing or wrong.
    pub fn read(dir: &Path) -> anyhow::Result<Self> {
        let config_file = dir.join(ADAPTER_CONFIG_FILE);
        let text = std::fs::read_to_string(&config_file)
            .with_context(|| format!("cannot read {} (a PEFT adapter folder has one)", config_file.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not JSON", config_file.display()))?;
        let config = LoraConfig::from_json(&json, &config_file.display().to_string(), "")?;
        let files = TensorFiles::open_file(&dir.join(ADAPTER_WEIGHTS_FILE))?;
        Ok(Self { dir: dir.to_path_buf(), config: Arc::new(config), files })
    }
}

/// The LoRA config the run of `ckpt` trained with (its plan's `zerotrain.lora`), if any.
pub fn trained_lora(ckpt: &zerotrain_checkpoint::Checkpoint) -> anyhow::Result<Option<LoraConfig>> {
    let Some(json) = ckpt.manifest().config.get("lora").filter(|l| !l.is_null()) else { return Ok(None) };
    let origin = format!("{}'s config", ckpt.dir().display());
    Ok(Some(LoraConfig::from_json(json, &origin, "zerotrain.lora")?))
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct ExportedAdapter {
    /// Adapted modules.
    pub modules: usize,
    /// Tensors written (two per adapted module, and each `modules_to_save` parameter).
    pub tensors: usize,
    /// Bytes of `adapter_model.safetensors`.
    pub bytes: u64,
}

/// Writes the adapters of the checkpoint `<dir>/<tag>` (or `latest`'s), trained with
/// `zerotrain.lora`, as PEFT's adapter folder `out`: `adapter_model.safetensors` (PEFT's
/// names, in `dtype`, metadata `{"format": "pt"}`) and `adapter_config.json` (every
/// `LoraConfig` key; `fan_in_fan_out` for GPT-2's Conv1D, read from `config.json` in
/// `source`, default `dir`). `out` must not exist; it appears whole or not at all.
pub fn export(
    dir: &Path,
    tag: Option<&str>,
    out: &Path,
    dtype: zerotrain_precision::Precision,
    source: Option<&Path>,
) -> anyhow::Result<ExportedAdapter> {
    use anyhow::bail;
    if out.exists() {
        bail!("{} exists: give a new folder for the adapter", out.display());
    }
    let ckpt = zerotrain_checkpoint::Checkpoint::open(dir, tag)?;
    let Some(config) = trained_lora(&ckpt)? else {
        bail!(
            "{} was not trained with zerotrain.lora: it holds a whole model (use --format hf or safetensors)",
            ckpt.dir().display()
        );
    };
    let model_config = super::HfConfig::read(&source.unwrap_or(dir).join(super::CONFIG_FILE))
        .context("the adapter's export reads the model's config.json (or give --hf-config DIR)")?;
    let gpt2 = matches!(model_config.family, super::Family::Gpt2(_));
    let layout = &ckpt.manifest().layout;
    let mut names = Vec::with_capacity(layout.len());
    let mut adapted = Vec::new();
    for entry in layout {
        let name = match tensor_name(&entry.path) {
            Some(name) => {
                if entry.path.ends_with(".adapter.a") {
                    adapted.push(entry.path.trim_end_matches(".adapter.a").to_string());
                }
                name
            }
            None if config.trains_whole(&entry.path) => {
                format!("{PREFIX}{}", entry.path)
            }
            None => bail!(
                "the checkpoint's tensor `{}` is neither an adapter's nor in zerotrain.lora.modules_to_save: it is not \
                 a LoRA run's",
                entry.path
            ),
        };
        names.push(name);
    }
    let base = config
        .provenance
        .get("base_model_name_or_path")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .or_else(|| source.map(|s| s.display().to_string()))
        .unwrap_or_default();
    let peft_json = config.to_peft_json(&base, &adapted, gpt2);
    let partial = out.with_file_name(format!(
        "{}.partial",
        out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    ));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
    let written = (|| {
        let meta = [("format", "pt".to_string())];
        let weights = partial.join(ADAPTER_WEIGHTS_FILE);
        zerotrain_checkpoint::write_parameters_as(&ckpt, layout, &names, &weights, dtype, &meta)?;
        let bytes = std::fs::metadata(&weights)?.len();
        let text = serde_json::to_string_pretty(&peft_json)?;
        std::fs::write(partial.join(ADAPTER_CONFIG_FILE), text)?;
        std::fs::rename(&partial, out)
            .with_context(|| format!("cannot rename {} to {}", partial.display(), out.display()))?;
        Ok(ExportedAdapter { modules: adapted.len(), tensors: names.len(), bytes })
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&partial);
    }
    written
}
