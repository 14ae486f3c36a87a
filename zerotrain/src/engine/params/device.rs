//! A unit's flat range as one 1-D tensor on the rank's device, read out of the model and
//! written back without leaving the device: fp32 training on a GPU, where the parameters
//! are their own master weights, steps them there instead of copying them to the host and
//! back around the optimizer.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Device, Tensor};
use zerotrain_zero::Sharding;

use super::index::{ParamIndex, Walk};

/// The part of unit `unit`'s parameters that falls in `range` of its flat buffer, as one
/// f32 tensor on `device` (the rank's device without autodiff); the range's padding, past
/// the last parameter, reads as zeros.
pub(crate) fn read_range<M: Module>(
    model: &M,
    index: &ParamIndex,
    sharding: &Sharding,
    unit: usize,
    range: std::ops::Range<usize>,
    device: &Device,
) -> Tensor<1> {
    struct Reader<'a> {
        walk: Walk<'a>,
        unit: usize,
        range: std::ops::Range<usize>,
        /// Each piece at its offset in the range.
        pieces: Vec<(usize, Tensor<1>)>,
    }
    impl ModuleVisitor for Reader<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some((unit, e)) = self.walk.next().filter(|(u, _)| *u == self.unit) else { return };
            let entry = &self.walk.sharding.units()[unit].layout.entries()[e];
            let Some(segment) = entry.segment(self.range.clone()) else { return };
            let flat = param.val().inner().reshape([entry.num_elems]).cast(DType::F32);
            self.pieces.push((segment.flat_range.start - self.range.start, flat.slice(segment.param_range)));
        }
    }
    let len = range.len();
    let mut reader = Reader { walk: Walk { index, sharding, position: 0 }, unit, range, pieces: Vec::new() };
    model.visit(&mut reader);
    crate::engine::flat::lay_out(len, DType::F32, device, reader.pieces)
}

/// Replaces unit `unit`'s trainable parameters with the matching pieces of `values`, a
/// 1-D tensor on the rank's device holding the unit's whole flat buffer (stage 0's range),
/// keeping their ids and making them trainable leaves again (untracked tensors, for a
/// frozen `index`).
pub(crate) fn write_unit<M: Module>(
    model: M,
    index: &ParamIndex,
    sharding: &Sharding,
    unit: usize,
    values: Tensor<1>,
) -> M {
    struct Writer<'a> {
        walk: Walk<'a>,
        unit: usize,
        values: Tensor<1>,
    }
    impl ModuleMapper for Writer<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((unit, e)) = self.walk.next().filter(|(u, _)| *u == self.unit) else { return param };
            let entry = &self.walk.sharding.units()[unit].layout.entries()[e];
            let shape: [usize; D] = entry.shape.as_slice().try_into().expect("layout shapes come from this module");
            let piece = self.values.clone().slice(entry.flat_range()).reshape(shape);
            super::replace(param, super::leaf(Tensor::from_inner(piece), self.walk.index))
        }
    }
    model.map(&mut Writer { walk: Walk { index, sharding, position: 0 }, unit, values })
}
