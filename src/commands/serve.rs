//! `zerotrain serve`: a parameter server for replica groups in separate jobs.

use std::path::Path;

use crate::keys;

/// `zerotrain serve`: a parameter server for the config's replica groups, until a signal.
pub fn serve(file: &Path, listen: std::net::SocketAddr, checkpoint: Option<std::path::PathBuf>) -> anyhow::Result<()> {
    // A server trains nothing: a schedule's "auto" length, the world size and mpirun do
    // not matter to it.
    let only_groups = zerotrain::Overrides { total_steps: Some(1 << 30), ..zerotrain::Overrides::default() };
    let (plan, _) = keys::load(file, only_groups)?;
    let Some(replicas) = &plan.replicas else {
        anyhow::bail!("{}: no local_sgd section with groups: nothing to serve", file.display());
    };
    let mut config = zerotrain::replicas::server::ServerConfig::new(replicas, checkpoint);
    config.token = zerotrain::replicas::server::auth::Token::load(replicas.auth_token_file.as_deref())?;
    config.tls = zerotrain::replicas::server::tls::identity(replicas)?;
    if config.token.is_none() {
        eprintln!(
            "zerotrain serve: warning: no token (local_sgd.auth_token_file or {}): anyone who reaches {listen} can \
             join as a group and push values",
            zerotrain::replicas::server::auth::TOKEN_VARIABLE
        );
    }
    if config.tls.is_none() {
        eprintln!(
            "zerotrain serve: warning: no TLS (local_sgd.tls): the token and the weights cross the network in the \
             clear; keep the server on a private network"
        );
    }
    let server = zerotrain::replicas::server::serve(listen, config)?;
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })?;
    if let Some(round) = server.resumed() {
        eprintln!("zerotrain serve: resumed from the checkpoint of round {round}");
    }
    println!("parameter server for {} groups listening on {}", replicas.groups, server.addr());
    let _ = rx.recv();
    eprintln!("zerotrain: stopping the parameter server");
    server.stop()?;
    Ok(())
}
