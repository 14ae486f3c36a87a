//! A Hugging Face family's model: built fresh from a `config.json` ([`fresh`]) or imported
//! from a checkpoint folder, its parameters read lazily one unit at a time ([`import`]),
//! loaded with its tokenizer as a config names it ([`load`]), and written back as a Hugging
//! Face folder ([`export`]).

pub mod base;
pub mod companions;
pub mod export;
pub mod load;
pub mod merge;

use std::path::Path;
use std::sync::Arc;

use burn::tensor::Device;

use crate::hf::files::TensorFiles;
use crate::hf::size::ModelSize;
use crate::hf::weights::Weights;
use crate::hf::{CONFIG_FILE, Family, HfConfig};
use crate::{CausalLm, Gpt2, Llama, gpt2, llama};
use zerotrain::nn::lora::LoraConfig;
use zerotrain::nn::parallel::ParallelGroups;

/// A built-in model of either family.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant, reason = "one per rank, moved a few times while it is built")]
pub enum HfModel {
    /// GPT-2.
    Gpt2(Gpt2),
    /// The LLaMA family.
    Llama(Llama),
}

/// Code run on whichever family a model is ([`HfModel::run`]).
pub trait WithModel {
    /// What the code returns.
    type Output;
    /// Runs on `model`.
    fn run<M: CausalLm>(self, model: M) -> Self::Output;
}

impl HfModel {
    /// The model as the family type `M`, if it is one (for code generic over the families
    /// that builds another model of the same family: a tensor-parallel rank's part).
    pub fn into_model<M: 'static>(self) -> Option<M> {
        let any: Box<dyn std::any::Any> = match self {
            Self::Gpt2(m) => Box::new(m),
            Self::Llama(m) => Box::new(m),
        };
        any.downcast().ok().map(|m| *m)
    }

    /// Runs `job` on the model.
    pub fn run<J: WithModel>(self, job: J) -> J::Output {
        match self {
            Self::Gpt2(m) => job.run(m),
            Self::Llama(m) => job.run(m),
        }
    }
}

fn build(config: &HfConfig, w: &Weights) -> HfModel {
    match &config.family {
        Family::Gpt2(shape) => HfModel::Gpt2(Gpt2::new(shape, w)),
        Family::Llama(shape) => HfModel::Llama(Llama::new(shape, w)),
    }
}

/// A fresh model of `config` on `device` (Hugging Face's initialisation: N(0,
/// `initializer_range`) for projections and embeddings, norms at one, biases at zero),
/// every value drawn from `seed` and its parameter's name, as [`fresh_split`] draws them:
/// so a run of one seed starts from the same model at every layout (tensor or sequence
/// parallel, any number of data-parallel ranks), and a seed alone names it.
pub fn fresh(config: &HfConfig, device: &Device, seed: u64) -> HfModel {
    build(config, &Weights::fresh(device, initializer_range(config)).with_groups(&ParallelGroups::alone(), seed))
}

/// [`fresh`] for a rank of a device mesh's `groups`: its part of the model ([`Llama::new`],
/// [`Gpt2::new`]) for its tensor group, its units running its part of every sequence for
/// its sequence group; every value drawn from `seed` and the parameter's name, so that the
/// ranks' parts make one model (the one every group size draws); an error naming the
/// config field that does not divide over the groups.
pub fn fresh_split(config: &HfConfig, device: &Device, groups: &ParallelGroups, seed: u64) -> Result<HfModel, String> {
    fresh_adapted(config, device, groups, seed, None)
}

/// [`fresh_split`] fine-tuned with low-rank adapters where `lora` is given
/// ([`Weights::with_lora`]: the base frozen, adapters drawn from `seed`); an error naming
/// the LoRA key that names nothing, or the config field that does not divide.
pub fn fresh_adapted(
    config: &HfConfig,
    device: &Device,
    groups: &ParallelGroups,
    seed: u64,
    lora: Option<&Adapters>,
) -> Result<HfModel, String> {
    let w = adapting(Weights::fresh(device, initializer_range(config)).with_groups(groups, seed), config, lora, seed);
    let model = build(config, &w);
    w.finish(|_| false)?;
    Ok(model)
}

/// The parameters of `config`'s model fine-tuned with `lora`'s adapters: the trained ones
/// (the adapters and `modules_to_save`) and the frozen base's, counted from a lazy build
/// (nothing of the base is drawn); an error naming the LoRA key that names nothing.
pub fn lora_sizes(config: &HfConfig, lora: &Arc<LoraConfig>) -> Result<LoraSizes, String> {
    let w = Weights::fresh(&Device::flex(), 0.0).with_lora(Arc::clone(lora), default_lora_targets(config), 0);
    build(config, &w);
    let asked = w.asked();
    w.finish(|_| false)?;
    let mut sizes = LoraSizes { trained: 0, frozen: FrozenSizes::default() };
    for (name, shape) in asked {
        let n: u64 = shape.iter().map(|&d| d as u64).product();
        // A layer's tensors are those under a numbered module (`model.layers.3.`, `h.0.`).
        let in_layer = name.split('.').any(|part| part.parse::<usize>().is_ok());
        match crate::hf::peft::tensor_name(&name).is_some() || lora.trains_whole(&name) {
            true => sizes.trained += n,
            false if in_layer && shape.len() == 2 => sizes.frozen.layer_matrices.push(n),
            false => sizes.frozen.rest += n,
        }
    }
    Ok(sizes)
}

/// [`lora_sizes`]' counts.
#[derive(Debug, Clone, Default)]
pub struct LoraSizes {
    /// Parameters that train.
    pub trained: u64,
    /// The frozen base's.
    pub frozen: FrozenSizes,
}

pub use zerotrain::estimate::FrozenSizes;

/// PEFT's default targets of `config`'s family, where a LoRA config names none
/// (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`).
pub fn default_lora_targets(config: &HfConfig) -> &'static [&'static str] {
    match config.family {
        Family::Gpt2(_) => &["c_attn"],
        Family::Llama(_) => &["q_proj", "v_proj"],
    }
}

/// The low-rank adapters a model is fine-tuned with: PEFT's config, and the tensors of an
/// adapter to start from (fresh ones otherwise).
#[derive(Debug, Clone)]
pub struct Adapters {
    /// Which layers get adapters, of what rank.
    pub config: Arc<LoraConfig>,
    /// An adapter's `adapter_model.safetensors`.
    pub files: Option<Arc<TensorFiles>>,
}

impl Adapters {
    /// Fresh adapters of `config`.
    pub fn fresh(config: Arc<LoraConfig>) -> Self {
        Self { config, files: None }
    }

    /// The adapter PEFT wrote in `folder`, to start from.
    pub fn from_folder(folder: &crate::hf::peft::AdapterFolder) -> Self {
        Self { config: Arc::clone(&folder.config), files: Some(Arc::clone(&folder.files)) }
    }
}

/// `w` adapting the layers `lora` names, if given.
fn adapting(w: Weights, config: &HfConfig, lora: Option<&Adapters>, seed: u64) -> Weights {
    let Some(lora) = lora else { return w };
    let w = w.with_lora(Arc::clone(&lora.config), default_lora_targets(config), seed);
    match &lora.files {
        Some(files) => w.with_adapter_files(Arc::clone(files)),
        None => w,
    }
}

/// Whether `config`'s model splits over a mesh of `tp` tensor and `sp` sequence ranks as
/// training would split it: its first rank's part is built (lazily: nothing is drawn or
/// allocated) and every refusal named, by config field, as [`fresh_split`] names it.
/// `config check` runs it, so that it refuses what `train` refuses.
pub fn check_split(config: &HfConfig, tp: usize, sp: usize) -> Result<(), String> {
    if tp * sp == 1 {
        return Ok(());
    }
    let group = |n: usize| {
        let world = zerotrain_zero::ThreadWorld::new(n, std::time::Duration::from_secs(1));
        zerotrain::nn::parallel::ParallelGroup::new(std::sync::Arc::new(world.communicator(0)))
    };
    let groups = ParallelGroups { tensor: group(tp), sequence: group(sp) };
    fresh_split(config, &Device::flex(), &groups, 0).map(|_| ())
}

/// The standard deviation of fresh projections and embeddings.
fn initializer_range(config: &HfConfig) -> f64 {
    config.json.get("initializer_range").and_then(|v| v.as_f64()).unwrap_or(0.02)
}

/// A problem importing a checkpoint folder, naming the file and the tensor.
#[derive(Debug, thiserror::Error)]
#[error("cannot import the Hugging Face checkpoint {dir}: {message}")]
pub struct ImportError {
    /// The folder.
    pub dir: String,
    /// What is wrong, naming the file and the tensor.
    pub message: String,
}

/// The checkpoint in `dir`: its config and the model, every parameter a lazy read of its
/// tensor (converted to f32 exactly). Every tensor the model needs is checked (present,
/// float, of the config's shape) and every tensor the files hold must have a place.
pub fn import(dir: &Path, device: &Device) -> Result<(HfConfig, HfModel), ImportError> {
    import_split(dir, device, &ParallelGroups::alone())
}

/// [`import`] for a rank of a device mesh's `groups`: its part of the model ([`Llama::new`],
/// [`Gpt2::new`]), each split parameter a lazy read of its slice.
pub fn import_split(dir: &Path, device: &Device, groups: &ParallelGroups) -> Result<(HfConfig, HfModel), ImportError> {
    import_adapted(dir, device, groups, None, 0)
}

/// [`import_split`] fine-tuned with low-rank adapters where `lora` is given
/// ([`Weights::with_lora`]: the checkpoint's weights frozen, fresh adapters drawn from
/// `seed`).
pub fn import_adapted(
    dir: &Path,
    device: &Device,
    groups: &ParallelGroups,
    lora: Option<&Adapters>,
    seed: u64,
) -> Result<(HfConfig, HfModel), ImportError> {
    let fail = |message: String| ImportError { dir: dir.display().to_string(), message };
    let config = HfConfig::read(&dir.join(CONFIG_FILE)).map_err(|e| fail(e.to_string()))?;
    let files = TensorFiles::open(dir).map_err(|e| fail(e.to_string()))?;
    let size = ModelSize::of(&config);
    let held = files.names().count() as u64;
    // A few missing tensors are named one by one below, once built; a config asking for
    // far more than the files hold (millions of layers) is refused before anything is
    // built for it.
    if size.tensors > held.saturating_add(1024) {
        return Err(fail(format!(
            "{CONFIG_FILE} asks for a model of {} tensors ({} layers), but its files hold {held}: the config is not \
             the weights' (nothing was built)",
            size.tensors,
            config.num_layers()
        )));
    }
    let model = match &config.family {
        Family::Gpt2(shape) => {
            let w =
                adapting(Weights::from_files(device, files, gpt2::alias).with_groups(groups, 0), &config, lora, seed);
            let model = Gpt2::new(shape, &w);
            w.finish(gpt2::ignored).map_err(fail)?;
            HfModel::Gpt2(model)
        }
        Family::Llama(shape) => {
            let w = adapting(Weights::from_files(device, files, |_| None).with_groups(groups, 0), &config, lora, seed);
            let model = Llama::new(shape, &w);
            let tied = shape.tie_word_embeddings;
            w.finish(|name| llama::ignored(name, tied)).map_err(fail)?;
            HfModel::Llama(model)
        }
    };
    Ok((config, model))
}

/// The module path and shape of every parameter a model of `config` has, in order (the
/// tensors an export writes).
pub fn parameter_names(config: &HfConfig) -> Vec<(String, Vec<usize>)> {
    let w = Weights::fresh(&Device::flex(), 0.02);
    build(config, &w);
    w.asked()
}

#[cfg(test)]
mod tests;
