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

/// Which float parameters (by visit position) are trainable, and their global entry.
#[derive(Debug, Clone)]
pub(crate) struct ParamIndex {
    entry_of: Vec<Option<usize>>,
}

impl ParamIndex {
    /// Whether the float parameter at visit `position` is trainable.
    pub fn is_trainable(&self, position: usize) -> bool {
        self.entry(position).is_some()
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
        (params, Self { entry_of })
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
            let tensor = param.val();
            let shape = tensor.dims();
            let flat = || tensor.clone().reshape([shape.iter().product::<usize>()]);
            let path = self.path.join(".");
            (self.f)(FloatTensor { path: &path, trainable: tensor.is_require_grad(), shape: &shape, flat: &flat });
        }
    }
    model.visit(&mut Floats { path: Vec::new(), f });
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
