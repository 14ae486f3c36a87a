//! The outer optimizer of replica groups: SGD on the global weights, stepped with the
//! pseudo-gradient, in PyTorch's `torch.optim.SGD` arithmetic (f32, no dampening):
//! `buf = g` at the first step, `buf = momentum * buf + g` after; the update is
//! `g + momentum * buf` with Nesterov momentum, `buf` without (`g` without momentum);
//! `w -= lr * update`.

use crate::config::OuterOptimizer;

/// The outer optimizer's state for one flat range: its momentum buffer, from the first step.
#[derive(Debug, Default, Clone)]
pub(crate) struct OuterState {
    momentum: Option<Vec<f32>>,
}

impl OuterState {
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
