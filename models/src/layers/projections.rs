//! The projections: `nn.Linear`'s layout ([`Dense`], `[out, in]`) and GPT-2's `Conv1D`
//! (`[in, out]`), whole or a tensor-parallel rank's part ([`Cut`]), each with the LoRA
//! adapter its model's [`Weights`] give it.

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use burn::tensor::module::linear;
use zerotrain::nn::lora::{AdapterCut, LoraAdapter};
use zerotrain::nn::parallel::{ParallelGroup, Split, row_parallel_linear};

use crate::hf::weights::{Features, Init, Weights};

/// How a projection is split over its [`Weights`]' tensor-parallel group (Megatron-LM's
/// column- and row-parallel layers); with a group of one rank, nothing is.
#[derive(Debug, Clone)]
pub enum Cut {
    /// The whole layer on every rank.
    Whole,
    /// Output features split: the input enters through the group's copy (`f`).
    Column(ParallelGroup),
    /// Input features split: the ranks' products are summed (`g`), the bias added once.
    Row(ParallelGroup),
}

impl Cut {
    /// `y = x W + b` for `x` and the weight `[d_in, out]` as this rank holds them, plus
    /// `adapter`'s update where there is one.
    fn apply(
        &self,
        x: Tensor<3>,
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        adapter: Option<&LoraAdapter>,
    ) -> Tensor<3> {
        self.entered(self.enter(x), weight, bias, adapter)
    }

    /// `x` entering a column-parallel region through the group's copy (`f`); other cuts
    /// take it as it is.
    fn enter(&self, x: Tensor<3>) -> Tensor<3> {
        match self {
            Self::Column(group) => group.copy_to(x),
            _ => x,
        }
    }

    /// [`apply`](Self::apply) to an `x` that already entered a column-parallel region.
    fn entered(
        &self,
        x: Tensor<3>,
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        adapter: Option<&LoraAdapter>,
    ) -> Tensor<3> {
        let base = |x| match self {
            Self::Whole | Self::Column(_) => linear(x, weight, bias),
            Self::Row(group) => row_parallel_linear(x, weight, bias, group),
        };
        match adapter {
            Some(adapter) => base(x.clone()) + adapter.delta(x),
            None => base(x),
        }
    }

    /// The rule an adapter on a layer of this cut follows.
    fn adapter_cut(&self) -> AdapterCut {
        match self {
            Self::Whole => AdapterCut::Whole,
            Self::Column(group) => AdapterCut::Column(group.clone()),
            Self::Row(group) => AdapterCut::Row(group.clone()),
        }
    }
}

/// A projection stored as `nn.Linear` stores it: `weight` `[out, in]`, optional `bias`;
/// whole, or this rank's part of it ([`Cut`]); with a LoRA adapter where the model's
/// [`Weights`] adapt it (`adapter.a`, `adapter.b`: PEFT's `lora_A`, `lora_B`).
#[derive(Module, Debug)]
pub struct Dense {
    weight: Param<Tensor<2>>,
    bias: Option<Param<Tensor<1>>>,
    adapter: Option<LoraAdapter>,
    #[module(skip)]
    cut: Cut,
}

impl Dense {
    /// `name.weight` `[out, d_in]`, and `name.bias` when `bias`, whole on every rank.
    pub fn new(w: &Weights, name: &str, d_in: usize, out: usize, bias: bool) -> Self {
        Self::cut(w, name, [d_in, out], bias, Split::Whole, Split::Whole, Cut::Whole)
    }

    /// Which of the layer's features its weight split `ws` (of `[out, d_in]`) cuts.
    fn features(ws: Split) -> Features {
        match ws.dim() {
            Some(0) => Features::Output(ws),
            Some(_) => Features::Input,
            None => Features::Whole,
        }
    }

    /// The layer with its output features split over `w`'s group: its rows of `weight` and
    /// of `bias` (Megatron's column-parallel layer: q, k, v, an MLP's up and gate).
    pub fn column(w: &Weights, name: &str, d_in: usize, out: usize, bias: bool) -> Self {
        let rows = Split::Even { dim: 0, blocks: 1 };
        Self::cut(w, name, [d_in, out], bias, rows, rows, Cut::Column(w.tensor_parallel().clone()))
    }

    /// The layer with its input features split over `w`'s group: its columns of `weight`,
    /// the whole `bias` (Megatron's row-parallel layer: attention's output, an MLP's down).
    pub fn row(w: &Weights, name: &str, d_in: usize, out: usize, bias: bool) -> Self {
        let columns = Split::Even { dim: 1, blocks: 1 };
        Self::cut(w, name, [d_in, out], bias, columns, Split::Whole, Cut::Row(w.tensor_parallel().clone()))
    }

    /// A head over a vocabulary of `vocab` ids split over `w`'s group (parts that need not
    /// be equal), without a bias: this rank's logits.
    pub fn vocabulary(w: &Weights, name: &str, d_in: usize, vocab: usize) -> Self {
        let rows = Split::Uneven { dim: 0 };
        Self::cut(w, name, [d_in, vocab], false, rows, rows, Cut::Column(w.tensor_parallel().clone()))
    }

    fn cut(w: &Weights, name: &str, [d_in, out]: [usize; 2], bias: bool, ws: Split, bs: Split, cut: Cut) -> Self {
        let head = matches!(ws, Split::Uneven { .. });
        Self {
            weight: w.split_param(&format!("{name}.weight"), [out, d_in], ws, Init::Normal),
            bias: bias.then(|| w.split_param(&format!("{name}.bias"), [out], bs, Init::Zeros)),
            adapter: w.adapter(name, [d_in, out], Self::features(ws), cut.adapter_cut(), head),
            cut,
        }
    }

    /// `x W^T + b` over the last dimension (this rank's part of it, as [`Cut`] says), plus
    /// the adapter's update.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.cut.apply(x, self.weight.val().transpose(), self.bias.as_ref().map(Param::val), self.adapter.as_ref())
    }

    /// `x` entering this column-parallel layer's region through the group's copy (`f`), to
    /// be shared by the layers that read the same input
    /// ([`forward_entered`](Self::forward_entered)): q, k and v, or gate and up, then cost
    /// one all-reduce of its gradient, not one each. Other cuts return `x`.
    pub fn enter(&self, x: Tensor<3>) -> Tensor<3> {
        self.cut.enter(x)
    }

    /// [`forward`](Self::forward) of an `x` that [`enter`](Self::enter) gave.
    pub fn forward_entered(&self, x: Tensor<3>) -> Tensor<3> {
        self.cut.entered(x, self.weight.val().transpose(), self.bias.as_ref().map(Param::val), self.adapter.as_ref())
    }

    /// The weight `[out, d_in]` and the bias: a head's, for its loss. An adapted head's
    /// weight is merged (`W + scaling B A`), so its update trains through the loss.
    pub fn weight_and_bias(&self) -> (Tensor<2>, Option<Tensor<1>>) {
        let weight = match &self.adapter {
            Some(adapter) => self.weight.val() + adapter.merged_delta(),
            None => self.weight.val(),
        };
        (weight, self.bias.as_ref().map(Param::val))
    }
}

/// GPT-2's `Conv1D`: `weight` `[in, out]` and `bias`; whole, or this rank's part ([`Cut`]).
#[derive(Module, Debug)]
pub struct Conv1D {
    weight: Param<Tensor<2>>,
    bias: Param<Tensor<1>>,
    adapter: Option<LoraAdapter>,
    #[module(skip)]
    cut: Cut,
}

impl Conv1D {
    /// `name.weight` `[d_in, out]`, fresh as `init` says, and `name.bias`, whole.
    pub fn new(w: &Weights, name: &str, d_in: usize, out: usize, init: Init) -> Self {
        Self::cut(w, name, [d_in, out], init, [Split::Whole; 2], Cut::Whole)
    }

    /// The layer with its output features split over `w`'s group, the output being
    /// `blocks` equal blocks side by side (`c_attn`'s q, k and v: 3), each split alike.
    pub fn column(w: &Weights, name: &str, d_in: usize, out: usize, init: Init, blocks: usize) -> Self {
        let splits = [Split::Even { dim: 1, blocks }, Split::Even { dim: 0, blocks }];
        Self::cut(w, name, [d_in, out], init, splits, Cut::Column(w.tensor_parallel().clone()))
    }

    /// The layer with its input features split over `w`'s group, its bias whole.
    pub fn row(w: &Weights, name: &str, d_in: usize, out: usize, init: Init) -> Self {
        let splits = [Split::Even { dim: 0, blocks: 1 }, Split::Whole];
        Self::cut(w, name, [d_in, out], init, splits, Cut::Row(w.tensor_parallel().clone()))
    }

    fn cut(w: &Weights, name: &str, [d_in, out]: [usize; 2], init: Init, [ws, bs]: [Split; 2], cut: Cut) -> Self {
        // The weight is `[d_in, out]`: its dimension 1 is the output, whose split the bias
        // (and B's rows) share.
        let features = match ws.dim() {
            Some(1) => Features::Output(bs),
            Some(_) => Features::Input,
            None => Features::Whole,
        };
        Self {
            weight: w.split_param(&format!("{name}.weight"), [d_in, out], ws, init),
            bias: w.split_param(&format!("{name}.bias"), [out], bs, Init::Zeros),
            adapter: w.adapter(name, [d_in, out], features, cut.adapter_cut(), false),
            cut,
        }
    }

    /// `x W + b` over the last dimension (this rank's part of it, as [`Cut`] says), plus
    /// the adapter's update.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.cut.apply(x, self.weight.val(), Some(self.bias.val()), self.adapter.as_ref())
    }
}
