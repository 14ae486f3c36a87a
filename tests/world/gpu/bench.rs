//! `zerotrain bench gpu` on the device, in each half precision: where the device computes
//! in it, every row is measured (plain Burn in fp32 and in it, then the engine); where it
//! does not (wgpu has no bf16), the bench is refused by its flag before any row. Before, the
//! plain half-precision row ran kernels the device cannot compile: they panicked in the
//! device's own thread, once per kernel, and the row was printed with a time as if measured.

use std::sync::Mutex;

use burn::tensor::DType;
use zerotrain::app::bench::RunMode;
use zerotrain::app::bench::gpu::GpuBench;
use zerotrain::app::models::GptConfig;
use zerotrain::config::ComputeDevice;

use super::{Gpu, device_alone};

pub fn bench_in_half_precision_measures_every_row_or_refuses_before_the_first(on: Gpu) {
    let _alone = device_alone();
    let device = match on.name {
        "wgpu" => ComputeDevice::Wgpu,
        "cuda" => ComputeDevice::Cuda,
        other => panic!("no ComputeDevice for {other}"),
    };
    let shape = GptConfig { n_layer: 1, n_head: 2, n_embd: 16, block_size: 8, vocab_size: 13, tied_head: true };
    for (precision, dtype) in [("bf16", DType::BF16), ("fp16", DType::F16)] {
        let supported = (on.device)().supports_dtype(dtype);
        let bench = GpuBench {
            shape,
            device,
            batch: 2,
            steps: 1,
            stages: vec![0],
            precision: precision.into(),
            modes: vec![RunMode::Units],
            recompute_units: Vec::new(),
            peak_tflops: 1.0,
            breakdown: false,
        };
        let rows = Mutex::new(Vec::new());
        let result = bench.run(|row| rows.lock().unwrap().push(row.what.clone()));
        let rows = rows.into_inner().unwrap();
        eprintln!("{precision} on {}: supported {supported}, rows {rows:?}", on.name);
        if supported {
            assert!(result.is_ok(), "{precision}: {}", result.err().map(|e| e.to_string()).unwrap_or_default());
            let plain_half = format!("plain Burn {precision}");
            assert_eq!(rows, ["plain Burn fp32", plain_half.as_str(), "engine 0 units"]);
        } else {
            let error = result.err().map(|e| e.to_string()).unwrap_or_default();
            let says = format!("this {} device cannot compute in {precision}", on.name);
            assert!(error.contains("`--precision`") && error.contains(&says), "{precision}: {error:?}");
            assert!(rows.is_empty(), "{precision}: rows measured before the refusal: {rows:?}");
        }
    }
}
