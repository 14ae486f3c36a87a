//! TLS between workers and parameter servers (`local_sgd.tls`), through tonic's rustls
//! support: `zerotrain serve` presents `cert_file` and `key_file`; a worker trusts the
//! certificate authorities of `ca_file` and expects `domain` (default: the host of the
//! server's address) in the certificate. Each side needs only its own files, so one config
//! serves both; a side that lacks one of them is an error naming the key, a file that
//! cannot be read or parsed an error naming the file.

use std::path::Path;

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::config::{ReplicaPlan, TlsPlan};
use crate::{Error, Result};

/// The identity `zerotrain serve` presents, if `plan` has a `tls` section.
pub fn identity(plan: &ReplicaPlan) -> Result<Option<ServerTlsConfig>> {
    let Some(tls) = &plan.tls else { return Ok(None) };
    let cert = pem(needed(tls.cert_file.as_deref(), "cert_file", "the server's certificate")?, "CERTIFICATE")?;
    let key = pem(needed(tls.key_file.as_deref(), "key_file", "the server's private key")?, "PRIVATE KEY")?;
    Ok(Some(ServerTlsConfig::new().identity(Identity::from_pem(cert, key))))
}

/// What a worker trusts the server at `addr` by, if `plan` has a `tls` section.
pub(super) fn client(plan: &ReplicaPlan, addr: &str) -> Result<Option<ClientTlsConfig>> {
    let Some(tls) = &plan.tls else { return Ok(None) };
    let ca = pem(needed(tls.ca_file.as_deref(), "ca_file", "what workers trust the server by")?, "CERTIFICATE")?;
    Ok(Some(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name(domain(tls, addr))))
}

/// The name a worker expects in the certificate of the server at `addr`.
fn domain(tls: &TlsPlan, addr: &str) -> String {
    if let Some(domain) = &tls.domain {
        return domain.clone();
    }
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']').to_owned()
}

fn needed<'a>(file: Option<&'a Path>, key: &str, what: &str) -> Result<&'a Path> {
    file.ok_or_else(|| Error::Usage(format!("local_sgd.tls.{key} is needed here: {what} (a PEM file)")))
}

/// The PEM text of `file`, which must hold at least one block whose label ends in `label`.
fn pem(file: &Path, label: &str) -> Result<String> {
    let text = super::auth::read_small_text(file)?;
    let has = text.lines().any(|l| l.starts_with("-----BEGIN ") && l.trim_end().ends_with(&format!("{label}-----")));
    if !has {
        return Err(Error::Usage(format!("local_sgd.tls: {} holds no PEM `{label}` block", file.display())));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_expects_the_host_of_the_address_unless_a_domain_is_set() {
        let mut tls = TlsPlan { cert_file: None, key_file: None, ca_file: None, domain: None };
        assert_eq!(domain(&tls, "params.example.org:50051"), "params.example.org");
        assert_eq!(domain(&tls, "127.0.0.1:7"), "127.0.0.1");
        assert_eq!(domain(&tls, "[::1]:7"), "::1");
        tls.domain = Some("ps".into());
        assert_eq!(domain(&tls, "127.0.0.1:7"), "ps");
    }
}
