//! Writes a checkpoint of a large MLP (default 40M parameters, 160 MB of fp32) from 4 thread
//! ranks at ZeRO stage 2, to measure `zerotrain consolidate`'s peak memory:
//!
//! ```sh
//! cargo run --example big_checkpoint -- /tmp/big 40
//! cargo run -- consolidate /tmp/big --out /tmp/big.safetensors   # prints its peak RSS
//! ```

use burn::tensor::Device;
use zerotrain::{Config, Engine, Overrides, launch};
use zerotrain_models::{Mlp, RegressionTask};

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().unwrap_or_else(|| "/tmp/zerotrain-big".into());
    let millions: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(40);
    // Two square layers of width w hold about 2 w^2 parameters.
    let width = ((millions as f64 * 1e6 / 2.0).sqrt()) as usize;
    let json =
        r#"{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "zerotrain": {"world_size": 4}}"#;
    let plan = Config::parse(json, "big").and_then(|c| c.resolve(Overrides::default())).expect("config");
    let task = RegressionTask { seq_len: 1, features: width };
    let init = Mlp::new(&[width, width, width], &Device::flex().autodiff());
    let paths = launch(&plan, |ctx| {
        let mut engine = Engine::new(init.clone(), &plan, &ctx)?;
        let batch = task.batch([ctx.rank() as u64], ctx.device());
        let loss = engine.forward(|m| m.loss(&batch))?;
        engine.backward(loss)?;
        engine.step()?;
        engine.save_checkpoint(&dir, None, serde_json::Value::Null)
    })
    .expect("training");
    println!("wrote {} ({} x {width} x {width} MLP)", paths[0].display(), 2);
}
