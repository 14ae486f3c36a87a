//! Aligned buffers and the I/O threads that move them to and from swap files.
//!
//! # Note: threads and direct I/O, not io_uring
//! Each request (a tile or a unit shard) is cut into `aio.block_size` blocks, and
//! `thread_count x queue_depth` threads each `pread`/`pwrite` one block at a time on a file
//! opened with `O_DIRECT`, so that many blocks are in flight, as DeepSpeed's `aio` keeps
//! `queue_depth` requests per thread. io_uring would save the threads, but Docker's
//! default seccomp profile and many CI sandboxes refuse its system calls, and a swap tier
//! that fails where containers run is no tier; blocking calls on a few threads reach the
//! disk's sequential bandwidth here (the bench measures it). Direct I/O keeps the page
//! cache from holding a second copy of every state (the point of offloading is that memory
//! does not hold them) and from hiding the disk's real speed; a filesystem without it
//! (tmpfs before Linux 6.6, some network filesystems) falls back to buffered I/O, said once
//! by the engine.

use std::alloc::{Layout, alloc, dealloc};
use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Alignment of buffers, file offsets and lengths for direct I/O.
pub const ALIGN: usize = 4096;

/// A zeroed, [`ALIGN`]-aligned buffer of f32 whose byte length is a multiple of [`ALIGN`]
/// (what `O_DIRECT` needs), holding `len` meaningful values.
pub struct AlignedBuf {
    ptr: NonNull<f32>,
    len: usize,
    /// Capacity in f32 elements (a multiple of `ALIGN / 4`).
    cap: usize,
}

// SAFETY: the buffer owns its allocation exclusively (like a `Vec<f32>`); no aliasing
// pointer is kept anywhere else.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only read the elements, as for `&[f32]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer for `len` values.
    pub fn zeroed(len: usize) -> Self {
        // SAFETY: the fill writes every slot.
        unsafe { Self::filled_by(len, |slots| slots.fill(MaybeUninit::new(0.0))) }
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice(values: &[f32]) -> Self {
        // SAFETY: the copy writes every one of the `values.len()` slots.
        unsafe {
            Self::filled_by(values.len(), |slots| {
                slots.write_copy_of_slice(values);
            })
        }
    }

    /// A buffer of `len` values: the first `len` that `values` yields, zeros after them if
    /// it yields fewer.
    pub fn from_values(len: usize, values: impl IntoIterator<Item = f32>) -> Self {
        let mut values = values.into_iter();
        let fill = |slots: &mut [MaybeUninit<f32>]| {
            for slot in slots {
                slot.write(values.next().unwrap_or(0.0));
            }
        };
        // SAFETY: `fill` writes every slot it is given.
        unsafe { Self::filled_by(len, fill) }
    }

    /// A buffer of `len` values that `fill` writes, the allocation's tail after them zeroed:
    /// each byte is written once (a zeroed buffer then filled writes every page twice, the
    /// costlier for buffers of a unit's size, which come fresh from the OS).
    ///
    /// # Safety
    /// `fill` must write every one of the `len` slots it is given.
    unsafe fn filled_by(len: usize, fill: impl FnOnce(&mut [MaybeUninit<f32>])) -> Self {
        let cap = len.max(1).next_multiple_of(ALIGN / size_of::<f32>());
        let layout = Self::layout(cap);
        // SAFETY: `layout` has a non-zero size (cap >= 1024 elements).
        let raw = unsafe { alloc(layout) }.cast::<f32>();
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        advise_huge_pages(raw.cast(), layout.size());
        // SAFETY: the allocation holds `cap` f32 slots, not initialised yet; `MaybeUninit`
        // has f32's layout and asks nothing of the bytes.
        let slots = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr().cast::<MaybeUninit<f32>>(), cap) };
        let (head, tail) = slots.split_at_mut(len);
        fill(head);
        tail.fill(MaybeUninit::new(0.0));
        // The caller's `fill` wrote the head: every slot is initialised.
        Self { ptr, len, cap }
    }

    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap * size_of::<f32>(), ALIGN).expect("swap buffer size fits a Layout")
    }

    /// The meaningful values.
    pub fn as_slice(&self) -> &[f32] {
        // SAFETY: `ptr` points to `cap >= len` initialised (zeroed or written) f32s.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The meaningful values' bytes, to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the first `len * 4` bytes are initialised (zeroed or written), and
        // `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<u8>(), self.len * size_of::<f32>()) }
    }

    /// The whole allocation as bytes (a multiple of [`ALIGN`]).
    fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation is `cap * 4` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>(), self.cap * size_of::<f32>()) }
    }

    /// Bytes of the allocation.
    pub fn capacity_bytes(&self) -> u64 {
        (self.cap * size_of::<f32>()) as u64
    }
}

/// Asks the kernel to back `bytes` at `ptr` with transparent huge pages where it can
/// (Linux's `madvise` mode leaves them off unless asked). A unit's buffer is hundreds of
/// megabytes that come fresh from the OS: 4 KiB pages make every first touch of each page a
/// fault, which measured as most of an import's time; 2 MiB pages fault 512 times less. A
/// kernel that refuses the advice keeps small pages, which are only slower.
fn advise_huge_pages(ptr: *mut u8, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 2 * HUGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + bytes) / HUGE * HUGE;
        if start < end {
            // SAFETY: `start..end` lies inside the caller's live allocation; the advice
            // changes how its pages are backed, never their contents.
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` or `filled_by` with this very layout.
        unsafe { dealloc(self.ptr.as_ptr().cast::<u8>(), Self::layout(self.cap)) }
    }
}

/// One block of a request, done by one I/O thread.
struct Block {
    file: Arc<File>,
    path: Arc<PathBuf>,
    offset: u64,
    /// The request's buffer (kept alive until every block is done) and this block's
    /// byte range in it; the ranges of one request are disjoint.
    buf: Arc<AlignedBuf>,
    at: std::ops::Range<usize>,
    write: bool,
    done: Arc<Completion>,
}

/// Counts a request's blocks down and keeps its first error.
struct Completion {
    state: Mutex<(usize, Option<IoFailure>)>,
    cv: Condvar,
}

/// A failed request: the file and what happened (the byte offset in the message).
pub type IoFailure = (PathBuf, std::io::Error);

/// A request in flight; [`wait`](Self::wait) gives its buffer back. Dropped unwaited (an
/// error path), it still waits for its blocks: nothing of it may land in a file after the
/// file is truncated or opened again.
#[must_use = "a request's buffer comes back only through wait()"]
pub struct Ticket {
    /// `None` once waited for.
    buf: Option<Arc<AlignedBuf>>,
    done: Arc<Completion>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.buf.take().is_some() {
            self.done.settle();
        }
    }
}

impl Completion {
    /// Waits until every block has finished; their first error, taken.
    fn settle(&self) -> Option<IoFailure> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while state.0 > 0 {
            state = self.cv.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        state.1.take()
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ticket")
    }
}

impl Ticket {
    /// Waits for every block; the buffer, or the first error and its file.
    pub fn wait(mut self) -> Result<AlignedBuf, IoFailure> {
        let buf = self.buf.take().expect("a ticket is waited for once");
        if let Some(error) = self.done.settle() {
            return Err(error);
        }
        // Every block has finished and dropped its reference before counting down.
        Ok(Arc::try_unwrap(buf).unwrap_or_else(|_| unreachable!("every block dropped its buffer before counting down")))
    }
}

/// The I/O threads of one rank's swap folder.
pub struct IoPool {
    queue: Option<Sender<Block>>,
    threads: Vec<JoinHandle<()>>,
    block_bytes: usize,
    /// Bytes requested so far: (read, written).
    moved: [AtomicU64; 2],
}

impl IoPool {
    /// `threads` I/O threads moving `block_bytes` (a multiple of [`ALIGN`]) per call; the
    /// system's error if a thread cannot be started (the ones started stop again).
    pub fn new(threads: usize, block_bytes: usize) -> std::io::Result<Self> {
        let (tx, rx) = channel::<Block>();
        let rx = Arc::new(Mutex::new(rx));
        let block_bytes = block_bytes.next_multiple_of(ALIGN).max(ALIGN);
        let mut pool =
            Self { queue: Some(tx), threads: Vec::new(), block_bytes, moved: [AtomicU64::new(0), AtomicU64::new(0)] };
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            // On error `pool` drops here, closing the queue and joining the threads so far.
            pool.threads.push(std::thread::Builder::new().name(format!("zerotrain-io-{i}")).spawn(move || serve(&rx))?);
        }
        Ok(pool)
    }

    /// Bytes requested so far: (read, written).
    pub fn moved(&self) -> (u64, u64) {
        (self.moved[0].load(Ordering::Relaxed), self.moved[1].load(Ordering::Relaxed))
    }

    /// Starts reading (`write: false`) or writing `buf`'s whole allocation at byte `offset`
    /// (a multiple of [`ALIGN`]) of `file`.
    pub fn submit(&self, file: &Arc<File>, path: &Arc<PathBuf>, offset: u64, buf: AlignedBuf, write: bool) -> Ticket {
        let total = buf.bytes().len();
        self.moved[usize::from(write)].fetch_add(total as u64, Ordering::Relaxed);
        let blocks = total.div_ceil(self.block_bytes);
        let done = Arc::new(Completion { state: Mutex::new((blocks, None)), cv: Condvar::new() });
        let buf = Arc::new(buf);
        for b in 0..blocks {
            let at = b * self.block_bytes..((b + 1) * self.block_bytes).min(total);
            let block = Block {
                file: Arc::clone(file),
                path: Arc::clone(path),
                offset: offset + at.start as u64,
                buf: Arc::clone(&buf),
                at,
                write,
                done: Arc::clone(&done),
            };
            if let Some(Err(std::sync::mpsc::SendError(block))) = self.queue.as_ref().map(|q| q.send(block)) {
                let done = Arc::clone(&block.done);
                drop(block);
                let error = std::io::Error::other("the I/O threads have stopped");
                finish(&done, Some((path.as_ref().clone(), error)));
            }
        }
        Ticket { buf: Some(buf), done }
    }
}

impl Drop for IoPool {
    fn drop(&mut self) {
        self.queue.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve(rx: &Mutex<Receiver<Block>>) {
    loop {
        let block = match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
            Ok(block) => block,
            Err(_) => return,
        };
        let error = run(&block).err().map(|e| {
            let verb = if block.write { "writing" } else { "reading" };
            let what = format!("{verb} {} bytes at byte {}: {e}", block.at.len(), block.offset);
            (block.path.as_ref().clone(), std::io::Error::new(e.kind(), what))
        });
        let done = Arc::clone(&block.done);
        // The buffer's reference goes before the count does, so `wait` can take it back.
        drop(block);
        finish(&done, error);
    }
}

/// One block's system call, straight from or into its part of the request's buffer.
fn run(block: &Block) -> std::io::Result<()> {
    let base = block.buf.ptr.as_ptr().cast::<u8>();
    // SAFETY: `at` lies inside the allocation (`submit` cuts it from its length); the
    // blocks of one request cover disjoint ranges, and nothing else reads or writes the
    // buffer until `Ticket::wait` has seen every block finish, so this is the only
    // reference to these bytes while it lives. The `Arc` keeps the allocation alive.
    let bytes = unsafe { std::slice::from_raw_parts_mut(base.add(block.at.start), block.at.len()) };
    if block.write {
        block.file.write_all_at(bytes, block.offset)
    } else {
        block.file.read_exact_at(bytes, block.offset)
    }
}

fn finish(done: &Completion, error: Option<IoFailure>) {
    let mut state = done.state.lock().unwrap_or_else(|e| e.into_inner());
    state.0 -= 1;
    if state.1.is_none() {
        state.1 = error;
    }
    done.cv.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_whole_pages() {
        let buf = AlignedBuf::zeroed(1500);
        assert_eq!(buf.as_slice().len(), 1500);
        assert!(buf.as_slice().iter().all(|&v| v == 0.0));
        assert_eq!(buf.ptr.as_ptr() as usize % ALIGN, 0);
        assert_eq!(buf.capacity_bytes(), 8192);
    }
}
