//! LoRA on the built-in GPT: a low-rank adapter beside each linear layer a [`LoraConfig`]
//! names, the rest of the model frozen but its `modules_to_save`.
//!
//! The layers are matched by their module paths, as PEFT matches a model's:
//! `blocks.{i}.attn.query`, `.attn.key`, `.attn.value`, `.attn.output`, `blocks.{i}.mlp_up`,
//! `blocks.{i}.mlp_down`, and the untied `head` (which takes no adapter here: its weight
//! goes whole into the fused loss). PEFT has no default targets for this model, so
//! `target_modules` must be given. A block's adapters live beside its layers
//! (`blocks.{i}.adapters.query.a`, ...): a model without them has exactly the parameters,
//! and so the checkpoints, it had before adapters existed. The frozen base is the model's
//! [`frozen_parameters`](zerotrain::engine::UnitModel::frozen_parameters): at stage 3 the
//! engine shards it with the trained parameters and saves none of it.

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::Linear;
use burn::tensor::{Device, Tensor};
use zerotrain::engine::ParamCount;
use zerotrain::estimate::FrozenSizes;
use zerotrain::nn::lora::{AdapterCut, LoraAdapter, LoraConfig, modules_above};
use zerotrain::nn::parallel::{ParallelGroup, Split};

use super::{Block, Gpt, GptConfig};
use crate::family::LoraSizes;

/// A block's linear layers, by module path below the block, and whether each is
/// column-parallel on a tensor-parallel mesh (Megatron's plan: its output features split;
/// else its input features, as attention's output and the MLP's down projection are).
/// Each layer's adapter is named as the path's last part (`adapters.query`, ...).
pub(super) const LAYERS: [(&str, bool); 6] = [
    ("attn.query", true),
    ("attn.key", true),
    ("attn.value", true),
    ("attn.output", false),
    ("mlp_up", true),
    ("mlp_down", false),
];

/// The adapters of one block's six linear layers (`None`: the layer alone).
#[derive(Module, Debug)]
pub struct BlockAdapters {
    query: Option<LoraAdapter>,
    key: Option<LoraAdapter>,
    value: Option<LoraAdapter>,
    output: Option<LoraAdapter>,
    mlp_up: Option<LoraAdapter>,
    mlp_down: Option<LoraAdapter>,
}

impl BlockAdapters {
    /// The adapters of [`LAYERS`], in its order.
    fn from_layers([query, key, value, output, mlp_up, mlp_down]: [Option<LoraAdapter>; 6]) -> Self {
        Self { query, key, value, output, mlp_up, mlp_down }
    }

    /// No adapters.
    pub(super) fn none() -> Self {
        Self::from_layers(Default::default())
    }

    /// The adapters of [`LAYERS`], in its order.
    pub(super) fn layers(&self) -> [&Option<LoraAdapter>; 6] {
        [&self.query, &self.key, &self.value, &self.output, &self.mlp_up, &self.mlp_down]
    }

    /// On a tensor-parallel mesh, each adapter's factor cut as its base is cut, by path
    /// below the block: B's rows under a column-parallel base, A's columns under a
    /// row-parallel one.
    pub(super) fn cuts(&self) -> Vec<(String, Split)> {
        (LAYERS.iter().zip(self.layers()))
            .filter(|(_, adapter)| adapter.is_some())
            .map(|(&(path, column), _)| match column {
                true => (format!("adapters.{}.b", name(path)), Split::Even { dim: 0, blocks: 1 }),
                false => (format!("adapters.{}.a", name(path)), Split::Even { dim: 1, blocks: 1 }),
            })
            .collect()
    }

    /// These adapters as a rank's parts, their factors cut by [`cuts`](Self::cuts), over
    /// the tensor-parallel `group`.
    pub(super) fn on_mesh(self, group: &ParallelGroup) -> Self {
        let Self { query, key, value, output, mlp_up, mlp_down } = self;
        let layers =
            [query, key, value, output, mlp_up, mlp_down].into_iter().zip(LAYERS).map(|(adapter, (_, column))| {
                let cut = if column { AdapterCut::Column(group.clone()) } else { AdapterCut::Row(group.clone()) };
                adapter.map(|a| a.with_cut(cut))
            });
        Self::from_layers(layers.collect::<Vec<_>>().try_into().expect("one adapter or none a layer"))
    }
}

/// The module paths of the linear layers of `blocks` blocks, block by block in
/// [`LAYERS`]' order.
pub(super) fn block_linears(blocks: usize) -> impl Iterator<Item = String> {
    (0..blocks).flat_map(|i| LAYERS.map(|(path, _)| format!("blocks.{i}.{path}")))
}

/// The adapter's name of the layer at `path` below a block: its last part.
fn name(path: &str) -> &str {
    path.rsplit('.').next().unwrap_or(path)
}

/// `y`, the output of a layer for input `x`, plus `adapter`'s update of `x` where there is one.
pub(super) fn adapted(adapter: &Option<LoraAdapter>, y: Tensor<3>, x: Tensor<3>) -> Tensor<3> {
    match adapter {
        Some(adapter) => y + adapter.delta(x),
        None => y,
    }
}

impl Block {
    /// The block's linear layers, in [`LAYERS`]' order.
    fn linears(&self) -> [&Linear; 6] {
        let attn = &self.attn;
        [&attn.query, &attn.key, &attn.value, &attn.output, &self.mlp_up, &self.mlp_down]
    }
}

impl Gpt {
    /// This model fine-tuned with `lora`: every parameter frozen but those of the modules
    /// `modules_to_save` names, and a fresh adapter (as `init_lora_weights` says: B zero,
    /// so the model starts as it was) on each linear layer `target_modules` names (module
    /// docs for the paths). The whole model: a mesh's parts get theirs from
    /// [`Gpt::new_split_adapted`].
    ///
    /// # Errors
    /// No `target_modules`; targets naming no layer (the message names a few that exist) or
    /// the head; a `modules_to_save` entry naming no module; two `rank_pattern` (or
    /// `alpha_pattern`) entries naming one layer. Each message names the key.
    pub fn with_lora(self, lora: &LoraConfig) -> Result<Self, String> {
        if self.mesh.is_some() {
            return Err("zerotrain.lora: adapters go on the whole model, before it is split over a mesh \
                        (Gpt::new_split_adapted)"
                .into());
        }
        if lora.target_modules.is_none() {
            return Err("zerotrain.lora.target_modules: the built-in GPT has no default targets (PEFT has none for \
                        it): name its layers, such as [\"query\", \"value\"], or give \"all-linear\""
                .into());
        }
        let named = |e: String| format!("zerotrain.lora.{e}");
        let blocks = self.blocks.len();
        let mut linears: Vec<(String, bool)> = block_linears(blocks).map(|path| (path, false)).collect();
        if self.head.is_some() {
            linears.push(("head".into(), true));
        }
        let mut freeze = Freeze { path: Vec::new(), lora, params: Vec::new(), frozen: Vec::new() };
        let mut model = self.map(&mut freeze);
        lora.check_against(&linears, &modules_above(freeze.params.iter().map(String::as_str)), &[]).map_err(named)?;
        if model.head.is_some() && lora.adapter("head", true, true, &[]).map_err(named)?.is_some() {
            return Err("zerotrain.lora.target_modules names the built-in GPT's output head (`head`), which takes no \
                        adapter: name the blocks' layers, or put \"head\" in modules_to_save to train it whole"
                .into());
        }
        model.frozen = freeze.frozen;
        for (block, paths) in model.blocks.iter_mut().zip(linears.chunks(LAYERS.len())) {
            let mut made = Vec::with_capacity(LAYERS.len());
            for (linear, (path, _)) in block.linears().into_iter().zip(paths) {
                // From the lazy shape: a base not yet drawn stays undrawn (the engine draws it).
                let [d_in, d_out] = linear.weight.lazy_shape().dims();
                let device = linear.weight.lazy_device();
                let spec = lora.adapter(path, true, false, &[]).map_err(named)?;
                made.push(spec.map(|spec| LoraAdapter::init(d_in, d_out, &spec, &device)));
            }
            block.adapters = BlockAdapters::from_layers(made.try_into().expect("one adapter or none a layer"));
        }
        Ok(model)
    }
}

/// The built-in GPT of shape `config` fine-tuned with `lora`: its trained parameters (the
/// adapters and `modules_to_save`) and its frozen base, counted from the model built with
/// them, nothing drawn. The errors of [`Gpt::with_lora`].
pub fn lora_sizes(config: &GptConfig, lora: &LoraConfig) -> Result<LoraSizes, String> {
    let model = Gpt::new(config, &Device::flex().autodiff()).with_lora(lora)?;
    let trained = ParamCount::trainable(&model);
    // The blocks' frozen weights (`quantizable_parameters`), unless modules_to_save trains them.
    let linears = model.blocks.iter().flat_map(Block::linears);
    let layer_matrices: Vec<u64> = (linears.zip(block_linears(model.blocks.len())))
        .filter(|(_, path)| !lora.trains_whole(&format!("{path}.weight")))
        .map(|(linear, _)| linear.weight.lazy_shape().num_elements() as u64)
        .collect();
    let rest = model.num_params() as u64 - trained - layer_matrices.iter().sum::<u64>();
    let frozen = FrozenSizes { layer_matrices, rest };
    Ok(LoraSizes { trained, frozen })
}

/// Freezes every float parameter but those `lora` trains whole (in `modules_to_save`), and
/// lists the paths of every parameter and of those it froze.
struct Freeze<'a> {
    path: Vec<String>,
    lora: &'a LoraConfig,
    params: Vec<String>,
    frozen: Vec<String>,
}

impl ModuleMapper for Freeze<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let path = self.path.join(".");
        let trains = self.lora.trains_whole(&path);
        if !trains {
            self.frozen.push(path.clone());
        }
        self.params.push(path);
        if trains { param } else { param.set_require_grad(false) }
    }
}
