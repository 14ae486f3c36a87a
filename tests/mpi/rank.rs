//! One rank's side of the MPI tests: the test binary runs itself under `mpirun` with
//! `--ignored --exact rank::rank_program` and the arguments in `ZEROTRAIN_MPI_RANK_ARGS`
//! (see `main.rs`), so the harness is part of the test, not an installed binary.
//!
//! `MODE [ARGS]` (every process prints `ok ...` lines; any failure panics, which aborts the
//! whole job):
//! - `collectives`: every collective, f32/f16/bf16, against host answers and byte counts.
//! - `train`: stages 0-3, 4 steps, against the threads backend at the same world size run
//!   inside this process.
//! - `save DIR [WORLD]`: 3 steps at stage 2, then a checkpoint (threads if not under mpirun).
//! - `resume DIR STAGE [WORLD]`: resume, 3 more steps, compare with an uninterrupted 6-step
//!   run at the same world size (threads if not under mpirun).
//! - `fail-error` / `fail-kill` / `fail-stall`: rank 1 returns an error / SIGKILLs itself
//!   / SIGSTOPs itself at step 2 (the last with a 2 s collective timeout).
//! - `half`: bf16 and fp16 at stages 0 and 2, 4 steps: the threads backend's masters (the
//!   same bits at 2 processes) and the same bytes of every collective (16-bit gradients
//!   travel as 16 bits).
//! - `buffers`: a BatchNorm conv net, 6 steps at stage 2: every rank's running statistics
//!   equal, and equal to the threads backend's.
//! - `dropout`: an MLP with dropout on its input, stages 0 and 3, 4 steps, against the
//!   threads backend: a rank draws its masks by its rank, not by its process.

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use zerotrain::{Config, Engine, Error, LoadOptions, Overrides, Plan, RankContext, launch};
use zerotrain_models::{ConvNet, ImageTask, Mlp, RegressionTask};
use zerotrain_precision::{BufRef, FlatBuf, Precision};
use zerotrain_zero::collective::{CommStats, OpKind, convention_bytes};
use zerotrain_zero::{Collective, ReduceOp, ThreadWorld};

const TASK: RegressionTask = RegressionTask { seq_len: 5, features: 6 };

fn plan(stage: u8, world_size: Option<usize>) -> Plan {
    plan_with(stage, world_size, "")
}

/// [`plan`] with `extra` top-level fields (each followed by a comma).
fn plan_with(stage: u8, world_size: Option<usize>, extra: &str) -> Plan {
    plan_of_batch(stage, world_size, extra, 12)
}

/// [`plan_with`] with `batch` samples per step.
fn plan_of_batch(stage: u8, world_size: Option<usize>, extra: &str, batch: u64) -> Plan {
    plan_from(stage, world_size, extra, batch, zerotrain::detect_mpirun())
}

/// [`plan_of_batch`] for `mpirun`'s processes (`Some`) or for threads (`None`).
fn plan_from(
    stage: u8,
    world_size: Option<usize>,
    extra: &str,
    batch: u64,
    mpirun: Option<zerotrain::config::MpirunEnvironment>,
) -> Plan {
    let json = format!(
        r#"{{{extra} "train_batch_size": {batch}, "gradient_clipping": 0.05, "zero_optimization": {{"stage": {stage}}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.1}}}},
            "zerotrain": {{"comm_timeout_s": 60}}}}"#
    );
    Config::parse(&json, "mpi-check")
        .and_then(|c| c.resolve(Overrides { world_size, mpirun, ..Overrides::default() }))
        .expect("plan")
}

fn init() -> Mlp {
    let device = Device::flex().autodiff();
    device.seed(31);
    drawn(Mlp::new(&[6, 24, 6], &device))
}

/// `model` with its lazily initialised values drawn now, from the seed just set (Burn
/// draws a parameter's values at its first access, which would otherwise happen in the
/// rank threads).
fn drawn<M: burn::module::Module>(model: M) -> M {
    drop(burn::module::Module::valid(&model));
    model
}

/// Trains `model` for `steps` on `ctx` (optionally resuming / saving / failing) and returns
/// the fp32 masters. The model is built once per process, before any rank thread starts:
/// rank threads building it would race on Flex's process-wide RNG.
fn train(
    model: Mlp,
    ctx: &RankContext,
    plan: &Plan,
    steps: std::ops::Range<u64>,
    resume: Option<&str>,
    save: Option<&str>,
    fail: Option<&str>,
) -> Result<Vec<f32>, Error> {
    let mut engine = Engine::new(model, plan, ctx)?;
    if let Some(dir) = resume {
        engine.load_checkpoint(dir, None, LoadOptions::default())?;
    }
    let (b, r) = (plan.batch, ctx.rank() as u64);
    for step in steps {
        if step == 2 && r == 1 {
            match fail {
                Some("fail-error") => return Err(Error::Usage("rank 1 injected an error at step 2".into())),
                Some("fail-stall") => {
                    // Alive but stopped: no collective ever completes with it again.
                    let _ =
                        std::process::Command::new("kill").args(["-STOP", &std::process::id().to_string()]).status();
                }
                Some("fail-kill") => {
                    let _ = std::process::Command::new("kill").args(["-9", &std::process::id().to_string()]).status();
                    std::thread::sleep(Duration::from_secs(60));
                }
                _ => {}
            }
        }
        let first = step * b.train_batch_size + r * b.micro_batch_per_rank;
        let batch = TASK.batch(first..first + b.micro_batch_per_rank, ctx.device());
        let loss = engine.forward(|m| m.loss(&batch))?;
        engine.backward(loss)?;
        engine.step()?;
    }
    if let Some(dir) = save {
        engine.save_checkpoint(dir, None, serde_json::Value::Null)?;
    }
    engine.master_params()
}

/// [`Mlp`] with dropout on its input.
#[derive(burn::module::Module, Debug)]
struct NoisyMlp {
    mlp: Mlp,
    dropout: burn::nn::Dropout,
}

/// [`train`]'s data and steps, through [`NoisyMlp`] at dropout 0.2 (rank 0's masters).
fn train_noisy(model: Mlp, ctx: &RankContext, plan: &Plan) -> Result<Vec<f32>, Error> {
    let model = NoisyMlp { mlp: model, dropout: burn::nn::DropoutConfig::new(0.2).init() };
    let mut engine = Engine::new(model, plan, ctx)?;
    let (b, r) = (plan.batch, ctx.rank() as u64);
    for step in 0..4 {
        let first = step * b.train_batch_size + r * b.micro_batch_per_rank;
        let batch = TASK.batch(first..first + b.micro_batch_per_rank, ctx.device());
        let loss = engine.forward(|m| {
            let dropped = zerotrain_models::Batch { input: m.dropout.forward(batch.input.clone()), ..batch };
            m.mlp.loss(&dropped)
        })?;
        engine.backward(loss)?;
        engine.step()?;
    }
    engine.master_params()
}

/// The same training on `world_size` threads inside this process (rank 0's masters).
fn threads_reference(plan: &Plan, steps: std::ops::Range<u64>, resume: Option<&str>) -> Vec<f32> {
    threads_reference_with_traffic(plan, steps, resume).0
}

/// [`threads_reference`], with the traffic rank 0 recorded.
fn threads_reference_with_traffic(
    plan: &Plan,
    steps: std::ops::Range<u64>,
    resume: Option<&str>,
) -> (Vec<f32>, CommStats) {
    on_threads(plan, |model, ctx, plan| {
        let before = ctx.collective().stats();
        let masters = train(model, ctx, plan, steps.clone(), resume, None, None).expect("threads reference");
        (masters, ctx.collective().stats().since(&before))
    })
}

/// Runs `f` on `plan.world_size()` thread ranks inside this process, each with the model
/// built once here; rank 0's result.
fn on_threads<T: Send>(plan: &Plan, f: impl Fn(Mlp, &RankContext, &Plan) -> T + Sync) -> T {
    let model = init();
    let mut plan = plan.clone();
    plan.runtime.backend = zerotrain::config::Backend::Threads;
    let world = ThreadWorld::new(plan.world_size(), Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..plan.world_size())
            .map(|rank| {
                let ctx = RankContext::new(Arc::new(world.communicator(rank)), Device::flex().autodiff());
                let (plan, model, f) = (&plan, model.clone(), &f);
                s.spawn(move || f(model, &ctx, plan))
            })
            .collect();
        handles.into_iter().next().unwrap().join().unwrap()
    })
}

/// Replica groups: `steps` of [`train`]'s data under `plan`'s `local_sgd` groups, through
/// `replicas::split` and `LocalSgd`; the masters after (the last step ends with a round).
fn train_groups(model: Mlp, ctx: &RankContext, plan: &Plan, steps: std::ops::Range<u64>) -> Result<Vec<f32>, Error> {
    use zerotrain::Trainer;
    let (group_ctx, group_plan, replicas) = zerotrain::replicas::split(ctx, plan)?;
    let mut local = zerotrain::replicas::LocalSgd::new(Engine::new(model, &group_plan, &group_ctx)?, replicas)?;
    // Each rank reads its place in the batch of every group together (with servers the
    // job is one group of several).
    let (r, n) = (local.data_parallel_rank() as u64, local.data_parallel_size() as u64);
    let micro = plan.batch.micro_batch_per_rank;
    for step in steps {
        let first = (step * n + r) * micro;
        let batch = TASK.batch(first..first + micro, group_ctx.device());
        let loss = local.engine_mut().forward(|m| m.loss(&batch))?;
        local.engine_mut().backward(loss)?;
        local.step()?;
    }
    local.engine().master_params()
}

/// [`train_groups`] on `plan.world_size()` threads inside this process (rank 0's masters).
fn threads_groups_reference(plan: &Plan, steps: std::ops::Range<u64>) -> Vec<f32> {
    on_threads(plan, |model, ctx, plan| train_groups(model, ctx, plan, steps.clone()).expect("threads reference"))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((rank * 7919 + i * 31) % 1000) as f32 * 0.013 - 3.1).collect()
}

fn collectives(comm: &dyn Collective) {
    let (rank, n) = (comm.rank(), comm.world_size());
    for dtype in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        for len in [0, 1, 7, 1000 * n, 4099] {
            let host = |op: ReduceOp| -> Vec<f32> {
                let widened: Vec<Vec<f32>> =
                    (0..n).map(|r| FlatBuf::from_f32(dtype, &input(r, len)).into_f32()).collect();
                let combined = (0..len)
                    .map(|i| widened.iter().skip(1).fold(widened[0][i], |a, w| op.apply(a, w[i])))
                    .collect::<Vec<f32>>();
                FlatBuf::from_f32(dtype, &combined).into_f32()
            };
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let mut buf = FlatBuf::from_f32(dtype, &input(rank, len));
                let before_reduce = comm.stats();
                comm.all_reduce(buf.as_mut(), op).unwrap();
                let got = buf.into_f32();
                // 16-bit sums are combined in f32 in rank order and rounded once, as the
                // host does: the same bits. MPI sums f32 in an order of its own.
                let tolerance = if op == ReduceOp::Sum && dtype == Precision::Fp32 { 1e-5 } else { 0.0 };
                for (g, h) in got.iter().zip(host(op)) {
                    assert!((g - h).abs() <= tolerance * h.abs().max(1.0), "{dtype} {op:?} len {len}: {g} vs {h}");
                }
                let moved = comm.stats().since(&before_reduce);
                assert_eq!(
                    moved.all_reduce.bytes,
                    convention_bytes(OpKind::AllReduce, len, dtype.bytes_per_elem(), n, rank, 0),
                    "{dtype} all-reduce of {len} moves its own dtype's bytes"
                );
            }
            let chunk = len / n;
            let src = FlatBuf::from_f32(dtype, &input(rank, chunk * n));
            let mut shard = FlatBuf::zeros(dtype, chunk);
            let before = comm.stats();
            comm.reduce_scatter(src.as_ref(), shard.as_mut(), ReduceOp::Sum).unwrap();
            let expected: Vec<f32> = {
                let widened: Vec<Vec<f32>> =
                    (0..n).map(|r| FlatBuf::from_f32(dtype, &input(r, chunk * n)).into_f32()).collect();
                let mine = rank * chunk..(rank + 1) * chunk;
                let sums: Vec<f32> =
                    mine.map(|i| widened.iter().skip(1).fold(widened[0][i], |a, w| a + w[i])).collect();
                FlatBuf::from_f32(dtype, &sums).into_f32()
            };
            for (g, h) in shard.clone().into_f32().iter().zip(&expected) {
                let tolerance = if dtype == Precision::Fp32 { 1e-5 * h.abs().max(1.0) } else { 0.0 };
                assert!((g - h).abs() <= tolerance, "{dtype} reduce-scatter of {len}: {g} vs {h}");
            }
            let mut full = FlatBuf::zeros(dtype, chunk * n);
            comm.all_gather(shard.as_ref(), full.as_mut()).unwrap();
            let moved = comm.stats().since(&before);
            assert_eq!(
                moved.reduce_scatter.bytes,
                convention_bytes(OpKind::ReduceScatter, chunk * n, dtype.bytes_per_elem(), n, rank, 0)
            );
            assert_eq!(
                moved.all_gather.bytes,
                convention_bytes(OpKind::AllGather, chunk * n, dtype.bytes_per_elem(), n, rank, 0)
            );
            let mut b = FlatBuf::from_f32(dtype, &input(rank, len));
            comm.broadcast(b.as_mut(), n - 1).unwrap();
            assert_eq!(b, FlatBuf::from_f32(dtype, &input(n - 1, len)));
        }
    }
    point_to_point_and_groups(comm);
    comm.barrier().unwrap();
    println!("ok collectives rank {rank} of {n}");
}

/// Buffered sends (every rank sends a ring's worth, large enough for MPI's rendezvous
/// protocol, before receiving), in order, in every dtype; and groups split by parity.
fn point_to_point_and_groups(comm: &dyn Collective) {
    let (rank, n) = (comm.rank(), comm.world_size());
    let (next, previous) = ((rank + 1) % n, (rank + n - 1) % n);
    for dtype in [Precision::Fp32, Precision::Bf16] {
        for k in 0..3 {
            comm.send(FlatBuf::from_f32(dtype, &input(rank + k, 300_000)).as_ref(), next).unwrap();
        }
        for k in 0..3 {
            let mut got = FlatBuf::zeros(dtype, 300_000);
            comm.recv(got.as_mut(), previous).unwrap();
            assert_eq!(got, FlatBuf::from_f32(dtype, &input(previous + k, 300_000)), "{dtype} message {k}");
        }
    }
    // The uneven all-to-all: rank r sends rank j (r + 2j) % 3 elements (none for some
    // pairs), counts exchanged first; what arrives is laid out by hand.
    let count = |from: usize, to: usize| (from + 2 * to) % 3;
    let value = |from: usize, to: usize, k: usize| (from * 100 + to * 10 + k) as f32;
    let counts: Vec<usize> = (0..n).map(|to| count(rank, to)).collect();
    let parts: Vec<f32> = (0..n).flat_map(|to| (0..count(rank, to)).map(move |k| value(rank, to, k))).collect();
    let (got, from) = zerotrain_zero::exchange(comm, BufRef::F32(&parts), &counts).unwrap();
    let want: Vec<f32> = (0..n).flat_map(|i| (0..count(i, rank)).map(move |k| value(i, rank, k))).collect();
    assert_eq!((got.into_f32(), from), (want, (0..n).map(|i| count(i, rank)).collect::<Vec<_>>()), "all-to-all");
    let group = comm.split(rank % 2, n - rank).unwrap();
    let members: Vec<usize> = (0..n).filter(|r| r % 2 == rank % 2).rev().collect();
    assert_eq!((group.rank(), group.world_size()), (members.iter().position(|&r| r == rank).unwrap(), members.len()));
    let mut gathered = vec![0.0f32; members.len()];
    group.all_gather(BufRef::F32(&[rank as f32]), (&mut gathered).into()).unwrap();
    assert_eq!(gathered, members.iter().map(|&r| r as f32).collect::<Vec<_>>());
}

/// A 2-stage pipeline of 2 data-parallel ranks each, 3 micro-batches per step.
fn pipeline_plan(world_size: Option<usize>, schedule: &str) -> Plan {
    let json = format!(
        r#"{{"train_batch_size": 12, "gradient_accumulation_steps": 3, "gradient_clipping": 0.05,
            "zero_optimization": {{"stage": 1}}, "pipeline": {{"stages": 2}},
            "optimizer": {{"type": "AdamW", "params": {{"lr": 0.01, "weight_decay": 0.1}}}},
            "zerotrain": {{"comm_timeout_s": 60, "schedule": "{schedule}"}}}}"#
    );
    Config::parse(&json, "mpi-pipeline")
        .and_then(|c| c.resolve(Overrides { world_size, mpirun: zerotrain::detect_mpirun(), ..Overrides::default() }))
        .expect("plan")
}

/// Pipelined training of `model` (its layers the units) for `steps`: the fp32 masters.
fn train_pipelined(model: Mlp, ctx: &RankContext, plan: &Plan, steps: std::ops::Range<u64>) -> Result<Vec<f32>, Error> {
    let mut engine = zerotrain::Pipeline::new(model, plan, ctx)?;
    let (b, d) = (plan.batch, ctx.rank() as u64 % 2);
    for step in steps {
        engine.train_batch(|micro| {
            let first = step * b.train_batch_size + (micro as u64 * 2 + d) * b.micro_batch_per_rank;
            TASK.batch(first..first + b.micro_batch_per_rank, ctx.device())
        })?;
    }
    engine.master_params()
}

fn conv_net() -> ConvNet {
    let device = Device::flex().autodiff();
    device.seed(35);
    drawn(ConvNet::new(4, &device))
}

/// Six steps of the conv net at this rank's share of 12 images per step; returns its
/// running statistics (after the engine averaged them over the ranks).
fn train_conv(model: ConvNet, ctx: &RankContext, plan: &Plan) -> Result<Vec<f32>, Error> {
    let mut engine = Engine::with_units(model, plan, ctx)?;
    let per = plan.batch.micro_batch_per_rank;
    for step in 0..6u64 {
        let first = step * plan.batch.train_batch_size + ctx.rank() as u64 * per;
        engine.forward_backward(&ImageTask.batch(first..first + per, ctx.device()))?;
        engine.step()?;
    }
    engine.sync_buffers()?;
    drop(burn::module::Module::valid(engine.module()));
    let mut values = Vec::new();
    burn::module::Module::visit(engine.module(), &mut Statistics(&mut values));
    Ok(values)
}

/// Collects the non-trainable tensors' values.
struct Statistics<'a>(&'a mut Vec<f32>);

impl burn::module::ModuleVisitor for Statistics<'_> {
    fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<burn::tensor::Tensor<D>>) {
        if !param.val().is_require_grad() {
            self.0.extend(param.val().into_data().try_to_vec::<f32>().expect("f32 statistics"));
        }
    }
}

/// The variable that carries a rank's arguments, separated by [`ARG_SEPARATOR`].
pub const ARGS_VAR: &str = "ZEROTRAIN_MPI_RANK_ARGS";
/// Separates the arguments in [`ARGS_VAR`].
pub const ARG_SEPARATOR: char = '\u{1f}';

#[test]
#[ignore = "one rank of an MPI job: the other tests in this file run it under mpirun"]
fn rank_program() {
    let args: Vec<String> = std::env::var(ARGS_VAR)
        .unwrap_or_else(|_| panic!("{ARGS_VAR} is not set: this test runs only as a child of the MPI tests"))
        .split(ARG_SEPARATOR)
        .map(str::to_string)
        .collect();
    let mode = args.first().map(String::as_str).unwrap_or("");
    let world = args.get(2).and_then(|w| w.parse().ok());
    let stage = match mode {
        "resume" => args.get(2).and_then(|s| s.parse().ok()).unwrap_or(2),
        _ => 2,
    };
    let world = match mode {
        "resume" => args.get(3).and_then(|w| w.parse().ok()),
        _ => world,
    };
    let mut the_plan = plan(stage, if mode == "save" || mode == "resume" { world } else { None });
    if mode == "fail-stall" {
        the_plan.runtime.comm_timeout = Duration::from_secs(2);
    }
    let model = init();
    let result = launch(&the_plan, |ctx| -> Result<(), Error> {
        match mode {
            "collectives" => collectives(ctx.collective().as_ref()),
            "pipeline" => {
                for schedule in ["gpipe", "1f1b"] {
                    let plan = pipeline_plan(None, schedule);
                    let got = train_pipelined(model.clone(), &ctx, &plan, 0..3)?;
                    let diff = if ctx.rank() == 0 {
                        let mut threads = pipeline_plan(Some(4), schedule);
                        threads.runtime.backend = zerotrain::config::Backend::Threads;
                        let world = ThreadWorld::new(4, Duration::from_secs(60));
                        let reference = std::thread::scope(|s| {
                            let handles: Vec<_> = (0..4)
                                .map(|rank| {
                                    let ctx =
                                        RankContext::new(Arc::new(world.communicator(rank)), Device::flex().autodiff());
                                    let (plan, model) = (&threads, model.clone());
                                    s.spawn(move || {
                                        train_pipelined(model, &ctx, plan, 0..3).expect("threads reference")
                                    })
                                })
                                .collect();
                            handles.into_iter().next().unwrap().join().unwrap()
                        });
                        max_diff(&got, &reference)
                    } else {
                        0.0
                    };
                    assert!(diff <= 1e-6, "{schedule}: MPI vs threads differ by {diff}");
                    println!("ok pipeline {schedule} rank {} diff {diff:e}", ctx.rank());
                }
            }
            "groups" => {
                let extra = r#""local_sgd": {"groups": 2, "sync_every": 2},"#;
                let plan = plan_with(2, Some(ctx.world_size()), extra);
                let got = train_groups(model.clone(), &ctx, &plan, 0..4)?;
                let diff = if ctx.rank() == 0 { max_diff(&got, &threads_groups_reference(&plan, 0..4)) } else { 0.0 };
                assert!(diff <= 1e-6, "replica groups: MPI vs threads differ by {diff}");
                println!("ok groups rank {} diff {diff:e}", ctx.rank());
            }
            "server-group" => {
                // This job is one group of 2 through the server at `args[1]`; the reference
                // is the same 2 groups of 2 as threads in one job.
                let (addr, group) = (args[1].as_str(), args[2].parse::<usize>().expect("a group"));
                let extra = format!(
                    r#""local_sgd": {{"groups": 2, "sync_every": 2, "servers": ["{addr}"], "group": {group}}},"#
                );
                let plan = plan_of_batch(2, Some(ctx.world_size()), &extra, 6);
                let got = train_groups(model.clone(), &ctx, &plan, 0..4)?;
                let in_job = plan_from(2, Some(4), r#""local_sgd": {"groups": 2, "sync_every": 2},"#, 12, None);
                let diff = if ctx.rank() == 0 { max_diff(&got, &threads_groups_reference(&in_job, 0..4)) } else { 0.0 };
                assert!(diff == 0.0, "server group {group}: MPI job vs in-job threads differ by {diff}");
                println!("ok server-group {group} rank {} diff {diff:e}", ctx.rank());
            }
            "train" => {
                for stage in 0..=3 {
                    let plan = plan(stage, Some(ctx.world_size()));
                    let got = train(model.clone(), &ctx, &plan, 0..4, None, None, None)?;
                    let diff =
                        if ctx.rank() == 0 { max_diff(&got, &threads_reference(&plan, 0..4, None)) } else { 0.0 };
                    assert!(diff <= 1e-6, "stage {stage}: MPI vs threads differ by {diff}");
                    println!("ok train stage {stage} rank {} diff {diff:e}", ctx.rank());
                }
            }
            "half" => {
                let precisions =
                    [r#""bf16": {"enabled": true},"#, r#""fp16": {"enabled": true, "initial_scale_power": 10},"#];
                for precision in precisions {
                    for stage in [0, 2] {
                        let plan = plan_with(stage, Some(ctx.world_size()), precision);
                        let comm = ctx.collective();
                        let before = comm.stats();
                        let got = train(model.clone(), &ctx, &plan, 0..4, None, None, None)?;
                        let moved = comm.stats().since(&before);
                        if ctx.rank() == 0 {
                            let (reference, expected) = threads_reference_with_traffic(&plan, 0..4, None);
                            // Two f32 terms sum alike in any order: the bits must agree.
                            let diff = max_diff(&got, &reference);
                            let bound = if ctx.world_size() == 2 { 0.0 } else { 1e-6 };
                            assert!(diff <= bound, "{precision} stage {stage}: MPI vs threads differ by {diff}");
                            for (kind, mpi, threads) in [
                                ("all-reduce", moved.all_reduce.bytes, expected.all_reduce.bytes),
                                ("reduce-scatter", moved.reduce_scatter.bytes, expected.reduce_scatter.bytes),
                                ("all-gather", moved.all_gather.bytes, expected.all_gather.bytes),
                            ] {
                                assert_eq!(mpi, threads, "{precision} stage {stage}: {kind} bytes, MPI vs threads");
                            }
                        }
                        println!("ok half {precision} stage {stage} rank {}", ctx.rank());
                    }
                }
            }
            "save" => {
                train(model.clone(), &ctx, &the_plan, 0..3, None, Some(&args[1]), None)?;
                println!("ok save rank {} of {}", ctx.rank(), ctx.world_size());
            }
            "resume" => {
                let got = train(model.clone(), &ctx, &the_plan, 3..6, Some(&args[1]), None, None)?;
                if ctx.rank() == 0 {
                    let whole = threads_reference(&the_plan, 0..6, None);
                    let diff = max_diff(&got, &whole);
                    assert!(diff <= 2e-6, "resumed vs uninterrupted: {diff}");
                    println!("ok resume stage {stage} world {} diff {diff:e}", ctx.world_size());
                }
            }
            "buffers" => {
                let conv = conv_net();
                let plan = plan(2, Some(ctx.world_size()));
                let mine = train_conv(conv.clone(), &ctx, &plan)?;
                let comm = ctx.collective();
                let mut all = vec![0.0f32; mine.len() * ctx.world_size()];
                comm.all_gather((&mine).into(), (&mut all).into())?;
                for (rank, theirs) in all.chunks(mine.len()).enumerate() {
                    assert!(
                        theirs == mine.as_slice(),
                        "rank {rank}'s running statistics differ from rank {}'s",
                        ctx.rank()
                    );
                }
                if ctx.rank() == 0 {
                    let mut threads = plan.clone();
                    threads.runtime.backend = zerotrain::config::Backend::Threads;
                    let world = ThreadWorld::new(threads.world_size(), Duration::from_secs(60));
                    let reference = std::thread::scope(|s| {
                        let handles: Vec<_> = (0..threads.world_size())
                            .map(|rank| {
                                let ctx =
                                    RankContext::new(Arc::new(world.communicator(rank)), Device::flex().autodiff());
                                let (plan, conv) = (&threads, conv.clone());
                                s.spawn(move || train_conv(conv, &ctx, plan).expect("threads reference"))
                            })
                            .collect();
                        handles.into_iter().next().unwrap().join().unwrap()
                    });
                    let diff = max_diff(&mine, &reference);
                    assert!(diff <= 1e-6, "MPI vs threads running statistics differ by {diff}");
                }
                println!("ok buffers rank {}", ctx.rank());
            }
            "dropout" => {
                for stage in [0, 3] {
                    let plan = plan(stage, Some(ctx.world_size()));
                    let got = train_noisy(model.clone(), &ctx, &plan)?;
                    let diff = if ctx.rank() == 0 {
                        let reference = on_threads(&plan, train_noisy);
                        max_diff(&got, &reference.expect("threads reference"))
                    } else {
                        0.0
                    };
                    assert!(diff <= 1e-6, "dropout stage {stage}: MPI vs threads differ by {diff}");
                    println!("ok dropout stage {stage} rank {} diff {diff:e}", ctx.rank());
                }
            }
            "fail-error" | "fail-kill" | "fail-stall" => {
                train(model.clone(), &ctx, &the_plan, 0..5, None, None, Some(mode))?;
            }
            other => panic!("unknown mode {other:?}"),
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("error: {e}");
    }
}
