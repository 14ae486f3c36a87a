//! Which backend runs the ranks when the processes were started by `mpirun` or a launcher,
//! and how many there are: read from the overrides (the command reads the environment).

use super::*;
use crate::config::runtime::{backend, world_size};

#[test]
fn resolution_reads_mpirun_from_the_overrides_not_the_environment() {
    let config = parse(r#"{"train_micro_batch_size_per_gpu": 2, "zerotrain": {"world_size": 2}}"#).unwrap();
    let plain = config.resolve(Overrides::default()).unwrap();
    assert_eq!((plain.runtime.backend, plain.world_size(), plain.batch.train_batch_size), (Backend::Auto, 2, 4));
    let mpirun = Some(MpirunEnvironment { rank: 1, world_size: 3 });
    let under = config.resolve(Overrides { mpirun, ..Overrides::default() }).unwrap();
    assert_eq!((under.runtime.backend, under.world_size(), under.batch.train_batch_size), (Backend::Mpi, 3, 6));
    let err = config.resolve(Overrides { mpirun, world_size: Some(4), ..Overrides::default() }).unwrap_err();
    assert!(err.to_string().contains("is 4 but mpirun started 3 processes"), "{err}");
}

/// Regression: `mpirun -np 2 zerotrain train` over a recipe with `"backend": "threads"`
/// trained two independent jobs into one run folder.
#[test]
fn an_explicit_threads_backend_inside_a_multi_process_mpirun_is_refused() {
    let threads = parse(r#"{"train_batch_size": 2, "zerotrain": {"backend": "threads"}}"#).unwrap();
    let under = |processes| {
        let mpirun = Some(MpirunEnvironment { rank: 0, world_size: processes });
        threads.resolve(Overrides { mpirun, ..Overrides::default() })
    };
    let err = under(3).unwrap_err();
    assert!(
        matches!(&err, ConfigError::Unsupported { key, message } if key == "zerotrain.backend" && message.contains("mpirun started 3 processes")),
        "{err}"
    );
    assert_eq!(under(1).unwrap().runtime.backend, Backend::Threads, "one process is one job");
}

/// A launcher's processes (`zerotrain launch`, torchrun) select the launcher backend at its
/// process count (on any device: on the CPU its relay carries the collectives); an
/// explicit threads backend among them is refused.
#[test]
fn a_launcher_s_processes_train_at_its_process_count() {
    let zt = |json: serde_json::Value| -> raw::ZerotrainConfig { serde_json::from_value(json).unwrap() };
    let launcher = Some(LauncherEnvironment { rank: 1, world_size: 4 });
    let under = Overrides { launcher, ..Overrides::default() };
    let auto = zt(serde_json::json!({"world_size": 2}));
    assert_eq!(backend(&auto, under).unwrap(), Backend::Launcher);
    assert_eq!(world_size(&auto, Backend::Launcher, under).unwrap(), 4, "the launcher's count, not the file's");
    let err = world_size(&auto, Backend::Launcher, Overrides { world_size: Some(2), ..under }).unwrap_err();
    assert!(err.to_string().contains("is 2 but the launcher started 4 processes"), "{err}");
    // mpirun's environment wins where both are set: MPI is then what started the processes.
    let both = Overrides { mpirun: Some(MpirunEnvironment { rank: 0, world_size: 4 }), ..under };
    assert_eq!(backend(&auto, both).unwrap(), Backend::Mpi);
    let threads = zt(serde_json::json!({"backend": "threads"}));
    let err = backend(&threads, under).unwrap_err();
    assert!(err.to_string().contains("a launcher (RANK, WORLD_SIZE) started 4 processes"), "{err}");
    let named = zt(serde_json::json!({"backend": "launcher"}));
    assert_eq!(backend(&named, Overrides::default()).unwrap(), Backend::Launcher);
    let err = backend(&zt(serde_json::json!({"backend": "tcp"})), under).unwrap_err();
    assert!(err.to_string().contains("available: auto, threads, mpi, launcher"), "{err}");
}
