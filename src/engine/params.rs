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
use burn::tensor::{Device, Tensor, TensorData};
use zerotrain_zero::FlatLayout;

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

/// Copies the flat range `range` of the module's parameters into `dst` (padding stays as
/// it is in `dst`). Only parameters that overlap the range are read.
pub(crate) fn read_params<M: Module>(
    model: &M,
    index: &ParamIndex,
    layout: &FlatLayout,
    range: std::ops::Range<usize>,
    dst: &mut [f32],
) -> Result<()> {
    let mut reader = FlatReader { index, layout, range, dst, position: 0, error: None, source: Source::Params };
    model.visit(&mut reader);
    reader.error.map_or(Ok(()), Err)
}

/// Copies (or with `add`, adds) the gradients of the module's trainable parameters into the
/// full flat buffer `dst` (at least `layout.num_elems()` long). A parameter without a
/// gradient (unused in the forward pass) contributes zeros.
/// The gradients are removed from `grads` as they are read, so that each tensor is uniquely
/// owned and Flex hands its buffer over without a copy.
pub(crate) fn read_grads<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    index: &ParamIndex,
    layout: &FlatLayout,
    dst: &mut [f32],
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
    dst: &'a mut [f32],
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
        let start = entry.offset.max(self.range.start);
        let end = (entry.offset + entry.num_elems).min(self.range.end);
        if start >= end || self.error.is_some() {
            return;
        }
        let out = &mut self.dst[start - self.range.start..end - self.range.start];
        let (tensor, add) = match &mut self.source {
            Source::Params => (Some(param.val()), false),
            Source::Grads { grads, add } => (grads.remove::<D>(param.id), *add),
        };
        let Some(tensor) = tensor else {
            if !add {
                out.fill(0.0);
            }
            return;
        };
        let data = tensor.into_data();
        match data.as_slice::<f32>() {
            Ok(values) if values.len() == entry.num_elems => {
                let values = &values[start - entry.offset..end - entry.offset];
                if add {
                    out.iter_mut().zip(values).for_each(|(o, v)| *o += v);
                } else {
                    out.copy_from_slice(values);
                }
            }
            Ok(values) => {
                self.error = Some(Error::Model(format!(
                    "parameter `{}` has {} elements, the layout expects {}; was the model changed after Engine::new?",
                    entry.path,
                    values.len(),
                    entry.num_elems
                )))
            }
            Err(_) => {
                self.error = Some(Error::Model(format!(
                    "parameter `{}` is {:?}; fp32 training needs f32 parameters",
                    entry.path,
                    data.dtype()
                )))
            }
        }
    }
}

/// What [`write_params`] puts into each trainable parameter.
pub(crate) enum Fill<'a> {
    /// Values from the full flat buffer (at least `layout.num_elems()` long).
    From(&'a [f32]),
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
                    let values = flat[entry.flat_range()].to_vec();
                    let shape: [usize; D] =
                        entry.shape.as_slice().try_into().expect("layout shapes come from this module");
                    Tensor::<D>::from_data(TensorData::new(values, shape), self.device)
                }
                Fill::Release(keep) if keep[entry_index] => return param,
                Fill::Release(_) => Tensor::<D>::empty([0; D], self.device),
            };
            param.map(|_| tensor.require_grad())
        }
    }
    model.map(&mut Writer { index, layout, fill, device, position: 0 })
}
