//! Where a built-in model's parameters come from: fresh initialisation, or a checkpoint's
//! tensors by name ([`Weights`]). Either way each parameter is lazy (Burn initialises it on
//! first use): the engine initialises a model one unit at a time as it shards it, so an
//! imported model is read from its files one unit at a time, and never whole.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

use burn::module::{Param, ParamId};
use burn::nn::Initializer;
use burn::tensor::{Device, Shape, Tensor, TensorData};

use super::files::{TensorEntry, TensorFiles, check_float};
use zerotrain::Precision;
use zerotrain::engine::InitialValues;
use zerotrain_precision::{BufMut, FlatElem};

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
/// for (the model's parameter paths, checked against the files).
pub struct Weights {
    device: Device,
    std: f64,
    files: Option<Arc<TensorFiles>>,
    /// Names a checkpoint may write differently (GPT-2's without `transformer.`).
    alias: fn(&str) -> Option<String>,
    asked: RefCell<Vec<(String, Vec<usize>)>>,
    used: RefCell<BTreeSet<String>>,
    errors: RefCell<Vec<String>>,
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
        let (asked, used, errors) = Default::default();
        Self { device: device.clone(), std, files, alias, asked, used, errors }
    }

    /// The parameter at module path `name` of `shape`.
    pub fn param<const D: usize>(&self, name: &str, shape: [usize; D], init: Init) -> Param<Tensor<D>> {
        self.asked.borrow_mut().push((name.to_string(), shape.to_vec()));
        match &self.files {
            None => match init {
                Init::Normal => Initializer::Normal { mean: 0.0, std: self.std },
                Init::ScaledNormal(factor) => Initializer::Normal { mean: 0.0, std: self.std * factor },
                Init::Ones => Initializer::Ones,
                Init::Zeros => Initializer::Zeros,
            }
            .init(shape, &self.device),
            Some(files) => self.read(files, name, shape),
        }
    }

    /// A lazy parameter that reads `name` when first used; a placeholder of zeros (and an
    /// error recorded) if the files do not hold it as `shape`.
    fn read<const D: usize>(&self, files: &Arc<TensorFiles>, name: &str, shape: [usize; D]) -> Param<Tensor<D>> {
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
        Param::uninitialized(
            ParamId::new(),
            move |device, require_grad| {
                let entry = files.get(&file_name).expect("checked when the model was built");
                let data = TensorData::new(files.read_f32(entry), shape);
                let tensor = Tensor::<D>::from_data(data, device);
                if require_grad { tensor.require_grad() } else { tensor }
            },
            self.device.clone(),
            true,
            Shape::from(shape),
        )
    }

    /// Where an engine reads the first values of the parameters straight from the files
    /// ([`UnitModel::initial_values`](zerotrain::engine::UnitModel::initial_values)); `None` for
    /// fresh ones.
    pub fn initial_values(&self) -> Option<Arc<dyn InitialValues>> {
        let files = Arc::clone(self.files.as_ref()?);
        Some(Arc::new(FileValues { files, alias: self.alias, reader: std::sync::Mutex::new(None) }))
    }

    /// Every (module path, shape) asked for, in order.
    pub fn asked(&self) -> Vec<(String, Vec<usize>)> {
        self.asked.borrow().clone()
    }

    /// Ends the build: an error listing what the files lack or hold wrongly, and tensors
    /// they hold that the model has no place for (`ignored` says which may be dropped:
    /// buffers such as GPT-2's attention masks).
    pub fn finish(self, ignored: impl Fn(&str) -> bool) -> Result<(), String> {
        let mut errors = self.errors.into_inner();
        if let Some(files) = &self.files {
            let used = self.used.borrow();
            let extra: Vec<&str> = files.names().filter(|n| !used.contains(*n) && !ignored(n)).collect();
            if let Some(first) = extra.first() {
                let at = files.file_of(files.get(first).expect("listed")).display();
                errors.push(format!(
                    "{at}: tensor `{first}` has no place in the model ({} such tensor(s)): is config.json the \
                     checkpoint's own?",
                    extra.len()
                ));
            }
        }
        match errors.len() {
            0 => Ok(()),
            1 => Err(errors.remove(0)),
            n => Err(format!("{} (and {} more problem(s))", errors[0], n - 1)),
        }
    }
}

/// A checkpoint's tensors as the first values of its model's parameters, by module path
/// (or the name the alias gives).
struct FileValues {
    files: Arc<TensorFiles>,
    alias: fn(&str) -> Option<String>,
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
        let len: usize = entry.shape.iter().product();
        if elems.end > len || dst.len() != elems.len() {
            let at = files.file_of(entry).display();
            return Err(format!("{at}: tensor `{path}` has {len} elements; elements {elems:?} were asked for"));
        }
        let first = elems.start;
        files.read_into(entry, elems, dst.reborrow());
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
