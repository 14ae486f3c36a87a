//! `local_sgd`: its raw keys and their resolution into replica groups and their outer
//! optimizer.

use serde::{Deserialize, Serialize};
use zerotrain_precision::Precision;

use super::autos::{Autos, invalid};
use super::plan::{OuterOptimizer, ReplicaMode, ReplicaPlan, RuntimePlan, TlsPlan};
use super::value::Count;
use super::{Config, ConfigError};

/// `local_sgd`: the world split into replica groups of contiguous ranks, each a normal ZeRO
/// job, averaged through an outer optimizer every `sync_every` steps.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LocalSgdConfig {
    /// Replica groups, dividing the world size. Default 1 (no groups: the section does
    /// nothing).
    pub groups: Option<Count>,
    /// Optimizer steps each group takes between synchronisations (DiLoCo's H). Default 50.
    pub sync_every: Option<Count>,
    /// The optimizer of the global weights. Default `{"type": "nesterov", "lr": 0.7,
    /// "momentum": 0.9}` (DiLoCo's).
    pub outer_optimizer: Option<OuterOptimizerConfig>,
    /// dtype the pseudo-gradients travel in between groups: `fp32` (default) or `bf16`.
    pub communication_data_type: Option<String>,
    /// `sync` (default: every group waits for the others at each synchronisation) or
    /// `async` (parameter servers only: each push applies as it arrives).
    pub mode: Option<String>,
    /// `async`: how many rounds a group may run ahead of the slowest live one. Default 1.
    pub max_staleness: Option<Count>,
    /// With servers: seconds a group may keep the others waiting before it is dropped from
    /// the quorum (its unfinished window discarded). Default 60.
    pub group_timeout_s: Option<f64>,
    /// With servers: `zerotrain serve --checkpoint DIR` saves every this many rounds.
    /// Default 10.
    pub checkpoint_every: Option<Count>,
    /// Parameter servers (`host:port`, `zerotrain serve`): the groups are separate jobs, this
    /// one group `group`; every rank talks to every server, each holding a contiguous part
    /// (1/len) of the rank's shard. Default: none (the groups are in this job).
    #[serde(default)]
    pub servers: Vec<String>,
    /// With `servers`: this job's group, `0..groups`.
    pub group: Option<Count>,
    /// With servers: a file holding the secret every call to a server carries, and the
    /// server checks (the `ZEROTRAIN_SERVER_TOKEN` environment variable wins over it).
    /// Default: none (a server answers anyone who reaches its port).
    pub auth_token_file: Option<String>,
    /// With servers: TLS on every call. Default: none (plain TCP: the token and the weights
    /// cross the network in the clear).
    pub tls: Option<TlsConfig>,
}

/// `local_sgd.tls`: the files `zerotrain serve` presents and workers check, PEM each. One
/// section serves both sides, so that one config file starts the server and its workers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TlsConfig {
    /// The server's certificate chain (`zerotrain serve`).
    pub cert_file: Option<String>,
    /// The server's private key (`zerotrain serve`).
    pub key_file: Option<String>,
    /// The certificate authority (or authorities) workers trust the server's certificate by.
    pub ca_file: Option<String>,
    /// The name workers expect in the server's certificate. Default: the host of each
    /// address in `servers`.
    pub domain: Option<String>,
}

/// `local_sgd.outer_optimizer`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OuterOptimizerConfig {
    /// `nesterov` (SGD with Nesterov momentum; default) or `sgd` (plain SGD; lr 1 without
    /// momentum is model averaging).
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// Learning rate. Default 0.7 (`nesterov`), 1.0 (`sgd`).
    pub lr: Option<f64>,
    /// Momentum. Default 0.9 (`nesterov`), 0 (`sgd`).
    pub momentum: Option<f64>,
}

/// `host:port` or `[v6]:port`: a port number after the last colon, a host name or address
/// before it.
fn is_host_port(s: &str) -> bool {
    if s.parse::<std::net::SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = s.rsplit_once(':') else { return false };
    let name = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
    port.parse::<u16>().is_ok() && !host.is_empty() && host.chars().all(name)
}

pub(super) fn resolve(
    config: &Config,
    runtime: &RuntimePlan,
    pipelined: bool,
    autos: &mut Autos,
) -> Result<Option<ReplicaPlan>, ConfigError> {
    let Some(section) = &config.raw.local_sgd else { return Ok(None) };
    let groups = section.groups.map_or(1, |c| c.0);
    let world_size = runtime.world_size;
    let groups = usize::try_from(groups).map_err(|_| invalid("local_sgd.groups", "too large"))?;
    let (servers, group) = servers_and_group(section, groups)?;
    if groups == 0 || (servers.is_empty() && !world_size.is_multiple_of(groups)) {
        let message = format!("must divide the world size ({world_size}) into groups of equal size, got {groups}");
        return Err(invalid("local_sgd.groups", message));
    }
    let sync_every = section.sync_every.map_or(50, |c| c.0);
    if sync_every == 0 {
        return Err(invalid("local_sgd.sync_every", "must be at least 1 (optimizer steps between synchronisations)"));
    }
    let outer = outer(section.outer_optimizer.as_ref())?;
    let comm_dtype = match section.communication_data_type.as_deref().unwrap_or("fp32") {
        "fp32" | "float32" => Precision::Fp32,
        "bf16" | "bfloat16" => Precision::Bf16,
        other => {
            return Err(invalid("local_sgd.communication_data_type", format!("must be fp32 or bf16, got `{other}`")));
        }
    };
    let mode = mode(section, servers.is_empty(), autos)?;
    let (group_timeout, checkpoint_every) = server_keys(section, servers.is_empty(), autos)?;
    if groups == 1 && servers.is_empty() {
        autos.no_effect("local_sgd (groups is 1: one synchronous job, as without the section)".into());
        return Ok(None);
    }
    if pipelined {
        return Err(ConfigError::Unsupported {
            key: "local_sgd.groups".into(),
            message: "replica groups with pipeline.stages > 1 are not supported yet: use one or the other".into(),
        });
    }
    Ok(Some(ReplicaPlan {
        groups,
        sync_every,
        outer,
        comm_dtype,
        servers,
        group,
        mode,
        group_timeout,
        checkpoint_every,
        auth_token_file: section.auth_token_file.as_ref().map(std::path::PathBuf::from),
        tls: section.tls.as_ref().map(tls),
    }))
}

/// `local_sgd.servers` and `local_sgd.group`: both or neither, each server once, as
/// `host:port`, the group one of `groups`.
fn servers_and_group(section: &LocalSgdConfig, groups: usize) -> Result<(Vec<String>, Option<usize>), ConfigError> {
    let servers = section.servers.clone();
    let group = match (&section.group, servers.is_empty()) {
        (Some(_), true) => {
            return Err(invalid(
                "local_sgd.group",
                "is this job's group among servers' groups: set local_sgd.servers too",
            ));
        }
        (None, false) => {
            return Err(invalid("local_sgd.group", "is needed with local_sgd.servers: which group this job is"));
        }
        (None, true) => None,
        (Some(g), false) => match usize::try_from(g.0) {
            Ok(g) if g < groups => Some(g),
            _ => {
                return Err(invalid(
                    "local_sgd.group",
                    format!("must be one of the {groups} groups (0..{groups}), got {}", g.0),
                ));
            }
        },
    };
    if let Some(bad) = servers.iter().find(|s| !is_host_port(s)) {
        return Err(invalid("local_sgd.servers", format!("`{bad}` is not host:port")));
    }
    for (i, a) in servers.iter().enumerate() {
        if let Some(b) = servers[i + 1..].iter().find(|b| a.eq_ignore_ascii_case(b)) {
            return Err(invalid("local_sgd.servers", format!("lists `{a}` twice (`{b}`): list each server once")));
        }
    }
    Ok((servers, group))
}

/// `local_sgd.mode` (and `max_staleness`): async only with servers.
fn mode(section: &LocalSgdConfig, no_servers: bool, autos: &mut Autos) -> Result<ReplicaMode, ConfigError> {
    Ok(match section.mode.as_deref().unwrap_or("sync") {
        "sync" => {
            if section.max_staleness.is_some() {
                autos.no_effect("local_sgd.max_staleness (only \"async\" mode bounds staleness)".into());
            }
            ReplicaMode::Sync
        }
        "async" if no_servers => {
            return Err(ConfigError::Unsupported {
                key: "local_sgd.mode".into(),
                message: "\"async\" needs parameter servers (local_sgd.servers, `zerotrain serve`); \
                          groups in one job run \"sync\""
                    .into(),
            });
        }
        "async" => ReplicaMode::Async { max_staleness: section.max_staleness.map_or(1, |c| c.0) },
        other => return Err(invalid("local_sgd.mode", format!("must be sync or async, got `{other}`"))),
    })
}

/// The keys only servers act on: `group_timeout_s`, `checkpoint_every`,
/// `auth_token_file`, `tls` (named as without effect when there are none).
fn server_keys(
    section: &LocalSgdConfig,
    no_servers: bool,
    autos: &mut Autos,
) -> Result<(std::time::Duration, u64), ConfigError> {
    let group_timeout = match section.group_timeout_s {
        None => std::time::Duration::from_secs(60),
        Some(s) if s > 0.0 && s.is_finite() && s < 1e9 => std::time::Duration::from_secs_f64(s),
        Some(s) => {
            return Err(invalid("local_sgd.group_timeout_s", format!("must be a positive number of seconds, got {s}")));
        }
    };
    let checkpoint_every = section.checkpoint_every.map_or(10, |c| c.0);
    if checkpoint_every == 0 {
        return Err(invalid("local_sgd.checkpoint_every", "must be at least 1 (rounds between server checkpoints)"));
    }
    if no_servers {
        if section.group_timeout_s.is_some() {
            autos.no_effect(
                "local_sgd.group_timeout_s (groups in one job fail together: zerotrain.comm_timeout_s)".into(),
            );
        }
        if section.checkpoint_every.is_some() {
            autos.no_effect("local_sgd.checkpoint_every (only parameter servers save by rounds)".into());
        }
        if section.auth_token_file.is_some() {
            autos.no_effect("local_sgd.auth_token_file (no parameter servers)".into());
        }
        if section.tls.is_some() {
            autos.no_effect("local_sgd.tls (no parameter servers)".into());
        }
    }
    Ok((group_timeout, checkpoint_every))
}

/// `local_sgd.tls` as paths: which of them a side needs is checked where it reads them
/// (`replicas::server::tls`), so that a worker's config needs no server key and the
/// reverse.
fn tls(raw: &TlsConfig) -> TlsPlan {
    let path = |p: &Option<String>| p.as_ref().map(std::path::PathBuf::from);
    TlsPlan {
        cert_file: path(&raw.cert_file),
        key_file: path(&raw.key_file),
        ca_file: path(&raw.ca_file),
        domain: raw.domain.clone(),
    }
}

fn outer(raw: Option<&OuterOptimizerConfig>) -> Result<OuterOptimizer, ConfigError> {
    let kind = raw.and_then(|o| o.kind.as_deref()).unwrap_or("nesterov");
    let (lr, momentum, nesterov) = match kind {
        "nesterov" => (0.7, 0.9, true),
        "sgd" => (1.0, 0.0, false),
        other => {
            let message = format!("must be nesterov or sgd, got `{other}`");
            return Err(invalid("local_sgd.outer_optimizer.type", message));
        }
    };
    let lr = raw.and_then(|o| o.lr).unwrap_or(lr);
    let momentum = raw.and_then(|o| o.momentum).unwrap_or(momentum);
    if !(lr > 0.0 && lr.is_finite()) {
        return Err(invalid("local_sgd.outer_optimizer.lr", format!("must be a positive number, got {lr}")));
    }
    if !(0.0..1.0).contains(&momentum) {
        return Err(invalid("local_sgd.outer_optimizer.momentum", format!("must be in [0, 1), got {momentum}")));
    }
    if nesterov && momentum == 0.0 {
        let message = "nesterov needs a momentum above 0 (use type sgd for none)";
        return Err(invalid("local_sgd.outer_optimizer.momentum", message));
    }
    Ok(OuterOptimizer { lr, momentum, nesterov })
}

#[cfg(test)]
mod tests {
    use super::super::tests::plan;
    use super::super::*;

    fn with(section: &str, world: usize) -> Result<Plan, ConfigError> {
        plan(&format!(
            r#"{{"train_micro_batch_size_per_gpu": 1, "zerotrain": {{"world_size": {world}}}, "local_sgd": {section}}}"#
        ))
    }

    #[test]
    fn defaults_are_diloco_s_and_groups_split_the_world() {
        let p = with(r#"{"groups": 2}"#, 4).unwrap().replicas.unwrap();
        assert_eq!((p.groups, p.sync_every, p.group_size(4)), (2, 50, 2));
        assert_eq!(p.outer, OuterOptimizer { lr: 0.7, momentum: 0.9, nesterov: true });
        assert_eq!(p.comm_dtype, zerotrain_precision::Precision::Fp32);
        let p = with(
            r#"{"groups": 4, "sync_every": 1, "outer_optimizer": {"type": "sgd"}, "communication_data_type": "bf16"}"#,
            4,
        )
        .unwrap()
        .replicas
        .unwrap();
        assert_eq!(p.outer, OuterOptimizer { lr: 1.0, momentum: 0.0, nesterov: false });
        assert_eq!(p.comm_dtype, zerotrain_precision::Precision::Bf16);
    }

    #[test]
    fn servers_make_the_job_one_group_which_must_be_named() {
        let p = with(r#"{"groups": 3, "servers": ["127.0.0.1:50051"], "group": 2}"#, 2).unwrap().replicas.unwrap();
        let v6 = with(r#"{"groups": 2, "servers": ["[::1]:5", "node-3.cluster:7"], "group": 0}"#, 1).unwrap();
        assert_eq!(v6.replicas.unwrap().servers.len(), 2);
        assert_eq!((p.groups, p.group, p.group_size(2)), (3, Some(2), 2));
        let bf16 = with(r#"{"groups": 2, "servers": ["h:1"], "group": 0, "communication_data_type": "bf16"}"#, 1);
        assert_eq!(bf16.unwrap().replicas.unwrap().comm_dtype, zerotrain_precision::Precision::Bf16);
        let asynchronous = with(
            r#"{"groups": 2, "servers": ["h:1"], "group": 0, "mode": "async", "max_staleness": 3, "group_timeout_s": 2.5}"#,
            1,
        );
        let p = asynchronous.unwrap().replicas.unwrap();
        assert_eq!(
            (p.mode, p.group_timeout.as_millis(), p.checkpoint_every),
            (ReplicaMode::Async { max_staleness: 3 }, 2500, 10)
        );
        for (section, needle) in [
            (r#"{"groups": 2, "servers": ["127.0.0.1:1"]}"#, "is needed with local_sgd.servers"),
            (r#"{"groups": 2, "group": 1}"#, "set local_sgd.servers too"),
            (r#"{"groups": 2, "servers": ["127.0.0.1:1"], "group": 2}"#, "must be one of the 2 groups"),
            (r#"{"groups": 2, "servers": ["nowhere"], "group": 0}"#, "`nowhere` is not host:port"),
            (r#"{"groups": 2, "servers": ["h:port"], "group": 0}"#, "`h:port` is not host:port"),
            (r#"{"groups": 2, "servers": ["h:70000"], "group": 0}"#, "`h:70000` is not host:port"),
            (r#"{"groups": 2, "servers": [":1"], "group": 0}"#, "`:1` is not host:port"),
            (r#"{"groups": 2, "servers": ["h/x:1"], "group": 0}"#, "`h/x:1` is not host:port"),
            (r#"{"groups": 2, "servers": ["h:1", "g:2", "H:1"], "group": 0}"#, "lists `h:1` twice (`H:1`)"),
        ] {
            let err = with(section, 2).unwrap_err().to_string();
            assert!(err.contains(needle), "{section}: {err}");
        }
    }

    #[test]
    fn one_group_is_no_groups_and_says_so() {
        let p = with(r#"{"groups": 1}"#, 2).unwrap();
        assert!(p.replicas.is_none());
        assert!(p.warning().is_some_and(|w| w.contains("local_sgd")), "{:?}", p.warning());
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            (r#"{"groups": 3}"#, "local_sgd.groups"),
            (r#"{"groups": 0}"#, "local_sgd.groups"),
            (r#"{"groups": 2, "sync_every": 0}"#, "local_sgd.sync_every"),
            (r#"{"groups": 2, "outer_optimizer": {"type": "adam"}}"#, "local_sgd.outer_optimizer.type"),
            (r#"{"groups": 2, "outer_optimizer": {"lr": -1}}"#, "local_sgd.outer_optimizer.lr"),
            (r#"{"groups": 2, "outer_optimizer": {"momentum": 1.0}}"#, "local_sgd.outer_optimizer.momentum"),
            (r#"{"groups": 2, "communication_data_type": "fp8"}"#, "local_sgd.communication_data_type"),
            (r#"{"groups": 2, "mode": "async"}"#, "local_sgd.mode"),
            (r#"{"groups": 2, "servers": ["h:1"], "group": 0, "group_timeout_s": 0}"#, "local_sgd.group_timeout_s"),
            (r#"{"groups": 2, "servers": ["h:1"], "group": 0, "checkpoint_every": 0}"#, "local_sgd.checkpoint_every"),
            (r#"{"groups": 2, "mode": "eventually"}"#, "local_sgd.mode"),
            (r#"{"groups": 2, "group": 2}"#, "local_sgd.group"),
        ];
        for (section, key) in cases {
            let err = with(section, 4).unwrap_err().to_string();
            assert!(err.contains(key), "{section}: {err}");
        }
    }
}
