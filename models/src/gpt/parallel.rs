//! The built-in GPT on a device mesh: Megatron-LM's plan for its layers, each rank's part
//! cut from the values the whole model starts from.

use std::collections::BTreeMap;

use burn::tensor::Device;
use zerotrain::nn::lora::LoraConfig;
use zerotrain::nn::parallel::{ModelSplit, ParallelGroups, Split, split_module};

use super::lora::LAYERS;
use super::{Gpt, GptConfig};
use crate::mesh_part::MeshPart;

impl Gpt {
    /// This rank's part of the model of shape `config`, on `device`, for a device mesh's
    /// `groups`, starting from exactly the values the whole model starts from in an engine
    /// run seeded with `seed` (each split parameter drawn whole as the engine would draw
    /// it, then cut: [`split_module`]; the others left for the engine to draw).
    ///
    /// Megatron-LM's plan: attention's query, key and value and the MLP's up projection
    /// split by output features (a rank holds `n_head / tp` heads), attention's output
    /// and the MLP's down projection by input features, the token embedding (and so a tied
    /// head) and an untied head by vocabulary (parts that differ by one where it does not
    /// divide); norms, positions and the row-parallel biases whole. With sequence
    /// parallelism each rank's units run its consecutive part of every sequence (positions
    /// from its first) and attention trades parts for heads (DeepSpeed-Ulysses).
    ///
    /// # Errors
    /// Heads that do not divide by tp x sp (`model.n_head`), a context that does not divide
    /// by sp (`model.block_size`), fewer ids than tensor ranks (`model.vocab_size`).
    pub fn new_split(config: &GptConfig, device: &Device, groups: &ParallelGroups, seed: u64) -> Result<Self, String> {
        Self::new_split_adapted(config, device, groups, seed, None)
    }

    /// [`new_split`](Self::new_split) of the model fine-tuned with `lora`'s adapters
    /// ([`Gpt::with_lora`] on the whole model, then cut): each adapter follows its base's
    /// cut, B's rows under a column-parallel layer and A's columns under a row-parallel one,
    /// from the values the whole adapter starts from.
    ///
    /// # Errors
    /// Those of [`new_split`](Self::new_split) and [`Gpt::with_lora`].
    pub fn new_split_adapted(
        config: &GptConfig,
        device: &Device,
        groups: &ParallelGroups,
        seed: u64,
        lora: Option<&LoraConfig>,
    ) -> Result<Self, String> {
        let (tp, sp) = (groups.tensor.size(), groups.sequence.size());
        config.check_mesh(tp, sp)?;
        let whole = match lora {
            Some(lora) => Self::new(config, device).with_lora(lora)?,
            None => Self::new(config, device),
        };
        let splits = if tp > 1 { plan(&whole, config) } else { BTreeMap::new() };
        let mut part = split_module(whole, &splits, &groups.tensor, seed).map_err(|e| e.to_string())?;
        for block in &mut part.blocks {
            block.attn.n_heads = config.n_head / tp;
            block.attn.d_model = config.n_embd / tp;
            if tp > 1 {
                let adapters = std::mem::replace(&mut block.adapters, super::BlockAdapters::none());
                block.adapters = adapters.on_mesh(&groups.tensor);
            }
        }
        let split = ModelSplit { tensor: groups.tensor.clone(), splits, sequence: groups.sequence.clone() };
        part.mesh = Some(MeshPart::new(split, config.vocab_size));
        Ok(part)
    }
}

impl GptConfig {
    /// Whether this shape splits over `tp` tensor and `sp` sequence ranks
    /// ([`Gpt::new_split`]); the error names the field that does not divide.
    pub fn check_mesh(&self, tp: usize, sp: usize) -> Result<(), String> {
        if !self.n_head.is_multiple_of(tp * sp) {
            return Err(format!(
                "model.n_head ({}) does not divide by the tensor- times the sequence-parallel size {tp} x {sp}",
                self.n_head
            ));
        }
        if !self.block_size.is_multiple_of(sp) {
            return Err(format!(
                "model.block_size ({}) does not divide by the sequence-parallel size {sp}: each rank runs an equal \
                 part of every sequence",
                self.block_size
            ));
        }
        if self.vocab_size < tp {
            return Err(format!(
                "model.vocab_size ({}) has fewer ids than the tensor-parallel size {tp}",
                self.vocab_size
            ));
        }
        Ok(())
    }
}

/// Each split parameter's cut, by module path. Burn's `Linear` stores its weight `[d_in,
/// d_out]`: a column-parallel layer's weight is cut along dimension 1 and its bias with
/// it, a row-parallel layer's weight along dimension 0 (its bias whole, added once after
/// the group's sum). The key projection has no bias. Each adapter of `model`'s blocks is
/// cut as its layer ([`BlockAdapters::cuts`](super::BlockAdapters)).
fn plan(model: &Gpt, config: &GptConfig) -> BTreeMap<String, Split> {
    let (by_output, by_input) = (Split::Even { dim: 1, blocks: 1 }, Split::Even { dim: 0, blocks: 1 });
    let mut plan = BTreeMap::from([("token.weight".to_string(), Split::Uneven { dim: 0 })]);
    for (i, block) in model.blocks.iter().enumerate() {
        let mut cut = |param: &str, split| plan.insert(format!("blocks.{i}.{param}"), split);
        for (layer, column) in LAYERS {
            cut(&format!("{layer}.weight"), if column { by_output } else { by_input });
            if column && layer != "attn.key" {
                cut(&format!("{layer}.bias"), by_input);
            }
        }
        for (path, split) in block.adapters.cuts() {
            cut(&path, split);
        }
    }
    if !config.tied_head {
        plan.insert("head.weight".into(), Split::Uneven { dim: 1 });
        plan.insert("head.bias".into(), Split::Uneven { dim: 0 });
    }
    plan
}
