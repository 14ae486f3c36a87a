//! A step that fails part-way: some units stepped, some not. The rank refuses every use of
//! its states (forward, step, save, masters, the whole model) until a checkpoint load, and
//! after the load trains exactly as if the failure had never happened. On the CPU here, on
//! a device through `gpu` (where one rank steps on the device).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::tensor::{Device, Tensor};
use zerotrain::engine::optimizer::{ExportedState, ShardOptimizer};
use zerotrain::{Engine, Error, LoadOptions, launch};

use crate::common::*;
use crate::tiers::scratch;
use crate::units::{MODES, Tokens, Workload, tiny_gpt, unit_recipe};

/// Plain SGD, failing at its `fail_at`-th call (counted over every unit, tile and step).
pub(crate) struct Flaky {
    pub steps: Arc<AtomicUsize>,
    pub fail_at: Arc<AtomicUsize>,
}

impl ShardOptimizer for Flaky {
    fn step(&mut self, lr: f64, p: Tensor<1>, g: Tensor<1>) -> zerotrain::Result<Tensor<1>> {
        if self.steps.fetch_add(1, Ordering::SeqCst) + 1 == self.fail_at.load(Ordering::SeqCst) {
            return Err(Error::Model("injected failure".into()));
        }
        Ok(p - g.mul_scalar(lr))
    }
    fn state_bytes(&self) -> u64 {
        0
    }
    fn export(&self) -> ExportedState {
        (Vec::new(), Vec::new())
    }
    fn import(&mut self, _: ExportedState, _: &Device) -> zerotrain::Result<()> {
        Ok(())
    }
}

/// What a run brought back: the failed step's error, the refusals while torn, the bytes the
/// first step moved between host and device, and the masters after the healed step.
struct Run {
    refusals: Vec<String>,
    crossed: (u64, u64),
    masters: Vec<f32>,
}

/// One rank, in units with recomputation, at stages 0 and 3, in each of `precisions` (fp32,
/// bf16, fp16): step 0, a save; step 1 fails at its third unit; every use refused; the save
/// loaded; step 1 again. The masters then equal an uninterrupted run's bit for bit. `json`
/// puts the run on its device; `expect_crossed` is what the first step may move between
/// host and device.
pub(crate) fn a_step_failing_part_way_leaves_the_rank_torn_until_a_load(
    json: impl Fn(&str) -> String,
    expect_crossed: (u64, u64),
    precisions: &[&str],
) {
    let init = tiny_gpt(true, 29);
    let w = Tokens { vocab: 11, len: 9 };
    for &precision in precisions {
        for stage in [0u8, 3] {
            let what = format!("{precision} stage {stage}");
            let root = scratch(&format!("torn-{precision}-{stage}"));
            let recipe = match precision {
                "fp16" => unit_recipe(stage, 1, MODES[5], "fp32", "").replacen(
                    '{',
                    r#"{ "fp16": {"enabled": true, "initial_scale_power": 8},"#,
                    1,
                ),
                _ => unit_recipe(stage, 1, MODES[5], precision, ""),
            };
            let p = plan(&json(&recipe), 1);
            let run = |fail: bool| {
                let (steps, fail_at) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(usize::MAX)));
                launch(&p, |ctx| {
                    let (s, f) = (Arc::clone(&steps), Arc::clone(&fail_at));
                    let mut engine = Engine::builder(init.clone(), &p, &ctx)
                        .optimizer(move |_| Box::new(Flaky { steps: Arc::clone(&s), fail_at: Arc::clone(&f) }))
                        .build_units()?;
                    let batch = |step| w.batch(&p, step, 0, ctx.rank(), ctx.device());
                    engine.forward_backward(&batch(0))?;
                    let first = engine.step()?.expect("accumulation 1");
                    let ckpt = root.join(if fail { "failing" } else { "whole" });
                    engine.save_checkpoint(&ckpt, None, serde_json::Value::Null)?;
                    let mut refusals = Vec::new();
                    if fail {
                        fail_at.store(steps.load(Ordering::SeqCst) + 3, Ordering::SeqCst);
                        engine.forward_backward(&batch(1))?;
                        refusals.push(engine.step().unwrap_err().to_string());
                        refusals.push(engine.forward_backward(&batch(2)).unwrap_err().to_string());
                        let torn = root.join("torn");
                        refusals.push(
                            engine.save_checkpoint(&torn, None, serde_json::Value::Null).unwrap_err().to_string(),
                        );
                        refusals.push(engine.master_params().unwrap_err().to_string());
                        refusals.push(engine.full_model().unwrap_err().to_string());
                        assert!(!torn.join("latest").exists(), "{what}: a torn rank saved a checkpoint");
                        engine.load_checkpoint(&ckpt, None, LoadOptions::default())?;
                    }
                    engine.forward_backward(&batch(1))?;
                    engine.step()?;
                    let crossed = (first.host_device.to_device, first.host_device.to_host);
                    Ok::<_, Error>(Run { refusals, crossed, masters: engine.master_params()? })
                })
                .unwrap()
                .remove(0)
            };
            let (failed, whole) = (run(true), run(false));
            assert!(failed.refusals[0].contains("injected failure"), "{what}: {}", failed.refusals[0]);
            for refusal in &failed.refusals[1..] {
                assert!(
                    refusal.contains("failed part-way") && refusal.contains("load a checkpoint"),
                    "{what}: {refusal}"
                );
            }
            assert_eq!(whole.crossed, expect_crossed, "{what}: bytes crossed in the first step");
            assert!(
                failed.masters == whole.masters,
                "{what}: after the load, training differs from the uninterrupted run"
            );
            let _ = std::fs::remove_dir_all(&root);
        }
    }
}

#[test]
fn on_the_cpu_a_step_failing_part_way_leaves_the_rank_torn_until_a_load() {
    a_step_failing_part_way_leaves_the_rank_torn_until_a_load(str::to_string, (0, 0), &["fp32", "bf16", "fp16"]);
}
