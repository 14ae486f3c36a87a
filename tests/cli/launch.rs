//! `zerotrain launch` as a supervisor of processes: the variables each rank gets, a failed
//! rank taking the job down with its status, a stop signal reaching every rank. The ranks
//! here are shell scripts (`--no-zerotrain`): `train` under a launcher needs CUDA GPUs, and
//! on this machine is refused by name (tested last); the rendezvous the trainers join is
//! tested over loopback in `zerotrain-zero` (`collective::tcp`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::text;

fn launch(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_zerotrain"));
    command.arg("launch").args(args).current_dir(env!("CARGO_MANIFEST_DIR"));
    for (k, v) in env {
        command.env(k, v);
    }
    command
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zerotrain-launch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
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
    let dir = scratch("vars");
    let script = "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT \
                  ${NCCL_HOSTID:-none} ${NCCL_P2P_DISABLE:-on} > $OUT/$RANK";
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
        &[("OUT", dir.to_str().unwrap())],
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Node 1 of 3, two ranks each: ranks 2 and 3 of 6, each its own NCCL host.
    let got: Vec<String> = ["2", "3"].iter().map(|r| std::fs::read_to_string(dir.join(r)).unwrap()).collect();
    assert_eq!(got[0].trim(), "2 6 0 2 1 node-0 6000 zerotrain-launch-6000-rank-2 1");
    assert_eq!(got[1].trim(), "3 6 1 2 1 node-0 6000 zerotrain-launch-6000-rank-3 1");
    assert!(!dir.join("0").exists() && !dir.join("4").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rank_that_fails_takes_the_job_down_with_its_status() {
    let dir = scratch("fail");
    // Ranks 0 and 2 would run for ten minutes; rank 1 fails once they are running.
    let script = r#"echo $$ >> $OUT/pids
        if [ $RANK = 1 ]; then
            while [ $(wc -l < $OUT/pids) -lt 3 ]; do sleep 0.05; done
            exit 3
        fi
        exec sleep 600"#;
    let started = Instant::now();
    let out = launch(
        &["--nproc-per-node", "3", "--no-zerotrain", "--", "sh", "-c", script],
        &[("OUT", dir.to_str().unwrap())],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("launch: rank 1 ended (exit status: 3): stopping the other ranks"));
    assert!(started.elapsed() < Duration::from_secs(60), "the sleepers were stopped, not waited for");
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
    let dir = scratch("stop");
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

#[test]
fn train_under_a_launcher_needs_cuda_and_malformed_variables_are_named() {
    let out = launch(
        &["--nproc-per-node", "2", "--master-port", "29517", "--", "train", "--config", "configs/tiny.json"],
        &[],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("`zerotrain.device`: is \"cpu\" but this process was started by a launcher"), "{stderr}");
    assert!(stderr.contains("run the processes under mpirun"), "{stderr}");
    // torchrun's variables set by hand, one of them wrong: named, not ignored.
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(["config", "check", "configs/tiny.json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .envs([("RANK", "1"), ("WORLD_SIZE", "two"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("WORLD_SIZE=\"two\""), "{}", text(&out.stderr));
}
