//! CUDA (`--features cuda`): what a CUDA build does on a machine without a driver (run
//! everywhere, CI's machines included), and the GPU bodies plus NCCL on a CUDA GPU (ignored
//! elsewhere: `bench/gpu/verify.sh` runs them with `--ignored`).

use std::ffi::CString;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use burn::tensor::Device;
use zerotrain::{Error, launch};
use zerotrain_zero::collective::nccl;
use zerotrain_zero::{Collective, ReduceOp, ThreadComm, ThreadWorld};

use super::{Gpu, on_device};
use crate::common::*;

/// Ranks on CUDA device 0: one rank runs its collectives through NCCL (`auto`), two thread
/// ranks share the GPU over the host backend (`auto` falls back: NCCL takes one rank per GPU).
const CUDA: Gpu = Gpu { name: "cuda", device: || Device::cuda(0), keys: "", granule: Some(512) };

/// Whether the dynamic loader finds `name`, asked directly (not through the code under test).
fn loads(name: &str) -> bool {
    let name = CString::new(name).unwrap();
    // SAFETY: dlopen of a valid C string; the handle is closed at once, nothing called.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
        true
    }
}

fn has_driver() -> bool {
    loads("libcuda.so.1") || loads("libcuda.so")
}

fn cuda_json(extra: &str) -> String {
    on_device(&recipe(0, 1, 1, 0.0), CUDA).replacen(r#""zerotrain": {"#, &format!(r#""zerotrain": {{{extra}"#), 1)
}

/// A CUDA build launched on a machine without a driver or GPU ends with one error naming
/// `zerotrain.device`, from the library and from the command, never a panic. Where a driver
/// is there, the same launch finds a CUDA device and its ranks compute on it.
#[test]
fn a_cuda_build_refuses_the_device_by_name_without_a_driver_and_finds_it_with_one() {
    let plan = plan(&cuda_json(""), 1);
    let outcome = launch(&plan, |ctx| Ok::<_, Error>(format!("{:?}", ctx.device())));
    if has_driver() {
        let devices = outcome.expect("a machine with the driver has a CUDA device");
        assert!(devices[0].to_lowercase().contains("cuda"), "{devices:?}");
        return;
    }
    let err = outcome.unwrap_err().to_string();
    assert!(err.contains(r#"zerotrain.device is "cuda""#), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["train", "--config", "configs/tiny.json", "--device", "cuda", "--steps", "1", "--out"])
        .arg(std::env::temp_dir().join(format!("zerotrain-cuda-{}", std::process::id())))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("zerotrain.device") && !stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

/// NCCL's availability names each missing library, checked against the dynamic loader
/// asked directly.
#[test]
fn nccl_availability_names_what_is_missing() {
    let (driver, nccl_loads) = (has_driver(), loads("libnccl.so"));
    match nccl::available() {
        Ok(()) => assert!(driver && nccl_loads, "NCCL said available without libcuda {driver} / libnccl {nccl_loads}"),
        Err(reason) => {
            assert!(!(driver && nccl_loads), "both load, yet: {reason}");
            assert_eq!(reason.contains("libcuda"), !driver, "{reason}");
            assert_eq!(reason.contains("libnccl"), !nccl_loads, "{reason}");
        }
    }
}

/// A machine with only `libnccl.so.2` (NVIDIA's wheel's name), which cudarc never loads, is
/// told where it is and how to make it load. A stand-in library with NCCL's soname and one
/// of its symbols plays the wheel's file; `zerotrain config check` reports it. Where
/// `libnccl.so` itself loads (a machine with NCCL's development files), there is no such
/// machine to make: the test checks only that NCCL is found, as its name says.
#[test]
fn without_libnccl_so_a_versioned_libnccl_is_found_and_its_link_named_else_nccl_loads() {
    if loads("libnccl.so") {
        // cudarc finds NCCL here; the hint is for machines where it cannot.
        assert!(nccl::available().is_ok() || !has_driver());
        return;
    }
    let dir = std::env::temp_dir().join(format!("zerotrain-fake-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("nccl.c");
    std::fs::write(&source, "int ncclGetVersion(int *v) { *v = 22800; return 0; }\n").unwrap();
    let lib = dir.join("libnccl.so.2");
    let cc = Command::new("cc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libnccl.so.2", "-o"])
        .arg(&lib)
        .arg(&source)
        .status()
        .expect("a C compiler (cc) builds the stand-in library");
    assert!(cc.success());
    let config = dir.join("ds_config.json");
    std::fs::write(&config, cuda_json(r#""collectives": "auto", "#)).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["config", "check"])
        .arg(&config)
        .env("LD_LIBRARY_PATH", &dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("collectives here")).unwrap_or_else(|| panic!("{stdout}"));
    let expected = format!("NCCL is at {}, but it is loaded as libnccl.so", lib.display());
    assert!(line.contains(&expected) && line.contains("ln -s") && line.contains("LD_LIBRARY_PATH"), "{line}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn a_gpt_on_cuda_matches_plain_burn_there_and_on_the_cpu_at_every_stage() {
    super::a_gpt_matches_plain_burn_there_and_on_the_cpu_at_every_stage(CUDA);
}

/// In f32 within 1e-5 of each result's largest value (as on wgpu; not yet run on a GPU),
/// and in bf16 within 3e-2: the matmuls' inputs rounded to bf16's 2^-8 (3.9e-3), over sums
/// of at most 46 terms.
#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn packed_attention_on_cuda_equals_the_masked_unfused_ops_on_the_cpu() {
    super::kernels::packed_attention_on_the_device_equals_the_masked_unfused_ops(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn zerotrains_attention_and_loss_on_cuda_equal_burns_unfused_ops_on_the_cpu() {
    use burn::tensor::FloatDType;
    super::kernels::nn_ops_on_the_device_equal_burns_unfused_ops_on_the_cpu(CUDA, FloatDType::F32, 1e-5);
    super::kernels::nn_ops_on_the_device_equal_burns_unfused_ops_on_the_cpu(CUDA, FloatDType::BF16, 3e-2);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn attention_on_cuda_holds_what_grows_with_the_tokens_not_the_context() {
    super::kernels::attention_holds_on_the_device_what_grows_with_the_tokens_not_the_context(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn a_long_sequence_attends_on_cuda_without_its_whole_scores() {
    super::kernels::a_long_sequence_attends_without_its_whole_scores(CUDA, true);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn train_on_cuda_says_each_ranks_host_device_bytes() {
    super::commands::train_says_each_ranks_host_device_bytes(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn a_lazy_model_starts_on_cuda_as_on_the_cpu() {
    super::a_lazy_model_starts_the_same_on_the_device_as_on_the_cpu(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn dropout_replays_under_recomputation_on_cuda() {
    super::dropout_replays_under_recomputation_on_the_device(CUDA, false);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn ranks_compute_on_the_configured_cuda_device() {
    super::ranks_compute_on_the_configured_device(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn half_precision_cuda_lacks_is_a_clear_error() {
    super::half_precision_the_device_lacks_is_a_clear_error(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn bench_gpu_on_cuda_in_half_precision_measures_every_row_or_refuses_before_the_first() {
    super::commands::bench_in_half_precision_measures_every_row_or_refuses_before_the_first(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn generate_samples_on_cuda_when_the_config_names_it() {
    super::commands::generate_samples_on_the_configured_device(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn fp16_on_cuda_trains_as_fp16_on_the_cpu() {
    super::fp16_trains_as_fp16_on_the_cpu(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn model_states_on_cuda_fall_with_the_stage() {
    super::model_states_on_the_device_fall_with_the_stage(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn cpu_offload_leaves_only_the_parameters_on_cuda() {
    super::cpu_offload_leaves_only_the_parameters_on_the_device(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn host_device_copies_per_step_on_cuda_are_what_host_collectives_need() {
    super::host_device_copies_per_step_are_what_host_collectives_need(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn wall_clock_breakdown_on_cuda_waits_and_trains_the_same() {
    super::wall_clock_breakdown_waits_and_trains_the_same(CUDA, false);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn a_large_units_norm_on_cuda_counts_every_element() {
    super::large_units::a_large_units_norm_counts_every_element(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn an_overflow_at_the_end_of_a_large_unit_on_cuda_skips_the_step() {
    super::large_units::an_overflow_at_the_end_of_a_large_unit_skips_the_step(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn long_reductions_on_cuda_count_every_element() {
    super::large_units::long_reductions_count_every_element(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn one_rank_with_states_on_cuda_steps_there() {
    super::one_rank_with_states_on_the_device_steps_there(CUDA);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn the_device_adamw_on_cuda_steps_as_the_host_adamw() {
    // cubecl compiles CUDA kernels with fast math (division and square root within 2 ulp
    // each) and contracted multiply-adds: a few ulp of the update.
    super::the_device_adamw_steps_as_the_host_adamw(CUDA, 8);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn stage_3_device_gathers_on_cuda_equal_host_gathers() {
    // Fast-math AdamW on the device: not bit for bit with the host's.
    super::stage_3_device_gathers_equal_host_gathers(CUDA, false);
}

#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn a_step_failing_part_way_on_cuda_leaves_the_rank_torn_until_a_load() {
    super::a_step_failing_part_way_on_the_device_leaves_the_rank_torn_until_a_load(CUDA);
}

/// `auto` runs one rank per GPU through NCCL, silently; two ranks sharing the one GPU fall
/// back to the host backend with a notice saying why; `nccl` there is an error naming the key.
#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn auto_takes_nccl_for_one_rank_per_gpu_and_the_host_backend_for_ranks_sharing_one() {
    let gpus = Device::enumerate(burn::tensor::DeviceType::Cuda).len();
    let notices = |world: usize, extra: &str| {
        launch(&plan(&cuda_json(extra), world), |ctx| Ok::<_, Error>(ctx.notices().to_vec()))
    };
    assert_eq!(notices(1, "").unwrap(), vec![Vec::<String>::new()]);
    let shared = gpus + 1;
    let fallen = notices(shared, "").unwrap();
    assert!(fallen[0][0].contains(&format!("{shared} ranks share")), "{fallen:?}");
    let err = notices(shared, r#""collectives": "nccl", "#).unwrap_err().to_string();
    assert!(err.contains(r#"zerotrain.collectives is "nccl""#), "{err}");
}

/// At world size 1: the threads backend (the reference), and an NCCL communicator on GPU 0
/// with the host communicator it was made over (whose counts its own include).
fn nccl_beside_the_host_backend() -> (ThreadComm, Arc<ThreadComm>, nccl::NcclComm) {
    let timeout = Duration::from_secs(60);
    let reference = ThreadWorld::new(1, timeout).communicator(0);
    let nccl_host = Arc::new(ThreadWorld::new(1, timeout).communicator(0));
    let comm = nccl::NcclComm::new(Arc::clone(&nccl_host) as Arc<dyn Collective>, 0, timeout).unwrap();
    (reference, nccl_host, comm)
}

/// NCCL's collectives at world size 1 give the host backend's results bit for bit, in every
/// dtype and op the engine uses (the all-to-all too), and count the same bytes.
#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn nccl_equals_the_host_backend_bit_for_bit_at_world_size_one() {
    use zerotrain_precision::{FlatBuf, Precision};
    let (reference, nccl_host, comm) = nccl_beside_the_host_backend();
    let values: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
    for dtype in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        let both = |f: &dyn Fn(&dyn Collective, &mut FlatBuf) -> Result<(), zerotrain_zero::ZeroError>| {
            let (mut a, mut b) = (FlatBuf::from_f32(dtype, &values), FlatBuf::from_f32(dtype, &values));
            f(&reference, &mut a).unwrap();
            f(&comm, &mut b).unwrap();
            assert_eq!(a, b, "{dtype:?}");
        };
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            both(&|c, buf| c.all_reduce(buf.as_mut(), op));
        }
        both(&|c, buf| c.broadcast(buf.as_mut(), 0));
        both(&|c, buf| {
            let input = buf.clone();
            c.reduce_scatter(input.as_ref(), buf.as_mut(), ReduceOp::Sum)
        });
        both(&|c, buf| {
            let input = buf.clone();
            c.all_gather(input.as_ref(), buf.as_mut())
        });
        // The all-to-all, counts then payloads: one grouped send and receive to itself.
        both(&|c, buf| {
            let (got, counts) = zerotrain_zero::exchange(c, buf.as_ref(), &[buf.len()])?;
            assert_eq!(counts, [buf.len()]);
            *buf = got;
            Ok(())
        });
    }
    // The NCCL communicator's counts include its host communicator's (the id's broadcast).
    let (a, b) = (reference.stats(), comm.stats().since(&nccl_host.stats()));
    let ops = |s: zerotrain_zero::CommStats| (s.all_reduce, s.reduce_scatter, s.all_gather, s.broadcast);
    assert_eq!(ops(a), ops(b));
}

/// Collectives on CUDA tensors (`zerotrain::engine::on_device`) through NCCL at world size 1 give the
/// host backend's results bit for bit in every dtype and op, read a tensor that starts inside
/// a bigger one (its address is not its buffer's start where Burn keeps the view), leave
/// their input as it was, and count the host backend's bytes.
#[test]
#[ignore = "needs a CUDA GPU: bench/gpu/verify.sh"]
fn collectives_on_cuda_tensors_equal_the_host_backend_bit_for_bit_at_world_size_one() {
    use burn::tensor::{DType, Tensor, TensorData};
    use zerotrain::engine::on_device;
    use zerotrain_precision::{FlatBuf, Precision};
    let (reference, nccl_host, comm) = nccl_beside_the_host_backend();
    assert!(comm.reads_device_memory());
    let (n, skip) = (1000, 24);
    let values: Vec<f32> = (0..n + skip).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
    let bits = |t: Tensor<1>| -> Vec<u32> {
        let values = t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
        values.iter().map(|v| v.to_bits()).collect()
    };
    let flat_bits = |f: &FlatBuf| -> Vec<u32> { f.clone().into_f32().iter().map(|v| v.to_bits()).collect() };
    for (dtype, burn_dtype) in
        [(Precision::Fp32, DType::F32), (Precision::Fp16, DType::F16), (Precision::Bf16, DType::BF16)]
    {
        let whole =
            Tensor::<1>::from_data(TensorData::new(values.clone(), [n + skip]), &Device::cuda(0)).cast(burn_dtype);
        let tensor = whole.clone().narrow(0, skip, n);
        let input = FlatBuf::from_f32(dtype, &values[skip..]);
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let mut expected = input.clone();
            reference.all_reduce(expected.as_mut(), op).unwrap();
            let got = on_device::all_reduce(&comm, &tensor, op).unwrap();
            assert_eq!(bits(got), flat_bits(&expected), "all_reduce {op:?} {dtype:?}");
        }
        let mut expected = FlatBuf::zeros(dtype, n);
        reference.reduce_scatter(input.as_ref(), expected.as_mut(), ReduceOp::Sum).unwrap();
        let got = on_device::reduce_scatter(&comm, &tensor, ReduceOp::Sum).unwrap();
        assert_eq!(bits(got), flat_bits(&expected), "reduce_scatter {dtype:?}");
        let mut expected = FlatBuf::zeros(dtype, n);
        reference.all_gather(input.as_ref(), expected.as_mut()).unwrap();
        let got = on_device::all_gather(&comm, &tensor).unwrap();
        assert_eq!(bits(got), flat_bits(&expected), "all_gather {dtype:?}");
        let mut expected = FlatBuf::zeros(dtype, n);
        reference.all_to_all(input.as_ref(), &[n], expected.as_mut(), &[n]).unwrap();
        let got = on_device::all_to_all(&comm, &tensor).unwrap();
        assert_eq!(bits(got), flat_bits(&expected), "all_to_all {dtype:?}");
        assert_eq!(bits(tensor), flat_bits(&input), "the input was written");
        assert_eq!(bits(whole), flat_bits(&FlatBuf::from_f32(dtype, &values)), "the tensor around it was written");
    }
    let (a, b) = (reference.stats(), comm.stats().since(&nccl_host.stats()));
    let ops = |s: zerotrain_zero::CommStats| (s.all_reduce, s.reduce_scatter, s.all_gather, s.send, s.recv);
    assert_eq!(ops(a), ops(b));
}
