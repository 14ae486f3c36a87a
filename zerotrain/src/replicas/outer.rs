//! The outer optimizer of replica groups: SGD on the global weights, stepped with the
//! pseudo-gradient, in PyTorch's `torch.optim.SGD` arithmetic (f32, no dampening):
//! `buf = g` at the first step, `buf = momentum * buf + g` after; the update is
//! `g + momentum * buf` with Nesterov momentum, `buf` without (`g` without momentum);
//! `w -= lr * update`.
//!
//! # Note: Delayed Nesterov
//! Asynchronous rounds ([`Delayed`]) apply each group's pseudo-gradient as it arrives, but
//! momentum on single pushes would multiply stale directions (Liu et al. 2024, "Asynchronous
//! Local-SGD Training for Language Modeling"). So, as their Delayed Nesterov does, each push
//! moves the weights by its plain share `lr * g / N` (N the configured groups: a group
//! dropped or finished counts as a zero pseudo-gradient, so a lone survivor's windows never
//! take the whole step), and every N pushes
//! the momentum buffer takes their mean and the weights take the momentum part of the step:
//! `lr * momentum * buf` after the buffer's update with Nesterov, before it without. N
//! pushes of one round thus move the weights exactly as the synchronous step on their mean
//! does (up to rounding), and a push never carries more than its share.

use crate::config::OuterOptimizer;

/// The outer optimizer's state for one flat range: its momentum buffer, from the first step.
#[derive(Debug, Default, Clone)]
pub(crate) struct OuterState {
    momentum: Option<Vec<f32>>,
}

impl OuterState {
    /// From a saved momentum buffer (a server's checkpoint).
    #[cfg(feature = "servers")]
    pub fn from_momentum(momentum: Option<Vec<f32>>) -> Self {
        Self { momentum }
    }

    /// The momentum buffer, from the first step with momentum.
    #[cfg(feature = "servers")]
    pub fn momentum(&self) -> Option<&[f32]> {
        self.momentum.as_deref()
    }

    /// Steps `weights` with the mean of `groups` pseudo-gradients, given summed (in group
    /// order) in `sum`, which is divided in place. Every form of a round (peers in one job,
    /// a parameter server) steps through here, so they give the same bits.
    pub fn step_mean(&mut self, opt: &OuterOptimizer, weights: &mut [f32], sum: &mut [f32], groups: usize) {
        let groups = groups as f32;
        sum.iter_mut().for_each(|d| *d /= groups);
        self.step(opt, weights, sum);
    }

    /// Steps `weights` with the pseudo-gradient `grad` (same length).
    pub fn step(&mut self, opt: &OuterOptimizer, weights: &mut [f32], grad: &[f32]) {
        debug_assert_eq!(weights.len(), grad.len());
        let (lr, momentum) = (opt.lr as f32, opt.momentum as f32);
        if momentum == 0.0 {
            weights.iter_mut().zip(grad).for_each(|(w, g)| *w -= lr * g);
            return;
        }
        let buf = match &mut self.momentum {
            Some(buf) => {
                buf.iter_mut().zip(grad).for_each(|(b, g)| *b = momentum * *b + g);
                buf
            }
            None => self.momentum.insert(grad.to_vec()),
        };
        for ((w, g), b) in weights.iter_mut().zip(grad).zip(buf.iter()) {
            let update = if opt.nesterov { g + momentum * b } else { *b };
            *w -= lr * update;
        }
    }
}

/// The outer optimizer of asynchronous rounds (module note: Delayed Nesterov): the
/// momentum buffer, the pushes' mean since its last update, and how many pushes that was.
#[cfg(feature = "servers")]
#[derive(Debug, Default, Clone)]
pub(crate) struct Delayed {
    outer: OuterState,
    pending: Vec<f32>,
    pushes: usize,
}

#[cfg(feature = "servers")]
impl Delayed {
    /// From saved parts (a server's checkpoint).
    pub fn from_parts(momentum: Option<Vec<f32>>, pending: Vec<f32>, pushes: usize) -> Self {
        Self { outer: OuterState { momentum }, pending, pushes }
    }

    /// The momentum buffer (none before the first momentum step), the pending mean (empty
    /// when none), and the pushes in it.
    pub fn parts(&self) -> (Option<&[f32]>, &[f32], usize) {
        (self.outer.momentum.as_deref(), &self.pending, self.pushes)
    }

    /// Applies one group's pseudo-gradient `grad` to `weights`, one of `groups` groups.
    pub fn push(&mut self, opt: &OuterOptimizer, weights: &mut [f32], grad: &[f32], groups: usize) {
        let (lr, n) = (opt.lr as f32, groups.max(1) as f32);
        if self.pending.len() != weights.len() {
            self.pending = vec![0.0; weights.len()];
        }
        for ((w, g), p) in weights.iter_mut().zip(grad).zip(&mut self.pending) {
            let share = g / n;
            *w -= lr * share;
            *p += share;
        }
        self.pushes += 1;
        if self.pushes < groups {
            return;
        }
        let beta = opt.momentum as f32;
        if beta != 0.0 {
            let first = self.outer.momentum.is_none();
            let buf = self.outer.momentum.get_or_insert_with(|| vec![0.0; weights.len()]);
            for ((w, b), p) in weights.iter_mut().zip(buf.iter_mut()).zip(&self.pending) {
                let old = *b;
                *b = if first { *p } else { beta * old + p };
                *w -= lr * beta * if opt.nesterov { *b } else { old };
            }
        }
        self.pending.fill(0.0);
        self.pushes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two outer steps on a few values, against the same recurrences written out by hand
    /// in f64 (DiLoCo's defaults: lr 0.7, Nesterov momentum 0.9).
    #[test]
    fn nesterov_steps_match_a_hand_computed_reference() {
        let opt = OuterOptimizer { lr: 0.7, momentum: 0.9, nesterov: true };
        let mut w = vec![1.0f32, -2.0, 0.5];
        let g1 = [0.1f32, -0.2, 0.0];
        let g2 = [0.05f32, 0.3, -0.4];
        let mut state = OuterState::default();
        state.step(&opt, &mut w, &g1);
        state.step(&opt, &mut w, &g2);
        for i in 0..3 {
            let (w0, a, b) = ([1.0, -2.0, 0.5][i], g1[i] as f64, g2[i] as f64);
            // Step 1: buf = a; w -= 0.7 (a + 0.9 a). Step 2: buf = 0.9 a + b; w -= 0.7 (b + 0.9 buf).
            let after1 = w0 - 0.7 * (a + 0.9 * a);
            let buf2 = 0.9 * a + b;
            let want = after1 - 0.7 * (b + 0.9 * buf2);
            assert!((w[i] as f64 - want).abs() < 1e-6, "element {i}: {} vs {want}", w[i]);
        }
    }

    /// Delayed Nesterov: two rounds of three pushes each (in any order) end where two
    /// synchronous steps on the rounds' means do, within f32 rounding; heavy-ball momentum
    /// too. A push moves the weights by its plain share only.
    #[test]
    #[cfg(feature = "servers")]
    fn delayed_nesterov_rounds_equal_synchronous_steps_on_their_means() {
        let rounds = [[[0.3f32, -0.1], [0.1, 0.2], [-0.4, 0.5]], [[0.05, 0.0], [0.2, -0.3], [0.1, 0.1]]];
        for opt in [
            OuterOptimizer { lr: 0.7, momentum: 0.9, nesterov: true },
            OuterOptimizer { lr: 0.5, momentum: 0.5, nesterov: false },
        ] {
            let (mut sync_w, mut sync_state) = (vec![1.0f32, -1.0], OuterState::default());
            let (mut async_w, mut delayed) = (vec![1.0f32, -1.0], Delayed::default());
            for pushes in rounds {
                let mean: Vec<f32> = (0..2).map(|i| pushes.iter().map(|p| p[i]).sum::<f32>() / 3.0).collect();
                sync_state.step(&opt, &mut sync_w, &mean);
                for (k, push) in pushes.iter().rev().enumerate() {
                    let before = async_w.clone();
                    delayed.push(&opt, &mut async_w, push, 3);
                    if k < 2 {
                        let moved: Vec<f32> = before.iter().zip(&async_w).map(|(b, a)| b - a).collect();
                        let share: Vec<f32> = push.iter().map(|g| opt.lr as f32 * g / 3.0).collect();
                        assert!(moved.iter().zip(&share).all(|(m, s)| (m - s).abs() < 1e-6), "{moved:?} vs {share:?}");
                    }
                }
            }
            for (s, a) in sync_w.iter().zip(&async_w) {
                assert!((s - a).abs() < 1e-6, "{opt:?}: sync {sync_w:?} async {async_w:?}");
            }
        }
    }

    #[test]
    fn plain_sgd_with_lr_one_is_averaging_and_heavy_ball_uses_the_buffer() {
        // w - 1 * (w - mean) = mean.
        let mut w = vec![3.0f32, -1.0];
        let mean = [2.0f32, 1.0];
        let grad: Vec<f32> = w.iter().zip(mean).map(|(w, m)| w - m).collect();
        OuterState::default().step(&OuterOptimizer { lr: 1.0, momentum: 0.0, nesterov: false }, &mut w, &grad);
        assert_eq!(w, mean);
        // Momentum without Nesterov: the second update is the buffer 0.5 * 1 + 1.
        let opt = OuterOptimizer { lr: 0.1, momentum: 0.5, nesterov: false };
        let (mut w, mut state) = (vec![0.0f32], OuterState::default());
        state.step(&opt, &mut w, &[1.0]);
        state.step(&opt, &mut w, &[1.0]);
        assert!((w[0] - -(0.1 + 0.1 * 1.5)).abs() < 1e-7, "{}", w[0]);
    }
}
