//! The whole of a dimension split over a group, put back together on every rank: a
//! tensor-parallel head's logits for inference (no gradient flows through it).

use burn::tensor::{FloatDType, Tensor, TensorData};
use zerotrain_precision::{BufMut, BufRef};

use super::ParallelGroup;

impl ParallelGroup {
    /// `x` `[.., part]`, this rank's [`part`](Self::part) of a last dimension of `len`,
    /// gathered from every rank in rank order into `[.., len]` on every rank, in `x`'s
    /// dtype (the values cross the group in f32, exactly). For inference: no gradient
    /// flows through it (at one rank it is `x` itself). A failed collective aborts the job and panics with the cause, as
    /// [`reduce_from`](Self::reduce_from) does.
    pub fn gather_parts<const D: usize>(&self, x: Tensor<D>, len: usize) -> Tensor<D> {
        let n = self.size();
        if n == 1 {
            return x;
        }
        let (dims, dtype, device) = (x.dims(), x.dtype(), x.device());
        let rows: usize = dims[..D - 1].iter().product();
        let width = len.div_ceil(n);
        let fail = |cause: String| -> ! {
            let reason = format!("gathering a tensor-parallel dimension failed: {cause}");
            self.collective().abort(&reason);
            panic!("{reason}");
        };
        let mut padded = vec![0f32; rows * width];
        let values = match x.detach().cast(FloatDType::F32).try_into_data().map(|d| d.try_into_vec::<f32>()) {
            Ok(Ok(values)) => values,
            Ok(Err(e)) => fail(format!("{e:?}")),
            Err(e) => fail(e.to_string()),
        };
        let part = dims[D - 1];
        for (row, chunk) in values.chunks(part.max(1)).enumerate().take(rows) {
            padded[row * width..row * width + part].copy_from_slice(chunk);
        }
        let mut gathered = vec![0f32; rows * width * n];
        if let Err(e) = self.collective().all_gather(BufRef::F32(&padded), BufMut::F32(&mut gathered)) {
            fail(e.to_string());
        }
        let mut whole = Vec::with_capacity(rows * len);
        for row in 0..rows {
            for r in 0..n {
                let share = super::split::uneven(len, r, n);
                let at = (r * rows + row) * width;
                whole.extend_from_slice(&gathered[at..at + share.len()]);
            }
        }
        let mut shape = dims;
        shape[D - 1] = len;
        Tensor::<D>::from_data(TensorData::new(whole, shape), &device).cast(dtype)
    }
}
