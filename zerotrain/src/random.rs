//! The random numbers a model draws while it trains (dropout's masks, noise layers): where
//! they come from, so that a forward pass recomputed in backward draws the same numbers and
//! a seeded run repeats bit for bit, however many ranks share a process.
//!
//! # Note: replayable randomness
//! Burn's backends keep one random-number generator per process (Flex's and cubecl's alike):
//! every random op draws from it, and `Device::seed` restarts it; there is no state to save
//! and restore. Two things follow for training. A unit recomputed in backward (activation
//! checkpointing) would draw new numbers, so its gradient would belong to another loss than
//! the one its forward reported; and ranks that are threads of one process would draw from
//! one generator in whatever order the threads happen to run, so no run would repeat.
//! PyTorch's checkpoint saves and restores the generator (`preserve_rng_state`) and
//! DeepSpeed keeps a tracker per model-parallel rank; with only seeding to work with, the
//! engine gives every forward its own stream instead (`Streams`): before a unit of
//! micro-batch `m` of step `s` runs its forward on data-parallel rank `r`, the engine seeds
//! the generator with a hash of the run's `seed`, `r`, `s`, `m` and the unit, and holds the
//! process-wide [`lock`] until that forward returns, so no other thread of the process can
//! seed or draw in between. So:
//! - the recomputation seeds the same stream and draws the same numbers (checkpointing on
//!   and off train alike, bit for bit);
//! - a rank's numbers depend on its data position, not on how many ranks share its process:
//!   threads, `mpirun` processes, ZeRO stages, overlap and pipeline stages all draw alike;
//! - a run resumed from a checkpoint is at the same step and continues the same streams.
//!
//! Holding the lock makes forward passes of ranks sharing a process take turns: with every
//! forward holding it, the 2-rank main job ran 5-30% slower (three alternating runs of 600
//! steps). So a forward pays for it only if it draws:
//! the first time a forward runs (a declared unit, the loss head, or the n-th
//! [`Engine::forward`] call of a micro-step), the engine looks at the generator after it
//! (four values drawn after the forward against four drawn from the fresh stream); one
//! that drew nothing is taken never to draw and runs without the lock from then on. A
//! forward that draws only on some runs (depending on its data) is outside this rule: its
//! draws would not repeat.
//!
//! On a fused backend (Burn's `fusion`, on by default for wgpu and CUDA here) operations run
//! when the fusion queue is flushed, not when they are called, and a random kernel takes
//! its seeds from the generator when it runs: a forward that draws flushes its queue before
//! it lets the generator go (the probe's read of the generator flushes it anyway).
//!
//! # Note: initialisation
//! A Burn parameter built lazily (every `nn` layer's, and the Hugging Face families' fresh
//! ones) draws its first value from the process's generator when it is first read. The
//! engine reads a model one unit at a time, in an order that depends on the layout: a
//! pipeline's first rank reads the later stages' units before its own, and other layouts
//! may read in other orders again. So that a seeded model is the same model whatever the
//! layout (stages, world size, units, backend), the engine draws each lazy parameter under
//! a stream of its own, seeded from the run's `seed` and the parameter's module path
//! (`init_seed`), holding the [`lock`] meanwhile. A parameter already holding a value
//! (built eagerly, or read by the caller before) keeps it.
//!
//! Code of the caller's that seeds the device or draws random numbers while ranks train
//! should hold the same lock ([`lock`], [`seeded`]); an unlocked draw there can land inside
//! another rank's forward and change its numbers. Code running inside an engine's forward
//! (the closure of [`Engine::forward`], a unit's forward) must not take the lock: it may
//! already hold it.
//!
//! [`Engine::forward`]: crate::Engine::forward

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use burn::tensor::{Device, Distribution, Tensor};

/// The lock every seeding of, and draw from, the process's generator is made under.
static GENERATOR: Mutex<()> = Mutex::new(());

/// Holds the process's random-number generator until the guard drops: no engine forward
/// (and no other holder) seeds it or draws from it meanwhile. A forward that panicked while
/// holding it leaves it usable.
pub fn lock() -> MutexGuard<'static, ()> {
    GENERATOR.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `draw` with the generator seeded with `seed` and held (see [`lock`]): what `draw`
/// draws on `device` depends on `seed` alone, whatever else the process runs. Building a
/// seeded model while ranks may be training is the typical use.
pub fn seeded<T>(device: &Device, seed: u64, draw: impl FnOnce() -> T) -> T {
    let _held = lock();
    device.seed(seed);
    draw()
}

/// The seed the first value of the lazy parameter at module path `path` is drawn with, in
/// a run seeded with `seed` (module note: initialisation).
pub(crate) fn init_seed(seed: u64, path: &str) -> u64 {
    path.bytes().fold(mix(seed ^ 0x1A17_5EED), |h, b| mix(h ^ u64::from(b)))
}

/// The first value of `param`, at module path `path`, in a run seeded with `seed`: a lazy
/// parameter drawn under its path's own stream ([`init_seed`]) with the generator held (as
/// the engine draws every lazy parameter it reads), one already holding a value its value.
pub(crate) fn first_value<const D: usize>(param: &burn::module::Param<Tensor<D>>, path: &str, seed: u64) -> Tensor<D> {
    if param.is_initialized() {
        return param.val();
    }
    seeded(&param.lazy_device(), init_seed(seed, path), || param.val())
}

/// Which forward draws: within step `step`'s micro-batch `micro`, the stream `index`
/// (module note).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Draw {
    /// Optimizer steps taken before this one (skipped ones included).
    pub step: u64,
    /// The micro-batch within the step's accumulation window.
    pub micro: u64,
    /// The forward within the micro-batch: a declared unit's index in the whole model,
    /// [`LOSS`], or the count of whole-model forwards before this one.
    pub index: u64,
}

/// [`Draw::index`] of a unit model's loss (its output head).
pub(crate) const LOSS: u64 = u64::MAX;

/// One rank's forward streams, and what each forward was seen to draw (module note).
#[derive(Debug)]
pub(crate) struct Streams {
    seed: u64,
    data_parallel_rank: u64,
    /// By [`Draw::index`]: whether that forward drew random numbers the first time it ran.
    seen: Mutex<HashMap<u64, bool>>,
    /// The forwards wait for other ranks inside them ([`Streams::waiting_inside`]).
    unlocked: bool,
}

impl Streams {
    /// The streams of the rank at data-parallel position `data_parallel_rank` of a run
    /// seeded with `seed`.
    pub fn new(seed: u64, data_parallel_rank: usize) -> Self {
        Self { seed, data_parallel_rank: data_parallel_rank as u64, seen: Mutex::default(), unlocked: false }
    }

    /// The same streams for forwards that wait for other ranks of the process inside them
    /// (a tensor-parallel model's collectives): holding the generator's lock there would
    /// keep those ranks from ever arriving, so they run without it, unseeded. Such a
    /// model's forward must draw no random numbers (the Hugging Face families draw none):
    /// its draws would neither repeat nor be its rank's own.
    pub fn waiting_inside(mut self) -> Self {
        self.unlocked = true;
        self
    }

    /// The seed of `draw`'s stream.
    pub fn seed_of(&self, draw: Draw) -> u64 {
        let coordinates = [self.data_parallel_rank, draw.step, draw.micro, draw.index];
        coordinates.into_iter().fold(mix(self.seed), |h, v| mix(h ^ mix(v)))
    }

    /// Runs the forward `f` drawing from `draw`'s stream on `device`: holding the
    /// generator, seeded with the stream's seed, unless this forward (`draw.index`) drew
    /// nothing the first time it ran; that first time, it finds out (module note). Streams
    /// [`waiting_inside`](Self::waiting_inside) just run `f`.
    pub fn run<T>(&self, device: &Device, draw: Draw, f: impl FnOnce() -> T) -> T {
        if self.unlocked {
            return f();
        }
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner).get(&draw.index).copied();
        let seed = self.seed_of(draw);
        match seen {
            Some(false) => f(),
            Some(true) => seeded(device, seed, || {
                let out = f();
                launched(device);
                out
            }),
            None => {
                let _held = lock();
                device.seed(seed);
                let fresh = probe(device);
                device.seed(seed);
                let out = f();
                let drew = probe(device) != fresh;
                self.seen.lock().unwrap_or_else(PoisonError::into_inner).insert(draw.index, drew);
                out
            }
        }
    }
}

/// Hands the device's queued work out for execution, so that a fused backend (which records
/// operations and runs them later) has drawn the forward's random numbers before the lock
/// is let go: a random kernel takes its seeds from the generator when it is launched. Eager
/// backends have nothing queued. A failure here is the device's, and the step's next read
/// of a result reports it.
fn launched(device: &Device) {
    let _ = device.flush();
}

/// The next values of the generator (four, so that a forward that drew cannot leave the
/// generator where it found it by chance: 2^-96 with f32's 24 random bits each).
fn probe(device: &Device) -> burn::tensor::TensorData {
    Tensor::<1>::random([4], Distribution::Default, device).into_data()
}

/// One step of SplitMix64: advances `state` and returns a well-mixed 64-bit value (cheap
/// and deterministic: stream seeds here, and the application's generated data).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// SplitMix64's output for `x`: a bijection of `u64` that spreads every input bit over the
/// output.
fn mix(x: u64) -> u64 {
    splitmix64(&mut { x })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// Every coordinate of a draw picks another stream, and the same coordinates the same.
    #[test]
    fn each_rank_step_micro_batch_and_unit_has_a_stream_of_its_own() {
        let mut seen = HashSet::new();
        for (seed, rank) in [(42, 0), (42, 1), (7, 0)] {
            let streams = Streams::new(seed, rank);
            for step in 0..4 {
                for micro in 0..3 {
                    for index in [0, 1, 2, LOSS] {
                        let draw = Draw { step, micro, index };
                        assert!(seen.insert(streams.seed_of(draw)), "{seed} {rank} {draw:?} repeats a stream");
                        assert_eq!(streams.seed_of(draw), Streams::new(seed, rank).seed_of(draw));
                    }
                }
            }
        }
        // Swapped coordinates are other streams too (the hash is not symmetric).
        let s = Streams::new(42, 0);
        assert_ne!(s.seed_of(Draw { step: 1, micro: 2, index: 0 }), s.seed_of(Draw { step: 2, micro: 1, index: 0 }));
    }

    /// The first run of a forward finds out whether it draws; one that drew nothing then runs
    /// without the lock (here: while this thread holds it), and one that drew still replays
    /// its stream.
    #[test]
    fn a_forward_that_drew_nothing_runs_without_the_lock_from_its_second_run_on() {
        let device = Device::flex();
        let streams = Streams::new(1, 0);
        let (quiet, noisy) = (Draw { step: 0, micro: 0, index: 0 }, Draw { step: 0, micro: 0, index: 1 });
        let draws = || Tensor::<1>::random([8], Distribution::Default, &device).into_data();
        streams.run(&device, quiet, || ());
        let first = streams.run(&device, noisy, draws);
        let seen = streams.seen.lock().unwrap().clone();
        assert_eq!(seen, HashMap::from([(0, false), (1, true)]));
        assert_eq!(streams.run(&device, Draw { step: 5, ..noisy }, draws), {
            let later = Streams::new(1, 0);
            later.run(&device, Draw { step: 5, ..noisy }, draws)
        });
        assert_eq!(streams.run(&device, noisy, draws), first);
        let (done, ran) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            let _held = lock();
            s.spawn(|| {
                streams.run(&device, Draw { step: 3, ..quiet }, || ());
                done.send(()).unwrap();
            });
            let waited = ran.recv_timeout(std::time::Duration::from_secs(30));
            assert!(waited.is_ok(), "a forward that drew nothing waited for the generator");
        });
    }

    /// A stream replays: what a forward draws under it is what it drew the first time, even
    /// with another thread seeding and drawing (under the lock) all the while.
    #[test]
    fn a_stream_replays_while_other_threads_draw() {
        let device = Device::flex();
        let draw = Draw { step: 3, micro: 1, index: 2 };
        let values = || {
            Streams::new(5, 1)
                .run(&device, draw, || Tensor::<1>::random([64], Distribution::Default, &device).into_data())
        };
        let first = values();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0.. {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    seeded(&device, i, || Tensor::<1>::random([64], Distribution::Default, &device));
                }
            });
            for _ in 0..50 {
                assert_eq!(values(), first);
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    }
}
