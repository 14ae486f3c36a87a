//! Checkpoints of an offloaded engine stream: saving and loading hold about one unit's
//! tensors at a time, never the rank's whole states (measured by a counting allocator).

use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use zerotrain_zero::ThreadWorld;

use zerotrain::{Config, Engine, LoadOptions, Overrides, RankContext};

use crate::{Mlp, RegressionTask};

/// Bytes this thread holds (allocated minus freed since the last reset) and the most it
/// held: the test's own thread does the saving and loading, so other tests' allocations
/// do not count.
pub(crate) mod live_bytes {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
    }

    fn add(delta: isize) {
        // `try_with`: the thread may be tearing down its locals.
        let _ = LIVE.try_with(|l| {
            l.set(l.get() + delta);
            let _ = PEAK.try_with(|p| p.set(p.get().max(l.get())));
        });
    }

    /// The system allocator, counting this thread's bytes.
    pub struct Counting;

    // SAFETY: every call forwards to `System` with the caller's arguments unchanged; the
    // counts are `const`-initialised thread-local `Cell`s, whose access never allocates.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            add(layout.size() as isize);
            // SAFETY: the caller's contract for `alloc` holds unchanged.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            add(layout.size() as isize);
            // SAFETY: as above.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            add(new_size as isize - layout.size() as isize);
            // SAFETY: as above, for `realloc`.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            add(-(layout.size() as isize));
            // SAFETY: as above, for `dealloc`.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    /// Starts a measurement: the peak restarts from what this thread holds now.
    pub fn reset() -> isize {
        let now = LIVE.with(Cell::get);
        PEAK.with(|p| p.set(now));
        now
    }

    /// The most this thread held since [`reset`].
    pub fn peak() -> isize {
        PEAK.with(Cell::get)
    }
}

/// A unit's tensor is 1 MiB here and the rank's states 25 MiB (8 units of masters and two
/// moments): a save or load that gathered them would need that much at once.
#[test]
fn saving_and_loading_an_offloaded_engine_holds_about_one_unit_at_a_time() {
    let root = std::env::temp_dir().join(format!("zerotrain-stream-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let swap = serde_json::to_string(&root.join("swap").display().to_string()).unwrap();
    let json = format!(
        r#"{{"train_micro_batch_size_per_gpu": 1, "bf16": {{"enabled": true}}, "activation_checkpointing": {{}},
            "zero_optimization": {{"stage": 3, "sub_group_size": 1e5,
              "offload_optimizer": {{"device": "nvme", "nvme_path": {swap}}},
              "offload_param": {{"device": "nvme", "nvme_path": {swap}, "max_in_cpu": 0}}}}}}"#
    );
    let plan = Config::parse(&json, "t").unwrap().resolve(Overrides::default()).unwrap();
    let world = ThreadWorld::new(1, Duration::from_secs(60));
    let device = Device::flex().autodiff();
    let ctx = RankContext::new(Arc::new(world.communicator(0)), device.clone());
    let width = 512;
    let mut engine = Engine::with_units(Mlp::new(&[width; 9], &device), &plan, &ctx).unwrap();
    let task = RegressionTask { seq_len: 1, features: width };
    engine.forward_backward(&task.batch(0..1, &device)).unwrap();
    engine.step().unwrap();
    let unit_bytes = ((width * width + width) * size_of::<f32>()) as isize;
    let states = 8 * 3 * unit_bytes;

    let before = live_bytes::reset();
    engine.save_checkpoint(root.join("ckpt"), None, serde_json::Value::Null).unwrap();
    let save = live_bytes::peak() - before;
    let before = live_bytes::reset();
    engine.load_checkpoint(root.join("ckpt"), None, LoadOptions::default()).unwrap();
    let load = live_bytes::peak() - before;
    eprintln!("states {states} B; held at most {save} B saving, {load} B loading");
    // Saving: one unit's tensor read through its aligned I/O buffer and copied out, and the
    // shard file's 1 MiB write buffer (3.2 MB measured). Loading: one unit's master and two
    // moments, and a read buffer (5.3 MB measured). Gathering the states would be 25 MB.
    assert!(save < 4 * unit_bytes, "saving held {save} B, states are {states} B");
    assert!(load < 6 * unit_bytes, "loading held {load} B, states are {states} B");
    drop(engine);
    let _ = std::fs::remove_dir_all(&root);
}
