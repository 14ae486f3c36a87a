//! The GPU bodies on wgpu: any GPU Vulkan, Metal or DX12 reaches; lavapipe where there is
//! none, so these run on every machine (CI's included).

use burn::tensor::{Device, DeviceKind};

use super::Gpu;

const WGPU: Gpu = Gpu { name: "wgpu", device: || Device::wgpu(DeviceKind::DefaultDevice), keys: "", granule: None };

#[test]
fn a_gpt_on_wgpu_matches_plain_burn_there_and_on_the_cpu_at_every_stage() {
    super::a_gpt_matches_plain_burn_there_and_on_the_cpu_at_every_stage(WGPU);
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
fn one_rank_with_states_on_wgpu_steps_there() {
    super::one_rank_with_states_on_the_device_steps_there(WGPU);
}

#[test]
fn the_device_adamw_on_wgpu_steps_as_the_host_adamw() {
    // Bit for bit on lavapipe.
    super::the_device_adamw_steps_as_the_host_adamw(WGPU, 0);
}

#[test]
fn stage_3_device_gathers_on_wgpu_equal_host_gathers() {
    super::stage_3_device_gathers_equal_host_gathers(WGPU, true);
}

#[test]
fn a_step_failing_part_way_on_wgpu_leaves_the_rank_torn_until_a_load() {
    super::a_step_failing_part_way_on_the_device_leaves_the_rank_torn_until_a_load(WGPU);
}
