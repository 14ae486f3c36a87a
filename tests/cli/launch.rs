//! `zerotrain launch` as a supervisor of processes: the variables each rank gets, a failed
//! rank taking the job down with its status, a stop signal reaching every rank (ranks here
//! are shell scripts, `--no-zerotrain`), and `train` itself launched on the CPU: a
//! terminal's Ctrl-C to the whole group stops each rank once, and the job saves. The
//! rendezvous the trainers join is tested over loopback in `zerotrain-zero`
//! (`collective::tcp`), across hosts in `tests/cli/hosts.rs`.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{scratch, text};

fn launch(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_zerotrain"));
    command.arg("launch").args(args).current_dir(env!("CARGO_MANIFEST_DIR"));
    for (k, v) in env {
        command.env(k, v);
    }
    command
}

/// Waits until `path` holds `lines` lines (what the ranks append when they are ready).
fn wait_for_lines(path: &Path, lines: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::fs::read_to_string(path).map_or(0, |s| s.lines().count()) < lines {
        assert!(Instant::now() < deadline, "{} never had {lines} lines", path.display());
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn alive(pid: &str) -> bool {
    // A zombie is dead too: its state letter is Z.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.split_whitespace().nth(2) != Some("Z"))
}

#[test]
fn each_rank_gets_torchrun_s_variables_for_its_node() {
    let dir = scratch("launch-vars");
    let script = "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT \
                  ${NCCL_HOSTID:-none} ${NCCL_P2P_DISABLE:-on} $ZEROTRAIN_JOB_SECRET > $OUT/$RANK";
    let out = launch(
        &[
            "--nproc-per-node",
            "2",
            "--nnodes",
            "3",
            "--node-rank",
            "1",
            "--master-addr",
            "node-0",
            "--master-port",
            "6000",
            "--ranks-share-gpu",
            "--no-zerotrain",
            "--",
            "sh",
            "-c",
            script,
        ],
        &[("OUT", dir.to_str().unwrap()), ("ZEROTRAIN_JOB_SECRET", "the-three-nodes-secret")],
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Node 1 of 3, two ranks each: ranks 2 and 3 of 6, each its own NCCL host, with the
    // job's secret as the nodes were given it.
    let got: Vec<String> = ["2", "3"].iter().map(|r| std::fs::read_to_string(dir.join(r)).unwrap()).collect();
    assert_eq!(got[0].trim(), "2 6 0 2 1 node-0 6000 zerotrain-launch-6000-rank-2 1 the-three-nodes-secret");
    assert_eq!(got[1].trim(), "3 6 1 2 1 node-0 6000 zerotrain-launch-6000-rank-3 1 the-three-nodes-secret");
    assert!(!dir.join("0").exists() && !dir.join("4").exists());
    // One node makes a secret of its own (64 hex digits), the same for each of its ranks
    // and another for every job.
    let secrets = |name: &str| {
        let script = "echo $ZEROTRAIN_JOB_SECRET > $OUT/$RANK";
        let sub = dir.join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let out = launch(
            &["--nproc-per-node", "2", "--no-zerotrain", "--", "sh", "-c", script],
            &[("OUT", sub.to_str().unwrap())],
        )
        .env_remove("ZEROTRAIN_JOB_SECRET")
        .output()
        .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        ["0", "1"].map(|r| std::fs::read_to_string(sub.join(r)).unwrap().trim().to_string())
    };
    let (first, second) = (secrets("a"), secrets("b"));
    assert!(first[0].len() == 64 && first[0].bytes().all(|b| b.is_ascii_hexdigit()), "{first:?}");
    assert_eq!(first[0], first[1]);
    assert_ne!(first[0], second[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_that_fails_takes_the_job_down_with_its_status() {
    let dir = scratch("launch-fail");
    // Ranks 0 and 2 would run for ten minutes, and note the SIGTERM that stops them; rank 1
    // fails once they are running. Each says so (its pid) only once its trap and its sleeper
    // are in place: a SIGTERM before then would go unnoted, or leave the sleeper holding the
    // job's output open for its ten minutes.
    let script = r#"if [ $RANK = 1 ]; then
            echo $$ >> $OUT/pids
            while [ $(wc -l < $OUT/pids) -lt 3 ]; do sleep 0.05; done
            exit 3
        fi
        sleep 600 > /dev/null 2>&1 & sleeper=$!
        trap 'echo $RANK >> $OUT/stopped; kill $sleeper; exit 143' TERM
        echo $$ >> $OUT/pids
        wait $sleeper"#;
    let out = launch(
        &["--nproc-per-node", "3", "--no-zerotrain", "--", "sh", "-c", script],
        &[("OUT", dir.to_str().unwrap())],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("launch: rank 1 ended (exit status: 3): stopping the other ranks"));
    let mut stopped: Vec<String> =
        std::fs::read_to_string(dir.join("stopped")).unwrap().lines().map(String::from).collect();
    stopped.sort();
    assert_eq!(stopped, ["0", "2"], "the sleepers were stopped by SIGTERM, not waited for");
    let pids = std::fs::read_to_string(dir.join("pids")).unwrap();
    assert_eq!(pids.lines().count(), 3);
    assert!(pids.lines().all(|pid| !alive(pid)), "every rank ended with the job: {pids}");

    // A rank that ignores SIGTERM is killed after --grace-s; a signal's status is 128 + it.
    let script = r#"trap '' TERM; echo $$ >> $OUT/stubborn
        if [ $RANK = 0 ]; then
            while [ $(wc -l < $OUT/stubborn) -lt 2 ]; do sleep 0.05; done
            kill -KILL $$
        fi
        while :; do sleep 0.1; done"#;
    let out = launch(
        &["--nproc-per-node", "2", "--grace-s", "1", "--no-zerotrain", "--", "sh", "-c", script],
        &[("OUT", dir.to_str().unwrap())],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(128 + 9), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("killing them"), "{}", text(&out.stderr));
    let pids = std::fs::read_to_string(dir.join("stubborn")).unwrap();
    assert!(pids.lines().all(|pid| !alive(pid)), "{pids}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_stop_signal_to_the_launcher_reaches_every_rank_which_ends_its_own_way() {
    let dir = scratch("launch-stop");
    // Each rank "saves" on SIGTERM (writes a line) and ends with 0.
    let script = r#"trap 'kill $sleeper; echo saved $RANK >> $OUT/saved; exit 0' TERM
        sleep 600 & sleeper=$!
        echo ready >> $OUT/ready
        wait $sleeper"#;
    let child = launch(
        &["--nproc-per-node", "3", "--no-zerotrain", "--", "sh", "-c", script],
        &[("OUT", dir.to_str().unwrap())],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_lines(&dir.join("ready"), 3);
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let out: Output = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut saved: Vec<String> =
        std::fs::read_to_string(dir.join("saved")).unwrap().lines().map(String::from).collect();
    saved.sort();
    assert_eq!(saved, ["saved 0", "saved 1", "saved 2"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A port nobody listens on now (the system's choice, given back).
fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// A terminal's Ctrl-C goes to its whole foreground group: every launched rank gets SIGINT
/// directly and SIGTERM from the launcher a moment later. Each stops once (finishing its
/// step), the two ranks save one checkpoint at the step they stopped at, and the launcher
/// exits 0. The launcher here leads a group of its own, as a shell's job does.
#[test]
fn ctrl_c_to_the_launchers_group_stops_every_rank_once_and_the_job_saves() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let dir = scratch("launch-ctrl-c");
    let run = dir.join("run");
    let port = free_port();
    let args = ["--nproc-per-node", "2", "--master-port", &port, "--", "train", "--config", "configs/tiny.json"];
    let mut child = launch(&[&args[..], &["--steps", "100000", "--out", run.to_str().unwrap()]].concat(), &[])
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    stdout.by_ref().map_while(Result::ok).find(|l| l.starts_with("[Rank 0] step=3,")).expect("the ranks train");
    // SAFETY: kill takes plain integers; the group is the launcher's, which has not ended.
    assert_eq!(unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGINT) }, 0);
    let rest: Vec<String> = stdout.map_while(Result::ok).collect();
    let out = child.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "the launcher exits 0 after the ranks saved: {stderr}");
    assert!(!stderr.contains("stopping now"), "no rank took the second signal for an abort: {stderr}");
    let stopped = rest.iter().find(|l| l.starts_with("stopped by SIGINT/SIGTERM at step")).expect("a summary line");
    let step: u64 = stopped.split_whitespace().nth(5).unwrap().parse().unwrap();
    let ckpt = zerotrain_checkpoint::Checkpoint::open(&run.join("checkpoints"), None).unwrap();
    assert_eq!((ckpt.manifest().global_step, ckpt.manifest().world_size), (step, 2), "{stopped}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// One SIGTERM to the launcher arms `--grace-s`: a rank that ignores it is killed after it
/// (before, it was armed only after a failure, and the launcher waited for ever).
#[test]
fn a_rank_that_ignores_the_stop_is_killed_after_the_grace() {
    let dir = scratch("launch-grace");
    let script = r#"trap '' TERM; echo $$ >> $OUT/ready; while :; do sleep 0.1; done"#;
    let child = launch(
        &["--nproc-per-node", "1", "--grace-s", "1", "--no-zerotrain", "--", "sh", "-c", script],
        &[("OUT", dir.to_str().unwrap())],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_lines(&dir.join("ready"), 1);
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 9), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("still running 1 s after SIGTERM: killing them"), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A launcher killed outright takes its ranks with it: each gets SIGTERM (Linux's
/// parent-death signal), so none outlives the job's supervisor.
#[test]
fn ranks_do_not_outlive_a_killed_launcher() {
    let dir = scratch("launch-orphans");
    let mut child = launch(
        &["--nproc-per-node", "2", "--no-zerotrain", "--", "sh", "-c", "echo $$ >> $OUT/pids; exec sleep 600"],
        &[("OUT", dir.to_str().unwrap())],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_lines(&dir.join("pids"), 2);
    child.kill().unwrap();
    child.wait().unwrap();
    let pids = std::fs::read_to_string(dir.join("pids")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while pids.lines().any(alive) {
        assert!(Instant::now() < deadline, "ranks outlived the launcher: {pids}");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Flags out of range are refused by name before anything starts (they overflowed or
/// panicked before), and so are several nodes that could not meet: a loopback rendezvous
/// address, or no job secret shared between them.
#[test]
fn launch_flags_that_cannot_work_are_refused_by_name() {
    let huge = "18446744073709551615";
    let cases: [(&[&str], &str); 5] = [
        (&["--grace-s", huge], "--grace-s"),
        (&["--nproc-per-node", huge], "--nproc-per-node"),
        (&["--nproc-per-node", "1024", "--nnodes", "1000000"], "--nnodes"),
        (&["--nnodes", "2"], "--master-addr 127.0.0.1 is this host's loopback"),
        (&["--nnodes", "2", "--master-addr", "10.0.0.1"], "set ZEROTRAIN_JOB_SECRET to the same value on every node"),
    ];
    for (flags, said) in cases {
        let mut command = launch(&[flags, &["--no-zerotrain", "--", "true"]].concat(), &[]);
        let out = command.env_remove("ZEROTRAIN_JOB_SECRET").output().unwrap();
        let stderr = text(&out.stderr);
        assert!(!out.status.success() && stderr.contains(said), "{flags:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flags:?}: {stderr}");
    }
    // A secret too short to be one is refused before any rank starts; none is ever printed.
    let out = launch(&["--no-zerotrain", "--", "true"], &[("ZEROTRAIN_JOB_SECRET", "hunter2")]).output().unwrap();
    let stderr = text(&out.stderr);
    assert!(!out.status.success() && stderr.contains("ZEROTRAIN_JOB_SECRET has 7 bytes"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[test]
fn ranks_started_by_hand_need_a_shared_secret_and_malformed_variables_are_named() {
    // torchrun's variables set by hand for two ranks, with no job secret: refused by name.
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["train", "--config", "configs/tiny.json", "--steps", "1", "--out", "/tmp/zerotrain-never"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs([("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", &free_port())])
        .env_remove("ZEROTRAIN_JOB_SECRET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("ZEROTRAIN_JOB_SECRET is not set"), "{}", text(&out.stderr));
    // One of them wrong: named, not ignored.
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["config", "check", "configs/tiny.json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs([("RANK", "1"), ("WORLD_SIZE", "two"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("WORLD_SIZE=\"two\""), "{}", text(&out.stderr));
}
