//! Consolidation: one safetensors file of every parameter and buffer, keyed by module path
//! (what a strict Burn load expects), streamed in chunks of [`CHUNK_ELEMS`], so that memory
//! stays bounded whatever the manifest says a tensor's size is (a hostile manifest cannot
//! make it allocate before the shards are read and checked, and a large frozen layer, a
//! buffer, streams like a parameter).

use std::fs;
use std::ops::Range;
use std::path::Path;

use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{Precision, to_half};

use crate::shard::{SafetensorsWriter, ShardReader, TensorSpec};
use crate::{Checkpoint, CheckpointError, LayoutEntry, Result};

/// Elements read, converted and written at a time (4 MiB of f32).
pub const CHUNK_ELEMS: u64 = 1 << 20;

/// Writes `ckpt`'s master weights to `out` as one safetensors file in `dtype`, one tensor
/// per parameter (named by module path, in the model's shape), through `<out>.partial` and
/// a rename, so that `out` is never half-written; on failure the partial file is removed.
/// `out` must be a file path outside the checkpoint's directory. Returns the bytes written.
pub fn consolidate(ckpt: &Checkpoint, out: &Path, dtype: Precision) -> Result<u64> {
    let partial = check_output(ckpt, out)?;
    let written = write_consolidated(ckpt, &partial, dtype).and_then(|size| {
        fs::rename(&partial, out).map_err(CheckpointError::io(out))?;
        Ok(size)
    });
    if written.is_err() {
        let _ = fs::remove_file(&partial);
    }
    written
}

/// `<out>.partial`, after refusing an `out` that is a directory or lies inside the
/// checkpoint being read (writing there could destroy the checkpoint).
fn check_output(ckpt: &Checkpoint, out: &Path) -> Result<std::path::PathBuf> {
    let refuse = |reason: &str| CheckpointError::InvalidOutput { path: out.to_path_buf(), reason: reason.into() };
    if out.is_dir() {
        return Err(refuse("is a directory; give a file path such as model.safetensors"));
    }
    let name = out.file_name().and_then(|n| n.to_str()).ok_or_else(|| refuse("not a file path"))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = fs::canonicalize(parent).map_err(CheckpointError::io(parent))?;
    let source = fs::canonicalize(ckpt.dir()).map_err(CheckpointError::io(ckpt.dir()))?;
    let resolved = fs::canonicalize(out).unwrap_or_else(|_| parent.join(name));
    if parent.starts_with(&source) || resolved.starts_with(&source) {
        return Err(refuse(&format!("is inside the checkpoint being read ({}); write it elsewhere", source.display())));
    }
    Ok(parent.join(format!("{name}.partial")))
}

fn write_consolidated(ckpt: &Checkpoint, partial: &Path, dtype: Precision) -> Result<u64> {
    let m = ckpt.manifest();
    let st_dtype = safetensors_dtype(dtype);
    let buffers = m.buffers.as_ref().map(|b| b.layout.as_slice()).unwrap_or_default();
    let specs: Vec<TensorSpec> = m
        .layout
        .iter()
        .chain(buffers)
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
    let mut writer = SafetensorsWriter::create(partial, &specs, &meta)?;
    stream(&m.layout, |range, out| ckpt.read_range("master", range, out), &mut writer, dtype)?;
    if let Some(buffers) = &m.buffers {
        let mut reader = ShardReader::open(ckpt.dir(), &buffers.file, &["buffers".to_string()])?;
        stream(&buffers.layout, |range, out| reader.read_f32("buffers", range, out), &mut writer, dtype)?;
    }
    Ok(writer.finish()?.size)
}

/// Writes the parameters `entries` (of `ckpt`'s layout) to one safetensors file at `path`
/// in `dtype`, streamed from the master weights as [`consolidate`] does, with `meta` as
/// the file's metadata. The caller makes `path` atomic (a Hugging Face export writes its
/// shards into a folder it renames). Returns the bytes written.
pub fn write_parameters(
    ckpt: &Checkpoint,
    entries: &[LayoutEntry],
    path: &Path,
    dtype: Precision,
    meta: &[(&str, String)],
) -> Result<u64> {
    let names: Vec<String> = entries.iter().map(|e| e.path.clone()).collect();
    write_parameters_as(ckpt, entries, &names, path, dtype, meta)
}

/// [`write_parameters`] with each tensor named `names[i]` instead of its module path (a
/// format of its own names: PEFT's adapter files).
pub fn write_parameters_as(
    ckpt: &Checkpoint,
    entries: &[LayoutEntry],
    names: &[String],
    path: &Path,
    dtype: Precision,
    meta: &[(&str, String)],
) -> Result<u64> {
    assert_eq!(entries.len(), names.len(), "a name per tensor");
    let specs: Vec<TensorSpec> = entries
        .iter()
        .zip(names)
        .map(|(e, name)| TensorSpec {
            name: name.clone(),
            dtype: safetensors_dtype(dtype),
            shape: e.shape.iter().map(|&d| d as usize).collect(),
        })
        .collect();
    let mut writer = SafetensorsWriter::create(path, &specs, meta)?;
    stream(entries, |range, out| ckpt.read_range("master", range, out), &mut writer, dtype)?;
    Ok(writer.finish()?.size)
}

fn safetensors_dtype(dtype: Precision) -> safetensors::Dtype {
    match dtype {
        Precision::Fp32 => safetensors::Dtype::F32,
        Precision::Fp16 => safetensors::Dtype::F16,
        Precision::Bf16 => safetensors::Dtype::BF16,
    }
}

/// Writes the tensors `specs` (name, shape) to the safetensors file `path` in `dtype`, the
/// `i`-th one's f32 values computed by `values(i)` when it is written: one tensor in memory
/// at a time (a merged model's weights, computed from a checkpoint tensor by tensor).
pub fn write_computed(
    path: &Path,
    specs: &[(String, Vec<usize>)],
    dtype: Precision,
    meta: &[(&str, String)],
    mut values: impl FnMut(usize) -> Result<Vec<f32>>,
) -> Result<u64> {
    let tensors: Vec<TensorSpec> = specs
        .iter()
        .map(|(name, shape)| TensorSpec { name: name.clone(), dtype: safetensors_dtype(dtype), shape: shape.clone() })
        .collect();
    let mut writer = SafetensorsWriter::create(path, &tensors, meta)?;
    for (i, (name, shape)) in specs.iter().enumerate() {
        let v = values(i)?;
        if v.len() != shape.iter().product::<usize>() {
            return Err(CheckpointError::Mismatch(format!("tensor `{name}`: {} values for shape {shape:?}", v.len())));
        }
        write_as(&mut writer, &v, dtype)?;
    }
    Ok(writer.finish()?.size)
}

/// Writes each tensor of `layout` in `dtype`, read by `read` (a range of the flat order
/// into a buffer of its length) in chunks of at most [`CHUNK_ELEMS`].
fn stream(
    layout: &[LayoutEntry],
    mut read: impl FnMut(Range<u64>, &mut [f32]) -> Result<()>,
    writer: &mut SafetensorsWriter,
    dtype: Precision,
) -> Result<()> {
    let mut values = Vec::new();
    for entry in layout {
        let end = entry.offset + entry.shape.iter().product::<u64>();
        let mut at = entry.offset;
        while at < end {
            let n = CHUNK_ELEMS.min(end - at);
            values.resize(n as usize, 0.0f32);
            read(at..at + n, &mut values)?;
            at += n;
            write_as(writer, &values, dtype)?;
        }
    }
    Ok(())
}

/// Writes f32 `values` in `dtype`.
fn write_as(writer: &mut SafetensorsWriter, values: &[f32], dtype: Precision) -> Result<()> {
    match dtype {
        Precision::Fp32 => writer.write_f32(values),
        Precision::Fp16 => {
            let mut half = vec![f16::ZERO; values.len()];
            to_half(values, &mut half);
            writer.write(&half.iter().flat_map(|h| h.to_le_bytes()).collect::<Vec<u8>>())
        }
        Precision::Bf16 => {
            let mut half = vec![bf16::ZERO; values.len()];
            to_half(values, &mut half);
            writer.write(&half.iter().flat_map(|h| h.to_le_bytes()).collect::<Vec<u8>>())
        }
    }
}
