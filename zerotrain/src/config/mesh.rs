//! The device mesh: DeepSpeed's `tensor_parallel` section and `zerotrain.mesh`, resolved
//! into how many ranks split each layer (`tp`) and each sequence (`sp`); the rest of a
//! pipeline stage's ranks are data-parallel (`dp`), ZeRO's group.

use serde::{Deserialize, Serialize};

use super::autos::invalid;
use super::value::Count;
use super::{Config, ConfigError};

/// `tensor_parallel`: DeepSpeed's AutoTP training section.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TensorParallelConfig {
    /// Ranks that split each layer (its attention heads, MLP and vocabulary) between them.
    /// Default 1 (no tensor parallelism).
    pub autotp_size: Option<Count>,
}

/// `zerotrain.mesh`: the mesh's dimensions beside the pipeline's stages.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MeshConfig {
    /// Tensor-parallel ranks; the same as `tensor_parallel.autotp_size` (set either, or both
    /// alike). Default 1.
    pub tp: Option<Count>,
    /// Sequence-parallel ranks (DeepSpeed-Ulysses: each holds a part of every sequence, and
    /// attention trades sequence parts for heads). Default 1.
    pub sp: Option<Count>,
}

/// The mesh a job runs on. Rank `r` of a stage's ranks is data-parallel rank `r / (sp *
/// tp)`, sequence rank `(r / tp) % sp` and tensor rank `r % tp`: a tensor-parallel group is
/// `tp` consecutive ranks (one machine's GPUs, as NCCL needs for speed), and a
/// sequence-parallel group the next level out, as in Megatron-LM's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MeshPlan {
    /// Ranks that split each layer.
    pub tp: usize,
    /// Ranks that split each sequence.
    pub sp: usize,
}

impl Default for MeshPlan {
    fn default() -> Self {
        Self { tp: 1, sp: 1 }
    }
}

impl MeshPlan {
    /// Ranks that hold the same data-parallel place: `tp * sp`.
    pub fn model_parallel(&self) -> usize {
        self.tp * self.sp
    }

    /// Whether every rank computes whole layers on whole sequences (tp and sp 1).
    pub fn is_trivial(&self) -> bool {
        self.model_parallel() == 1
    }

    /// Rank `rank`'s place (data-parallel, sequence, tensor) among a stage's ranks.
    pub fn coordinates(&self, rank: usize) -> (usize, usize, usize) {
        (rank / self.model_parallel(), (rank / self.tp) % self.sp, rank % self.tp)
    }
}

/// The mesh of `config` over the `ranks` of a pipeline stage (the world without one): `tp`
/// from either key (an error where both are set and differ), `sp`, each at least 1, and
/// their product dividing `ranks`, each refusal naming its key.
pub(super) fn resolve(config: &Config, ranks: usize) -> Result<MeshPlan, ConfigError> {
    let count = |key: &str, value: Option<Count>| -> Result<usize, ConfigError> {
        match value.map(|c| usize::try_from(c.0)) {
            None => Ok(1),
            Some(Ok(n)) if n >= 1 => Ok(n),
            Some(_) => Err(invalid(key, "must be at least 1")),
        }
    };
    let raw = &config.raw;
    let autotp = count("tensor_parallel.autotp_size", raw.tensor_parallel.as_ref().and_then(|t| t.autotp_size))?;
    let mesh = raw.zerotrain.as_ref().and_then(|z| z.mesh.as_ref());
    let tp = count("zerotrain.mesh.tp", mesh.and_then(|m| m.tp))?;
    let sp = count("zerotrain.mesh.sp", mesh.and_then(|m| m.sp))?;
    let both =
        raw.tensor_parallel.as_ref().is_some_and(|t| t.autotp_size.is_some()) && mesh.is_some_and(|m| m.tp.is_some());
    if both && autotp != tp {
        let message = format!("is {tp} but tensor_parallel.autotp_size is {autotp}: set one, or both alike");
        return Err(invalid("zerotrain.mesh.tp", message));
    }
    let plan = MeshPlan { tp: tp.max(autotp), sp };
    if !ranks.is_multiple_of(plan.model_parallel()) {
        let message = format!(
            "tp {} x sp {} = {} must divide the {ranks} ranks of a pipeline stage (the world without one) into \
             data-parallel places",
            plan.tp,
            plan.sp,
            plan.model_parallel()
        );
        return Err(invalid(key(config), message));
    }
    Ok(plan)
}

/// The key a refusal of the mesh names: `zerotrain.mesh` where that section is set, else
/// DeepSpeed's.
pub(super) fn key(config: &Config) -> &'static str {
    let mesh = config.raw.zerotrain.as_ref().and_then(|z| z.mesh.as_ref());
    if mesh.is_some() { "zerotrain.mesh" } else { "tensor_parallel.autotp_size" }
}

#[cfg(test)]
mod tests {
    use super::super::tests::parse;
    use super::super::*;

    fn at(json: &str, n: usize) -> Result<Plan, ConfigError> {
        parse(json)?.resolve(Overrides { world_size: Some(n), ..Overrides::default() })
    }

    /// Either key sets tp; the batch splits over the data-parallel ranks only (every rank of
    /// a tensor- or sequence-parallel group reads the same samples), and each rank's place
    /// follows Megatron's order; `config check` prints the mesh.
    #[test]
    fn the_mesh_comes_from_either_key_and_the_batch_splits_over_dp_only() {
        let micro = r#""train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2"#;
        let deepspeed = at(&format!(r#"{{{micro}, "tensor_parallel": {{"autotp_size": 2}}}}"#), 4).unwrap();
        let ours = at(&format!(r#"{{{micro}, "zerotrain": {{"mesh": {{"tp": 2}}}}}}"#), 4).unwrap();
        for plan in [&deepspeed, &ours] {
            assert_eq!((plan.mesh, plan.data_parallel_size()), (MeshPlan { tp: 2, sp: 1 }, 2));
            assert_eq!(plan.batch.train_batch_size, 3 * 2 * 2);
        }
        let both = at(r#"{"train_batch_size": 4, "tensor_parallel": {"autotp_size": 2}, "zerotrain": {"mesh": {"tp": 2, "sp": 2}}}"#, 16)
            .unwrap();
        assert_eq!(
            (both.mesh, both.data_parallel_size(), both.batch.micro_batch_per_rank),
            (MeshPlan { tp: 2, sp: 2 }, 4, 1)
        );
        let places: Vec<_> = (0..8).map(|r| both.mesh.coordinates(r)).collect();
        let want = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)];
        assert_eq!(places, want);
        let shown = both.to_string();
        assert!(shown.contains("mesh                dp 4 x sp 2 x tp 2"), "{shown}");
        assert!(!at(r#"{"train_batch_size": 4}"#, 4).unwrap().to_string().contains("mesh"));
    }

    /// Sizes that cannot make a mesh (of the world, or of a pipeline stage's ranks), keys
    /// that disagree, and what the mesh does not run beside yet are refused, naming the key.
    #[test]
    fn bad_meshes_are_refused_naming_the_key() {
        let err = |json: &str, n: usize| at(json, n).unwrap_err().to_string();
        let e = err(r#"{"train_batch_size": 6, "tensor_parallel": {"autotp_size": 4}}"#, 6);
        assert!(e.contains("`tensor_parallel.autotp_size`") && e.contains("must divide the 6 ranks"), "{e}");
        let e = err(r#"{"train_batch_size": 4, "zerotrain": {"mesh": {"sp": 3}}}"#, 4);
        assert!(e.contains("`zerotrain.mesh`") && e.contains("tp 1 x sp 3 = 3"), "{e}");
        let e = err(r#"{"train_batch_size": 4, "tensor_parallel": {"autotp_size": 0}}"#, 4);
        assert!(e.contains("`tensor_parallel.autotp_size`: must be at least 1"), "{e}");
        let e = err(
            r#"{"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2}, "zerotrain": {"mesh": {"tp": 4}}}"#,
            8,
        );
        assert!(e.contains("`zerotrain.mesh.tp`") && e.contains("autotp_size is 2"), "{e}");
        // Beside pipeline stages the mesh splits each stage's ranks: 8 ranks in 2 stages at
        // tp 2 are 2 data-parallel places per stage; tp 4 does not divide a stage of 2.
        let piped = r#"{"train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 2}, "tensor_parallel": {"autotp_size": 2}}"#;
        let plan = at(piped, 8).unwrap();
        assert_eq!((plan.mesh.tp, plan.data_parallel_size(), plan.batch.train_batch_size), (2, 2, 2));
        let e = err(&piped.replace("\"autotp_size\": 2", "\"autotp_size\": 4"), 4);
        assert!(e.contains("tensor_parallel.autotp_size") && e.contains("the 2 ranks of a pipeline stage"), "{e}");
        // Each replica group is a mesh: 4 ranks in 2 groups at tp 2 are one data-parallel
        // place per group; 6 ranks in 2 groups of 3 do not split at tp 2.
        let groups = r#"{"train_batch_size": 2, "local_sgd": {"groups": 2}, "zerotrain": {"mesh": {"tp": 2}}}"#;
        assert_eq!(at(groups, 4).unwrap().data_parallel_size(), 2, "one place in each of 2 groups");
        let e = err(groups, 6);
        assert!(e.contains("zerotrain.mesh") && e.contains("the 3 ranks of a local_sgd group"), "{e}");
        let e = parse(r#"{"tensor_parallel": {"autotp_sise": 2}}"#).unwrap_err().to_string();
        assert!(e.contains("`tensor_parallel.autotp_sise`") && e.contains("autotp_size"), "{e}");
    }
}
