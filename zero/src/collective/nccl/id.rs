//! Sharing NCCL's unique id: rank 0 makes the 128 bytes (`ncclGetUniqueId`), every other
//! rank receives them over the host communicator (threads or MPI), and then all create
//! their NCCL communicator from the same id. This is what lets one code path serve one
//! thread per GPU and one process per GPU across nodes. Pure host logic: it runs, and is
//! tested, on machines without a GPU.

use zerotrain_precision::BufMut;

use crate::ZeroError;
use crate::collective::Collective;

/// The size of `ncclUniqueId`.
pub const ID_BYTES: usize = 128;

/// Returns rank 0's id on every rank of `host`. `make` runs on rank 0 only; if it fails,
/// rank 0 aborts `host` with the reason, so every other rank gets an error naming it
/// instead of waiting for an id that never comes.
///
/// The bytes travel as one f32 per byte (0 to 255, exact in f32): the collectives carry
/// float buffers, and no byte pattern can turn into a NaN on the way.
pub fn share_id(
    host: &dyn Collective,
    make: impl FnOnce() -> Result<[u8; ID_BYTES], ZeroError>,
) -> Result<[u8; ID_BYTES], ZeroError> {
    let mut wire = [0f32; ID_BYTES];
    if host.rank() == 0 {
        match make() {
            Ok(id) => wire.iter_mut().zip(id).for_each(|(w, b)| *w = f32::from(b)),
            Err(e) => {
                host.abort(&format!("could not create the NCCL unique id: {e}"));
                return Err(e);
            }
        }
    }
    host.broadcast(BufMut::F32(&mut wire), 0)?;
    let mut id = [0u8; ID_BYTES];
    for (b, w) in id.iter_mut().zip(wire) {
        if !(0.0..=255.0).contains(&w) || w.fract() != 0.0 {
            return Err(ZeroError::Mismatch { rank: host.rank(), detail: format!("NCCL id byte arrived as {w}") });
        }
        *b = w as u8;
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::collective::ThreadWorld;

    #[test]
    fn every_rank_gets_rank_zeros_bytes() {
        let world = ThreadWorld::new(3, Duration::from_secs(10));
        // Distinct bytes in an order that is not the identity, both extremes among them.
        let mut made: [u8; ID_BYTES] = std::array::from_fn(|i| (i * 37) as u8);
        made[1] = 255;
        let ids: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let comm = world.communicator(rank);
                    s.spawn(move || {
                        share_id(&comm, || {
                            assert_eq!(rank, 0, "only rank 0 makes the id");
                            Ok(made)
                        })
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(ids.iter().all(|id| *id == made));
        assert!(made.contains(&0) && made.contains(&255));
    }

    #[test]
    fn a_failure_on_rank_zero_reaches_every_rank_at_once() {
        // A timeout far beyond the test's patience: the others must learn of the failure
        // through the abort, not by timing out.
        let world = ThreadWorld::new(2, Duration::from_secs(600));
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let comm = world.communicator(rank);
                    s.spawn(move || {
                        share_id(&comm, || Err(ZeroError::CommThread("ncclGetUniqueId: no network interface".into())))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let other = results[1].as_ref().unwrap_err().to_string();
        assert!(other.contains("rank 0") && other.contains("no network interface"), "{other}");
        assert!(results[0].as_ref().unwrap_err().to_string().contains("no network interface"));
    }
}
