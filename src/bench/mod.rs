//! Benchmarks printed by `zerotrain bench`: each table measures its competitors in the same
//! run, so that ratios hold on a noisy machine.

pub mod engine;
pub mod gpu;
pub mod offload;
pub mod pipeline;
pub mod servers;

use burn::tensor::Tensor;

use zerotrain::engine::UnitModel;
use zerotrain::{Engine, Result};

/// Resolves a benchmark's config text: over MPI under mpirun (its process count the world
/// size), else on `world_size` threads.
pub fn resolve(json: &str, world_size: usize) -> Result<zerotrain::Plan> {
    let mpirun = zerotrain::detect_mpirun();
    let world_size = if mpirun.is_some() { None } else { Some(world_size) };
    Ok(zerotrain::Config::parse(json, "bench")?.resolve(zerotrain::Overrides {
        world_size,
        mpirun,
        ..Default::default()
    })?)
}

/// How a benchmark runs its model through the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum RunMode {
    /// One unit (`Engine::new`, `forward` and `backward`): the whole model at once.
    OneUnit,
    /// One unit per layer (`Engine::with_units`, `forward_backward`), activations kept.
    Units,
    /// One unit per layer with activation checkpointing.
    Checkpointed,
}

impl RunMode {
    /// A few letters for tables: `1-unit`, `units`, `recompute`.
    pub fn short_name(self) -> &'static str {
        match self {
            Self::OneUnit => "1-unit",
            Self::Units => "units",
            Self::Checkpointed => "recompute",
        }
    }

    /// The config keys the mode needs (the `activation_checkpointing` section), to put
    /// first in a JSON object.
    pub fn config_keys(self) -> &'static str {
        if self == Self::Checkpointed { r#""activation_checkpointing": {},"# } else { "" }
    }

    /// The engine for `model` in this mode.
    pub fn engine<M: UnitModel>(
        self,
        model: M,
        plan: &zerotrain::Plan,
        ctx: &zerotrain::RankContext,
    ) -> Result<Engine<M>> {
        match self {
            Self::OneUnit => Engine::new(model, plan, ctx),
            _ => Engine::with_units(model, plan, ctx),
        }
    }

    /// One micro-step on `batch`: `forward_backward` by units, or `forward` with `loss` and
    /// `backward`. Returns the loss value.
    pub fn micro_step<M: UnitModel>(
        self,
        engine: &mut Engine<M>,
        batch: &M::Batch,
        loss: impl FnOnce(&M, &M::Batch) -> Tensor<1>,
    ) -> Result<f32> {
        match self {
            Self::OneUnit => {
                let value = engine.forward(|m| loss(m, batch))?;
                engine.backward(value)
            }
            _ => engine.forward_backward(batch),
        }
    }
}

use std::hint::black_box;
use std::time::{Duration, Instant};

use zerotrain_precision::half::slice::HalfFloatSliceExt;
use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{from_half, to_half};

/// One row of the conversion table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConversionRow {
    /// What was measured.
    pub op: &'static str,
    /// Best time over the repeats, seconds.
    pub seconds: f64,
    /// f32-side bytes per second (4 bytes per element), in GB/s.
    pub gb_per_s: f64,
    /// Throughput relative to the plain memcpy of the same f32 bytes in the same run.
    pub vs_memcpy: f64,
}

/// Converts `elems` f32 values to and from f16 and bf16, and copies them, `repeats` times
/// each; reports the best time of each. The last row is `half`'s slice conversion to bf16,
/// for comparison with zerotrain's.
pub fn conversion_table(elems: usize, repeats: usize) -> Vec<ConversionRow> {
    let src: Vec<f32> = (0..elems).map(|i| (i % 4099) as f32 * 0.37 - 700.0).collect();
    let mut f32_out = vec![0.0f32; elems];
    let mut halves = vec![f16::ZERO; elems];
    let mut brains = vec![bf16::ZERO; elems];
    to_half(&src, &mut halves);
    to_half(&src, &mut brains);
    let best = |f: &mut dyn FnMut()| {
        (0..repeats.max(1))
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .min()
            .unwrap_or(Duration::ZERO)
    };
    let timings = [
        ("memcpy f32", best(&mut || f32_out.copy_from_slice(black_box(&src)))),
        ("f32 -> f16", best(&mut || to_half(black_box(&src), &mut halves))),
        ("f16 -> f32", best(&mut || from_half(black_box(&halves), &mut f32_out))),
        ("f32 -> bf16", best(&mut || to_half(black_box(&src), &mut brains))),
        ("bf16 -> f32", best(&mut || from_half(black_box(&brains), &mut f32_out))),
        // The `half` crate's own slice conversion, the baseline of zerotrain's bf16 rounding.
        ("f32 -> bf16 (half)", best(&mut || black_box(&mut brains[..]).convert_from_f32_slice(black_box(&src)))),
    ];
    black_box((&f32_out, &halves, &brains));
    let bytes = (elems * size_of::<f32>()) as f64;
    let memcpy = timings[0].1.as_secs_f64();
    timings
        .into_iter()
        .map(|(op, t)| {
            let seconds = t.as_secs_f64();
            ConversionRow { op, seconds, gb_per_s: bytes / seconds / 1e9, vs_memcpy: memcpy / seconds }
        })
        .collect()
}

/// The conversion table as text.
pub fn format_conversion_table(rows: &[ConversionRow], elems: usize, repeats: usize) -> String {
    let mut out = format!(
        "flat-buffer conversion, {elems} elements ({:.0} MiB of f32), best of {repeats}; GB/s of f32-side bytes\n",
        (elems * 4) as f64 / (1 << 20) as f64
    );
    out.push_str(&format!("{:<18} {:>10} {:>9} {:>10}\n", "op", "ms", "GB/s", "vs memcpy"));
    for r in rows {
        out.push_str(&format!("{:<18} {:>10.3} {:>9.2} {:>9.2}x\n", r.op, r.seconds * 1e3, r.gb_per_s, r.vs_memcpy));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conversion_table_measures_every_op_against_memcpy() {
        let rows = conversion_table(4096, 2);
        let ops: Vec<&str> = rows.iter().map(|r| r.op).collect();
        assert_eq!(ops, ["memcpy f32", "f32 -> f16", "f16 -> f32", "f32 -> bf16", "bf16 -> f32", "f32 -> bf16 (half)"]);
        for r in &rows {
            assert!(r.seconds > 0.0, "{}: timed nothing", r.op);
            // Throughput counts the f32 side's 4 bytes per element; ratios are to memcpy's
            // time of the same run.
            assert!((r.gb_per_s - 4.0 * 4096.0 / r.seconds / 1e9).abs() <= 1e-9 * r.gb_per_s, "{}", r.op);
            assert!((r.vs_memcpy - rows[0].seconds / r.seconds).abs() <= 1e-12 * r.vs_memcpy, "{}", r.op);
        }
        assert!(format_conversion_table(&rows, 4096, 2).contains("bf16 -> f32"));
    }
}

/// One row of the collectives table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CollectiveRow {
    /// `threads` or `mpi`.
    pub backend: &'static str,
    /// The collective.
    pub op: &'static str,
    /// Bytes of the full buffer.
    pub bytes: usize,
    /// Ranks.
    pub world_size: usize,
    /// Seconds per call (slowest rank, best of the repeats' mean).
    pub seconds: f64,
    /// Algorithm bandwidth: buffer bytes / time, GB/s.
    pub algbw: f64,
    /// Bus bandwidth (nccl-tests convention): algbw x 2(N-1)/N for all-reduce, x (N-1)/N for
    /// reduce-scatter and all-gather, GB/s.
    pub busbw: f64,
}

/// Times all-reduce, reduce-scatter and all-gather of f32 buffers of `sizes` bytes on
/// `comm`. Every rank must call it; every rank gets the same rows (slowest rank's time).
pub fn collectives_on(
    comm: &dyn zerotrain_zero::Collective,
    backend: &'static str,
    sizes: &[usize],
    repeats: usize,
) -> Result<Vec<CollectiveRow>, zerotrain_zero::ZeroError> {
    use zerotrain_zero::ReduceOp;
    let n = comm.world_size();
    let mut rows = Vec::new();
    for &bytes in sizes {
        let elems = (bytes / 4).div_ceil(n) * n;
        let mut full = vec![1.0f32; elems];
        let mut shard = vec![0.0f32; elems / n];
        for op in ["all_reduce", "reduce_scatter", "all_gather"] {
            let mut call = || match op {
                "all_reduce" => comm.all_reduce((&mut full).into(), ReduceOp::Sum),
                "reduce_scatter" => comm.reduce_scatter((&full).into(), (&mut shard).into(), ReduceOp::Sum),
                _ => comm.all_gather((&shard).into(), (&mut full).into()),
            };
            call()?; // warm up
            comm.barrier()?;
            let start = Instant::now();
            for _ in 0..repeats.max(1) {
                call()?;
            }
            let mut t = [(start.elapsed().as_secs_f64() / repeats.max(1) as f64) as f32];
            comm.all_reduce((&mut t[..]).into(), ReduceOp::Max)?;
            let t = [f64::from(t[0])];
            let factor = match op {
                "all_reduce" => 2.0 * (n as f64 - 1.0) / n as f64,
                _ => (n as f64 - 1.0) / n as f64,
            };
            let algbw = (elems * 4) as f64 / t[0] / 1e9;
            rows.push(CollectiveRow {
                backend,
                op,
                bytes: elems * 4,
                world_size: n,
                seconds: t[0],
                algbw,
                busbw: algbw * factor,
            });
        }
    }
    Ok(rows)
}

/// [`collectives_on`] for a threads world of `world_size` ranks in this process.
pub fn collectives_threads(
    world_size: usize,
    sizes: &[usize],
    repeats: usize,
) -> Result<Vec<CollectiveRow>, zerotrain_zero::ZeroError> {
    let world = zerotrain_zero::ThreadWorld::new(world_size, Duration::from_secs(300));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let comm = world.communicator(rank);
                s.spawn(move || collectives_on(&comm, "threads", sizes, repeats))
            })
            .collect();
        let mut results: Vec<_> = handles.into_iter().map(|h| h.join().expect("bench thread")).collect();
        results.swap_remove(0)
    })
}

/// Single-thread memcpy bandwidth of `bytes`, GB/s (best of `repeats`).
pub fn memcpy_gbps(bytes: usize, repeats: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let best = (0..repeats.max(1))
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    bytes as f64 / best / 1e9
}

/// The collectives table as text, with memcpy of the same bytes beside each size.
pub fn format_collectives(rows: &[CollectiveRow], repeats: usize) -> String {
    let mut out =
        format!("collectives on f32 buffers, mean of {repeats} calls, slowest rank; GB/s (nccl-tests convention)\n");
    out.push_str(&format!(
        "{:<8} {:<15} {:>6} {:>12} {:>11} {:>9} {:>9} {:>12}\n",
        "backend", "op", "ranks", "bytes", "time (ms)", "algbw", "busbw", "busbw/memcpy"
    ));
    for r in rows {
        let memcpy = memcpy_gbps(r.bytes.min(256 << 20), 3);
        out.push_str(&format!(
            "{:<8} {:<15} {:>6} {:>12} {:>11.3} {:>9.2} {:>9.2} {:>11.0}%\n",
            r.backend,
            r.op,
            r.world_size,
            r.bytes,
            r.seconds * 1e3,
            r.algbw,
            r.busbw,
            100.0 * r.busbw / memcpy
        ));
    }
    out
}
