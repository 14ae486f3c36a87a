//! Replica groups as separate processes through `zerotrain serve`, attacked: a group
//! SIGKILLed or SIGSTOPped mid-window, the server SIGKILLed and restarted from its
//! checkpoint. Tiny GPT jobs of one rank each, loopback only, every wait bounded.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{temp_run, text};

/// A config of the tiny GPT as one rank with `local_sgd` set to `section`, written whole
/// under its name at once (renamed into place: a job started earlier may be reading the
/// file this one replaces).
fn config(dir: &Path, name: &str, section: &str) -> PathBuf {
    let tiny = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/tiny.json")).unwrap();
    let json = tiny.replacen('{', &format!(r#"{{ "local_sgd": {section},"#), 1).replace(
        r#""zerotrain": { "world_size": 2, "eval_every": 2 }"#,
        r#""zerotrain": { "world_size": 1, "eval_every": 1000000, "comm_timeout_s": 30 }"#,
    );
    let (path, partial) = (dir.join(name), dir.join(format!("{name}.partial")));
    std::fs::write(&partial, json).unwrap();
    std::fs::rename(&partial, &path).unwrap();
    path
}

/// A child process that is killed (and reaped) when dropped, so that a failing test
/// leaves no server or training job behind.
struct Job(Option<Child>);

impl Job {
    fn spawn(command: &mut Command) -> Self {
        Self(Some(command.spawn().unwrap()))
    }

    fn child(&mut self) -> &mut Child {
        self.0.as_mut().expect("a job not yet finished")
    }

    fn id(&self) -> u32 {
        self.0.as_ref().expect("a job not yet finished").id()
    }

    /// Kills it (SIGKILL) and reaps it.
    fn kill(&mut self) {
        let _ = self.child().kill();
        let _ = self.child().wait();
    }

    fn output(mut self) -> Output {
        self.0.take().expect("a job not yet finished").wait_with_output().unwrap()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Starts `zerotrain serve` on `listen` with `section`'s groups; returns it and the address
/// it printed.
fn server(dir: &Path, section: &str, listen: &str, checkpoint: Option<&Path>) -> (Job, String) {
    // A server reads any group's config (its own servers and group do not matter to it).
    let as_group = section.replacen('{', r#"{"servers": ["127.0.0.1:1"], "group": 0, "#, 1);
    let path = config(dir, "server.json", &as_group);
    let mut args = vec!["serve", "--listen", listen, "--config", path.to_str().unwrap()];
    if let Some(c) = checkpoint {
        args.extend(["--checkpoint", c.to_str().unwrap()]);
    }
    let log = std::fs::File::create(dir.join(format!("server-{}.log", now_ms()))).unwrap();
    let mut job =
        Job::spawn(Command::new(env!("CARGO_BIN_EXE_zerotrain")).args(&args).stdout(Stdio::piped()).stderr(log));
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(job.child().stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.contains("listening on 127.0.0.1:"), "{line}");
    (job, line.trim().rsplit(' ').next().unwrap().to_string())
}

fn now_ms() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
}

/// A group's training job: `steps` steps as `group` of the groups' config `path` through
/// `addr`, into `run{group}`.
fn group(dir: &Path, path: &Path, addr: &str, group: usize, steps: u64) -> Job {
    group_into(dir, path, addr, group, steps, &format!("run{group}"))
}

/// [`group`] into the run folder `run`. The server and the group come as `--server` and
/// `--group` (one config for every group).
fn group_into(dir: &Path, path: &Path, addr: &str, group: usize, steps: u64, run: &str) -> Job {
    let out = dir.join(run);
    let (steps, group) = (steps.to_string(), group.to_string());
    Job::spawn(
        Command::new(env!("CARGO_BIN_EXE_zerotrain"))
            .args(["train", "--config", path.to_str().unwrap(), "--server", addr, "--group", &group])
            .args(["--steps", &steps, "--out", out.to_str().unwrap()])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    )
}

/// The metrics lines group `group` has written so far (a line being written is skipped).
fn metrics(dir: &Path, group: usize) -> Vec<serde_json::Value> {
    metrics_in(&dir.join(format!("run{group}")))
}

/// The metrics lines written so far in the run folder `run`.
fn metrics_in(run: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn rounds(dir: &Path, group: usize) -> u64 {
    metrics(dir, group).last().and_then(|m| m["rounds"].as_u64()).unwrap_or(0)
}

/// Waits (polling) until `done`, failing with `what` after `limit`.
fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < limit, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(job: &Job, signal: &str) {
    let status = Command::new("kill").args([&format!("-{signal}"), &job.id().to_string()]).status().unwrap();
    assert!(status.success(), "kill -{signal}");
}

/// Waits for a job to end, killing it past `limit` (then failing).
fn finish(mut job: Job, limit: Duration) -> Output {
    let started = Instant::now();
    while job.child().try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = job.child().kill();
            panic!("a job ran past {limit:?}: {}", text(&job.output().stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    job.output()
}

fn server_log(dir: &Path) -> String {
    let mut logs: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    logs.retain(|p| p.file_name().unwrap().to_str().unwrap().starts_with("server-"));
    logs.sort();
    logs.iter().map(|p| std::fs::read_to_string(p).unwrap()).collect::<Vec<_>>().join("\n")
}

/// Three groups; once they have met a few times, group 2 is SIGKILLed and group 1 stopped
/// (SIGSTOP) at once. The server drops both once they have kept group 0 waiting past the
/// group timeout, and group 0 goes on alone (its metrics say one live group). Group 1,
/// continued (SIGCONT), finds itself dropped, joins again from the current global weights
/// and both survivors finish every step; a new job for the killed group joins mid-run and
/// trains its steps with them.
#[test]
fn a_killed_group_is_dropped_and_a_stalled_one_rejoins() {
    let dir = temp_run("ps-faults");
    std::fs::create_dir_all(&dir).unwrap();
    let section = r#"{"groups": 3, "sync_every": 2, "group_timeout_s": 3, "outer_optimizer": {"type": "sgd"}}"#;
    let (mut server, addr) = server(&dir, section, "127.0.0.1:0", None);
    let groups = config(&dir, "groups.json", section);
    let steps = 4000;
    let jobs: Vec<Job> = (0..3).map(|g| group(&dir, &groups, &addr, g, steps)).collect();
    let live = |m: &serde_json::Value| m["live_groups"].as_u64();
    // A group slow to start (a loaded machine) may be dropped from a first round and join
    // again: the faults come once all three are live.
    wait_until("three live groups to meet five times", Duration::from_secs(60), || {
        (0..3).all(|g| rounds(&dir, g) >= 5) && metrics(&dir, 0).last().is_some_and(|m| live(m) == Some(3))
    });
    let before = metrics(&dir, 0).len();
    let mut jobs = jobs.into_iter();
    let (zero, one, mut two) = (jobs.next().unwrap(), jobs.next().unwrap(), jobs.next().unwrap());
    two.kill(); // SIGKILL
    signal(&one, "STOP");
    wait_until("group 0 to go on alone", Duration::from_secs(30), || {
        metrics(&dir, 0).last().is_some_and(|m| live(m) == Some(1))
    });
    signal(&one, "CONT");
    // A new job for the killed group joins mid-run and trains from the current weights.
    let again = group_into(&dir, &groups, &addr, 2, 40, "run2-again");
    let again = finish(again, Duration::from_secs(120));
    assert!(again.status.success(), "group 2 again: {}", text(&again.stderr));
    let last = metrics_in(&dir.join("run2-again")).pop().unwrap();
    assert_eq!((last["step"].as_u64(), last["rounds"].as_u64()), (Some(40), Some(20)), "{last}");
    let (zero, one) = (finish(zero, Duration::from_secs(120)), finish(one, Duration::from_secs(120)));
    drop(two);
    server.kill();
    assert!(zero.status.success(), "group 0: {}", text(&zero.stderr));
    assert!(one.status.success(), "group 1: {}", text(&one.stderr));
    assert!(text(&one.stderr).contains("dropped from the quorum") && text(&one.stderr).contains("joining again"));
    let log = server_log(&dir);
    assert!(log.contains("dropped group 2") && log.contains("dropped group 1"), "{log}");
    for g in [0, 1] {
        let m = metrics(&dir, g);
        assert_eq!(m.last().unwrap()["step"].as_u64(), Some(steps), "group {g} finished");
    }
    let after: Vec<u64> = metrics(&dir, 0)[before..].iter().filter_map(live).collect();
    assert!(after.contains(&1), "group 0 went on alone after the faults: {after:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The server is SIGKILLed in the middle of training and started again on its address from
/// its checkpoint (saved every round), the groups held still by SIGSTOP meanwhile so that the
/// kill lands mid-run: both groups reconnect (retrying with backoff), join
/// again, and finish every step. Every call carries the token of the config's file.
#[test]
fn a_killed_server_restarts_from_its_checkpoint_and_the_groups_go_on() {
    let dir = temp_run("ps-restart");
    std::fs::create_dir_all(&dir).unwrap();
    let token = dir.join("token");
    std::fs::write(&token, "a-shared-secret-of-32-characters").unwrap();
    let section = format!(
        r#"{{"groups": 2, "sync_every": 2, "checkpoint_every": 1, "group_timeout_s": 20, "auth_token_file": "{}"}}"#,
        token.display()
    );
    let section = section.as_str();
    let saved = dir.join("ckpt");
    let (mut first, addr) = server(&dir, section, "127.0.0.1:0", Some(&saved));
    let groups = config(&dir, "groups.json", section);
    let steps = 3000;
    let jobs: Vec<Job> = (0..2).map(|g| group(&dir, &groups, &addr, g, steps)).collect();
    wait_until("ten rounds and a checkpoint", Duration::from_secs(60), || {
        (0..2).all(|g| rounds(&dir, g) >= 10) && saved.join("latest").exists()
    });
    // Held still while the server dies, so that neither finishes before it does.
    jobs.iter().for_each(|j| signal(j, "STOP"));
    assert!((0..2).all(|g| rounds(&dir, g) < steps / 2), "the groups finished before the server was killed");
    first.kill(); // SIGKILL
    jobs.iter().for_each(|j| signal(j, "CONT"));
    // Reaped: its port is free again (the server's listener reuses the address).
    let (mut second, again) = server(&dir, section, &addr, Some(&saved));
    assert_eq!(again, addr);
    let outs: Vec<Output> = jobs.into_iter().map(|j| finish(j, Duration::from_secs(120))).collect();
    second.kill();
    assert!(server_log(&dir).contains("resumed from the checkpoint of round"), "{}", server_log(&dir));
    assert!(!server_log(&dir).contains("no token"), "{}", server_log(&dir));
    finished_in_step(&dir, &outs, steps);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `zerotrain bench servers` measures real rounds: each row moved the pushed pseudo-gradient
/// in its dtype plus the pulled f32 weights (6 bytes a value in bf16, 8 in fp32).
#[test]
fn bench_servers_moves_the_pushed_and_pulled_bytes() {
    for (dtype, width) in [("bf16", 6), ("fp32", 8)] {
        let out =
            super::zerotrain(&["bench", "servers", "--params", "300000", "--dtype", dtype, "--repeats", "2", "--json"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(rows.len(), 2);
        for row in rows {
            assert_eq!(row["bytes"].as_u64(), Some(300_000 * width), "{row}");
            assert!(row["seconds"].as_f64().unwrap() > 0.0 && row["gb_per_s"].as_f64().unwrap() > 0.0, "{row}");
        }
    }
    let bad = super::zerotrain(&["bench", "servers", "--dtype", "fp8"]);
    assert!(!bad.status.success() && text(&bad.stderr).contains("--dtype must be bf16 or fp32"));
}

/// A server reads the groups' own recipe: its `"auto"` schedule length, world size and
/// everything but `local_sgd` do not matter to it.
#[test]
fn serve_reads_a_recipe_with_an_auto_schedule() {
    let dir = temp_run("ps-recipe");
    std::fs::create_dir_all(&dir).unwrap();
    let recipe = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/local_sgd.json")).unwrap();
    let path = dir.join("recipe.json");
    std::fs::write(
        &path,
        recipe.replacen(r#""groups": 4,"#, r#""groups": 4, "servers": ["127.0.0.1:1"], "group": 0,"#, 1),
    )
    .unwrap();
    let mut job = Job::spawn(
        Command::new(env!("CARGO_BIN_EXE_zerotrain"))
            .args(["serve", "--listen", "127.0.0.1:0", "--config", path.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(job.child().stdout.take().unwrap()), &mut line).unwrap();
    let _ = job.child().kill();
    let out = job.output();
    assert!(line.contains("parameter server for 4 groups listening on 127.0.0.1:"), "{line} {}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--server` and `--group` need a `local_sgd` section to complete, and say so by name.
#[test]
fn server_flags_without_groups_name_themselves() {
    let tiny = concat!(env!("CARGO_MANIFEST_DIR"), "/configs/tiny.json");
    for flag in [["--server", "127.0.0.1:1"], ["--group", "1"]] {
        let out = super::zerotrain(&["train", "--config", tiny, flag[0], flag[1], "--steps", "1"]);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(&format!("`{}`: needs a local_sgd section", flag[0])), "{stderr}");
    }
}

/// A server that dies and never comes back: the group retries with backoff for its
/// `comm_timeout_s`, then fails with one line naming the server's address, never hangs.
#[test]
fn a_server_gone_for_good_fails_the_group_by_address_within_its_timeout() {
    let dir = temp_run("ps-gone");
    std::fs::create_dir_all(&dir).unwrap();
    let section = r#"{"groups": 1, "sync_every": 2}"#;
    let (mut server, addr) = server(&dir, section, "127.0.0.1:0", None);
    let path = config(&dir, "gone.json", section);
    let json = std::fs::read_to_string(&path).unwrap().replace(r#""comm_timeout_s": 30"#, r#""comm_timeout_s": 3"#);
    std::fs::write(&path, json).unwrap();
    let job = group_into(&dir, &path, &addr, 0, 100_000, "run");
    wait_until("a few rounds", Duration::from_secs(60), || {
        rounds(&dir, 0) >= 1 || metrics_in(&dir.join("run")).len() > 4
    });
    server.kill();
    let out = finish(job, Duration::from_secs(60));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&addr) && stderr.contains("unreachable") && !stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `zerotrain serve` with `local_sgd.tls` (certificate and key) serves a group whose job
/// trusts its authority (`ca_file`; the name expected is the address's host, 127.0.0.1),
/// from one config file: the group trains every round through it. A server without `tls`
/// says at start that the token and the weights cross the network in the clear.
#[test]
fn zerotrain_serve_over_tls_trains_a_group_that_trusts_it_and_warns_without_tls() {
    let dir = temp_run("ps-tls");
    std::fs::create_dir_all(&dir).unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let authority = rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap().signed_by(&key, &authority).unwrap();
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let (cert, key, ca) =
        (write("server.pem", cert.pem()), write("server.key", key.serialize_pem()), write("ca.pem", authority.pem()));
    let section = format!(
        r#"{{"groups": 1, "sync_every": 2, "group_timeout_s": 20, "tls": {{"cert_file": "{cert}", "key_file": "{key}", "ca_file": "{ca}"}}}}"#
    );
    let (mut secure, addr) = server(&dir, &section, "127.0.0.1:0", None);
    let groups = config(&dir, "groups.json", &section);
    let out = finish(group(&dir, &groups, &addr, 0, 20), Duration::from_secs(120));
    secure.kill();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let last = metrics(&dir, 0).pop().unwrap();
    assert_eq!(
        (last["step"].as_u64(), last["rounds"].as_u64(), last["global_round"].as_u64()),
        (Some(20), Some(10), Some(10))
    );
    assert!(!server_log(&dir).contains("no TLS"), "{}", server_log(&dir));
    // The same groups without `tls`: the server warns.
    let plain = dir.join("plain");
    std::fs::create_dir_all(&plain).unwrap();
    let (mut open, _) = server(&plain, r#"{"groups": 1, "sync_every": 2}"#, "127.0.0.1:0", None);
    open.kill();
    let log = server_log(&plain);
    assert!(log.contains("no TLS (local_sgd.tls): the token and the weights cross the network in the clear"), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two servers, each holding half of every group's shard; the first is SIGKILLed mid-run
/// (the groups held still meanwhile) and restarted from its checkpoint, an older round than
/// the second server has reached. Each group's pushes to it are refused, and it joins it
/// again at the round after its push (`at_least`), which the restarted server skips to:
/// both groups finish every step, with every window counted as the same round at both
/// servers, so groups that end at one round hold one model bit for bit.
#[test]
fn one_of_two_servers_restarts_from_an_older_round_and_the_groups_go_on_in_step() {
    let dir = temp_run("ps-two");
    let (dir_a, dir_b) = (dir.join("a"), dir.join("b"));
    [&dir_a, &dir_b].iter().for_each(|d| std::fs::create_dir_all(d).unwrap());
    let section = r#"{"groups": 2, "sync_every": 2, "checkpoint_every": 5, "group_timeout_s": 20}"#;
    let saved = dir_a.join("ckpt");
    let (mut first, addr_a) = server(&dir_a, section, "127.0.0.1:0", Some(&saved));
    let (mut b, addr_b) = server(&dir_b, section, "127.0.0.1:0", None);
    let groups = config(&dir, "groups.json", section);
    let steps = 3000;
    let jobs: Vec<Job> = (0..2)
        .map(|g| {
            let out = dir.join(format!("run{g}"));
            Job::spawn(
                Command::new(env!("CARGO_BIN_EXE_zerotrain"))
                    .args(["train", "--config", groups.to_str().unwrap(), "--group", &g.to_string()])
                    .args(["--server", &addr_a, "--server", &addr_b, "--steps", &steps.to_string()])
                    .args(["--out", out.to_str().unwrap()])
                    .current_dir(env!("CARGO_MANIFEST_DIR"))
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped()),
            )
        })
        .collect();
    wait_until("twenty rounds and a checkpoint", Duration::from_secs(60), || {
        (0..2).all(|g| rounds(&dir, g) >= 20) && saved.join("latest").exists()
    });
    jobs.iter().for_each(|j| signal(j, "STOP"));
    assert!((0..2).all(|g| rounds(&dir, g) < steps / 2), "the groups finished before the server was killed");
    first.kill();
    jobs.iter().for_each(|j| signal(j, "CONT"));
    let (mut second, again) = server(&dir_a, section, &addr_a, Some(&saved));
    assert_eq!(again, addr_a);
    let outs: Vec<Output> = jobs.into_iter().map(|j| finish(j, Duration::from_secs(120))).collect();
    second.kill();
    b.kill();
    assert!(server_log(&dir_a).contains("resumed from the checkpoint of round"), "{}", server_log(&dir_a));
    finished_in_step(&dir, &outs, steps);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two groups that rejoined their servers after a server restart finished in step: each
/// succeeded, said it joined again, and ended every window in a round (a rejoin replaces a
/// round, it loses none); they ended at most one server round apart (a group whose last
/// pull before the kill had been answered is a window ahead after the rejoin, so it ends a
/// round earlier), and groups ending at one round hold one model, bit for bit.
fn finished_in_step(dir: &Path, outs: &[Output], steps: u64) {
    let mut finals = Vec::new();
    for (g, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "group {g}: {:?} {}", out.status, text(&out.stderr));
        assert!(text(&out.stderr).contains("joining again"), "group {g}: {}", text(&out.stderr));
        let last = metrics(dir, g).pop().unwrap();
        assert_eq!((last["step"].as_u64(), last["rounds"].as_u64()), (Some(steps), Some(steps / 2)), "{last}");
        let global = last["global_round"].as_u64().expect("a round count from the server");
        finals.push((global, last["val_loss"].as_f64().unwrap()));
    }
    eprintln!("(server round, final val_loss) of each group: {finals:?}");
    let ((a, loss_a), (b, loss_b)) = (finals[0], finals[1]);
    assert!(a.abs_diff(b) <= 1, "the groups ended {} rounds apart: {finals:?}", a.abs_diff(b));
    if a == b {
        assert_eq!(loss_a.to_bits(), loss_b.to_bits(), "the groups ended at round {a} with other weights: {finals:?}");
    }
}

/// Two replica groups through a server read their own parts of every global batch from a
/// Hugging Face token file: with lr 0 (the loss depends on the batch alone) the mean of the
/// groups' losses at each step is the loss of the synchronous 2-rank job reading the same
/// global batches, and the groups' losses differ. (They once strode by their own batch and
/// read each other's samples a step apart: group 1's step s was group 0's step s + 1.)
#[test]
fn groups_through_a_server_read_their_own_samples_of_a_token_file() {
    let dir = temp_run("ps-token-data");
    std::fs::create_dir_all(&dir).unwrap();
    let (_, tokens) = super::hf::fresh_llama(&dir, 1, "");
    let write = |name: &str, world: usize, batch: usize, section: &str| {
        let json = format!(
            r#"{{"train_batch_size": {batch}, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {{"stage": 2}},
                "optimizer": {{"type": "AdamW", "params": {{"lr": 0.0}}}}, {section}
                "zerotrain": {{"world_size": {world}, "eval_every": 100, "comm_timeout_s": 30}},
                "model": {{"hf_config": "model.json", "tokenizer": "tokenizer.json", "block_size": 8}}}}"#
        );
        let path = dir.join(name);
        std::fs::write(&path, json).unwrap();
        path
    };
    let section = r#"{"groups": 2, "sync_every": 2, "group_timeout_s": 30, "outer_optimizer": {"type": "sgd"}}"#;
    let sync = write("sync.json", 2, 8, "");
    let groups = write("groups.json", 1, 4, &format!(r#""local_sgd": {section},"#));
    let whole = dir.join("sync");
    super::hf::run_ok(&[
        "train",
        "--config",
        sync.to_str().unwrap(),
        "--data",
        tokens.to_str().unwrap(),
        "--steps",
        "5",
        "--out",
        whole.to_str().unwrap(),
    ]);
    let (mut server, addr) = server(&dir, section, "127.0.0.1:0", None);
    let jobs: Vec<Job> = (0..2)
        .map(|g| {
            let out = dir.join(format!("run{g}"));
            Job::spawn(
                Command::new(env!("CARGO_BIN_EXE_zerotrain"))
                    .args(["train", "--config", groups.to_str().unwrap(), "--server", &addr, "--group", &g.to_string()])
                    .args(["--data", tokens.to_str().unwrap(), "--steps", "5", "--out", out.to_str().unwrap()])
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped()),
            )
        })
        .collect();
    let outs: Vec<Output> = jobs.into_iter().map(|j| finish(j, Duration::from_secs(120))).collect();
    server.kill();
    for (g, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "group {g}: {}", text(&out.stderr));
    }
    let expected = super::hf::losses(&whole);
    let (a, b) = (super::hf::losses(&dir.join("run0")), super::hf::losses(&dir.join("run1")));
    assert_eq!((expected.len(), a.len(), b.len()), (5, 5, 5));
    for ((&(step, whole), &(_, x)), &(_, y)) in expected.iter().zip(&a).zip(&b) {
        let mean = (x + y) / 2.0;
        assert!(
            (mean - whole).abs() <= 1e-5 * whole,
            "step {step}: groups {x} and {y} (mean {mean}), synchronous {whole}"
        );
        assert!(x != y, "step {step}: both groups scored {x}: the same samples");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
