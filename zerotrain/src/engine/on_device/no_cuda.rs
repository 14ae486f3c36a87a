//! Without the `cuda` feature: no tensor is CUDA memory, so every call is staged and
//! nothing here is reached.

use burn::tensor::Tensor;
use zerotrain_precision::Precision;
use zerotrain_zero::{Collective, DeviceOp};

use crate::{Error, Result};

/// Without the `cuda` feature no tensor is CUDA memory.
pub(super) fn is_cuda(_: &burn::tensor::Device) -> bool {
    false
}

/// Never called: without CUDA every call is staged.
pub(super) fn run(_: &dyn Collective, op: DeviceOp, _: Precision, _: &Tensor<1>, _: &Tensor<1>) -> Result<()> {
    run_refused(op)
}

/// Never called, as `run`.
pub(super) fn start_send(_: &dyn Collective, _: Precision, _: Tensor<1>, to: usize) -> Result<super::Sending> {
    run_refused(DeviceOp::Send(to))
}

/// Never called, as `run`.
pub(super) fn recv_into(_: &dyn Collective, _: Precision, _: &Tensor<1>, from: usize) -> Result<()> {
    run_refused(DeviceOp::Recv(from))
}

fn run_refused<T>(op: DeviceOp) -> Result<T> {
    Err(Error::Usage(format!("{} on device memory needs a build with the `cuda` feature", op.kind().name())))
}
