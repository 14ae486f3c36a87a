//! The application's keys in a config file, beside DeepSpeed's: the built-in GPT's shape
//! (`model`) and the train job's cadence (`zerotrain.checkpoint_every`,
//! `zerotrain.eval_every`). The library never sees them: [`Config::parse_with`] hands
//! them here, checked key by key like the library's own.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_aux::serde_introspection::serde_introspect;

use zerotrain::config::{ConfigError, Count};
use zerotrain::{Config, ConfigExtension, Overrides, Plan};
use zerotrain_models::GptConfig;
use zerotrain_models::family::Adapters;
pub use zerotrain_models::family::load::{HfSource, ModelSource};

/// The application's keys as written.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AppKeys {
    /// The model: the built-in GPT's shape, or a Hugging Face family's checkpoint
    /// (`hf_dir`) or shape (`hf_config`).
    #[serde(default)]
    pub model: Option<ModelKeys>,
    /// The train job's keys inside the `zerotrain` section.
    #[serde(default)]
    pub zerotrain: JobKeys,
}

/// The `model` section: the built-in GPT's shape keys (see [`GptConfig`]; `block_size` is
/// the context of every model), and the Hugging Face keys. The shape keys are listed here
/// rather than flattened from [`GptConfig`]: serde's `flatten` would hide misspelled keys
/// from the unknown-key check.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ModelKeys {
    /// [`GptConfig::n_layer`].
    pub n_layer: Option<usize>,
    /// [`GptConfig::n_head`].
    pub n_head: Option<usize>,
    /// [`GptConfig::n_embd`].
    pub n_embd: Option<usize>,
    /// [`GptConfig::block_size`]: the context of every model.
    pub block_size: Option<usize>,
    /// [`GptConfig::vocab_size`].
    pub vocab_size: Option<usize>,
    /// [`GptConfig::tied_head`].
    pub tied_head: Option<bool>,
    /// A Hugging Face checkpoint folder (`config.json`, safetensors, `tokenizer.json`) to
    /// start from; relative to the config file's folder.
    #[serde(default)]
    pub hf_dir: Option<PathBuf>,
    /// A Hugging Face `config.json` (or a preset in `configs/models/`) to build a fresh model
    /// of that family; relative to the config file's folder.
    #[serde(default)]
    pub hf_config: Option<PathBuf>,
    /// The `tokenizer.json` of a Hugging Face family's model (default: `hf_dir`'s); relative
    /// to the config file's folder.
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
}

impl ModelKeys {
    /// The built-in GPT's shape: the keys given, defaults for the rest.
    pub fn shape(&self) -> GptConfig {
        let d = GptConfig::default();
        GptConfig {
            n_layer: self.n_layer.unwrap_or(d.n_layer),
            n_head: self.n_head.unwrap_or(d.n_head),
            n_embd: self.n_embd.unwrap_or(d.n_embd),
            block_size: self.block_size.unwrap_or(d.block_size),
            vocab_size: self.vocab_size.unwrap_or(d.vocab_size),
            tied_head: self.tied_head.unwrap_or(d.tied_head),
        }
    }
}

/// `zerotrain.checkpoint_every` and `zerotrain.eval_every`.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct JobKeys {
    /// `zerotrain train`: save a checkpoint every this many steps (0: only at the end).
    /// Default 0.
    pub checkpoint_every: Option<Count>,
    /// `zerotrain train`: measure the validation loss every this many steps. Default 50.
    pub eval_every: Option<Count>,
}

impl ConfigExtension for AppKeys {
    const KEYS: &'static [&'static str] = &["model", "zerotrain.checkpoint_every", "zerotrain.eval_every"];

    fn known_keys(parent: &str) -> Vec<&'static str> {
        match parent {
            "model" => serde_introspect::<ModelKeys>().to_vec(),
            "zerotrain" => serde_introspect::<JobKeys>().to_vec(),
            _ => Vec::new(),
        }
    }
}

/// The application's settings, resolved and validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppSettings {
    /// The built-in GPT's shape (`vocab_size` 0: from the corpus; `block_size` its default
    /// where the key is not set).
    pub model: GptConfig,
    /// A Hugging Face family's model instead of the built-in GPT.
    pub hf: Option<HfSource>,
    /// `model.block_size` as written: a Hugging Face family's model without it trains at the
    /// smaller of its positions and 1024, and evaluates at its positions.
    pub block_size: Option<usize>,
    /// `model.tokenizer`: the `tokenizer.json` to use instead of `hf_dir`'s.
    pub tokenizer: Option<PathBuf>,
    /// Checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Validation loss every this many steps (at least 1).
    pub eval_every: u64,
}

impl AppSettings {
    /// The Hugging Face family's model these settings name, for
    /// [`load_model`](zerotrain_models::family::load::load_model); refused, naming
    /// `config_file`, where they name the built-in GPT.
    /// With `adapters` ([`adapters`]), the model is fine-tuned with them.
    pub fn hf_model(&self, config_file: &Path, adapters: Option<Adapters>) -> anyhow::Result<ModelSource> {
        let Some(from) = self.hf.clone() else {
            anyhow::bail!(
                "{}: give model.hf_dir (a Hugging Face checkpoint folder) or model.hf_config",
                config_file.display()
            );
        };
        Ok(ModelSource { from, tokenizer: self.tokenizer.clone(), block_size: self.block_size, lora: adapters })
    }
}

/// Makes `plan` record the adapters a training run trains (what its checkpoints' exports
/// read back): `adapter`'s own config where one is given (it rules), and the base model
/// they adapt (`source`'s folder, unless the config names one).
pub fn record_lora(plan: &mut zerotrain::Plan, adapter: Option<&Path>, source: &HfSource) -> anyhow::Result<()> {
    if let Some(dir) = adapter {
        let file = dir.join(zerotrain_models::hf::peft::ADAPTER_CONFIG_FILE);
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file)?)?;
        let quantize = plan.lora.as_ref().and_then(|l| l.quantize);
        let lora = zerotrain::config::LoraPlan::from_json(json, &file.display().to_string())?;
        plan.lora = Some(lora.with_quantize(quantize));
    }
    if let HfSource::Dir(dir) = source {
        let base = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
        plan.lora = plan.lora.take().map(|lora| lora.with_base_model(&base.display().to_string()));
    }
    Ok(())
}

/// The adapters a command's model gets: those of `adapter` (a PEFT adapter folder, from its
/// values), else fresh ones of `plan`'s `zerotrain.lora`, else none. Where both are given,
/// the folder's `adapter_config.json` rules, and a `zerotrain.lora` that disagrees with it
/// is refused naming the key.
pub fn adapters(plan: &zerotrain::Plan, adapter: Option<&Path>) -> anyhow::Result<Option<Adapters>> {
    let Some(dir) = adapter else {
        return Ok(plan.lora.as_ref().map(|l| Adapters::fresh(std::sync::Arc::clone(&l.config))));
    };
    let folder = zerotrain_models::hf::peft::AdapterFolder::read(dir)?;
    if let Some(key) = plan.lora.as_ref().and_then(|l| l.config.first_difference(&folder.config)) {
        anyhow::bail!(
            "zerotrain.lora.{key} disagrees with {}'s adapter_config.json, which rules for --adapter: make them agree, \
             or leave zerotrain.lora out",
            dir.display()
        );
    }
    Ok(Some(Adapters::from_folder(&folder)))
}

impl AppKeys {
    /// Defaults applied, the model's shape checked (a `vocab_size` of 0 is filled in from
    /// the corpus later, so it passes here).
    pub fn resolve(&self) -> Result<AppSettings, ConfigError> {
        self.resolve_in(Path::new("."))
    }

    /// [`resolve`](Self::resolve), with relative `hf_dir` and `hf_config` paths taken
    /// from `base` (the config file's folder).
    pub fn resolve_in(&self, base: &Path) -> Result<AppSettings, ConfigError> {
        let section = self.model.clone().unwrap_or_default();
        let model = section.shape();
        let hf = match (&section.hf_dir, &section.hf_config) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::InvalidValue {
                    origin: "config".into(),
                    key: "model.hf_config".into(),
                    message: "give model.hf_dir (a checkpoint to start from) or model.hf_config (a fresh model of a \
                              config.json), not both"
                        .into(),
                });
            }
            (Some(dir), None) => Some(HfSource::Dir(base.join(dir))),
            (None, Some(file)) => Some(HfSource::Config(base.join(file))),
            (None, None) => None,
        };
        let probe = GptConfig { vocab_size: model.vocab_size.max(1), ..model };
        probe.validate().map_err(|message| {
            let key = message.split_whitespace().next().unwrap_or("model").to_string();
            ConfigError::InvalidValue { origin: "config".into(), key, message }
        })?;
        Ok(AppSettings {
            model,
            hf,
            block_size: section.block_size,
            tokenizer: section.tokenizer.as_ref().map(|t| base.join(t)),
            checkpoint_every: self.zerotrain.checkpoint_every.map_or(0, |c| c.0),
            eval_every: self.zerotrain.eval_every.map_or(50, |c| c.0).max(1),
        })
    }
}

/// Reads `path` into the library's plan and the application's settings.
pub fn load(path: &Path, overrides: Overrides) -> Result<(Plan, AppSettings), ConfigError> {
    let (config, keys) = Config::from_file_with::<AppKeys>(path)?;
    Ok((config.resolve(overrides)?, keys.resolve_in(folder_of(path))?))
}

/// [`load`] for one rank that holds the whole model (`generate`): the layout the config
/// trains at (its tensor- and sequence-parallel mesh, pipeline stages, replica groups and
/// world size) is left out, since a checkpoint loads at any layout, and so are the batch
/// keys that would not fit one rank (only the micro-batch's size, or else the global
/// batch's, is kept: one rank's batch, which generation does not read).
pub fn load_for_one_rank(path: &Path, overrides: Overrides) -> Result<(Plan, AppSettings), ConfigError> {
    let (mut config, keys) = Config::from_file_with::<AppKeys>(path)?;
    let raw = &mut config.raw;
    (raw.tensor_parallel, raw.pipeline, raw.local_sgd) = (None, None, None);
    if let Some(zt) = raw.zerotrain.as_mut() {
        (zt.mesh, zt.world_size) = (None, None);
    }
    raw.gradient_accumulation_steps = None;
    if raw.train_micro_batch_size_per_gpu.is_some() {
        raw.train_batch_size = None;
    }
    let overrides = Overrides { world_size: Some(1), ..overrides };
    Ok((config.resolve(overrides)?, keys.resolve_in(folder_of(path))?))
}

/// The folder of a config file (relative model paths start there).
fn folder_of(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// [`load`], with `--server` and `--group` put into `local_sgd` first (`servers` replaced
/// when any are given): this job as one replica group through parameter servers.
pub fn load_as_group(
    path: &Path,
    overrides: Overrides,
    servers: &[String],
    group: Option<u64>,
) -> Result<(Plan, AppSettings), ConfigError> {
    let (mut config, keys) = Config::from_file_with::<AppKeys>(path)?;
    if !servers.is_empty() || group.is_some() {
        let Some(section) = config.raw.local_sgd.as_mut() else {
            return Err(ConfigError::InvalidValue {
                origin: path.display().to_string(),
                key: if servers.is_empty() { "--group" } else { "--server" }.into(),
                message: "needs a local_sgd section (its groups, sync_every and outer optimizer) in the config".into(),
            });
        };
        if !servers.is_empty() {
            section.servers = servers.to_vec();
        }
        if let Some(group) = group {
            section.group = Some(zerotrain::config::Count(group));
        }
    }
    Ok((config.resolve(overrides)?, keys.resolve_in(folder_of(path))?))
}

/// The application's keys of `path`; the library's keys are checked but not resolved.
pub fn load_keys(path: &Path) -> Result<AppKeys, ConfigError> {
    Ok(Config::from_file_with::<AppKeys>(path)?.1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use zerotrain_models::family::parameter_names;
    use zerotrain_models::hf::HfConfig;

    fn parse(json: &str) -> Result<AppSettings, ConfigError> {
        Config::parse_with::<AppKeys>(json, "test.json")?.1.resolve()
    }

    #[test]
    fn every_shipped_recipe_parses_and_resolves() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/configs");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "json") {
                let overrides = Overrides { total_steps: Some(100), ..Overrides::default() };
                let (plan, _) = load(&path, overrides).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                // A recipe written for GPUs (llama_finetune.json) offloads to host memory,
                // which is where a CPU rank's states are already: on the CPU those keys are
                // notes. Any other note is a key the recipe should not have.
                let gpu_only = |n: &&String| n.contains("rank's") && n.contains("in host memory already");
                let others: Vec<_> = plan.notes.no_effect.iter().filter(|n| !gpu_only(n)).collect();
                assert!(others.is_empty(), "{}: recipes use only implemented keys: {others:?}", path.display());
                n += 1;
            }
        }
        assert!(n >= 5, "expected the zero0..3 and accumulation recipes, found {n}");
    }

    #[test]
    fn the_model_section_is_checked_key_by_key() {
        let s = parse(r#"{"train_batch_size": 1, "model": {"n_layer": 3}}"#).unwrap();
        assert_eq!((s.model.n_layer, s.model.n_embd, s.model.vocab_size), (3, 64, 0));
        let err = parse(r#"{"model": {"n_layers": 3}}"#).unwrap_err().to_string();
        assert!(err.contains("unknown key `model.n_layers` (did you mean `n_layer`?)"), "{err}");
        let err = parse(r#"{"train_batch_size": 1, "model": {"n_embd": 30, "n_head": 4}}"#).unwrap_err().to_string();
        assert!(err.contains("`model.n_embd`") && err.contains("multiple of model.n_head"), "{err}");
        let err = parse(r#"{"train_batch_size": 1, "model": {"block_size": 1}}"#).unwrap_err().to_string();
        assert!(err.contains("`model.block_size`"), "{err}");
    }

    #[test]
    fn cadence_keys_live_in_the_zerotrain_section_beside_the_library_keys() {
        let (config, keys) = Config::parse_with::<AppKeys>(
            r#"{"train_batch_size": 2, "zerotrain": {"world_size": 2, "eval_every": 7, "checkpoint_every": 3}}"#,
            "t",
        )
        .unwrap();
        let s = keys.resolve().unwrap();
        assert_eq!((s.eval_every, s.checkpoint_every), (7, 3));
        assert_eq!(config.resolve(Overrides::default()).unwrap().world_size(), 2);
        let err = Config::parse_with::<AppKeys>(r#"{"zerotrain": {"eval_evry": 7}}"#, "t").unwrap_err();
        assert_eq!(err.to_string(), "t: unknown key `zerotrain.eval_evry` (did you mean `eval_every`?)");
        let err = Config::parse_with::<AppKeys>(r#"{"modle": {}}"#, "t").unwrap_err();
        assert_eq!(err.to_string(), "t: unknown key `modle` (did you mean `model`?)");
    }

    #[test]
    fn the_library_alone_rejects_the_application_keys() {
        let err = Config::parse(r#"{"model": {"n_layer": 3}}"#, "t").unwrap_err();
        assert!(matches!(&err, ConfigError::UnknownKey { key, .. } if key == "model"), "{err}");
        let err = Config::parse(r#"{"zerotrain": {"eval_every": 3}}"#, "t").unwrap_err();
        assert!(matches!(&err, ConfigError::UnknownKey { key, .. } if key == "zerotrain.eval_every"), "{err}");
    }

    /// The recipes decay what Hugging Face's `Trainer` and nanoGPT decay: every matrix and
    /// embedding, no bias and no norm (for these families, exactly the parameters of rank 1).
    #[test]
    fn the_recipes_decay_the_matrices_and_not_the_biases_or_norms() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let groups = |recipe: &str| {
            let overrides = Overrides { total_steps: Some(100), ..Overrides::default() };
            let (plan, _) = load(&root.join("configs").join(recipe), overrides).unwrap();
            plan.optim.param_groups
        };
        let check = |groups: &[zerotrain::config::ParamGroupPlan], config: &HfConfig, what: &str| {
            let names = parameter_names(config);
            for (name, shape) in &names {
                let group = groups.iter().find(|g| g.matches(name));
                // In a group without decay, whatever the optimizer's (0 in the fine-tuning
                // recipe, where the group keeps a raised decay off the norms).
                let undecayed = group.is_some_and(|g| g.weight_decay == 0.0);
                assert_eq!(undecayed, shape.len() == 1, "{what}: {name} {shape:?} in {group:?}");
            }
            assert!(names.iter().any(|(_, s)| s.len() == 1) && names.iter().any(|(_, s)| s.len() == 2), "{what}");
        };
        let gpt2 = HfConfig::read(&root.join("configs/models/gpt2-small.json")).unwrap();
        check(&groups("gpt2_scratch.json"), &gpt2, "gpt2_scratch");
        let llama = groups("llama_finetune.json");
        check(&llama, &HfConfig::read(&root.join("configs/models/llama-100m.json")).unwrap(), "llama-100m");
        // Qwen2's q/k/v biases, Qwen3's per-head query and key norms, an untied head.
        let small = json!({"model_type": "llama", "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
                           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
                           "tie_word_embeddings": false});
        let mut qwen2 = small.clone();
        qwen2["model_type"] = json!("qwen2");
        check(&llama, &HfConfig::from_json(qwen2).unwrap(), "qwen2");
        let mut qwen3 = small;
        qwen3["model_type"] = json!("qwen3");
        qwen3["attention_bias"] = json!(true);
        check(&llama, &HfConfig::from_json(qwen3).unwrap(), "qwen3");
    }
}
