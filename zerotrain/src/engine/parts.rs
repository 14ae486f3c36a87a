//! What an engine is made of, apart from how it is made: the units a model declares
//! ([`Declared`]), which of them a rank holds and over which group ([`Parts`]), and the
//! shard alignment. Both the builder (`build.rs`) and a pipeline stage's placement
//! (`pipeline/stage_values.rs`) use them; neither imports the other for them.

use std::sync::Arc;

use zerotrain_zero::{Collective, Sharding};

use super::buffers::Buffers;
use super::frozen::FrozenLayout;
use super::model::UnitSpec;
use super::params::{ParamIndex, ParamShapes};
use super::span::Span;
use super::tensor::TensorPart;

/// Shard alignment in elements (one 64-byte cache line of f32).
pub(super) const ALIGN_ELEMS: usize = 16;

/// A model's declared units, found by `EngineBuilder::declared`.
pub(super) struct Declared {
    pub params: ParamShapes,
    pub index: ParamIndex,
    /// Each parameter's unit (the root is `specs.len()`).
    pub unit_of: Vec<usize>,
    pub names: Vec<String>,
    pub specs: Vec<UnitSpec>,
    /// Parameters no unit claims and the model does not list as shared.
    pub root_paths: Vec<String>,
    /// The model's buffers, each in its declared unit (the root's are `specs.len()`).
    pub buffers: Buffers,
}

/// Which units a rank holds and where: what `build.rs`'s `assemble` needs beside the model and plan.
pub(super) struct Parts {
    /// The group the units are sharded over.
    pub comm: Arc<dyn Collective>,
    pub sharding: Sharding,
    pub index: ParamIndex,
    /// Stage 3: the frozen parameters' layout over the same units, if any unit holds one.
    pub frozen: Option<FrozenLayout>,
    pub buffers: Buffers,
    pub span: Span,
    /// How the units are split over a tensor-parallel group, if they are.
    pub tensor: Option<TensorPart>,
}
