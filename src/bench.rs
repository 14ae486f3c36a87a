//! Benchmarks printed by `zerotrain bench`: each table measures its competitors in the same
//! run, so that ratios hold on a noisy machine.

use std::hint::black_box;
use std::time::{Duration, Instant};

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
/// each; reports the best time of each.
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
    out.push_str(&format!("{:<12} {:>10} {:>9} {:>10}\n", "op", "ms", "GB/s", "vs memcpy"));
    for r in rows {
        out.push_str(&format!("{:<12} {:>10.3} {:>9.2} {:>9.2}x\n", r.op, r.seconds * 1e3, r.gb_per_s, r.vs_memcpy));
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
        assert_eq!(ops, ["memcpy f32", "f32 -> f16", "f16 -> f32", "f32 -> bf16", "bf16 -> f32"]);
        assert_eq!(rows[0].vs_memcpy, 1.0);
        assert!(rows.iter().all(|r| r.seconds > 0.0 && r.gb_per_s.is_finite()));
        assert!(format_conversion_table(&rows, 4096, 2).contains("bf16 -> f32"));
    }
}
