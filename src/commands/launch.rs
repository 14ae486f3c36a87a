//! `zerotrain launch`: starts this node's ranks as processes, in the form GPU clusters
//! already use (torchrun's flags and variables), and supervises them as torchrun does: a
//! rank that fails takes the job down, and a stop signal reaches every rank.

use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use zerotrain_zero::collective::tcp::{JOB_SECRET_VARIABLE, JobSecret};

/// `zerotrain launch`'s flags.
#[derive(clap::Args, Debug)]
pub struct LaunchArgs {
    /// Processes (ranks) to start on this node (1 to 1024).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_NPROC as i64))]
    pub nproc_per_node: u32,
    /// Nodes in the job (1 to 65536), each running `zerotrain launch` with the same flags but
    /// its own --node-rank.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_NNODES as i64))]
    pub nnodes: u32,
    /// This node's place among the nodes: its ranks are node-rank x nproc-per-node onwards.
    #[arg(long, default_value_t = 0)]
    pub node_rank: u32,
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
    /// Seconds the ranks have to end, after one failed or after a stop signal (long enough
    /// to finish a step and save a checkpoint), before they are killed; at most a week.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(0..=MAX_GRACE_S))]
    pub grace_s: u64,
    /// What each process runs: `zerotrain` arguments, as in `-- train --config FILE`.
    #[arg(last = true, required = true, num_args = 1..)]
    pub command: Vec<String>,
}

/// The most processes one node starts.
const MAX_NPROC: u32 = 1024;
/// The most nodes a job has.
const MAX_NNODES: u32 = 65536;
/// The longest `--grace-s`: a week.
const MAX_GRACE_S: u64 = 7 * 24 * 3600;

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
    if args.node_rank >= args.nnodes {
        bail!("--node-rank {} is not a node of --nnodes {}", args.node_rank, args.nnodes);
    }
    // At most 2^26 ranks (the flags' ranges): no product here overflows.
    let (nproc, node_rank) = (args.nproc_per_node as usize, args.node_rank as usize);
    let world_size = nproc * args.nnodes as usize;
    if args.nnodes > 1 && is_loopback(&args.master_addr) {
        bail!(
            "--master-addr {} is this host's loopback, but --nnodes {} puts ranks on other hosts, which cannot \
             reach it: give node 0's address on the network the nodes share",
            args.master_addr,
            args.nnodes
        );
    }
    let secret = job_secret(args.nnodes)?;
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

    let mut pids: Vec<Option<u32>> = Vec::with_capacity(nproc);
    for local in 0..nproc {
        let rank = node_rank * nproc + local;
        let mut command = Command::new(&program);
        command
            .args(rest)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc_per_node.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &args.master_addr)
            .env("MASTER_PORT", args.master_port.to_string())
            .env(JOB_SECRET_VARIABLE, &secret);
        end_with_the_launcher(&mut command);
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

/// Whether `host` is a loopback address as written (`localhost`, 127.0.0.0/8, `::1`): one
/// the other nodes cannot reach. A hostname that resolves to loopback here (Debian's and
/// Ubuntu's `/etc/hosts` map the machine's own name to 127.0.1.1) is not: the other nodes
/// resolve it through their own, and rank 0 listens on every address.
fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The job's secret for the ranks: `ZEROTRAIN_JOB_SECRET` where it is set (checked here, so
/// that a bad one is refused once, not by every rank), else one made for a job of one node.
/// The nodes of a larger job must be given the same one: it is never sent between them.
fn job_secret(nnodes: u32) -> anyhow::Result<String> {
    match std::env::var(JOB_SECRET_VARIABLE) {
        Ok(secret) => {
            JobSecret::new(&secret)?;
            Ok(secret)
        }
        Err(_) if nnodes == 1 => Ok(JobSecret::generate()?),
        Err(_) => bail!(
            "--nnodes {nnodes}: set {JOB_SECRET_VARIABLE} to the same value on every node (e.g. `export \
             {JOB_SECRET_VARIABLE}=$(openssl rand -hex 32)` in the job script): the ranks prove it to each other, \
             so that nobody else who reaches the rendezvous port can join or abort the job"
        ),
    }
}

/// Has the rank sent SIGTERM (save and stop) when the launcher's process ends, killed
/// included, so that no rank outlives the job's supervisor (Linux's parent-death signal;
/// elsewhere a SIGKILLed launcher leaves its ranks running: docs/commands.md says so).
fn end_with_the_launcher(command: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the child between fork and exec, and calls only
        // async-signal-safe functions (prctl, getppid, kill of itself) with plain integers.
        let launcher = std::process::id() as libc::pid_t;
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died before the signal was armed.
                if libc::getppid() != launcher {
                    libc::kill(libc::getpid(), libc::SIGTERM);
                }
                Ok(())
            });
        }
    }
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
/// save and end); a stop signal to the launcher is sent on to every rank as SIGTERM. Either
/// way the ranks still running after `--grace-s` are killed, as they are at a second stop
/// signal. Returns the job's exit code.
fn supervise(args: &LaunchArgs, pids: &mut [Option<u32>], events: &mpsc::Receiver<Event>) -> i32 {
    let first_rank = args.node_rank as usize * args.nproc_per_node as usize;
    let grace = Duration::from_secs(args.grace_s);
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
        // Armed once, by the first failure or stop; a week from now fits any clock.
        let mut arm = || {
            kill_at.get_or_insert_with(|| Instant::now() + grace);
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
                        arm();
                    }
                }
            }
            Event::Stop => {
                stops += 1;
                if stops == 1 {
                    eprintln!(
                        "launch: stop signal: sending SIGTERM to every rank, which saves and ends (killed after {} \
                         s, or at a second signal)",
                        args.grace_s
                    );
                    signal_all(pids, libc::SIGTERM);
                    arm();
                } else {
                    signal_all(pids, libc::SIGKILL);
                }
            }
        }
    }
    failed.unwrap_or(0)
}
