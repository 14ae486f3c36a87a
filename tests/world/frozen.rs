//! A frozen base with trained adapters (LoRA on a library user's own layers): at stage 3
//! the base is sharded over the ranks like the trained parameters, in every tier, and the
//! run is plain Burn's; below stage 3 it stays whole.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor};
use zerotrain::engine::{UnitModel, UnitSpec};
use zerotrain::nn::lora::{AdapterSpec, LoraInit, LoraLinear};
use zerotrain::{Engine, Error, MemoryReport, launch};
use zerotrain_models::Batch;

use crate::common::*;

/// Features in and out, and the hidden width.
pub(crate) const FEATURES: usize = 6;
pub(crate) const WIDTH: usize = 32;
pub(crate) const LAYERS: usize = 3;

/// A frozen input projection the root holds (every unit may read it; the first does),
/// then `LAYERS` frozen linear layers with adapters and a frozen output layer with none.
#[derive(Module, Debug)]
pub(crate) struct Adapted {
    pub(crate) embed: Linear,
    pub(crate) layers: Vec<LoraLinear>,
}

impl Adapted {
    pub(crate) fn new(device: &Device) -> Self {
        let spec = AdapterSpec { r: 2, alpha: 4.0, scaling: 2.0, dropout: 0.0, init: LoraInit::Random };
        let mut layers: Vec<LoraLinear> =
            (0..LAYERS).map(|_| LoraLinear::new(LinearConfig::new(WIDTH, WIDTH).init(device), Some(&spec))).collect();
        layers.push(LoraLinear::new(LinearConfig::new(WIDTH, FEATURES).init(device), None));
        let embed = LinearConfig::new(FEATURES, WIDTH).init(device);
        let embed = Linear {
            weight: embed.weight.set_require_grad(false),
            bias: embed.bias.map(|b| b.set_require_grad(false)),
        };
        Self { embed, layers }
    }

    fn input(&self, batch: &Batch) -> Tensor<2> {
        let [b, t, d] = batch.input.dims();
        let dtype = self.embed.weight.val().dtype();
        self.embed.forward(batch.input.clone().cast(dtype).reshape([b * t, d]))
    }

    fn layer(&self, i: usize, x: Tensor<2>) -> Tensor<2> {
        let y = self.layers[i].forward(x);
        if i + 1 < self.layers.len() { gelu(y) } else { y }
    }

    /// The loss in one piece (plain Burn's reference).
    pub(crate) fn loss(&self, batch: &Batch) -> Tensor<1> {
        let x = (0..self.layers.len()).fold(self.input(batch), |x, i| self.layer(i, x));
        mse(x.reshape(batch.target.dims()), batch.target.clone())
    }
}

/// The mean squared error.
fn mse(pred: Tensor<3>, target: Tensor<3>) -> Tensor<1> {
    (pred.cast(burn::tensor::FloatDType::F32) - target).square().mean()
}

impl UnitModel for Adapted {
    type Batch = Batch;
    type Hidden = Tensor<2>;

    fn units(&self) -> Vec<UnitSpec> {
        (0..self.layers.len()).map(|i| UnitSpec::new(format!("layers.{i}"), [format!("layers.{i}")])).collect()
    }

    fn forward_unit(&self, unit: usize, input: Option<Tensor<2>>, batch: &Batch) -> Tensor<2> {
        self.layer(unit, input.unwrap_or_else(|| self.input(batch)))
    }

    fn output_loss(&self, output: Tensor<2>, batch: &Batch) -> Tensor<1> {
        mse(output.reshape(batch.target.dims()), batch.target.clone())
    }

    fn frozen_parameters(&self) -> Vec<String> {
        let bases = (0..self.layers.len()).map(|i| format!("layers.{i}.base"));
        std::iter::once("embed".to_string()).chain(bases).collect()
    }
}

/// Elements of the model's tensors that train, and of those that do not.
pub(crate) fn elems(model: &Adapted) -> (u64, u64) {
    let count = |trained: bool| floats_by_path(model, |t| t == trained).iter().map(|(_, v)| v.len() as u64).sum();
    (count(true), count(false))
}

/// `steps` steps of `model` under `plan`: each rank's memory report after the last step,
/// its full model's frozen tensors and its trained ones.
pub(crate) fn train(model: &Adapted, plan: &zerotrain::Plan, steps: u64) -> Vec<(MemoryReport, Named, Named)> {
    launch(plan, |ctx| {
        let mut engine = Engine::with_units(model.clone(), plan, &ctx)?;
        for step in 0..steps {
            for micro in 0..plan.batch.gradient_accumulation_steps {
                let batch = TASK.batch(rank_indices(plan, step, micro, ctx.rank()), ctx.device());
                engine.forward_backward(&batch)?;
            }
            engine.step()?;
        }
        let report = engine.memory_report();
        let full = engine.full_model()?;
        Ok::<_, Error>((report, floats_by_path(&full, |trains| !trains), floats_by_path(&full, |trains| trains)))
    })
    .unwrap()
}

pub(crate) type Named = Vec<(String, Vec<f32>)>;

/// The adapters train as plain Burn trains them (its optimizer skips the frozen base) at
/// stages 0, 2 and 3, on 1, 2 and 3 ranks, with 1 and 3 micro-batches a step, the stage-3
/// base in memory and on NVMe; the base keeps its exact bits on every rank.
#[test]
fn a_frozen_base_sharded_at_stage_3_trains_its_adapters_like_plain_burn() {
    let init = seeded(41, Adapted::new);
    let base = floats_by_path(&init, |trains| !trains);
    let dir = std::env::temp_dir().join(format!("zt-frozen-base-{}", std::process::id()));
    let nvme = format!(
        r#""stage3_param_persistence_threshold": 0, "offload_param": {{"device": "nvme", "nvme_path": {:?}, "max_in_cpu": 0}}"#,
        dir.display().to_string()
    );
    let device = Device::flex().autodiff();
    for (world, gas) in [(1, 1), (2, 3), (3, 1)] {
        let reference_plan = plan(&recipe(0, 2, gas, 0.0), world);
        let (_, reference) = reference_run(&init, &reference_plan, 3, |m, b| m.loss(b), &device);
        let reference = floats_by_path(&reference, |trains| trains);
        for (stage, tier) in [(0, false), (2, false), (3, false), (3, true)] {
            let what = format!("world {world}, accumulation {gas}, stage {stage}, nvme {tier}");
            let mut json = recipe(stage, 2, gas, 0.0);
            if tier {
                json = json.replace(r#""stage3_param_persistence_threshold": 0"#, &nvme);
            }
            for (rank, (_, frozen, trained)) in train(&init, &plan(&json, world), 3).iter().enumerate() {
                assert!(frozen == &base, "{what}: rank {rank}'s frozen base changed");
                let (diff, path) = max_abs_diff(trained, &reference);
                assert!(diff <= 2e-6, "{what}: rank {rank} differs from plain Burn by {diff} at {path}");
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Each rank holds the frozen base whole below stage 3, and at stage 3 its share of it,
/// Psi_frozen / N to within each unit's padding (at most one alignment quantum, 16
/// elements, per unit and rank): in memory, or in the swap files with the base on NVMe
/// (nothing of it in memory between steps).
#[test]
fn each_rank_holds_its_share_of_the_frozen_base_at_stage_3() {
    let init = seeded(43, Adapted::new);
    let (trained, psi) = elems(&init);
    // The layers' units and the root's, which holds the frozen input projection.
    let padding = 4 * 16 * (LAYERS as u64 + 2);
    let dir = std::env::temp_dir().join(format!("zt-frozen-share-{}", std::process::id()));
    let on_nvme = format!(
        r#""stage3_param_persistence_threshold": 0, "offload_param": {{"device": "nvme", "nvme_path": {:?}, "max_in_cpu": 0}}"#,
        dir.display().to_string()
    );
    for world in [1, 2, 4] {
        let n = world as u64;
        for (report, _, _) in train(&init, &plan(&recipe(2, 2, 1, 0.0), world), 1) {
            assert_eq!(report.frozen, 4 * psi, "stage 2 on {world}: the base is whole");
        }
        for (rank, (report, _, _)) in train(&init, &plan(&recipe(3, 2, 1, 0.0), world), 1).iter().enumerate() {
            let share = 4 * psi / n;
            let what =
                format!("stage 3 on {world}, rank {rank}: {} bytes of the base, its share {share}", report.frozen);
            assert!(report.frozen >= share && report.frozen <= share + padding, "{what}");
        }
        let json = recipe(3, 2, 1, 0.0).replace(r#""stage3_param_persistence_threshold": 0"#, &on_nvme);
        for (report, _, _) in train(&init, &plan(&json, world), 1) {
            assert_eq!(report.frozen, 0, "on NVMe over {world}: nothing of the base in memory between steps");
            // The trained shards are swapped too (fp32: one word an element).
            let share = 4 * (psi + trained) / n;
            let what = format!("on NVMe over {world}: {} bytes swapped, the shares {share}", report.swapped);
            assert!(report.swapped >= share && report.swapped <= share + 2 * padding, "{what}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Under bf16 the frozen base computes in bf16 at every stage: whole below stage 3 (two
/// bytes an element on each rank), its share at stage 3; the losses of stage 3 are stage
/// 0's bit for bit (the same casts, only where the base lives differs) and stay within
/// bf16's rounding of the fp32 run's.
#[test]
fn a_bf16_run_holds_its_frozen_base_in_bf16_at_every_stage() {
    let init = seeded(47, Adapted::new);
    let (_, psi) = elems(&init);
    let padding = 2 * 16 * (LAYERS as u64 + 2);
    let bf16 =
        |json: String| json.replace(r#""zero_optimization""#, r#""bf16": {"enabled": true}, "zero_optimization""#);
    let run = |json: &str| {
        let p = plan(json, 2);
        launch(&p, |ctx| {
            let mut engine = Engine::with_units(init.clone(), &p, &ctx)?;
            let mut losses = vec![];
            for step in 0..3 {
                let batch = TASK.batch(rank_indices(&p, step, 0, ctx.rank()), ctx.device());
                losses.push(engine.forward_backward(&batch)?);
                engine.step()?;
            }
            Ok::<_, Error>((losses, engine.memory_report().frozen))
        })
        .unwrap()
    };
    let fp32 = run(&recipe(0, 2, 1, 0.0));
    let whole = run(&bf16(recipe(0, 2, 1, 0.0)));
    let sharded = run(&bf16(recipe(3, 2, 1, 0.0)));
    for rank in 0..2 {
        assert_eq!(whole[rank].0, sharded[rank].0, "rank {rank}: stage 3's bf16 losses differ from stage 0's");
        assert_eq!(whole[rank].1, 2 * psi, "rank {rank}: stage 0 holds the whole base in bf16");
        let share = 2 * psi / 2;
        let frozen = sharded[rank].1;
        assert!(
            frozen >= share && frozen <= share + padding,
            "rank {rank}: stage 3 holds {frozen} bytes, its share {share}"
        );
        for (step, (half, full)) in whole[rank].0.iter().zip(&fp32[rank].0).enumerate() {
            assert!(
                (half - full).abs() <= 2e-2 * full.abs(),
                "rank {rank}, step {step}: bf16 loss {half}, fp32 {full}"
            );
        }
    }
}
