//! The tensor-parallel layers and loss against the same computation unsplit, in Burn's own
//! operations on one rank: outputs, the loss, and every gradient (each rank's slice
//! against the same slice of the unsplit gradient), over thread ranks.

use std::sync::Arc;
use std::time::Duration;

use crate::nn::LinearCrossEntropy;
use burn::tensor::activation::{gelu, log_softmax};
use burn::tensor::module::{embedding, linear};
use burn::tensor::{Device, Int, Tensor, TensorData};
use zerotrain_zero::{Collective, ThreadWorld};

use super::{ParallelGroup, Split, row_parallel_linear, vocab_parallel_lookup};

/// `f(group)` on each of `n` thread ranks of one world, in rank order.
pub(crate) fn on_ranks<T: Send>(n: usize, f: impl Fn(ParallelGroup) -> T + Sync) -> Vec<T> {
    let world = ThreadWorld::new(n, Duration::from_secs(30));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let comm: Arc<dyn Collective> = Arc::new(world.communicator(r));
                let f = &f;
                s.spawn(move || f(ParallelGroup::new(comm)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

/// `n` values in [-scale, scale) from a seeded generator.
pub(crate) fn draw(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

pub(crate) fn tensor<const D: usize>(values: &[f32], shape: [usize; D], tracked: bool) -> Tensor<D> {
    let t = Tensor::from_data(TensorData::new(values.to_vec(), shape), &Device::flex().autodiff());
    if tracked { t.require_grad() } else { t }
}

pub(crate) fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// Columns `cols` of a row-major `[rows, width]` matrix, row-major.
pub(crate) fn columns(m: &[f32], width: usize, cols: std::ops::Range<usize>) -> Vec<f32> {
    m.chunks(width).flat_map(|row| row[cols.clone()].to_vec()).collect()
}

/// The largest difference between `got` and `want`, as a share of `want`'s largest value.
pub(crate) fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// An MLP `x -> column-parallel -> gelu -> row-parallel` at 2 and 4 ranks gives the unsplit
/// MLP's output and input gradient on every rank, each rank's weight and bias slices get
/// the unsplit gradients' slices, and the replicated bias the whole gradient. Bound: each
/// value is a sum of at most 16 products (hidden width 16) regrouped into partial sums, one
/// per rank, added in rank order; f32 regrouping moves it by at most a few ulp of its
/// largest term: 1e-5 of the largest value.
#[test]
fn column_then_row_parallel_equals_the_unsplit_mlp_and_its_gradients() {
    let (d, h, shape) = (8, 16, [2, 3, 8]);
    let n_x = shape.iter().product();
    let (x, w1, b1, w2, b2, up) = (
        draw(n_x, 1, 1.0),
        draw(d * h, 2, 0.5),
        draw(h, 3, 0.2),
        draw(h * d, 4, 0.5),
        draw(d, 5, 0.2),
        draw(n_x, 6, 1.0),
    );
    let mlp = |x: Tensor<3>, w1: Tensor<2>, b1: Tensor<1>, w2: Tensor<2>, b2: Tensor<1>| {
        linear(gelu(linear(x, w1, Some(b1))), w2, Some(b2))
    };
    let (tx, tw1, tb1, tw2, tb2) = (
        tensor(&x, shape, true),
        tensor(&w1, [d, h], true),
        tensor(&b1, [h], true),
        tensor(&w2, [h, d], true),
        tensor(&b2, [d], true),
    );
    let y = mlp(tx.clone(), tw1.clone(), tb1.clone(), tw2.clone(), tb2.clone());
    let grads = (y.clone() * tensor(&up, shape, false)).sum().backward();
    let want_y = values(y);
    let g = |t: &Tensor<3>| values(t.grad(&grads).unwrap());
    let (g2, g1) = (|t: &Tensor<2>| values(t.grad(&grads).unwrap()), |t: &Tensor<1>| values(t.grad(&grads).unwrap()));
    let (want_dx, want_dw1, want_db1, want_dw2, want_db2) = (g(&tx), g2(&tw1), g1(&tb1), g2(&tw2), g1(&tb2));

    for n in [2, 4] {
        let results = on_ranks(n, |group| {
            let (r, size) = (group.rank(), group.size());
            // A leaf of this rank's slice of `values` (whole shape `whole`), cut by `split`.
            let part = |values: &[f32], whole: [usize; 2], split: Split| {
                let cut = split.slice(tensor(values, whole, false), r, size, "w").unwrap();
                Tensor::<2>::from_data(cut.into_data(), &Device::flex().autodiff()).require_grad()
            };
            let bias = |values: &[f32], len: usize, split: Split| {
                let cut = split.slice(tensor(values, [len], false), r, size, "b").unwrap();
                Tensor::<1>::from_data(cut.into_data(), &Device::flex().autodiff()).require_grad()
            };
            let (column, row) = (Split::Even { dim: 1, blocks: 1 }, Split::Even { dim: 0, blocks: 1 });
            let tx = tensor(&x, shape, true);
            let (cw, cb) = (part(&w1, [d, h], column), bias(&b1, h, row));
            let (rw, rb) = (part(&w2, [h, d], row), bias(&b2, d, Split::Whole));
            let hidden = gelu(linear(group.copy_to(tx.clone()), cw.clone(), Some(cb.clone())));
            let y = row_parallel_linear(hidden, rw.clone(), Some(rb.clone()), &group);
            let grads = (y.clone() * tensor(&up, shape, false)).sum().backward();
            let g2 = |t: Tensor<2>| values(t.grad(&grads).unwrap());
            let g1 = |t: Tensor<1>| values(t.grad(&grads).unwrap());
            (values(y), values(tx.grad(&grads).unwrap()), g2(cw), g1(cb), g2(rw), g1(rb))
        });
        let each = h / n;
        for (r, (y, dx, dw1, db1, dw2, db2)) in results.iter().enumerate() {
            let cols = r * each..(r + 1) * each;
            let checks = [
                ("output", y, want_y.clone()),
                ("input's gradient", dx, want_dx.clone()),
                ("column weight's gradient", dw1, columns(&want_dw1, h, cols.clone())),
                ("column bias's gradient", db1, want_db1[cols.clone()].to_vec()),
                ("row weight's gradient", dw2, want_dw2[cols.start * d..cols.end * d].to_vec()),
                ("row bias's gradient", db2, want_db2.clone()),
            ];
            for (what, got, want) in checks {
                let error = relative_error(got, &want);
                assert!(error <= 1e-5, "{n} ranks, rank {r}: the {what} is off by {error:e} of its largest value");
            }
        }
    }
}

/// A vocabulary-parallel embedding and head (with a bias) with the vocabulary-parallel
/// loss (`LinearCrossEntropy::forward_parallel` in one block of all 10 tokens, in blocks of
/// 3 tokens, the last short, and in the blocks the vocabulary gives), at 2 and 5 ranks (12
/// ids in parts of 2 or 3): the loss equals the unsplit model's
/// (embedding, head, log-softmax, the targets' mean negative log-likelihood) on every rank,
/// and each rank's table rows, head columns and bias entries get the unsplit gradients'
/// slices. Targets include each rank's first and last ids. Bound: the loss and gradients
/// regroup sums of at most 12 exponentials and 4 products into one partial sum per rank;
/// 1e-5 of the largest value.
#[test]
fn vocabulary_parallel_embedding_head_and_loss_equal_the_unsplit_ones() {
    let (vocab, d, batch, time) = (12, 4, 2, 5);
    let ids: Vec<i64> = vec![0, 5, 6, 11, 2, 3, 8, 9, 11, 1];
    let targets: Vec<i64> = vec![5, 6, 0, 11, 2, 3, 9, 8, 1, 11];
    let (table, head, bias) = (draw(vocab * d, 7, 1.0), draw(d * vocab, 8, 1.0), draw(vocab, 9, 0.5));
    let int = |v: &[i64], shape: [usize; 2]| {
        Tensor::<2, Int>::from_data(TensorData::new(v.to_vec(), shape), &Device::flex().autodiff())
    };
    let n = batch * time;

    let (te, tw, tb) =
        (tensor(&table, [vocab, d], true), tensor(&head, [d, vocab], true), tensor(&bias, [vocab], true));
    let hidden = embedding(te.clone(), int(&ids, [batch, time])).reshape([n, d]);
    let logp = log_softmax(hidden.matmul(tw.clone()) + tb.clone().unsqueeze(), 1);
    let picked = logp.gather(1, int(&targets, [n, 1]));
    let loss = picked.mean().neg();
    let grads = loss.clone().backward();
    let want = [
        values(loss),
        values(te.grad(&grads).unwrap()),
        values(tw.grad(&grads).unwrap()),
        values(tb.grad(&grads).unwrap()),
    ];

    for ranks in [2, 5] {
        let results = on_ranks(ranks, |group| {
            let (r, n_ranks) = (group.rank(), group.size());
            let leaf = |t: Tensor<2>| Tensor::<2>::from_data(t.into_data(), &Device::flex().autodiff()).require_grad();
            let split = Split::Uneven { dim: 1 };
            let head = split.slice(tensor(&head, [d, vocab], false), r, n_ranks, "head").unwrap();
            let bias = Split::Uneven { dim: 0 }.slice(tensor(&bias, [vocab], false), r, n_ranks, "bias").unwrap();
            let rows = group.part(vocab);
            let targets = int(&targets, [n, 1]).reshape([n]);
            // How the loss runs: one block of every token (the whole logits of this rank's
            // part); fixed blocks of 3 tokens; blocks chosen by the vocabulary (24 logits: 2
            // tokens of 12 ids), which every rank must cut from the whole vocabulary, not
            // from its part of 2 or 3 ids (12 or 8 tokens: one block or two of the 10,
            // exchanges of different lengths).
            let run = |blocks: LinearCrossEntropy| {
                let table = leaf(tensor(&table, [vocab, d], false).narrow(0, rows.start, rows.len()));
                let (hw, hb) = (
                    leaf(head.clone()),
                    Tensor::<1>::from_data(bias.clone().into_data(), &Device::flex().autodiff()).require_grad(),
                );
                let hidden =
                    vocab_parallel_lookup(table.clone(), rows.start, int(&ids, [batch, time]), &group).reshape([n, d]);
                let loss = blocks.forward_parallel(
                    hidden,
                    (hw.clone().transpose(), Some(hb.clone())),
                    targets.clone(),
                    vocab,
                    &group,
                );
                let grads = loss.clone().backward();
                let grad = |t: Tensor<2>| values(t.grad(&grads).unwrap());
                [values(loss), grad(table), grad(hw), values(hb.grad(&grads).unwrap())]
            };
            let by_vocab = LinearCrossEntropy::new().with_block_elements(24);
            assert_eq!(by_vocab.block_tokens(vocab), 2);
            let one_block = LinearCrossEntropy::new().with_block_tokens(n);
            [run(one_block), run(LinearCrossEntropy::new().with_block_tokens(3)), run(by_vocab)]
        });
        for (r, both) in results.iter().enumerate() {
            let rows = r * vocab / ranks..(r + 1) * vocab / ranks;
            let slices = [
                ("loss", want[0].clone()),
                ("table's gradient", want[1][rows.start * d..rows.end * d].to_vec()),
                ("head's gradient", columns(&want[2], vocab, rows.clone())),
                ("bias's gradient", want[3][rows.clone()].to_vec()),
            ];
            for (how, got) in ["one block", "blocks of 3", "blocks by the vocabulary"].iter().zip(both) {
                for ((what, want), got) in slices.iter().zip(got) {
                    let error = relative_error(got, want);
                    assert!(
                        error <= 1e-5,
                        "{how}, {ranks} ranks, rank {r}: the {what} is off by {error:e} of its largest value"
                    );
                }
            }
        }
    }
}

/// Widths that do not divide over the group are refused, naming the parameter and its
/// width (and a vocabulary smaller than the group); a group of one rank splits nothing.
#[test]
fn widths_that_do_not_divide_are_refused_by_name() {
    let results = on_ranks(4, |group| {
        let (r, n) = (group.rank(), group.size());
        let cut = |split: Split, shape: [usize; 2], what: &str| {
            split.slice(tensor(&vec![0.0; shape[0] * shape[1]], shape, false), r, n, what).err().unwrap().to_string()
        };
        [
            cut(Split::Even { dim: 1, blocks: 1 }, [2, 6], "mlp.up.weight"),
            cut(Split::Even { dim: 0, blocks: 1 }, [6, 2], "mlp.down.weight"),
            cut(Split::Uneven { dim: 0 }, [3, 2], "wte.weight"),
        ]
    });
    for [col, row, emb] in results {
        assert!(col.contains("mlp.up.weight: its length 6 does not divide by the tensor-parallel size 4"), "{col}");
        assert!(row.contains("mlp.down.weight: its length 6"), "{row}");
        assert!(emb.contains("wte.weight: its length 3 is less than the tensor-parallel size 4"), "{emb}");
    }
    let alone = ParallelGroup::alone();
    let whole = Split::Even { dim: 1, blocks: 1 }.slice(tensor(&[1.0; 12], [2, 6], false), 0, alone.size(), "w");
    assert_eq!(whole.unwrap().dims(), [2, 6]);
}

/// A rank whose peer has failed does not wait: its reduction panics (the engine reports a
/// panic in a model as the model's error) naming the failed rank's reason.
#[test]
fn a_failed_peer_ends_a_reduction_with_its_reason() {
    let results = on_ranks(2, |group| {
        if group.rank() == 1 {
            group.collective().abort("rank 1 ran out of memory");
            return None;
        }
        let x = tensor(&[1.0, 2.0], [2], true);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| group.reduce_from(x)));
        Some(caught.err().map(|p| p.downcast_ref::<String>().cloned().unwrap_or_default()))
    });
    let message = results[0].clone().unwrap().expect("the reduction did not fail");
    assert!(message.contains("tensor-parallel reduction failed") && message.contains("out of memory"), "{message}");
}

/// A split's parts: GPT-2's fused q, k and v (3 blocks of 8 over 2 ranks) give each rank its
/// part of every block, in block order; 7 ids over 3 ranks are parts of 2, 2 and 3; an even
/// split that does not divide is refused, naming the parameter and its blocks.
#[test]
#[allow(clippy::single_range_in_vec_init)]
fn splits_cut_blocks_and_vocabularies_as_documented() {
    let fused = Split::Even { dim: 1, blocks: 3 };
    assert_eq!(fused.ranges(24, 1, 2, "c_attn").unwrap(), vec![4..8, 12..16, 20..24]);
    assert_eq!(fused.local_shape([2, 24], 1, 2, "c_attn").unwrap(), [2, 12]);
    let whole = tensor(&(0..24).map(|i| i as f32).collect::<Vec<_>>(), [1, 24], false);
    let want: Vec<f32> = [4..8, 12..16, 20..24].into_iter().flatten().map(|i| i as f32).collect();
    assert_eq!(values(fused.slice(whole, 1, 2, "c_attn").unwrap()), want);
    let parts: Vec<_> = (0..3).map(|r| Split::Uneven { dim: 0 }.ranges(7, r, 3, "wte").unwrap()).collect();
    assert_eq!(parts, [vec![0..2], vec![2..4], vec![4..7]]);
    assert_eq!(Split::Whole.local_shape([3, 5], 1, 4, "ln").unwrap(), [3, 5]);
    // Where a slice's elements lie in the whole: [2, 6] in 3 column blocks over 2 ranks
    // gives rank 1 columns 1, 3 and 5 of each row; its elements 2..5 cross a row's end.
    let runs = Split::Even { dim: 1, blocks: 3 }.runs(&[2, 6], 1, 2, "w").unwrap();
    assert_eq!(runs, [(1, 1), (3, 1), (5, 1), (7, 1), (9, 1), (11, 1)]);
    assert_eq!(super::within(&runs, 2..5), [(5..6, 2..3), (7..8, 3..4), (9..10, 4..5)]);
    assert_eq!(Split::Uneven { dim: 0 }.runs(&[5, 3], 1, 2, "wte").unwrap(), [(6, 9)]);
    assert_eq!(Split::Whole.runs(&[4, 3], 0, 2, "ln").unwrap(), [(0, 12)]);
    let e = fused.ranges(18, 0, 4, "h.0.attn.c_attn.weight").unwrap_err().to_string();
    assert!(e.contains("h.0.attn.c_attn.weight") && e.contains("(3 blocks of 6)") && e.contains("size 4"), "{e}");
}

/// Each rank's share of a last dimension of 12 over 5 ranks (parts of 2 and 3), gathered:
/// the whole on every rank, in the input's dtype.
#[test]
fn shares_gather_into_the_whole_dimension_on_every_rank() {
    let (rows, len) = (3, 12);
    let whole: Vec<f32> = (0..rows * len).map(|i| i as f32 * 0.5 - 4.0).collect();
    let results = on_ranks(5, |group| {
        let part = group.part(len);
        let mine = columns(&whole, len, part.clone());
        let x = tensor(&mine, [1, rows, part.len()], false).cast(burn::tensor::FloatDType::BF16);
        let gathered = group.gather_parts(x, len);
        (gathered.dims(), gathered.dtype(), values(gathered.cast(burn::tensor::FloatDType::F32)))
    });
    for (dims, dtype, got) in results {
        assert_eq!((dims, dtype), ([1, rows, len], burn::tensor::DType::BF16));
        assert_eq!(got, whole, "the values are multiples of 0.5 below 16: exact in bf16");
    }
}

/// DeepSpeed-Ulysses over 2 and 4 ranks: each holds a quarter (or half) of the sequence of
/// q, k and v (4 query heads over 4 kv heads at 4 ranks, 2 kv heads at 2: grouped), trades
/// it for all of the sequence of its share of the heads, attends causally, and trades
/// back: its part of the output and of every input's gradient equals the whole attention's.
/// Bound: the exchanges move values exactly, so only the attention's own rounding differs
/// (the same kernel over the same rows): 1e-6 of the largest value.
#[test]
fn ulysses_attention_equals_whole_attention_and_its_gradients() {
    let (b, h, t, d) = (2, 4, 8, 3);
    for (n, kv) in [(2, 2), (4, 4)] {
        let (q, k, v, up) = (
            draw(b * h * t * d, 11, 1.0),
            draw(b * kv * t * d, 12, 1.0),
            draw(b * kv * t * d, 13, 1.0),
            draw(b * h * t * d, 14, 1.0),
        );
        let (tq, tk, tv) =
            (tensor(&q, [b, h, t, d], true), tensor(&k, [b, kv, t, d], true), tensor(&v, [b, kv, t, d], true));
        let out = crate::nn::causal_attention(tq.clone(), tk.clone(), tv.clone(), 0.5);
        let grads = (out.clone() * tensor(&up, [b, h, t, d], false)).sum().backward();
        let whole = [
            values(out),
            values(tq.grad(&grads).unwrap()),
            values(tk.grad(&grads).unwrap()),
            values(tv.grad(&grads).unwrap()),
        ];
        let results = on_ranks(n, |group| {
            let rows = group.part(t);
            let local = |x: &[f32], heads: usize| {
                let x = tensor(x, [b, heads, t, d], false).narrow(2, rows.start, rows.len());
                Tensor::<4>::from_data(x.into_data(), &Device::flex().autodiff()).require_grad()
            };
            let (lq, lk, lv) = (local(&q, h), local(&k, kv), local(&v, kv));
            let heads_of = |x: Tensor<4>| group.all_to_all(x, 1, 2);
            let out =
                crate::nn::causal_attention(heads_of(lq.clone()), heads_of(lk.clone()), heads_of(lv.clone()), 0.5);
            let out = group.all_to_all(out, 2, 1);
            let upstream = tensor(&up, [b, h, t, d], false).narrow(2, rows.start, rows.len());
            let grads = (out.clone() * upstream).sum().backward();
            [
                values(out),
                values(lq.grad(&grads).unwrap()),
                values(lk.grad(&grads).unwrap()),
                values(lv.grad(&grads).unwrap()),
            ]
        });
        for (r, got) in results.iter().enumerate() {
            let rows = r * t / n..(r + 1) * t / n;
            for (i, what) in ["output", "q's gradient", "k's gradient", "v's gradient"].iter().enumerate() {
                let heads = if i < 2 { h } else { kv };
                let want: Vec<f32> = whole[i]
                    .chunks(t * d)
                    .take(b * heads)
                    .flat_map(|head| head[rows.start * d..rows.end * d].to_vec())
                    .collect();
                let error = relative_error(&got[i], &want);
                assert!(error <= 1e-6, "{n} ranks, rank {r}: the {what} is off by {error:e}");
            }
        }
    }
}
