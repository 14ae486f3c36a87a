//! [`ServerExchange`]: one rank's rounds through every server, each holding a contiguous part
//! of the rank's shard (TensorFlow's partitioned variables: `len` servers share every
//! place's weights and outer state, and a round's bytes, about equally).

use std::ops::Range;
use std::time::Duration;

use zerotrain_zero::Sharding;

use super::Part;
use super::client::PlaceClient;
use crate::config::ReplicaPlan;
use crate::replicas::Round;
use crate::replicas::round::scatter;
use crate::{Error, Result};

/// One rank's parts, one per server, and its shard's global weights per unit.
pub struct ServerExchange {
    parts: Vec<(Range<usize>, PlaceClient)>,
    global: Vec<Vec<f32>>,
    /// The global weights gathered from the parts, flat (the parts' layout).
    flat: Vec<f32>,
    /// A round's local weights, flat, for the parts (kept across rounds).
    local: Vec<f32>,
}

/// Part `k` of `len` values over `servers` servers: contiguous, sizes differing by at most one.
fn part(len: usize, servers: usize, k: usize) -> Range<usize> {
    (k * len / servers)..((k + 1) * len / servers)
}

/// A fingerprint of what a rank's shard holds (FNV-1a over the text below): every unit's
/// parameter paths and shapes, the ranks sharing each unit, and the rank's shard length per
/// unit. Ranks at one place in groups of one model, stage and size agree on it.
fn fingerprint(sharding: &Sharding, shard_lens: &[usize]) -> u64 {
    let mut text = format!("ranks {}\n", sharding.world_size());
    for (unit, len) in sharding.units().iter().zip(shard_lens) {
        text.push_str(&format!("unit {} shard {len}\n", unit.name));
        for entry in unit.layout.entries() {
            text.push_str(&format!("{} {:?}\n", entry.path, entry.shape));
        }
    }
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, b| (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Refuses a `local_sgd.servers` list naming one server twice, as written or as resolved
/// (`localhost:P` and `127.0.0.1:P`): its two parts would overwrite each other. A name that
/// does not resolve is left to the connection to report.
fn refuse_one_server_twice(servers: &[String]) -> Result<()> {
    use std::net::ToSocketAddrs;
    let resolved: Vec<Vec<std::net::SocketAddr>> =
        servers.iter().map(|s| s.to_socket_addrs().map(Iterator::collect).unwrap_or_default()).collect();
    for (i, a) in servers.iter().enumerate() {
        for (j, b) in servers.iter().enumerate().skip(i + 1) {
            if a.eq_ignore_ascii_case(b) || resolved[i].iter().any(|x| resolved[j].contains(x)) {
                return Err(Error::Usage(format!(
                    "local_sgd.servers: `{a}` and `{b}` are one server; list each server once"
                )));
            }
        }
    }
    Ok(())
}

impl ServerExchange {
    /// Connects to every server in `servers` (at once) and joins each as `place` with its
    /// part of this rank's `start` weights, saying which part it is and the fingerprint of
    /// the shard's layout in `sharding` (`fingerprint`); the global weights to start from
    /// come back. Two addresses that resolve to one server are refused.
    pub fn start(
        servers: &[String],
        place: usize,
        sharding: &Sharding,
        plan: &ReplicaPlan,
        start: Vec<Vec<f32>>,
        timeout: Duration,
    ) -> Result<Self> {
        refuse_one_server_twice(servers)?;
        let lens: Vec<usize> = start.iter().map(Vec::len).collect();
        let layout = fingerprint(sharding, &lens);
        let flat = start.concat();
        let n = servers.len();
        let parts: Vec<Result<(Range<usize>, PlaceClient)>> = std::thread::scope(|s| {
            let handles: Vec<_> = servers
                .iter()
                .enumerate()
                .map(|(k, addr)| {
                    let range = part(flat.len(), n, k);
                    let values = flat[range.clone()].to_vec();
                    let part = Part {
                        index: k as u32,
                        count: n as u32,
                        offset: range.start as u64,
                        shard_len: flat.len() as u64,
                        layout,
                    };
                    s.spawn(move || PlaceClient::start(addr, place, part, plan, values, timeout).map(|r| (range, r)))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Launch("a server's client panicked".into()))))
                .collect()
        });
        let parts = parts.into_iter().collect::<Result<Vec<_>>>()?;
        let mut rounds = Self { parts, global: start, flat, local: Vec::new() };
        rounds.gather();
        Ok(rounds)
    }

    /// The shard's global weights, per unit.
    pub fn global(&self) -> &[Vec<f32>] {
        &self.global
    }

    /// A round through every server at once (see [`PlaceClient::run`]): the bytes of all
    /// parts, the fewest live groups any server saw, the largest staleness, and whether any
    /// part joined again.
    pub fn run(&mut self, local: &[Vec<f32>]) -> Result<(&[Vec<f32>], Round)> {
        self.local.clear();
        self.local.extend(local.iter().flatten());
        let results: Vec<Result<Round>> = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .parts
                .iter_mut()
                .map(|(range, round)| {
                    let local = &self.local[range.clone()];
                    s.spawn(move || round.run(local).map(|(_, x)| x))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(Error::Launch("a server's client panicked".into()))))
                .collect()
        });
        let mut total =
            Round { round: 0, bytes: 0, live_groups: usize::MAX, staleness: 0, rejoined: false, global_round: None };
        for x in results {
            let x = x?;
            total.global_round = total.global_round.max(x.global_round);
            total.bytes += x.bytes;
            total.live_groups = total.live_groups.min(x.live_groups);
            total.staleness = total.staleness.max(x.staleness);
            total.rejoined |= x.rejoined;
        }
        self.gather();
        Ok((&self.global, total))
    }

    /// The parts' global weights back into the per-unit layout.
    fn gather(&mut self) {
        for (range, round) in &self.parts {
            self.flat[range.clone()].copy_from_slice(round.global());
        }
        scatter(&self.flat, &mut self.global);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn parts_cover_the_shard_contiguously_and_evenly() {
        for (len, servers) in [(10, 3), (2, 3), (0, 2), (7, 1)] {
            let parts: Vec<_> = (0..servers).map(|k| super::part(len, servers, k)).collect();
            assert_eq!(parts.first().unwrap().start, 0);
            assert_eq!(parts.last().unwrap().end, len);
            assert!(parts.windows(2).all(|w| w[0].end == w[1].start));
            let sizes: Vec<usize> = parts.iter().map(|r| r.len()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
        }
    }
}
