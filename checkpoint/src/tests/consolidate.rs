//! Consolidation into one safetensors file: by module path, streamed in bounded chunks,
//! refusing unsafe outputs, with the buffers beside the parameters.

use super::*;

#[test]
fn consolidation_writes_one_valid_safetensors_file_by_module_path() {
    let root = temp_root("consolidate");
    let ckpt = write_sample(&root, "global_step1", 1, 1000);
    for dtype in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
        let out = root.join(format!("model-{dtype}.safetensors"));
        consolidate(&ckpt, &out, dtype).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let bias = st.tensor("big.bias").unwrap();
        assert_eq!(bias.shape(), [2, 5]);
        let first = match dtype {
            Precision::Fp32 => f32::from_le_bytes(bias.data()[..4].try_into().unwrap()),
            Precision::Bf16 => {
                zerotrain_precision::half::bf16::from_le_bytes(bias.data()[..2].try_into().unwrap()).to_f32()
            }
            Precision::Fp16 => {
                zerotrain_precision::half::f16::from_le_bytes(bias.data()[..2].try_into().unwrap()).to_f32()
            }
        };
        let expected = match dtype {
            Precision::Bf16 => zerotrain_precision::half::bf16::from_f32(990.0).to_f32(), // 992: 8-bit mantissa
            _ => 990.0,
        };
        assert_eq!(first, expected);
        assert_eq!(st.tensor("big.weight").unwrap().shape(), [990]);
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// Regression: `consolidate --out` could overwrite a shard of the checkpoint it read,
/// `--out /tmp` wrote `/tmp.partial`, and a failure left `<out>.partial` behind.
#[test]
fn consolidation_refuses_unsafe_outputs_and_leaves_nothing_on_failure() {
    let root = temp_root("consolidate-out");
    let ckpt = write_sample(&root, "global_step1", 1, 100);
    let shard = ckpt.dir().join("rank0.safetensors");
    for out in [shard.clone(), ckpt.dir().join("model.safetensors"), root.clone()] {
        let err = consolidate(&ckpt, &out, Precision::Fp32).unwrap_err();
        assert!(matches!(err, CheckpointError::InvalidOutput { .. }), "{}: {err}", out.display());
    }
    assert!(!root.with_file_name(format!("{}.partial", root.file_name().unwrap().to_string_lossy())).exists());
    ckpt.verify().unwrap();
    // A corrupted shard fails the export and leaves neither the file nor its partial.
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let out = root.join("model.safetensors");
    assert!(consolidate(&ckpt, &out, Precision::Fp32).is_err());
    assert!(!out.exists() && !root.join("model.safetensors.partial").exists());
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn consolidation_streams_parameters_larger_than_one_chunk_exactly() {
    let root = temp_root("consolidate-chunks");
    let elems = crate::consolidate::CHUNK_ELEMS + 1010;
    let ckpt = write_sample(&root, "global_step1", 1, elems);
    let out = root.join("model.safetensors");
    consolidate(&ckpt, &out, Precision::Fp32).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let weight = st.tensor("big.weight").unwrap();
    let value = |i: usize| f32::from_le_bytes(weight.data()[4 * i..4 * i + 4].try_into().unwrap());
    let chunk = crate::consolidate::CHUNK_ELEMS as usize;
    for i in [0, chunk - 1, chunk, chunk + 999] {
        assert_eq!(value(i), i as f32, "element {i}: the sample's master holds its flat index");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// The largest single allocation each thread asks for, so that a test can bound memory
/// whatever the machine would grant (an overcommitting kernel hands out 64 GiB of virtual
/// memory without complaint, so a failed test could otherwise pass).
mod largest_allocation {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static LARGEST: Cell<usize> = const { Cell::new(0) };
    }

    fn note(size: usize) {
        // `try_with`: the thread may be tearing down its locals.
        let _ = LARGEST.try_with(|l| l.set(l.get().max(size)));
    }

    /// The system allocator, noting request sizes.
    pub struct Tracking;

    // SAFETY: every call forwards to `System` with the caller's arguments unchanged; the
    // note is a `const`-initialised thread-local `Cell`, whose access never allocates.
    unsafe impl GlobalAlloc for Tracking {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            // SAFETY: the caller's contract for `alloc` holds unchanged.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            note(layout.size());
            // SAFETY: as above.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            note(new_size);
            // SAFETY: as above, for `realloc`.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: as above, for `dealloc`.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static GLOBAL: Tracking = Tracking;

    /// The largest allocation this thread asked for since the last call.
    pub fn take() -> usize {
        LARGEST.with(|l| l.replace(0))
    }
}

/// Regression: consolidation allocated each parameter as the manifest sized it before any
/// shard was read, so a checksummed manifest claiming a 64 GiB parameter aborted the
/// process. It now streams in bounded chunks and fails on the first shard that does not
/// match; no allocation beyond a few chunks is ever asked for.
#[test]
fn a_manifest_claiming_a_huge_parameter_fails_without_allocating_it() {
    let root = temp_root("huge-param");
    let ckpt = write_sample(&root, "global_step1", 1, 100);
    let mut m = ckpt.manifest().clone();
    let huge: u64 = 1 << 34; // 64 GiB of f32
    m.layout = vec![LayoutEntry { path: "huge".into(), shape: vec![huge], offset: 0 }];
    for (i, f) in m.files.iter_mut().enumerate() {
        f.ranges = vec![[i as u64 * huge / 2, (i as u64 + 1) * huge / 2]];
        f.size = 8 + 4 * (huge / 2) * 2;
        f.block_crc32 = vec![0; f.size.div_ceil(f.block_bytes) as usize];
    }
    std::fs::write(ckpt.dir().join("manifest.json"), m.to_bytes().unwrap()).unwrap();
    let ckpt = Checkpoint::open(&root, None).expect("the manifest itself is consistent");
    let out = root.join("model.safetensors");
    largest_allocation::take();
    let err = consolidate(&ckpt, &out, Precision::Fp32).unwrap_err().to_string();
    let largest = largest_allocation::take();
    assert!(largest <= 4 * crate::consolidate::CHUNK_ELEMS as usize * 2, "asked for {largest} bytes at once");
    assert!(err.contains("rank0.safetensors"), "{err}");
    assert!(!out.exists() && !root.join("model.safetensors.partial").exists());
    std::fs::remove_dir_all(&root).unwrap();
}

/// The manifest of a one-rank checkpoint of one parameter `w` of `shape` and `buffers`.
fn one_rank_manifest(shape: Vec<u64>, buffers: BufferSet) -> Manifest {
    Manifest {
        format_version: FORMAT_VERSION,
        tag: "global_step1".into(),
        global_step: 1,
        world_size: 1,
        stage: 0,
        precision: "fp32".into(),
        layout: vec![LayoutEntry { path: "w".into(), shape, offset: 0 }],
        tensors: vec!["master".into()],
        files: vec![],
        buffers: Some(buffers),
        engine: serde_json::json!({}),
        config: serde_json::json!({}),
        client_state: serde_json::json!(null),
    }
}

/// A checkpoint in `root` of one parameter `w` (2 x 3) and two buffers, `bn.running_mean`
/// = [0.5, -0.5] and `bn.running_var` = [2, 3]; returns the buffers' layout.
fn write_with_buffers(root: &Path) -> Vec<LayoutEntry> {
    let partial = prepare(root, "global_step1").unwrap();
    write_shard(&partial, 0, &[0..6], &[("master", &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0][..])]).unwrap();
    let layout = vec![
        LayoutEntry { path: "bn.running_mean".into(), shape: vec![2], offset: 0 },
        LayoutEntry { path: "bn.running_var".into(), shape: vec![2], offset: 2 },
    ];
    let buffers = write_buffers(&partial, layout.clone(), &[0.5, -0.5, 2.0, 3.0]).unwrap();
    commit(root, one_rank_manifest(vec![2, 3], buffers), None).unwrap();
    layout
}

/// Buffers (format 3) are one checksummed file: they read back by path, a flipped byte in
/// it is caught, and consolidation writes them beside the parameters.
#[test]
fn buffers_round_trip_are_verified_and_consolidated() {
    let root = temp_root("buffers");
    let layout = write_with_buffers(&root);
    let ckpt = Checkpoint::open(&root, None).unwrap();
    let read = ckpt.read_buffers().unwrap().unwrap();
    assert_eq!(read, vec![(layout[0].clone(), vec![0.5, -0.5]), (layout[1].clone(), vec![2.0, 3.0])]);
    ckpt.verify().unwrap();

    let out = root.with_extension("safetensors");
    consolidate(&ckpt, &out, Precision::Fp32).unwrap();
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let var = st.tensor("bn.running_var").unwrap();
    assert_eq!(var.shape(), [2]);
    assert_eq!(var.data(), [2.0f32.to_le_bytes(), 3.0f32.to_le_bytes()].concat());
    assert_eq!(st.names().len(), 3, "the parameter and both buffers");

    let file = root.join("global_step1").join(BUFFERS_FILE);
    let mut data = std::fs::read(&file).unwrap();
    let last = data.len() - 1;
    data[last] ^= 0x40;
    std::fs::write(&file, data).unwrap();
    for err in [ckpt.read_buffers().unwrap_err(), ckpt.verify().unwrap_err()] {
        assert!(err.to_string().contains(BUFFERS_FILE), "{err}");
    }
    std::fs::remove_dir_all(&root).unwrap();
    std::fs::remove_file(&out).unwrap();
}

/// A frozen layer is a buffer, and may be large: buffers stream through consolidation in
/// chunks like parameters, never read whole.
#[test]
fn consolidation_streams_a_large_buffer_in_chunks() {
    let root = temp_root("big-buffer");
    let chunk = crate::consolidate::CHUNK_ELEMS as usize;
    let elems = 4 * chunk + 7;
    let values: Vec<f32> = (0..elems).map(|i| i as f32).collect();
    let partial = prepare(&root, "global_step1").unwrap();
    write_shard(&partial, 0, &[0..2], &[("master", &[1.0, 2.0][..])]).unwrap();
    let layout = vec![LayoutEntry { path: "frozen.weight".into(), shape: vec![elems as u64], offset: 0 }];
    let buffers = write_buffers(&partial, layout, &values).unwrap();
    drop(values);
    commit(&root, one_rank_manifest(vec![2], buffers), None).unwrap();
    let ckpt = Checkpoint::open(&root, None).unwrap();
    let out = root.join("model.safetensors");
    largest_allocation::take();
    consolidate(&ckpt, &out, Precision::Fp32).unwrap();
    let largest = largest_allocation::take();
    assert!(largest <= 2 * 4 * chunk, "asked for {largest} bytes at once for a {} byte buffer", 4 * elems);
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let frozen = st.tensor("frozen.weight").unwrap();
    let value = |i: usize| f32::from_le_bytes(frozen.data()[4 * i..4 * i + 4].try_into().unwrap());
    for i in [0, chunk - 1, chunk, 3 * chunk + 5, elems - 1] {
        assert_eq!(value(i), i as f32, "element {i}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}
