//! A family model's place on a device mesh ([`MeshPart`]): the groups it was built for,
//! how its parameters are cut, and what its forward does with them (its part of each
//! sequence, the vocabulary's parts put together); and the shapes a mesh refuses.

use std::collections::BTreeMap;

use burn::tensor::{Int, Tensor};
use zerotrain::nn::parallel::{ModelSplit, ParallelGroup, Split, vocab_parallel_lookup};

use crate::hf::weights::Weights;

/// Where a model built from a [`Weights`] sits on a mesh; the whole model on one rank
/// where its groups are of one rank.
#[derive(Debug, Clone)]
pub(crate) struct MeshPart {
    split: ModelSplit,
    /// The whole vocabulary's size.
    vocab: usize,
}

impl MeshPart {
    /// The part `w` builds (call it once the model's parameters are asked for: it records
    /// how they were cut), of a vocabulary of `vocab` ids.
    pub fn of(w: &Weights, vocab: usize) -> Self {
        let (group, sequence) = (w.tensor_parallel().clone(), w.sequence_parallel().clone());
        let splits: BTreeMap<String, Split> = w.splits();
        Self { split: ModelSplit { tensor: group, splits, sequence }, vocab }
    }

    /// The part `split` describes, of a vocabulary of `vocab` ids (a model cut by
    /// [`split_module`](zerotrain::nn::parallel::split_module)).
    pub fn new(split: ModelSplit, vocab: usize) -> Self {
        Self { split, vocab }
    }

    /// The group the layers are split over (a group of one: none).
    pub fn group(&self) -> &ParallelGroup {
        &self.split.tensor
    }

    /// The embeddings `[batch, time, d]` of `ids` `[batch, time]` in a token table `[rows,
    /// d]` of this rank's rows of the vocabulary (the whole table without a split).
    pub fn lookup(&self, table: Tensor<2>, ids: Tensor<2, Int>) -> Tensor<3> {
        let group = &self.split.tensor;
        match group.size() {
            1 => burn::tensor::module::embedding(table, ids),
            _ => vocab_parallel_lookup(table, group.part(self.vocab).start, ids, group),
        }
    }

    /// The split, as the engine asks for it (`UnitModel::model_split`).
    pub fn model_split(&self) -> ModelSplit {
        self.split.clone()
    }

    /// The head's group and the whole vocabulary, for the vocabulary-parallel loss.
    pub fn vocabulary(&self) -> Option<(&ParallelGroup, usize)> {
        Some((&self.split.tensor, self.vocab))
    }

    /// The whole logits from this rank's part of the vocabulary's (for inference).
    pub fn logits(&self, part: Tensor<3>) -> Tensor<3> {
        self.split.tensor.gather_parts(part, self.vocab)
    }

    /// The sequence group, where the units run a part of every sequence.
    pub fn sequence(&self) -> Option<&ParallelGroup> {
        (self.split.sequence.size() > 1).then_some(&self.split.sequence)
    }

    /// The position of the first of this rank's `time` tokens of a sequence.
    pub fn first(&self, time: usize) -> usize {
        self.sequence().map_or(0, |seq| seq.rank() * time)
    }

    /// This rank's part of the sequences of `ids` `[batch, time]` (consecutive, `time /
    /// size` each; all of them without sequence parallelism) and its first position.
    ///
    /// # Panics
    /// Where the time does not divide by the group's size, naming both (the command refuses
    /// such a context before anything is built).
    pub fn inputs(&self, ids: Tensor<2, Int>) -> (Tensor<2, Int>, usize) {
        let Some(seq) = self.sequence() else { return (ids, 0) };
        let [_, t] = ids.dims();
        let n = seq.size();
        assert!(t % n == 0, "a context of {t} tokens does not divide by the sequence-parallel size {n}");
        let part = t / n;
        (ids.narrow(1, seq.rank() * part, part), seq.rank() * part)
    }
}

/// Records with `w` (as its [`finish`](Weights::finish) error) each of `fields` (a config
/// field, its value, and whether the sequence group splits it too: heads) that does not
/// divide over `w`'s tensor-parallel group (times its sequence-parallel one).
pub(crate) fn refuse_undivided(w: &Weights, fields: &[(&str, usize, bool)]) {
    let (tp, sp) = (w.tensor_parallel().size(), w.sequence_parallel().size());
    for &(field, value, heads) in fields {
        let (n, what) = match heads && sp > 1 {
            true => (tp * sp, format!("the tensor- times the sequence-parallel size {tp} x {sp}")),
            false => (tp, format!("the tensor-parallel size {tp}")),
        };
        if value % n != 0 {
            w.refuse(format!("config.json: `{field}` ({value}) does not divide by {what}"));
        }
    }
}
