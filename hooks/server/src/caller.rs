//! Who is calling: the identity of a connection's peer, and the Cedar request that asks
//! whether that caller may change state through the API (`Action::"manage"`).

use probity::{Decision, EntityUid, Request};
use serde_json::{Map, Value};

/// How an anonymous caller's network is written after `anonymous`: no other identity
/// (`uid:`, `cn:`, `uri:`) starts so.
const ANONYMOUS_AT: &str = "anonymous@";

/// The identity of a connection's peer, put into each request's extensions by the
/// listener: `uid:<n>` on the Unix socket, `cn:<subject CN>` with a client certificate.
/// A request without one is `anonymous`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller(pub String);

impl Caller {
    /// The caller of a request with no identity.
    pub fn anonymous() -> Self {
        Caller("anonymous".into())
    }

    /// An anonymous caller over TCP, counted by its network: its IPv4 address, or the
    /// /64 of its IPv6 address (one host holds a whole /64). To the policies it is
    /// `anonymous` ([`Caller::identity`]); budgets and limits keyed by [`Caller`] count
    /// each network apart, so one flooding client cannot spend another's budget.
    pub fn anonymous_at(ip: std::net::IpAddr) -> Self {
        use std::net::IpAddr;
        let network = match ip {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => v4.to_string(),
                None => {
                    let s = v6.segments();
                    format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
                }
            },
        };
        Caller(format!("{ANONYMOUS_AT}{network}"))
    }

    /// The identity the policies see: `anonymous` for every anonymous caller, wherever
    /// it connects from; the caller's name otherwise.
    pub fn identity(&self) -> &str {
        if self.0.starts_with(ANONYMOUS_AT) {
            "anonymous"
        } else {
            &self.0
        }
    }

    /// A Unix socket peer.
    pub fn unix_uid(uid: u32) -> Self {
        Caller(format!("uid:{uid}"))
    }

    /// A TLS client certificate's subject common name.
    pub fn common_name(cn: &str) -> Self {
        Caller(format!("cn:{cn}"))
    }

    /// The Cedar request asking whether this caller may do `operation` on the `api`
    /// endpoint family (for `node` when it names one). The caller's groups and node
    /// are engine-owned facts the server registered at start
    /// ([`crate::AuthConfig::api_entities`]), never part of the request.
    pub(crate) fn manage_request(
        &self,
        api: &str,
        operation: &str,
        node: Option<&str>,
    ) -> Result<Request, probity::RequestError> {
        let mut context = Map::new();
        context.insert("operation".into(), Value::String(operation.into()));
        if let Some(n) = node {
            context.insert("node".into(), Value::String(n.into()));
        }
        Ok(Request::new(
            EntityUid::new("ApiCaller", self.identity())?,
            EntityUid::action("manage")?,
            EntityUid::new("Api", api)?,
        )
        .with_context(context))
    }
}

/// The message of a deny of `manage`, naming the policies that said no.
pub(crate) fn forbidden_message(caller: &Caller, operation: &str, d: &Decision) -> String {
    let why: Vec<String> = d
        .reasons
        .iter()
        .map(|r| format!("{} ({})", r.message, r.policy))
        .collect();
    if why.is_empty() {
        format!("{} may not {operation}: no policy permits it", caller.0)
    } else {
        format!("{} may not {operation}: {}", caller.0, why.join("; "))
    }
}

/// Why a client certificate names no identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The certificate does not parse.
    #[error("the client certificate does not parse")]
    Malformed,
    /// More than one URI subject alternative name: which one is the caller?
    #[error("the client certificate has {0} URI subject alternative names; one is an identity")]
    ManyUris(usize),
    /// No URI SAN and no common name.
    #[error("the client certificate names no identity (no URI SAN, no subject CN)")]
    Nameless,
    /// More than one common name: two certificates could map to one identity.
    #[error("the client certificate's subject has {0} common names; exactly one is an identity")]
    ManyCommonNames(usize),
    /// A common name that is not UTF-8 text.
    #[error("the client certificate's subject CN is not UTF-8 text")]
    NotUtf8,
}

/// The identity a client certificate gives its connection: `uri:<SAN URI>` when it
/// has exactly one URI subject alternative name (a SPIFFE ID, as service meshes
/// issue), else `cn:<subject CN>` when its subject has exactly one common name in
/// UTF-8. Anything else names no one, and the connection is refused: two different
/// certificates must never map to one identity. Parsed with `x509-parser`.
pub fn certificate_identity(der: &[u8]) -> Result<Caller, IdentityError> {
    use x509_parser::extensions::GeneralName;
    use x509_parser::prelude::{FromDer, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).map_err(|_| IdentityError::Malformed)?;
    let uris: Vec<String> = match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::URI(u) => Some((*u).to_owned()),
                _ => None,
            })
            .collect(),
        Ok(None) => Vec::new(),
        Err(_) => return Err(IdentityError::Malformed),
    };
    match uris.as_slice() {
        [one] => return Ok(Caller(format!("uri:{one}"))),
        [] => {}
        many => return Err(IdentityError::ManyUris(many.len())),
    }
    let cns: Vec<_> = cert.subject().iter_common_name().collect();
    match cns.as_slice() {
        [] => Err(IdentityError::Nameless),
        [cn] => cn
            .as_str()
            .map(Caller::common_name)
            .map_err(|_| IdentityError::NotUtf8),
        many => Err(IdentityError::ManyCommonNames(many.len())),
    }
}

/// The subject common name of a DER certificate (see [`certificate_identity`], which
/// the server uses).
pub fn certificate_common_name(der: &[u8]) -> Option<String> {
    match certificate_identity(der) {
        Ok(Caller(id)) => id.strip_prefix("cn:").map(str::to_owned),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_certificates_have_no_name() {
        assert_eq!(certificate_common_name(b""), None);
        assert_eq!(
            certificate_identity(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]),
            Err(IdentityError::Malformed)
        );
        assert_eq!(certificate_common_name(&[0x30, 0x03, 0x30, 0x01]), None);
    }

    fn cert(dn: &[(rcgen::DnType, rcgen::DnValue)], sans: Vec<rcgen::SanType>) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::default();
        let mut name = rcgen::DistinguishedName::new();
        for (t, v) in dn {
            name.push(t.clone(), v.clone());
        }
        params.distinguished_name = name;
        params.subject_alt_names = sans;
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    /// Issue: the hand-written DER walker let the last CN win and replaced non-UTF-8
    /// bytes, so two different certificates could map to one identity.
    #[test]
    fn bug_two_common_names_or_a_non_utf8_one_mapped_to_an_identity() {
        use rcgen::{DnType, DnValue};
        let one = cert(
            &[(DnType::CommonName, DnValue::Utf8String("sidecar-a".into()))],
            vec![],
        );
        assert_eq!(
            certificate_identity(&one),
            Ok(Caller("cn:sidecar-a".into()))
        );
        // rcgen keeps one value per attribute type, so the two-CN certificate comes
        // from openssl.
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("two-cn.der");
        let made = std::process::Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
            ])
            .args(["-keyout", "/dev/null", "-days", "1", "-outform", "DER"])
            .args(["-subj", "/CN=evil/CN=sidecar-a", "-out"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            made.status.success(),
            "{}",
            String::from_utf8_lossy(&made.stderr)
        );
        let two = std::fs::read(&out).unwrap();
        assert_eq!(
            certificate_identity(&two),
            Err(IdentityError::ManyCommonNames(2))
        );
        let bmp = cert(
            &[(
                DnType::CommonName,
                DnValue::BmpString(rcgen::string::BmpString::try_from("sidecar-a").unwrap()),
            )],
            vec![],
        );
        assert!(matches!(
            certificate_identity(&bmp),
            Err(IdentityError::NotUtf8 | IdentityError::Malformed)
        ));
        let none = cert(
            &[(DnType::OrganizationName, DnValue::Utf8String("o".into()))],
            vec![],
        );
        assert_eq!(certificate_identity(&none), Err(IdentityError::Nameless));
    }

    #[test]
    fn a_spiffe_uri_san_is_the_identity_and_two_are_refused() {
        use rcgen::{DnType, DnValue, SanType};
        let spiffe = "spiffe://cluster.local/ns/probity/sa/sidecar";
        let c = cert(
            &[(DnType::CommonName, DnValue::Utf8String("ignored".into()))],
            vec![SanType::URI(spiffe.try_into().unwrap())],
        );
        assert_eq!(
            certificate_identity(&c),
            Ok(Caller(format!("uri:{spiffe}")))
        );
        let two = cert(
            &[],
            vec![
                SanType::URI("spiffe://a/x".try_into().unwrap()),
                SanType::URI("spiffe://a/y".try_into().unwrap()),
            ],
        );
        assert_eq!(certificate_identity(&two), Err(IdentityError::ManyUris(2)));
    }

    /// Issue 28 item 5: anonymous callers shared one budget; each network has its own,
    /// an IPv6 host's whole /64 counting as one, and the policies still see `anonymous`.
    #[test]
    fn anonymous_callers_are_counted_by_network() {
        let at = |s: &str| Caller::anonymous_at(s.parse().unwrap());
        assert_eq!(at("192.0.2.7").0, "anonymous@192.0.2.7");
        assert_ne!(at("192.0.2.7"), at("192.0.2.8"));
        assert_eq!(at("2001:db8:1:2:aaaa::1"), at("2001:db8:1:2:bbbb::9"));
        assert_eq!(at("2001:db8:1:2::1").0, "anonymous@2001:db8:1:2::/64");
        assert_ne!(at("2001:db8:1:2::1"), at("2001:db8:1:3::1"));
        assert_eq!(at("::ffff:192.0.2.7"), at("192.0.2.7"));
        assert_eq!(at("192.0.2.7").identity(), "anonymous");
        let request = at("192.0.2.7")
            .manage_request("entities", "upsert", None)
            .unwrap();
        assert_eq!(request.principal().to_string(), r#"ApiCaller::"anonymous""#);
        assert_eq!(
            Caller::common_name("anonymous@x").identity(),
            "cn:anonymous@x"
        );
    }
}
