//! NCCL, the collectives of NVIDIA GPUs. The pure parts (what a call's NCCL arguments are;
//! sharing the unique id over the host communicator) are always built and tested; the
//! communicator itself, `NcclComm`, needs the `nccl` feature (cudarc, which loads the
//! driver and `libnccl` at run time) and a GPU.

mod call;
#[cfg(feature = "nccl")]
mod comm;
mod id;
#[cfg(feature = "nccl")]
mod init;
#[cfg(feature = "nccl")]
mod library;
pub mod poll;
#[cfg(feature = "nccl")]
mod wire;

pub use call::{NcclCall, NcclDtype, message_buffer};
#[cfg(feature = "nccl")]
pub use comm::NcclComm;
pub use id::{ID_BYTES, share_id};

/// The version of the NCCL that loads (`major * 10000 + minor * 100 + patch`, NCCL's own
/// code), or `None` where [`available`] is not `Ok`.
pub fn version() -> Option<u32> {
    #[cfg(feature = "nccl")]
    return library::check().ok().and_then(|()| cudarc::nccl::result::get_nccl_version().ok()).map(|v| v as u32);
    #[cfg(not(feature = "nccl"))]
    None
}

/// Whether NCCL can run here: `Ok` when this build has the `nccl` feature and the driver's
/// `libcuda` and `libnccl` load; otherwise what is missing, in words for an error message.
pub fn available() -> Result<(), String> {
    #[cfg(feature = "nccl")]
    return library::check();
    #[cfg(not(feature = "nccl"))]
    Err("this build has no NCCL support (it comes with the `cuda` feature)".into())
}
