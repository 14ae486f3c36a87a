//! Reductions that count every element on every backend Burn runs on.
//!
//! Burn 0.22's reductions on lavapipe (Mesa's Vulkan on the CPU, where CI runs the wgpu
//! tests) count only the first 262,128 or so elements of a longer one: `sum`, `sum_dim`
//! and `mean` alike, along a contiguous axis, and from about 65,500 along a strided one
//! (measured with `Tensor::ones`). The cause is lavapipe's shader compiler, llvmpipe: it
//! ends a shader invocation's loops after 65,535 iterations in all (its loop limiter, which
//! guards against shaders that never end), and a reduction walks its axis in one loop, one
//! vector of 4 elements per iteration where the axis is contiguous (65,533 x 4 = 262,132).
//! CUDA has no such limit. A unit's gradient has millions of elements, and a language
//! model's loss averages `batch * context` tokens: [`sum`] reduces in rows short enough for
//! every backend.

use burn::tensor::Tensor;

/// The sum of a tensor's elements, as a 1-element tensor: Burn's `sum` where one reduction of
/// at most 32,768 elements holds them all, else from reductions of that many each (the
/// elements viewed as rows of that length, each row summed, level by level until one
/// reduction is left).
///
/// A row of 32,768 is at most 32,768 loop iterations, half of lavapipe's limit even where
/// the elements cannot be read as vectors (module note); one more small reduction per level
/// is all it costs elsewhere. Differentiable, as the operations it is made of are.
pub fn sum<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    let n = t.shape().num_elements();
    if n <= ROW { t.sum() } else { sum_in_rows(t.reshape([n]), ROW) }
}

/// The longest reduction [`sum`] asks of a backend.
const ROW: usize = 1 << 15;

/// [`sum`] in rows of `row` elements.
fn sum_in_rows(mut t: Tensor<1>, row: usize) -> Tensor<1> {
    loop {
        let n = t.dims()[0];
        if n <= row {
            return t.sum();
        }
        let rows = n / row;
        let whole = rows * row;
        let sums = t.clone().slice(0..whole).reshape([rows, row]).sum_dim(1).reshape([rows]);
        t = if whole == n { sums } else { Tensor::cat(vec![sums, t.slice(whole..n).sum()], 0) };
    }
}

/// The mean of a tensor's elements, as a 1-element tensor: Burn's `mean` where one
/// reduction of at most 32,768 elements holds them all, else [`sum`] divided by their number.
pub fn mean<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    let n = t.shape().num_elements();
    if n <= ROW { t.mean() } else { sum(t).div_scalar(n as f64) }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    /// A mean past one row is the sum over the count.
    #[test]
    fn a_mean_past_one_row_divides_the_whole_sum() {
        let n = super::ROW * 2 + 6;
        let values: Vec<f32> = (0..n).map(|i| (i % 4) as f32).collect();
        let want = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
        let t = Tensor::<1>::from_data(TensorData::new(values, [n]), &Device::flex());
        let got = super::mean(t).into_data().try_to_vec::<f32>().unwrap()[0];
        assert!((f64::from(got) - want).abs() <= 1e-6 * want, "{got} against {want}");
    }

    /// Sums in rows, level by level, add every element once: lengths below, at and past
    /// one row, past a row of rows (three levels), with and without remainders, in rows of
    /// 4 and of the engine's 32,768 (integers, so that f32 holds every partial sum exactly).
    #[test]
    fn a_sum_in_rows_counts_every_element_once() {
        let device = Device::flex();
        let cases =
            [(4, 1), (4, 4), (4, 5), (4, 16), (4, 17), (4, 67), (4, 64 * 3 + 2), (1 << 15, 3 << 15), (1 << 15, 70_001)];
        for (row, n) in cases {
            let values: Vec<f32> = (0..n).map(|i| (i % 3 + 1) as f32).collect();
            let want: f64 = values.iter().map(|&v| f64::from(v)).sum();
            let t = Tensor::<1>::from_data(TensorData::new(values, [n]), &device);
            let got = super::sum_in_rows(t, row).into_data().try_to_vec::<f32>().unwrap();
            assert_eq!(got, [want as f32], "{n} elements in rows of {row}");
        }
    }
}
