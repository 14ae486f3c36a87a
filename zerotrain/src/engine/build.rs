//! Making an engine: [`Engine::new`] (the model as one unit), [`Engine::with_units`] (its
//! declared units), [`Pipeline::new`](super::Pipeline::new) (a stage's run of them), and
//! the [`EngineBuilder`] behind all three, where a program brings its own optimizer.

use std::sync::Arc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use zerotrain_zero::{ReduceOp, Sharding};

use super::assemble::assemble;
use super::buffers::Buffers;
use super::frozen::{FrozenLayout, Storage};
use super::model::{UnitModel, UnitSpec, claims, group, under};
use super::optimizer::{OptimizerFactory, ShardGroup, ShardOptimizer, built_in};
use super::params::{ParamIndex, ParamShapes, initialise_lazy, is_lazy_enough};
use super::parts::{ALIGN_ELEMS, Declared, Parts};
use super::span::Span;
use super::{Engine, Granularity, Pipeline};
use crate::config::Plan;
use crate::context::RankContext;
use crate::{Error, Result};

/// Builds an [`Engine`] (or a [`Pipeline`] stage) with options beyond the plan's.
///
/// ```no_run
/// # use zerotrain::engine::optimizer::{ShardGroup, ShardOptimizer};
/// # fn lion(group: &ShardGroup<'_>) -> Box<dyn ShardOptimizer> { unimplemented!() }
/// # fn demo<M: burn::module::Module>(model: M, plan: &zerotrain::Plan, ctx: &zerotrain::RankContext) -> zerotrain::Result<()> {
/// let engine = zerotrain::Engine::builder(model, plan, ctx).optimizer(lion).build()?;
/// # Ok(()) }
/// ```
pub struct EngineBuilder<'a, M: Module> {
    model: M,
    plan: &'a Plan,
    ctx: &'a RankContext,
    optimizer: OptimizerFactory,
}

impl<M: Module> Engine<M> {
    /// Wraps `model` for training under `plan` on `ctx`'s rank, as one unit: at stage 3 the
    /// whole model is gathered for [`forward`](Self::forward) and released after
    /// [`backward`](Self::backward). Every rank must call it; rank 0's parameters and
    /// buffers are broadcast so that all ranks start identical.
    pub fn new(model: M, plan: &Plan, ctx: &RankContext) -> Result<Self> {
        Self::builder(model, plan, ctx).build()
    }

    /// A builder for options the plan does not carry (a program's own optimizer).
    pub fn builder<'a>(model: M, plan: &'a Plan, ctx: &'a RankContext) -> EngineBuilder<'a, M> {
        EngineBuilder { model, plan, ctx, optimizer: built_in() }
    }
}

impl<M: UnitModel> Engine<M> {
    /// Wraps `model` like [`Engine::new`], sharded per unit as [`UnitModel::units`]
    /// declares, for [`forward_backward`](Self::forward_backward). A plan with pipeline
    /// stages builds a [`Pipeline`] instead.
    pub fn with_units(model: M, plan: &Plan, ctx: &RankContext) -> Result<Self> {
        Self::builder(model, plan, ctx).build_units()
    }
}

impl<'a, M: Module> EngineBuilder<'a, M> {
    /// Steps every parameter group of every unit with the optimizers `factory` builds
    /// instead of the config's (`optimizer.type` still names what checkpoints record).
    pub fn optimizer(
        mut self,
        factory: impl Fn(&ShardGroup<'_>) -> Box<dyn ShardOptimizer> + Send + Sync + 'static,
    ) -> Self {
        self.optimizer = Arc::new(factory);
        self
    }

    /// The engine of the model as one unit ([`Engine::new`]).
    pub fn build(self) -> Result<Engine<M>> {
        if self.plan.pipeline.is_some() {
            return Err(Error::Usage(
                "the plan has pipeline stages: build a Pipeline (Pipeline::new) of a model declared in units".into(),
            ));
        }
        if !self.plan.mesh.is_trivial() || self.ctx.mesh().is_some() {
            return Err(Error::Usage(
                "the plan has a tensor- or sequence-parallel mesh: build the engine of a model declared in units \
                 (Engine::with_units), whose UnitModel::model_split says how it is split"
                    .into(),
            ));
        }
        let (model, params, index) = prepare(self.model, self.ctx, self.plan.runtime.seed)?;
        let sharding = Sharding::single(params, self.plan.world_size(), ALIGN_ELEMS)?;
        let buffers = Buffers::scan(&model, self.plan.runtime.seed, |_| Some(0), &[]);
        let span = Span::whole(self.plan.world_size());
        let parts = Parts { comm: self.ctx.collective(), sharding, index, frozen: None, buffers, span, tensor: None };
        let (plan, ctx) = (self.plan, self.ctx);
        let mut engine = assemble(model, plan, ctx, parts, Granularity::WholeModel, &self.optimizer, None)?;
        if plan.activation_checkpointing {
            engine.notices.warn(
                "activation_checkpointing is set, but Engine::new runs the model as one unit, which cannot be \
                 recomputed: declare the model's units (UnitModel) and build it with Engine::with_units"
                    .into(),
            );
        }
        if plan.zero.stage.shards_parameters() {
            engine.notices.warn(
                "at stage 3, Engine::new gathers the whole model for forward and keeps it through backward: \
                 declare the model's units (UnitModel) to gather one at a time"
                    .into(),
            );
        }
        Ok(engine)
    }

    /// Which of the model's float tensors are trainable, and each unit's name, of a model
    /// declared in units: (model, parameters, index, unit of each parameter, names).
    fn declared(self) -> Result<(Self, Declared)>
    where
        M: UnitModel,
    {
        let EngineBuilder { model, plan, ctx, optimizer } = self;
        let (model, params, index) = prepare(model, ctx, plan.runtime.seed)?;
        let specs = model.units();
        let paths: Vec<String> = params.iter().map(|(path, _)| path.clone()).collect();
        // Buffers belong to the unit whose module holds them, else to the root.
        let buffers = Buffers::scan(
            &model,
            plan.runtime.seed,
            |path| Some(specs.iter().position(|s| claims(s, path)).unwrap_or(specs.len())),
            &model.frozen_parameters(),
        );
        let frozen: Vec<String> = buffers.entries().iter().map(|e| e.path.clone()).collect();
        let (unit_of, names) = group(&paths, &frozen, &specs)?;
        let root_paths = unshared_root(&paths, &unit_of, &specs, &model.shared(), &frozen)?;
        let declared = Declared { params, index, unit_of, names, specs, root_paths, buffers };
        Ok((EngineBuilder { model, plan, ctx, optimizer }, declared))
    }

    /// The engine of the model's declared units ([`Engine::with_units`]).
    pub fn build_units(self) -> Result<Engine<M>>
    where
        M: UnitModel,
    {
        if self.plan.pipeline.is_some() {
            return Err(Error::Usage(
                "the plan has pipeline stages: build the rank's stage with Pipeline::new (or \
                 Engine::builder(..).build_pipeline())"
                    .into(),
            ));
        }
        let (builder, mut declared) = self.declared()?;
        let EngineBuilder { model, plan, ctx, optimizer } = builder;
        let stage3 = plan.zero.stage.shards_parameters();
        let declared_units = declared.specs.len();
        // A frozen tensor no unit claims (a LoRA run's embedding) is sharded in the root,
        // which then exists without trained parameters of its own.
        let frozen_root = declared.buffers.entries().iter().any(|e| e.frozen && e.unit == Some(declared_units));
        if stage3 && frozen_root && declared.names.len() == declared_units {
            declared.names.push("root".into());
        }
        let frozen = match stage3 {
            true => FrozenLayout::new(
                &mut declared.buffers,
                declared.index.floats(),
                &declared.names,
                plan.world_size(),
                plan.zero.param_persistence_threshold,
                Storage {
                    quantize: plan.lora.as_ref().and_then(|l| l.quantize),
                    quantizable: model.quantizable_parameters(),
                    layer_units: declared_units,
                    dtype: plan.precision.compute,
                    split: model.model_split(),
                },
            )?,
            false => None,
        };
        let unit_of: Vec<Option<usize>> = declared.unit_of.iter().copied().map(Some).collect();
        let sharding = Sharding::new(declared.params, &unit_of, declared.names, plan.world_size(), ALIGN_ELEMS)?;
        let root = sharding.units().len() > declared_units;
        let every = usize::from(plan.activation_checkpointing);
        let granularity = Granularity::declared(declared_units, root, every, plan.recompute_units);
        let tensor = super::tensor::tensor_part(&model, plan, ctx, &sharding)?;
        let parts = Parts {
            comm: ctx.collective(),
            sharding,
            index: declared.index,
            frozen,
            buffers: declared.buffers,
            span: Span::whole(plan.world_size()),
            tensor,
        };
        let initial = model.initial_values();
        let mut engine = assemble(model, plan, ctx, parts, granularity, &optimizer, initial.as_deref())?;
        engine.note_layout(&declared.root_paths);
        Ok(engine)
    }

    /// This rank's stage of a pipeline ([`Pipeline::new`]).
    pub fn build_pipeline(self) -> Result<Pipeline<M>>
    where
        M: UnitModel,
    {
        let Some(pipeline) = self.plan.pipeline else {
            return Err(Error::Usage(
                "the plan has no pipeline section: build an Engine (Engine::with_units) for data parallelism".into(),
            ));
        };
        let (builder, declared) = self.declared()?;
        let EngineBuilder { model, plan, ctx, optimizer } = builder;
        let root_paths = declared.root_paths.clone();
        let placed = super::pipeline::place(model, ctx, (plan, pipeline), declared)?;
        let root = placed.parts.sharding.units().len() > placed.stage_units;
        let every = pipeline.checkpoint_interval;
        let granularity = Granularity::declared(placed.stage_units, root, every, plan.recompute_units);
        let initial = placed.model.initial_values();
        let mut engine = assemble(placed.model, plan, ctx, placed.parts, granularity, &optimizer, initial.as_deref())?;
        engine.note_layout(&root_paths);
        Pipeline::from_engine(engine, pipeline, placed.stage_ranges)
    }
}

/// The root's parameters (those no unit claims, `unit_of[i] == specs.len()`) that
/// `shared` does not name; an error for a `shared` path that names no root parameter, unless
/// it names only `frozen` tensors (a frozen shared embedding: whole on every rank, nothing to
/// share).
fn unshared_root(
    paths: &[String],
    unit_of: &[usize],
    specs: &[UnitSpec],
    shared: &[String],
    frozen: &[String],
) -> Result<Vec<String>> {
    let root: Vec<&String> = paths.iter().zip(unit_of).filter(|(_, u)| **u == specs.len()).map(|(p, _)| p).collect();
    let only_frozen = |s: &String| !paths.iter().any(|p| under(s, p)) && frozen.iter().any(|f| under(s, f));
    if let Some(stray) = shared.iter().find(|s| !root.iter().any(|p| under(s, p)) && !only_frozen(s)) {
        let owner = paths.iter().zip(unit_of).find(|(p, _)| under(stray, p)).map(|(_, &u)| &specs[u].name);
        let why = match owner {
            Some(unit) => format!("unit `{unit}` claims it"),
            None => "it names no trainable parameter".to_string(),
        };
        return Err(Error::Model(format!("units: shared parameter path `{stray}` is not left to the root: {why}")));
    }
    Ok(root.into_iter().filter(|p| !shared.iter().any(|s| under(s, p))).cloned().collect())
}

/// The model with buffers of its own, forked onto the rank's device, its trainable
/// parameters (path, shape) and their index; an error if it has none, saying why.
///
/// Whether the model is still all lazy is agreed by every rank before any initialises a
/// parameter: ranks that are threads hold clones sharing each lazy parameter's value, so
/// one rank's first reads would otherwise make the model look partly initialised to a rank
/// that looks later, which would then initialise the rest in its own order. A model partly
/// initialised by its caller gets its remaining lazy parameters under their own streams of
/// `seed` (`random.rs`' note on initialisation).
pub(super) fn prepare<M: Module>(model: M, ctx: &RankContext, seed: u64) -> Result<(M, ParamShapes, ParamIndex)> {
    if !ctx.device().is_autodiff() {
        return Err(Error::Usage(
            "the rank's device has no autodiff, so nothing can train: build the context on an autodiff device \
             (Device::flex().autodiff()); launch does"
                .into(),
        ));
    }
    // `valid()` copies every running state out of the caller's model (a clone shares
    // them), `train()` restores each parameter's gradient tracking (module note in
    // `buffers.rs`), `fork` puts it on the rank's device. All three give every parameter
    // its value. A model whose tensors are still lazy (built and handed over untouched),
    // but for trained parameters with values (a LoRA run's fresh adapters), has no
    // running state to copy and gets its tracking when each parameter initialises, so it
    // skips them: the engine then initialises one unit at a time as it shards them, and no
    // rank ever holds the whole model (the construction peak). It is forked once the
    // engine has replaced its parameters (`assemble`): forking a lazy parameter that a
    // clone shares (each thread rank's model is a clone) initialises it.
    let mut lazy = [f32::from(u8::from(is_lazy_enough(&model)))];
    ctx.collective().all_reduce((&mut lazy[..]).into(), ReduceOp::Min)?;
    let model = if lazy[0] > 0.0 {
        model
    } else {
        initialise_lazy(&model, seed);
        model.valid().train().fork(ctx.device())
    };
    let (params, index) = ParamIndex::scan(&model);
    if params.is_empty() {
        let floats = count_floats(&model);
        let why = if floats == 0 {
            "it has no float parameters".to_string()
        } else {
            format!(
                "none of its {floats} float tensors is set to train (frozen with no_grad or freeze?): unfreeze what \
                 should train"
            )
        };
        return Err(Error::Model(format!("the model has no trainable parameters: {why}")));
    }
    Ok((model, params, index))
}

fn count_floats<M: Module>(model: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
            self.0 += 1;
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    count.0
}
