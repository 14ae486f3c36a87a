//! Where a pipeline stage's units come from, and how the whole model goes back to one rank.
//!
//! # Note: seeding the stages
//! Every rank starts from world rank 0's values. World rank 0 (stage 0's first
//! data-parallel rank) sends each other stage's first rank the values of that stage's
//! units and the root, and every buffer; each stage's engine then broadcasts its units
//! over its data-parallel group, as any engine does over its ranks. So each value crosses
//! once to its stage and once within it: the model is never broadcast to every rank.

use std::ops::Range;

use burn::module::Module;
use zerotrain_precision::{BufMut, FlatBuf};
use zerotrain_zero::pipeline::{Topology, partition};
use zerotrain_zero::{Collective, Sharding};

use super::Pipeline;
use crate::config::{PipelinePlan, Plan};
use crate::context::RankContext;
use crate::engine::model::{UnitModel, claims};
use crate::engine::params::{Fill, Lazy, read_params, release_unheld, write_global, write_params};
use crate::engine::parts::{ALIGN_ELEMS, Declared, Parts};
use crate::engine::span::Span;
use crate::{Error, Result};

/// A placed stage: its model (other stages' parameters released), what its engine is
/// built from, how many declared units it runs, and every stage's run of units.
pub(in crate::engine) struct Placed<M> {
    pub model: M,
    pub parts: Parts,
    pub stage_units: usize,
    pub stage_ranges: Vec<Range<usize>>,
}

/// This rank's stage (module note in `pipeline/mod.rs`): the topology, the groups, the
/// partition of the declared units, the values seeded from world rank 0, and the stage's
/// sharding over its data-parallel group. Lazy parameters are initialised under the run's
/// `seed` (`random.rs`' note on initialisation), so the stages start from the model an
/// unpipelined run starts from.
pub(in crate::engine) fn place<M: UnitModel>(
    model: M,
    ctx: &RankContext,
    (plan, pipeline): (&Plan, PipelinePlan),
    declared: Declared,
) -> Result<Placed<M>> {
    let seed = plan.runtime.seed;
    let world = ctx.collective();
    let topology = Topology::new(world.world_size(), pipeline.stages)?;
    let (stage, data) = (topology.stage(world.rank()), topology.data_index(world.rank()));
    let count = declared.specs.len();
    let weights: Vec<u64> = (0..count)
        .map(|u| {
            let sizes = declared.params.iter().zip(&declared.unit_of).filter(|(_, owner)| **owner == u);
            sizes.map(|((_, shape), _)| shape.iter().product::<usize>() as u64).sum()
        })
        .collect();
    let ranges = partition(&weights, pipeline.stages, pipeline.partition).map_err(|_| {
        Error::Model(format!(
            "pipeline.stages is {} but the model declares {count} units: each stage needs at least one",
            pipeline.stages
        ))
    })?;
    let holds = |s: usize, u: usize| u == count || ranges[s].contains(&u);
    let model = seed_stages(model, world.as_ref(), topology, &declared, &holds, (ctx, seed))?;
    let units = ranges[stage].clone();
    // A declared unit's index on this stage (`None` elsewhere); the root comes last.
    let to_local = |u: usize| if u < count { units.contains(&u).then(|| u - units.start) } else { Some(units.len()) };
    let local: Vec<Option<usize>> = declared.unit_of.iter().map(|&u| to_local(u)).collect();
    let mut names = declared.names[units.clone()].to_vec();
    names.extend(declared.names.get(count).cloned());
    let data_group = world.split(stage, data)?;
    let pipe = world.split(data, stage)?;
    let sharding = Sharding::new(declared.params, &local, names, topology.data_parallel, ALIGN_ELEMS)?;
    let model = release_unheld(model, &declared.index, &sharding, ctx.device());
    let buffers = declared.buffers.map_units(to_local);
    let span = Span { topology, stage, first_unit: units.start, pipe: Some(pipe) };
    // On a mesh, the stage's tensor group splits its units (`mesh.rs`' note on pipelines).
    let tensor = crate::engine::tensor::tensor_part(&model, plan, ctx, &sharding)?;
    let parts = Parts { comm: data_group, sharding, index: declared.index, frozen: None, buffers, span, tensor };
    Ok(Placed { model, parts, stage_units: units.len(), stage_ranges: ranges })
}

/// Sends every stage's first rank world rank 0's values of what it holds (`holds(stage,
/// unit)`, the root being unit `specs.len()`) and every buffer (module note).
fn seed_stages<M: UnitModel>(
    mut model: M,
    world: &dyn Collective,
    topology: Topology,
    declared: &Declared,
    holds: &dyn Fn(usize, usize) -> bool,
    (ctx, seed): (&RankContext, u64),
) -> Result<M> {
    let me = world.rank();
    let buffers = &declared.buffers;
    for stage in 1..topology.stages {
        let leader = topology.rank(stage, 0);
        if me != 0 && me != leader {
            continue;
        }
        let wanted: Vec<Option<usize>> = declared.unit_of.iter().map(|&u| holds(stage, u).then_some(0)).collect();
        let view = Sharding::new(declared.params.clone(), &wanted, vec!["stage".into()], 1, 1)?;
        let n = view.units()[0].layout.num_elems();
        let mut values = vec![0.0f32; n];
        let mut states = vec![0.0f32; buffers.entries().iter().map(|e| e.shape.iter().product::<usize>()).sum()];
        if me == 0 {
            let initial = model.initial_values();
            let lazy = Lazy { values: initial.as_deref(), seed };
            read_params(&model, &declared.index, &view, 0, 0..n, BufMut::F32(&mut values), Some(lazy))?;
            states = buffers.read(&model, |_| true, false)?;
            world.send((&values).into(), leader)?;
            world.send((&states).into(), leader)?;
        } else {
            world.recv((&mut values).into(), 0)?;
            world.recv((&mut states).into(), 0)?;
            let device = ctx.device();
            model = write_params(model, &declared.index, &view, 0, Fill::Take(FlatBuf::F32(values)), device);
            model = buffers.write(model, &states, |_| true);
        }
    }
    Ok(model)
}

/// [`Pipeline::gather_model`]: each stage's first rank sends world rank `root` the values
/// of the parameters it holds (the root's from stage 0), every value once, with the
/// buffers; `root` writes them into a copy of its model.
pub(super) fn gather_model<M: UnitModel>(pipeline: &mut Pipeline<M>, root: usize) -> Result<Option<M>> {
    let engine = &mut pipeline.engine;
    let paused = engine.window.pause(engine.traffic());
    engine.sync_buffers()?;
    let world = std::sync::Arc::clone(&engine.shared.ranks);
    let (me, topology, stages) = (world.rank(), engine.span.topology, pipeline.parts.len());
    let global = engine.shared.sharding.global();
    // Every rank's view of which parameters each stage owns: those of its units, and the
    // root's on stage 0 (a parameter of no declared unit).
    let specs = engine.model.units();
    let owner = |path: &str| match specs.iter().position(|s| claims(s, path)) {
        Some(u) => pipeline.parts.iter().position(|r| r.contains(&u)).unwrap_or(0),
        None => 0,
    };
    let mut values = (me == root).then(|| vec![0.0f32; global.num_elems()]);
    for stage in 0..stages {
        let sender = topology.rank(stage, 0);
        let entries: Vec<(usize, &zerotrain_zero::FlatEntry)> =
            global.entries().iter().enumerate().filter(|(_, e)| owner(&e.path) == stage).collect();
        let n: usize = entries.iter().map(|(_, e)| e.num_elems).sum();
        if me != sender && me != root {
            continue;
        }
        let mut mine = vec![0.0f32; n];
        if me == sender {
            let mut at = 0;
            for &(g, e) in &entries {
                read_global(&engine.model, &engine.shared, g, &mut mine[at..at + e.num_elems])?;
                at += e.num_elems;
            }
            if sender != root {
                world.send((&mine).into(), root)?;
            }
        }
        if me == root {
            if sender != root {
                world.recv((&mut mine).into(), sender)?;
            }
            let out = values.as_mut().expect("root");
            let mut at = 0;
            for (_, e) in &entries {
                out[e.flat_range()].copy_from_slice(&mine[at..at + e.num_elems]);
                at += e.num_elems;
            }
        }
    }
    let buffers = &engine.buffers;
    let mut states = buffers.read(&engine.model, |e| engine.counts_buffer(e), true)?;
    engine.span.sum_over_stages((&mut states).into())?;
    let out = values.map(|values| {
        let (index, sharding, dtype) = (&engine.shared.index, &engine.shared.sharding, engine.shared.dtype());
        let model = write_global(engine.model.clone(), index, sharding, &values, dtype, &engine.shared.device);
        buffers.write(model, &states, |_| true)
    });
    engine.window.resume(paused, engine.traffic());
    Ok(out)
}

/// The compute-dtype values of global entry `entry` as f32.
fn read_global<M: Module>(
    model: &M,
    shared: &crate::engine::shared::Shared,
    entry: usize,
    out: &mut [f32],
) -> Result<()> {
    let held = shared.sharding.location(entry);
    let (unit, e) = held.ok_or_else(|| Error::Model("a stage reads a parameter it does not hold".into()))?;
    let range = shared.layout(unit).entries()[e].flat_range();
    read_params(model, &shared.index, &shared.sharding, unit, range, BufMut::F32(out), None)
}
