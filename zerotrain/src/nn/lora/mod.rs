//! LoRA (low-rank adaptation, Hu et al. 2021; PEFT's `LoraLayer`): a linear layer left
//! frozen and a trained low-rank update beside it,
//! `y = base(x) + B(A(dropout(x))) * scaling`, `A` `[r, in]` and `B` `[out, r]` stored as
//! PEFT stores them. [`LoraAdapter`] is the update, for any layer's input;
//! [`LoraLinear`] is Burn's `Linear` with one; the Hugging Face families of
//! `zerotrain-models` put one on each projection a [`LoraConfig`] names.
//!
//! Burn 0.22's own `Lora` reparameterises the weight (`W + scale * a b`, built every forward),
//! so its backward computes a weight-sized gradient for every adapted layer and it cannot
//! apply dropout to the input as PEFT's forward does; this adapter only ever multiplies the
//! input by the factors, so a frozen base gets no weight gradient at all.
//!
//! # Note: adapters on a tensor-parallel mesh
//! The adapter follows its base's cut (torchtitan's rule). A column-parallel base (output
//! features split) gets A whole and B cut as the base's rows: each rank computes its rows of
//! the update from the input the base's region entered with, so the input's gradient is
//! the ranks' partial sum the region's copy already adds up; A's own gradient is such a
//! partial sum too, so A enters through the group's copy (`f`: its value unchanged, its
//! gradient summed), and every rank holds the unsplit run's gradient of A. A row-parallel
//! base (input features split) gets A cut on its input and B whole: the ranks' partial
//! `A x` are summed (`g`) before B, and the update is added after the base's own sum.

pub mod config;
mod matching;
mod peft_file;

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear};
use burn::tensor::module::linear;
use burn::tensor::{Device, Tensor};

pub use self::config::{AdapterSpec, LoraConfig, LoraInit, Targets};
pub use self::matching::modules_above;
use super::parallel::ParallelGroup;

/// Where an adapter's base layer sits on a tensor-parallel mesh (see the module note).
#[derive(Debug, Clone, Default)]
pub enum AdapterCut {
    /// The whole layer on every rank.
    #[default]
    Whole,
    /// The base's output features are split over the group: B is cut as its rows.
    Column(ParallelGroup),
    /// The base's input features are split over the group: A is cut as its columns.
    Row(ParallelGroup),
}

/// The trained low-rank update of one linear layer (module docs).
#[derive(Module, Debug)]
pub struct LoraAdapter {
    /// `lora_A.weight`, `[r, in]` (this rank's input columns under a row-parallel base).
    pub a: Param<Tensor<2>>,
    /// `lora_B.weight`, `[out, r]` (this rank's output rows under a column-parallel base).
    pub b: Param<Tensor<2>>,
    dropout: Dropout,
    #[module(skip)]
    scaling: f64,
    #[module(skip)]
    cut: AdapterCut,
}

impl LoraAdapter {
    /// The adapter of `spec` with factors `a` `[r, in]` and `b` `[out, r]` (as this rank
    /// holds them under `cut`).
    pub fn new(a: Param<Tensor<2>>, b: Param<Tensor<2>>, spec: &AdapterSpec, cut: AdapterCut) -> Self {
        Self { a, b, dropout: DropoutConfig::new(spec.dropout).init(), scaling: spec.scaling, cut }
    }

    /// A fresh, whole adapter for a layer of `d_in` inputs and `d_out` outputs, started as
    /// `spec.init` says (PEFT's `init_lora_weights`).
    pub fn init(d_in: usize, d_out: usize, spec: &AdapterSpec, device: &Device) -> Self {
        let [a, b] = initializers(spec, d_in);
        Self::new(a.init([spec.r, d_in], device), b.init([d_out, spec.r], device), spec, AdapterCut::Whole)
    }

    /// This adapter as one rank's part under a tensor-parallel base cut as `cut`, its
    /// factors already cut to match (module note).
    pub fn with_cut(self, cut: AdapterCut) -> Self {
        Self { cut, ..self }
    }

    /// The factor of `B A x`.
    pub fn scaling(&self) -> f64 {
        self.scaling
    }

    /// `B(A(dropout(x))) * scaling` over the last dimension of `x` (the input as the base
    /// layer takes it: entered through a column-parallel region's copy, or this rank's
    /// input features under a row-parallel base); this rank's part of the update, to add to
    /// its part of the base's output (after the row-parallel base's sum).
    pub fn delta<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let x = self.dropout.forward(x);
        let a = match &self.cut {
            AdapterCut::Column(group) => group.copy_to(self.a.val()),
            _ => self.a.val(),
        };
        let down = linear(x, a.transpose(), None);
        let down = match &self.cut {
            AdapterCut::Row(group) => group.reduce_from(down),
            _ => down,
        };
        linear(down, self.b.val().transpose(), None).mul_scalar(self.scaling)
    }

    /// The update as this rank's part of a weight `[out, in]`, `scaling * B A` (what
    /// merging adds to the base), for a layer that uses its weight whole (a head's fused
    /// loss). The factor every rank holds whole enters through the group's copy, as in
    /// [`delta`](Self::delta): its gradient is the ranks' partial sum.
    pub fn merged_delta(&self) -> Tensor<2> {
        let (a, b) = match &self.cut {
            AdapterCut::Whole => (self.a.val(), self.b.val()),
            AdapterCut::Column(group) => (group.copy_to(self.a.val()), self.b.val()),
            AdapterCut::Row(group) => (self.a.val(), group.copy_to(self.b.val())),
        };
        b.matmul(a).mul_scalar(self.scaling)
    }
}

/// The initialisers of A and B for `spec` on a layer of `d_in` inputs: PyTorch's
/// `nn.Linear` default (Kaiming-uniform with `a = sqrt(5)`: uniform within `1 / sqrt(fan_in)`)
/// for A, and for B too with `init_lora_weights: false`; normal `1 / r` for A with
/// `"gaussian"`; B zero otherwise.
pub fn initializers(spec: &AdapterSpec, d_in: usize) -> [Initializer; 2] {
    let uniform = |fan_in: usize| {
        let bound = (fan_in as f64).sqrt().recip();
        Initializer::Uniform { min: -bound, max: bound }
    };
    match spec.init {
        LoraInit::KaimingZero => [uniform(d_in), Initializer::Zeros],
        LoraInit::GaussianZero => [Initializer::Normal { mean: 0.0, std: 1.0 / spec.r as f64 }, Initializer::Zeros],
        LoraInit::Random => [uniform(d_in), uniform(spec.r)],
    }
}

/// Burn's `Linear` (weight `[in, out]`) frozen, with an optional adapter:
/// `base(x) + adapter.delta(x)`. For a user's own model: wrap each layer a [`LoraConfig`]
/// names, train, and only the adapters (and what else is left trainable) train.
#[derive(Module, Debug)]
pub struct LoraLinear {
    /// The frozen layer.
    pub base: Linear,
    /// The update; `None`: the frozen layer alone.
    pub adapter: Option<LoraAdapter>,
}

impl LoraLinear {
    /// `base` frozen (its weight and bias no longer train), with a fresh adapter of `spec`
    /// where given.
    pub fn new(base: Linear, spec: Option<&AdapterSpec>) -> Self {
        let weight = base.weight.val();
        let ([d_in, d_out], device) = (weight.dims(), weight.device());
        let adapter = spec.map(|spec| LoraAdapter::init(d_in, d_out, spec, &device));
        let base =
            Linear { weight: base.weight.set_require_grad(false), bias: base.bias.map(|b| b.set_require_grad(false)) };
        Self { base, adapter }
    }

    /// `base(x) + adapter.delta(x)` over the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match &self.adapter {
            Some(adapter) => self.base.forward(x.clone()) + adapter.delta(x),
            None => self.base.forward(x),
        }
    }
}

#[cfg(test)]
mod tests;
