//! Config parsing and resolution: real DeepSpeed files load, bad input names its key.

use super::*;
use crate::schedule::LrSchedule;
use zerotrain_zero::ZeroStage;

mod processes;

pub(super) fn parse(json: &str) -> Result<Config, ConfigError> {
    Config::parse(json, "test.json")
}

pub(super) fn plan(json: &str) -> Result<Plan, ConfigError> {
    parse(json)?.resolve(Overrides::default())
}

/// The keys of no-effect notes (`key (why)`).
fn keys_of(notes: &[String]) -> Vec<&str> {
    notes.iter().map(|n| n.split(' ').next().unwrap_or_default()).collect()
}

#[test]
fn hf_trainer_zero3_config_loads_with_autos_resolved_and_one_warning() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/hf_trainer_zero3.json");
    let plan =
        Config::from_file(path).unwrap().resolve(Overrides { world_size: Some(2), ..Overrides::default() }).unwrap();
    assert_eq!(plan.zero.stage, ZeroStage::Parameters);
    assert_eq!(
        (plan.batch.train_batch_size, plan.batch.micro_batch_per_rank, plan.batch.gradient_accumulation_steps),
        (2, 1, 1)
    );
    assert_eq!(
        plan.optim.optimizer,
        OptimizerPlan::Adam {
            lr: 1e-3,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: true,
            amsgrad: false
        }
    );
    assert_eq!(
        plan.optim.schedule,
        LrSchedule::WarmupLR {
            min_lr: 0.0,
            max_lr: 1e-3,
            warmup_num_steps: 1000,
            warmup_type: crate::schedule::WarmupType::Log
        }
    );
    assert_eq!(plan.zero.param_persistence_threshold, 100_000);
    assert_eq!(
        keys_of(&plan.notes.no_effect),
        [
            "zero_optimization.stage3_max_reuse_distance",
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
            // CPU ranks: host memory is where they compute, so "cpu" offload changes nothing.
            "zero_optimization.offload_optimizer.device",
            "zero_optimization.offload_optimizer.pin_memory",
            "zero_optimization.offload_param.device",
            "zero_optimization.offload_param.pin_memory",
            "zero_optimization.sub_group_size",
        ]
    );
    let warning = plan.warning().unwrap();
    assert!(warning.contains("zero_optimization.offload_param.device \"cpu\" (a CPU rank's"), "{warning}");
    assert_eq!((plan.zero.offload.optimizer.clone(), plan.zero.offload.param.clone()), (Tier::Host, Tier::Host));
    assert!(
        plan.notes.auto_resolved.iter().any(|a| a.starts_with("scheduler.params.warmup_max_lr = 0.001")),
        "{:?}",
        plan.notes.auto_resolved
    );
}

#[test]
fn llama_factory_zero2_config_loads() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/llama_factory_z2.json");
    let plan =
        Config::from_file(path).unwrap().resolve(Overrides { world_size: Some(4), ..Overrides::default() }).unwrap();
    assert_eq!(plan.zero.stage, ZeroStage::Gradients);
    assert_eq!(plan.zero.reduce_bucket_size, 500_000_000);
    assert_eq!(plan.batch.train_batch_size, 4);
    assert_eq!(plan.optim.gradient_clipping, 0.0);
    assert_eq!(
        keys_of(&plan.notes.no_effect),
        [
            "zero_allow_untested_optimizer",
            "zero_optimization.round_robin_gradients",
            "zero_optimization.allgather_bucket_size"
        ]
    );
}

#[test]
fn unknown_keys_name_the_path_and_the_closest_key() {
    let err = parse(r#"{"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5e8}}"#).unwrap_err();
    assert_eq!(
        err.to_string(),
        "test.json: unknown key `zero_optimization.reduce_bucket_sise` (did you mean `reduce_bucket_size`?)"
    );
    let err = parse(r#"{"train_batch_sise": 8}"#).unwrap_err();
    assert_eq!(err.to_string(), "test.json: unknown key `train_batch_sise` (did you mean `train_batch_size`?)");
    let err = parse(r#"{"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "beta": [0.9, 0.99]}}}"#).unwrap_err();
    assert!(
        matches!(&err, ConfigError::UnknownKey { key, suggestion: Some(s), .. } if key == "optimizer.params.beta" && s == "betas"),
        "{err}"
    );
    // Hugging Face's ZeRO-3 NVMe example nests the top-level `aio` section.
    let err = parse(r#"{"zero_optimization": {"stage": 3, "aio": {"block_size": 262144}}}"#).unwrap_err();
    assert_eq!(
        err.to_string(),
        "test.json: unknown key `zero_optimization.aio` (did you mean `aio` at the top level, not in \
         `zero_optimization`?)"
    );
    let err = parse(r#"{"completely_unrelated": 1}"#).unwrap_err();
    assert!(matches!(&err, ConfigError::UnknownKey { suggestion: None, .. }), "{err}");
}

#[test]
fn wrong_types_name_the_key_and_the_expected_type() {
    let err = parse(r#"{"train_batch_size": "many"}"#).unwrap_err();
    assert!(
        matches!(&err, ConfigError::InvalidValue { key, message, .. } if key == "train_batch_size" && message.contains("non-negative integer")),
        "{err}"
    );
    let err = parse(r#"{"zero_optimization": {"stage": "two"}}"#).unwrap_err();
    assert!(err.to_string().contains("`zero_optimization.stage`"), "{err}");
    let err = parse(r#"{"gradient_clipping": [1]}"#).unwrap_err();
    assert!(err.to_string().contains("`gradient_clipping`") && err.to_string().contains("f64"), "{err}");
    let err = parse("{\n  \"train_batch_size\": 8,\n}").unwrap_err();
    assert!(matches!(err, ConfigError::Json { line: 3, .. }), "{err}");
}

#[test]
fn floats_that_are_integers_are_counts_and_others_are_not() {
    let plan =
        plan(r#"{"train_batch_size": 8.0, "zero_optimization": {"stage": 1, "reduce_bucket_size": 2e8}}"#).unwrap();
    assert_eq!(plan.zero.reduce_bucket_size, 200_000_000);
    assert!(parse(r#"{"train_batch_size": 8.5}"#).is_err());
    assert!(parse(r#"{"train_batch_size": -8}"#).is_err());
}

#[test]
fn auto_that_nothing_can_supply_is_an_error_naming_the_key() {
    let json =
        r#"{"train_batch_size": 4, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}"#;
    let err = plan(json).unwrap_err();
    assert!(
        matches!(&err, ConfigError::UnresolvableAuto { key, .. } if key == "scheduler.params.total_num_steps"),
        "{err}"
    );
    let ok = parse(json).unwrap().resolve(Overrides { total_steps: Some(50), ..Overrides::default() }).unwrap();
    assert!(matches!(ok.optim.schedule, LrSchedule::WarmupDecayLR { total_num_steps: 50, .. }));
}

#[test]
fn legacy_and_refused_settings() {
    assert_eq!(
        plan(r#"{"train_batch_size": 1, "zero_optimization": true}"#).unwrap().zero.stage,
        ZeroStage::OptimizerStates
    );
    assert_eq!(
        plan(r#"{"train_batch_size": 1, "zero_optimization": {"stage": false}}"#).unwrap().zero.stage,
        ZeroStage::Disabled
    );
    let err = plan(r#"{"train_batch_size": 1, "zero_optimization": {"stage": 4}}"#).unwrap_err();
    assert!(err.to_string().contains("must be 0, 1, 2 or 3, got 4"), "{err}");
    let err = plan(r#"{"train_batch_size": 1, "fp16": {"enabled": true}, "bfloat16": {"enabled": true}}"#).unwrap_err();
    assert!(err.to_string().contains("fp16.enabled, bf16.enabled"), "{err}");
    let err = plan(r#"{"train_batch_size": 1, "optimizer": {"type": "Lamb"}}"#).unwrap_err();
    assert!(matches!(&err, ConfigError::Unsupported { key, .. } if key == "optimizer.type"), "{err}");
    let err =
        plan(r#"{"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}"#).unwrap_err();
    assert!(err.to_string().contains("optimizer.params.betas") && err.to_string().contains("SGD"), "{err}");
    let err = plan(r#"{"train_batch_size": 1, "zerotrain": {"backend": "carrier-pigeon"}}"#).unwrap_err();
    assert!(err.to_string().contains("zerotrain.backend"), "{err}");
}

#[test]
fn deepspeed_adam_is_adamw_unless_adam_w_mode_is_false() {
    let opt = |params: &str| {
        plan(&format!(r#"{{"train_batch_size": 1, "optimizer": {{"type": "Adam", "params": {params}}}}}"#))
            .unwrap()
            .optim
            .optimizer
    };
    assert!(matches!(opt("{}"), OptimizerPlan::Adam { decoupled_weight_decay: true, .. }));
    assert!(matches!(opt(r#"{"adam_w_mode": false}"#), OptimizerPlan::Adam { decoupled_weight_decay: false, .. }));
    let sgd = plan(r#"{"train_batch_size": 1, "optimizer": {"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}}"#)
        .unwrap()
        .optim
        .optimizer;
    assert_eq!(sgd, OptimizerPlan::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, nesterov: false, weight_decay: 0.0 });
}

#[test]
fn the_overflow_check_is_on_unless_turned_off() {
    assert!(plan(r#"{"train_batch_size": 1}"#).unwrap().precision.check_grad_overflow);
    assert!(
        !plan(r#"{"train_batch_size": 1, "zerotrain": {"check_grad_overflow": false}}"#)
            .unwrap()
            .precision
            .check_grad_overflow
    );
}

#[test]
fn world_size_comes_from_the_cli_then_the_config_then_one() {
    let c = parse(r#"{"train_micro_batch_size_per_gpu": 2, "zerotrain": {"world_size": 3}}"#).unwrap();
    assert_eq!(c.resolve(Overrides::default()).unwrap().world_size(), 3);
    assert_eq!(
        c.resolve(Overrides { world_size: Some(5), ..Overrides::default() }).unwrap().batch.train_batch_size,
        10
    );
    assert_eq!(plan(r#"{"train_batch_size": 2}"#).unwrap().world_size(), 1);
}

#[test]
fn fp16_resolves_to_deepspeeds_dynamic_scaler_with_its_defaults() {
    use zerotrain_precision::{AtMinimum, DynamicScaleConfig, Precision};
    let p = plan(r#"{"train_batch_size": 1, "fp16": {"enabled": true}}"#).unwrap();
    assert_eq!(
        (p.precision.compute, p.precision.comm, p.precision.grad_accum),
        (Precision::Fp16, Precision::Fp16, Precision::Fp16)
    );
    let expected = DynamicScaleConfig {
        initial_scale_power: 16,
        window: 1000,
        hysteresis: 2,
        consecutive_hysteresis: false,
        min_scale: 1.0,
        at_minimum: AtMinimum::Error,
    };
    assert_eq!(p.precision.loss_scale, Some(LossScalePlan::Dynamic(expected)));
    let p =
        plan(r#"{"train_batch_size": 1, "fp16": {"enabled": true, "loss_scale": 128, "auto_cast": true}}"#).unwrap();
    assert_eq!(p.precision.loss_scale, Some(LossScalePlan::Static { scale: 128.0 }));
    assert!(p.notes.no_effect[0].starts_with("fp16.auto_cast"), "{:?}", p.notes.no_effect);
    let p = plan(
        r#"{"train_batch_size": 1, "bf16": {"enabled": true}, "communication_data_type": "fp32",
            "data_types": {"grad_accum_dtype": "fp32"}}"#,
    )
    .unwrap();
    assert_eq!(
        (p.precision.compute, p.precision.comm, p.precision.grad_accum, p.precision.loss_scale),
        (Precision::Bf16, Precision::Fp32, Precision::Fp32, None)
    );
    let p = plan(r#"{"train_batch_size": 1, "fp16": {"enabled": true, "consecutive_hysteresis": true, "loss_scale_window": 50}, "zerotrain": {"loss_scale_at_minimum": "stay"}}"#).unwrap();
    assert!(
        matches!(p.precision.loss_scale, Some(LossScalePlan::Dynamic(c)) if c.consecutive_hysteresis && c.window == 50 && c.at_minimum == AtMinimum::Stay)
    );
}

#[test]
fn bad_precision_settings_name_their_key() {
    let cases = [
        (r#""fp16": {"enabled": true, "loss_scale": -1}"#, "fp16.loss_scale"),
        (r#""fp16": {"enabled": true, "loss_scale_window": 0}"#, "fp16.loss_scale_window"),
        (r#""fp16": {"enabled": true, "hysteresis": 0}"#, "fp16.hysteresis"),
        (r#""fp16": {"enabled": true, "initial_scale_power": 100}"#, "fp16.initial_scale_power"),
        (r#""fp16": {"enabled": true, "min_loss_scale": 0}"#, "fp16.min_loss_scale"),
        (r#""fp16": {"enabled": true, "fp16_master_weights_and_grads": true}"#, "fp16.fp16_master_weights_and_grads"),
        (
            r#""fp16": {"enabled": true}, "zerotrain": {"loss_scale_at_minimum": "shrug"}"#,
            "zerotrain.loss_scale_at_minimum",
        ),
        (r#""communication_data_type": "int8""#, "communication_data_type"),
        (r#""data_types": {"grad_accum_dtype": "fp8"}"#, "data_types.grad_accum_dtype"),
    ];
    for (json, key) in cases {
        let err = plan(&format!(r#"{{"train_batch_size": 1, {json}}}"#)).unwrap_err().to_string();
        assert!(err.contains(&format!("`{key}`")), "{json}: {err}");
    }
}

#[test]
fn a_config_file_larger_than_the_limit_is_refused_without_reading_it_all() {
    let dir = std::env::temp_dir().join(format!("zerotrain-config-size-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("huge.json");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(MAX_CONFIG_BYTES + 1).unwrap();
    let err = Config::from_file(&path).unwrap_err();
    assert!(matches!(&err, ConfigError::TooLarge { limit, .. } if *limit == MAX_CONFIG_BYTES), "{err}");
    // A device (or a symlink to one, or a FIFO, whose open would block) is refused unread.
    let err = Config::from_file("/dev/zero").unwrap_err();
    assert!(
        matches!(&err, ConfigError::Io { .. }) && err.to_string().contains("a device, not a regular file"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Regressions from hostile configs: an overflowing batch product panicked; absurd sizes
/// passed `config check` and aborted later on an allocation.
#[test]
fn huge_batch_sizes_and_world_sizes_are_errors_naming_the_key_not_panics() {
    let overflow = r#"{"train_micro_batch_size_per_gpu": 9223372036854775808, "gradient_accumulation_steps": 3}"#;
    let err = parse(overflow).unwrap().resolve(Overrides { world_size: Some(2), ..Overrides::default() });
    assert!(matches!(err, Err(ConfigError::BatchMismatch { .. })), "{err:?}");
    let err = plan(r#"{"train_micro_batch_size_per_gpu": 1099511627776}"#).unwrap_err().to_string();
    assert!(err.contains("`train_micro_batch_size_per_gpu`: 1099511627776 is more than the 1048576"), "{err}");
    let err = plan(r#"{"train_batch_size": 8, "gradient_accumulation_steps": 18446744073709551615}"#).unwrap_err();
    assert!(matches!(err, ConfigError::BatchMismatch { .. }), "{err}");
    let config = parse(r#"{"train_batch_size": 20000}"#).unwrap();
    let err = config.resolve(Overrides { world_size: Some(20000), ..Overrides::default() }).unwrap_err();
    assert!(err.to_string().contains("`--world-size`: 20000 thread ranks is more than the 1024"), "{err}");
    let err = plan(r#"{"train_batch_size": 4, "zerotrain": {"world_size": 4096}}"#).unwrap_err();
    assert!(err.to_string().contains("`zerotrain.world_size`"), "{err}");
    // mpirun's process count is not limited by the threads cap.
    let mpirun = Some(MpirunEnvironment { rank: 0, world_size: 2048 });
    assert!(
        parse(r#"{"train_micro_batch_size_per_gpu": 1}"#)
            .unwrap()
            .resolve(Overrides { mpirun, ..Overrides::default() })
            .is_ok()
    );
}

#[test]
fn collectives_default_to_auto_and_nccl_needs_cuda_ranks() {
    assert_eq!(plan(r#"{"train_batch_size": 1}"#).unwrap().runtime.collectives, Collectives::Auto);
    let with = |value: &str| plan(&format!(r#"{{"train_batch_size": 1, "zerotrain": {{"collectives": "{value}"}}}}"#));
    assert_eq!(with("host").unwrap().runtime.collectives, Collectives::Host);
    assert_eq!(with("auto").unwrap().runtime.collectives, Collectives::Auto);
    let err = with("gloo").unwrap_err();
    assert!(
        matches!(&err, ConfigError::InvalidValue { key, message, .. }
            if key == "zerotrain.collectives" && message.contains("available: auto, nccl, host")),
        "{err}"
    );
    // NCCL on CPU ranks is refused by name, whatever the build.
    let err = with("nccl").unwrap_err();
    assert!(
        matches!(&err, ConfigError::Unsupported { key, message }
            if key == "zerotrain.collectives" && message.contains("ranks compute on cpu")),
        "{err}"
    );
    let cuda = plan(r#"{"train_batch_size": 1, "zerotrain": {"device": "cuda", "collectives": "nccl"}}"#);
    match ComputeDevice::Cuda.is_built() {
        true => assert_eq!(cuda.unwrap().runtime.collectives, Collectives::Nccl),
        false => assert!(cuda.unwrap_err().to_string().contains("--features cuda")),
    }
}

#[test]
fn the_device_is_cpu_unless_set_and_a_device_this_build_lacks_names_its_feature() {
    assert_eq!(plan(r#"{"train_batch_size": 1}"#).unwrap().runtime.device, ComputeDevice::Cpu);
    let err = plan(r#"{"train_batch_size": 1, "zerotrain": {"device": "tpu"}}"#).unwrap_err();
    assert!(
        matches!(&err, ConfigError::InvalidValue { key, message, .. }
            if key == "zerotrain.device" && message.contains("available: cpu, wgpu, cuda")),
        "{err}"
    );
    for device in [ComputeDevice::Wgpu, ComputeDevice::Cuda] {
        let json = format!(r#"{{"train_batch_size": 1, "zerotrain": {{"device": "{}"}}}}"#, device.name());
        let from_file = plan(&json);
        let from_cli = parse(r#"{"train_batch_size": 1}"#)
            .unwrap()
            .resolve(Overrides { device: Some(device), ..Overrides::default() });
        if device.is_built() {
            assert_eq!(from_file.unwrap().runtime.device, device);
            assert_eq!(from_cli.unwrap().runtime.device, device);
        } else {
            let feature = format!("--features {}", device.name());
            for (err, key) in [(from_file.unwrap_err(), "zerotrain.device"), (from_cli.unwrap_err(), "--device")] {
                assert!(
                    matches!(&err, ConfigError::Unsupported { key: k, message } if k == key && message.contains(&feature)),
                    "{err}"
                );
            }
        }
    }
}
