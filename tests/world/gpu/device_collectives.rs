//! Several ranks whose collectives read device memory (NCCL's) keep their whole step on the
//! device: the engine reduces its gradients and gathers its parameters as device tensors
//! (`zerotrain::engine::on_device`), at every stage. NCCL needs a GPU per rank, so here the
//! threads backend stands in for it ([`ClaimsDeviceMemory`]); `on_device` stages its calls
//! through host memory, where the host collective computes what NCCL would. The NCCL calls
//! on device memory themselves are checked on a CUDA GPU (`cuda.rs`).

use std::sync::Arc;
use std::time::Duration;

use zerotrain::{Engine, Error, RankContext};
use zerotrain_precision::{BufMut, BufRef};
use zerotrain_zero::{Collective, CommStats, ReduceOp, ThreadComm, ThreadWorld, ZeroError};

use super::{DEVICE_LOSS_TOL, Gpu, device_alone, on_device};
use crate::common::plan;
use crate::units::{MODES, Mode, Tokens, Workload, micro_step, tiny_gpt, unit_recipe, unit_sizes};

/// The threads backend, saying its collectives read device memory as NCCL's do: the engine
/// then keeps its step on the device and hands the collectives device tensors, which
/// `on_device` stages through host memory (a wgpu tensor has no address to give).
struct ClaimsDeviceMemory(ThreadComm);

impl Collective for ClaimsDeviceMemory {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.0.all_reduce(buf, op)
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.0.reduce_scatter(input, output, op)
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError> {
        self.0.all_gather(input, output)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError> {
        self.0.broadcast(buf, root)
    }
    fn barrier(&self) -> Result<(), ZeroError> {
        self.0.barrier()
    }
    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.0.send(buf, to)
    }
    fn recv(&self, buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        self.0.recv(buf, from)
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError> {
        self.0.split(color, key)
    }
    fn reads_device_memory(&self) -> bool {
        true
    }
    fn abort(&self, reason: &str) {
        self.0.abort(reason);
    }
    fn aborted(&self) -> Option<String> {
        self.0.aborted()
    }
    fn stats(&self) -> CommStats {
        self.0.stats()
    }
}

/// What rank 0 saw: losses, gradient norms, fp32 masters and model-state bytes crossed per
/// step (to the host, to the device).
type Seen = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<(u64, u64)>);

/// What rank 0 of two thread ranks saw training `plan` for 3 steps on `on`'s device, over the
/// threads backend as it is or (`claims`) saying it reads device memory.
fn run(plan: &zerotrain::Plan, mode: Mode, on: Gpu, claims: bool) -> Seen {
    let init = tiny_gpt(true, 13);
    let w = Tokens { vocab: 11, len: 9 };
    let world = ThreadWorld::new(2, Duration::from_secs(120));
    let out: Vec<_> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let (world, init, w) = (&world, init.clone(), &w);
                s.spawn(move || {
                    let comm: Arc<dyn Collective> = match claims {
                        true => Arc::new(ClaimsDeviceMemory(world.communicator(rank))),
                        false => Arc::new(world.communicator(rank)),
                    };
                    let ctx = RankContext::new(comm, (on.device)().autodiff());
                    let mut engine =
                        if mode.units { Engine::with_units(init, plan, &ctx)? } else { Engine::new(init, plan, &ctx)? };
                    let (mut losses, mut norms, mut crossed) = (Vec::new(), Vec::new(), Vec::new());
                    for step in 0..3 {
                        for micro in 0..plan.batch.gradient_accumulation_steps {
                            micro_step(&mut engine, mode, &w.batch(plan, step, micro, rank, ctx.device()))?;
                        }
                        let report = engine.step()?.expect("a boundary");
                        losses.push(report.loss);
                        norms.push(report.grad_norm);
                        crossed.push((report.host_device.to_host, report.host_device.to_device));
                    }
                    Ok::<_, Error>((losses, norms, engine.master_params()?, crossed))
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().unwrap().unwrap()).collect()
    });
    out.into_iter().next().unwrap()
}

/// Two ranks whose collectives read device memory train exactly as the same two ranks over
/// host collectives (the host-staged step): at every stage (stage 1 with and without
/// reduce-scatter), accumulating 2 micro-steps, as
/// one unit and in units with recomputation and overlap, fp32 and fp16, every loss and
/// master agrees bit for bit where `exact` (lavapipe; elsewhere every loss within
/// `DEVICE_LOSS_TOL`). Clipping is off, so that the norm (summed in f32 on the device, in
/// f64 on the host) does not enter the values; it agrees within 1e-5 relative, which a
/// shard counted twice or not at all would not. And the step stays on the device: at stage
/// 0 in fp32 the only bytes crossing are those the stand-in's collective stages, the
/// accumulator's all-reduce (4Ψ each way).
pub fn ranks_whose_collectives_read_device_memory_step_on_the_device(on: Gpu, exact: bool) {
    let _alone = device_alone();
    let fp16 = r#"{ "fp16": {"enabled": true, "initial_scale_power": 8},"#;
    let (sizes, root) = unit_sizes(&tiny_gpt(true, 13));
    let psi: u64 = sizes.iter().map(|&u| u as u64).sum::<u64>() + root as u64;
    for precision in ["fp32", "fp16"] {
        // Stage 1 reduces with a reduce-scatter by default, and all-reduces without.
        for (stage, zero) in [(0, ""), (1, ""), (1, r#", "reduce_scatter": false"#), (2, ""), (3, "")] {
            for mode in [MODES[0], MODES[5]] {
                let what = format!("{} {precision} stage {stage}{zero} {mode:?}", on.name);
                let json = unit_recipe(stage, 2, mode, "fp32", zero);
                let unclipped = json.replace(r#""gradient_clipping": 0.05"#, r#""gradient_clipping": 0.0"#);
                assert_ne!(json, unclipped, "the recipe's clipping moved");
                let json = if precision == "fp16" { unclipped.replacen('{', fp16, 1) } else { unclipped };
                let plan = plan(&on_device(&json, on), 2);
                let (device_losses, device_norms, device_masters, crossed) = run(&plan, mode, on, true);
                let (host_losses, host_norms, host_masters, _) = run(&plan, mode, on, false);
                // Elsewhere the masters are not compared: Adam turns a last-bit difference of a
                // near-zero gradient into a step.
                if exact {
                    assert_eq!(device_losses, host_losses, "{what}: losses");
                    assert_eq!(device_masters, host_masters, "{what}: masters");
                }
                for (d, h) in device_losses.iter().zip(&host_losses) {
                    assert!((d - h).abs() <= DEVICE_LOSS_TOL * h.abs(), "{what}: loss {d} vs {h} host-staged");
                }
                for (d, h) in device_norms.iter().zip(&host_norms) {
                    assert!((d - h).abs() <= 1e-5 * h.abs(), "{what}: norm {d} vs {h} host-staged");
                }
                if stage == 0 && precision == "fp32" {
                    assert!(crossed.iter().all(|&c| c == (4 * psi, 4 * psi)), "{what}: {crossed:?}, 4Ψ = {}", 4 * psi);
                }
            }
        }
    }
}
