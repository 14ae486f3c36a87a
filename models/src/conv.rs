//! [`ConvNet`]: a small image classifier in the shape of Burn's MNIST example (convolution
//! blocks with BatchNorm and GELU, then a linear head), with a deterministic task
//! ([`ImageTask`]). Its BatchNorm running statistics are the buffers the engine must keep
//! consistent, checkpoint and leave alone during evaluation.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::{gelu, log_softmax};
use burn::tensor::{Device, Int, Tensor, TensorData};

use zerotrain::engine::{UnitModel, UnitSpec};

/// Image side (images are `SIDE x SIDE`, one channel).
pub const SIDE: usize = 8;
/// Classes.
pub const CLASSES: usize = 4;

/// A 3x3 convolution (without bias: BatchNorm's shift replaces it, and a bias there has no
/// gradient but rounding noise, which Adam would amplify), BatchNorm and GELU.
#[derive(Module, Debug)]
pub struct ConvBlock {
    conv: Conv2d,
    norm: BatchNorm,
}

impl ConvBlock {
    fn new(channels: [usize; 2], device: &Device) -> Self {
        let conv =
            Conv2dConfig::new(channels, [3, 3]).with_padding(PaddingConfig2d::Same).with_bias(false).init(device);
        Self { conv, norm: BatchNormConfig::new(channels[1]).init(device) }
    }

    /// `[batch, in, h, w] -> [batch, out, h, w]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        gelu(self.norm.forward(self.conv.forward(x)))
    }
}

/// Two convolution blocks, a global average over the image, a linear head.
#[derive(Module, Debug)]
pub struct ConvNet {
    blocks: Vec<ConvBlock>,
    head: Linear,
}

/// Images `[batch, 1, SIDE, SIDE]` and their classes `[batch]`.
#[derive(Debug, Clone)]
pub struct Images {
    /// The pixels.
    pub images: Tensor<4>,
    /// The class of each image.
    pub labels: Tensor<1, Int>,
}

impl ConvNet {
    /// Blocks of `width` channels.
    pub fn new(width: usize, device: &Device) -> Self {
        let blocks = vec![ConvBlock::new([1, width], device), ConvBlock::new([width, width], device)];
        Self { blocks, head: LinearConfig::new(width, CLASSES).init(device) }
    }

    /// Class logits `[batch, CLASSES]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let x = self.blocks.iter().fold(images, |x, block| block.forward(x));
        self.head(x)
    }

    /// The head over the image-averaged channels: `[batch, width, h, w] -> [batch, CLASSES]`.
    fn head(&self, x: Tensor<4>) -> Tensor<2> {
        let pooled: Tensor<2> = x.mean_dim(3).mean_dim(2).flatten(1, 3);
        self.head.forward(pooled)
    }

    /// Mean cross-entropy.
    pub fn loss(&self, batch: &Images) -> Tensor<1> {
        cross_entropy(self.forward(batch.images.clone()), &batch.labels)
    }

    /// Correctly classified images.
    pub fn correct(&self, batch: &Images) -> usize {
        let predicted: Tensor<1, Int> = self.forward(batch.images.clone()).argmax(1).flatten(0, 1);
        let hits = predicted.equal(batch.labels.clone()).int().sum().into_scalar::<i64>();
        hits as usize
    }
}

fn cross_entropy(logits: Tensor<2>, labels: &Tensor<1, Int>) -> Tensor<1> {
    let n = labels.dims()[0];
    log_softmax(logits, 1).gather(1, labels.clone().reshape([n, 1])).mean().neg()
}

/// One unit per block and the head.
impl UnitModel for ConvNet {
    type Batch = Images;
    /// `[batch, width, SIDE, SIDE]` between blocks; the head's output holds the logits in
    /// its first two dimensions.
    type Hidden = Tensor<4>;

    fn units(&self) -> Vec<UnitSpec> {
        let mut units: Vec<UnitSpec> =
            (0..self.blocks.len()).map(|i| UnitSpec::new(format!("blocks.{i}"), [format!("blocks.{i}")])).collect();
        units.push(UnitSpec::new("head", ["head"]));
        units
    }

    fn forward_unit(&self, unit: usize, input: Option<Tensor<4>>, batch: &Images) -> Tensor<4> {
        let x = input.unwrap_or_else(|| batch.images.clone());
        match self.blocks.get(unit) {
            Some(block) => block.forward(x),
            None => self.head(x).unsqueeze_dims::<4>(&[2, 3]),
        }
    }

    fn output_loss(&self, output: Tensor<4>, batch: &Images) -> Tensor<1> {
        let logits: Tensor<2> = output.flatten(1, 3);
        cross_entropy(logits, &batch.labels)
    }

    fn batch_size(&self, batch: &Images) -> Option<usize> {
        Some(batch.labels.dims()[0])
    }
}

/// A deterministic classification task: class `c` is a bright bar at row or column
/// `2 + c` (even classes rows, odd columns) on a noisy background.
#[derive(Debug, Clone, Copy, Default)]
pub struct ImageTask;

impl ImageTask {
    /// Sample `index`: its pixels and class.
    pub fn sample(&self, index: u64) -> (Vec<f32>, i64) {
        let class = (index % CLASSES as u64) as usize;
        let mut state = index.wrapping_mul(0x2545_F491_4F6C_DD1D).wrapping_add(7);
        let mut noise = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let line = 2 + class / 2;
        let pixels = (0..SIDE * SIDE)
            .map(|p| {
                let (row, col) = (p / SIDE, p % SIDE);
                let on = if class.is_multiple_of(2) { row == line } else { col == line };
                noise() * 0.6 + if on { 1.5 } else { 0.0 }
            })
            .collect();
        (pixels, class as i64)
    }

    /// The batch of samples `indices`, on `device`.
    pub fn batch(&self, indices: std::ops::Range<u64>, device: &Device) -> Images {
        let n = (indices.end - indices.start) as usize;
        let (mut pixels, mut labels) = (Vec::with_capacity(n * SIDE * SIDE), Vec::with_capacity(n));
        for i in indices {
            let (p, c) = self.sample(i);
            pixels.extend(p);
            labels.push(c);
        }
        Images {
            images: Tensor::from_data(TensorData::new(pixels, [n, 1, SIDE, SIDE]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}
