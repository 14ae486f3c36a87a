//! The communication thread: order, hand-off, creation on its own thread, abort.

use super::*;

/// Through a communication thread, started requests complete in issue order and give the
/// host answer, blocking calls interleave with them in that same order, and the caller
/// gets control back before a started collective finishes: rank 2 starts only once ranks
/// 0 and 1 have started both requests and seen the all-gather unfinished, which they could
/// not if starting waited for it (they would never signal, and the world would time out).
#[test]
fn a_comm_thread_runs_requests_in_issue_order_and_returns_at_once() {
    let n = 3;
    let world = ThreadWorld::new(n, T);
    let (issued_tx, issued_rx) = std::sync::mpsc::channel::<usize>();
    let issued_rx = std::sync::Mutex::new(issued_rx);
    let out: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let comm = CommThread::new(world.communicator(r)).unwrap();
                let (issued_tx, issued_rx) = (issued_tx.clone(), &issued_rx);
                s.spawn(move || {
                    let len = 3 * 1001;
                    if r == 2 {
                        let rx = issued_rx.lock().unwrap();
                        for _ in 0..2 {
                            rx.recv_timeout(Duration::from_secs(10)).expect("ranks 0 and 1 issued without waiting");
                        }
                    }
                    let rs = comm.start(Request::ReduceScatter {
                        input: FlatBuf::F32(input(r, len)),
                        output: FlatBuf::zeros(Precision::Fp32, len / n),
                        op: ReduceOp::Sum,
                    });
                    let mut ag = comm.start(Request::AllGather {
                        input: FlatBuf::F32(vec![r as f32; 2]),
                        output: FlatBuf::zeros(Precision::Fp32, 2 * n),
                    });
                    let not_done_yet = r != 2 && !ag.is_done();
                    if r != 2 {
                        issued_tx.send(r).unwrap();
                    }
                    // A blocking call after them runs after them.
                    let mut flag = [r as f32];
                    comm.all_reduce((&mut flag[..]).into(), ReduceOp::Max).unwrap();
                    let rs = rs.wait().unwrap();
                    let ag = ag.wait().unwrap();
                    (not_done_yet, rs.output, ag.output, flag[0], comm.stats())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let expected = host_reduce(n, 3 * 1001, ReduceOp::Sum);
    for (r, (not_done_yet, rs, ag, flag, stats)) in out.into_iter().enumerate() {
        if r != 2 {
            assert!(not_done_yet, "rank {r}: the all-gather cannot finish before rank 2 arrives");
        }
        assert_eq!(rs, FlatBuf::F32(expected[r * 1001..(r + 1) * 1001].to_vec()));
        assert_eq!(ag, FlatBuf::F32(vec![0.0, 0.0, 1.0, 1.0, 2.0, 2.0]));
        assert_eq!(flag, 2.0);
        assert_eq!((stats.reduce_scatter.calls, stats.all_gather.calls, stats.all_reduce.calls), (1, 1, 1));
    }
}

/// A collective created on the thread (as MPI must be) and a failure to create one.
#[test]
fn a_comm_thread_creates_its_collective_on_its_own_thread() {
    let world = ThreadWorld::new(1, T);
    let comm = world.communicator(0);
    let main = std::thread::current().id();
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = CommThread::spawn("zerotrain-comm-test".into(), move || {
        tx.send(std::thread::current().id()).unwrap();
        Ok(comm)
    })
    .unwrap();
    assert_ne!(rx.recv().unwrap(), main);
    assert_eq!((thread.rank(), thread.world_size()), (0, 1));
    let err = CommThread::spawn::<ThreadComm, _>("t".into(), || Err(ZeroError::MpiInit("no MPI here".into())));
    assert_eq!(err.unwrap_err(), ZeroError::MpiInit("no MPI here".into()));
}

/// An aborted world fails a request that waits inside the thread, from another thread.
#[test]
fn aborting_releases_a_request_waiting_on_the_comm_thread() {
    let world = ThreadWorld::new(2, Duration::from_secs(60));
    let comm = CommThread::new(world.communicator(0)).unwrap();
    let pending = comm.start(Request::AllReduce { buf: FlatBuf::F32(vec![1.0; 4]), op: ReduceOp::Sum });
    std::thread::sleep(Duration::from_millis(50));
    comm.abort("rank 0 gives up");
    let err = pending.wait().unwrap_err();
    assert!(matches!(err, ZeroError::Aborted { rank: 0, .. }), "{err}");
    // Later calls fail the same way, without hanging.
    assert!(comm.barrier().is_err());
}

/// A collective that records the thread each of its handles (and its splits') is dropped on,
/// and the threads its device calls run on (it claims to read device memory, as NCCL does).
struct Recorder {
    inner: Arc<dyn Collective>,
    made_on: std::thread::ThreadId,
    drops: Arc<std::sync::Mutex<Vec<(std::thread::ThreadId, std::thread::ThreadId)>>>,
    device_calls: Arc<std::sync::Mutex<Vec<(std::thread::ThreadId, DeviceCall)>>>,
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.drops.lock().unwrap().push((self.made_on, std::thread::current().id()));
    }
}

impl Collective for Recorder {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.inner.all_reduce(buf, op)
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), ZeroError> {
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), ZeroError> {
        self.inner.all_gather(input, output)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<(), ZeroError> {
        self.inner.broadcast(buf, root)
    }
    fn barrier(&self) -> Result<(), ZeroError> {
        self.inner.barrier()
    }
    fn send(&self, buf: BufRef<'_>, to: usize) -> Result<(), ZeroError> {
        self.inner.send(buf, to)
    }
    fn recv(&self, buf: BufMut<'_>, from: usize) -> Result<(), ZeroError> {
        self.inner.recv(buf, from)
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Collective>, ZeroError> {
        let inner = self.inner.split(color, key)?;
        let (made_on, drops) = (std::thread::current().id(), Arc::clone(&self.drops));
        Ok(Arc::new(Recorder { inner, made_on, drops, device_calls: Arc::clone(&self.device_calls) }))
    }
    fn reads_device_memory(&self) -> bool {
        true
    }
    fn on_device(&self, call: &DeviceCall) -> Result<(), ZeroError> {
        self.device_calls.lock().unwrap().push((std::thread::current().id(), *call));
        Ok(())
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason);
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
}

/// A group split through a communication thread is made there and, when its handle is
/// dropped on the rank's thread, dropped there too (an NCCL communicator must be destroyed
/// on the thread that made it; dropped elsewhere it leaked).
#[test]
fn a_group_made_on_the_comm_thread_is_dropped_there() {
    let world = ThreadWorld::new(1, T);
    let drops = Arc::new(std::sync::Mutex::new(Vec::new()));
    let comm = world.communicator(0);
    let recorder_drops = Arc::clone(&drops);
    let thread = CommThread::spawn("zerotrain-comm-test".into(), move || {
        let (made_on, device_calls) = (std::thread::current().id(), Default::default());
        Ok(Recorder { inner: Arc::new(comm), made_on, drops: recorder_drops, device_calls })
    })
    .unwrap();
    let group = thread.split(0, 0).unwrap();
    let mut one = [1.0f32];
    group.all_reduce((&mut one[..]).into(), ReduceOp::Sum).unwrap();
    drop(group);
    drop(thread);
    let drops = drops.lock().unwrap();
    assert_eq!(drops.len(), 2, "the group and the thread's own collective");
    for (made_on, dropped_on) in drops.iter() {
        assert_eq!(made_on, dropped_on, "a collective dropped off the thread that made it");
        assert_ne!(*dropped_on, std::thread::current().id());
    }
}

/// Device calls go to the communication thread (an NCCL communicator may be used only on
/// the thread that made it) and report what the collective says of device memory; a host
/// backend, directly or through a thread, refuses them naming the call.
#[test]
fn device_calls_run_on_the_comm_thread_and_host_backends_refuse_them() {
    use crate::collective::{DeviceBuf, DeviceOp};
    // SAFETY: never handed to a collective that touches memory: the recorder only records,
    // the host backends refuse.
    let (input, output) =
        unsafe { (DeviceBuf::new(4096, 8, Precision::Bf16), DeviceBuf::new(8192, 8, Precision::Bf16)) };
    let call = DeviceCall { op: DeviceOp::AllReduce(ReduceOp::Sum), input, output };
    let world = ThreadWorld::new(1, T);
    let comm = world.communicator(0);
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (recorded, made) = (Arc::clone(&calls), std::sync::mpsc::channel());
    let thread = CommThread::spawn("zerotrain-comm-test".into(), move || {
        made.0.send(std::thread::current().id()).unwrap();
        let drops = Default::default();
        Ok(Recorder { inner: Arc::new(comm), made_on: std::thread::current().id(), drops, device_calls: recorded })
    })
    .unwrap();
    let made_on = made.1.recv().unwrap();
    assert!(thread.reads_device_memory());
    thread.on_device(&call).unwrap();
    assert_eq!(*calls.lock().unwrap(), vec![(made_on, call)]);
    assert_ne!(made_on, std::thread::current().id());

    let host = ThreadWorld::new(1, T);
    let direct = host.communicator(0);
    assert!(!direct.reads_device_memory());
    let err = direct.on_device(&call).unwrap_err();
    assert!(matches!(err, ZeroError::BadBuffer { rank: 0, op: "all_reduce", .. }), "{err}");
    assert!(err.to_string().contains("host memory"), "{err}");
    let threaded = CommThread::new(host.communicator(0)).unwrap();
    assert!(!threaded.reads_device_memory());
    assert_eq!(threaded.on_device(&call).unwrap_err(), err);
}
