//! Consolidation: one safetensors file of every parameter, keyed by module path, streamed
//! parameter by parameter so that memory stays near one tensor.

use std::fs;
use std::path::Path;

use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{Precision, to_half};

use crate::shard::{SafetensorsWriter, TensorSpec};
use crate::{Checkpoint, CheckpointError, Result};

/// Writes `ckpt`'s master weights to `out` as one safetensors file in `dtype`, one tensor
/// per parameter (named by module path, in the model's shape), through `<out>.partial` and
/// a rename, so that `out` is never half-written. Returns the bytes written.
pub fn consolidate(ckpt: &Checkpoint, out: &Path, dtype: Precision) -> Result<u64> {
    let m = ckpt.manifest();
    let st_dtype = match dtype {
        Precision::Fp32 => safetensors::Dtype::F32,
        Precision::Fp16 => safetensors::Dtype::F16,
        Precision::Bf16 => safetensors::Dtype::BF16,
    };
    let specs: Vec<TensorSpec> = m
        .layout
        .iter()
        .map(|e| TensorSpec {
            name: e.path.clone(),
            dtype: st_dtype,
            shape: e.shape.iter().map(|&d| d as usize).collect(),
        })
        .collect();
    let meta = [
        ("format", "pt".to_string()),
        ("zerotrain_tag", m.tag.clone()),
        ("zerotrain_global_step", m.global_step.to_string()),
    ];
    let partial = out.with_file_name(format!(
        "{}.partial",
        out.file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| CheckpointError::Mismatch(format!("{}: not a file path", out.display())))?
    ));
    let mut writer = SafetensorsWriter::create(&partial, &specs, &meta)?;
    for (entry, spec) in m.layout.iter().zip(&specs) {
        let elems = spec.shape.iter().product::<usize>();
        let mut values = vec![0.0f32; elems];
        ckpt.read_range("master", entry.offset..entry.offset + elems as u64, &mut values)?;
        match dtype {
            Precision::Fp32 => writer.write_f32(&values)?,
            Precision::Fp16 => {
                let mut half = vec![f16::ZERO; elems];
                to_half(&values, &mut half);
                writer.write(&half.iter().flat_map(|h| h.to_le_bytes()).collect::<Vec<u8>>())?;
            }
            Precision::Bf16 => {
                let mut half = vec![bf16::ZERO; elems];
                to_half(&values, &mut half);
                writer.write(&half.iter().flat_map(|h| h.to_le_bytes()).collect::<Vec<u8>>())?;
            }
        }
    }
    let summary = writer.finish()?;
    fs::rename(&partial, out).map_err(CheckpointError::io(out))?;
    Ok(summary.size)
}
