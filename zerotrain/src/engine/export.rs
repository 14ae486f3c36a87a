//! Getting the model out: the fp32 master weights ([`Engine::master_params`]), the whole
//! model on one rank ([`Engine::gather_model`]), one safetensors file keyed by module path
//! ([`Engine::save_model`]), and the same from a checkpoint ([`consolidate`]).

use std::path::Path;

use burn::module::Module;
use zerotrain_checkpoint::{SafetensorsWriter, TensorSpec};
use zerotrain_precision::{FlatBuf, Precision};

use super::Engine;
use super::params::{Fill, for_each_float, read_params, write_params};
use crate::{Error, Result};

impl<M: Module> Engine<M> {
    /// The fp32 master weights of every trainable parameter in the global order
    /// (`sharding().global()` says where each parameter is). In fp32 training these are
    /// the parameters themselves. On a pipeline stage every stage contributes its units, so
    /// every rank gets the whole model's. Every rank must call it.
    pub fn master_params(&self) -> Result<Vec<f32>> {
        self.whole()?;
        let sharding = &self.shared.sharding;
        let mut out = vec![0.0f32; sharding.global().num_elems()];
        let skip_root = self.root_counted_elsewhere();
        for (id, unit) in self.units.iter().enumerate() {
            if skip_root == Some(id) {
                continue; // the first stage reports the root
            }
            let layout = self.shared.layout(id);
            let values = unit.values(&self.model, &self.shared)?;
            let full = if self.shared.plan.zero.stage.shards_optimizer_states() {
                let mut full = vec![0.0; layout.padded_elems()];
                self.shared.comm.all_gather((&values).into(), (&mut full).into())?;
                full
            } else {
                values
            };
            for (unit_range, global) in sharding.global_segments(id, 0..layout.num_elems()) {
                out[global].copy_from_slice(&full[unit_range]);
            }
        }
        // Each element comes from exactly one stage.
        self.span.sum_over_stages((&mut out).into())?;
        Ok(out)
    }

    /// The model with every parameter present and current (in the compute dtype) and its
    /// buffers averaged, on rank `root` only (`None` elsewhere). At stage 3 the units are
    /// gathered one at a time: no other rank holds more than one unit beyond its shards.
    /// Every rank must call it. A tensor-parallel rank's model is its part of the whole
    /// (gathered over its data-parallel group, `root` a rank of that group).
    pub fn gather_model(&mut self, root: usize) -> Result<Option<M>> {
        self.off_the_clock(|engine| engine.gather_on(root))
    }

    fn gather_on(&mut self, root: usize) -> Result<Option<M>> {
        self.agree(self.whole(), "checking its states")?;
        self.sync_buffers()?;
        let mine = self.shared.comm.rank() == root;
        if !self.shared.plan.zero.stage.shards_parameters() {
            return Ok(mine.then(|| self.model.clone()));
        }
        let mut out = mine.then(|| self.model.clone());
        for id in 0..self.units.len() {
            let was_released = !self.units[id].is_gathered();
            self.gather(id)?;
            if let Some(model) = out.take() {
                let n = self.shared.layout(id).num_elems();
                let mut values = FlatBuf::zeros(self.shared.dtype(), n);
                let (index, sharding) = (&self.shared.index, &self.shared.sharding);
                read_params(&self.model, index, sharding, id, 0..n, values.as_mut(), None)?;
                let model = write_params(model, index, sharding, id, Fill::Take(values), &self.shared.device);
                out = Some(self.units[id].copy_frozen(&self.model, model, &self.shared)?);
            }
            if was_released {
                self.release(id);
            }
        }
        Ok(out)
    }

    /// Writes the whole model (parameters and buffers, by module path, in `dtype`) to one
    /// safetensors file at `path`, from world rank 0, through `<path>.partial` and a rename.
    /// Burn loads it with `SafetensorsStore`, Python with `safetensors`. Every rank must
    /// call it; it returns once the file is complete. A tensor-parallel engine refuses it
    /// (its model is a part): its checkpoints hold the whole model.
    pub fn save_model(&mut self, path: impl AsRef<Path>, dtype: Precision) -> Result<()> {
        if self.shared.tensor.is_some() {
            return Err(Error::Usage(
                "save_model of a tensor-parallel engine would write one rank's part of the model: save a checkpoint \
                 (it holds the whole model) and write the model from it with `zerotrain consolidate`"
                    .into(),
            ));
        }
        let model = self.gather_model(0)?;
        let written = match model {
            Some(model) => write_safetensors(&model, path.as_ref(), dtype),
            None => Ok(()),
        };
        self.agree(written, "writing the model")
    }
}

/// Writes every float tensor of `model` (trainable or not) to `path` in `dtype`.
pub(super) fn write_safetensors<M: Module>(model: &M, path: &Path, dtype: Precision) -> Result<()> {
    let (mut tensors, mut error) = (Vec::new(), None);
    for_each_float(model, |float| {
        match super::readout::f32s(float.flat(), &format!("`{}` for the export", float.path)) {
            Ok(values) => tensors.push((float.path.to_string(), float.shape.to_vec(), values)),
            Err(e @ Error::Device { .. }) => {
                error.get_or_insert(e);
            }
            _ => {
                let path = float.path;
                error.get_or_insert(Error::Model(format!("`{path}` cannot be read as f32 for the export")));
            }
        }
    });
    if let Some(error) = error {
        return Err(error);
    }
    let st = match dtype {
        Precision::Fp32 => safetensors::Dtype::F32,
        Precision::Fp16 => safetensors::Dtype::F16,
        Precision::Bf16 => safetensors::Dtype::BF16,
    };
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(name, shape, _)| TensorSpec { name: name.clone(), dtype: st, shape: shape.clone() })
        .collect();
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    let written = (|| {
        let mut writer = SafetensorsWriter::create(&partial, &specs, &[("format", "pt".to_string())])?;
        for (_, _, values) in &tensors {
            let bytes: Vec<u8> = match FlatBuf::from_f32(dtype, values) {
                FlatBuf::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                FlatBuf::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                FlatBuf::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            writer.write(&bytes)?;
        }
        writer.finish().map(|_| ())
    })()
    .map_err(Error::from);
    let renamed = written
        .and_then(|()| std::fs::rename(&partial, path).map_err(|cause| Error::Io { path: path.to_path_buf(), cause }));
    if renamed.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    renamed
}

/// Writes the checkpoint `<dir>/<tag>` (or `latest`'s) as one safetensors file of every
/// parameter and buffer, keyed by module path, in `dtype`, streaming it (memory stays about
/// one chunk whatever the model's size). Returns the bytes written. The library's form of
/// `zerotrain consolidate`.
pub fn consolidate(dir: &Path, tag: Option<&str>, out: &Path, dtype: Precision) -> Result<u64> {
    let ckpt = zerotrain_checkpoint::Checkpoint::open(dir, tag)?;
    Ok(zerotrain_checkpoint::consolidate(&ckpt, out, dtype)?)
}
