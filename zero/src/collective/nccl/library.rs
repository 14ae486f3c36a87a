//! Whether this machine can run NCCL: the NVIDIA driver's `libcuda` and `libnccl` load.
//!
//! cudarc loads both lazily and panics when one is missing, so every NCCL path asks here
//! first. cudarc looks for `libnccl.so` (and versioned names of its own), never for
//! `libnccl.so.2`, the only name NVIDIA's `nvidia-nccl-cu12` wheel ships; a machine with
//! just that file gets an error saying how to make it visible.

use std::ffi::{CStr, CString};

/// `Ok` if the driver library and NCCL both load; otherwise everything that is missing and
/// what to do, in one sentence.
pub fn check() -> Result<(), String> {
    let mut missing = Vec::new();
    // SAFETY: `is_culib_present` only tries to open the library by each of its names
    // (dlopen, then dlclose); it calls nothing in it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        missing.push("the NVIDIA driver's libcuda does not load (no driver, or no GPU)".to_owned());
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        missing.push(match versioned_only() {
            Some(path) => format!(
                "NCCL is at {path}, but it is loaded as libnccl.so, which is missing: make a folder with \
                 `ln -s {path} DIR/libnccl.so` and put DIR on LD_LIBRARY_PATH"
            ),
            None => "libnccl.so does not load: NCCL is not installed (Debian: libnccl2; pip: nvidia-nccl-cu12, \
                     whose libnccl.so.2 needs a libnccl.so link on LD_LIBRARY_PATH)"
                .to_owned(),
        });
    }
    if missing.is_empty() { Ok(()) } else { Err(missing.join("; ")) }
}

/// The path of a `libnccl.so.2` the dynamic loader finds, if there is one.
fn versioned_only() -> Option<String> {
    let name = CString::new("libnccl.so.2").ok()?;
    let symbol = CString::new("ncclGetVersion").ok()?;
    // SAFETY: dlopen with a valid C string; the handle is closed before returning and no
    // function of the library is called. dladdr writes into a zeroed Dl_info we own, and
    // the file name it points to is copied out before dlclose.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return None;
        }
        let address = libc::dlsym(handle, symbol.as_ptr());
        let mut info: libc::Dl_info = std::mem::zeroed();
        let path = if !address.is_null() && libc::dladdr(address, &mut info) != 0 && !info.dli_fname.is_null() {
            CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned()
        } else {
            "libnccl.so.2".to_owned()
        };
        libc::dlclose(handle);
        Some(path)
    }
}
