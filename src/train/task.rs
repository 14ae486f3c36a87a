//! What a training run is given: the model to train with its data and report
//! ([`Task`], [`TrainData`]), and how the model reaches each rank ([`Handout`]).

use burn::tensor::Device;
use zerotrain::nn::parallel::ParallelGroups;

use super::VALIDATION_SEQUENCES;
use zerotrain::Plan;
use zerotrain_models::LmBatch;
use zerotrain_models::data::{Corpus, windows};

/// What a training job reads: next-token rows `[count, context + 1]`, every target
/// counted, or (fine-tuning sequences) those their masks mark.
pub trait TrainData: Sync {
    /// The model's context: rows are one token longer.
    fn context(&self) -> usize;
    /// Rows `first..first + count` of the global batch of the step after `step`. Where
    /// only some targets count, the batch's loss is its counted targets' sum divided by
    /// the step's counted targets (the caller shares it out: `LmBatch::shared_by`).
    fn batch(&self, step: u64, first: u64, count: u64, device: &Device) -> LmBatch;
    /// The targets counted in the step after `step`, over its whole global batch, where
    /// only some count (`None`: every target of every row).
    fn counted(&self, _step: u64) -> Option<u64> {
        None
    }
    /// The held-out rows the validation loss is measured on.
    fn validation(&self, device: &Device) -> LmBatch;
    /// What a checkpoint records of the data after `step` (JSON, beside the step).
    fn position(&self, step: u64) -> serde_json::Value;
    /// Continue after `step` from a checkpoint's record (an error if it names other data).
    fn resume(&self, _record: &serde_json::Value, _step: u64) -> anyhow::Result<()> {
        Ok(())
    }
}

/// The character corpus of the main job through its stateless sampler ([`windows`]).
pub(super) struct CorpusData<'a> {
    pub(super) corpus: &'a Corpus,
    pub(super) context: usize,
    pub(super) seed: u64,
}

impl TrainData for CorpusData<'_> {
    fn context(&self) -> usize {
        self.context
    }
    fn batch(&self, step: u64, first: u64, count: u64, device: &Device) -> LmBatch {
        windows(&self.corpus.train, self.context, self.seed, step, first, count, device).into()
    }
    fn validation(&self, device: &Device) -> LmBatch {
        windows(&self.corpus.valid, self.context, self.seed, u64::MAX, 0, VALIDATION_SEQUENCES, device).into()
    }
    fn position(&self, _: u64) -> serde_json::Value {
        serde_json::Value::Null
    }
}

/// A model to train and what to report about it.
pub struct Task<'a, M> {
    /// The model as it starts (lazy parameters are read unit by unit by the engine).
    pub init: M,
    /// Its trainable parameters.
    pub num_params: u64,
    /// The data.
    pub data: &'a dyn TrainData,
    /// Text the trained model writes, for the summary (rank 0's gathered model).
    pub samples: &'a (dyn Fn(&M) -> zerotrain::Result<Vec<String>> + Sync),
    /// Files written into the checkpoints' folder once the run folder is locked (a Hugging
    /// Face family's `config.json` and `tokenizer.json`): (name, contents).
    pub files: Vec<(String, Vec<u8>)>,
    /// The fingerprint of a LoRA run's frozen base, which every checkpoint records and a
    /// resume checks (`Null`: nothing frozen).
    pub base: serde_json::Value,
    /// How a tensor-parallel rank builds its part of the model on its device, where the
    /// model has a tensor-parallel plan (`None`: the engine refuses a tensor-parallel mesh).
    pub split: Option<&'a Splitter<'a, M>>,
}

/// Builds a tensor-parallel rank's part of a model for its group, on a device.
pub type Splitter<'a, M> = dyn Fn(&ParallelGroups, &Device) -> anyhow::Result<M> + Sync + 'a;

/// One model for each rank of this process, with no copy left behind.
///
/// # Note: why the model is handed out
/// Clones of a Burn module share each lazy parameter's state: when one rank's engine
/// initialises a unit, every clone holds its values. A copy kept by the caller for the
/// length of the run (`launch(plan, |ctx| run(model.clone()))`) therefore ends up holding
/// the whole model, however the engines shard and release it. The last rank to ask gets
/// the original instead of a clone, so once each engine has replaced its parameters
/// nothing else refers to them.
pub(crate) struct Handout<M> {
    left: std::sync::Mutex<(usize, Option<M>)>,
}

impl<M: Clone> Handout<M> {
    /// `model` for the ranks `plan` runs in this process (all of them under threads, one
    /// under mpirun).
    pub(crate) fn new(model: M, plan: &Plan) -> Self {
        let ranks = if crate::processes::place().is_some() { 1 } else { plan.world_size() };
        Self { left: std::sync::Mutex::new((ranks, Some(model))) }
    }

    /// This rank's model: a clone, or the original for the last rank to ask.
    pub(crate) fn take(&self) -> M {
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        left.0 = left.0.saturating_sub(1);
        let model = if left.0 == 0 { left.1.take() } else { left.1.clone() };
        model.expect("one model per rank of this process")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    use zerotrain_models::{Gpt, GptConfig};

    /// Whether every float parameter of `model` holds a value.
    fn initialised<M: Module>(model: &M) -> bool {
        struct All(bool);
        impl ModuleVisitor for All {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0 &= param.is_initialized();
            }
        }
        let mut all = All(true);
        model.visit(&mut all);
        all.0
    }

    /// Clones of a lazy module share its parameters' values (the reason for the handout),
    /// and the last rank to take gets the original, leaving nothing behind.
    #[test]
    fn each_rank_takes_a_model_and_none_is_left_behind() {
        let device = Device::flex().autodiff();
        let config = GptConfig { vocab_size: 5, ..GptConfig::default() };
        let plan = zerotrain::Config::parse(r#"{"train_batch_size": 3, "zerotrain": {"world_size": 3}}"#, "t")
            .unwrap()
            .resolve(zerotrain::Overrides::default())
            .unwrap();
        let handout = Handout::new(Gpt::new(&config, &device), &plan);
        let models = [handout.take(), handout.take(), handout.take()];
        assert!(handout.left.lock().unwrap().1.is_none(), "the original went to the last rank");
        assert!(models.iter().all(|m| !initialised(m)));
        let _ = models[0].clone().into_record(); // reads every value through one rank's copy
        assert!(initialised(&models[2]), "clones share a lazy parameter's value");
    }
}
