//! Replica groups (`local_sgd`): DiLoCo-style local SGD inside one job.
//!
//! The world's ranks are `groups` groups of contiguous ranks ([`split`]); each group is a
//! normal ZeRO job (an [`Engine`] over the group's communicator, every stage, precision
//! and offload tier as without groups), reading its own part of each global batch. Every
//! `sync_every` optimizer steps, [`LocalSgd`] runs a round: the groups average the
//! pseudo-gradient `global - local` and the outer optimizer steps the global weights, which
//! every group then continues from. Its inner optimizer keeps its state.
//!
//! With parameter servers (the `server` module, `servers` feature; `local_sgd.servers`) each
//! job is one group and the round goes through the servers instead: synchronous as in one
//! job (bit for bit), or asynchronous with bounded staleness; a group that dies or stalls is
//! dropped from the quorum and may join again, and a server restarts from its own
//! checkpoints.
//!
//! # Note: the HSDP shape
//! A rank of a group holds the master weights of its shard of every unit (at stage 0, of
//! every unit whole). The rank at the same place in every other group holds the same shard,
//! so a round is one all-reduce among those peers ([`Replicas::peers`]), of the rank's
//! shard only: no rank ever holds more than its shard of the global weights or of the outer
//! optimizer's momentum. Per round a rank moves `2 (G-1)/G` of its shard's bytes in
//! `communication_data_type`, against synchronous data parallelism's `2 (N-1)/N` of the
//! gradients at every step.
//!
//! # Example
//! ```
//! use zerotrain::replicas::{LocalSgd, split};
//! use zerotrain::{Config, Engine, Overrides, launch};
//! # use burn::module::Module;
//! # use burn::nn::{Linear, LinearConfig};
//! # use burn::tensor::Tensor;
//! let config = Config::parse(
//!     r#"{"train_micro_batch_size_per_gpu": 1,
//!         "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
//!         "zero_optimization": {"stage": 1},
//!         "local_sgd": {"groups": 2, "sync_every": 2},
//!         "zerotrain": {"world_size": 4}}"#,
//!     "example",
//! )?;
//! let plan = config.resolve(Overrides::default())?;
//! let rounds = launch(&plan, |ctx| {
//!     let (group_ctx, group_plan, replicas) = split(&ctx, &plan)?;
//!     let model = LinearConfig::new(3, 1).init(group_ctx.device());
//!     let mut local = LocalSgd::new(Engine::new(model, &group_plan, &group_ctx)?, replicas)?;
//!     for step in 0..4 {
//!         let x = Tensor::<2>::ones([1, 3], group_ctx.device()) * (ctx.rank() + step) as f32;
//!         let loss = local.engine_mut().forward(|m| m.forward(x.clone()).powi_scalar(2).mean())?;
//!         local.engine_mut().backward(loss)?;
//!         local.step()?;
//!     }
//!     Ok::<_, zerotrain::Error>(local.rounds())
//! })?;
//! assert_eq!(rounds, vec![2; 4]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod outer;
mod round;
#[cfg(feature = "servers")]
pub mod server;
mod trainer;

use std::sync::Arc;

use burn::module::Module;
use zerotrain_zero::{Collective, CommStats, Sharding};

use self::round::PeerExchange;
use crate::config::ReplicaPlan;
use crate::engine::{Engine, StepReport};
use crate::{Error, Plan, RankContext, Result};

/// One rank's place among the replica groups: its group, and the collective of its peers
/// (the ranks at the same place in every group).
#[derive(Clone)]
pub struct Replicas {
    plan: ReplicaPlan,
    group: usize,
    peers: Arc<dyn Collective>,
    /// Which part of each global batch this rank reads, of how many: its place among the
    /// ranks of every group together (on a device mesh, among their data-parallel places).
    data: (usize, usize),
    /// This rank's place in its group (its world rank less the group's first), of the
    /// group's ranks.
    place: (usize, usize),
    /// How long a round may wait for the other groups (through servers).
    #[cfg_attr(not(feature = "servers"), allow(dead_code))]
    timeout: std::time::Duration,
}

impl Replicas {
    /// This rank's group, `0..groups`.
    pub fn group(&self) -> usize {
        self.group
    }

    /// The ranks holding the same shard as this one, one per group, ranked by group (with
    /// parameter servers: this job's ranks, which meet through the servers instead).
    pub fn peers(&self) -> &Arc<dyn Collective> {
        &self.peers
    }

    /// The same rank as data-parallel place `d` of `dp` of its group's device mesh: every
    /// rank of a tensor or sequence group reads the same part of each global batch, its
    /// group's `d`-th.
    pub(crate) fn on_mesh(mut self, d: usize, dp: usize) -> Self {
        self.data = (self.group * dp + d, self.plan.groups * dp);
        self
    }

    /// The world rank of place `place` of group `group`, in a job of several groups.
    pub(crate) fn world_rank(&self, group: usize, place: usize) -> usize {
        group * self.place.1 + place
    }

    /// Which part of each global batch this rank reads, of how many.
    pub(crate) fn data_position(&self) -> (usize, usize) {
        self.data
    }

    /// This rank's place in its group, and the group's ranks.
    pub(crate) fn place(&self) -> (usize, usize) {
        self.place
    }
}

/// Splits `ctx`'s world into `plan`'s replica groups (`plan.replicas`; an error without
/// them). Returns this rank's context inside its group (its collective the group's, its
/// data position still its place in the world, so that each group reads its own part of
/// every global batch), the plan each group's engine trains with (the group's world size
/// and its share of the batch), and its [`Replicas`]. Every rank calls it at once.
///
/// With parameter servers (`local_sgd.servers`) the whole job is one group, `local_sgd.group`:
/// the context is `ctx` itself, reading its group's part of every global batch.
pub fn split(ctx: &RankContext, plan: &Plan) -> Result<(RankContext, Plan, Replicas)> {
    let replicas = plan
        .replicas
        .clone()
        .ok_or_else(|| Error::Usage("replicas::split: the plan has no local_sgd groups".into()))?;
    let world = ctx.collective();
    let timeout = plan.runtime.comm_timeout;
    let mut group_plan = plan.clone();
    // The group's own job has no groups; an engine refuses a plan that still has them.
    group_plan.replicas = None;
    if let Some(group) = replicas.group {
        let (rank, size) = (world.rank(), world.world_size());
        let data = (group * size + rank, replicas.groups * size);
        let group_ctx = ctx.clone().with_data_position(data.0, data.1).in_replica_group(group);
        let replicas = Replicas { plan: replicas, group, peers: world, data, place: (rank, size), timeout };
        return Ok((group_ctx, group_plan, replicas));
    }
    let (rank, size) = (world.rank(), replicas.group_size(world.world_size()));
    if world.world_size() != plan.world_size() {
        let (planned, actual) = (plan.world_size(), world.world_size());
        return Err(Error::Usage(format!("replicas::split: the plan is for {planned} ranks, the world has {actual}")));
    }
    let (group, place) = (rank / size, rank % size);
    let group_comm = world.split(group, place)?;
    let peers = world.split(place, group)?;
    let data = (rank, world.world_size());
    let group_ctx =
        RankContext::new(group_comm, ctx.device().clone()).with_data_position(data.0, data.1).in_replica_group(group);
    group_plan.runtime.world_size = size;
    group_plan.batch.train_batch_size /= replicas.groups as u64;
    Ok((group_ctx, group_plan, Replicas { plan: replicas, group, peers, data, place: (place, size), timeout }))
}

/// A round of [`LocalSgd`]: the groups met and the global weights moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// Rounds so far, this one included.
    pub round: u64,
    /// Bytes this rank moved in the round: among its peers (the bus-bandwidth convention),
    /// or pushed to and pulled from its server.
    pub bytes: u64,
    /// Groups live after the round (all of them in one job).
    pub live_groups: usize,
    /// Rounds this group was ahead of the slowest live group at its push (async servers;
    /// otherwise 0).
    pub staleness: u64,
    /// The group had been dropped from the servers' quorum (or a server restarted): it
    /// joined again and continues from the current global weights, its window discarded.
    pub rejoined: bool,
    /// Through servers: the servers' round count, the rounds the global weights the group
    /// continues from have had applied (sync), or the round it pushes next (async); the
    /// highest of its places'. Groups that continue from the same count of a sync server
    /// hold the same weights. `None` in one job (`round` counts there).
    pub global_round: Option<u64>,
}

/// An optimizer step of a group, and the round it ended with, if any.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalStep {
    /// The group's step.
    pub report: StepReport,
    /// The round after this step (every `sync_every` steps).
    pub round: Option<Round>,
}

/// An engine training one replica group, meeting the other groups every `sync_every`
/// optimizer steps (see the module docs).
pub struct LocalSgd<M: Module> {
    engine: Engine<M>,
    replicas: Replicas,
    round: Exchange,
    steps_since_round: u64,
    /// The last round (none before the first).
    last: Option<Round>,
}

impl<M: Module> LocalSgd<M> {
    /// Wraps a group's engine (built with [`split`]'s context and plan). The global weights
    /// start as group 0's, and every group starts from them. Every rank calls it at once.
    pub fn new(mut engine: Engine<M>, replicas: Replicas) -> Result<Self> {
        let round = Self::start(&mut engine, &replicas)?;
        Ok(Self { engine, replicas, round, steps_since_round: 0, last: None })
    }

    /// Group 0's engine weights as the global weights, loaded into every group's engine,
    /// with a fresh outer optimizer (at the start, and after a checkpoint load).
    fn start(engine: &mut Engine<M>, replicas: &Replicas) -> Result<Exchange> {
        let local = engine.shard_masters()?;
        let plan = &replicas.plan;
        let round = match plan.servers.as_slice() {
            [] => Exchange::Peers(Box::new(PeerExchange::start(plan.clone(), Arc::clone(&replicas.peers), local)?)),
            servers => server_round(servers, replicas, engine.sharding(), local)?,
        };
        if replicas.group != 0 || !plan.servers.is_empty() {
            engine.load_shard_masters(round.global().to_vec())?;
        }
        Ok(round)
    }

    /// [`start`](Self::start) again, from the engine's current weights.
    fn restart_from_engine(&mut self) -> Result<()> {
        self.round = Self::start(&mut self.engine, &self.replicas)?;
        self.steps_since_round = 0;
        Ok(())
    }

    /// The group's engine: forward, backward and everything else go through it.
    pub fn engine(&self) -> &Engine<M> {
        &self.engine
    }

    /// The group's engine, mutably.
    pub fn engine_mut(&mut self) -> &mut Engine<M> {
        &mut self.engine
    }

    /// Rounds so far.
    pub fn rounds(&self) -> u64 {
        self.last.map_or(0, |r| r.round)
    }

    /// The last round, if there was one.
    pub fn last_round(&self) -> Option<Round> {
        self.last
    }

    /// [`Engine::step`], and a round after every `sync_every`-th optimizer step (skipped
    /// steps count: the groups stay in step). `None` inside an accumulation window.
    pub fn step(&mut self) -> Result<Option<LocalStep>> {
        let Some(report) = self.engine.step()? else { return Ok(None) };
        let round = self.count_step()?;
        Ok(Some(LocalStep { report, round }))
    }

    /// Counts an optimizer step; runs the round it completes, if it does.
    fn count_step(&mut self) -> Result<Option<Round>> {
        self.steps_since_round += 1;
        if self.steps_since_round < self.replicas.plan.sync_every {
            return Ok(None);
        }
        self.sync().map(Some)
    }

    /// A round now: the pseudo-gradients `global - local` averaged over the groups (in
    /// `communication_data_type`), the outer optimizer's step of the global weights, and
    /// every group's engine continuing from them. Every rank calls it at once, between
    /// optimizer steps.
    pub fn sync(&mut self) -> Result<Round> {
        let local = self.engine.shard_masters()?;
        let (global, mut round) = match &mut self.round {
            Exchange::Peers(peers) => peers.run(&local)?,
            #[cfg(feature = "servers")]
            Exchange::Server(servers) => servers.run(&local)?,
        };
        self.engine.load_shard_masters(global.to_vec())?;
        self.steps_since_round = 0;
        round.round = self.rounds() + 1;
        self.last = Some(round);
        Ok(round)
    }

    /// The peers' traffic so far (the rounds', and the start's broadcast).
    pub fn peer_stats(&self) -> CommStats {
        self.replicas.peers.stats()
    }

    /// The engine, giving up the groups.
    pub fn into_engine(self) -> Engine<M> {
        self.engine
    }
}

/// Where a rank's rounds happen.
enum Exchange {
    /// Among the ranks of this job holding the same shard in every group.
    Peers(Box<PeerExchange>),
    /// Through a parameter server (the `servers` feature).
    #[cfg(feature = "servers")]
    Server(Box<server::ServerExchange>),
}

impl Exchange {
    fn global(&self) -> &[Vec<f32>] {
        match self {
            Self::Peers(round) => round.global(),
            #[cfg(feature = "servers")]
            Self::Server(round) => round.global(),
        }
    }
}

/// This rank's rounds through every server, each holding a part of its shard (every call
/// bounded by the collective timeout).
#[cfg(feature = "servers")]
fn server_round(
    servers: &[String],
    replicas: &Replicas,
    sharding: &Sharding,
    local: Vec<Vec<f32>>,
) -> Result<Exchange> {
    let place = replicas.peers.rank();
    let rounds = server::ServerExchange::start(servers, place, sharding, &replicas.plan, local, replicas.timeout)?;
    Ok(Exchange::Server(Box::new(rounds)))
}

#[cfg(not(feature = "servers"))]
fn server_round(_servers: &[String], _replicas: &Replicas, _: &Sharding, _local: Vec<Vec<f32>>) -> Result<Exchange> {
    Err(Error::Launch("local_sgd.servers: this build has no parameter servers (the `servers` feature)".into()))
}
