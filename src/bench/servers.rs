//! `zerotrain bench servers`: a parameter server's round over loopback: one group's rank
//! pushes a pseudo-gradient (in the wire dtype) and pulls the new global weights (f32), as
//! training does, against a server in this process.

use std::time::{Duration, Instant};

use serde::Serialize;
use zerotrain_precision::Precision;

use zerotrain::Result;
use zerotrain::config::{OuterOptimizer, ReplicaMode, ReplicaPlan};
use zerotrain::replicas::server::{Part, PlaceClient, ServerConfig, serve};

/// One measured round.
#[derive(Debug, Clone, Serialize)]
pub struct ServerRow {
    /// Values pushed and pulled.
    pub params: usize,
    /// The pseudo-gradient's wire dtype.
    pub dtype: String,
    /// Bytes pushed plus pulled.
    pub bytes: u64,
    /// The round's seconds (push, the server's step, pull; client-side copies included).
    pub seconds: f64,
    /// `bytes / seconds`, GB/s (10^9).
    pub gb_per_s: f64,
}

/// Rounds of `params` values with pseudo-gradients in `dtype`, `repeats` times.
pub fn rounds(params: usize, dtype: Precision, repeats: usize) -> Result<Vec<ServerRow>> {
    let plan = ReplicaPlan {
        groups: 1,
        sync_every: 1,
        outer: OuterOptimizer { lr: 1.0, momentum: 0.0, nesterov: false },
        comm_dtype: dtype,
        servers: vec![],
        group: Some(0),
        mode: ReplicaMode::Sync,
        group_timeout: Duration::from_secs(600),
        checkpoint_every: 1,
        auth_token_file: None,
        tls: None,
    };
    let server = serve("127.0.0.1:0".parse().expect("an address"), ServerConfig::new(&plan, None))?;
    let start: Vec<f32> = (0..params).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let part = Part { index: 0, count: 1, offset: 0, shard_len: params as u64, layout: 0 };
    let mut round = PlaceClient::start(&server.addr().to_string(), 0, part, &plan, start, Duration::from_secs(600))?;
    let mut rows = Vec::new();
    for r in 0..repeats.max(1) {
        let local: Vec<f32> = round.global().iter().map(|w| w - 1e-4 * (r + 1) as f32).collect();
        let started = Instant::now();
        let (_, done) = round.run(&local)?;
        let seconds = started.elapsed().as_secs_f64();
        let bytes = done.bytes;
        rows.push(ServerRow {
            params,
            dtype: format!("{dtype:?}").to_lowercase(),
            bytes,
            seconds,
            gb_per_s: bytes as f64 / seconds / 1e9,
        });
    }
    drop(round);
    server.stop()?;
    Ok(rows)
}

/// The rows as a table.
pub fn format(rows: &[ServerRow]) -> String {
    let mut out = String::from("parameter server round over loopback (push in the wire dtype, pull in f32)\n");
    out.push_str(&format!("{:>12} {:>6} {:>12} {:>9} {:>8}\n", "params", "dtype", "MB moved", "seconds", "GB/s"));
    for r in rows {
        out.push_str(&format!(
            "{:>12} {:>6} {:>12.1} {:>9.3} {:>8.2}\n",
            r.params,
            r.dtype,
            r.bytes as f64 / 1e6,
            r.seconds,
            r.gb_per_s
        ));
    }
    out
}
