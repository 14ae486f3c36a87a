//! ZeRO's moving parts that need no tensors: where each parameter lives in a flat buffer
//! ([`FlatLayout`]), how a model's units are each sharded over every rank ([`Sharding`]),
//! what each stage partitions ([`ZeroStage`]), how ranks talk ([`Collective`], with the
//! always-built [`ThreadWorld`] backend, owned-buffer [`Request`]s and the
//! [`CommThread`] that runs them while the rank computes; MPI processes behind the `mpi`
//! feature, NCCL on NVIDIA GPUs behind `nccl`, see [`collective::nccl`]), and what a rank
//! should hold in memory ([`memory::model_state_bytes`]).
//!
//! The engine in the `zerotrain` crate builds a [`Sharding`] from the model (one
//! [`FlatLayout`] per unit), asks the [`ZeroStage`] which state to keep for a unit's whole
//! buffer and which for its shard only, and moves gradients and parameters unit by unit
//! with [`Collective::start`].
//!
//! ```
//! use std::time::Duration;
//! use zerotrain_zero::{Collective, FlatLayout, ReduceOp, ThreadWorld};
//!
//! let layout = FlatLayout::new([("w".to_string(), vec![3, 2]), ("b".to_string(), vec![2])], 2, 1)?;
//! assert_eq!(layout.shard_range(1), 4..8);
//!
//! let world = ThreadWorld::new(2, Duration::from_secs(30));
//! let shards: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let ranks: Vec<_> = (0..2).map(|rank| {
//!         let comm = world.communicator(rank);
//!         let layout = &layout;
//!         s.spawn(move || {
//!             let grads = vec![rank as f32 + 1.0; layout.padded_elems()];
//!             let mut shard = vec![0.0; layout.shard_len()];
//!             comm.reduce_scatter((&grads).into(), (&mut shard).into(), ReduceOp::Sum).unwrap();
//!             shard
//!         })
//!     }).collect();
//!     ranks.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert_eq!(shards[1], vec![3.0; 4]);
//! # Ok::<(), zerotrain_zero::ZeroError>(())
//! ```
//!
//! # Design notes
//! - *Note: padding* — see [`layout`].
//! - *Note: units*, *the global order*, *buckets* — see [`sharding`].
//! - *Note: one thread, one order*, *borrowed buffers* — see [`CommThread`].
//! - *Note: the three-barrier protocol* — see the threads backend in [`collective`].
//! - *Note: byte counting* — see [`collective`].
#![deny(missing_docs)]

pub mod collective;
mod error;
pub mod layout;
pub mod memory;
pub mod pipeline;
pub mod sharding;
mod stage;

pub use collective::{
    Collective, CommStats, CommThread, Completed, DeviceBuf, DeviceCall, DeviceOp, OpStats, Pending, ReduceOp, Request,
    ThreadComm, ThreadWorld, equal_counts, exchange, part_ranges,
};
pub use error::ZeroError;
pub use layout::{FlatEntry, FlatLayout, Segment};
pub use sharding::{ShardedUnit, Sharding};
pub use stage::ZeroStage;
