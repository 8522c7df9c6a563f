//! The PKCS#11 anchor: signs manifest digests inside an HSM with a non-extractable ECDSA P-256
//! key, and stores each digest on the token as a `CKO_DATA` object.
//!
//! * The module is loaded and `C_Initialize`d once per process per module path
//!   (`OS_LOCKING_OK`); the context lives until the process exits.
//! * The token is found by **label** (slot ids change when tokens are added).
//! * The key is generated in the token: `CKA_TOKEN`, `CKA_SENSITIVE`, not `CKA_EXTRACTABLE`,
//!   labelled. The public half is read from `CKA_EC_POINT`.
//! * Signing uses raw `CKM_ECDSA` over `SHA-256(digest)` (SoftHSM2 2.6 has no
//!   `CKM_ECDSA_SHA256`); see [`super::anchor`] for the scheme.
//! * One session per anchor, behind a mutex (a PKCS#11 session is not thread-safe).
//! * The user PIN comes from an environment variable or a file ([`Pin`]), never from a
//!   command-line argument, and is never printed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use cryptoki::context::{CInitializeArgs, CInitializeFlags, Pkcs11};
use cryptoki::error::{Error as P11Error, RvError};
use cryptoki::mechanism::Mechanism;
use cryptoki::object::{Attribute, AttributeType, KeyType, ObjectClass, ObjectHandle};
use cryptoki::session::{Session, UserType};

use super::anchor::{
    Anchor, AnchorDescription, AnchorError, AnchorKind, PublicKey, SIGNATURE_LEN, Signature,
    Verifier,
};
use super::manifest::{Hash, sha256};
use crate::trust::{self, Material, TrustError};

/// DER encoding of the P-256 curve OID (1.2.840.10045.3.1.7), the `CKA_EC_PARAMS` value.
const P256_PARAMS: [u8; 10] = [0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
/// `CKA_APPLICATION` of the digest data objects.
pub const DATA_APPLICATION: &str = "probity";

/// A token user PIN: the keyring's [`probity_keys::Pin`] (redacted `Debug`, no `Display`,
/// zeroized on drop), read with the anchor's errors and, from a file, the trust check.
pub struct Pin(probity_keys::Pin);

impl Pin {
    /// Reads the PIN from environment variable `var`.
    pub fn from_env(var: &str) -> Result<Self, AnchorError> {
        probity_keys::Pin::from_env(var)
            .map(Self)
            .map_err(|_| AnchorError::PinEnvMissing {
                var: var.to_owned(),
            })
    }
    /// Reads the PIN from the first line of the file at `path` (trailing newline removed).
    /// Refuses a file that group or others may read or write, or that another user than
    /// this one or root owns (see `probity_base::trust`).
    pub fn from_file(path: &Path) -> Result<Self, AnchorError> {
        let (pin, readable) = Self::from_file_lenient(path)?;
        match readable {
            Some(problem) => Err(problem.into()),
            None => Ok(pin),
        }
    }

    /// [`Pin::from_file`], except that a file group or others may read is accepted and
    /// the problem returned beside the PIN, for the caller to warn about. Everything
    /// else [`Pin::from_file`] refuses is still refused.
    pub fn from_file_lenient(path: &Path) -> Result<(Self, Option<TrustError>), AnchorError> {
        let (_, readable) =
            trust::check_file_lenient(path, Material::Secret).map_err(|e| match e {
                // A file that cannot be found or read is a PIN file problem, not a trust one.
                TrustError::Io { source, .. } => AnchorError::PinFile {
                    path: path.to_owned(),
                    source,
                },
                other => other.into(),
            })?;
        Ok((Self::read_file(path)?, readable))
    }

    fn read_file(path: &Path) -> Result<Self, AnchorError> {
        let source = match probity_keys::Pin::from_file(path) {
            Ok(pin) => return Ok(Self(pin)),
            Err(probity_keys::PinError::File { source, .. }) => source,
            Err(probity_keys::PinError::FileEmpty { .. }) => {
                std::io::Error::new(std::io::ErrorKind::InvalidData, "the first line is empty")
            }
            Err(other) => std::io::Error::other(other.to_string()),
        };
        Err(AnchorError::PinFile {
            path: path.to_owned(),
            source,
        })
    }
    /// Wraps a PIN obtained some other way (a prompt, a secret store). Never pass a PIN on a
    /// command line: it shows in the process list.
    pub fn new(pin: String) -> Self {
        Self(probity_keys::Pin::new(pin))
    }
}

impl std::fmt::Debug for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pin(<redacted>)")
    }
}

/// Where the PKCS#11 anchor's key lives.
#[derive(Debug)]
pub struct Pkcs11Config {
    /// Path of the PKCS#11 module, e.g. `/usr/lib/softhsm/libsofthsm2.so`.
    pub module: PathBuf,
    /// Label of the token.
    pub token_label: String,
    /// Label of the signing key pair on the token.
    pub key_label: String,
    /// The user PIN.
    pub pin: Pin,
    /// Use a key found on the token even if the HSM does not protect it (sensitive, not
    /// extractable, and generated in the token or never extractable): every description
    /// of the anchor then says its signatures are NOT HSM-protected. Default: false, and
    /// such a key is refused with [`AnchorError::UnprotectedKey`].
    pub allow_unprotected_key: bool,
}

impl Pkcs11Config {
    /// A configuration that refuses unprotected keys.
    pub fn new(
        module: impl Into<PathBuf>,
        token_label: impl Into<String>,
        key_label: impl Into<String>,
        pin: Pin,
    ) -> Self {
        Self {
            module: module.into(),
            token_label: token_label.into(),
            key_label: key_label.into(),
            pin,
            allow_unprotected_key: false,
        }
    }
}

/// A manifest digest kept on the token as a `CKO_DATA` object (see
/// [`Anchor::store_digest`]): the rollback memory that survives the loss of the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenDigest {
    /// Object id.
    pub object_id: String,
    /// Version.
    pub version: u64,
    /// Manifest digest.
    pub digest: Hash,
}

/// An anchor backed by a PKCS#11 token (an HSM).
pub struct Pkcs11Anchor {
    module: PathBuf,
    token: String,
    key_label: String,
    session: Mutex<Session>,
    key: ObjectHandle,
    public: PublicKey,
    /// The first protection check the key failed, when it was used anyway.
    unprotected: Option<AnchorError>,
}

impl std::fmt::Debug for Pkcs11Anchor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pkcs11Anchor")
            .field("module", &self.module)
            .field("token", &self.token)
            .field("key_label", &self.key_label)
            .field("public", &self.public)
            .finish_non_exhaustive()
    }
}

fn contexts() -> &'static Mutex<HashMap<PathBuf, Pkcs11>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<PathBuf, Pkcs11>>> = OnceLock::new();
    CONTEXTS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The process-wide initialized context for `module` (PKCS#11 allows one
/// `C_Initialize` per process; the keyring's KEKs share it, see `crate::keys`).
pub(crate) fn context(module: &Path) -> Result<Pkcs11, AnchorError> {
    let load_err = |e: P11Error| AnchorError::ModuleLoad {
        module: module.to_owned(),
        source: Box::new(e),
    };
    let mut map = contexts()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(ctx) = map.get(module) {
        return Ok(ctx.clone());
    }
    let ctx = Pkcs11::new(module).map_err(load_err)?;
    match ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK)) {
        Ok(()) | Err(P11Error::Pkcs11(RvError::CryptokiAlreadyInitialized, _)) => {}
        Err(e) => return Err(load_err(e)),
    }
    map.insert(module.to_owned(), ctx.clone());
    Ok(ctx)
}

fn p11(operation: &'static str, token: &str) -> impl FnOnce(P11Error) -> AnchorError {
    let token = token.to_owned();
    move |e| AnchorError::Pkcs11 {
        operation,
        token,
        source: Box::new(e),
    }
}

/// Opens a read-write session on the token labelled `token` and logs the user in.
fn login(config: &Pkcs11Config) -> Result<Session, AnchorError> {
    let ctx = context(&config.module)?;
    let token = config.token_label.as_str();
    let slots = ctx
        .get_slots_with_token()
        .map_err(p11("slot listing", token))?;
    let mut found = None;
    for slot in slots {
        let info = ctx.get_token_info(slot).map_err(p11("token info", token))?;
        if info.label().trim_end() == token {
            found = Some(slot);
            break;
        }
    }
    let slot = found.ok_or_else(|| AnchorError::TokenNotFound {
        label: token.to_owned(),
        module: config.module.clone(),
    })?;
    let session = ctx
        .open_rw_session(slot)
        .map_err(p11("open session", token))?;
    match session.login(UserType::User, Some(&config.pin.0.auth_pin())) {
        Ok(()) | Err(P11Error::Pkcs11(RvError::UserAlreadyLoggedIn, _)) => Ok(session),
        Err(P11Error::Pkcs11(RvError::PinIncorrect | RvError::PinLenRange, _)) => {
            Err(AnchorError::WrongPin {
                token: token.to_owned(),
            })
        }
        Err(P11Error::Pkcs11(RvError::PinLocked, _)) => Err(AnchorError::PinLocked {
            token: token.to_owned(),
        }),
        Err(e) => Err(p11("login", token)(e)),
    }
}

fn find_one(
    session: &Session,
    token: &str,
    template: &[Attribute],
) -> Result<Option<ObjectHandle>, AnchorError> {
    let found = session
        .find_objects(template)
        .map_err(p11("object search", token))?;
    Ok(found.first().copied())
}

/// Unwraps `CKA_EC_POINT`: a DER OCTET STRING around the 65-byte point (some modules return
/// the bare point).
fn ec_point(raw: &[u8]) -> Result<PublicKey, AnchorError> {
    match raw {
        [0x04, 0x41, point @ ..] if point.len() == 65 => PublicKey::from_sec1(point),
        _ => PublicKey::from_sec1(raw),
    }
}

impl Pkcs11Anchor {
    /// Opens the anchor: finds the token by label, logs in, finds the key by label.
    ///
    /// Distinct errors for a missing module ([`AnchorError::ModuleLoad`]), token
    /// ([`AnchorError::TokenNotFound`]), wrong PIN ([`AnchorError::WrongPin`]) and missing key
    /// ([`AnchorError::KeyNotFound`]).
    pub fn open(config: &Pkcs11Config) -> Result<Self, AnchorError> {
        let session = login(config)?;
        let token = config.token_label.as_str();
        let key = find_one(
            &session,
            token,
            &[
                Attribute::Class(ObjectClass::PRIVATE_KEY),
                Attribute::Label(config.key_label.as_bytes().to_vec()),
            ],
        )?
        .ok_or_else(|| AnchorError::KeyNotFound {
            key: config.key_label.clone(),
            token: token.to_owned(),
        })?;
        let public_handle = find_one(
            &session,
            token,
            &[
                Attribute::Class(ObjectClass::PUBLIC_KEY),
                Attribute::Label(config.key_label.as_bytes().to_vec()),
            ],
        )?
        .ok_or_else(|| AnchorError::KeyNotFound {
            key: config.key_label.clone(),
            token: token.to_owned(),
        })?;
        let unprotected = match check_protection(&session, key, config) {
            Ok(()) => None,
            Err(problem) if config.allow_unprotected_key => Some(problem),
            Err(problem) => return Err(problem),
        };
        let attrs = session
            .get_attributes(public_handle, &[AttributeType::EcPoint])
            .map_err(p11("public key read", token))?;
        let public = attrs
            .iter()
            .find_map(|a| match a {
                Attribute::EcPoint(p) => Some(ec_point(p)),
                _ => None,
            })
            .unwrap_or(Err(AnchorError::InvalidPublicKey { len: 0 }))?;
        Ok(Self {
            module: config.module.clone(),
            token: token.to_owned(),
            key_label: config.key_label.clone(),
            session: Mutex::new(session),
            key,
            public,
            unprotected,
        })
    }

    /// Generates the signing key pair in the token (non-extractable, sensitive, persistent,
    /// labelled `key_label`), then opens the anchor. Refuses if the label is taken.
    pub fn generate(config: &Pkcs11Config) -> Result<Self, AnchorError> {
        let session = login(config)?;
        let token = config.token_label.as_str();
        let label = config.key_label.as_bytes().to_vec();
        if find_one(&session, token, &[Attribute::Label(label.clone())])?.is_some() {
            return Err(AnchorError::KeyExists {
                key: config.key_label.clone(),
                token: token.to_owned(),
            });
        }
        let id = sha256(&label).get(..8).unwrap_or_default().to_vec();
        let public_template = [
            Attribute::Token(true),
            Attribute::Private(false),
            Attribute::KeyType(KeyType::EC),
            Attribute::EcParams(P256_PARAMS.to_vec()),
            Attribute::Verify(true),
            Attribute::Encrypt(false),
            Attribute::Wrap(false),
            Attribute::Derive(false),
            Attribute::Label(label.clone()),
            Attribute::Id(id.clone()),
        ];
        let private_template = [
            Attribute::Token(true),
            Attribute::Private(true),
            Attribute::Sensitive(true),
            Attribute::Extractable(false),
            Attribute::Sign(true),
            Attribute::Decrypt(false),
            Attribute::Unwrap(false),
            Attribute::Derive(false),
            Attribute::Label(label),
            Attribute::Id(id),
        ];
        session
            .generate_key_pair(
                &Mechanism::EccKeyPairGen,
                &public_template,
                &private_template,
            )
            .map_err(p11("key generation", token))?;
        drop(session);
        Self::open(config)
    }

    /// Opens the anchor, generating the key first if the token has none with this label.
    pub fn open_or_generate(config: &Pkcs11Config) -> Result<Self, AnchorError> {
        match Self::open(config) {
            Err(AnchorError::KeyNotFound { .. }) => Self::generate(config),
            other => other,
        }
    }

    /// The token label.
    pub fn token_label(&self) -> &str {
        &self.token
    }

    /// Why the key is not HSM-protected, when it was used anyway
    /// ([`Pkcs11Config::allow_unprotected_key`]); `None` for a protected key.
    pub fn protection_problem(&self) -> Option<&AnchorError> {
        self.unprotected.as_ref()
    }

    /// The manifest digests this token keeps (see `token_digests`).
    pub fn stored_digests(&self) -> Result<Vec<TokenDigest>, AnchorError> {
        list_digests(&self.session(), &self.token)
    }

    fn session(&self) -> std::sync::MutexGuard<'_, Session> {
        self.session
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Anchor for Pkcs11Anchor {
    fn sign(&self, digest: &Hash) -> Result<Signature, AnchorError> {
        let prehash = sha256(digest);
        let raw = self
            .session()
            .sign(&Mechanism::Ecdsa, self.key, &prehash)
            .map_err(p11("sign", &self.token))?;
        let fixed: [u8; SIGNATURE_LEN] =
            raw.as_slice()
                .try_into()
                .map_err(|_| AnchorError::SelfCheck {
                    anchor: self.describe().summary,
                })?;
        let signature = Signature(fixed);
        if !Verifier::new(self.public.clone()).verify(digest, &signature) {
            return Err(AnchorError::SelfCheck {
                anchor: self.describe().summary,
            });
        }
        Ok(signature)
    }

    fn public_key(&self) -> &PublicKey {
        &self.public
    }

    fn store_digest(
        &self,
        object_id: &str,
        version: u64,
        digest: &Hash,
    ) -> Result<(), AnchorError> {
        let label = format!("{object_id}@{version}");
        let token = self.token.as_str();
        let session = self.session();
        let template = [
            Attribute::Class(ObjectClass::DATA),
            Attribute::Application(DATA_APPLICATION.as_bytes().to_vec()),
            Attribute::Label(label.as_bytes().to_vec()),
        ];
        if let Some(existing) = find_one(&session, token, &template)? {
            let attrs = session
                .get_attributes(existing, &[AttributeType::Value])
                .map_err(p11("data object read", token))?;
            let same = attrs
                .iter()
                .any(|a| matches!(a, Attribute::Value(v) if v.as_slice() == digest.as_slice()));
            return if same {
                Ok(())
            } else {
                Err(AnchorError::DigestConflict {
                    token: token.to_owned(),
                    label,
                })
            };
        }
        session
            .create_object(&[
                Attribute::Class(ObjectClass::DATA),
                Attribute::Token(true),
                Attribute::Private(false),
                Attribute::Modifiable(false),
                Attribute::Application(DATA_APPLICATION.as_bytes().to_vec()),
                Attribute::Label(label.into_bytes()),
                Attribute::Value(digest.to_vec()),
            ])
            .map_err(p11("data object creation", token))?;
        Ok(())
    }

    fn describe(&self) -> AnchorDescription {
        let mut summary = format!(
            "PKCS#11 HSM token {:?} key {:?} via {}",
            self.token,
            self.key_label,
            self.module.display()
        );
        if let Some(problem) = &self.unprotected {
            summary.push_str(&format!(
                " -- signatures NOT HSM-protected: {problem} (used because unprotected keys were allowed)"
            ));
        }
        AnchorDescription {
            kind: AnchorKind::Hsm,
            summary,
            key_id: self.public.key_id(),
            key_protected: self.unprotected.is_none(),
        }
    }
}

/// Checks that the HSM protects the private key `key`: `CKA_SENSITIVE` true,
/// `CKA_EXTRACTABLE` false, and `CKA_LOCAL` true (generated in the token) or both
/// `CKA_ALWAYS_SENSITIVE` and `CKA_NEVER_EXTRACTABLE` true (never seen outside it). An
/// attribute the token does not report counts as failing.
fn check_protection(
    session: &Session,
    key: ObjectHandle,
    config: &Pkcs11Config,
) -> Result<(), AnchorError> {
    let token = config.token_label.as_str();
    let attrs = session
        .get_attributes(
            key,
            &[
                AttributeType::Sensitive,
                AttributeType::Extractable,
                AttributeType::Local,
                AttributeType::AlwaysSensitive,
                AttributeType::NeverExtractable,
            ],
        )
        .map_err(p11("key attribute read", token))?;
    let mut sensitive = None;
    let mut extractable = None;
    let mut local = None;
    let mut always_sensitive = None;
    let mut never_extractable = None;
    for a in &attrs {
        match a {
            Attribute::Sensitive(v) => sensitive = Some(*v),
            Attribute::Extractable(v) => extractable = Some(*v),
            Attribute::Local(v) => local = Some(*v),
            Attribute::AlwaysSensitive(v) => always_sensitive = Some(*v),
            Attribute::NeverExtractable(v) => never_extractable = Some(*v),
            _ => {}
        }
    }
    let fail = |attribute: &'static str, found: Option<bool>| {
        Err(AnchorError::UnprotectedKey {
            key: config.key_label.clone(),
            token: token.to_owned(),
            attribute,
            found,
        })
    };
    if sensitive != Some(true) {
        return fail("CKA_SENSITIVE", sensitive);
    }
    if extractable != Some(false) {
        return fail("CKA_EXTRACTABLE", extractable);
    }
    if local == Some(true) {
        return Ok(());
    }
    if always_sensitive != Some(true) {
        return fail("CKA_ALWAYS_SENSITIVE", always_sensitive);
    }
    if never_extractable != Some(true) {
        return fail("CKA_NEVER_EXTRACTABLE", never_extractable);
    }
    Ok(())
}

/// Every manifest digest the token labelled `config.token_label` keeps, read with a user
/// session but without the signing key: what a new registry is rebuilt from
/// ([`crate::integrity::restore_rollback_memory`]). Objects whose label or value is not
/// one Probity writes are skipped.
pub fn token_digests(config: &Pkcs11Config) -> Result<Vec<TokenDigest>, AnchorError> {
    let session = login(config)?;
    list_digests(&session, &config.token_label)
}

fn list_digests(session: &Session, token: &str) -> Result<Vec<TokenDigest>, AnchorError> {
    let handles = session
        .find_objects(&[
            Attribute::Class(ObjectClass::DATA),
            Attribute::Application(DATA_APPLICATION.as_bytes().to_vec()),
        ])
        .map_err(p11("data object search", token))?;
    let mut out = Vec::with_capacity(handles.len());
    for handle in handles {
        let attrs = session
            .get_attributes(handle, &[AttributeType::Label, AttributeType::Value])
            .map_err(p11("data object read", token))?;
        let mut label = None;
        let mut value = None;
        for a in attrs {
            match a {
                Attribute::Label(l) => label = Some(l),
                Attribute::Value(v) => value = Some(v),
                _ => {}
            }
        }
        if let Some(d) = label
            .zip(value)
            .and_then(|(l, v)| parse_digest_object(&l, &v))
        {
            out.push(d);
        }
    }
    Ok(out)
}

/// A data object as [`Anchor::store_digest`] writes it: label `<object id>@<version>`
/// (the id may itself hold `@`), value the 32-byte digest.
fn parse_digest_object(label: &[u8], value: &[u8]) -> Option<TokenDigest> {
    let label = std::str::from_utf8(label).ok()?;
    let (object_id, version) = label.rsplit_once('@')?;
    if object_id.is_empty() || version.starts_with('+') {
        return None;
    }
    Some(TokenDigest {
        object_id: object_id.to_owned(),
        version: version.parse().ok()?,
        digest: value.try_into().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_debug_is_redacted() {
        let pin = Pin::new("123456".into());
        assert_eq!(format!("{pin:?}"), "Pin(<redacted>)");
        let cfg = Pkcs11Config::new("/x", "t", "k", pin);
        assert!(!format!("{cfg:?}").contains("123456"));
    }

    #[test]
    fn ec_point_unwraps_octet_string() {
        let mut point = vec![0x04u8];
        point.extend_from_slice(&[9u8; 64]);
        let mut der = vec![0x04, 0x41];
        der.extend_from_slice(&point);
        assert_eq!(
            ec_point(&der).unwrap().as_sec1().as_slice(),
            point.as_slice()
        );
        assert_eq!(
            ec_point(&point).unwrap().as_sec1().as_slice(),
            point.as_slice()
        );
        assert!(ec_point(&[1, 2, 3]).is_err());
    }

    #[test]
    fn pin_file_first_line_and_empty_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pin");
        std::fs::write(&path, "1234\r\nignored\n").unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Pin::from_file(&path).is_ok());
        std::fs::write(&path, "\n").unwrap();
        assert!(matches!(
            Pin::from_file(&path),
            Err(AnchorError::PinFile { .. })
        ));
    }

    /// Issue (hardening): a PIN file others could read was used silently.
    #[test]
    fn bug_pin_file_readable_by_group_or_others_is_refused_unless_lenient() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pin");
        std::fs::write(&path, "1234\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let err = Pin::from_file(&path).unwrap_err();
        assert!(
            matches!(
                err,
                AnchorError::Untrusted(TrustError::Readable { mode: 0o640, .. })
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("lets group read it"), "{err}");
        let (_, warning) = Pin::from_file_lenient(&path).unwrap();
        assert!(warning.is_some());
        // Writable by others is refused even when lenient.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(Pin::from_file_lenient(&path).is_err());
    }

    #[test]
    fn digest_objects_parse_back_from_their_labels() {
        let d = [3u8; 32];
        assert_eq!(
            parse_digest_object(b"models/a@b@12", &d),
            Some(TokenDigest {
                object_id: "models/a@b".into(),
                version: 12,
                digest: d
            })
        );
        assert_eq!(parse_digest_object(b"x@", &d), None);
        assert_eq!(parse_digest_object(b"@1", &d), None);
        assert_eq!(parse_digest_object(b"x@+1", &d), None);
        assert_eq!(parse_digest_object(b"x@1", &d[..31]), None);
        assert_eq!(parse_digest_object(b"x@18446744073709551616", &d), None);
        assert_eq!(parse_digest_object(&[0xff, b'@', b'1'], &d), None);
    }

    #[test]
    fn missing_module_is_a_load_error() {
        let cfg = Pkcs11Config::new("/nonexistent/libnothing.so", "t", "k", Pin::new("1".into()));
        assert!(matches!(
            Pkcs11Anchor::open(&cfg),
            Err(AnchorError::ModuleLoad { .. })
        ));
    }
}
