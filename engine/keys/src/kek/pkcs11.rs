//! The PKCS#11 KEK provider: each KEK is an AES-256 key generated inside a token (an HSM) and
//! never leaves it; data keys are wrapped and unwrapped there with `CKM_AES_KEY_WRAP_PAD`
//! (RFC 5649).
//!
//! * The caller hands over an initialized [`Pkcs11`] context: `C_Initialize` happens once per
//!   process, in the caller, never in this library.
//! * The token is found by **label** (slot ids change when tokens are added).
//! * A KEK is generated with `CKA_TOKEN`, `CKA_PRIVATE`, `CKA_SENSITIVE` true,
//!   `CKA_EXTRACTABLE` false, `CKA_WRAP` and `CKA_UNWRAP` true, no encrypt, decrypt, sign or
//!   derive, labelled. A KEK *found* on the token is checked before first use: it must be an
//!   AES-256 key with `CKA_SENSITIVE` true, `CKA_EXTRACTABLE` false, and `CKA_LOCAL` true (or
//!   both `CKA_ALWAYS_SENSITIVE` and `CKA_NEVER_EXTRACTABLE` true); a pre-provisioned key that
//!   could have left the token, or was imported, is refused with an error naming the attribute.
//! * SoftHSM2 2.6 implements `CKM_AES_KEY_WRAP_PAD` for wrapping keys only, not for
//!   encrypting bytes. So a data key is wrapped by creating a short-lived session object
//!   (`CKA_TOKEN` false, extractable) holding it, wrapping that object and destroying it; and
//!   unwrapped into such an object whose `CKA_VALUE` is read and which is then destroyed.
//! * One session per provider, behind a mutex (a PKCS#11 session is not thread-safe).
//! * The user PIN is a [`Pin`]: never printed, zeroized on drop. PKCS#11 login state belongs
//!   to the process: once one session on a token is logged in, a later `C_Login` reports
//!   "already logged in" without checking the PIN. A wrong PIN is therefore only detected by
//!   the first provider a process opens on a token.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use cryptoki::context::Pkcs11;
use cryptoki::error::{Error as P11Error, RvError};
use cryptoki::mechanism::Mechanism;
use cryptoki::object::{Attribute, AttributeType, KeyType, ObjectClass, ObjectHandle};
use cryptoki::session::{Session, UserType};
use sha2::{Digest as _, Sha256};
use zeroize::Zeroize as _;

use super::{KekDescription, KekError, KekKind, KekOutcome, KekProvider, check_kek_label};
use crate::secret::{DATA_KEY_LEN, DataKey, Pin};

/// KEKs held in a PKCS#11 token.
pub struct Pkcs11Kek {
    token: String,
    module: String,
    inner: Mutex<Inner>,
}

struct Inner {
    session: Session,
    /// KEK handles that passed the attribute checks, by label.
    checked: HashMap<String, ObjectHandle>,
}

impl std::fmt::Debug for Pkcs11Kek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pkcs11Kek")
            .field("token", &self.token)
            .field("module", &self.module)
            .finish_non_exhaustive()
    }
}

fn p11(operation: &'static str, token: &str) -> impl FnOnce(P11Error) -> KekError {
    let token = token.to_owned();
    move |e| KekError::Pkcs11 {
        operation,
        token,
        source: Box::new(e),
    }
}

impl Pkcs11Kek {
    /// Opens a read-write session on the token labelled `token` through the initialized
    /// context `pkcs11`, and logs the user in with `pin`.
    ///
    /// Distinct errors for a missing token ([`KekError::TokenNotFound`]), an empty PIN
    /// ([`KekError::PinMissing`]), a wrong PIN ([`KekError::WrongPin`]) and a locked one
    /// ([`KekError::PinLocked`]).
    pub fn open(pkcs11: &Pkcs11, token: &str, pin: &Pin) -> Result<Self, KekError> {
        let module = pkcs11
            .get_library_info()
            .map(|i| i.library_description().trim_end().to_owned())
            .unwrap_or_else(|_| "(unknown module)".to_owned());
        let slots = pkcs11
            .get_slots_with_token()
            .map_err(p11("slot listing", token))?;
        let mut found = None;
        for slot in slots {
            let info = pkcs11
                .get_token_info(slot)
                .map_err(p11("token info", token))?;
            if info.label().trim_end() == token {
                found = Some(slot);
                break;
            }
        }
        let slot = found.ok_or_else(|| KekError::TokenNotFound {
            token: token.to_owned(),
            module: module.clone(),
        })?;
        if pin.is_empty() {
            return Err(KekError::PinMissing {
                token: token.to_owned(),
            });
        }
        let session = pkcs11
            .open_rw_session(slot)
            .map_err(p11("open session", token))?;
        let auth = pin.auth_pin();
        match session.login(UserType::User, Some(&auth)) {
            Ok(()) | Err(P11Error::Pkcs11(RvError::UserAlreadyLoggedIn, _)) => {}
            Err(P11Error::Pkcs11(RvError::PinIncorrect | RvError::PinLenRange, _)) => {
                return Err(KekError::WrongPin {
                    token: token.to_owned(),
                });
            }
            Err(P11Error::Pkcs11(RvError::PinLocked, _)) => {
                return Err(KekError::PinLocked {
                    token: token.to_owned(),
                });
            }
            Err(e) => return Err(p11("login", token)(e)),
        }
        Ok(Self {
            token: token.to_owned(),
            module,
            inner: Mutex::new(Inner {
                session,
                checked: HashMap::new(),
            }),
        })
    }

    /// The token label.
    pub fn token_label(&self) -> &str {
        &self.token
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn not_found(&self, label: &str) -> KekError {
        KekError::KekNotFound {
            label: label.to_owned(),
            provider: self.describe().summary,
        }
    }

    /// All secret keys on the token labelled `label`.
    fn find_all(&self, inner: &Inner, label: &str) -> Result<Vec<ObjectHandle>, KekError> {
        inner
            .session
            .find_objects(&[
                Attribute::Class(ObjectClass::SECRET_KEY),
                Attribute::Label(label.as_bytes().to_vec()),
            ])
            .map_err(p11("object search", &self.token))
    }

    /// The checked KEK labelled `label`: found once, attribute-checked, then remembered.
    fn kek(&self, inner: &mut Inner, label: &str) -> Result<ObjectHandle, KekError> {
        check_kek_label(label)?;
        if let Some(handle) = inner.checked.get(label) {
            return Ok(*handle);
        }
        let found = self.find_all(inner, label)?;
        let handle = match found.as_slice() {
            [] => return Err(self.not_found(label)),
            [one] => *one,
            many => {
                return Err(KekError::KekAmbiguous {
                    label: label.to_owned(),
                    token: self.token.clone(),
                    count: many.len(),
                });
            }
        };
        let attrs = inner
            .session
            .get_attributes(
                handle,
                &[
                    AttributeType::KeyType,
                    AttributeType::ValueLen,
                    AttributeType::Sensitive,
                    AttributeType::Extractable,
                    AttributeType::Local,
                    AttributeType::AlwaysSensitive,
                    AttributeType::NeverExtractable,
                    AttributeType::Wrap,
                    AttributeType::Unwrap,
                ],
            )
            .map_err(p11("KEK attribute read", &self.token))?;
        check_kek_attributes(label, &self.token, &attrs)?;
        inner.checked.insert(label.to_owned(), handle);
        Ok(handle)
    }
}

/// What the attributes of a KEK found on a token must say (see the module docs).
fn check_kek_attributes(label: &str, token: &str, attrs: &[Attribute]) -> Result<(), KekError> {
    let flag = |want: AttributeType| {
        attrs.iter().find_map(|a| match (a, want) {
            (Attribute::Sensitive(v), AttributeType::Sensitive)
            | (Attribute::Extractable(v), AttributeType::Extractable)
            | (Attribute::Local(v), AttributeType::Local)
            | (Attribute::AlwaysSensitive(v), AttributeType::AlwaysSensitive)
            | (Attribute::NeverExtractable(v), AttributeType::NeverExtractable)
            | (Attribute::Wrap(v), AttributeType::Wrap)
            | (Attribute::Unwrap(v), AttributeType::Unwrap) => Some(*v),
            _ => None,
        })
    };
    let show = |v: Option<bool>| match v {
        Some(true) => "true".to_owned(),
        Some(false) => "false".to_owned(),
        None => "absent".to_owned(),
    };
    let refuse = |attribute: &'static str, found: String, required: &'static str| {
        Err(KekError::KekAttribute {
            label: label.to_owned(),
            token: token.to_owned(),
            attribute,
            found,
            required,
        })
    };
    let key_type = attrs.iter().find_map(|a| match a {
        Attribute::KeyType(t) => Some(*t),
        _ => None,
    });
    if key_type != Some(KeyType::AES) {
        let found = key_type.map_or_else(|| "absent".to_owned(), |t| t.to_string());
        return refuse("CKA_KEY_TYPE", found, "it must be CKK_AES");
    }
    let len = attrs.iter().find_map(|a| match a {
        Attribute::ValueLen(n) => Some(u64::from(*n)),
        _ => None,
    });
    if len != Some(DATA_KEY_LEN as u64) {
        let found = len.map_or_else(|| "absent".to_owned(), |n| n.to_string());
        return refuse("CKA_VALUE_LEN", found, "it must be 32 (AES-256)");
    }
    let sensitive = flag(AttributeType::Sensitive);
    if sensitive != Some(true) {
        return refuse("CKA_SENSITIVE", show(sensitive), "it must be true");
    }
    let extractable = flag(AttributeType::Extractable);
    if extractable != Some(false) {
        return refuse(
            "CKA_EXTRACTABLE",
            show(extractable),
            "it must be false (the KEK must never leave the token)",
        );
    }
    let local = flag(AttributeType::Local);
    let always = flag(AttributeType::AlwaysSensitive);
    let never = flag(AttributeType::NeverExtractable);
    if local != Some(true) && !(always == Some(true) && never == Some(true)) {
        return refuse(
            "CKA_LOCAL",
            format!(
                "{} (CKA_ALWAYS_SENSITIVE {}, CKA_NEVER_EXTRACTABLE {})",
                show(local),
                show(always),
                show(never)
            ),
            "it must be true (generated in the token), or CKA_ALWAYS_SENSITIVE and \
             CKA_NEVER_EXTRACTABLE must both be true: an imported key may have copies elsewhere",
        );
    }
    for (attribute, ty) in [
        ("CKA_WRAP", AttributeType::Wrap),
        ("CKA_UNWRAP", AttributeType::Unwrap),
    ] {
        let v = flag(ty);
        if v != Some(true) {
            return refuse(attribute, show(v), "it must be true");
        }
    }
    Ok(())
}

/// Whether a PKCS#11 error means "these wrapped bytes are not a key wrapped under this KEK".
fn is_rejection(e: &P11Error) -> bool {
    matches!(
        e,
        P11Error::Pkcs11(
            RvError::WrappedKeyInvalid
                | RvError::WrappedKeyLenRange
                | RvError::EncryptedDataInvalid
                | RvError::EncryptedDataLenRange
                | RvError::DataInvalid
                | RvError::DataLenRange
                | RvError::GeneralError,
            _
        )
    )
}

impl KekProvider for Pkcs11Kek {
    fn describe(&self) -> KekDescription {
        KekDescription {
            kind: KekKind::Hsm,
            summary: format!("PKCS#11 token {:?} ({})", self.token, self.module),
        }
    }

    fn generate_kek(&self, label: &str) -> Result<(), KekError> {
        check_kek_label(label)?;
        let mut inner = self.lock();
        if !self.find_all(&inner, label)?.is_empty() {
            return Err(KekError::KekExists {
                label: label.to_owned(),
                provider: self.describe().summary,
            });
        }
        let id = Sha256::digest(label.as_bytes())
            .get(..8)
            .unwrap_or_default()
            .to_vec();
        let template = [
            Attribute::Class(ObjectClass::SECRET_KEY),
            Attribute::KeyType(KeyType::AES),
            Attribute::ValueLen((DATA_KEY_LEN as u64).into()),
            Attribute::Token(true),
            Attribute::Private(true),
            Attribute::Sensitive(true),
            Attribute::Extractable(false),
            Attribute::Wrap(true),
            Attribute::Unwrap(true),
            Attribute::Encrypt(false),
            Attribute::Decrypt(false),
            Attribute::Sign(false),
            Attribute::Verify(false),
            Attribute::Derive(false),
            Attribute::Label(label.as_bytes().to_vec()),
            Attribute::Id(id),
        ];
        inner
            .session
            .generate_key(&Mechanism::AesKeyGen, &template)
            .map_err(p11("KEK generation", &self.token))?;
        // Check what the token made, as for a found key: a token that ignored the template
        // must not be trusted with data keys.
        inner.checked.remove(label);
        self.kek(&mut inner, label)?;
        Ok(())
    }

    fn ensure_kek(&self, label: &str) -> Result<KekOutcome, KekError> {
        let found = {
            let mut inner = self.lock();
            self.kek(&mut inner, label)
        };
        match found {
            Ok(_) => Ok(KekOutcome::Existing),
            Err(KekError::KekNotFound { .. }) => {
                self.generate_kek(label)?;
                Ok(KekOutcome::Created)
            }
            Err(e) => Err(e),
        }
    }

    fn kek_exists(&self, label: &str) -> Result<bool, KekError> {
        check_kek_label(label)?;
        let inner = self.lock();
        Ok(!self.find_all(&inner, label)?.is_empty())
    }

    fn wrap(&self, label: &str, key: &DataKey) -> Result<Vec<u8>, KekError> {
        let mut inner = self.lock();
        let kek = self.kek(&mut inner, label)?;
        let mut template = [
            Attribute::Class(ObjectClass::SECRET_KEY),
            Attribute::KeyType(KeyType::AES),
            Attribute::Token(false),
            Attribute::Private(true),
            Attribute::Sensitive(false),
            Attribute::Extractable(true),
            Attribute::Value(key.expose().to_vec()),
        ];
        let created = inner.session.create_object(&template);
        for attr in &mut template {
            if let Attribute::Value(v) = attr {
                v.zeroize();
            }
        }
        let object = created.map_err(p11("data key import (session object)", &self.token))?;
        let wrapped = inner
            .session
            .wrap_key(&Mechanism::AesKeyWrapPad, kek, object);
        let destroyed = inner.session.destroy_object(object);
        let wrapped = wrapped.map_err(p11("C_WrapKey", &self.token))?;
        destroyed.map_err(p11("session object destruction", &self.token))?;
        Ok(wrapped)
    }

    fn unwrap(&self, label: &str, wrapped: &[u8]) -> Result<DataKey, KekError> {
        let mut inner = self.lock();
        let kek = self.kek(&mut inner, label)?;
        let template = [
            Attribute::Class(ObjectClass::SECRET_KEY),
            Attribute::KeyType(KeyType::AES),
            Attribute::Token(false),
            Attribute::Private(true),
            Attribute::Sensitive(false),
            Attribute::Extractable(true),
        ];
        let rejected = || KekError::UnwrapRejected {
            label: label.to_owned(),
            provider: self.describe().summary,
            len: wrapped.len(),
        };
        let object =
            match inner
                .session
                .unwrap_key(&Mechanism::AesKeyWrapPad, kek, wrapped, &template)
            {
                Ok(o) => o,
                Err(e) if is_rejection(&e) => return Err(rejected()),
                Err(e) => return Err(p11("C_UnwrapKey", &self.token)(e)),
            };
        let attrs = inner
            .session
            .get_attributes(object, &[AttributeType::Value]);
        let destroyed = inner.session.destroy_object(object);
        let mut attrs = attrs.map_err(p11("unwrapped key read", &self.token))?;
        destroyed.map_err(p11("session object destruction", &self.token))?;
        let mut key = None;
        for attr in &mut attrs {
            if let Attribute::Value(v) = attr {
                key = DataKey::from_slice(v);
                v.zeroize();
            }
        }
        key.ok_or_else(rejected)
    }

    fn destroy_kek(&self, label: &str) -> Result<(), KekError> {
        check_kek_label(label)?;
        let mut inner = self.lock();
        let found = self.find_all(&inner, label)?;
        if found.is_empty() {
            return Err(self.not_found(label));
        }
        for handle in found {
            inner
                .session
                .destroy_object(handle)
                .map_err(p11("C_DestroyObject", &self.token))?;
        }
        inner.checked.remove(label);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> Vec<Attribute> {
        vec![
            Attribute::KeyType(KeyType::AES),
            Attribute::ValueLen(32u64.into()),
            Attribute::Sensitive(true),
            Attribute::Extractable(false),
            Attribute::Local(true),
            Attribute::AlwaysSensitive(true),
            Attribute::NeverExtractable(true),
            Attribute::Wrap(true),
            Attribute::Unwrap(true),
        ]
    }

    fn refused(attrs: &[Attribute]) -> &'static str {
        match check_kek_attributes("k", "t", attrs) {
            Err(KekError::KekAttribute { attribute, .. }) => attribute,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn kek_attribute_checks_name_the_attribute() {
        check_kek_attributes("k", "t", &good()).unwrap();
        let with = |i: usize, a: Attribute| {
            let mut v = good();
            v[i] = a;
            v
        };
        assert_eq!(
            refused(&with(0, Attribute::KeyType(KeyType::DES3))),
            "CKA_KEY_TYPE"
        );
        assert_eq!(
            refused(&with(1, Attribute::ValueLen(16u64.into()))),
            "CKA_VALUE_LEN"
        );
        assert_eq!(
            refused(&with(2, Attribute::Sensitive(false))),
            "CKA_SENSITIVE"
        );
        assert_eq!(
            refused(&with(3, Attribute::Extractable(true))),
            "CKA_EXTRACTABLE"
        );
        // Not local, but always sensitive and never extractable: accepted.
        check_kek_attributes("k", "t", &with(4, Attribute::Local(false))).unwrap();
        // Imported: not local, not always sensitive.
        let mut imported = with(4, Attribute::Local(false));
        imported[5] = Attribute::AlwaysSensitive(false);
        assert_eq!(refused(&imported), "CKA_LOCAL");
        assert_eq!(refused(&with(8, Attribute::Unwrap(false))), "CKA_UNWRAP");
        // An attribute the token did not return counts as failing.
        let mut missing = good();
        missing.remove(3);
        let err = check_kek_attributes("k", "t", &missing).unwrap_err();
        assert!(
            err.to_string().contains("CKA_EXTRACTABLE is absent"),
            "{err}"
        );
    }
}
