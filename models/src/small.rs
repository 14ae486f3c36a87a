//! Small models for the examples, tests and benches: [`Mlp`] and [`TinyTransformer`] with a
//! deterministic regression task ([`RegressionTask`]). None has dropout
//! (`tests/world/dropout.rs` brings a model that has).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};

use zerotrain::engine::{UnitModel, UnitSpec};

use crate::Block;

/// A multi-layer perceptron with GELU between layers.
#[derive(Module, Debug)]
pub struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    /// Layers of widths `dims[0] -> dims[1] -> ... -> dims[n]`.
    pub fn new(dims: &[usize], device: &Device) -> Self {
        let layers = dims.windows(2).map(|w| LinearConfig::new(w[0], w[1]).init(device)).collect();
        Self { layers }
    }

    /// `[batch, in] -> [batch, out]`.
    pub fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i < last {
                x = gelu(x);
            }
        }
        x
    }

    /// Mean squared error against `target`, in f32 (inputs are cast to the weights' dtype).
    pub fn loss(&self, batch: &Batch) -> Tensor<1> {
        let [b, t, d] = batch.input.dims();
        let dtype = self.layers[0].weight.val().dtype();
        let pred = self.forward(batch.input.clone().cast(dtype).reshape([b * t, d]));
        mse(pred.reshape([b, t, d]), batch.target.clone())
    }
}

/// One unit per layer.
impl UnitModel for Mlp {
    type Batch = Batch;
    /// `[batch * seq, features]`.
    type Hidden = Tensor<2>;

    fn units(&self) -> Vec<UnitSpec> {
        (0..self.layers.len()).map(|i| UnitSpec::new(format!("layers.{i}"), [format!("layers.{i}")])).collect()
    }

    fn forward_unit(&self, unit: usize, input: Option<Tensor<2>>, batch: &Batch) -> Tensor<2> {
        let layer = &self.layers[unit];
        let x = input.unwrap_or_else(|| {
            let [b, t, d] = batch.input.dims();
            batch.input.clone().cast(layer.weight.val().dtype()).reshape([b * t, d])
        });
        let y = layer.forward(x);
        if unit + 1 < self.layers.len() { gelu(y) } else { y }
    }

    fn output_loss(&self, output: Tensor<2>, batch: &Batch) -> Tensor<1> {
        mse(output.reshape(batch.target.dims()), batch.target.clone())
    }

    fn batch_size(&self, batch: &Batch) -> Option<usize> {
        Some(batch.input.dims()[0])
    }
}

/// A pre-norm transformer block (causal self-attention and an MLP, each residual; the GPT's
/// [`Block`]) between an input and an output projection.
#[derive(Module, Debug)]
pub struct TinyTransformer {
    input: Linear,
    block: Block,
    output: Linear,
}

impl TinyTransformer {
    /// Features `d_in`, model width `d_model`, `n_heads` heads, MLP width `4 * d_model`.
    pub fn new(d_in: usize, d_model: usize, n_heads: usize, device: &Device) -> Self {
        Self {
            input: LinearConfig::new(d_in, d_model).init(device),
            block: Block::new(d_model, n_heads, device),
            output: LinearConfig::new(d_model, d_in).init(device),
        }
    }

    /// `[batch, seq, d_in] -> [batch, seq, d_in]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.output.forward(self.block.forward(self.input.forward(x)))
    }

    /// Mean squared error against `target`, in f32 (inputs are cast to the weights' dtype).
    pub fn loss(&self, batch: &Batch) -> Tensor<1> {
        let dtype = self.input.weight.val().dtype();
        mse(self.forward(batch.input.clone().cast(dtype)), batch.target.clone())
    }
}

/// Three units: the input projection, the block, the output projection.
impl UnitModel for TinyTransformer {
    type Batch = Batch;
    /// `[batch, seq, d_model]`, then `[batch, seq, d_in]`.
    type Hidden = Tensor<3>;

    fn units(&self) -> Vec<UnitSpec> {
        vec![UnitSpec::new("input", ["input"]), UnitSpec::new("block", ["block"]), UnitSpec::new("output", ["output"])]
    }

    fn forward_unit(&self, unit: usize, input: Option<Tensor<3>>, batch: &Batch) -> Tensor<3> {
        match (unit, input) {
            (1, Some(h)) => self.block.forward(h),
            (2, Some(h)) => self.output.forward(h),
            _ => self.input.forward(batch.input.clone().cast(self.input.weight.val().dtype())),
        }
    }

    fn output_loss(&self, output: Tensor<3>, batch: &Batch) -> Tensor<1> {
        mse(output, batch.target.clone())
    }

    fn batch_size(&self, batch: &Batch) -> Option<usize> {
        Some(batch.input.dims()[0])
    }
}

/// Mean squared error computed in f32, whatever dtype the prediction is in.
fn mse(pred: Tensor<3>, target: Tensor<3>) -> Tensor<1> {
    (pred.cast(FloatDType::F32) - target).square().mean()
}

/// A batch of the regression task: `target` is a fixed nonlinear function of `input`.
#[derive(Debug, Clone)]
pub struct Batch {
    /// `[batch, seq, features]`.
    pub input: Tensor<3>,
    /// `[batch, seq, features]`.
    pub target: Tensor<3>,
}

/// The deterministic regression task: sample `i` is a sequence whose target at position `t`
/// is a smooth function of the inputs up to `t` (so attention helps).
#[derive(Debug, Clone, Copy)]
pub struct RegressionTask {
    /// Sequence length.
    pub seq_len: usize,
    /// Features per position.
    pub features: usize,
}

impl RegressionTask {
    /// One sample's (input, target) values, each `seq_len * features` long.
    pub fn sample(&self, index: u64) -> (Vec<f32>, Vec<f32>) {
        let (t, f) = (self.seq_len, self.features);
        let mut state = index.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0xD1B5_4A32_D192_ED03);
        let mut next = || (zerotrain::random::splitmix64(&mut state) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        let input: Vec<f32> = (0..t * f).map(|_| next()).collect();
        let mut target = vec![0.0; t * f];
        let mut running = vec![0.0f32; f];
        for pos in 0..t {
            for j in 0..f {
                running[j] = 0.7 * running[j] + input[pos * f + j];
                let neighbour = input[pos * f + (j + 1) % f];
                target[pos * f + j] = (running[j] * 0.8).tanh() + 0.3 * neighbour * input[pos * f + j];
            }
        }
        (input, target)
    }

    /// The batch of samples `indices`, on `device`.
    pub fn batch(&self, indices: impl IntoIterator<Item = u64>, device: &Device) -> Batch {
        let (mut input, mut target) = (Vec::new(), Vec::new());
        let mut n = 0;
        for i in indices {
            let (x, y) = self.sample(i);
            input.extend(x);
            target.extend(y);
            n += 1;
        }
        let shape = [n, self.seq_len, self.features];
        Batch {
            input: Tensor::from_data(TensorData::new(input, shape), device),
            target: Tensor::from_data(TensorData::new(target, shape), device),
        }
    }
}
