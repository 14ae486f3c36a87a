//! `mpirun` across two hosts (network namespaces: `tests/common/hosts.rs`): OpenMPI starts
//! the second host's rank through a remote shell that enters that host (its
//! `plm_rsh_agent`), and its TCP transport carries the traffic between them (`--mca btl
//! tcp,self` on the link's subnet). The main job trains there as two thread ranks do.
//! Needs root and iproute2: ignored here, run by `.ci/run`.

use std::process::Command;

#[path = "../common/metrics.rs"]
mod metrics;
#[path = "../common/hosts.rs"]
mod netns;

use metrics::losses;
use netns::Hosts;

#[test]
#[ignore = "needs root and iproute2 (two network-namespace hosts); .ci/run runs it"]
fn the_main_job_over_mpi_across_two_hosts_trains_as_thread_ranks_do() {
    let hosts = Hosts::new("mpi");
    let dir = std::env::temp_dir().join(format!("zerotrain-mpi-hosts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // The remote shell: `agent HOST COMMAND...` runs COMMAND as a process of HOST.
    let agent = dir.join("enter-host");
    let cases: String = (0..2).map(|h| format!("{}) ns={};; ", Hosts::NAMES[h], hosts.namespace(h))).collect();
    let script = format!(
        "#!/bin/sh\nhost=$1; shift\ncase $host in {cases}*) echo \"no host $host\" >&2; exit 1;; esac\nexec ip netns \
         exec $ns unshare --uts sh -c \"hostname $host && exec sh -c \\\"\\$0\\\"\" \"$*\"\n"
    );
    std::fs::write(&agent, script).unwrap();
    Command::new("chmod").arg("+x").arg(&agent).status().unwrap();
    let (across, threads) = (dir.join("across"), dir.join("threads"));
    let train = ["train", "--config", "configs/tiny.json", "--steps", "4", "--out"];
    let subnet = "10.77.0.0/24";
    let hosts_flag = format!("{},{}", Hosts::NAMES[0], Hosts::NAMES[1]);
    let mpirun = [
        "--allow-run-as-root",
        "--host",
        &hosts_flag,
        "-np",
        "2",
        "--mca",
        "plm_rsh_agent",
        agent.to_str().unwrap(),
        "--mca",
        "btl",
        "tcp,self",
        "--mca",
        "btl_tcp_if_include",
        subnet,
        "--mca",
        "oob_tcp_if_include",
        subnet,
        env!("CARGO_BIN_EXE_zerotrain"),
    ];
    let args: Vec<&str> = mpirun.iter().chain(&train).copied().chain([across.to_str().unwrap()]).collect();
    let out = hosts.command(0, "mpirun", &args).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "mpirun across two hosts: {said}");
    let out = Command::new(env!("CARGO_BIN_EXE_zerotrain"))
        .args(train)
        .arg(&threads)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (got, want) = (losses(&across), losses(&threads));
    assert_eq!(got.len(), 4, "{got:?}: {said}");
    assert_eq!(got, want, "MPI across two hosts, against two thread ranks");
    std::fs::remove_dir_all(&dir).unwrap();
}
