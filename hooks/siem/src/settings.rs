//! The `[siem]` table both binaries read: where the receiver is and how to reach it.
//!
//! Why here: the server and the node agent forward the same logs the same way, so the
//! table, its checks and its mapping to a [`ForwarderConfig`] are written once.

use std::path::PathBuf;

use serde::Deserialize;

use crate::{ClientIdentity, ForwarderConfig, TlsSettings, Transport};

/// How the SIEM is reached (`transport`).
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum SiemTransport {
    /// Syslog over TCP, octet-counted (RFC 6587): delivery is confirmed by an orderly
    /// close of the connection.
    #[default]
    Tcp,
    /// Syslog over TLS (RFC 5425).
    Tls,
    /// RELP: each record acknowledged by the receiver.
    Relp,
    /// RELP over TLS.
    RelpTls,
}

impl SiemTransport {
    /// Whether it runs over TLS (and so needs a CA bundle).
    pub fn is_tls(self) -> bool {
        matches!(self, Self::Tls | Self::RelpTls)
    }
}

/// Forwarding the decision and event logs to a SIEM, at least once. Off while
/// `address` is unset.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct SiemSettings {
    /// The receiver, `host:port`; unset: no forwarding.
    pub address: Option<String>,
    /// `tcp`, `tls`, `relp` or `relp-tls`.
    pub transport: SiemTransport,
    /// PEM CA certificates that may sign the receiver's certificate (TLS transports).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate chain, for receivers that authenticate senders.
    pub client_cert: Option<PathBuf>,
    /// PEM key of `client_cert`.
    pub client_key: Option<PathBuf>,
    /// The name the receiver's certificate must carry; default the address's host.
    pub server_name: Option<String>,
}

impl SiemSettings {
    /// Checks the table on its own (a state directory is the caller's to require):
    /// what is wrong, in words an operator acts on.
    pub fn check(&self) -> Result<(), String> {
        let Some(address) = &self.address else {
            return Ok(());
        };
        let port = address
            .rsplit_once(':')
            .map(|(host, port)| (host, port.parse::<u16>()));
        if !matches!(port, Some((host, Ok(p))) if !host.is_empty() && p != 0) {
            return Err(format!("address {address:?} is not host:port"));
        }
        if self.transport.is_tls() && self.ca_file.is_none() {
            return Err("transport = \"tls\" or \"relp-tls\" needs ca_file".into());
        }
        if !self.transport.is_tls()
            && (self.ca_file.is_some()
                || self.client_cert.is_some()
                || self.client_key.is_some()
                || self.server_name.is_some())
        {
            return Err(
                "ca_file, client_cert, client_key and server_name need transport = \"tls\" or \"relp-tls\""
                    .into(),
            );
        }
        if self.client_cert.is_some() != self.client_key.is_some() {
            return Err("client_cert and client_key go together".into());
        }
        Ok(())
    }

    /// The forwarder settings the table describes, for `address`.
    pub fn forwarder_config(&self, address: &str) -> ForwarderConfig {
        let tls = || {
            let mut t = TlsSettings::new(self.ca_file.clone().unwrap_or_default());
            if let (Some(cert), Some(key)) = (&self.client_cert, &self.client_key) {
                t = t.with_client_identity(ClientIdentity {
                    cert_file: cert.clone(),
                    key_file: key.clone(),
                });
            }
            if let Some(name) = &self.server_name {
                t = t.with_server_name(name.clone());
            }
            t
        };
        let transport = match self.transport {
            SiemTransport::Tcp => Transport::Tcp,
            SiemTransport::Tls => Transport::Tls(tls()),
            SiemTransport::Relp => Transport::Relp,
            SiemTransport::RelpTls => Transport::RelpTls(tls()),
        };
        ForwarderConfig::new(address, transport)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(address: &str, transport: SiemTransport) -> SiemSettings {
        SiemSettings {
            address: Some(address.into()),
            transport,
            ..SiemSettings::default()
        }
    }

    #[test]
    fn an_address_needs_a_host_and_a_port() {
        for bad in ["siem", ":514", "siem:0", "siem:99999"] {
            let err = settings(bad, SiemTransport::Tcp).check().unwrap_err();
            assert!(err.contains("is not host:port"), "{bad}: {err}");
        }
        assert_eq!(settings("[::1]:514", SiemTransport::Tcp).check(), Ok(()));
        assert_eq!(SiemSettings::default().check(), Ok(()));
    }

    #[test]
    fn tls_needs_a_ca_and_tls_material_needs_tls() {
        let err = settings("siem:6514", SiemTransport::RelpTls)
            .check()
            .unwrap_err();
        assert!(err.contains("needs ca_file"), "{err}");
        let mut s = settings("siem:514", SiemTransport::Relp);
        s.server_name = Some("siem".into());
        assert!(s.check().unwrap_err().contains("need transport"));
        let mut s = settings("siem:6514", SiemTransport::Tls);
        s.ca_file = Some("ca.pem".into());
        s.client_cert = Some("c.pem".into());
        assert!(s.check().unwrap_err().contains("go together"));
        s.client_key = Some("k.pem".into());
        assert_eq!(s.check(), Ok(()));
        assert!(matches!(
            s.forwarder_config("siem:6514").transport,
            Transport::Tls(_)
        ));
    }
}
