//! Moving values between a Burn module and flat buffers: the module's trainable parameters
//! in visit order are the [`FlatLayout`]'s entries.
//!
//! # Note: identifying parameters
//! `ParamId`s are random per process, so parameters are keyed by module path and found by
//! their position among the module's float parameters in visit order (Burn's `visit` and
//! `map` walk fields in declaration order). [`ParamIndex`] records, once, which of those
//! positions are trainable and which layout entry each one is; later walks use it instead of
//! asking the tensors again (a released stage-3 parameter is an empty tensor).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorData};
use zerotrain_precision::half::{bf16, f16};
use zerotrain_precision::{BufMut, BufRef, FlatBuf, Precision, with_elem};
use zerotrain_zero::{Collective, FlatLayout};

use crate::{Error, Result};

/// Which float parameters (by visit position) are trainable, and their layout entry.
#[derive(Debug, Clone)]
pub(crate) struct ParamIndex {
    entry_of: Vec<Option<usize>>,
}

impl ParamIndex {
    /// Whether the float parameter at visit `position` is trainable.
    pub fn is_trainable(&self, position: usize) -> bool {
        self.entry_of.get(position).copied().flatten().is_some()
    }

    /// Scans `model`, returning the (path, shape) of each trainable parameter in order.
    pub fn scan<M: Module>(model: &M) -> (Vec<(String, Vec<usize>)>, Self) {
        struct Scan {
            path: Vec<String>,
            params: Vec<(String, Vec<usize>)>,
            entry_of: Vec<Option<usize>>,
        }
        impl ModuleVisitor for Scan {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let trainable = param.val().is_require_grad();
                self.entry_of.push(trainable.then_some(self.params.len()));
                if trainable {
                    self.params.push((self.path.join("."), param.val().dims().to_vec()));
                }
            }
        }
        let mut scan = Scan { path: Vec::new(), params: Vec::new(), entry_of: Vec::new() };
        model.visit(&mut scan);
        (scan.params, Self { entry_of: scan.entry_of })
    }
}

/// Copies the flat range `range` of the module's parameters into `dst` (any dtype; padding
/// stays as it is in `dst`). Only parameters that overlap the range are read.
pub(crate) fn read_params<M: Module>(
    model: &M,
    index: &ParamIndex,
    layout: &FlatLayout,
    range: std::ops::Range<usize>,
    dst: BufMut<'_>,
) -> Result<()> {
    let mut reader = FlatReader { index, layout, range, dst, position: 0, error: None, source: Source::Params };
    model.visit(&mut reader);
    reader.error.map_or(Ok(()), Err)
}

/// Copies (or with `add`, adds) the gradients of the module's trainable parameters into the
/// full flat buffer `dst` (at least `layout.num_elems()` long, any dtype: values convert
/// through f32). A parameter without a gradient (unused in the forward pass) contributes
/// zeros. The gradients are removed from `grads` as they are read, so that each tensor is
/// uniquely owned and Flex hands its buffer over without a copy.
pub(crate) fn read_grads<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    index: &ParamIndex,
    layout: &FlatLayout,
    dst: BufMut<'_>,
    add: bool,
) -> Result<()> {
    let range = 0..layout.num_elems();
    let mut reader =
        FlatReader { index, layout, range, dst, position: 0, error: None, source: Source::Grads { grads, add } };
    model.visit(&mut reader);
    reader.error.map_or(Ok(()), Err)
}

enum Source<'a> {
    Params,
    Grads { grads: &'a mut GradientsParams, add: bool },
}

struct FlatReader<'a> {
    index: &'a ParamIndex,
    layout: &'a FlatLayout,
    range: std::ops::Range<usize>,
    dst: BufMut<'a>,
    position: usize,
    error: Option<Error>,
    source: Source<'a>,
}

impl ModuleVisitor for FlatReader<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let position = self.position;
        self.position += 1;
        let Some(entry_index) = self.index.entry_of.get(position).copied().flatten() else { return };
        let entry = &self.layout.entries()[entry_index];
        let Some(segment) = entry.segment(self.range.clone()).filter(|_| self.error.is_none()) else { return };
        let flat = segment.flat_range;
        let mut out = self.dst.reborrow().slice(flat.start - self.range.start..flat.end - self.range.start);
        let (tensor, add) = match &mut self.source {
            Source::Params => (Some(param.val()), false),
            Source::Grads { grads, add } => (grads.remove::<D>(param.id), *add),
        };
        let Some(tensor) = tensor else {
            if !add {
                out.fill_zeros();
            }
            return;
        };
        let data = tensor.into_data();
        let values = match data_as_buf(&data) {
            Some(values) if values.len() == entry.num_elems => values,
            Some(values) => {
                let message = format!(
                    "parameter `{}` has {} elements, the layout expects {}; was the model changed after Engine::new?",
                    entry.path,
                    values.len(),
                    entry.num_elems
                );
                self.error = Some(Error::Model(message));
                return;
            }
            None => {
                let message =
                    format!("parameter `{}` is {:?}; zerotrain trains f32, f16 and bf16", entry.path, data.dtype());
                self.error = Some(Error::Model(message));
                return;
            }
        };
        out.copy_from(values.slice(segment.param_range), add);
    }
}

/// The tensor data as a flat buffer, if its dtype is one zerotrain handles.
fn data_as_buf(data: &TensorData) -> Option<BufRef<'_>> {
    match data.dtype() {
        DType::F32 => data.as_slice::<f32>().ok().map(BufRef::F32),
        DType::F16 => data.as_slice::<f16>().ok().map(BufRef::F16),
        DType::BF16 => data.as_slice::<bf16>().ok().map(BufRef::Bf16),
        _ => None,
    }
}

/// Burn's dtype for a flat-buffer dtype.
pub(crate) fn burn_dtype(precision: Precision) -> DType {
    match precision {
        Precision::Fp32 => DType::F32,
        Precision::Fp16 => DType::F16,
        Precision::Bf16 => DType::BF16,
    }
}

/// What [`write_params`] puts into each trainable parameter.
pub(crate) enum Fill<'a> {
    /// Values from the full flat buffer (at least `layout.num_elems()` long), in its dtype.
    From(BufRef<'a>),
    /// Empty tensors (stage 3's released state), except the entries marked `true` in
    /// the slice, which keep their current value.
    Release(&'a [bool]),
}

/// Replaces the module's trainable parameters, keeping their ids.
pub(crate) fn write_params<M: Module>(
    model: M,
    index: &ParamIndex,
    layout: &FlatLayout,
    fill: Fill<'_>,
    device: &Device,
) -> M {
    struct Writer<'a> {
        index: &'a ParamIndex,
        layout: &'a FlatLayout,
        fill: Fill<'a>,
        device: &'a Device,
        position: usize,
    }
    impl ModuleMapper for Writer<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let position = self.position;
            self.position += 1;
            let Some(entry_index) = self.index.entry_of.get(position).copied().flatten() else { return param };
            let entry = &self.layout.entries()[entry_index];
            let tensor = match self.fill {
                Fill::From(flat) => {
                    let shape: [usize; D] =
                        entry.shape.as_slice().try_into().expect("layout shapes come from this module");
                    let options = (self.device, burn_dtype(flat.dtype()));
                    let values = flat.slice(entry.flat_range());
                    let data = with_elem!(BufRef, values, v, _E => TensorData::new(v.to_vec(), shape));
                    Tensor::<D>::from_data(data, options)
                }
                Fill::Release(keep) if keep[entry_index] => return param,
                Fill::Release(_) => Tensor::<D>::empty([0; D], self.device),
            };
            param.map(|_| tensor.require_grad())
        }
    }
    model.map(&mut Writer { index, layout, fill, device, position: 0 })
}

/// `values` in `dtype`: `None` when that is f32 (use `values` as they are), else a converted
/// copy. Callers borrow it with `converted.as_ref().map_or(BufRef::F32(values), FlatBuf::as_ref)`.
pub(crate) fn convert(values: &[f32], dtype: Precision) -> Option<FlatBuf> {
    (dtype != Precision::Fp32).then(|| FlatBuf::from_f32(dtype, values))
}

/// All-gathers every rank's fp32 `shard` (its [`FlatLayout::shard_range`]) in the compute
/// dtype `dtype` and writes the full parameters into the model. Every rank must call it.
/// Returns the model and the transient bytes used (the gathered buffer and the converted
/// shard).
pub(crate) fn gather_params<M: Module>(
    model: M,
    index: &ParamIndex,
    layout: &FlatLayout,
    comm: &dyn Collective,
    shard: &[f32],
    (device, dtype): (&Device, Precision),
) -> Result<(M, u64)> {
    let converted = convert(shard, dtype);
    let local = converted.as_ref().map_or(BufRef::F32(shard), FlatBuf::as_ref);
    let mut full = FlatBuf::zeros(dtype, layout.padded_elems());
    comm.all_gather(local, full.as_mut())?;
    let bytes = full.bytes() + converted.as_ref().map_or(0, FlatBuf::bytes);
    Ok((write_params(model, index, layout, Fill::From(full.as_ref()), device), bytes))
}
