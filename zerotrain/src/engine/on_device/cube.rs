//! Burn's cubecl tensors (wgpu's and CUDA's: one type under the fusion backend) as the
//! dispatch tensors [`run`](super::run) takes: the way in for the mesh groups' backend
//! operations, whose default bodies see the fusion backend's own tensors.

use std::any::Any;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{Shape, Tensor};
use zerotrain_zero::{Collective, DeviceOp};

use crate::{Error, Result};

/// The fusion backend over cubecl: its float tensors are what the group operations'
/// default bodies see on wgpu and CUDA devices.
type Cube = burn_cubecl::Cube;

/// Whether `B`'s float tensors are [`Cube`]'s.
pub(super) fn is_cube<B: Backend>() -> bool {
    std::any::TypeId::of::<FloatTensor<B>>() == std::any::TypeId::of::<FloatTensor<Cube>>()
}

/// `x` as `len` elements in one dimension.
fn flattened<B: Backend>(x: FloatTensor<B>, len: usize) -> FloatTensor<B> {
    B::float_reshape(x, Shape::new([len]))
}

/// `x` as the type it is (`is_cube` checked the two are one type).
fn cast<A: 'static, B: 'static>(x: A) -> B {
    let boxed: Box<dyn Any> = Box::new(x);
    *boxed
        .downcast::<B>()
        .unwrap_or_else(|_| panic!("{} is not {}", std::any::type_name::<A>(), std::any::type_name::<B>()))
}

/// [`run`](super::run) on `x` (a [`Cube`] tensor: `is_cube` said so), flattened.
pub(super) fn run_primitive<B: Backend>(
    comm: &dyn Collective,
    op: DeviceOp,
    x: FloatTensor<B>,
) -> Result<FloatTensor<B>> {
    let x: FloatTensor<Cube> = cast(x);
    let len = x.shape().num_elements();
    let flat = flattened::<Cube>(x, len);
    let output = super::run(comm, op, &Tensor::<1>::from_primitive::<Cube>(flat))?;
    let output = output
        .try_into_primitive::<Cube>()
        .map_err(|e| Error::Model(format!("a collective's result left its backend: {e:?}")))?;
    Ok(cast(output))
}
