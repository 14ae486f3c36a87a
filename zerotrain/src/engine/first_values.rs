//! Each unit's first values at construction: read by the group's first rank, one unit at a
//! time into one reused buffer, and broadcast.
//!
//! # Note: the compute dtype, when it is exact
//! The values usually travel in f32: the masters start from them. When every parameter of
//! a unit is still lazy and its initial values are held in the compute dtype (a bf16
//! checkpoint trained in bf16), f32 would hold nothing more: the buffer is then the compute
//! dtype's, which halves the bytes read, broadcast and converted, and the masters are
//! those values widened (exact).

use burn::module::Module;
use zerotrain_precision::{BufMut, BufRef, FlatBuf, FlatElem, Precision};

use super::model::InitialValues;
use super::params::{Lazy, initial_dtype, read_params};
use super::shared::Shared;
use crate::Result;

/// The reused buffers: one in f32, one in the compute dtype.
pub(super) struct FirstValues {
    wide: Vec<f32>,
    compute: FlatBuf,
}

impl FirstValues {
    /// Empty buffers for an engine computing in `dtype`.
    pub fn new(dtype: Precision) -> Self {
        Self { wide: Vec::new(), compute: FlatBuf::zeros(dtype, 0) }
    }

    /// Unit `id`'s whole flat buffer (its padding zero), the same on every rank of the
    /// group: the first rank reads it from `model` (still-lazy parameters from `initial`)
    /// and broadcasts it. In the compute dtype where the module note allows, else in f32.
    pub fn read<M: Module>(
        &mut self,
        model: &M,
        shared: &Shared,
        id: usize,
        initial: Option<&dyn InitialValues>,
    ) -> Result<BufRef<'_>> {
        let (layout, lead) = (shared.layout(id), shared.comm.rank() == 0);
        let compute = shared.dtype();
        let mut narrow = lead
            && compute != Precision::Fp32
            && initial.is_some_and(|v| initial_dtype(model, &shared.index, &shared.sharding, id, v) == Some(compute));
        if shared.comm.world_size() > 1 {
            let mut chosen = [f32::from(u8::from(narrow))];
            shared.comm.broadcast((&mut chosen[..]).into(), 0)?;
            narrow = chosen[0] != 0.0;
        }
        let (real, padded) = (layout.num_elems(), layout.padded_elems());
        // The parameters' values cover all but the padding (`read_params` checks it), so
        // only the padding is zeroed: a reused buffer is not written twice.
        fn sized<E: FlatElem>(buf: &mut Vec<E>, real: usize, padded: usize) -> &mut [E] {
            buf.resize(padded, E::from_f32(0.0));
            buf[real..].fill(E::from_f32(0.0));
            buf
        }
        let mut buf = match (narrow, &mut self.compute) {
            (false, _) | (true, FlatBuf::F32(_)) => BufMut::from(sized(&mut self.wide, real, padded)),
            (true, FlatBuf::F16(v)) => BufMut::from(sized(v, real, padded)),
            (true, FlatBuf::Bf16(v)) => BufMut::from(sized(v, real, padded)),
        };
        if lead {
            if let Some(initial) = initial {
                // The next unit's values are asked for ahead (and the first unit's own: no
                // unit before it asked).
                let units = shared.sharding.units();
                let (first, end) = (if id == 0 { 0 } else { id + 1 }, (id + 2).min(units.len()));
                let ahead = &units[first.min(end)..end];
                ahead.iter().flat_map(|u| u.layout.entries()).for_each(|entry| initial.prefetch(&entry.path));
            }
            let values = buf.reborrow().slice(0..real);
            let lazy = Lazy { values: initial, seed: shared.plan.runtime.seed };
            read_params(model, &shared.index, &shared.sharding, id, 0..real, values, Some(lazy))?;
        }
        shared.comm.broadcast(buf.reborrow(), 0)?;
        if let Some(share) = &shared.tensor {
            share.agree_whole(id, buf)?;
        }
        Ok(match (narrow, &self.compute) {
            (true, compute) => compute.as_ref(),
            (false, _) => BufRef::F32(&self.wide),
        })
    }
}
