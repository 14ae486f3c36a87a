//! The update rule: `optimizer` (Adam, AdamW, SGD), parameter groups
//! (`zerotrain.param_groups`), `scheduler` and `gradient_clipping`.
//!
//! # Note: parameter groups
//! DeepSpeed takes PyTorch's parameter groups from the Python call; a JSON file cannot
//! hold tensors, so zerotrain's groups name parameters by module-path pattern (`*` matches
//! any run of characters, dots included: `*.bias`, `blocks.*.ln1.*`). Each group may set
//! its own `weight_decay` and `lr` (PyTorch's meaning: the group's base lr; the schedule
//! scales it as it scales `optimizer.params.lr`). A parameter belongs to the first group
//! whose pattern matches it, else to the default group, `optimizer.params` itself.

use serde::Serialize;

use super::autos::{Autos, invalid};
use super::raw::{OptimizerParams, ParamGroupConfig, SchedulerConfig};
use super::value::{AutoOr, Count};
use super::{Config, ConfigError};
use crate::schedule::{LrSchedule, WarmupType};

/// How parameters are updated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OptimPlan {
    /// The optimizer of the default group.
    pub optimizer: OptimizerPlan,
    /// Parameter groups, in matching order (empty: every parameter is in the default
    /// group).
    pub param_groups: Vec<ParamGroupPlan>,
    /// The learning-rate schedule.
    pub schedule: LrSchedule,
    /// Max global gradient norm; 0 disables clipping.
    pub gradient_clipping: f64,
}

/// A parameter group (module note).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParamGroupPlan {
    /// Module-path patterns; `*` matches any run of characters.
    pub patterns: Vec<String>,
    /// The group's lr over the default group's: the schedule's lr is multiplied by it.
    pub lr_scale: f64,
    /// The group's weight decay (replacing the optimizer's).
    pub weight_decay: f64,
}

impl ParamGroupPlan {
    /// A group of the parameters matching `patterns` that are not decayed (biases and
    /// norms in every transformer recipe).
    pub fn no_decay(patterns: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self { patterns: patterns.into_iter().map(Into::into).collect(), lr_scale: 1.0, weight_decay: 0.0 }
    }

    /// Whether the parameter at module path `path` matches one of the patterns.
    pub fn matches(&self, path: &str) -> bool {
        self.patterns.iter().any(|p| glob(p.as_bytes(), path.as_bytes()))
    }
}

/// `*`-only glob matching (no other special characters).
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    match pattern.split_first() {
        None => text.is_empty(),
        Some((b'*', rest)) => (0..=text.len()).any(|skip| glob(rest, &text[skip..])),
        Some((&c, rest)) => text.split_first().is_some_and(|(&t, more)| t == c && glob(rest, more)),
    }
}

/// The optimizer, with every hyper-parameter explicit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum OptimizerPlan {
    /// Adam; `decoupled_weight_decay` makes it AdamW.
    Adam {
        /// Learning rate (the schedule may override it per step).
        lr: f64,
        /// (beta1, beta2).
        betas: [f64; 2],
        /// Epsilon added to sqrt(v).
        eps: f64,
        /// Weight decay coefficient.
        weight_decay: f64,
        /// AdamW (true) or L2 regularisation (false).
        decoupled_weight_decay: bool,
        /// AMSGrad variant.
        amsgrad: bool,
    },
    /// SGD with optional momentum.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0: none).
        momentum: f64,
        /// Dampening of the momentum.
        dampening: f64,
        /// Nesterov momentum.
        nesterov: bool,
        /// L2 weight decay.
        weight_decay: f64,
    },
}

impl OptimizerPlan {
    /// The optimizer's name as DeepSpeed spells it: `Adam`, `AdamW` or `SGD`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Adam { decoupled_weight_decay: true, .. } => "AdamW",
            Self::Adam { .. } => "Adam",
            Self::Sgd { .. } => "SGD",
        }
    }

    /// The configured learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            Self::Adam { lr, .. } | Self::Sgd { lr, .. } => *lr,
        }
    }

    /// The same optimizer with weight decay `weight_decay` (a parameter group's).
    pub fn with_weight_decay(mut self, value: f64) -> Self {
        match &mut self {
            Self::Adam { weight_decay, .. } | Self::Sgd { weight_decay, .. } => *weight_decay = value,
        }
        self
    }

    /// fp32 optimizer-state bytes per parameter (Adam: m and v; AMSGrad adds max v; SGD:
    /// the velocity when momentum is on).
    pub fn state_bytes_per_param(&self) -> u64 {
        match *self {
            Self::Adam { amsgrad: true, .. } => 12,
            Self::Adam { .. } => 8,
            Self::Sgd { momentum, .. } if momentum > 0.0 => 4,
            Self::Sgd { .. } => 0,
        }
    }
}

/// `optimizer`, `zerotrain.param_groups`, `scheduler` and `gradient_clipping`.
pub(super) fn resolve(config: &Config, total_steps: Option<u64>, autos: &mut Autos) -> Result<OptimPlan, ConfigError> {
    let raw = &config.raw;
    let gradient_clipping = autos.or("gradient_clipping", raw.gradient_clipping, 0.0, "DeepSpeed default: off");
    if !(gradient_clipping >= 0.0 && gradient_clipping.is_finite()) {
        return Err(invalid("gradient_clipping", format!("must be >= 0, got {gradient_clipping}")));
    }
    let optimizer = optimizer(config, autos)?;
    let groups = raw.zerotrain.as_ref().map(|z| z.param_groups.as_slice()).unwrap_or_default();
    let param_groups =
        groups.iter().enumerate().map(|(i, g)| param_group(i, g, &optimizer)).collect::<Result<_, _>>()?;
    let schedule = match &raw.scheduler {
        None => LrSchedule::Constant { lr: optimizer.lr() },
        Some(s) => schedule(s, optimizer.lr(), total_steps, autos)?,
    };
    Ok(OptimPlan { optimizer, param_groups, schedule, gradient_clipping })
}

fn param_group(i: usize, g: &ParamGroupConfig, optimizer: &OptimizerPlan) -> Result<ParamGroupPlan, ConfigError> {
    let key = |name: &str| format!("zerotrain.param_groups.{i}.{name}");
    if g.params.is_empty() || g.params.iter().any(String::is_empty) {
        return Err(invalid(&key("params"), "must list at least one non-empty module-path pattern"));
    }
    let weight_decay = g.weight_decay.unwrap_or(match optimizer {
        OptimizerPlan::Adam { weight_decay, .. } | OptimizerPlan::Sgd { weight_decay, .. } => *weight_decay,
    });
    if !(weight_decay >= 0.0 && weight_decay.is_finite()) {
        return Err(invalid(&key("weight_decay"), format!("must be >= 0, got {weight_decay}")));
    }
    let lr_scale = match g.lr {
        None => 1.0,
        Some(lr) if !(lr >= 0.0 && lr.is_finite()) => {
            return Err(invalid(&key("lr"), format!("must be a finite number >= 0, got {lr}")));
        }
        Some(_) if optimizer.lr() == 0.0 => {
            return Err(invalid(&key("lr"), "a group's lr scales with optimizer.params.lr, which is 0"));
        }
        Some(lr) => lr / optimizer.lr(),
    };
    Ok(ParamGroupPlan { patterns: g.params.clone(), lr_scale, weight_decay })
}

fn optimizer(config: &Config, autos: &mut Autos) -> Result<OptimizerPlan, ConfigError> {
    let (kind, p) = match &config.raw.optimizer {
        Some(o) => (o.kind.to_ascii_lowercase(), o.params.clone()),
        None => ("adam".to_string(), OptimizerParams::default()),
    };
    let lr = autos.or("optimizer.params.lr", p.lr, 1e-3, "DeepSpeed/torch default");
    let weight_decay = autos.or("optimizer.params.weight_decay", p.weight_decay, 0.0, "default");
    if !(lr >= 0.0 && lr.is_finite()) {
        return Err(invalid("optimizer.params.lr", format!("must be a finite number >= 0, got {lr}")));
    }
    if !(weight_decay >= 0.0 && weight_decay.is_finite()) {
        return Err(invalid("optimizer.params.weight_decay", format!("must be >= 0, got {weight_decay}")));
    }
    match kind.as_str() {
        "adam" | "adamw" => adam(kind == "adamw", &p, lr, weight_decay, autos),
        "sgd" => sgd(&p, lr, weight_decay),
        other => Err(ConfigError::Unsupported {
            key: "optimizer.type".into(),
            message: format!(
                "`{other}` is not supported; use Adam, AdamW or SGD (flat-shard-safe optimizers), or bring your \
                 own through the library's ShardOptimizer"
            ),
        }),
    }
}

/// The first of `present` that is set: a key of another optimizer.
fn refuse(present: &[(&str, bool)], kind: &str) -> Result<(), ConfigError> {
    match present.iter().find(|(_, set)| *set) {
        Some((name, _)) => Err(invalid(&format!("optimizer.params.{name}"), format!("does not apply to {kind}"))),
        None => Ok(()),
    }
}

fn adam(
    adamw: bool,
    p: &OptimizerParams,
    lr: f64,
    weight_decay: f64,
    autos: &mut Autos,
) -> Result<OptimizerPlan, ConfigError> {
    let sgd_only = [("momentum", p.momentum.is_some()), ("dampening", p.dampening.is_some())];
    refuse(&[sgd_only.as_slice(), &[("nesterov", p.nesterov.is_some())]].concat(), "Adam")?;
    if p.bias_correction == Some(false) {
        return Err(ConfigError::Unsupported {
            key: "optimizer.params.bias_correction".into(),
            message: "Adam without bias correction is not supported".into(),
        });
    }
    let betas = autos.or("optimizer.params.betas", p.betas, [0.9, 0.999], "default");
    let eps = autos.or("optimizer.params.eps", p.eps, 1e-8, "default");
    if !betas.iter().all(|b| (0.0..1.0).contains(b)) {
        return Err(invalid("optimizer.params.betas", format!("each beta must be in [0, 1), got {betas:?}")));
    }
    if !eps.is_finite() || eps <= 0.0 {
        return Err(invalid("optimizer.params.eps", format!("must be > 0, got {eps}")));
    }
    if adamw && p.adam_w_mode == Some(false) {
        return Err(invalid("optimizer.params.adam_w_mode", "AdamW always decouples weight decay; use type Adam"));
    }
    let decoupled_weight_decay = adamw || p.adam_w_mode.unwrap_or(true);
    let amsgrad = p.amsgrad.unwrap_or(false);
    Ok(OptimizerPlan::Adam { lr, betas, eps, weight_decay, decoupled_weight_decay, amsgrad })
}

fn sgd(p: &OptimizerParams, lr: f64, weight_decay: f64) -> Result<OptimizerPlan, ConfigError> {
    let adam_only = [
        ("betas", p.betas.is_some()),
        ("eps", p.eps.is_some()),
        ("adam_w_mode", p.adam_w_mode.is_some()),
        ("amsgrad", p.amsgrad.is_some()),
        ("bias_correction", p.bias_correction.is_some()),
    ];
    refuse(&adam_only, "SGD")?;
    let momentum = p.momentum.unwrap_or(0.0);
    let dampening = p.dampening.unwrap_or(0.0);
    let nesterov = p.nesterov.unwrap_or(false);
    if !(0.0..1.0).contains(&momentum) || !(0.0..=1.0).contains(&dampening) {
        return Err(invalid(
            "optimizer.params.momentum",
            format!("momentum must be in [0, 1) and dampening in [0, 1], got {momentum} and {dampening}"),
        ));
    }
    if nesterov && (momentum == 0.0 || dampening != 0.0) {
        return Err(invalid(
            "optimizer.params.nesterov",
            "Nesterov momentum needs momentum > 0 and zero dampening (as in PyTorch)",
        ));
    }
    Ok(OptimizerPlan::Sgd { lr, momentum, dampening, nesterov, weight_decay })
}

/// The warmup keys every warmup schedule shares: (min lr, steps, type).
fn warmup(s: &SchedulerConfig, autos: &mut Autos) -> Result<(f64, u64, WarmupType), ConfigError> {
    let p = &s.params;
    let warmup_type = match p.warmup_type.as_deref().unwrap_or("log") {
        "log" => WarmupType::Log,
        "linear" => WarmupType::Linear,
        other => return Err(invalid(&key("warmup_type"), format!("must be `log` or `linear`, got `{other}`"))),
    };
    let steps = autos.or(&key("warmup_num_steps"), p.warmup_num_steps, Count(1000), "DeepSpeed default").0;
    if steps == 0 {
        return Err(invalid(&key("warmup_num_steps"), "must be a positive integer"));
    }
    let min_lr = autos.or(&key("warmup_min_lr"), p.warmup_min_lr, 0.0, "DeepSpeed default");
    Ok((min_lr, steps.max(2), warmup_type))
}

fn key(name: &str) -> String {
    format!("scheduler.params.{name}")
}

/// `total_num_steps`, required by the decaying schedules (`"auto"`: the run's `--steps`).
fn total_steps(s: &SchedulerConfig, run_steps: Option<u64>, autos: &mut Autos) -> Result<u64, ConfigError> {
    match s.params.total_num_steps {
        Some(AutoOr::Value(Count(n))) => Ok(n),
        Some(AutoOr::Auto) => {
            let n = run_steps.ok_or_else(|| ConfigError::UnresolvableAuto {
                key: key("total_num_steps"),
                why: "no total step count is known; give a number or run with --steps".into(),
            })?;
            autos.note(format!("{} = {n} (the run's --steps)", key("total_num_steps")));
            Ok(n)
        }
        None => Err(invalid(&key("total_num_steps"), format!("is required by {}", s.kind))),
    }
}

fn schedule(
    s: &SchedulerConfig,
    base_lr: f64,
    run_steps: Option<u64>,
    autos: &mut Autos,
) -> Result<LrSchedule, ConfigError> {
    let p = &s.params;
    if p.last_batch_iteration.is_some_and(|i| i != -1) {
        return Err(ConfigError::Unsupported {
            key: key("last_batch_iteration"),
            message: "only -1 (start) is supported; resume the schedule from a checkpoint instead".into(),
        });
    }
    match s.kind.as_str() {
        "WarmupLR" => {
            let (min_lr, warmup_num_steps, warmup_type) = warmup(s, autos)?;
            let max_lr = autos.or(&key("warmup_max_lr"), p.warmup_max_lr, base_lr, "the optimizer's lr");
            Ok(LrSchedule::WarmupLR { min_lr, max_lr, warmup_num_steps, warmup_type })
        }
        "WarmupDecayLR" => {
            let (min_lr, warmup_num_steps, warmup_type) = warmup(s, autos)?;
            let total_num_steps = total_steps(s, run_steps, autos)?;
            let max_lr = autos.or(&key("warmup_max_lr"), p.warmup_max_lr, 1e-3, "DeepSpeed default");
            Ok(LrSchedule::WarmupDecayLR { min_lr, max_lr, warmup_num_steps, warmup_type, total_num_steps })
        }
        "WarmupCosineLR" => {
            let (_, warmup_num_steps, warmup_type) = warmup(s, autos)?;
            Ok(LrSchedule::WarmupCosineLR {
                base_lr,
                warmup_min_ratio: p.warmup_min_ratio.unwrap_or(0.0),
                warmup_num_steps,
                cos_min_ratio: p.cos_min_ratio.unwrap_or(1e-4),
                warmup_type,
                total_num_steps: total_steps(s, run_steps, autos)?,
            })
        }
        "OneCycle" => one_cycle(s, autos),
        other => Err(ConfigError::Unsupported {
            key: "scheduler.type".into(),
            message: format!("`{other}` is not supported; use WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle"),
        }),
    }
}

fn one_cycle(s: &SchedulerConfig, autos: &mut Autos) -> Result<LrSchedule, ConfigError> {
    let p = &s.params;
    let need = |v: Option<f64>, name: &str| v.ok_or_else(|| invalid(&key(name), "is required by OneCycle"));
    if p.cycle_momentum != Some(false) {
        autos
            .note(format!("{} = false (momentum cycling is not implemented; betas stay fixed)", key("cycle_momentum")));
    }
    let first = p.cycle_first_step_size.map_or(2000, |c| c.0);
    let first_stairs = p.cycle_first_stair_count.map_or(0, |c| c.0);
    if first == 0 {
        return Err(invalid(&key("cycle_first_step_size"), "must be at least 1"));
    }
    Ok(LrSchedule::OneCycle {
        cycle_min_lr: need(p.cycle_min_lr, "cycle_min_lr")?,
        cycle_max_lr: need(p.cycle_max_lr, "cycle_max_lr")?,
        decay_lr_rate: p.decay_lr_rate.unwrap_or(0.0),
        cycle_first_step_size: first,
        cycle_second_step_size: p.cycle_second_step_size.map_or(first, |c| c.0).max(1),
        cycle_first_stair_count: first_stairs,
        cycle_second_stair_count: p.cycle_second_stair_count.map_or(first_stairs, |c| c.0),
        decay_step_size: p.decay_step_size.map_or(0, |c| c.0),
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{parse, plan};
    use super::*;

    #[test]
    fn globs_match_any_run_of_characters_and_nothing_else() {
        let g = ParamGroupPlan::no_decay(["*.bias", "blocks.*.ln?"]);
        assert!(g.matches("blocks.0.attn.query.bias") && g.matches(".bias"));
        assert!(!g.matches("blocks.0.attn.query.weight") && !g.matches("bias"));
        assert!(!g.matches("blocks.1.ln1"), "`?` is an ordinary character");
        assert!(glob(b"*", b"") && glob(b"a*b*c", b"aXXbYYc") && !glob(b"a*b*c", b"aXXbYY"));
    }

    #[test]
    fn param_groups_resolve_their_lr_as_a_scale_and_their_own_weight_decay() {
        let p = plan(
            r#"{"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
                "zerotrain": {"param_groups": [{"params": ["*.bias", "*.gamma"], "weight_decay": 0},
                                               {"params": ["head.*"], "lr": 0.001}]}}"#,
        )
        .unwrap();
        let groups = &p.optim.param_groups;
        assert_eq!((groups[0].lr_scale, groups[0].weight_decay), (1.0, 0.0));
        assert!((groups[1].lr_scale - 0.1).abs() < 1e-12 && groups[1].weight_decay == 0.1, "{groups:?}");
        for (json, needle) in [
            (r#"[{"params": []}]"#, "`zerotrain.param_groups.0.params`"),
            (r#"[{"params": ["a"]}, {"params": ["b"], "lr": -1}]"#, "`zerotrain.param_groups.1.lr`"),
            (r#"[{"params": ["a"], "weight_decay": -0.5}]"#, "`zerotrain.param_groups.0.weight_decay`"),
        ] {
            let err = plan(&format!(r#"{{"train_batch_size": 1, "zerotrain": {{"param_groups": {json}}}}}"#));
            assert!(err.unwrap_err().to_string().contains(needle), "{json}");
        }
        let err = parse(r#"{"zerotrain": {"param_groups": [{"params": ["a"], "weight_decy": 0}]}}"#).unwrap_err();
        assert!(err.to_string().contains("did you mean `weight_decay`"), "{err}");
    }
}
