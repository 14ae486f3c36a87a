//! Where a built-in model's parameters come from: fresh initialisation, or a checkpoint's
//! tensors by name ([`Weights`]). Either way each parameter is lazy (Burn initialises it on
//! first use): the engine initialises a model one unit at a time as it shards it, so an
//! imported model is read from its files one unit at a time, and never whole.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;

use burn::module::{Param, ParamId};
use burn::nn::Initializer;
use burn::tensor::{Device, Shape, Tensor, TensorData};

use super::files::{TensorEntry, TensorFiles, check_float};
use super::slices;
use adapting::Adapting;
pub use adapting::Features;
use zerotrain::Precision;
use zerotrain::engine::InitialValues;
use zerotrain::nn::parallel::{ParallelGroup, ParallelGroups, Split, within};
use zerotrain_precision::{BufMut, FlatElem};

mod adapting;

/// How a fresh parameter starts (Hugging Face's `_init_weights` for these families).
#[derive(Debug, Clone, Copy)]
pub enum Init {
    /// N(0, `initializer_range`): projections and embeddings.
    Normal,
    /// N(0, `initializer_range` x the factor): GPT-2's residual projections (`c_proj`),
    /// scaled by 1/sqrt(2 n_layer) as GPT-2's paper and Hugging Face's `_init_weights` do.
    ScaledNormal(f64),
    /// Ones: norm scales.
    Ones,
    /// Zeros: biases.
    Zeros,
}

/// The source of a model's parameters while it is built; records every name it is asked
/// for (the model's parameter paths, checked against the files). Built for a
/// tensor-parallel group ([`with_tensor_parallel`](Self::with_tensor_parallel)), it gives
/// each split parameter as this rank's slice.
pub struct Weights {
    device: Device,
    std: f64,
    files: Option<Arc<TensorFiles>>,
    /// Names a checkpoint may write differently (GPT-2's without `transformer.`).
    alias: fn(&str) -> Option<String>,
    asked: RefCell<Vec<(String, Vec<usize>)>>,
    used: RefCell<BTreeSet<String>>,
    errors: RefCell<Vec<String>>,
    /// The group whose rank's slices split parameters are (alone: nothing is split).
    tp: ParallelGroup,
    /// Fresh values drawn per parameter from this seed and its name, not from the device's
    /// generator (set with a group: every rank must draw the same whole tensors).
    seed: Option<u64>,
    /// The split parameters, by module path.
    splits: RefCell<BTreeMap<String, Split>>,
    /// The ranks that split each sequence (no parameter is split over them).
    sequence: ParallelGroup,
    /// Low-rank adapters on the layers a LoRA config names, the rest of the model frozen.
    lora: Option<Adapting>,
}

impl Weights {
    /// Fresh parameters on `device`, normal ones with standard deviation `std`.
    pub fn fresh(device: &Device, std: f64) -> Self {
        Self::new(device, std, None, |_| None)
    }

    /// Parameters read from `files`, by name or by the name `alias` gives.
    pub fn from_files(device: &Device, files: Arc<TensorFiles>, alias: fn(&str) -> Option<String>) -> Self {
        Self::new(device, 0.0, Some(files), alias)
    }

    fn new(device: &Device, std: f64, files: Option<Arc<TensorFiles>>, alias: fn(&str) -> Option<String>) -> Self {
        let (asked, used, errors, splits) = Default::default();
        let (tp, seed, sequence) = (ParallelGroup::alone(), None, ParallelGroup::alone());
        Self { device: device.clone(), std, files, alias, asked, used, errors, tp, seed, splits, sequence, lora: None }
    }

    /// The same source for rank `group.rank()` of a tensor-parallel group: each parameter
    /// asked for with a [`Split`] is this rank's slice of it, read from the files or drawn;
    /// fresh values are drawn from `seed` and each parameter's name (the same whole
    /// tensors on every rank, whatever order they are first used in).
    pub fn with_tensor_parallel(mut self, group: ParallelGroup, seed: u64) -> Self {
        self.tp = group;
        self.seed = Some(seed);
        self
    }

    /// The same source for a model built for `groups`: the tensor group's slices (as
    /// [`with_tensor_parallel`](Self::with_tensor_parallel)) and the sequence group the
    /// model's units split each sequence over.
    pub fn with_groups(self, groups: &ParallelGroups, seed: u64) -> Self {
        let mut w = self.with_tensor_parallel(groups.tensor.clone(), seed);
        w.sequence = groups.sequence.clone();
        w
    }

    /// The tensor-parallel group the slices are for (a group of one rank by default).
    pub fn tensor_parallel(&self) -> &ParallelGroup {
        &self.tp
    }

    /// The sequence-parallel group (a group of one rank by default).
    pub fn sequence_parallel(&self) -> &ParallelGroup {
        &self.sequence
    }

    /// The split parameters asked for so far, by module path.
    pub fn splits(&self) -> BTreeMap<String, Split> {
        self.splits.borrow().clone()
    }

    /// Records a problem the build must end with ([`finish`](Self::finish) returns it): a
    /// shape the model cannot take, named by its config field.
    pub fn refuse(&self, problem: String) {
        self.errors.borrow_mut().push(problem);
    }

    /// The parameter at module path `name` of `shape`.
    pub fn param<const D: usize>(&self, name: &str, shape: [usize; D], init: Init) -> Param<Tensor<D>> {
        self.split_param(name, shape, Split::Whole, init)
    }

    /// This rank's slice under `split` of the parameter at module path `name`, whose whole
    /// shape is `whole` (the whole parameter for [`Split::Whole`] or a group of one rank).
    pub fn split_param<const D: usize>(
        &self,
        name: &str,
        whole: [usize; D],
        split: Split,
        init: Init,
    ) -> Param<Tensor<D>> {
        self.asked.borrow_mut().push((name.to_string(), whole.to_vec()));
        let (rank, n) = (self.tp.rank(), self.tp.size());
        let local = match split.local_shape(whole, rank, n, name) {
            Ok(local) => local,
            Err(e) => {
                self.refuse(e.to_string());
                return Initializer::Zeros.init(whole, &self.device);
            }
        };
        if n > 1 && split != Split::Whole {
            self.splits.borrow_mut().insert(name.to_string(), split);
        }
        if let Some(param) = self.saved_in_adapter(name, whole, split) {
            return param;
        }
        let param = match (&self.files, self.seed) {
            (Some(files), _) => self.read(files, name, whole, split),
            (None, Some(seed)) => self.drawn(seed, name, whole, local, split, init),
            (None, None) => self.generated(whole, init),
        };
        if self.trains(name) { param } else { param.set_require_grad(false) }
    }

    /// A fresh parameter from the device's generator.
    fn generated<const D: usize>(&self, shape: [usize; D], init: Init) -> Param<Tensor<D>> {
        match init {
            Init::Normal => Initializer::Normal { mean: 0.0, std: self.std },
            Init::ScaledNormal(factor) => Initializer::Normal { mean: 0.0, std: self.std * factor },
            Init::Ones => Initializer::Ones,
            Init::Zeros => Initializer::Zeros,
        }
        .init(shape, &self.device)
    }

    /// A fresh, lazy parameter: this rank's slice of the whole tensor drawn from `seed` and
    /// `name` ([`slices::drawn`]), or ones or zeros.
    fn drawn<const D: usize>(
        &self,
        seed: u64,
        name: &str,
        whole: [usize; D],
        local: [usize; D],
        split: Split,
        init: Init,
    ) -> Param<Tensor<D>> {
        let std = match init {
            Init::Normal => self.std,
            Init::ScaledNormal(factor) => self.std * factor,
            Init::Ones => return Initializer::Ones.init(local, &self.device),
            Init::Zeros => return Initializer::Zeros.init(local, &self.device),
        };
        let (name, rank, n) = (name.to_string(), self.tp.rank(), self.tp.size());
        let make = move |device: &Device| {
            let values = slices::drawn(seed, &name, whole.iter().product(), std);
            let tensor = Tensor::<D>::from_data(TensorData::new(values, whole), device);
            split.slice(tensor, rank, n, &name).expect("the split was checked when the model was built")
        };
        lazy(make, local, &self.device)
    }

    /// A lazy parameter that reads `name` (this rank's slice under `split`) when first used;
    /// a placeholder of zeros (and an error recorded) if the files do not hold it as `shape`.
    fn read<const D: usize>(
        &self,
        files: &Arc<TensorFiles>,
        name: &str,
        shape: [usize; D],
        split: Split,
    ) -> Param<Tensor<D>> {
        let found = files
            .get(name)
            .map(|e| (name.to_string(), e))
            .or_else(|| (self.alias)(name).and_then(|a| files.get(&a).map(|e| (a, e))));
        let problem = match &found {
            None => Some(format!("no file holds tensor `{name}`, which the model needs (shape {shape:?})")),
            Some((file_name, entry)) => {
                self.used.borrow_mut().insert(file_name.to_string());
                let at = files.file_of(entry).display();
                if entry.shape != shape {
                    Some(format!("{at}: tensor `{file_name}` has shape {:?}; the config needs {shape:?}", entry.shape))
                } else {
                    check_float(entry).err().map(|why| format!("{at}: tensor `{file_name}` {why}"))
                }
            }
        };
        if let Some(problem) = problem {
            self.errors.borrow_mut().push(problem);
            return Initializer::Zeros.init(shape, &self.device);
        }
        let files = Arc::clone(files);
        let file_name = found.expect("checked").0;
        let (rank, n) = (self.tp.rank(), self.tp.size());
        let local = split.local_shape(shape, rank, n, name).expect("checked by split_param");
        let make = move |device: &Device| {
            let entry = files.get(&file_name).expect("checked when the model was built");
            let tensor = Tensor::<D>::from_data(TensorData::new(files.read_f32(entry), shape), device);
            split.slice(tensor, rank, n, &file_name).expect("checked by split_param")
        };
        lazy(make, local, &self.device)
    }

    /// Where an engine reads the first values of the parameters straight from the files
    /// ([`UnitModel::initial_values`](zerotrain::engine::UnitModel::initial_values)); `None` for
    /// fresh ones.
    pub fn initial_values(&self) -> Option<Arc<dyn InitialValues>> {
        let files = Arc::clone(self.files.as_ref()?);
        let (splits, place) = (self.splits(), (self.tp.rank(), self.tp.size()));
        Some(Arc::new(FileValues { files, alias: self.alias, splits, place, reader: std::sync::Mutex::new(None) }))
    }

    /// Every (module path, shape) asked for, in order.
    pub fn asked(&self) -> Vec<(String, Vec<usize>)> {
        self.asked.borrow().clone()
    }

    /// Ends the build: an error listing what the files lack or hold wrongly, and tensors
    /// they hold that the model has no place for (`ignored` says which may be dropped:
    /// buffers such as GPT-2's attention masks).
    pub fn finish(self, ignored: impl Fn(&str) -> bool) -> Result<(), String> {
        self.finish_adapting();
        let mut errors = self.errors.into_inner();
        if let Some(files) = &self.files {
            let used = self.used.borrow();
            errors.extend(unplaced(files, |n| used.contains(n) || ignored(n), "is config.json the checkpoint's own?"));
        }
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            n => Err(format!("{} (and {} more problem(s))", errors[0], n - 1)),
        }
    }
}

/// The message for the tensors of `files` that `placed` does not accept, if any: the
/// first, how many, and `hint` at why.
fn unplaced(files: &TensorFiles, placed: impl Fn(&str) -> bool, hint: &str) -> Option<String> {
    let extra: Vec<&str> = files.names().filter(|n| !placed(n)).collect();
    let first = extra.first()?;
    let at = files.file_of(files.get(first).expect("listed")).display();
    Some(format!("{at}: tensor `{first}` has no place in the model ({} such tensor(s)): {hint}", extra.len()))
}

/// A checkpoint's tensors as the first values of its model's parameters, by module path
/// (or the name the alias gives): this rank's slice of a split one.
struct FileValues {
    files: Arc<TensorFiles>,
    alias: fn(&str) -> Option<String>,
    /// The split parameters (this rank's slices are read), and (rank, group size).
    splits: BTreeMap<String, Split>,
    place: (usize, usize),
    /// The thread reading ahead ([`InitialValues::prefetch`]), started by the first hint; it
    /// ends when this is dropped.
    reader: std::sync::Mutex<Option<std::sync::mpsc::Sender<String>>>,
}

/// The first element of `values` that is NaN or infinite, and its value, searched on every
/// core.
fn first_non_finite(values: BufMut<'_>) -> Option<(usize, f32)> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    zerotrain_precision::with_elem!(BufMut, values, v, E => {
        v.par_chunks(CHUNK).enumerate().find_map_first(|(c, chunk)| {
            let i = chunk.iter().position(|x| !E::to_f32(*x).is_finite())?;
            Some((c * CHUNK + i, E::to_f32(chunk[i])))
        })
    })
}

/// The file entry of the parameter at module path `path`, under its own name or the one
/// `alias` gives.
fn entry<'a>(files: &'a TensorFiles, alias: fn(&str) -> Option<String>, path: &str) -> Option<&'a TensorEntry> {
    files.get(path).or_else(|| alias(path).and_then(|name| files.get(&name)))
}

impl std::fmt::Debug for FileValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FileValues({} tensors)", self.files.names().count())
    }
}

impl InitialValues for FileValues {
    /// Reads the elements and checks them: a NaN or an infinity among a checkpoint's
    /// weights is refused naming the tensor and the element, rather than training on it
    /// (every step would be skipped as an overflow) or scoring it (NaN).
    fn read(&self, path: &str, elems: Range<usize>, mut dst: BufMut<'_>) -> Result<(), String> {
        let files = &self.files;
        let entry = entry(files, self.alias, path).ok_or_else(|| format!("no file holds tensor `{path}`"))?;
        let split = self.splits.get(path).copied().unwrap_or(Split::Whole);
        let (rank, n) = self.place;
        let runs = split.runs(&entry.shape, rank, n, path).map_err(|e| e.to_string())?;
        let len: usize = runs.iter().map(|r| r.1).sum();
        if elems.end > len || dst.len() != elems.len() {
            let at = files.file_of(entry).display();
            return Err(format!("{at}: tensor `{path}` has {len} elements here; elements {elems:?} were asked for"));
        }
        let first = elems.start;
        for (whole, part) in within(&runs, elems.clone()) {
            let at = part.start - first..part.end - first;
            files.read_into(entry, whole, dst.reborrow().slice(at));
        }
        if let Some((i, value)) = first_non_finite(dst) {
            let at = files.file_of(entry).display();
            return Err(format!(
                "{at}: tensor `{path}` holds {value} at element {} of {len}: the checkpoint is damaged, or its \
                 training diverged",
                first + i
            ));
        }
        Ok(())
    }

    fn dtype(&self, path: &str) -> Option<Precision> {
        entry(&self.files, self.alias, path).map(TensorEntry::precision)
    }

    /// Hands the tensor's name to a thread of its own, which asks the kernel to read its
    /// bytes into the page cache: the engine's threads then find them there instead of
    /// waiting on each page of the map in turn.
    fn prefetch(&self, path: &str) {
        let mut reader = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        let sender = reader.get_or_insert_with(|| {
            let (sender, names) = std::sync::mpsc::channel::<String>();
            let (files, alias) = (Arc::clone(&self.files), self.alias);
            std::thread::spawn(move || {
                for path in names {
                    if let Some(entry) = entry(&files, alias, &path) {
                        files.will_need(entry);
                    }
                }
            });
            sender
        });
        let _ = sender.send(path.to_owned());
    }
}

/// A parameter of `shape` that `make` computes on first use.
fn lazy<const D: usize>(
    make: impl Fn(&Device) -> Tensor<D> + Send + Sync + 'static,
    shape: [usize; D],
    device: &Device,
) -> Param<Tensor<D>> {
    Param::uninitialized(
        ParamId::new(),
        move |device, require_grad| {
            let tensor = make(device);
            if require_grad { tensor.require_grad() } else { tensor }
        },
        device.clone(),
        true,
        Shape::from(shape),
    )
}
