//! Which windows of a token file a run trains on, in what order ([`TokenSampler`]).
//!
//! # Note: the order is a function of the sample count
//! The training split is cut into windows of `context + 1` tokens, `context` apart (each
//! token is predicted once per epoch). Sample `k` of a run (counting every sequence of
//! every global batch) is window `perm_e(k mod n)` of epoch `e = k / n`, `perm_e` a
//! shuffle seeded by `(seed, e)`. A checkpoint records how many samples were drawn, so a
//! resume at any world size, or with another batch size, continues the same sequence of
//! samples exactly; the corpus itself is read through the map, window by window.

use std::sync::{Arc, Mutex};

use burn::tensor::{Device, Int, Tensor, TensorData};

use super::tokens::TokenFile;
use zerotrain::random::splitmix64;

/// Validation windows at most.
pub const VALIDATION_WINDOWS: usize = 32;

/// Training and validation windows of a token file.
#[derive(Debug)]
pub struct TokenSampler {
    file: Arc<TokenFile>,
    context: usize,
    windows: usize,
    order: Shuffle,
}

/// Which of `n` items sample `k` of a run is: item `perm_e(k mod n)` of epoch `e = k / n`,
/// `perm_e` a shuffle seeded by `(seed, e)` (the module note).
#[derive(Debug)]
pub(crate) struct Shuffle {
    n: usize,
    seed: u64,
    /// The shuffle of the epoch last asked for.
    order: Mutex<(u64, Vec<u32>)>,
}

impl Shuffle {
    /// Shuffles of `n` items (at least 1, at most 2^32).
    pub(crate) fn new(n: usize, seed: u64) -> Self {
        Self { n, seed, order: Mutex::new((u64::MAX, Vec::new())) }
    }

    /// The item sample `k` is.
    pub(crate) fn item(&self, k: u64) -> usize {
        let n = self.n as u64;
        let (epoch, i) = (k / n, (k % n) as usize);
        let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
        if order.0 != epoch {
            let mut perm: Vec<u32> = (0..self.n as u32).collect();
            let mut state = self.seed ^ epoch.wrapping_mul(0xA24B_AED4_963E_E407);
            for j in (1..perm.len()).rev() {
                let r = (splitmix64(&mut state) % (j as u64 + 1)) as usize;
                perm.swap(j, r);
            }
            *order = (epoch, perm);
        }
        order.1[i] as usize
    }
}

impl TokenSampler {
    /// Windows of `context + 1` tokens of `file`; an error naming the file when either
    /// split holds less than one window.
    pub fn new(file: Arc<TokenFile>, context: usize, seed: u64) -> Result<Self, String> {
        let windows = file.train_tokens().saturating_sub(1) / context;
        let held = file.len() - file.train_tokens();
        let name = file.path().display().to_string();
        if windows == 0 {
            return Err(format!(
                "{name}: its training split has {} tokens, fewer than one window of {} (model.block_size + 1)",
                file.train_tokens(),
                context + 1
            ));
        }
        if held < context + 1 {
            return Err(format!(
                "{name}: its held-out split has {held} tokens, fewer than one window of {}: give a longer text (train \
                 --data holds out 1% of it), tokenize it with `zerotrain tokenize --valid-fraction F` and train on the \
                 token file, or set a shorter model.block_size",
                context + 1
            ));
        }
        if windows > u32::MAX as usize {
            return Err(format!("{name}: more than 2^32 windows; use a longer model.block_size"));
        }
        Ok(Self { file, context, windows, order: Shuffle::new(windows, seed) })
    }

    /// The model's context (windows are one token longer).
    pub fn context(&self) -> usize {
        self.context
    }

    /// Training windows per epoch.
    pub fn windows(&self) -> usize {
        self.windows
    }

    /// The first token of sample `k`'s window.
    pub fn start(&self, k: u64) -> usize {
        self.order.item(k) * self.context
    }

    /// Samples `first..first + count` as a batch `[count, context + 1]`.
    pub fn batch(&self, first: u64, count: u64, device: &Device) -> Tensor<2, Int> {
        let mut data = Vec::with_capacity(count as usize * (self.context + 1));
        for k in first..first + count {
            let start = self.start(k);
            self.file.extend(start..start + self.context + 1, &mut data);
        }
        Tensor::from_data(TensorData::new(data, [count as usize, self.context + 1]), device)
    }

    /// The held-out windows (at most [`VALIDATION_WINDOWS`]), in order.
    pub fn validation(&self, device: &Device) -> Tensor<2, Int> {
        let from = self.file.train_tokens();
        let count = ((self.file.len() - from - 1) / self.context).min(VALIDATION_WINDOWS);
        let mut data = Vec::with_capacity(count * (self.context + 1));
        for w in 0..count {
            let start = from + w * self.context;
            self.file.extend(start..start + self.context + 1, &mut data);
        }
        Tensor::from_data(TensorData::new(data, [count, self.context + 1]), device)
    }
}
