//! A model fine-tuned with low-rank adapters, as [`Weights`] builds it: every parameter
//! frozen but `modules_to_save`, an adapter on each linear layer the LoRA config names
//! (fresh, or read from a PEFT adapter's tensors), and the checks the build ends with.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::Arc;

use burn::module::Param;
use burn::nn::Initializer;
use burn::tensor::{Tensor, TensorData};
use zerotrain::nn::lora::{AdapterCut, LoraAdapter, LoraConfig};
use zerotrain::nn::parallel::Split;

use super::super::files::{TensorFiles, check_float};
use super::super::{peft, slices};
use super::Weights;

/// What [`Weights::with_lora`] adapts, and what it has met.
pub(super) struct Adapting {
    config: Arc<LoraConfig>,
    /// The family's targets where the config names none (PEFT's table).
    defaults: &'static [&'static str],
    /// Fresh adapters are drawn from it and their names.
    seed: u64,
    /// Every linear layer built: (path, whether it is the output head).
    linears: RefCell<Vec<(String, bool)>>,
    /// Adapted layers' paths.
    adapted: RefCell<Vec<String>>,
    /// An adapter's tensors to start from (PEFT's names), instead of fresh ones.
    files: Option<Arc<TensorFiles>>,
    /// The names of `files` read so far.
    used: RefCell<BTreeSet<String>>,
}

/// Which of an adapted layer's features are split over the tensor-parallel group: the
/// output's (B's rows cut as given) or the input's (A's columns).
#[derive(Debug, Clone, Copy)]
pub enum Features {
    /// Neither.
    Whole,
    /// The output features, split as B's rows are.
    Output(Split),
    /// The input features.
    Input,
}

impl Weights {
    /// The same source for a model fine-tuned with low-rank adapters: every parameter
    /// frozen but those of `config`'s `modules_to_save`, and an adapter on each linear layer
    /// it names ([`adapter`](Self::adapter)), fresh ones drawn from `seed` and their names;
    /// `defaults` are the family's targets where the config names none.
    pub fn with_lora(mut self, config: Arc<LoraConfig>, defaults: &'static [&'static str], seed: u64) -> Self {
        let (linears, adapted, used) = Default::default();
        self.lora = Some(Adapting { config, defaults, seed, linears, adapted, files: None, used });
        self
    }

    /// The same source starting the adapters from an adapter's tensors (PEFT's
    /// `adapter_model.safetensors`), which must hold every factor the config adapts, at its
    /// shape, and nothing else. Only after [`with_lora`](Self::with_lora).
    pub fn with_adapter_files(mut self, files: Arc<TensorFiles>) -> Self {
        if let Some(lora) = &mut self.lora {
            lora.files = Some(files);
        }
        self
    }

    /// The adapter of the linear layer at module path `name` (`head`: the output head),
    /// if the LoRA config names it: `A` `[r, d_in]` and `B` `[out, r]` (PEFT's shapes),
    /// this rank's part of them as `features` says the layer is split, `cut` the layer's
    /// tensor-parallel rule. Records the layer for the checks [`finish`](Self::finish)
    /// makes.
    pub fn adapter(
        &self,
        name: &str,
        [d_in, out]: [usize; 2],
        features: Features,
        cut: AdapterCut,
        head: bool,
    ) -> Option<LoraAdapter> {
        let lora = self.lora.as_ref()?;
        lora.linears.borrow_mut().push((name.to_string(), head));
        let spec = match lora.config.adapter(name, true, head, lora.defaults) {
            Ok(spec) => spec?,
            Err(problem) => {
                self.refuse(format!("zerotrain.lora.{problem}"));
                return None;
            }
        };
        lora.adapted.borrow_mut().push(name.to_string());
        let [init_a, init_b] = zerotrain::nn::lora::initializers(&spec, d_in);
        let (a_split, b_split) = match features {
            Features::Whole => (Split::Whole, Split::Whole),
            Features::Output(split) => (Split::Whole, split),
            Features::Input => (Split::Even { dim: 1, blocks: 1 }, Split::Whole),
        };
        let a = self.factor(lora, &format!("{name}.adapter.a"), [spec.r, d_in], a_split, &init_a);
        let b = self.factor(lora, &format!("{name}.adapter.b"), [out, spec.r], b_split, &init_b);
        Some(LoraAdapter::new(a, b, &spec, cut))
    }

    /// An adapter factor, read from the adapter's files or drawn whole from the seed and
    /// `name`, sliced for this rank: initialised now (it is small), so that an engine
    /// reading a checkpoint's values for the base does not look for it there.
    pub(super) fn factor(
        &self,
        lora: &Adapting,
        name: &str,
        whole: [usize; 2],
        split: Split,
        init: &Initializer,
    ) -> Param<Tensor<2>> {
        self.asked.borrow_mut().push((name.to_string(), whole.to_vec()));
        let (rank, n) = (self.tp.rank(), self.tp.size());
        if n > 1 && split != Split::Whole {
            self.splits.borrow_mut().insert(name.to_string(), split);
        }
        let count = whole.iter().product();
        let values = match (&lora.files, init) {
            (Some(files), _) => {
                let peft = peft::tensor_name(name).expect("a factor's path");
                match files.get(&peft) {
                    Some(entry) if entry.shape == whole && check_float(entry).is_ok() => {
                        lora.used.borrow_mut().insert(peft);
                        files.read_f32(entry)
                    }
                    Some(entry) => {
                        let at = files.file_of(entry).display();
                        self.refuse(format!(
                            "{at}: tensor `{peft}` has shape {:?} ({:?}); the model needs {whole:?} (float): is the \
                             adapter for another base?",
                            entry.shape, entry.dtype
                        ));
                        vec![0.0; count]
                    }
                    None => {
                        self.refuse(format!(
                            "the adapter's tensors lack `{peft}`, which its adapter_config.json asks for (shape \
                             {whole:?})"
                        ));
                        vec![0.0; count]
                    }
                }
            }
            (None, &Initializer::Uniform { min, max }) => {
                slices::drawn_uniform(lora.seed, name, count, (max - min) / 2.0)
            }
            (None, &Initializer::Normal { std, .. }) => slices::drawn(lora.seed, name, count, std),
            _ => vec![0.0; count],
        };
        let tensor = Tensor::<2>::from_data(TensorData::new(values, whole), &self.device);
        match split.slice(tensor, rank, n, name) {
            Ok(tensor) => Param::from_tensor(tensor),
            Err(e) => {
                self.refuse(e.to_string());
                Initializer::Zeros.init(whole, &self.device)
            }
        }
    }

    /// The module paths of the parameters asked for so far that are frozen (none without
    /// LoRA; with it, all but the adapters and `modules_to_save`): the model's
    /// [`frozen_parameters`](zerotrain::engine::UnitModel::frozen_parameters).
    pub fn frozen_parameters(&self) -> Vec<String> {
        if self.lora.is_none() {
            return Vec::new();
        }
        let asked = self.asked.borrow();
        asked
            .iter()
            .filter(|(n, _)| peft::tensor_name(n).is_none() && !self.trains(n))
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// A `modules_to_save` parameter the adapter's files hold (PEFT saves them as
    /// `base_model.model.<path>`): this rank's slice of it, read now (the engine reads an
    /// initialised parameter from the model, not from the base's files), and the base's own
    /// tensor counted as used. `None` where there is no such tensor.
    pub(super) fn saved_in_adapter<const D: usize>(
        &self,
        name: &str,
        whole: [usize; D],
        split: Split,
    ) -> Option<Param<Tensor<D>>> {
        let lora = self.lora.as_ref()?;
        let files = lora.files.as_ref()?;
        let peft = format!("{}{name}", peft::PREFIX);
        let entry = files.get(&peft).filter(|_| lora.config.trains_whole(name))?;
        lora.used.borrow_mut().insert(peft.clone());
        if let Some(base) = &self.files {
            let own = base
                .get(name)
                .map(|_| name.to_string())
                .or_else(|| (self.alias)(name).filter(|a| base.get(a).is_some()));
            self.used.borrow_mut().extend(own);
        }
        if entry.shape != whole || check_float(entry).is_err() {
            let at = files.file_of(entry).display();
            self.refuse(format!(
                "{at}: tensor `{peft}` has shape {:?} ({:?}); the model needs {whole:?} (float)",
                entry.shape, entry.dtype
            ));
            return Some(Initializer::Zeros.init(whole, &self.device));
        }
        let tensor = Tensor::<D>::from_data(TensorData::new(files.read_f32(entry), whole), &self.device);
        let (rank, n) = (self.tp.rank(), self.tp.size());
        Some(match split.slice(tensor, rank, n, name) {
            Ok(tensor) => Param::from_tensor(tensor),
            Err(e) => {
                self.refuse(e.to_string());
                Initializer::Zeros.init(whole, &self.device)
            }
        })
    }

    /// Whether the parameter at `name` trains: every one without LoRA; with it, only those
    /// below a module `modules_to_save` names, all of them, as PEFT trains the copy it wraps
    /// (adapters are made by [`adapter`](Self::adapter)).
    pub(super) fn trains(&self, name: &str) -> bool {
        let Some(lora) = &self.lora else { return true };
        lora.config.trains_whole(name)
    }

    /// The LoRA checks [`finish`](Self::finish) makes: the targets against the layers
    /// built, and every tensor of the adapter's files read.
    pub(super) fn finish_adapting(&self) {
        let Some(lora) = &self.lora else { return };
        let modules = zerotrain::nn::lora::modules_above(self.asked.borrow().iter().map(|(name, _)| name.as_str()));
        if let Err(problem) = lora.config.check_against(&lora.linears.borrow(), &modules, lora.defaults) {
            self.refuse(format!("zerotrain.lora: {problem}"));
        }
        if let Some(files) = &lora.files {
            let used = lora.used.borrow();
            let hint = "is the adapter for another base, or its adapter_config.json another adapter's?";
            if let Some(problem) = super::unplaced(files, |n| used.contains(n), hint) {
                self.refuse(problem);
            }
        }
    }
}
