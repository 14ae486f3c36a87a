//! `zerotrain launch`: starts this node's ranks as processes, in the form GPU clusters
//! already use (torchrun's flags and variables), and supervises them as torchrun does: a
//! rank that fails takes the job down, and a stop signal reaches every rank.

use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// `zerotrain launch`'s flags.
#[derive(clap::Args, Debug)]
pub struct LaunchArgs {
    /// Processes (ranks) to start on this node.
    #[arg(long, default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Nodes in the job, each running `zerotrain launch` with the same flags but its own
    /// --node-rank.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's place among the nodes: its ranks are node-rank x nproc-per-node onwards.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// The address of the node whose first process is rank 0, which serves the rendezvous.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// The rendezvous port on that node.
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// The ranks share this node's GPU(s), more ranks than GPUs (for testing several ranks
    /// on one GPU): each process gets an NCCL_HOSTID of its own, so that NCCL takes it for a
    /// host of its own, with NCCL's peer-to-peer and shared-memory transports off and its
    /// sockets on loopback.
    #[arg(long)]
    pub ranks_share_gpu: bool,
    /// Run the command after `--` as it is, not as `zerotrain` arguments (torchrun's
    /// --no-python).
    #[arg(long)]
    pub no_zerotrain: bool,
    /// Seconds the other ranks have to end after one failed before they are killed.
    #[arg(long, default_value_t = 60)]
    pub grace_s: u64,
    /// What each process runs: `zerotrain` arguments, as in `-- train --config FILE`.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// What the supervisor waits for.
enum Event {
    /// A rank's process ended (its local index, and how).
    Exited(usize, std::io::Result<ExitStatus>),
    /// SIGINT or SIGTERM reached the launcher.
    Stop,
}

/// `zerotrain launch`: exits with the first failed rank's status (128 + the signal for a
/// rank a signal ended), 0 when every rank succeeded.
pub fn launch(args: LaunchArgs) -> anyhow::Result<()> {
    if args.nproc_per_node == 0 || args.nnodes == 0 {
        bail!("--nproc-per-node and --nnodes must be at least 1");
    }
    if args.node_rank >= args.nnodes {
        bail!("--node-rank {} is not a node of --nnodes {}", args.node_rank, args.nnodes);
    }
    let world_size = args.nproc_per_node * args.nnodes;
    let (program, rest) = match args.no_zerotrain {
        true => (args.command[0].clone().into(), &args.command[1..]),
        false => (std::env::current_exe().context("cannot find the zerotrain executable")?, &args.command[..]),
    };
    let (tx, rx) = mpsc::channel();
    let stop = tx.clone();
    ctrlc::set_handler(move || {
        let _ = stop.send(Event::Stop);
    })
    .context("cannot install the launcher's signal handler")?;

    let mut pids: Vec<Option<u32>> = Vec::with_capacity(args.nproc_per_node);
    for local in 0..args.nproc_per_node {
        let rank = args.node_rank * args.nproc_per_node + local;
        let mut command = Command::new(&program);
        command
            .args(rest)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", args.master_port.to_string());
        if args.ranks_share_gpu {
            command
                .env("NCCL_HOSTID", format!("zerotrain-launch-{}-rank-{rank}", args.master_port))
                .env("NCCL_P2P_DISABLE", "1")
                .env("NCCL_SHM_DISABLE", "1");
            if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
                command.env("NCCL_SOCKET_IFNAME", "lo");
            }
        }
        let child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                signal_all(&pids, libc::SIGKILL);
                return Err(e).with_context(|| format!("cannot start rank {rank} ({})", program.display()));
            }
        };
        pids.push(Some(child.id()));
        watch(child, local, tx.clone());
    }
    drop(tx);
    let code = supervise(&args, &mut pids, &rx);
    std::process::exit(code);
}

/// Reports `child`'s end on `events`, from a thread of its own.
fn watch(mut child: Child, local: usize, events: mpsc::Sender<Event>) {
    std::thread::spawn(move || {
        let _ = events.send(Event::Exited(local, child.wait()));
    });
}

/// Sends `signal` to every rank still running.
fn signal_all(pids: &[Option<u32>], signal: libc::c_int) {
    for pid in pids.iter().flatten() {
        // SAFETY: kill takes plain integers; the pid is a child of ours not yet reported ended.
        unsafe {
            libc::kill(*pid as libc::pid_t, signal);
        }
    }
}

/// The exit code a rank's status stands for: its own, or 128 + the signal that ended it.
fn code_of(status: &std::io::Result<ExitStatus>) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(status) => status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1),
        Err(_) => 1,
    }
}

/// Waits for every rank. The first that fails has the others sent SIGTERM (so that they
/// save and end), and after `--grace-s` SIGKILL; a stop signal to the launcher is sent on
/// to every rank as SIGTERM, and a second one kills them. Returns the job's exit code.
fn supervise(args: &LaunchArgs, pids: &mut [Option<u32>], events: &mpsc::Receiver<Event>) -> i32 {
    let first_rank = args.node_rank * args.nproc_per_node;
    let mut failed: Option<i32> = None;
    let mut stops = 0;
    let mut kill_at: Option<Instant> = None;
    while pids.iter().any(Option::is_some) {
        let event = match kill_at {
            Some(at) => match events.recv_timeout(at.saturating_duration_since(Instant::now())) {
                Ok(event) => event,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    eprintln!("launch: ranks still running {} s after SIGTERM: killing them", args.grace_s);
                    signal_all(pids, libc::SIGKILL);
                    kill_at = None;
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            },
            None => match events.recv() {
                Ok(event) => event,
                Err(_) => break,
            },
        };
        match event {
            Event::Exited(local, status) => {
                pids[local] = None;
                let code = code_of(&status);
                if code != 0 && failed.is_none() {
                    failed = Some(code);
                    if stops == 0 && pids.iter().any(Option::is_some) {
                        let how = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                        eprintln!("launch: rank {} ended ({how}): stopping the other ranks", first_rank + local);
                        signal_all(pids, libc::SIGTERM);
                        kill_at = Some(Instant::now() + Duration::from_secs(args.grace_s));
                    }
                }
            }
            Event::Stop => {
                stops += 1;
                if stops == 1 {
                    eprintln!("launch: stop signal: sending SIGTERM to every rank (a second signal kills them)");
                    signal_all(pids, libc::SIGTERM);
                } else {
                    signal_all(pids, libc::SIGKILL);
                }
            }
        }
    }
    failed.unwrap_or(0)
}
