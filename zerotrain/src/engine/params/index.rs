//! Identifying a model's parameters: [`ParamIndex`], and [`for_each_float`], the one walk
//! over a model's float tensors with their module paths.
//!
//! # Note: identifying parameters
//! `ParamId`s are random per process, so parameters are keyed by module path and found by
//! their position among the module's float parameters in visit order (Burn's `visit` and
//! `map` walk fields in declaration order). [`ParamIndex`] records, once, which of those
//! positions are trainable and which global entry each one is; the [`Sharding`] says which
//! unit that entry belongs to. Later walks use the index instead of asking the tensors
//! again (a released stage-3 parameter is an empty tensor).

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use zerotrain_zero::Sharding;

/// The (module path, shape) of each trainable parameter, in the model's order.
pub(crate) type ParamShapes = Vec<(String, Vec<usize>)>;

/// Which float parameters (by visit position) are trainable, and their global entry. An
/// index of frozen parameters ([`frozen`](Self::frozen)) lists those instead, and the
/// walks that write through it leave what they write untracked by autodiff.
#[derive(Debug, Clone)]
pub(crate) struct ParamIndex {
    entry_of: Vec<Option<usize>>,
    /// Whether the indexed tensors train (they are written as autodiff leaves).
    trains: bool,
}

impl ParamIndex {
    /// Whether the float parameter at visit `position` is one this index lists (trainable,
    /// for the model's own index).
    pub fn is_trainable(&self, position: usize) -> bool {
        self.entry(position).is_some()
    }

    /// Whether the tensors listed train: written back, they require gradients.
    pub fn trains(&self) -> bool {
        self.trains
    }

    /// The index of the frozen tensors at visit `positions` (ascending) among a model's
    /// `floats` float tensors, numbered in that order: what a [`Sharding`] of frozen
    /// parameters is walked with.
    pub fn frozen(floats: usize, positions: impl IntoIterator<Item = usize>) -> Self {
        let mut entry_of = vec![None; floats];
        for (entry, position) in positions.into_iter().enumerate() {
            entry_of[position] = Some(entry);
        }
        Self { entry_of, trains: false }
    }

    /// The model's float tensors (trainable or not) the index was made over.
    pub fn floats(&self) -> usize {
        self.entry_of.len()
    }

    fn entry(&self, position: usize) -> Option<usize> {
        self.entry_of.get(position).copied().flatten()
    }

    /// Scans `model`, returning the (path, shape) of each trainable parameter in order.
    pub fn scan<M: Module>(model: &M) -> (ParamShapes, Self) {
        let (mut params, mut entry_of) = (Vec::new(), Vec::new());
        for_each_float(model, |float| {
            entry_of.push(float.trainable.then_some(params.len()));
            if float.trainable {
                params.push((float.path.to_string(), float.shape.to_vec()));
            }
        });
        (params, Self { entry_of, trains: true })
    }
}

/// One float tensor of a model, as [`for_each_float`] meets it.
pub(crate) struct FloatTensor<'a> {
    /// Its module path.
    pub path: &'a str,
    /// Whether it trains (a parameter) or not (a buffer).
    pub trainable: bool,
    pub shape: &'a [usize],
    flat: &'a dyn Fn() -> Tensor<1>,
}

impl FloatTensor<'_> {
    /// Its values as a 1-D tensor.
    pub fn flat(&self) -> Tensor<1> {
        (self.flat)()
    }
}

/// Calls `f` with every float tensor of `model`, in visit order (the order every walk of
/// this module assumes).
pub(crate) fn for_each_float<M: Module>(model: &M, f: impl FnMut(FloatTensor<'_>)) {
    struct Floats<F> {
        path: Vec<String>,
        f: F,
    }
    impl<F: FnMut(FloatTensor<'_>)> ModuleVisitor for Floats<F> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let path = self.path.join(".");
            let shape: Vec<usize> = param.lazy_shape().iter().copied().collect();
            let n = shape.iter().product::<usize>();
            let flat = || param.val().reshape([n]);
            let trainable = lazy_is_require_grad(param);
            (self.f)(FloatTensor { path: &path, trainable, shape: &shape, flat: &flat });
        }
    }
    model.visit(&mut Floats { path: Vec::new(), f });
}

/// Whether `param` trains, without initialising it if it is still lazy (Burn initialises a
/// module's parameters on first use, so a model built and handed over untouched holds no
/// values yet). Burn answers this only inside its loading path: `transform_for_load` gives
/// a loaded parameter the gradient setting the lazy one would have, so it is asked to load
/// an empty tensor into a clone. Reading every value here instead would materialise the
/// whole model at once before the engine shards it unit by unit.
fn lazy_is_require_grad<const D: usize>(param: &Param<Tensor<D>>) -> bool {
    if param.is_initialized() {
        return param.val().is_require_grad();
    }
    let empty = Tensor::<D>::empty([0; D], &param.lazy_device());
    param.clone().transform_for_load(empty, param.id).val().is_require_grad()
}

/// Whether the engine may take `model` as it is and give its tensors their values one unit
/// at a time: some float tensor has no value yet (a lazy parameter), and every one that has
/// is a parameter that trains (a LoRA run's fresh adapters beside a base still in its
/// files). The engine writes every trained parameter from the values it broadcasts, so an
/// initialised one the caller's clones share is only read; a tensor with a value that does
/// not train may be a running state those clones share and update, which must be copied
/// first (`build.rs`'s `prepare`).
pub(crate) fn is_lazy_enough<M: Module>(model: &M) -> bool {
    struct Lazy {
        lazy: bool,
        untracked: bool,
    }
    impl ModuleVisitor for Lazy {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            match param.is_initialized() {
                true => self.untracked |= !param.val().is_require_grad(),
                false => self.lazy = true,
            }
        }
    }
    let mut lazy = Lazy { lazy: false, untracked: false };
    model.visit(&mut lazy);
    lazy.lazy && !lazy.untracked
}

/// Whether no float tensor of `model` has a value yet (every one is a lazy parameter).
#[cfg(test)]
pub(crate) fn is_all_lazy<M: Module>(model: &M) -> bool {
    struct Lazy(bool);
    impl ModuleVisitor for Lazy {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 &= !param.is_initialized();
        }
    }
    let mut lazy = Lazy(true);
    model.visit(&mut lazy);
    lazy.0
}

/// Where a walk over the model is: the index, the sharding and the visit position.
pub(super) struct Walk<'a> {
    pub index: &'a ParamIndex,
    pub sharding: &'a Sharding,
    pub position: usize,
}

impl Walk<'_> {
    /// The next float parameter's global entry, if trainable.
    pub fn next_global(&mut self) -> Option<usize> {
        let position = self.position;
        self.position += 1;
        self.index.entry(position)
    }

    /// The next float parameter's (unit, entry within the unit), if trainable and held.
    pub fn next(&mut self) -> Option<(usize, usize)> {
        self.next_global().and_then(|g| self.sharding.location(g))
    }
}

#[cfg(test)]
mod tests {
    use burn::module::ParamId;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::Device;

    use super::*;

    /// A lazy parameter is walked (path, shape, whether it trains) without being given a
    /// value, frozen or not; an initialised one reports its own tracking.
    #[test]
    fn lazy_parameters_are_walked_without_initialising_them() {
        let device = Device::flex().autodiff();
        let mut linear: Linear = LinearConfig::new(3, 2).init(&device);
        let shape = burn::tensor::Shape::new([2]);
        let frozen =
            Param::uninitialized(ParamId::new(), |d, _| Tensor::<1>::zeros([2], d), device.clone(), false, shape);
        linear.bias = Some(frozen);
        let mut seen = Vec::new();
        for_each_float(&linear, |f| seen.push((f.path.to_string(), f.shape.to_vec(), f.trainable)));
        assert_eq!(seen, [("weight".to_string(), vec![3, 2], true), ("bias".to_string(), vec![2], false)]);
        assert!(is_all_lazy(&linear), "walking initialised nothing");
        drop(linear.weight.val());
        assert!(!is_all_lazy(&linear));
        let mut trainable = Vec::new();
        for_each_float(&linear, |f| trainable.push(f.trainable));
        assert_eq!(trainable, [true, false]);
    }

    /// A model is taken as it is while a tensor is still lazy and every tensor with a value
    /// trains (fresh adapters on a base in its files); a value that does not train (a
    /// running state, an eager frozen tensor) or no lazy tensor at all sends it through
    /// the copy that gives every tensor its value.
    #[test]
    fn a_lazy_base_with_initialised_trained_tensors_stays_lazy() {
        let device = Device::flex().autodiff();
        let lazy_bias = || {
            let shape = burn::tensor::Shape::new([2]);
            Param::uninitialized(ParamId::new(), |d, _| Tensor::<1>::zeros([2], d), device.clone(), false, shape)
        };
        let mut linear: Linear = LinearConfig::new(3, 2).init(&device);
        linear.bias = Some(lazy_bias());
        assert!(is_lazy_enough(&linear), "all lazy");
        drop(linear.weight.val());
        assert!(is_lazy_enough(&linear), "a trained weight with a value beside a lazy bias");
        assert!(linear.bias.as_ref().is_some_and(|b| !b.is_initialized()), "asking initialised nothing");
        let frozen = Param::from_tensor(Tensor::<1>::zeros([2], &device)).set_require_grad(false);
        linear.bias = Some(frozen);
        assert!(!is_lazy_enough(&linear), "nothing lazy");
        let mut other: Linear = LinearConfig::new(3, 2).init(&device);
        other.weight = Param::from_tensor(Tensor::<2>::zeros([3, 2], &device)).set_require_grad(false);
        assert!(!is_lazy_enough(&other), "a value that does not train beside a lazy bias");
    }
}
