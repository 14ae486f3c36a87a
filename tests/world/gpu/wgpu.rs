//! The GPU bodies on wgpu: any GPU Vulkan, Metal or DX12 reaches; lavapipe where there is
//! none, so these run on every machine (CI's included).

use burn::tensor::{Device, DeviceKind, DeviceType};

use super::Gpu;

const WGPU: Gpu = Gpu { name: "wgpu", device: || Device::wgpu(DeviceKind::DefaultDevice), keys: "", granule: None };

/// Whether wgpu runs on a software adapter only (lavapipe: CI's machines), whose kernels
/// round as the host's arithmetic does, so that the same operations in the same kernels
/// agree with the host bit for bit (two programs that Burn fuses into other kernels need
/// not: `device_collectives.rs`). A GPU's driver contracts multiply-adds and approximates
/// division (NVIDIA's Vulkan on an H200: 2 ulp of the operands apart, losses within 4e-6
/// relative), as CUDA does.
fn software_only() -> bool {
    !Device::enumerate(DeviceType::Wgpu).into_iter().any(|d| d.identity().is_some_and(|id| id.physical.is_some()))
}

#[test]
fn a_gpt_on_wgpu_matches_plain_burn_there_and_on_the_cpu_at_every_stage() {
    super::a_gpt_matches_plain_burn_there_and_on_the_cpu_at_every_stage(WGPU);
}

/// In f32 within 1e-5 of each result's largest value: the same arithmetic in another order
/// (blocks, the device's reductions), over sums of at most 46 terms.
#[test]
fn zerotrains_attention_and_loss_on_wgpu_equal_burns_unfused_ops_on_the_cpu() {
    super::kernels::nn_ops_on_the_device_equal_burns_unfused_ops_on_the_cpu(WGPU, burn::tensor::FloatDType::F32, 1e-5);
}

#[test]
fn packed_attention_on_wgpu_equals_the_masked_unfused_ops_on_the_cpu() {
    super::kernels::packed_attention_on_the_device_equals_the_masked_unfused_ops(WGPU);
}

#[test]
fn attention_on_wgpu_holds_what_grows_with_the_tokens_not_the_context() {
    super::kernels::attention_holds_on_the_device_what_grows_with_the_tokens_not_the_context(WGPU);
}

#[test]
fn a_long_sequence_attends_on_wgpu_without_its_whole_scores() {
    super::kernels::a_long_sequence_attends_without_its_whole_scores(WGPU, !software_only());
}

#[test]
fn train_on_wgpu_says_each_ranks_host_device_bytes() {
    super::commands::train_says_each_ranks_host_device_bytes(WGPU);
}

#[test]
fn a_lazy_model_starts_on_wgpu_as_on_the_cpu() {
    super::a_lazy_model_starts_the_same_on_the_device_as_on_the_cpu(WGPU);
}

#[test]
fn dropout_replays_under_recomputation_on_wgpu() {
    super::dropout_replays_under_recomputation_on_the_device(WGPU, software_only());
}

#[test]
fn ranks_compute_on_the_configured_device() {
    super::ranks_compute_on_the_configured_device(WGPU);
}

#[test]
fn half_precision_the_device_lacks_is_a_clear_error() {
    super::half_precision_the_device_lacks_is_a_clear_error(WGPU);
}

#[test]
fn bench_gpu_on_wgpu_in_half_precision_measures_every_row_or_refuses_before_the_first() {
    super::commands::bench_in_half_precision_measures_every_row_or_refuses_before_the_first(WGPU);
}

#[test]
fn generate_samples_on_wgpu_when_the_config_names_it() {
    super::commands::generate_samples_on_the_configured_device(WGPU);
}

#[test]
fn fp16_on_wgpu_trains_as_fp16_on_the_cpu() {
    super::fp16_trains_as_fp16_on_the_cpu(WGPU);
}

#[test]
fn model_states_on_the_device_fall_with_the_stage() {
    super::model_states_on_the_device_fall_with_the_stage(WGPU);
}

#[test]
fn cpu_offload_leaves_only_the_parameters_on_the_device() {
    super::cpu_offload_leaves_only_the_parameters_on_the_device(WGPU);
}

#[test]
fn host_device_copies_per_step_are_what_host_collectives_need() {
    super::host_device_copies_per_step_are_what_host_collectives_need(WGPU);
}

#[test]
fn wall_clock_breakdown_on_wgpu_waits_and_trains_the_same() {
    super::wall_clock_breakdown_waits_and_trains_the_same(WGPU, software_only());
}

#[test]
fn one_rank_with_states_on_wgpu_steps_there() {
    super::one_rank_with_states_on_the_device_steps_there(WGPU);
}

#[test]
fn the_device_adamw_on_wgpu_steps_as_the_host_adamw() {
    // Bit for bit on lavapipe; on a GPU, CUDA's bound.
    super::the_device_adamw_steps_as_the_host_adamw(WGPU, if software_only() { 0 } else { 8 });
}

#[test]
fn stage_3_device_gathers_on_wgpu_equal_host_gathers() {
    super::stage_3_device_gathers_equal_host_gathers(WGPU, software_only());
}

#[test]
fn a_step_failing_part_way_on_wgpu_leaves_the_rank_torn_until_a_load() {
    super::a_step_failing_part_way_on_the_device_leaves_the_rank_torn_until_a_load(WGPU);
}

#[test]
fn ranks_whose_collectives_read_device_memory_step_on_wgpu() {
    super::device_collectives::ranks_whose_collectives_read_device_memory_step_on_the_device(WGPU, software_only());
}

#[test]
fn a_mesh_over_device_collectives_keeps_its_activations_on_wgpu() {
    super::device_collectives::a_mesh_over_device_collectives_keeps_its_activations_on_the_device(
        WGPU,
        software_only(),
    );
}

#[test]
fn a_pipeline_over_device_collectives_passes_device_tensors_on_wgpu() {
    super::device_collectives::a_pipeline_over_device_collectives_passes_device_tensors(WGPU, software_only());
}

#[test]
fn a_large_units_norm_on_wgpu_counts_every_element() {
    super::large_units::a_large_units_norm_counts_every_element(WGPU);
}

#[test]
fn an_overflow_at_the_end_of_a_large_unit_on_wgpu_skips_the_step() {
    super::large_units::an_overflow_at_the_end_of_a_large_unit_skips_the_step(WGPU);
}

#[test]
fn long_reductions_on_wgpu_count_every_element() {
    super::large_units::long_reductions_count_every_element(WGPU);
}

#[test]
fn a_tensor_past_the_largest_wgpu_buffer_is_an_error_not_a_panic() {
    // lavapipe allocates at most 128 MiB at once; a GPU's adapter allows more.
    super::large_units::a_tensor_past_the_devices_largest_buffer_is_an_error_not_a_panic(WGPU, software_only());
}
