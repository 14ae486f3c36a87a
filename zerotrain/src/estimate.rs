//! Model-state memory per rank before training: the ZeRO paper's formulas and DeepSpeed's
//! own estimator, side by side (`zerotrain estimate`).

use serde::Serialize;
use zerotrain_zero::ZeroStage;
use zerotrain_zero::memory::{BytesPerParam, model_state_bytes};

/// One stage's per-rank bytes under the ZeRO paper's mixed-precision Adam (K = 12).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PaperRow {
    /// The stage.
    pub stage: u8,
    /// 16-bit parameters.
    pub params: u64,
    /// 16-bit gradients.
    pub grads: u64,
    /// fp32 master weights and Adam's two moments.
    pub optimizer: u64,
    /// All of it.
    pub total: u64,
}

/// The paper's per-rank model states for `params` over `ranks`, stages 0-3.
pub fn paper(params: u64, ranks: u64) -> Vec<PaperRow> {
    let shard = params.div_ceil(ranks.max(1));
    ZeroStage::ALL
        .iter()
        .map(|&stage| {
            let b = model_state_bytes(stage, params, shard, BytesPerParam::MIXED_ADAM);
            PaperRow {
                stage: stage.index(),
                params: b.params,
                grads: b.grads,
                optimizer: b.master + b.optimizer,
                total: b.total(),
            }
        })
        .collect()
}

/// DeepSpeed's `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/
/// stage_1_and_2.py), reproduced: (per-CPU bytes, per-GPU bytes).
///
/// Without offload each GPU holds 2Ψ (16-bit parameters) + 18Ψ/N (16-bit and 32-bit
/// gradients, 32-bit parameters, Adam's moments); with optimizer offload 2Ψ, and the CPU
/// holds the rest, times `additional_buffer_factor` (1.5 in DeepSpeed).
pub fn deepspeed_zero2(
    params: u64,
    gpus_per_node: u64,
    nodes: u64,
    cpu_offload: bool,
    buffer_factor: f64,
) -> (u64, u64) {
    let gpus = gpus_per_node * nodes;
    let p = params as f64;
    if cpu_offload {
        let cpu = p * (4 * gpus).max(16) as f64 * buffer_factor;
        (cpu as u64, 2 * params)
    } else {
        let cpu = p * 4.0 * gpus_per_node as f64 * buffer_factor;
        (cpu as u64, 2 * params + (18.0 * p / gpus as f64) as u64)
    }
}

/// What DeepSpeed's ZeRO-3 estimator is asked: which states are offloaded to the CPU, and
/// whether the model is built already partitioned (`zero.Init`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Zero3Options {
    /// `offload_optimizer: cpu`.
    pub offload_optimizer: bool,
    /// `offload_param: cpu` (DeepSpeed counts it only with `offload_optimizer`).
    pub offload_param: bool,
    /// The model is built partitioned (`zero.Init`). zerotrain builds whole models, so its
    /// CPU memory is the `false` figure.
    pub zero_init: bool,
}

/// DeepSpeed's `estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py),
/// reproduced in its own arithmetic (Python's int and float steps in order): (per-CPU bytes,
/// per-GPU bytes) for `params` parameters whose largest layer has `largest_layer` of them.
///
/// Without offload each GPU holds the largest layer's fp32 copy plus 18Ψ/N; with optimizer
/// offload the largest layer plus 2Ψ/N, the CPU 16Ψ per node's share; with parameter offload
/// too, the GPU holds only the largest layer and the CPU 18Ψ per node's share. Without
/// `zero_init` every process first holds the whole fp32 model (4Ψ per GPU of the node).
pub fn deepspeed_zero3(
    params: u64,
    largest_layer: u64,
    gpus_per_node: u64,
    nodes: u64,
    o: Zero3Options,
    buffer_factor: f64,
) -> (u64, u64) {
    let gpus = gpus_per_node * nodes;
    let gpus_factor = 1.0 / nodes as f64;
    let largest_memory = 4 * largest_layer;
    // Python's `total_params * max(4 * num_gpus_per_node, k * gpus_factor)`: an int product
    // when the int wins the max (it comes first, so a tie picks it), a float one otherwise.
    // Python's ints do not overflow: the int products here are taken in u128.
    let (p, l, g) = (u128::from(params), u128::from(largest_layer), u128::from(gpus_per_node));
    let whole_or_share = |k: f64| -> f64 {
        let per_gpu = (4 * gpus_per_node) as f64;
        if per_gpu >= k * gpus_factor { (p * 4 * g) as f64 } else { params as f64 * (k * gpus_factor) }
    };
    let (cpu, gpu) = match (o.offload_optimizer, o.offload_param) {
        (true, true) => {
            let cpu = if o.zero_init { (p * 18) as f64 * gpus_factor } else { whole_or_share(18.0) };
            (cpu * buffer_factor, largest_memory)
        }
        (true, false) => {
            let cpu = if o.zero_init { (p * 16) as f64 * gpus_factor } else { whole_or_share(16.0) };
            (cpu * buffer_factor, largest_memory + ((2 * p) as f64 / gpus as f64) as u64)
        }
        (false, _) => {
            let cpu = if o.zero_init { l * 4 * g } else { p * 4 * g };
            (cpu as f64 * buffer_factor, largest_memory + ((18 * p) as f64 / gpus as f64) as u64)
        }
    };
    (cpu as u64, gpu)
}

/// Where one rank's model states live between steps, by tier, for a plan and a model of
/// `params` trainable parameters (`zerotrain config check`): bytes on the rank's device,
/// in host memory and in NVMe swap files. On a CPU rank the device is host memory, so
/// everything not on NVMe counts as host memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// Bytes on the rank's device (0 on a CPU rank).
    pub device: u64,
    /// Bytes in host memory.
    pub host: u64,
    /// Bytes in swap files.
    pub nvme: u64,
}

impl Placement {
    /// Counts `bytes` in `tier` (a CPU rank's device being host memory).
    fn put(&mut self, tier: &crate::config::Tier, cpu: bool, bytes: u64) {
        use crate::config::Tier;
        match tier {
            Tier::Nvme(_) => self.nvme += bytes,
            Tier::Host => self.host += bytes,
            Tier::Device if cpu => self.host += bytes,
            Tier::Device => self.device += bytes,
        }
    }
}

/// [`Placement`] by the rules the engine follows (padding ignored): parameters in the
/// compute dtype (stage 3: only the shard, which is the fp32 master in fp32 training, and
/// a compute-dtype copy when the optimizer is offloaded), gradients in the accumulation
/// dtype, fp32 masters in mixed precision, and the optimizer's moments (Adam 2, AMSGrad 3,
/// SGD with momentum 1), each where the plan's tiers put it. On a tensor-parallel mesh a
/// rank holds `1/tp` of the model (the few parameters every tensor rank holds whole, norms
/// and biases, counted at `1/tp` too: a slight underestimate) and shards it over `dp x sp`
/// (within its replica group, with `local_sgd` groups in one job).
pub fn placement(plan: &crate::Plan, params: u64) -> Placement {
    use crate::config::{ComputeDevice, OptimizerPlan, Tier};
    let (zero, precision) = (&plan.zero, &plan.precision);
    let params = params.div_ceil(plan.mesh.tp as u64);
    let shard = params.div_ceil(plan.sharding_size().max(1) as u64);
    let pick = |sharded: bool| if sharded { shard } else { params };
    let compute = precision.compute.bytes_per_elem() as u64;
    let fp32 = compute == 4;
    let moments = match plan.optim.optimizer {
        OptimizerPlan::Adam { amsgrad, .. } => 2 + u64::from(amsgrad),
        OptimizerPlan::Sgd { momentum, .. } => u64::from(momentum > 0.0),
    };
    let stage = zero.stage;
    let optimizer_elems = pick(stage.shards_optimizer_states());
    let swapped = zero.offload.optimizer.nvme_path().is_some();
    // Masters are separate in mixed precision, and at stage 3 in fp32 unless swapped (then
    // the parameter shard is the master).
    let master = if !fp32 || (stage.shards_parameters() && !swapped) { 4 * optimizer_elems } else { 0 };
    let moments = 4 * moments * optimizer_elems;
    let mut out = Placement::default();
    let cpu = plan.runtime.device == ComputeDevice::Cpu;
    let mut put = |tier: &Tier, bytes: u64| out.put(tier, cpu, bytes);
    put(&zero.offload.optimizer, master + moments);
    put(&Tier::Device, precision.grad_accum.bytes_per_elem() as u64 * pick(stage.shards_gradients()));
    if !stage.shards_parameters() {
        put(&Tier::Device, compute * params);
    } else if swapped || zero.offload.param.nvme_path().is_some() {
        // The shard as the gather sends it, in the compute dtype (in memory or in a file).
        let cached = zero.offload.max_in_cpu.min(shard);
        match &zero.offload.param {
            Tier::Nvme(_) => {
                put(&Tier::Host, compute * cached);
                put(&zero.offload.param, compute * (shard - cached));
            }
            tier => put(tier, compute * shard),
        }
    }
    out
}

/// A frozen base's parameters (a LoRA run's), for [`frozen_placement`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FrozenSizes {
    /// Elements of each matrix of the layers (what `zerotrain.lora.quantize` stores in NF4).
    pub layer_matrices: Vec<u64>,
    /// Elements of the rest: embeddings, the head, norms, biases.
    pub rest: u64,
}

impl FrozenSizes {
    /// All the frozen parameters.
    pub fn total(&self) -> u64 {
        self.layer_matrices.iter().sum::<u64>() + self.rest
    }
}

/// Where one rank holds a frozen base of `sizes` beside `trained` trainable parameters, by
/// the rules the engine follows (padding ignored): whole in the compute dtype below stage
/// 3, in the parameters' place; at stage 3 its shard, in `offload_param`'s tier (on NVMe
/// beyond what `max_in_cpu` leaves after the trained shard), the layers' matrices over
/// `stage3_param_persistence_threshold` in NF4 with `zerotrain.lora.quantize` (half a byte
/// a value and four a block of 64, in whole words: eight values to a word).
pub fn frozen_placement(plan: &crate::Plan, trained: u64, sizes: &FrozenSizes) -> Placement {
    use crate::config::{ComputeDevice, Tier};
    let zero = &plan.zero;
    let compute = plan.precision.compute.bytes_per_elem() as u64;
    let quantized = zero.stage.shards_parameters() && plan.lora.as_ref().is_some_and(|l| l.quantize.is_some());
    let matrix = |n: u64| match quantized && n > zero.param_persistence_threshold {
        true => 4 * (n.div_ceil(8) + n.div_ceil(64)),
        false => compute * n,
    };
    let bytes = (sizes.layer_matrices.iter().map(|&n| matrix(n)).sum::<u64>() + compute * sizes.rest)
        .div_ceil(plan.mesh.tp as u64);
    let mut out = Placement::default();
    let cpu = plan.runtime.device == ComputeDevice::Cpu;
    let mut put = |tier: &Tier, bytes: u64| out.put(tier, cpu, bytes);
    if !zero.stage.shards_parameters() {
        put(&Tier::Device, bytes);
        return out;
    }
    let ranks = plan.sharding_size().max(1) as u64;
    let shard = bytes.div_ceil(ranks);
    match &zero.offload.param {
        Tier::Nvme(_) => {
            // `max_in_cpu` counts elements, the trained shard's first.
            let trained_shard = trained.div_ceil(plan.mesh.tp as u64).div_ceil(ranks);
            let elems = sizes.total().div_ceil(plan.mesh.tp as u64).div_ceil(ranks).max(1);
            let room = zero.offload.max_in_cpu.saturating_sub(trained_shard).min(elems);
            let cached = (shard as u128 * room as u128 / elems as u128) as u64;
            put(&Tier::Host, cached);
            put(&zero.offload.param, shard - cached);
        }
        tier => put(tier, shard),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reproduces_the_papers_table_1_row() {
        let gb: Vec<f64> = paper(7_500_000_000, 64).iter().map(|r| r.total as f64 / 1e9).collect();
        for (got, want) in gb.iter().zip([120.0, 31.4, 16.6, 1.88]) {
            assert!((got - want).abs() <= 0.005 * want, "{gb:?}");
        }
    }

    /// Against DeepSpeed 0.19.8's own function, run by `bench/reference/deepspeed_traces.py`.
    #[test]
    fn reproduces_deepspeeds_zero2_estimator() {
        let text = include_str!("../../bench/reference/deepspeed_traces.json");
        let all: serde_json::Value = serde_json::from_str(text).expect("the committed traces parse");
        let cases = all["zero2_estimates"].as_array().expect("estimates");
        assert!(cases.len() >= 6);
        for case in cases {
            let n = |key: &str| case[key].as_u64().unwrap();
            let got = deepspeed_zero2(n("params"), n("gpus_per_node"), n("nodes"), case["offload"] == true, 1.5);
            assert_eq!(got, (n("cpu_bytes"), n("gpu_bytes")), "{case}");
        }
    }

    /// Against DeepSpeed 0.19.8's own ZeRO-3 estimator, every offload and `zero_init`
    /// combination (`bench/reference/deepspeed_traces.py`).
    #[test]
    fn reproduces_deepspeeds_zero3_estimator() {
        let text = include_str!("../../bench/reference/deepspeed_traces.json");
        let all: serde_json::Value = serde_json::from_str(text).expect("the committed traces parse");
        let cases = all["zero3_estimates"].as_array().expect("estimates");
        assert!(cases.len() >= 18);
        for case in cases {
            let n = |key: &str| case[key].as_u64().unwrap();
            let options = Zero3Options {
                offload_optimizer: case["offload_optimizer"] == true,
                offload_param: case["offload_param"] == true,
                zero_init: case["zero_init"] == true,
            };
            let got =
                deepspeed_zero3(n("params"), n("largest_layer_params"), n("gpus_per_node"), n("nodes"), options, 1.5);
            assert_eq!(got, (n("cpu_bytes"), n("gpu_bytes")), "{case}");
        }
    }

    /// Per-tier bytes written out by hand for Ψ = 1000 over 2 ranks (a 500-element shard).
    #[test]
    fn placement_puts_each_state_in_its_tier() {
        let plan = |zero: &str, extra: &str| {
            crate::Config::parse(
                &format!(r#"{{"train_batch_size": 2, "zero_optimization": {{{zero}}}, {extra} "zerotrain": {{"world_size": 2}}}}"#),
                "t",
            )
            .unwrap()
            .resolve(crate::Overrides::default())
            .unwrap()
        };
        let nvme = r#""offload_optimizer": {"device": "nvme", "nvme_path": "/x"}"#;
        let param = r#""offload_param": {"device": "nvme", "nvme_path": "/y", "max_in_cpu": 100}"#;
        // bf16 stage 3, both tiers on NVMe: grads 2 x 500 and the cached 100 shard
        // elements x 2 in memory; masters 4 x 500, moments 8 x 500, the rest of the shard
        // 2 x 400 (bf16) on NVMe.
        let p = placement(&plan(&format!(r#""stage": 3, {nvme}, {param}"#), r#""bf16": {"enabled": true},"#), 1000);
        assert_eq!(p, Placement { device: 0, host: 1000 + 200, nvme: 2000 + 4000 + 800 });
        // fp32 stage 2, optimizer on NVMe: the model's 4 x 1000 parameters are the masters;
        // grads 4 x 500; moments 8 x 500 on NVMe.
        let p = placement(&plan(&format!(r#""stage": 2, {nvme}"#), ""), 1000);
        assert_eq!(p, Placement { device: 0, host: 4000 + 2000, nvme: 4000 });
        // No offload, fp32 stage 3: master shard 4 x 500, moments 8 x 500, grads 4 x 500.
        let p = placement(&plan(r#""stage": 3"#, ""), 1000);
        assert_eq!(p, Placement { device: 0, host: 2000 + 4000 + 2000, nvme: 0 });
        // At tp 2 (4 ranks: dp 2) a rank holds 500 of the 1000 and shards them over 2: the
        // same bytes as 500 parameters over 2 data-parallel ranks, half of the above.
        let mesh = |zero: &str| {
            let json = format!(
                r#"{{"train_batch_size": 2, "zero_optimization": {{{zero}}}, "tensor_parallel": {{"autotp_size": 2}},
                    "zerotrain": {{"world_size": 4}}}}"#
            );
            crate::Config::parse(&json, "t").unwrap().resolve(crate::Overrides::default()).unwrap()
        };
        let p = placement(&mesh(r#""stage": 3"#), 1000);
        assert_eq!(p, Placement { device: 0, host: 1000 + 2000 + 1000, nvme: 0 });
        // A rank shards over its replica group's ranks (2 groups of 2 in a job of 4: the same
        // bytes as one job of 2) and over its sequence ranks (sp 2 of 4 ranks: dp 2, 4 shards).
        let at = |extra: &str, world: usize| {
            let json = format!(r#"{{"train_batch_size": 4, "zero_optimization": {{"stage": 3}}{extra}}}"#);
            let overrides = crate::Overrides { world_size: Some(world), ..Default::default() };
            crate::Config::parse(&json, "t").unwrap().resolve(overrides).unwrap()
        };
        let groups = at(r#", "local_sgd": {"groups": 2}"#, 4);
        assert_eq!((groups.sharding_size(), placement(&groups, 1000)), (2, placement(&at("", 2), 1000)));
        let sequence = at(r#", "zerotrain": {"mesh": {"sp": 2}}"#, 4);
        assert_eq!((sequence.data_parallel_size(), sequence.sharding_size()), (2, 4));
        assert_eq!(placement(&sequence, 1000), placement(&at("", 4), 1000));
        assert!(groups.to_string().contains("gradients: 1/2 shard"), "{groups}");
        let meshes = at(r#", "local_sgd": {"groups": 2}, "tensor_parallel": {"autotp_size": 2}"#, 8);
        let shown = meshes.to_string();
        assert!(shown.contains("mesh                dp 2 x sp 1 x tp 2 (a group's rank r"), "{shown}");
    }
}
