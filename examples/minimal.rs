//! The few engine calls that train your own Burn model with ZeRO, on 2 thread ranks.
//!
//! Run it with `cargo run --example minimal`.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use zerotrain::{Config, Engine, Overrides, Precision, launch};

/// Any Burn module works; this one fits y = sin(x0) + x1 * x2.
#[derive(Module, Debug)]
struct Net {
    hidden: Linear,
    out: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        Self { hidden: LinearConfig::new(3, 32).init(device), out: LinearConfig::new(32, 1).init(device) }
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        (self.out.forward(relu(self.hidden.forward(x))) - y).square().mean()
    }
}

/// A deterministic batch: sample `i` of the data set, for `indices`.
fn batch(indices: std::ops::Range<u64>, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for i in indices.clone() {
        let v = [(i % 17) as f32 / 8.5 - 1.0, (i % 7) as f32 / 3.5 - 1.0, (i % 11) as f32 / 5.5 - 1.0];
        y.push(v[0].sin() + v[1] * v[2]);
        x.extend(v);
    }
    let n = indices.count();
    (Tensor::from_data(TensorData::new(x, [n, 3]), device), Tensor::from_data(TensorData::new(y, [n, 1]), device))
}

const CONFIG: &str = r#"{
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 3},
    "zerotrain": {"world_size": 2}
}"#;

fn main() {
    let model_file = std::env::temp_dir().join(format!("zerotrain-minimal-{}.safetensors", std::process::id()));
    train(&model_file);
    println!("model: {}", model_file.display());
}

/// Trains 300 steps, saves the model to `model_file`, and returns the (first, last) mean
/// loss.
pub fn train(model_file: &std::path::Path) -> (f32, f32) {
    // 1. A DeepSpeed-style config, resolved into a plan (Config::from_file for a file).
    let plan = Config::parse(CONFIG, "example").and_then(|c| c.resolve(Overrides::default())).expect("valid config");
    let b = plan.batch;
    // 2. The model, built once from a seed; every rank starts from a clone (the engine
    //    forks it onto the rank's device and broadcasts rank 0's values).
    let device = Device::flex().autodiff();
    device.seed(plan.runtime.seed);
    let init = Net::new(&device);
    // 3. One closure per rank.
    let losses = launch(&plan, |ctx| {
        let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
        let mut losses = Vec::new();
        for step in 0..300u64 {
            for micro in 0..b.gradient_accumulation_steps {
                // Each rank reads its own part of the global batch.
                let first = step * b.train_batch_size
                    + (micro * ctx.world_size() as u64 + ctx.rank() as u64) * b.micro_batch_per_rank;
                let (x, y) = batch(first..first + b.micro_batch_per_rank, ctx.device());
                // 4. forward, backward, step: step() acts at accumulation boundaries.
                let loss = engine.forward(|net| net.loss(x, y))?;
                engine.backward(loss)?;
                if let Some(report) = engine.step()? {
                    losses.push(report.loss);
                }
            }
        }
        // 5. The trained model, whole, in bf16 (Burn's SafetensorsStore or Python load it).
        engine.save_model(model_file, Precision::Bf16)?;
        Ok::<_, zerotrain::Error>(losses)
    })
    .expect("training");
    let (first, last) = (losses[0][0], *losses[0].last().unwrap());
    println!(
        "{} steps on {} ranks at ZeRO {}: loss {first:.4} -> {last:.4}",
        losses[0].len(),
        plan.world_size(),
        plan.zero.stage
    );
    (first, last)
}
