//! Declaring a model's units: [`UnitModel`], [`UnitSpec`] and the [`Activation`] that flows
//! between units (`activation.rs`).
//!
//! A unit is the granule the engine gathers, releases, reduces and recomputes (a
//! transformer block, the embeddings, the head). A model declares its units in execution
//! order with the module paths of their parameters, and runs one unit at a time in
//! [`UnitModel::forward_unit`]; the engine then drives the units itself
//! ([`Engine::forward_backward`](crate::Engine::forward_backward)): at ZeRO stage 3 it
//! gathers each unit just before it runs and releases it after, and it reduces each unit's
//! gradients as soon as backward has produced them.
//!
//! # Note: the root unit
//! Parameters that no declared unit claims form the *root* unit, as in PyTorch FSDP: it is
//! gathered before the first unit runs and kept until the backward pass is over, so any
//! unit (and the loss) may use it. A parameter used by two units (a token embedding tied to
//! the output head) must be left to the root: its gradient contributions from every use
//! are summed before it is reduced ([`UnitModel::shared`] says so, and silences the
//! engine's warning about root parameters). A unit may use its own and the root's
//! parameters only;
//! the engine reports a gradient that appears in another unit's backward pass as an error.

use std::ops::Range;
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Tensor;
use zerotrain_precision::{BufMut, Precision};

use crate::{Error, Result};

pub use super::activation::{Activation, ZerosLike};

/// A model the engine can run one unit at a time. See the module docs.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::tensor::{Device, Tensor};
/// use zerotrain::engine::{UnitModel, UnitSpec};
///
/// #[derive(Module, Debug)]
/// struct Mlp {
///     layers: Vec<Linear>,
/// }
///
/// impl UnitModel for Mlp {
///     type Batch = (Tensor<2>, Tensor<2>);
///     type Hidden = Tensor<2>;
///
///     fn units(&self) -> Vec<UnitSpec> {
///         (0..self.layers.len()).map(|i| UnitSpec::new(format!("layer{i}"), [format!("layers.{i}")])).collect()
///     }
///
///     fn forward_unit(&self, unit: usize, input: Option<Tensor<2>>, batch: &Self::Batch) -> Tensor<2> {
///         let x = input.unwrap_or_else(|| batch.0.clone());
///         self.layers[unit].forward(x).tanh()
///     }
///
///     fn output_loss(&self, output: Tensor<2>, batch: &Self::Batch) -> Tensor<1> {
///         (output - batch.1.clone()).square().mean()
///     }
/// }
/// ```
pub trait UnitModel: Module {
    /// What one micro-step reads (inputs and targets).
    type Batch;
    /// What flows from one unit to the next: a float tensor, or a tuple of them (a
    /// residual stream and a side input such as an encoder's output).
    type Hidden: Activation;

    /// The units in execution order, each with the module paths of its parameters.
    /// Parameters no unit claims belong to the root unit (module note).
    fn units(&self) -> Vec<UnitSpec>;

    /// Module paths of parameters left to the root on purpose, because several units use
    /// them (a token embedding tied to the output head). The engine warns about root
    /// parameters not listed here, which are usually a unit's forgotten layer. Each path
    /// must name a parameter (or module) no unit claims. Default: none.
    fn shared(&self) -> Vec<String> {
        Vec::new()
    }

    /// Runs unit `unit` (an index into [`units`](Self::units)). `input` is the previous
    /// unit's output, `None` for unit 0, which reads `batch`. It may use the unit's own
    /// parameters and the root's.
    fn forward_unit(&self, unit: usize, input: Option<Self::Hidden>, batch: &Self::Batch) -> Self::Hidden;

    /// [`forward_unit`](Self::forward_unit) with a loss term of the unit's own (a one-element
    /// tensor, such as a mixture-of-experts auxiliary loss), added to the model's loss and
    /// back-propagated through the unit. Default: no term. Override it (and let
    /// `forward_unit` return its first half) for a model with such terms.
    fn forward_unit_with_loss(
        &self,
        unit: usize,
        input: Option<Self::Hidden>,
        batch: &Self::Batch,
    ) -> (Self::Hidden, Option<Tensor<1>>) {
        (self.forward_unit(unit, input, batch), None)
    }

    /// The loss (a one-element tensor) from the last unit's output. It may use the root's
    /// parameters. (Named apart from a model's own `loss` method, which often takes a
    /// batch.)
    fn output_loss(&self, output: Self::Hidden, batch: &Self::Batch) -> Tensor<1>;

    /// How many samples `batch` holds, if the model can tell: the engine then warns once
    /// when a micro-batch is not `train_micro_batch_size_per_gpu` samples (the loss of a
    /// short batch weighs like a full one). Default: it cannot tell.
    fn batch_size(&self, batch: &Self::Batch) -> Option<usize> {
        let _ = batch;
        None
    }

    /// Where the engine reads the first values of parameters that are still lazy (never
    /// initialised, as Burn's `Param::uninitialized` leaves them) by module path, straight
    /// into each unit's flat buffer, instead of initialising each into a tensor and copying
    /// it out: a model imported from checkpoint files points at them, so each value is read
    /// once. The values must be those the parameters would initialise to. Parameters
    /// already initialised are read from the model. Default: none.
    fn initial_values(&self) -> Option<Arc<dyn InitialValues>> {
        None
    }

    /// Module paths of the model's frozen parameters: float tensors under them that do not
    /// train and that no forward updates (a LoRA run's base), unlike running statistics.
    /// The engine does not average them over the ranks, put them back after a recomputed
    /// forward, or save them in checkpoints (a resumed run builds them again, as the first
    /// run did, so a checkpoint holds what trains). Below stage 3 each rank holds them
    /// whole, cast to the compute dtype under fp16/bf16; at stage 3 those within a unit
    /// (and the root's) are sharded with its parameters, in its tier (memory or NVMe),
    /// gathered for the unit's forward and backward and released after, as the trained
    /// ones are. Default: none (every float tensor that does not train is a buffer).
    fn frozen_parameters(&self) -> Vec<String> {
        Vec::new()
    }

    /// Module paths of the frozen parameters that a quantised base
    /// (`zerotrain.lora.quantize`, QLoRA) stores quantised at stage 3: the linear layers'
    /// weights, as QLoRA quantises them, while embeddings, the output head, norms and
    /// biases stay in the compute dtype. Of the tensors under these paths only the 2-D ones
    /// over the persistence threshold are quantised. Default: `None`, every such tensor of
    /// a declared unit — right for a model whose units hold its layers and whose root holds
    /// its embeddings and head; a model with units of its own for those lists its layers.
    fn quantizable_parameters(&self) -> Option<Vec<String>> {
        None
    }

    /// The model's split over a tensor-parallel group, where it was built as one rank's
    /// part (Megatron's plan: [`crate::nn::parallel`]): the group and each split
    /// parameter's cut. An engine whose plan has a tensor-parallel mesh
    /// (`tensor_parallel.autotp_size`) refuses a model without one rather than train it
    /// whole on every rank. Default: none.
    fn model_split(&self) -> Option<crate::nn::parallel::ModelSplit> {
        None
    }
}

/// The first values of a model's parameters, by module path
/// ([`UnitModel::initial_values`]): checkpoint files, typically.
pub trait InitialValues: Send + Sync + std::fmt::Debug {
    /// Writes elements `elems` (row-major) of the parameter at module path `path` into
    /// `dst` (`elems.len()` long): exactly, in f32 or in the type [`dtype`](Self::dtype)
    /// says holds them (the engine asks for no other); a message saying what failed,
    /// naming the file, if it cannot.
    fn read(&self, path: &str, elems: Range<usize>, dst: BufMut<'_>) -> std::result::Result<(), String>;

    /// A type that holds every value of the parameter at `path` exactly, if known (a
    /// checkpoint file's dtype): when it is the compute dtype and a unit's parameters are
    /// all lazy, the engine reads them in it, skipping f32. Default: none known.
    fn dtype(&self, path: &str) -> Option<Precision> {
        let _ = path;
        None
    }

    /// A hint that the parameter at `path` will be [`read`](Self::read) soon: the engine
    /// gives it a unit ahead, so a source on disk can read while the engine converts.
    /// Default: nothing.
    fn prefetch(&self, path: &str) {
        let _ = path;
    }
}

/// One unit: a name and the module paths of its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitSpec {
    /// For messages and reports, e.g. `blocks.3`.
    pub name: String,
    /// Module paths, each naming a parameter (`head.weight`) or a module whose parameters
    /// all belong to the unit (`blocks.3`).
    pub params: Vec<String>,
}

impl UnitSpec {
    /// A unit called `name` holding the parameters under `params`.
    pub fn new(name: impl Into<String>, params: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self { name: name.into(), params: params.into_iter().map(Into::into).collect() }
    }
}

/// Whether the parameter (or buffer) at `path` is under one of `spec`'s paths.
pub(crate) fn claims(spec: &UnitSpec, path: &str) -> bool {
    spec.params.iter().any(|p| under(p, path))
}

/// Whether `path` is `prefix` or under the module `prefix`.
pub(crate) fn under(prefix: &str, path: &str) -> bool {
    path == prefix || path.strip_prefix(prefix).is_some_and(|rest| rest.starts_with('.'))
}

/// The unit each parameter (by module path, in visit order) belongs to, and the units'
/// names: the declared units, then the root (`"root"`) if any parameter is left to it.
/// `frozen` are the model's float tensors that do not train (buffers, frozen layers): a
/// unit may list a module of those alone (a frozen layer is still a step of the forward).
pub(crate) fn group(paths: &[String], frozen: &[String], specs: &[UnitSpec]) -> Result<(Vec<usize>, Vec<String>)> {
    let invalid = |message: String| Err(Error::Model(format!("units: {message}")));
    if specs.is_empty() {
        return invalid("the model declares no units".into());
    }
    for (i, spec) in specs.iter().enumerate() {
        if let Some(other) = specs[..i].iter().find(|s| s.name == spec.name) {
            return invalid(format!("two units are called `{}`", other.name));
        }
        let names_something = |p: &String| paths.iter().chain(frozen).any(|path| under(p, path));
        if let Some(unused) = spec.params.iter().find(|p| !names_something(p)) {
            return invalid(format!("unit `{}` lists `{unused}`, which names no parameter or buffer", spec.name));
        }
    }
    let root = specs.len();
    let mut unit_of = Vec::with_capacity(paths.len());
    for path in paths {
        let mut owners = specs.iter().enumerate().filter(|(_, s)| claims(s, path)).map(|(u, _)| u);
        match (owners.next(), owners.next()) {
            (Some(a), Some(b)) => {
                return invalid(format!("`{path}` is claimed by both `{}` and `{}`", specs[a].name, specs[b].name));
            }
            (Some(u), None) => unit_of.push(u),
            (None, _) => unit_of.push(root),
        }
    }
    let mut names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
    if unit_of.contains(&root) {
        names.push("root".into());
    }
    Ok((unit_of, names))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn units_claim_by_module_path_and_leave_the_rest_to_the_root() {
        let p = paths(&["token.weight", "blocks.0.w", "blocks.1.w", "blocks.10.w", "norm.gamma", "head.weight"]);
        let specs = [
            UnitSpec::new("b0", ["blocks.0"]),
            UnitSpec::new("b1", ["blocks.1"]),
            UnitSpec::new("b10", ["blocks.10"]),
            UnitSpec::new("head", ["norm", "head.weight"]),
        ];
        let (unit_of, names) = group(&p, &[], &specs).unwrap();
        // `blocks.1` does not claim `blocks.10.w`; the token embedding is the root's.
        assert_eq!(unit_of, [4, 0, 1, 2, 3, 3]);
        assert_eq!(names, ["b0", "b1", "b10", "head", "root"]);
        let (unit_of, names) = group(&p[1..], &[], &specs).unwrap();
        assert_eq!((unit_of, names.len()), (vec![0, 1, 2, 3, 3], 4), "no root when every parameter is claimed");
    }

    #[test]
    fn bad_declarations_are_errors_that_name_the_unit_and_path() {
        let p = paths(&["a.w", "b.w"]);
        let cases = [
            (vec![], "declares no units"),
            (vec![UnitSpec::new("x", ["a"]), UnitSpec::new("x", ["b"])], "two units are called `x`"),
            (vec![UnitSpec::new("x", ["a", "c"])], "unit `x` lists `c`, which names no parameter or buffer"),
            (vec![UnitSpec::new("x", ["a"]), UnitSpec::new("y", ["a.w"])], "`a.w` is claimed by both `x` and `y`"),
        ];
        for (specs, needle) in cases {
            let err = group(&p, &[], &specs).unwrap_err().to_string();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        // A unit of frozen tensors alone is a unit with nothing to train, not a typo.
        let frozen = paths(&["c.w"]);
        let (unit_of, names) =
            group(&p, &frozen, &[UnitSpec::new("x", ["a", "b"]), UnitSpec::new("c", ["c"])]).unwrap();
        assert_eq!((unit_of, names), (vec![0, 0], paths(&["x", "c"])));
    }
}
