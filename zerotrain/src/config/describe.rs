//! A human-readable account of a [`Plan`], as `zerotrain config check` prints it.

use std::fmt;

use zerotrain_precision::Precision;

use super::{LossScalePlan, Plan};

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (b, r) = (&self.batch, &self.runtime);
        let (n, d) = (r.world_size, self.data_parallel_size());
        writeln!(
            f,
            "world size          {n} ({:?} backend, {} device, {:?} collectives, collective timeout {:.0} s)",
            r.backend,
            r.device.name(),
            r.collectives,
            r.comm_timeout.as_secs_f64()
        )?;
        writeln!(
            f,
            "batch               train_batch_size {} = micro batch {} x accumulation {} x {}",
            b.train_batch_size,
            b.micro_batch_per_rank,
            b.gradient_accumulation_steps,
            if d == n { format!("world size {n}") } else { format!("data-parallel ranks {d}") }
        )?;
        self.describe_zero(f)?;
        self.describe_offload(f)?;
        self.describe_replicas(f)?;
        self.describe_pipeline(f)?;
        self.describe_mesh(f)?;
        let z = &self.zero;
        let recompute: std::borrow::Cow<str> =
            if let (true, Some(units)) = (self.activation_checkpointing, self.recompute_units) {
                format!(
                    "on for the first {units} unit(s) (zerotrain.recompute_units): those keep only their input and are \
                 recomputed in backward; later units keep their activations{}",
                    if z.stage.shards_parameters() { " and stay gathered until their backward" } else { "" }
                )
                .into()
            } else if self.activation_checkpointing {
                "on: models declared in units keep only unit boundaries and recompute each unit in backward \
             (Engine::new is one unit and cannot)"
                    .into()
            } else if z.stage.shards_parameters() {
                "off: at stage 3 each unit stays gathered from its forward to its backward (Burn's autodiff graph \
             holds its weights), so the peak is about the whole model; add an activation_checkpointing section \
             to release units after their forward"
                    .into()
            } else {
                "off".into()
            };
        writeln!(f, "activation ckpt     {recompute}")?;
        self.describe_lora(f)?;
        self.describe_precision(f)?;
        let (precision, optim) = (&self.precision, &self.optim);
        let clip = if optim.gradient_clipping > 0.0 {
            format!("global L2 norm <= {}", optim.gradient_clipping)
        } else {
            "off".into()
        };
        writeln!(f, "gradient clipping   {clip}")?;
        let check = if precision.check_grad_overflow { "on: steps with NaN/inf gradients are skipped" } else { "off" };
        writeln!(f, "overflow check      {check}")?;
        writeln!(f, "optimizer           {}", json(&optim.optimizer))?;
        for group in &optim.param_groups {
            writeln!(
                f,
                "  param group       {}: lr x {}, weight_decay {}",
                group.patterns.join(", "),
                group.lr_scale,
                group.weight_decay
            )?;
        }
        writeln!(f, "scheduler           {}", json(&optim.schedule))?;
        writeln!(f, "steps_per_print     {}, seed {}", r.steps_per_print, r.seed)?;
        for note in &self.notes.auto_resolved {
            writeln!(f, "auto                {note}")?;
        }
        if let Some(warning) = self.warning() {
            writeln!(f, "warning             {warning}")?;
        }
        Ok(())
    }
}

/// `config check`'s sections, one per part of the plan.
impl Plan {
    /// The stage: what each rank keeps, how gradients are reduced and parameters gathered.
    fn describe_zero(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let z = &self.zero;
        // Units are sharded over the data-parallel ranks: the world, or a pipeline stage's,
        // or a replica group's (with their sequence ranks).
        let d = self.sharding_size();
        let share = |sharded: bool| if sharded && d > 1 { format!("1/{d} shard") } else { "full copy".to_string() };
        writeln!(f, "zero                {}", z.stage)?;
        writeln!(
            f,
            "  each rank keeps   parameters: {}, gradients: {}, optimizer state: {}",
            share(z.stage.shards_parameters()),
            share(z.stage.shards_gradients()),
            share(z.stage.shards_optimizer_states())
        )?;
        writeln!(
            f,
            "  gradients         {}",
            match z.stage.index() {
                0 => "all-reduced at the accumulation boundary".to_string(),
                1 if z.reduce_scatter => "reduce-scattered at the accumulation boundary".to_string(),
                1 => "all-reduced at the accumulation boundary (reduce_scatter: false)".to_string(),
                _ => "reduce-scattered every micro-step into the shard accumulator".to_string(),
            }
        )?;
        if z.stage.shards_gradients() {
            writeln!(f, "  buckets           at most {} elements per reduce-scatter", z.reduce_bucket_size)?;
        }
        let overlap = if z.overlap_comm { "overlaps the next unit's backward" } else { "waited for at once" };
        writeln!(f, "  reduction         per unit, {overlap} (overlap_comm: {})", z.overlap_comm)?;
        if z.stage.shards_parameters() {
            writeln!(
                f,
                "  gathering         per unit; the next prefetched if <= {} elements, <= {} gathered beside the unit in use",
                z.prefetch_bucket_size, z.max_live_parameters
            )?;
            writeln!(
                f,
                "  persistence       parameters of <= {} elements stay resident",
                z.param_persistence_threshold
            )?;
        }
        Ok(())
    }

    /// Where the offload tiers put the optimizer and parameters.
    fn describe_offload(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let z = &self.zero;
        let o = &z.offload;
        let tier = |t: &super::Tier| match t {
            super::Tier::Device => "where the rank computes".to_string(),
            super::Tier::Host => "host memory".to_string(),
            super::Tier::Nvme(path) => format!("NVMe under {}", path.display()),
        };
        if o.optimizer != super::Tier::Device || o.param != super::Tier::Device {
            writeln!(f, "  offload optimizer {} (masters and moments, stepped there)", tier(&o.optimizer))?;
            if o.optimizer.nvme_path().is_some() {
                writeln!(
                    f,
                    "    tiles           {} elements; read ahead {}, write behind {}, {} tile buffers; {} I/O requests of {} bytes in flight",
                    o.sub_group_size,
                    o.pipeline_read,
                    o.pipeline_write,
                    o.buffer_count,
                    o.aio.requests_in_flight,
                    o.aio.block_size
                )?;
            }
            if z.stage.shards_parameters() {
                writeln!(f, "  offload param     {} (each unit's shard between gathers)", tier(&o.param))?;
            }
        }
        Ok(())
    }

    /// The replica groups, and the servers they meet at.
    fn describe_replicas(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.runtime.world_size;
        if let Some(r) = &self.replicas {
            let o = &r.outer;
            let kind = if o.nesterov { "nesterov" } else { "sgd" };
            writeln!(
                f,
                "replica groups      {} groups of {} rank(s) (local_sgd), a round every {} steps: outer {kind} lr {} momentum {}, pseudo-gradients in {}",
                r.groups,
                r.group_size(n),
                r.sync_every,
                o.lr,
                o.momentum,
                r.comm_dtype
            )?;
            if let Some(group) = r.group {
                let mode = match r.mode {
                    super::ReplicaMode::Sync => "sync (a round applies once every live group pushed it)".to_string(),
                    super::ReplicaMode::Async { max_staleness } => {
                        format!(
                            "async (each push applies at once, Delayed Nesterov; at most {max_staleness} round(s) ahead of the slowest group)"
                        )
                    }
                };
                writeln!(
                    f,
                    "  servers           this job is group {group} of {} at {}; {mode}; a group keeping the others waiting over {:.0} s is dropped; servers save every {} rounds",
                    r.groups,
                    r.servers.join(", "),
                    r.group_timeout.as_secs_f64(),
                    r.checkpoint_every
                )?;
            }
        }
        Ok(())
    }

    /// The pipeline's stages and bubble.
    fn describe_pipeline(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.runtime.world_size;
        if let Some(p) = &self.pipeline {
            let m = self.batch.gradient_accumulation_steps as usize;
            writeln!(
                f,
                "pipeline            {} stages x {} data-parallel rank(s), schedule {}, partition by {}, recompute every {} unit(s) (0: none){}",
                p.stages,
                p.data_parallel(n),
                json(&p.schedule).trim_matches('"'),
                json(&p.partition).trim_matches('"'),
                p.checkpoint_interval,
                self.recompute_units.map_or(String::new(), |u| format!(" among the first {u} of each stage"))
            )?;
            writeln!(
                f,
                "  bubble            (K-1)/(M+K-1) = {}/{} = {:.1}% of each step with M = {m} micro-batches (gradient_accumulation_steps)",
                p.stages - 1,
                m + p.stages - 1,
                100.0 * zerotrain_zero::pipeline::bubble_fraction(p.stages, m)
            )?;
        }
        Ok(())
    }

    /// LoRA's adapters: their shape, what trains, and where the frozen base lives.
    fn describe_lora(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(lora) = &self.lora else { return Ok(()) };
        let c = &lora.config;
        let targets = match &c.target_modules {
            Some(crate::nn::lora::Targets::Names(names)) => names.join(", "),
            Some(crate::nn::lora::Targets::Pattern(source, _)) => format!("/{source}/"),
            Some(crate::nn::lora::Targets::AllLinear) => "all-linear".into(),
            None => "the family's default".into(),
        };
        let scaling = c.scaled(c.lora_alpha, c.r);
        writeln!(
            f,
            "lora                r {}, alpha {} (scaling {scaling}{}), dropout {}, on {targets}: only the adapters{} \
             train, their states sharded as the stage says; the frozen base {}",
            c.r,
            c.lora_alpha,
            if c.use_rslora { ", rslora" } else { "" },
            c.lora_dropout,
            if c.modules_to_save.is_empty() { "" } else { " and modules_to_save" },
            match (self.zero.stage.shards_parameters(), lora.quantize) {
                (true, Some(_)) => "sharded over the ranks with the parameters, its layers' matrices in NF4",
                (true, None) => "sharded over the ranks with the parameters",
                (false, _) => "whole on every rank (sharded at stage 3)",
            },
        )
    }

    /// The device mesh, where it splits layers or sequences: the ranks of each group and
    /// what each rank holds of the model.
    fn describe_mesh(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.mesh;
        if m.is_trivial() {
            return Ok(());
        }
        // The mesh of one stage, or of one replica group in a job of several.
        let d = self.sharding_size() / m.sp;
        let rank = match (self.pipeline.is_some(), self.replicas.as_ref().is_some_and(|r| r.group.is_none())) {
            (true, _) => "a stage's rank r",
            (_, true) => "a group's rank r",
            _ => "rank r",
        };
        writeln!(
            f,
            "mesh                dp {d} x sp {} x tp {} ({rank}: dp r / {}, sp (r / {}) % {}, tp r % {})",
            m.sp,
            m.tp,
            m.model_parallel(),
            m.tp,
            m.sp,
            m.tp
        )?;
        if m.tp > 1 {
            writeln!(
                f,
                "  tensor parallel   groups of {} consecutive ranks (ranks 0 to {}, ...) split each layer: 1/{} of its \
                 attention heads, kv heads, MLP width and vocabulary each; norms whole on each; ZeRO shards each \
                 rank's slice over dp",
                m.tp,
                m.tp - 1,
                m.tp
            )?;
        }
        if m.sp > 1 {
            writeln!(
                f,
                "  sequence parallel groups of {} ranks {} apart hold 1/{} of each sequence; attention trades it for 1/{} \
                 of the heads (all-to-all)",
                m.sp, m.tp, m.sp, m.sp
            )?;
        }
        Ok(())
    }

    /// Compute dtype, gradient dtypes and the loss scale.
    fn describe_precision(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let precision = &self.precision;
        match precision.compute {
            Precision::Fp32 => writeln!(f, "precision           fp32 (parameters are their own master weights)")?,
            p => writeln!(f, "precision           {p} compute, fp32 master weights and optimizer state")?,
        }
        writeln!(f, "  gradients         reduced in {}, accumulated in {}", precision.comm, precision.grad_accum)?;
        match &precision.loss_scale {
            None => {}
            Some(LossScalePlan::Static { scale }) => writeln!(f, "  loss scale        static {scale}")?,
            Some(LossScalePlan::Dynamic(c)) => writeln!(
                f,
                "  loss scale        dynamic from 2^{}, x2 after {} good steps, hysteresis {}{}, min {} (at the minimum: {:?})",
                c.initial_scale_power,
                c.window,
                c.hysteresis,
                if c.consecutive_hysteresis { " (consecutive)" } else { "" },
                c.min_scale,
                c.at_minimum
            )?,
        }
        Ok(())
    }
}

/// Compact JSON of a plan's value (its enums carry their field names).
fn json(v: &impl serde::Serialize) -> String {
    serde_json::to_string(v).unwrap_or_else(|e| format!("<{e}>"))
}
