//! Where model states live between uses: `zero_optimization.offload_optimizer`,
//! `offload_param`, `sub_group_size` and the `aio` section, resolved into an
//! [`OffloadPlan`].
//!
//! The meanings are DeepSpeed's. Two rules differ, each for a reason: NVMe offload of the
//! optimizer is allowed at stages 1-3, not only 3 (a rank's optimizer range is a flat shard
//! at every sharded stage, so the same tiles stream from disk), and on a CPU rank
//! `device: "cpu"` is accepted and noted as changing nothing (the states already live in
//! host memory). Keys a path cannot use are accepted and listed by `config check`.

use std::path::PathBuf;

use serde::Serialize;
use zerotrain_zero::ZeroStage;

use super::autos::{Autos, invalid};
use super::raw::{AioConfig, OffloadOptimizerConfig, OffloadParamConfig};
use super::value::{AutoOr, Count};
use super::{ComputeDevice, Config, ConfigError};

/// DeepSpeed's default `sub_group_size` in its ZeRO-Infinity tutorial (its code's default,
/// 1e12, would make one tile of any model).
const DEFAULT_SUB_GROUP_ELEMS: u64 = 1_000_000_000;
/// Tiles start at multiples of this many elements, so every tile's bytes in a swap file
/// start on a 4 KiB boundary (direct I/O's alignment).
pub const TILE_ALIGN_ELEMS: u64 = 1024;
/// Most I/O requests in flight (`thread_count x queue_depth` threads are started).
const MAX_IO_REQUESTS: u64 = 64;

/// Where one kind of model state lives between uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Where the rank computes (`device: "none"`).
    Device,
    /// Host memory (`device: "cpu"`).
    Host,
    /// Files in a per-run, per-rank folder under this path (`device: "nvme"`).
    Nvme(PathBuf),
}

impl Tier {
    /// The NVMe folder, if this tier is NVMe.
    pub fn nvme_path(&self) -> Option<&std::path::Path> {
        match self {
            Self::Nvme(path) => Some(path),
            _ => None,
        }
    }

    /// Whether the states are in host memory on a rank computing on `device` (on the CPU,
    /// device memory is host memory).
    pub fn is_host(&self, device: ComputeDevice) -> bool {
        matches!(self, Self::Host) || (matches!(self, Self::Device) && device == ComputeDevice::Cpu)
    }
}

/// How the NVMe tiers do their I/O (`aio`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AioPlan {
    /// Bytes per read or write request (a multiple of 4096).
    pub block_size: u64,
    /// Requests in flight: `thread_count x queue_depth`, each on its own I/O thread.
    pub requests_in_flight: usize,
}

/// The offload tiers (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OffloadPlan {
    /// Where fp32 master weights and optimizer state live and are stepped.
    pub optimizer: Tier,
    /// Stage 3: where each unit's parameter shard (compute dtype) lives between uses.
    pub param: Tier,
    /// Elements per optimizer tile (a multiple of 1024, so tiles start on 4 KiB boundaries).
    pub sub_group_size: u64,
    /// NVMe optimizer: tile buffers (one per tensor of a tile) in memory at once.
    pub buffer_count: u64,
    /// NVMe optimizer: read the next tile while the current one steps.
    pub pipeline_read: bool,
    /// NVMe optimizer: write the previous tile while the current one steps.
    pub pipeline_write: bool,
    /// NVMe parameters: elements of unit shards kept cached in host memory.
    pub max_in_cpu: u64,
    /// The I/O settings.
    pub aio: AioPlan,
}

impl OffloadPlan {
    /// No offload: everything where the rank computes.
    pub fn none() -> Self {
        Self {
            optimizer: Tier::Device,
            param: Tier::Device,
            sub_group_size: tile_elems(DEFAULT_SUB_GROUP_ELEMS),
            buffer_count: 4,
            pipeline_read: false,
            pipeline_write: false,
            max_in_cpu: 1_000_000_000,
            aio: AioPlan { block_size: 1 << 20, requests_in_flight: 8 },
        }
    }

    /// Whether any state lives in files.
    pub fn uses_nvme(&self) -> bool {
        self.optimizer.nvme_path().is_some() || self.param.nvme_path().is_some()
    }

    /// Whether any state lives outside the rank's device (host memory or files).
    pub fn uses_host_or_nvme(&self) -> bool {
        self.optimizer != Tier::Device || self.param != Tier::Device
    }
}

pub(super) fn resolve(
    config: &Config,
    stage: ZeroStage,
    device: ComputeDevice,
    autos: &mut Autos,
) -> Result<OffloadPlan, ConfigError> {
    let z = config.raw.zero_optimization.clone().unwrap_or_default();
    let mut plan = OffloadPlan::none();
    let o = z.offload_optimizer.unwrap_or_default();
    let p = z.offload_param.unwrap_or_default();
    plan.optimizer = tier("zero_optimization.offload_optimizer", o.device.as_deref(), o.nvme_path.as_deref())?;
    plan.param = tier("zero_optimization.offload_param", p.device.as_deref(), p.nvme_path.as_deref())?;
    if plan.optimizer != Tier::Device && stage == ZeroStage::Disabled {
        return Err(ConfigError::Unsupported {
            key: "zero_optimization.offload_optimizer".into(),
            message: "needs zero_optimization.stage 1, 2 or 3 (as in DeepSpeed): offload moves a rank's shard of \
                      the optimizer"
                .into(),
        });
    }
    if plan.param != Tier::Device && !stage.shards_parameters() {
        return Err(ConfigError::Unsupported {
            key: "zero_optimization.offload_param".into(),
            message: format!(
                "needs zero_optimization.stage 3 (as in DeepSpeed): below it every rank keeps all parameters \
                 (stage is {})",
                stage.index()
            ),
        });
    }
    optimizer_keys(&mut plan, &o, device, autos)?;
    param_keys(&mut plan, &p, device, autos)?;
    let sub_group = autos
        .or(
            "zero_optimization.sub_group_size",
            z.sub_group_size,
            Count(DEFAULT_SUB_GROUP_ELEMS),
            "the ZeRO-Infinity tutorial's value",
        )
        .0;
    if sub_group == 0 {
        return Err(invalid("zero_optimization.sub_group_size", "must be at least 1 element"));
    }
    plan.sub_group_size = tile_elems(sub_group);
    if plan.optimizer.nvme_path().is_none() && z.sub_group_size.is_some() {
        autos.no_effect("zero_optimization.sub_group_size (only the NVMe optimizer steps in tiles)".into());
    }
    plan.aio = aio(config.raw.aio.clone().unwrap_or_default(), plan.uses_nvme(), autos)?;
    Ok(plan)
}

/// `elems` rounded up to a multiple of [`TILE_ALIGN_ELEMS`].
const fn tile_elems(elems: u64) -> u64 {
    elems.div_ceil(TILE_ALIGN_ELEMS).saturating_mul(TILE_ALIGN_ELEMS)
}

/// One section's `device` and `nvme_path`.
fn tier(section: &str, device: Option<&str>, nvme_path: Option<&str>) -> Result<Tier, ConfigError> {
    match device.unwrap_or("none") {
        "none" => Ok(Tier::Device),
        "cpu" => Ok(Tier::Host),
        "nvme" => match nvme_path {
            Some(path) if !path.trim().is_empty() => Ok(Tier::Nvme(PathBuf::from(path))),
            _ => Err(invalid(
                &format!("{section}.nvme_path"),
                "is required with device \"nvme\": a folder for the swap files",
            )),
        },
        other => Err(invalid(
            &format!("{section}.device"),
            format!("must be \"none\", \"cpu\" or \"nvme\", got \"{other}\""),
        )),
    }
}

fn optimizer_keys(
    plan: &mut OffloadPlan,
    o: &OffloadOptimizerConfig,
    device: ComputeDevice,
    autos: &mut Autos,
) -> Result<(), ConfigError> {
    const S: &str = "zero_optimization.offload_optimizer";
    if let Some(ratio) = o.ratio
        && ratio != 1.0
    {
        return Err(ConfigError::Unsupported {
            key: format!("{S}.ratio"),
            message: format!("partial offload is not supported: only 1 (offload everything), got {ratio}"),
        });
    }
    host_notes(S, &plan.optimizer, o.pin_memory, device, "optimizer state is", autos);
    let nvme = plan.optimizer.nvme_path().is_some();
    plan.buffer_count = buffer_count(S, o.buffer_count, plan.buffer_count)?;
    let both = o.pipeline.unwrap_or(false);
    plan.pipeline_read = o.pipeline_read.unwrap_or(both);
    plan.pipeline_write = o.pipeline_write.unwrap_or(both);
    let nvme_only = [
        ("buffer_count", o.buffer_count.is_some()),
        ("pipeline_read", o.pipeline_read == Some(true)),
        ("pipeline_write", o.pipeline_write == Some(true)),
        ("pipeline", both),
    ];
    if !nvme {
        for (key, _) in nvme_only.iter().filter(|(_, set)| *set) {
            autos.no_effect(format!("{S}.{key} (only with device \"nvme\")"));
        }
    }
    if o.fast_init == Some(true) {
        autos.no_effect(format!("{S}.fast_init (swap files are written as they are first filled)"));
    }
    Ok(())
}

fn param_keys(
    plan: &mut OffloadPlan,
    p: &OffloadParamConfig,
    device: ComputeDevice,
    autos: &mut Autos,
) -> Result<(), ConfigError> {
    const S: &str = "zero_optimization.offload_param";
    host_notes(S, &plan.param, p.pin_memory, device, "parameter shards are", autos);
    let nvme = plan.param.nvme_path().is_some();
    plan.max_in_cpu = autos.or(&format!("{S}.max_in_cpu"), p.max_in_cpu, Count(plan.max_in_cpu), "DeepSpeed default").0;
    if !nvme && matches!(p.max_in_cpu, Some(AutoOr::Value(_))) {
        autos.no_effect(format!("{S}.max_in_cpu (only with device \"nvme\")"));
    }
    if p.buffer_count.is_some() {
        buffer_count(S, p.buffer_count, 1)?;
        autos.no_effect(format!(
            "{S}.buffer_count (a unit's shard is read ahead when the unit before it runs, as \
             stage3_prefetch_bucket_size allows; one read per unit)"
        ));
    }
    if p.buffer_size.is_some() {
        autos.no_effect(format!("{S}.buffer_size (a parameter buffer holds one unit's shard, whatever its size)"));
    }
    Ok(())
}

/// What both sections note alike: `device: "cpu"` on a CPU rank (where `what` already
/// lives in host memory), and `pin_memory`.
fn host_notes(
    section: &str,
    tier: &Tier,
    pin_memory: Option<bool>,
    device: ComputeDevice,
    what: &str,
    autos: &mut Autos,
) {
    if *tier == Tier::Host && device == ComputeDevice::Cpu {
        autos.no_effect(format!("{section}.device \"cpu\" (a CPU rank's {what} in host memory already)"));
    }
    if pin_memory == Some(true) {
        autos.no_effect(format!("{section}.pin_memory (host buffers are not page-locked: {})", pin_why(device)));
    }
}

/// A section's `buffer_count`, or `default`; 0 is an error naming the key.
fn buffer_count(section: &str, v: Option<Count>, default: u64) -> Result<u64, ConfigError> {
    match v.map_or(default, |c| c.0) {
        0 => Err(invalid(&format!("{section}.buffer_count"), "must be at least 1")),
        n => Ok(n),
    }
}

fn pin_why(device: ComputeDevice) -> &'static str {
    match device {
        ComputeDevice::Cpu => "a CPU rank makes no device transfers",
        _ => "device transfers go through Burn's own staging",
    }
}

fn aio(a: AioConfig, used: bool, autos: &mut Autos) -> Result<AioPlan, ConfigError> {
    let block_size = a.block_size.map_or(1 << 20, |c| c.0);
    if block_size == 0 || !block_size.is_multiple_of(4096) || block_size > 1 << 30 {
        return Err(invalid(
            "aio.block_size",
            format!("must be a multiple of 4096 bytes up to 1 GiB, got {block_size}"),
        ));
    }
    let count = |key: &str, v: Option<Count>, default: u64| -> Result<u64, ConfigError> {
        match v.map_or(default, |c| c.0) {
            0 => Err(invalid(&format!("aio.{key}"), "must be at least 1")),
            n => Ok(n),
        }
    };
    let threads = count("thread_count", a.thread_count, 1)?;
    let depth = count("queue_depth", a.queue_depth, 8)?;
    if a.use_gds == Some(true) {
        return Err(ConfigError::Unsupported {
            key: "aio.use_gds".into(),
            message: "GPUDirect Storage is not supported: swap files are read through host memory".into(),
        });
    }
    if !used && config_has_aio(&a) {
        autos.no_effect("aio (no state is offloaded to NVMe)".into());
    }
    if a.single_submit == Some(true) {
        autos.no_effect("aio.single_submit (each I/O thread submits one request at a time anyway)".into());
    }
    if a.overlap_events == Some(false) {
        autos.no_effect("aio.overlap_events (requests always complete on their own threads)".into());
    }
    let asked = threads.saturating_mul(depth);
    if used && asked > MAX_IO_REQUESTS {
        autos.no_effect(format!(
            "aio.thread_count x aio.queue_depth beyond {MAX_IO_REQUESTS} ({threads} x {depth} = {asked} requests \
             in flight asked, {MAX_IO_REQUESTS} run, each on an I/O thread of its own)"
        ));
    }
    let requests_in_flight = asked.min(MAX_IO_REQUESTS) as usize;
    Ok(AioPlan { block_size, requests_in_flight })
}

fn config_has_aio(a: &AioConfig) -> bool {
    *a != AioConfig::default()
}

#[cfg(test)]
mod tests {
    use super::super::tests::plan;
    use super::*;

    fn offload(extra: &str) -> Result<OffloadPlan, ConfigError> {
        plan(&format!(r#"{{"train_batch_size": 4, {extra}}}"#)).map(|p| p.zero.offload)
    }

    #[test]
    fn deepspeeds_keys_resolve_with_its_defaults() {
        let o = offload(
            r#""zero_optimization": {"stage": 3, "sub_group_size": 1e6,
               "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x", "pipeline": true, "buffer_count": 6},
               "offload_param": {"device": "nvme", "nvme_path": "/tmp/y", "max_in_cpu": 5e6}},
               "aio": {"block_size": 262144, "queue_depth": 4, "thread_count": 2}"#,
        )
        .unwrap();
        assert_eq!(o.optimizer, Tier::Nvme("/tmp/x".into()));
        assert_eq!(o.param, Tier::Nvme("/tmp/y".into()));
        // 1e6 rounded up to a multiple of 1024.
        assert_eq!(o.sub_group_size, 1_000_448);
        assert_eq!((o.buffer_count, o.pipeline_read, o.pipeline_write, o.max_in_cpu), (6, true, true, 5_000_000));
        assert_eq!(o.aio, AioPlan { block_size: 262_144, requests_in_flight: 8 });
        assert_eq!(plan(r#"{"train_batch_size": 4}"#).unwrap().zero.offload, OffloadPlan::none());
    }

    #[test]
    fn bad_values_name_their_key() {
        let err = |extra: &str| offload(extra).unwrap_err().to_string();
        let e = err(r#""zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}"#);
        assert!(e.contains("zero_optimization.offload_optimizer.nvme_path"), "{e}");
        let e = err(r#""zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}"#);
        assert!(e.contains("offload_optimizer.device") && e.contains("disk"), "{e}");
        let e = err(r#""zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}"#);
        assert!(e.contains("zero_optimization.offload_param") && e.contains("stage 3"), "{e}");
        let e = err(r#""zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}"#);
        assert!(e.contains("zero_optimization.offload_optimizer") && e.contains("stage 1, 2 or 3"), "{e}");
        let e = err(r#""zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}"#);
        assert!(e.contains("offload_optimizer.ratio"), "{e}");
        let e = err(r#""zero_optimization": {"stage": 1, "sub_group_size": 0}"#);
        assert!(e.contains("sub_group_size"), "{e}");
        let e = err(r#""aio": {"block_size": 1000}"#);
        assert!(e.contains("aio.block_size"), "{e}");
        let e = err(r#""aio": {"use_gds": true}"#);
        assert!(e.contains("aio.use_gds"), "{e}");
    }

    /// Nothing silent: keys that change nothing on the chosen path are named.
    #[test]
    fn keys_without_effect_are_named() {
        let p = plan(
            r#"{"train_batch_size": 4, "zero_optimization": {"stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": true, "pipeline_read": true},
                "offload_param": {"device": "none", "buffer_size": 1e8}, "sub_group_size": 1e9},
                "aio": {"block_size": 1048576}}"#,
        )
        .unwrap();
        let warning = p.warning().unwrap();
        let nvme_param = plan(
            r#"{"train_batch_size": 4, "zero_optimization": {"stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "/tmp/p", "buffer_count": 3}}}"#,
        )
        .unwrap();
        assert!(nvme_param.warning().unwrap().contains("offload_param.buffer_count (a unit's shard is read ahead"));
        let nvme = r#"{"train_batch_size": 4, "zero_optimization": {"stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": "/tmp/p"}}, "aio": {"thread_count": 16, "queue_depth": Q}}"#;
        let capped = plan(&nvme.replace('Q', "8")).unwrap();
        assert_eq!(capped.zero.offload.aio.requests_in_flight, 64);
        assert!(capped.warning().unwrap().contains("aio.thread_count x aio.queue_depth beyond 64 (16 x 8 = 128"));
        let within = plan(&nvme.replace('Q', "4")).unwrap();
        assert_eq!(within.zero.offload.aio.requests_in_flight, 64);
        assert!(!within.warning().unwrap_or_default().contains("aio.thread_count"));
        for key in [
            "offload_optimizer.device \"cpu\"",
            "offload_optimizer.pin_memory",
            "offload_optimizer.pipeline_read",
            "offload_param.buffer_size",
            "sub_group_size",
            "aio (no state",
        ] {
            assert!(warning.contains(key), "{key} missing from {warning}");
        }
    }
}
