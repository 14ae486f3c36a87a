//! What NCCL is handed: its op and datatype codes, and the bytes of the engine's float
//! buffers.

use cudarc::nccl::sys;
use zerotrain_precision::{BufMut, BufRef};

use super::call::NcclDtype;
use crate::collective::ReduceOp;

pub(super) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

pub(super) fn nccl_type(dtype: NcclDtype) -> sys::ncclDataType_t {
    match dtype {
        NcclDtype::Float32 => sys::ncclDataType_t::ncclFloat32,
        NcclDtype::Float16 => sys::ncclDataType_t::ncclFloat16,
        NcclDtype::Bfloat16 => sys::ncclDataType_t::ncclBfloat16,
    }
}

/// The bytes of a float buffer.
pub(super) fn bytes(buf: BufRef<'_>) -> &[u8] {
    let (ptr, len) = match buf {
        BufRef::F32(s) => (s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)),
        BufRef::F16(s) => (s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)),
        BufRef::Bf16(s) => (s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)),
    };
    // SAFETY: f32, f16 and bf16 are plain bits without padding; the view covers exactly the
    // slice and borrows it for its lifetime.
    unsafe { std::slice::from_raw_parts(ptr, len) }
}

/// The bytes of a writable float buffer, read.
pub(super) fn bytes_of<'a>(buf: &'a BufMut<'_>) -> &'a [u8] {
    match buf {
        BufMut::F32(s) => bytes(BufRef::F32(s)),
        BufMut::F16(s) => bytes(BufRef::F16(s)),
        BufMut::Bf16(s) => bytes(BufRef::Bf16(s)),
    }
}

/// The bytes of a float buffer, writable.
pub(super) fn bytes_mut(buf: BufMut<'_>) -> &mut [u8] {
    let (ptr, len) = match buf {
        BufMut::F32(s) => (s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)),
        BufMut::F16(s) => (s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)),
        BufMut::Bf16(s) => (s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)),
    };
    // SAFETY: as in `bytes`; every bit pattern is a valid f32, f16 or bf16, so any bytes
    // written through the view leave valid values.
    unsafe { std::slice::from_raw_parts_mut(ptr, len) }
}
