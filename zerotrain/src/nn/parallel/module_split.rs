//! A whole Burn module cut into one rank's part ([`split_module`]): how a model built with
//! Burn's own layers gets its tensor-parallel slices with the values the unsplit model
//! starts from.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;

use super::{ParallelGroup, Split};
use crate::engine::params::{Lazy, first_value};
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
/// [`ColumnParallelLinear`](super::ColumnParallelLinear) and
/// [`RowParallelLinear`](super::RowParallelLinear) do.
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
        let whole = first_value(&param, &path, Some(Lazy { values: None, seed: self.seed }));
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

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::super::tests::{on_ranks, values};
    use super::*;

    /// Two lazy `Linear`s (`[4, 6]` with a bias, `[6, 4]`) for `split_module`.
    #[derive(burn::module::Module, Debug)]
    struct Pair {
        up: burn::nn::Linear,
        down: burn::nn::Linear,
    }

    fn pair() -> Pair {
        let device = Device::flex().autodiff();
        let linear = |d_in, d_out| burn::nn::LinearConfig::new(d_in, d_out).init(&device);
        Pair { up: linear(4, 6), down: linear(6, 4) }
    }

    /// `split_module` cuts what the plan names from the values the engine would give the whole
    /// model in a run of the same seed (the two ranks' parts side by side are the whole values
    /// the engine's own initialisation draws), leaves the rest lazy, and refuses a path the
    /// model lacks and a cut that does not divide, each by name.
    #[test]
    fn a_module_is_cut_from_the_values_the_whole_model_starts_from() {
        let plan = std::collections::BTreeMap::from([
            ("up.weight".to_string(), Split::Even { dim: 1, blocks: 1 }),
            ("up.bias".to_string(), Split::Even { dim: 0, blocks: 1 }),
            ("down.weight".to_string(), Split::Even { dim: 0, blocks: 1 }),
        ]);
        let parts = on_ranks(2, |group| {
            let part = split_module(pair(), &plan, &group, 7).unwrap();
            assert!(!part.down.bias.as_ref().unwrap().is_initialized(), "a whole parameter stays lazy");
            (values(part.up.weight.val()), values(part.up.bias.unwrap().val()), values(part.down.weight.val()))
        });
        let whole = pair();
        crate::engine::params::initialise_lazy(&whole, 7);
        let up = values(whole.up.weight.val());
        let joined: Vec<f32> = (0..4)
            .flat_map(|row| [&parts[0].0[row * 3..row * 3 + 3], &parts[1].0[row * 3..row * 3 + 3]].concat())
            .collect();
        assert_eq!(joined, up, "up.weight: columns 0..3 on rank 0, 3..6 on rank 1");
        assert_eq!([parts[0].1.clone(), parts[1].1.clone()].concat(), values(whole.up.bias.unwrap().val()));
        assert_eq!([parts[0].2.clone(), parts[1].2.clone()].concat(), values(whole.down.weight.val()));
        assert_ne!(parts[0].0, parts[1].0, "the ranks hold different columns");
        let errors = on_ranks(4, |group| {
            let mut missing = plan.clone();
            missing.insert("up.gate".to_string(), Split::Whole);
            let missing = split_module(pair(), &missing, &ParallelGroup::alone(), 7).err().unwrap().to_string();
            let undivided = split_module(pair(), &plan, &group, 7).err().unwrap().to_string();
            (missing, undivided)
        });
        let (missing, undivided) = &errors[0];
        assert!(missing.contains("`up.gate`") && missing.contains("no float parameter"), "{missing}");
        assert!(undivided.contains("`up.weight`") && undivided.contains("size 4"), "{undivided}");
    }
}
