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

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::nn::Linear;
use burn::tensor::Tensor;
use zerotrain::nn::lora::{AdapterCut, LoraAdapter, LoraConfig};
use zerotrain::nn::parallel::{ParallelGroup, Split};

use super::{Block, Gpt};

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
    /// No adapters.
    pub(super) fn none() -> Self {
        Self { query: None, key: None, value: None, output: None, mlp_up: None, mlp_down: None }
    }

    /// The adapters of the attention's projections and the MLP's two layers, in that order.
    pub(super) fn layers(&self) -> [&Option<LoraAdapter>; 6] {
        [&self.query, &self.key, &self.value, &self.output, &self.mlp_up, &self.mlp_down]
    }

    /// On a tensor-parallel mesh (Megatron's plan: the projections and the MLP's first
    /// layer split by output features, attention's output and the MLP's second layer by
    /// input features), each adapter's factor cut as its base is cut, by path below the
    /// block: B's rows under a column-parallel base, A's columns under a row-parallel one.
    pub(super) fn cuts(&self) -> Vec<(String, Split)> {
        let (rows, columns) = (Split::Even { dim: 0, blocks: 1 }, Split::Even { dim: 1, blocks: 1 });
        let names = ["query", "key", "value", "output", "mlp_up", "mlp_down"];
        let column_parallel = [true, true, true, false, true, false];
        (names.iter().zip(column_parallel).zip(self.layers()))
            .filter(|(_, adapter)| adapter.is_some())
            .map(|((name, column), _)| match column {
                true => (format!("adapters.{name}.b"), rows),
                false => (format!("adapters.{name}.a"), columns),
            })
            .collect()
    }

    /// These adapters as a rank's parts, their factors cut by [`cuts`](Self::cuts), over
    /// the tensor-parallel `group`.
    pub(super) fn on_mesh(self, group: &ParallelGroup) -> Self {
        let column = |a: Option<LoraAdapter>| a.map(|a| a.with_cut(AdapterCut::Column(group.clone())));
        let row = |a: Option<LoraAdapter>| a.map(|a| a.with_cut(AdapterCut::Row(group.clone())));
        Self {
            query: column(self.query),
            key: column(self.key),
            value: column(self.value),
            output: row(self.output),
            mlp_up: column(self.mlp_up),
            mlp_down: row(self.mlp_down),
        }
    }
}

/// `y`, the output of a layer for input `x`, plus `adapter`'s update of `x` where there is one.
pub(super) fn adapted(adapter: &Option<LoraAdapter>, y: Tensor<3>, x: Tensor<3>) -> Tensor<3> {
    match adapter {
        Some(adapter) => y + adapter.delta(x),
        None => y,
    }
}

impl Block {
    /// The block's six linear layers with their module paths below the block, in
    /// [`BlockAdapters::layers`]' order.
    fn linears(&self) -> [(&'static str, &Linear); 6] {
        let attn = &self.attn;
        [
            ("attn.query", &attn.query),
            ("attn.key", &attn.key),
            ("attn.value", &attn.value),
            ("attn.output", &attn.output),
            ("mlp_up", &self.mlp_up),
            ("mlp_down", &self.mlp_down),
        ]
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
    pub fn with_lora(mut self, lora: &LoraConfig) -> Result<Self, String> {
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
        let mut linears: Vec<(String, bool)> = Vec::new();
        for (i, block) in self.blocks.iter().enumerate() {
            linears.extend(block.linears().map(|(name, _)| (format!("blocks.{i}.{name}"), false)));
        }
        if self.head.is_some() {
            linears.push(("head".into(), true));
        }
        lora.check_against(&linears, &module_paths(&self), &[]).map_err(|e| format!("zerotrain.lora.{e}"))?;
        if self.head.is_some()
            && lora.adapter("head", true, true, &[]).map_err(|e| format!("zerotrain.lora.{e}"))?.is_some()
        {
            return Err("zerotrain.lora.target_modules names the built-in GPT's output head (`head`), which takes no \
                        adapter: name the blocks' layers, or put \"head\" in modules_to_save to train it whole"
                .into());
        }
        let mut freeze = Freeze { path: Vec::new(), lora, frozen: Vec::new() };
        self = self.map(&mut freeze);
        self.frozen = freeze.frozen;
        for (i, block) in self.blocks.iter_mut().enumerate() {
            let mut made = Vec::with_capacity(6);
            for (name, linear) in block.linears() {
                let spec = lora
                    .adapter(&format!("blocks.{i}.{name}"), true, false, &[])
                    .map_err(|e| format!("zerotrain.lora.{e}"))?;
                // From the lazy shape: a base not yet drawn stays undrawn (the engine draws it).
                let [d_in, d_out] = linear.weight.lazy_shape().dims();
                let device = linear.weight.lazy_device();
                made.push(spec.map(|spec| LoraAdapter::init(d_in, d_out, &spec, &device)));
            }
            let [query, key, value, output, mlp_up, mlp_down]: [Option<LoraAdapter>; 6] =
                made.try_into().expect("six layers");
            block.adapters = BlockAdapters { query, key, value, output, mlp_up, mlp_down };
        }
        Ok(self)
    }
}

/// Every module path of `model` that holds a parameter, at any depth (`blocks.0`,
/// `blocks.0.attn`, `blocks.0.attn.query`, ...).
fn module_paths<M: Module>(model: &M) -> Vec<String> {
    struct Paths {
        path: Vec<String>,
        found: Vec<String>,
    }
    impl ModuleVisitor for Paths {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
            // The parameter's own name is the path's last part; every module above it counts.
            for depth in 1..self.path.len() {
                let module = self.path[..depth].join(".");
                if !self.found.contains(&module) {
                    self.found.push(module);
                }
            }
        }
    }
    let mut paths = Paths { path: Vec::new(), found: Vec::new() };
    model.visit(&mut paths);
    paths.found
}

/// Freezes every float parameter but those of the modules `lora` trains whole
/// (`modules_to_save`), and lists the paths of those it froze.
struct Freeze<'a> {
    path: Vec<String>,
    lora: &'a LoraConfig,
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
        // A saved module trains whole: the parameter is in one where any module above it is.
        let saved = (1..self.path.len()).any(|depth| self.lora.saves(&self.path[..depth].join(".")));
        if saved {
            return param;
        }
        self.frozen.push(self.path.join("."));
        param.set_require_grad(false)
    }
}
