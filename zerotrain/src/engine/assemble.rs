//! Putting an engine together once its units are declared: the state every part shares
//! (`Shared`), each unit made from the model's first values (broadcast from the group's
//! first rank, one unit at a time, and agreed over the tensor group), the buffers, and the
//! notices a new engine gives.

use std::sync::Arc;

use burn::module::Module;

use super::buffers::Buffers;
use super::first_values::FirstValues;
use super::model::InitialValues;
use super::notices::Notices;
use super::optimizer::OptimizerFactory;
use super::parts::Parts;
use super::report::{Peaks, Window};
use super::shared::{Shared, SwapFolders};
use super::span::Span;
use super::unit::Unit;
use super::{Engine, Granularity, Progress};
use crate::config::{Backend, ComputeDevice, Plan};
use crate::context::RankContext;
use crate::random::Streams;
use crate::{Error, Result};

/// Every unit's state from the model's values (still-lazy parameters' from `initial`,
/// when given), broadcast from the group's rank 0 one unit at a time (so no full-size
/// buffer exists), written in the compute dtype, kept as the stage says; the buffers
/// likewise.
pub(super) fn assemble<M: Module>(
    model: M,
    plan: &Plan,
    ctx: &RankContext,
    parts: Parts,
    granularity: Granularity,
    factory: &OptimizerFactory,
    initial: Option<&dyn InitialValues>,
) -> Result<Engine<M>> {
    check_no_groups(plan)?;
    let world = ctx.collective();
    if world.world_size() != plan.world_size() {
        let (planned, actual) = (plan.world_size(), world.world_size());
        return Err(Error::Usage(format!("plan is for {planned} ranks, the communicator has {actual}")));
    }
    crate::device::check_dtype(plan.precision.compute, plan.runtime.device, ctx.device())?;
    let lead = world.rank() == 0;
    let (shared, buffers, span) = shared_state(plan, ctx, parts)?;
    let (model, units, transient) = first_units(model, &shared, &buffers, factory, initial)?;
    // Its parameters are the engine's now, on the rank's device; this moves whatever else
    // the model holds (a lazy model is not forked before: `prepare`).
    let model = model.fork(&shared.device);
    let progress = Progress::new(plan);
    let mut engine = Engine {
        model,
        units,
        granularity,
        span,
        progress,
        window: Window::default(),
        peaks: Peaks { transient, ..Peaks::default() },
        buffers,
        notices: Notices::new(lead),
        shared,
    };
    engine.window.at_start = engine.traffic();
    engine.note_setup(ctx);
    Ok(engine)
}

/// What every part of the engine shares, made of `parts`: the collectives, the layout, the
/// swap folders (named after this rank's place), the forward streams, where the step runs;
/// with the parts the engine keeps apart (its buffers and span).
fn shared_state(plan: &Plan, ctx: &RankContext, parts: Parts) -> Result<(Shared, Buffers, Span)> {
    let world = ctx.collective();
    let Parts { comm, sharding, index, frozen, buffers, span, tensor } = parts;
    let owner = match (ctx.replica_group(), &tensor) {
        (Some(g), _) => format!("group{g}.rank{}", world.rank()),
        (None, Some(t)) => format!("tp{}.rank{}", t.place().0, world.rank()),
        (None, None) => format!("rank{}", world.rank()),
    };
    let swaps = SwapFolders::open(plan, world.as_ref(), &owner)?;
    let streams = Streams::new(plan.runtime.seed, ctx.data_parallel_rank());
    // A mesh's forward waits for the other ranks of its tensor or sequence group inside
    // it: where they are threads of this process, holding the generator's lock there would
    // keep them from arriving. One rank per process (MPI, a launcher) keeps its streams.
    let threads = !matches!(plan.runtime.backend, Backend::Mpi | Backend::Launcher);
    let streams = if ctx.mesh().is_some() && threads { streams.waiting_inside() } else { streams };
    // Nothing on the host needs the step's values (the note in `engine/flat.rs`).
    let device_step = plan.runtime.device != ComputeDevice::Cpu
        && !plan.zero.offload.uses_host_or_nvme()
        && (comm.world_size() == 1 || comm.reads_device_memory())
        && !span.is_pipelined();
    let shared = Shared {
        comm,
        ranks: world,
        device: ctx.device().clone(),
        plan: plan.clone(),
        sharding,
        index,
        frozen,
        swaps,
        crossings: Default::default(),
        streams,
        device_step,
        tensor,
        data_place: ctx.mesh().map(|_| (ctx.data_parallel_rank(), ctx.data_parallel_size())),
        mesh_groups: ctx
            .mesh()
            .map_or_else(Vec::new, |m| vec![Arc::clone(m.tensor.collective()), Arc::clone(m.sequence.collective())]),
    };
    Ok((shared, buffers, span))
}

/// Each unit made from the model's first values, and the buffers' values broadcast; the
/// model (its parameters the units') and the most transient bytes a unit took.
fn first_units<M: Module>(
    mut model: M,
    shared: &Shared,
    buffers: &Buffers,
    factory: &OptimizerFactory,
    initial: Option<&dyn InitialValues>,
) -> Result<(M, Vec<Unit>, u64)> {
    let (mut units, mut transient, mut first) = (Vec::new(), 0, FirstValues::new(shared.dtype()));
    for id in 0..shared.sharding.units().len() {
        // Only the group's first rank reads (the broadcast overwrites the others' values):
        // a lazily built model is then initialised once, on one thread, in one order.
        let values = first.read(&model, shared, id, initial)?;
        let bytes = values.len() * (values.dtype().bytes_per_elem() + shared.dtype().bytes_per_elem());
        transient = transient.max(bytes as u64);
        let (next, unit) = Unit::new(id, values, model, shared, factory, initial)?;
        model = next;
        units.push(unit);
    }
    // A frozen parameter sharded at stage 3 came with its unit.
    if buffers.entries().iter().any(|e| !e.sharded) {
        let mut values = buffers.read(&model, |e| !e.sharded, false)?;
        shared.comm.broadcast((&mut values).into(), 0)?;
        model = buffers.write(model, &values, |e| !e.sharded);
        if shared.dtype() != zerotrain_precision::Precision::Fp32 {
            model = buffers.cast_frozen(model, super::flat::float_dtype(shared.dtype()));
        }
    }
    Ok((model, units, transient))
}

impl<M: Module> Engine<M> {
    /// The notices a new engine gives: the context's, persistence, the parameter cache,
    /// swap folders on filesystems without direct I/O.
    fn note_setup(&mut self, ctx: &RankContext) {
        for notice in ctx.notices() {
            self.notices.warn(notice.clone());
        }
        self.note_persistence();
        self.note_param_cache();
        let swaps = &self.shared.swaps;
        for dir in [&swaps.optimizer, &swaps.param].into_iter().flatten().filter(|d| !d.is_direct()) {
            self.notices.warn(format!(
                "{}: this filesystem refuses direct I/O (O_DIRECT), so swap files go through the page cache, which \
                 holds copies of them in memory; put nvme_path on a disk's filesystem (ext4, xfs)",
                dir.path().display()
            ));
        }
    }
}

/// Refuses `plan` for one engine while it still has replica groups: the engine would train
/// one synchronous job and silently ignore them (`zerotrain::replicas::split` gives each
/// group's plan).
fn check_no_groups(plan: &Plan) -> Result<()> {
    match plan.replicas {
        None => Ok(()),
        Some(_) => Err(Error::Usage(
            "the plan has local_sgd replica groups: build each group's engine with the context and plan \
             zerotrain::replicas::split gives (zerotrain::trainer does), or remove the section"
                .into(),
        )),
    }
}
