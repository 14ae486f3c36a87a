//! The first values of parameters still lazy, from the model's [`InitialValues`]: in f32,
//! or in the dtype the source holds a whole unit in ([`initial_dtype`]).

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use zerotrain_precision::{BufMut, BufRef, Precision};
use zerotrain_zero::Sharding;

use super::ParamIndex;
use super::index::Walk;
use crate::engine::model::InitialValues;
use crate::{Error, Result};

/// Elements `elems` of parameter `path` from `values` into `dst`: straight when `dst` is f32
/// or the dtype `values` holds the parameter in, else through f32.
pub(super) fn read(values: &dyn InitialValues, path: &str, elems: Range<usize>, mut dst: BufMut<'_>) -> Result<()> {
    let fail = |why: String| Error::Model(format!("the initial values of parameter `{path}`: {why}"));
    if dst.dtype() == Precision::Fp32 || values.dtype(path) == Some(dst.dtype()) {
        return values.read(path, elems, dst).map_err(fail);
    }
    let mut f32s = vec![0.0; elems.len()];
    values.read(path, elems, BufMut::F32(&mut f32s)).map_err(fail)?;
    dst.copy_from(BufRef::F32(&f32s), false);
    Ok(())
}

/// The dtype unit `unit`'s first values can be read in without loss: `values`' dtype for
/// them when every parameter of the unit is still lazy and `values` holds all of them in
/// one dtype; `None` otherwise (read them in f32).
pub(crate) fn initial_dtype<M: Module>(
    model: &M,
    index: &ParamIndex,
    sharding: &Sharding,
    unit: usize,
    values: &dyn InitialValues,
) -> Option<Precision> {
    struct Ask<'a> {
        walk: Walk<'a>,
        unit: usize,
        values: &'a dyn InitialValues,
        /// `None` before the first parameter; then the dtype so far, `None` once mixed.
        dtype: Option<Option<Precision>>,
    }
    impl ModuleVisitor for Ask<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some((unit, e)) = self.walk.next().filter(|(u, _)| *u == self.unit) else { return };
            let path = &self.walk.sharding.units()[unit].layout.entries()[e].path;
            let this = (!param.is_initialized()).then(|| self.values.dtype(path)).flatten();
            self.dtype = Some(match self.dtype {
                None => this,
                Some(so_far) => so_far.filter(|_| so_far == this),
            });
        }
    }
    let mut ask = Ask { walk: Walk { index, sharding, position: 0 }, unit, values, dtype: None };
    model.visit(&mut ask);
    ask.dtype.flatten()
}
