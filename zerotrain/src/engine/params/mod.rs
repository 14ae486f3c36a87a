//! Moving values between a Burn module and flat buffers, one unit at a time: a unit's
//! trainable parameters are the entries of its [`FlatLayout`](zerotrain_zero::FlatLayout)
//! in the [`Sharding`].
//!
//! Which float tensor is which parameter is `index`'s business (its note: identifying
//! parameters).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use zerotrain_precision::{BufMut, BufRef, FlatBuf, Precision, with_elem};
use zerotrain_zero::Sharding;

pub(crate) use self::device::{read_range, write_unit};
use self::index::Walk;
pub(crate) use self::index::{ParamIndex, ParamShapes, for_each_float, is_lazy_enough};
pub(crate) use self::initial::initial_dtype;
use super::flat::Flat;
use super::model::InitialValues;
use super::readout::{as_flat, into_flat, read};
use crate::{Error, Result};

mod device;
mod index;
mod initial;

/// Copies the part of unit `unit`'s parameters that falls in `range` (of the unit's flat
/// buffer) into `dst` (`range.len()` long, any dtype; padding is left as it is), every
/// element of it (an error otherwise: the model is not the one the sharding was made from).
/// A parameter still lazy is read from `lazy`'s values when it has them (and is left
/// uninitialised), else initialised under its own seeded stream ([`Lazy`]).
pub(crate) fn read_params<M: Module>(
    model: &M,
    index: &ParamIndex,
    sharding: &Sharding,
    unit: usize,
    range: std::ops::Range<usize>,
    dst: BufMut<'_>,
    lazy: Option<Lazy<'_>>,
) -> Result<()> {
    struct Reader<'a> {
        walk: Walk<'a>,
        unit: usize,
        range: std::ops::Range<usize>,
        dst: BufMut<'a>,
        lazy: Option<Lazy<'a>>,
        written: usize,
        error: Option<Error>,
    }
    impl ModuleVisitor for Reader<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some((unit, e)) = self.walk.next().filter(|(u, _)| *u == self.unit) else { return };
            let entry = &self.walk.sharding.units()[unit].layout.entries()[e];
            let Some(segment) = entry.segment(self.range.clone()).filter(|_| self.error.is_none()) else { return };
            let at = segment.flat_range.start - self.range.start..segment.flat_range.end - self.range.start;
            self.written += at.len();
            let mut dst = self.dst.reborrow().slice(at);
            let lazy = self.lazy.filter(|_| !param.is_initialized());
            let read = match lazy.and_then(|l| l.values) {
                Some(values) => initial::read(values, &entry.path, segment.param_range, dst),
                None => read(first_value(param, &entry.path, lazy), &format!("parameter `{}`", entry.path)).and_then(
                    |data| {
                        as_flat(&data, &entry.path, entry.num_elems)
                            .map(|values| dst.copy_from(values.slice(segment.param_range), false))
                    },
                ),
            };
            self.error = read.err();
        }
    }
    let real = sharding.units()[unit].layout.num_elems();
    let expected = range.end.min(real).saturating_sub(range.start.min(real));
    let walk = Walk { index, sharding, position: 0 };
    let mut reader = Reader { walk, unit, range, dst, lazy, written: 0, error: None };
    model.visit(&mut reader);
    match reader.error {
        Some(error) => Err(error),
        None if reader.written != expected => Err(Error::Model(format!(
            "unit {unit}: the model's parameters gave {} of the {expected} values asked for; the model is not \
             the one the engine was built for",
            reader.written
        ))),
        None => Ok(()),
    }
}

/// Where parameters still lazy get their first values when the engine first reads them:
/// the model's [`InitialValues`] (a checkpoint's tensors), or else their own initialisers
/// drawing from a stream seeded by `seed` and the parameter's path (the note on
/// initialisation in `random.rs`).
#[derive(Clone, Copy)]
pub(crate) struct Lazy<'a> {
    /// Values read instead of initialising (`UnitModel::initial_values`).
    pub values: Option<&'a dyn InitialValues>,
    /// The run's seed.
    pub seed: u64,
}

/// `param`'s value; a lazy one initialised under its path's stream when `lazy` is given.
fn first_value<const D: usize>(param: &Param<Tensor<D>>, path: &str, lazy: Option<Lazy<'_>>) -> Tensor<D> {
    match lazy {
        Some(lazy) => crate::random::first_value(param, path, lazy.seed),
        None => param.val(),
    }
}

/// Initialises every float tensor of `model` that is still lazy, each under its path's
/// stream of `seed` (`random.rs`' note on initialisation): before a walk that would
/// initialise the rest in its own order (reading buffers goes through `Module::valid`,
/// which gives every parameter its value).
pub(crate) fn initialise_lazy<M: Module>(model: &M, seed: u64) {
    struct Init {
        path: Vec<String>,
        seed: u64,
    }
    impl ModuleVisitor for Init {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if !param.is_initialized() {
                let lazy = Lazy { values: None, seed: self.seed };
                drop(first_value(param, &self.path.join("."), Some(lazy)));
            }
        }
    }
    model.visit(&mut Init { path: Vec::new(), seed });
}

/// `param` holding `tensor`, keeping its id. A lazy parameter not initialised yet is
/// replaced without initialising it, which would read or draw a value only to drop it.
fn replace<const D: usize>(param: Param<Tensor<D>>, tensor: Tensor<D>) -> Param<Tensor<D>> {
    if param.is_initialized() { param.map(|_| tensor) } else { Param::initialized(param.id, tensor) }
}

/// `tensor` as a parameter of `index`: an autodiff leaf where the index's tensors train,
/// untracked where they are frozen (no gradient is computed for it).
fn leaf<const D: usize>(tensor: Tensor<D>, index: &ParamIndex) -> Tensor<D> {
    if index.trains() { tensor.require_grad() } else { tensor }
}

/// One unit's gradients of one backward pass, per entry of the unit, in the dtype Burn
/// produced them in, flat, on the host or left on the device; `None` for a parameter that
/// got no gradient (it counts as zeros).
#[derive(Debug)]
pub(crate) struct UnitGrads {
    pub entries: Vec<Option<Flat>>,
}

impl UnitGrads {
    /// No gradients yet for a unit of `num_entries` parameters.
    pub fn empty(num_entries: usize) -> Self {
        Self { entries: (0..num_entries).map(|_| None).collect() }
    }

    /// Adds `other`'s gradients (of the same unit) to these.
    pub fn add(&mut self, other: UnitGrads) -> Result<()> {
        for (mine, theirs) in self.entries.iter_mut().zip(other.entries) {
            match (mine.as_mut(), theirs) {
                (Some(m), Some(t)) => m.add(t)?,
                (None, Some(t)) => *mine = Some(t),
                (_, None) => {}
            }
        }
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.entries.iter().flatten().map(Flat::bytes).sum()
    }

    /// Bytes held in host memory.
    pub fn host_bytes(&self) -> u64 {
        self.entries.iter().flatten().filter(|f| matches!(f, Flat::Host(_))).map(Flat::bytes).sum()
    }
}

/// Takes the gradients of every unit `wanted` marks out of `grads`, per unit, flat: left
/// on the device with `on_device`, else on the host. A gradient of a parameter in a unit
/// not wanted is an error naming it (a unit used a parameter it does not own; see the note
/// on the root unit in [`super::model`]).
pub(crate) fn take_grads<M: Module>(
    model: &M,
    grads: &mut GradientsParams,
    index: &ParamIndex,
    sharding: &Sharding,
    wanted: &[bool],
    on_device: bool,
) -> Result<Vec<Option<UnitGrads>>> {
    struct Taker<'a> {
        walk: Walk<'a>,
        grads: &'a mut GradientsParams,
        wanted: &'a [bool],
        on_device: bool,
        taken: Vec<Option<UnitGrads>>,
        foreign: Vec<String>,
        error: Option<Error>,
    }
    impl ModuleVisitor for Taker<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some((unit, e)) = self.walk.next() else { return };
            let units = self.walk.sharding.units();
            let entry = &units[unit].layout.entries()[e];
            let Some(grad) = self.grads.remove::<D>(param.id) else { return };
            if !self.wanted[unit] {
                self.foreign.push(format!("`{}` (unit `{}`)", entry.path, units[unit].name));
                return;
            }
            let flat = if self.on_device {
                match grad.shape().num_elements() {
                    n if n == entry.num_elems => Ok(Flat::Device(grad.reshape([n]))),
                    n => Err(Error::Model(format!(
                        "the gradient of `{}` has {n} elements, the layout expects {}",
                        entry.path, entry.num_elems
                    ))),
                }
            } else {
                // Removed from `grads`, the tensor is uniquely owned, so Flex hands its
                // buffer over without a copy.
                read(grad, &format!("the gradient of `{}`", entry.path))
                    .and_then(|data| into_flat(data, &entry.path, entry.num_elems))
                    .map(Flat::Host)
            };
            match flat {
                Ok(values) => {
                    let n = units[unit].layout.entries().len();
                    self.taken[unit].get_or_insert_with(|| UnitGrads::empty(n)).entries[e] = Some(values);
                }
                Err(err) => self.error = Some(err),
            }
        }
    }
    let walk = Walk { index, sharding, position: 0 };
    let taken = wanted.iter().map(|_| None).collect();
    let mut taker = Taker { walk, grads, wanted, on_device, taken, foreign: Vec::new(), error: None };
    model.visit(&mut taker);
    if let Some(error) = taker.error {
        return Err(error);
    }
    if !taker.foreign.is_empty() {
        return Err(Error::Model(format!(
            "a unit's backward pass produced gradients for parameters of other units: {}; a unit may use only its \
             own parameters and the root's (leave a shared parameter to the root)",
            taker.foreign.join(", ")
        )));
    }
    let mut taken = taker.taken;
    for (unit, wanted) in wanted.iter().enumerate() {
        if *wanted && taken[unit].is_none() {
            taken[unit] = Some(UnitGrads::empty(sharding.units()[unit].layout.entries().len()));
        }
    }
    Ok(taken)
}

/// What [`write_params`] puts into each trainable parameter of a unit.
pub(crate) enum Fill<'a> {
    /// The unit's flat buffer, taken apart into the parameters without copying the largest
    /// one ([`FlatBuf::split`]).
    Take(FlatBuf),
    /// Empty tensors (stage 3's released state), except the unit's entries marked `true`,
    /// which keep their current value.
    Release(&'a [bool]),
    /// Stage 3's released state from the start: the entries marked `keep` get their values
    /// from the unit's flat buffer `values` (f32, or `dtype` already), in `dtype`; the
    /// others are empty.
    Resident { values: BufRef<'a>, keep: &'a [bool], dtype: Precision },
}

/// Replaces unit `unit`'s parameters in the module (trainable ones, or the frozen ones of a
/// frozen `index`), keeping their ids.
pub(crate) fn write_params<M: Module>(
    model: M,
    index: &ParamIndex,
    sharding: &Sharding,
    unit: usize,
    fill: Fill<'_>,
    device: &Device,
) -> M {
    /// What each parameter gets.
    enum Source<'a> {
        Owned(Vec<Option<FlatBuf>>),
        Release(&'a [bool]),
        Resident(BufRef<'a>, &'a [bool], Precision),
    }
    struct Writer<'a> {
        walk: Walk<'a>,
        unit: usize,
        source: Source<'a>,
        device: &'a Device,
    }
    impl ModuleMapper for Writer<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some((unit, e)) = self.walk.next().filter(|(u, _)| *u == self.unit) else { return param };
            let entry = &self.walk.sharding.units()[unit].layout.entries()[e];
            let shape: [usize; D] = entry.shape.as_slice().try_into().expect("layout shapes come from this module");
            let data = match &mut self.source {
                Source::Owned(parts) => {
                    let part = parts[e].take().expect("each parameter is visited once");
                    with_elem!(FlatBuf, part, v, _E => TensorData::new(v, shape))
                }
                Source::Resident(values, keep, dtype) if keep[e] => {
                    let part = FlatBuf::from_buf(*dtype, values.slice(entry.flat_range()));
                    with_elem!(FlatBuf, part, v, _E => TensorData::new(v, shape))
                }
                Source::Release(keep) if keep[e] => return param,
                Source::Release(_) | Source::Resident(..) => {
                    return replace(param, leaf(Tensor::<D>::empty([0; D], self.device), self.walk.index));
                }
            };
            let options = (self.device, data.dtype());
            let tensor = Tensor::<D>::from_data(data, options);
            replace(param, leaf(tensor, self.walk.index))
        }
    }
    let source = match fill {
        Fill::Take(flat) => {
            let ranges: Vec<_> = sharding.units()[unit].layout.entries().iter().map(|e| e.flat_range()).collect();
            Source::Owned(flat.split(&ranges).into_iter().map(Some).collect())
        }
        Fill::Release(keep) => Source::Release(keep),
        Fill::Resident { values, keep, dtype } => Source::Resident(values, keep, dtype),
    };
    model.map(&mut Writer { walk: Walk { index, sharding, position: 0 }, unit, source, device })
}

/// Bytes of the trainable parameters the model holds now (released ones are empty).
pub(crate) fn trainable_bytes<M: Module>(model: &M, index: &ParamIndex) -> u64 {
    struct Count<'a> {
        index: &'a ParamIndex,
        position: usize,
        bytes: u64,
    }
    impl ModuleVisitor for Count<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.index.is_trainable(self.position) {
                let tensor = param.val();
                self.bytes += (tensor.shape().num_elements() * tensor.dtype().size()) as u64;
            }
            self.position += 1;
        }
    }
    let mut count = Count { index, position: 0, bytes: 0 };
    model.visit(&mut count);
    count.bytes
}

/// Replaces every trainable parameter that no unit of `sharding` holds with an empty
/// tensor (a pipeline stage's other stages' parameters).
pub(crate) fn release_unheld<M: Module>(model: M, index: &ParamIndex, sharding: &Sharding, device: &Device) -> M {
    struct Releaser<'a> {
        walk: Walk<'a>,
        device: &'a Device,
    }
    impl ModuleMapper for Releaser<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match self.walk.next_global() {
                Some(g) if self.walk.sharding.location(g).is_none() => {
                    replace(param, Tensor::<D>::empty([0; D], self.device).require_grad())
                }
                _ => param,
            }
        }
    }
    model.map(&mut Releaser { walk: Walk { index, sharding, position: 0 }, device })
}

/// Writes every trainable parameter from `values` (fp32, the global order of `sharding`),
/// cast to `dtype`: a full model, whatever the engine holds.
pub(crate) fn write_global<M: Module>(
    model: M,
    index: &ParamIndex,
    sharding: &Sharding,
    values: &[f32],
    dtype: zerotrain_precision::Precision,
    device: &Device,
) -> M {
    struct Writer<'a> {
        walk: Walk<'a>,
        values: &'a [f32],
        dtype: zerotrain_precision::Precision,
        device: &'a Device,
    }
    impl ModuleMapper for Writer<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(g) = self.walk.next_global() else { return param };
            let entry = &self.walk.sharding.global().entries()[g];
            let shape: [usize; D] = entry.shape.as_slice().try_into().expect("layout shapes come from this module");
            let flat = FlatBuf::from_f32(self.dtype, &self.values[entry.flat_range()]);
            let data = with_elem!(FlatBuf, flat, v, _E => TensorData::new(v, shape));
            let dtype = data.dtype();
            let tensor = Tensor::<D>::from_data(data, (self.device, dtype));
            replace(param, tensor.require_grad())
        }
    }
    model.map(&mut Writer { walk: Walk { index, sharding, position: 0 }, values, dtype, device })
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};

    use super::*;

    /// Reading a unit covers every element asked for, or says which model is wrong: a model
    /// that lacks a parameter the sharding was made with leaves part of the buffer unread,
    /// which is an error, not stale values.
    #[test]
    fn a_unit_read_from_another_model_is_an_error() {
        let device = Device::flex().autodiff();
        let linear: Linear = LinearConfig::new(3, 2).init(&device);
        let (params, index) = ParamIndex::scan(&linear);
        assert_eq!(params.iter().map(|(_, shape)| shape.iter().product::<usize>()).sum::<usize>(), 8);
        let unit_of = vec![Some(0); params.len()];
        let sharding = Sharding::new(params, &unit_of, vec!["all".into()], 1, 1).unwrap();
        let mut out = vec![f32::NAN; 8];
        read_params(&linear, &index, &sharding, 0, 0..8, BufMut::F32(&mut out), None).unwrap();
        assert!(out.iter().all(|v| v.is_finite()), "every element read: {out:?}");
        let unbiased: Linear = LinearConfig::new(3, 2).with_bias(false).init(&device);
        let error = read_params(&unbiased, &index, &sharding, 0, 0..8, BufMut::F32(&mut out), None).unwrap_err();
        assert!(error.to_string().contains("gave 6 of the 8 values"), "{error}");
    }
}
