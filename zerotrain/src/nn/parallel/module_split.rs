//! A whole Burn module cut into one rank's part ([`split_module`]): how a model built with
//! Burn's own layers gets its tensor-parallel slices with the values the unsplit model
//! starts from.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;

use super::{ParallelGroup, Split};
use crate::{Error, Result};

/// This rank's part of `model`: each parameter `splits` names (by module path) cut as its
/// [`Split`] says for rank [`group.rank()`](ParallelGroup::rank) of
/// [`group.size()`](ParallelGroup::size); every other parameter left as it is (a lazy one
/// stays lazy).
///
/// A parameter it cuts that is still lazy first gets the value an engine gives it in a run
/// seeded with `seed` (drawn under its module path's own stream, as the engine draws every
/// lazy parameter), and a parameter already holding a value keeps it: a model split this
/// way starts from exactly the values the unsplit model starts from in the same run, as
/// Megatron-LM's initialisation of the whole weight before slicing it. One whole
/// parameter is held at a time, and only while it is cut.
///
/// The forward of the part is the caller's to write: enter each column-parallel region
/// through [`ParallelGroup::copy_to`], leave each row-parallel one through
/// [`ParallelGroup::reduce_from`] (adding a row-parallel bias once, after the sum), as
/// [`row_parallel_linear`](super::row_parallel_linear) does for a row-parallel layer.
///
/// # Errors
/// A path of `splits` the model has no float parameter at, or a cut that does not divide
/// over the group, each named.
pub fn split_module<M: Module>(
    model: M,
    splits: &BTreeMap<String, Split>,
    group: &ParallelGroup,
    seed: u64,
) -> Result<M> {
    let mut cutter = Cutter { path: Vec::new(), splits, group, seed, found: 0, error: None };
    let model = model.map(&mut cutter);
    if let Some(error) = cutter.error {
        return Err(error);
    }
    if cutter.found != splits.len() {
        let missing = splits.keys().find(|path| !has_float(&model, path)).map_or("?", String::as_str);
        return Err(Error::Usage(format!(
            "the tensor-parallel plan cuts `{missing}`, but the model has no float parameter at that path"
        )));
    }
    Ok(model)
}

struct Cutter<'a> {
    path: Vec<String>,
    splits: &'a BTreeMap<String, Split>,
    group: &'a ParallelGroup,
    seed: u64,
    found: usize,
    error: Option<Error>,
}

impl ModuleMapper for Cutter<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let path = self.path.join(".");
        let Some(split) = self.splits.get(&path) else { return param };
        self.found += 1;
        if self.error.is_some() {
            return param;
        }
        let whole = crate::random::first_value(&param, &path, self.seed);
        let tracked = whole.is_require_grad();
        match split.slice(whole.detach(), self.group.rank(), self.group.size(), &format!("parameter `{path}`")) {
            // A copy of the slice (once, before training: through the host), so that no view
            // keeps the whole tensor's memory alive.
            Ok(part) => {
                let part = Tensor::from_data(part.into_data(), &param.lazy_device());
                param.map(|_| if tracked { part.require_grad() } else { part })
            }
            Err(error) => {
                self.error = Some(error);
                param
            }
        }
    }
}

/// Whether `model` has a float parameter at module path `path`.
fn has_float<M: Module>(model: &M, path: &str) -> bool {
    struct Find<'a> {
        path: Vec<String>,
        wanted: &'a str,
        found: bool,
    }
    impl burn::module::ModuleVisitor for Find<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
            self.found |= self.path.join(".") == self.wanted;
        }
    }
    let mut find = Find { path: Vec::new(), wanted: path, found: false };
    model.visit(&mut find);
    find.found
}
