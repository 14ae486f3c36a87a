//! Replica groups (`local_sgd`): groups of thread ranks training apart and meeting every
//! `sync_every` steps, checked against synchronous data parallelism and against the
//! traffic the HSDP shape allows.

use zerotrain::replicas::{LocalSgd, split};
use zerotrain::{Engine, Error, Plan, launch};

use crate::common::*;
use crate::units::{Tokens, Workload, padded, tiny_gpt, unit_sizes};

const STEPS: u64 = 4;

/// The common recipe with plain SGD inside (lr 0.05, no momentum, no weight decay) and
/// `local_sgd` set to `section` (none if empty).
fn sgd_recipe(stage: u8, section: &str) -> String {
    let json = recipe(stage, 1, 1, 0.0).replace(
        r#"{"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.1}}"#,
        r#"{"type": "SGD", "params": {"lr": 0.05}}"#,
    );
    if section.is_empty() { json } else { json.replacen('{', &format!(r#"{{ "local_sgd": {section},"#), 1) }
}

/// Trains the tiny GPT `STEPS` steps under `plan` (groups or not, through `trainer`, as the
/// command does), each world rank reading its part of every global batch; returns every
/// rank's view of its group's fp32 master weights (the parameters, in fp32 training).
fn run(plan: &Plan) -> Vec<Vec<f32>> {
    run_steps(plan, STEPS)
}

/// [`run`] for `steps` steps.
fn run_steps(plan: &Plan, steps: u64) -> Vec<Vec<f32>> {
    run_reading(plan, plan, steps)
}

/// [`run_steps`], the batches split as `data`'s world splits them (a job that is one group
/// of several reads its group's part of the whole world's batches).
fn run_reading(plan: &Plan, data: &Plan, steps: u64) -> Vec<Vec<f32>> {
    try_run_reading(plan, data, steps).unwrap()
}

/// [`run_reading`], its error returned.
fn try_run_reading(plan: &Plan, data: &Plan, steps: u64) -> Result<Vec<Vec<f32>>, Error> {
    let init = tiny_gpt(true, 11);
    let w = Tokens { vocab: 11, len: 9 };
    launch(plan, |ctx| {
        let mut trainer = zerotrain::trainer(init.clone(), plan, &ctx)?;
        for step in 0..steps {
            let rank = trainer.data_parallel_rank();
            trainer.train_batch(&mut |micro| w.batch(data, step, micro as u64, rank, ctx.device()))?;
        }
        trainer.master_params()
    })
}

/// An engine given the whole world's plan of a job with groups refuses it, naming the way
/// (it would otherwise train one synchronous job and silently ignore the groups).
#[test]
fn an_engine_refuses_a_plan_with_groups_that_was_not_split() {
    let plan = plan(&sgd_recipe(1, r#"{"groups": 2}"#), 2);
    let err = launch(&plan, |ctx| Engine::with_units(tiny_gpt(true, 11), &plan, &ctx).map(drop)).unwrap_err();
    assert!(err.to_string().contains("replicas::split"), "{err}");
}

/// `groups: 1` is no groups: the same bits as the config without the section.
#[test]
fn one_group_trains_bit_for_bit_as_without_the_section() {
    let plain = run(&plan(&sgd_recipe(2, ""), 2));
    let one = run(&plan(&sgd_recipe(2, r#"{"groups": 1, "sync_every": 1}"#), 2));
    assert_eq!(plain, one);
}

/// Averaging after every step of plain SGD is synchronous data parallelism over the same
/// samples: each group steps with the mean gradient of its ranks, and the mean of the
/// groups' steps is the step with the mean gradient of all ranks. Within fp32 rounding, at
/// every stage, with groups of one and of two ranks.
#[test]
fn averaging_every_sgd_step_is_synchronous_data_parallelism() {
    let averaging = r#"{"groups": GROUPS, "sync_every": 1, "outer_optimizer": {"type": "sgd", "lr": 1.0}}"#;
    let mut worst = 0.0f32;
    for stage in [0u8, 1, 2, 3] {
        let dp = run(&plan(&sgd_recipe(stage, ""), 4));
        let start = run_steps(&plan(&sgd_recipe(stage, ""), 4), 0);
        let moved = dp[0].iter().zip(&start[0]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(dp[0].len() > 1000 && moved > 1e-3, "stage {stage}: training moved the weights by {moved}");
        for groups in [2, 4] {
            let section = averaging.replace("GROUPS", &groups.to_string());
            let local = run(&plan(&sgd_recipe(stage, &section), 4));
            for (rank, masters) in local.iter().enumerate() {
                let diff = masters.iter().zip(&dp[0]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(diff <= 2e-6, "stage {stage}, {groups} groups, rank {rank}: parameters differ by {diff}");
                worst = worst.max(diff);
            }
        }
    }
    eprintln!("averaging every SGD step vs synchronous data parallelism: worst |difference| {worst:e}");
}

/// Between rounds the groups train apart; a round leaves every group with the same
/// weights; and a round moves only each rank's shard among its peers: an all-reduce of the
/// padded shard (2 groups: the whole shard's bytes, in fp32 or in bf16), nothing in the
/// steps without a round beyond the group's own collectives.
#[test]
fn groups_train_apart_and_a_round_moves_only_each_ranks_shard() {
    let init = tiny_gpt(true, 11);
    let (sizes, root) = unit_sizes(&init);
    let group_size = 2;
    let shard: u64 = sizes.iter().chain([&root]).map(|&u| (padded(u, group_size) / group_size) as u64).sum();
    for (dtype, bytes) in [("fp32", 4), ("bf16", 2)] {
        let section = format!(r#"{{"groups": 2, "sync_every": 3, "communication_data_type": "{dtype}"}}"#);
        let plan = plan(&sgd_recipe(2, &section), 4);
        let w = Tokens { vocab: 11, len: 9 };
        let out = launch(&plan, |ctx| {
            let (group_ctx, group_plan, replicas) = split(&ctx, &plan)?;
            let engine = Engine::with_units(init.clone(), &group_plan, &group_ctx)?;
            let mut local = LocalSgd::new(engine, replicas)?;
            let mut seen = Vec::new();
            for step in 0..3 {
                let peers_before = local.peer_stats();
                local.engine_mut().forward_backward(&w.batch(&plan, step, 0, ctx.rank(), ctx.device()))?;
                let done = local.step()?.expect("accumulation 1");
                let peer_bytes = local.peer_stats().since(&peers_before).total_bytes();
                let masters = local.engine().master_params()?;
                seen.push((done.round, peer_bytes, masters));
            }
            Ok::<_, Error>(seen)
        })
        .unwrap();
        // Ranks 0-1 are group 0, ranks 2-3 group 1.
        for (group0, group1) in out[0][..2].iter().zip(&out[2][..2]) {
            assert_eq!(group0.0, None);
            assert_eq!(group0.1, 0, "{dtype}: no traffic among peers before the round");
            assert_ne!(group0.2, group1.2, "{dtype}: the groups trained apart before the round");
        }
        for rank in 0..4 {
            let (round, peer_bytes, masters) = &out[rank][2];
            let want = zerotrain::replicas::Round {
                round: 1,
                bytes: shard * bytes,
                live_groups: 2,
                staleness: 0,
                rejoined: false,
                global_round: None,
            };
            assert_eq!(*round, Some(want), "rank {rank}");
            assert_eq!(*peer_bytes, shard * bytes, "{dtype} rank {rank}");
            assert_eq!(masters, &out[0][2].2, "{dtype}: rank {rank} left the round with other weights");
        }
    }
}

/// A save in the middle of a window runs the round first, then group 0 writes one normal
/// checkpoint (at the group's world size) while group 1 waits; loaded into fresh groups,
/// every rank starts from those weights, and one without groups loads it too.
#[test]
fn a_checkpoint_of_groups_is_the_global_weights_written_once() {
    let dir = std::env::temp_dir().join(format!("zt-world-replicas-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let init = tiny_gpt(true, 11);
    let w = Tokens { vocab: 11, len: 9 };
    let grouped = plan(&sgd_recipe(2, r#"{"groups": 2, "sync_every": 2}"#), 4);
    let saved = launch(&grouped, |ctx| {
        let mut trainer = zerotrain::trainer(init.clone(), &grouped, &ctx)?;
        for step in 0..3 {
            let rank = trainer.data_parallel_rank();
            trainer.train_batch(&mut |micro| w.batch(&grouped, step, micro as u64, rank, ctx.device()))?;
        }
        trainer.save_checkpoint(&dir, None, zerotrain::serde_json::Value::Null)?;
        trainer.master_params()
    })
    .unwrap();
    assert!(saved.iter().all(|m| *m == saved[0]), "after the save's round every group holds the same weights");
    let tags: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(tags.len(), 2, "one tag and `latest`: {tags:?}");
    let manifest = std::fs::read_to_string(dir.join("global_step3").join("manifest.json")).unwrap();
    assert!(manifest.contains(r#""world_size": 2"#) || manifest.contains(r#""world_size":2"#), "{manifest}");
    for plan in [grouped.clone(), plan(&sgd_recipe(1, ""), 2)] {
        let loaded = launch(&plan, |ctx| {
            let mut trainer = zerotrain::trainer(init.clone(), &plan, &ctx)?;
            trainer.load_checkpoint(&dir, None, zerotrain::LoadOptions::default())?;
            trainer.master_params()
        })
        .unwrap();
        assert!(loaded.iter().all(|m| *m == saved[0]), "{} ranks loaded other weights", plan.world_size());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The same groups as separate jobs meeting at a parameter server (each job one group of
/// two thread ranks) train bit for bit as the groups inside one job: the server sums the
/// pushes in group order, as the in-job all-reduce does, and steps the same outer optimizer;
/// so do they through two servers, each holding half of every rank's shard. With bf16 on
/// the wire too: both sum the bf16 pushes in f32 and round the sum once to bf16.
#[test]
fn groups_as_jobs_through_a_parameter_server_train_as_groups_in_one_job() {
    for wire in ["fp32", "bf16"] {
        let section =
            |extra: &str| format!(r#"{{"groups": 2, "sync_every": 2, "communication_data_type": "{wire}"{extra}}}"#);
        let world = plan(&sgd_recipe(2, &section("")), 4);
        let in_job = run(&world);
        for servers in [1, 2] {
            let jobs = through_server(&world, &section, "", servers);
            for (group, job) in jobs.iter().enumerate() {
                for (rank, masters) in job.iter().enumerate() {
                    assert!(
                        masters == &in_job[0],
                        "{wire}, {servers} server(s): group {group} rank {rank} ended with other weights than the \
                         in-job groups"
                    );
                }
            }
        }
    }
}

/// Async servers with `max_staleness` 0 make every group wait for the others' push of its
/// round before it goes on, so each round's pushes all start from the same global weights:
/// Delayed Nesterov then applies them (in arrival order, each its share, the momentum
/// part with the round's last) as the synchronous step on their mean, so the jobs end
/// where the in-job groups do, within f32 rounding (the order of the sums differs).
#[test]
fn async_groups_without_staleness_train_as_synchronous_groups() {
    let section = |extra: &str| format!(r#"{{"groups": 2, "sync_every": 2{extra}}}"#);
    let world = plan(&sgd_recipe(2, &section("")), 4);
    let in_job = run(&world);
    let jobs = through_server(&world, &section, r#", "mode": "async", "max_staleness": 0"#, 1);
    let scale = in_job[0].iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (group, job) in jobs.iter().enumerate() {
        for (rank, masters) in job.iter().enumerate() {
            let worst = masters.iter().zip(&in_job[0]).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= 1e-5 * scale.max(1.0), "group {group} rank {rank}: {worst} apart");
        }
    }
}

/// Group 0 writes the groups' checkpoint in one job; when its save fails (a file where the
/// folder should be), every group's save fails too, the others naming group 0's rank at
/// their place, instead of reporting a checkpoint that is not there.
#[test]
fn a_save_that_fails_in_group_0_fails_in_every_group() {
    let blocked = crate::tiers::scratch("groups-save");
    std::fs::write(&blocked, b"not a folder").unwrap();
    let world = plan(&sgd_recipe(2, r#"{"groups": 2, "sync_every": 2}"#), 4);
    let init = tiny_gpt(true, 11);
    let w = Tokens { vocab: 11, len: 9 };
    let outcomes = launch(&world, |ctx| {
        let mut trainer = zerotrain::trainer(init.clone(), &world, &ctx)?;
        let rank = trainer.data_parallel_rank();
        trainer.train_batch(&mut |micro| w.batch(&world, 0, micro as u64, rank, ctx.device()))?;
        let saved = trainer.save_checkpoint(&blocked, None, serde_json::Value::Null);
        Ok::<_, Error>(saved.map_err(|e| e.to_string()))
    })
    .unwrap();
    for (rank, outcome) in outcomes.iter().enumerate() {
        let e = outcome.as_ref().expect_err(&format!("rank {rank} reported a checkpoint group 0 did not write"));
        if rank >= 2 {
            let want = format!("rank(s) [{}] failed while saving the replica groups' checkpoint", rank % 2);
            assert!(e.contains(&want), "rank {rank}: {e}");
        } else if rank == 1 {
            assert!(e.contains("rank(s) [0] failed while preparing the checkpoint"), "rank {rank}: {e}");
        } else {
            assert!(e.contains(&*blocked.to_string_lossy()), "rank {rank}: {e}");
        }
    }
    std::fs::remove_file(&blocked).unwrap();
}

/// Replica groups with both NVMe tiers train bit for bit as the same groups in memory, in
/// one job and as jobs through a server, all of them swapping under one `nvme_path`: each
/// group's ranks have folders of their own (the groups' ranks all count from 0).
#[test]
fn groups_with_nvme_tiers_train_as_groups_in_memory() {
    let section = |extra: &str| format!(r#"{{"groups": 2, "sync_every": 2{extra}}}"#);
    let root = crate::tiers::scratch("groups");
    let keys = crate::tiers::tier_keys(&root, "nvme", "nvme");
    let with_nvme = |section: &str| {
        let json = sgd_recipe(3, section);
        json.replacen(
            r#""stage3_param_persistence_threshold": 0"#,
            &format!(r#""stage3_param_persistence_threshold": 0{keys}"#),
            1,
        )
    };
    let in_memory = run(&plan(&sgd_recipe(3, &section("")), 4));
    let nvme = plan(&with_nvme(&section("")), 4);
    assert!(nvme.zero.offload.uses_host_or_nvme());
    assert!(run(&nvme) == in_memory, "groups in one job with NVMe tiers ended with other weights");
    for (group, job) in through_server_with(&nvme, &with_nvme, &section, "", 1).iter().enumerate() {
        for (rank, masters) in job.iter().enumerate() {
            assert!(masters == &in_memory[0], "through a server, group {group} rank {rank} ended elsewhere");
        }
    }
    for owner in ["group0.rank0", "group0.rank1", "group1.rank0", "group1.rank1"] {
        assert!(root.join("opt").join(format!("zerotrain-optimizer.{owner}")).is_dir(), "{owner}");
        assert!(root.join("param").join(format!("zerotrain-param.{owner}")).is_dir(), "{owner}");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

/// A server holds one part of every rank's shard, and says which: a group listing the
/// servers in another order than the first group (it would average other parameters into
/// each part), or naming one server twice (its two parts would overwrite each other), is
/// refused by name when it joins, and nothing of it is averaged.
#[test]
fn a_server_refuses_a_join_for_another_part_of_the_shards() {
    use zerotrain::replicas::server::{Part, PlaceClient, ServerConfig, serve};
    let section = |extra: &str| format!(r#"{{"groups": 2, "sync_every": 2{extra}}}"#);
    let server_json = r#", "servers": ["127.0.0.1:1"], "group": 0, "group_timeout_s": 1"#;
    let server_plan = plan(&sgd_recipe(2, &section(server_json)), 2);
    let replicas = server_plan.replicas.as_ref().unwrap();
    let server = serve("127.0.0.1:0".parse().unwrap(), ServerConfig::new(replicas, None)).unwrap();
    let addr = server.addr().to_string();
    let timeout = std::time::Duration::from_secs(20);
    let first = Part { index: 0, count: 2, offset: 0, shard_len: 8, layout: 7 };
    let held = PlaceClient::start(&addr, 0, first, replicas, vec![1.0; 4], timeout).unwrap();
    let refused = [
        Part { index: 1, offset: 4, ..first },
        Part { layout: 8, ..first },
        Part { count: 3, ..first },
        Part { shard_len: 9, ..first },
    ];
    for part in refused {
        let Err(e) = PlaceClient::start(&addr, 0, part, replicas, vec![2.0; 4], timeout) else {
            panic!("a join with {part:?} at a place holding {first:?} was taken");
        };
        let e = e.to_string();
        assert!(e.contains("place 0 holds part 0 of 2 (values 0..4 of a shard of 8"), "{e}");
        assert!(e.contains("local_sgd.servers in one order, each server once"), "{e}");
    }
    // The same part at another place is another place; at this place it is welcome.
    let other = PlaceClient::start(&addr, 1, refused[0], replicas, vec![3.0; 4], timeout).unwrap();
    let again = PlaceClient::start(&addr, 0, first, replicas, vec![4.0; 4], timeout).unwrap();
    assert_eq!((held.global(), other.global(), again.global()), (&[1.0; 4][..], &[3.0; 4][..], &[1.0; 4][..]));

    // A worker whose local_sgd keys differ from the server's is told which.
    let other = plan(&sgd_recipe(2, &section(r#", "servers": ["127.0.0.1:1"], "group": 1, "mode": "async""#)), 2);
    let e = PlaceClient::start(&addr, 2, first, other.replicas.as_ref().unwrap(), vec![0.0; 4], timeout).err();
    let e = e.expect("a join under other settings was taken").to_string();
    assert!(e.contains("local_sgd.mode is async in this job's config, sync in the server's"), "{e}");
    assert!(e.contains("local_sgd.group_timeout_s is 60 in this job's config, 1 in the server's"), "{e}");
    assert!(!e.contains("local_sgd.groups"), "{e}");

    // Through jobs: group 1 lists the two servers in the other order; whichever group
    // joins a server second is refused there, naming the part.
    let servers: Vec<_> =
        (0..2).map(|_| serve("127.0.0.1:0".parse().unwrap(), ServerConfig::new(replicas, None)).unwrap()).collect();
    let (a, b) = (servers[0].addr(), servers[1].addr());
    let world = plan(&sgd_recipe(2, &section("")), 4);
    let results: Vec<Result<_, Error>> = std::thread::scope(|s| {
        let jobs: Vec<_> = [format!(r#""{a}", "{b}""#), format!(r#""{b}", "{a}""#)]
            .into_iter()
            .enumerate()
            .map(|(group, list)| {
                let extra = format!(r#", "servers": [{list}], "group": {group}, "group_timeout_s": 1"#);
                let json = sgd_recipe(2, &section(&extra));
                let world = &world;
                s.spawn(move || try_run_reading(&plan(&json, 2), world, STEPS))
            })
            .collect();
        jobs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let refusals: Vec<String> = results.iter().filter_map(|r| r.as_ref().err()).map(ToString::to_string).collect();
    assert!(!refusals.is_empty(), "two groups listing the servers in two orders both trained");
    for e in &refusals {
        assert!(e.contains("of a shard of") && e.contains("local_sgd.servers in one order"), "{e}");
    }

    // One server under two names.
    let port = a.port();
    let json =
        sgd_recipe(2, &section(&format!(r#", "servers": ["localhost:{port}", "127.0.0.1:{port}"], "group": 0"#)));
    let e = try_run_reading(&plan(&json, 2), &world, STEPS).unwrap_err().to_string();
    assert!(e.contains(&format!("`localhost:{port}` and `127.0.0.1:{port}` are one server")), "{e}");
}

/// Runs `world`'s groups as two jobs of two thread ranks each through `servers` parameter
/// servers whose `local_sgd` section is `section(extra)`; every job's ranks' final masters.
fn through_server(world: &Plan, section: &dyn Fn(&str) -> String, extra: &str, servers: usize) -> Vec<Vec<Vec<f32>>> {
    through_server_with(world, &|section| sgd_recipe(2, section), section, extra, servers)
}

/// [`through_server`], each job's config `recipe(local_sgd section)`.
fn through_server_with(
    world: &Plan,
    recipe: &(dyn Fn(&str) -> String + Sync),
    section: &dyn Fn(&str) -> String,
    extra: &str,
    servers: usize,
) -> Vec<Vec<Vec<f32>>> {
    let server_plan = plan(&recipe(&section(&format!(r#", "servers": ["127.0.0.1:1"], "group": 0{extra}"#))), 2);
    let config = zerotrain::replicas::server::ServerConfig::new(server_plan.replicas.as_ref().unwrap(), None);
    let handles: Vec<_> = (0..servers)
        .map(|_| zerotrain::replicas::server::serve("127.0.0.1:0".parse().unwrap(), config.clone()).unwrap())
        .collect();
    let addrs: Vec<String> = handles.iter().map(|h| format!(r#""{}""#, h.addr())).collect();
    let addrs = addrs.join(", ");
    let jobs = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..2)
            .map(|group| {
                let json = recipe(&section(&format!(r#", "servers": [{addrs}], "group": {group}{extra}"#)));
                s.spawn(move || run_reading(&plan(&json, 2), world, STEPS))
            })
            .collect();
        jobs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    handles.into_iter().for_each(|h| h.stop().unwrap());
    jobs
}

/// A server with a token refuses a call without it, or with another, by name and before
/// it allocates anything, and the group that has it trains on undisturbed; with a token, a
/// place of another length than the server's places is refused too (nothing but the first
/// join fixes what a call may allocate).
#[test]
fn a_server_with_a_token_refuses_calls_without_it_and_bounds_what_a_join_allocates() {
    use zerotrain::replicas::server::auth::Token;
    use zerotrain::replicas::server::{Part, PlaceClient, ServerConfig, serve};
    let dir = crate::tiers::scratch("token");
    std::fs::create_dir_all(&dir).unwrap();
    let (right, wrong) = (dir.join("token"), dir.join("other"));
    std::fs::write(&right, "0123456789abcdef0123456789abcdef\n").unwrap();
    std::fs::write(&wrong, "fedcba9876543210fedcba9876543210\n").unwrap();
    let section = |file: Option<&std::path::Path>| {
        let token = file.map_or(String::new(), |f| format!(r#", "auth_token_file": "{}""#, f.display()));
        let json = format!(
            r#"{{"groups": 1, "sync_every": 1, "outer_optimizer": {{"type": "sgd"}}, "servers": ["127.0.0.1:1"], "group": 0{token}}}"#
        );
        plan(&sgd_recipe(2, &json), 1).replicas.unwrap()
    };
    let mut config = ServerConfig::new(&section(Some(&right)), None);
    config.token = Token::load(Some(&right)).unwrap();
    let server = serve("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let addr = server.addr().to_string();
    let timeout = std::time::Duration::from_secs(20);
    let part = |len: u64| Part { index: 0, count: 1, offset: 0, shard_len: len, layout: 5 };
    let start = |plan: &zerotrain::config::ReplicaPlan, place: usize, len: usize| {
        PlaceClient::start(&addr, place, part(len as u64), plan, vec![1.0; len], timeout)
    };
    for (file, why) in [(None, "no token: this server needs one"), (Some(wrong.as_path()), "a wrong token")] {
        let e = start(&section(file), 0, 1 << 20).err().expect("a call without the token was taken").to_string();
        assert!(e.contains(why), "{e}");
    }
    // Nothing of the refused joins was kept: the first join with the token fixes the place.
    let ok = section(Some(&right));
    let mut group = start(&ok, 0, 8).unwrap();
    let e = start(&ok, 1, 1 << 20).err().expect("a place of another length was made").to_string();
    assert!(e.contains("with 1048576 values; this server's places hold 8"), "{e}");
    let (global, round) = group.run(&[0.5; 8]).unwrap();
    assert_eq!((global, round.live_groups), (&[0.5; 8][..], 1));
    drop(group);
    server.stop().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A server with TLS (`local_sgd.tls`) serves a worker that trusts its certificate
/// authority, over TLS, with the token; a worker without TLS, and one trusting another
/// authority, are refused by name; a side missing its own file is an error naming the key.
#[test]
fn a_server_with_tls_serves_workers_that_trust_its_authority_and_no_others() {
    use zerotrain::replicas::server::auth::Token;
    use zerotrain::replicas::server::{Part, PlaceClient, ServerConfig, serve, tls};
    let dir = crate::tiers::scratch("tls");
    std::fs::create_dir_all(&dir).unwrap();
    // Two authorities; the server's certificate, for `localhost`, signed by the first.
    let authority = |name: &str| {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap()
    };
    let (ours, theirs) = (authority("ours"), authority("theirs"));
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap().signed_by(&key, &ours).unwrap();
    let file = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let (cert, key) = (file("server.pem", cert.pem()), file("server.key", key.serialize_pem()));
    let (ours, theirs) = (file("ours.pem", ours.pem()), file("theirs.pem", theirs.pem()));
    let token = file("token", "0123456789abcdef0123456789abcdef".into());
    let section = |tls: &str| {
        let json = format!(
            r#"{{"groups": 1, "sync_every": 1, "outer_optimizer": {{"type": "sgd"}}, "servers": ["127.0.0.1:1"], "group": 0, "auth_token_file": "{token}"{tls}}}"#
        );
        plan(&sgd_recipe(2, &json), 1).replicas.unwrap()
    };
    let server_side = section(&format!(r#", "tls": {{"cert_file": "{cert}", "key_file": "{key}"}}"#));
    let mut config = ServerConfig::new(&server_side, None);
    config.token = Token::load(Some(std::path::Path::new(&token))).unwrap();
    config.tls = tls::identity(&server_side).unwrap();
    assert!(config.tls.is_some());
    let server = serve("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let addr = server.addr().to_string();
    let part = Part { index: 0, count: 1, offset: 0, shard_len: 8, layout: 5 };
    let start = |plan: &zerotrain::config::ReplicaPlan, secs: u64| {
        PlaceClient::start(&addr, 0, part, plan, vec![1.0; 8], std::time::Duration::from_secs(secs))
    };
    let trusting = |ca: &str| section(&format!(r#", "tls": {{"ca_file": "{ca}", "domain": "localhost"}}"#));
    // Refused: plain TCP to a TLS server, and a worker that trusts another authority (at
    // once: waiting cannot make a certificate trusted).
    let e = start(&section(""), 2).err().expect("a plain worker joined a TLS server").to_string();
    assert!(e.contains("a server with TLS needs local_sgd.tls.ca_file"), "{e}");
    let e = start(&trusting(&theirs), 20).err().expect("a worker trusting another authority joined").to_string();
    assert!(e.contains("invalid peer certificate") && e.contains("local_sgd.tls.ca_file"), "{e}");
    assert!(e.contains("after 1 try in"), "an untrusted certificate was retried: {e}");
    // A worker of the wrong name for the certificate is refused the same way.
    let misnamed = section(&format!(r#", "tls": {{"ca_file": "{ours}", "domain": "elsewhere"}}"#));
    let e = start(&misnamed, 20).err().expect("a worker expecting another name joined").to_string();
    assert!(e.contains("invalid peer certificate"), "{e}");
    // The worker that trusts the server's authority trains a round through it.
    let mut group = start(&trusting(&ours), 20).unwrap();
    let (global, round) = group.run(&[0.5; 8]).unwrap();
    assert_eq!((global, round.live_groups), (&[0.5; 8][..], 1));
    drop(group);
    server.stop().unwrap();
    // Each side names the file it lacks, or the one it cannot use.
    let e = tls::identity(&trusting(&ours)).unwrap_err().to_string();
    assert!(e.contains("local_sgd.tls.cert_file is needed here"), "{e}");
    let e = start(&server_side, 2).err().expect("a worker without a ca_file started").to_string();
    assert!(e.contains("local_sgd.tls.ca_file is needed here"), "{e}");
    let swapped = section(&format!(r#", "tls": {{"cert_file": "{key}", "key_file": "{key}"}}"#));
    let e = tls::identity(&swapped).unwrap_err().to_string();
    assert!(e.contains("server.key holds no PEM `CERTIFICATE` block"), "{e}");
    // A key that is no key fails the server's start by name (not its thread, silently).
    let garbage = file("garbage.key", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".into());
    let broken = section(&format!(r#", "tls": {{"cert_file": "{cert}", "key_file": "{garbage}"}}"#));
    let mut config = ServerConfig::new(&broken, None);
    config.tls = tls::identity(&broken).unwrap();
    let e = serve("127.0.0.1:0".parse().unwrap(), config).err().expect("a server started with no key").to_string();
    assert!(e.contains("local_sgd.tls"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Replica groups of tensor-parallel meshes through a parameter server: two jobs of the
/// built-in GPT at tp 2 (two thread ranks each), meeting at a server every 2 steps, end
/// with the masters the same two groups reach inside one job of four ranks, rank for rank
/// and bit for bit (a round sums two pushes of each tensor part's shard, exact in either
/// order; each job's rank at place p pushes as the in-job group's rank p does).
#[test]
fn groups_of_meshes_through_a_server_train_as_in_one_job() {
    use zerotrain_models::{Gpt, GptConfig};
    let recipe = |extra: &str| {
        plan_of(&format!(
            r#"{{"train_micro_batch_size_per_gpu": 2, "optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}},
                "zero_optimization": {{"stage": 1}}, "tensor_parallel": {{"autotp_size": 2}},
                "local_sgd": {{"groups": 2, "sync_every": 2{extra}}},
                "zerotrain": {{"backend": "threads", "comm_timeout_s": 30}}}}"#
        ))
    };
    let shape = GptConfig { n_layer: 1, n_head: 2, n_embd: 8, block_size: 4, vocab_size: 7, tied_head: true };
    let train = |plan: &Plan| -> Vec<Vec<f32>> {
        launch(plan, |ctx| {
            let mesh = zerotrain::mesh::split(&ctx, plan)?;
            let device = mesh.ctx.device().clone();
            let model = Gpt::new_split(&shape, &device, &mesh.groups(), plan.runtime.seed).map_err(Error::Model)?;
            let mut trainer = mesh.trainer(model)?;
            let place = trainer.data_parallel_rank() as i64;
            for step in 0..STEPS as i64 {
                let ids: Vec<i64> = (0..10).map(|i| (i * 3 + step * 5 + place * 11) % 7).collect();
                let batch: zerotrain_models::LmBatch = burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
                    burn::tensor::TensorData::new(ids, [2, 5]),
                    &device,
                )
                .into();
                trainer.train_batch(&mut |_| batch.clone())?;
            }
            trainer.master_params()
        })
        .unwrap()
    };
    let in_job = train(&with_world(recipe(""), 4));
    let server_plan = with_world(recipe(r#", "servers": ["127.0.0.1:1"], "group": 0"#), 2);
    let config = zerotrain::replicas::server::ServerConfig::new(server_plan.replicas.as_ref().unwrap(), None);
    let server = zerotrain::replicas::server::serve("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let addr = server.addr();
    let jobs: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..2)
            .map(|group| {
                let plan = with_world(recipe(&format!(r#", "servers": ["{addr}"], "group": {group}"#)), 2);
                s.spawn(move || train(&plan))
            })
            .collect();
        jobs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    server.stop().unwrap();
    assert_ne!(in_job[0], in_job[1], "the two tensor ranks hold different parts");
    for (group, job) in jobs.iter().enumerate() {
        for (rank, masters) in job.iter().enumerate() {
            assert!(masters == &in_job[2 * group + rank], "group {group} rank {rank}: other weights than in one job");
        }
    }
}

/// `json` as a config, unresolved.
fn plan_of(json: &str) -> zerotrain::Config {
    zerotrain::Config::parse(json, "test").unwrap()
}

/// `config` resolved at `world_size`.
fn with_world(config: zerotrain::Config, world_size: usize) -> Plan {
    config.resolve(zerotrain::Overrides { world_size: Some(world_size), ..Default::default() }).unwrap()
}
