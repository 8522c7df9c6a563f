//! Who is calling: the identity of a connection's peer, and the Cedar request that asks
//! whether that caller may change state through the API (`Action::"manage"`).

use probity::{Decision, EntityUid, Request};
use serde_json::{Map, Value};

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
            EntityUid::new("ApiCaller", &self.0)?,
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

/// The subject common name of a DER certificate, read with a minimal DER walker
/// (certificate -> tbsCertificate -> subject -> the CN attribute). `None` on anything
/// unexpected: such a caller stays anonymous.
pub fn certificate_common_name(der: &[u8]) -> Option<String> {
    let (cert, _) = der_element(der, 0x30)?;
    let (tbs, _) = der_element(cert, 0x30)?;
    let mut rest = tbs;
    // Optional [0] version.
    if rest.first() == Some(&0xa0) {
        rest = der_element(rest, 0xa0)?.1;
    }
    rest = der_element(rest, 0x02)?.1; // serialNumber
    rest = der_element(rest, 0x30)?.1; // signature
    rest = der_element(rest, 0x30)?.1; // issuer
    rest = der_element(rest, 0x30)?.1; // validity
    let (subject, _) = der_element(rest, 0x30)?;
    let mut rdns = subject;
    let mut found = None;
    while !rdns.is_empty() {
        let (set, next) = der_element(rdns, 0x31)?;
        rdns = next;
        let mut atvs = set;
        while !atvs.is_empty() {
            let (atv, next) = der_element(atvs, 0x30)?;
            atvs = next;
            let (oid, value) = der_element(atv, 0x06)?;
            if oid == [0x55, 0x04, 0x03] {
                let tag = *value.first()?;
                let (text, _) = der_element(value, tag)?;
                found = Some(String::from_utf8_lossy(text).into_owned());
            }
        }
    }
    found
}

/// Splits one DER element of the given tag off `input`: (its contents, the rest).
fn der_element(input: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    if *input.first()? != tag {
        return None;
    }
    let first = *input.get(1)?;
    let (len, header) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for b in input.get(2..2 + n)? {
            len = (len << 8) | usize::from(*b);
        }
        (len, 2 + n)
    };
    let end = header.checked_add(len)?;
    Some((input.get(header..end)?, input.get(end..)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_certificates_have_no_name() {
        assert_eq!(certificate_common_name(b""), None);
        assert_eq!(
            certificate_common_name(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]),
            None
        );
        assert_eq!(certificate_common_name(&[0x30, 0x03, 0x30, 0x01]), None);
    }
}
