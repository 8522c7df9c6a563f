use super::*;
use crate::integrity::SoftwareAnchor;
use crate::integrity::hex;

fn seal(anchor: &SoftwareAnchor) -> PolicySeal {
    PolicySeal::sign(
        "prod",
        7,
        vec![
            SealedFile {
                path: "security/blocklist.cedar".into(),
                sha256: sha256(b"b"),
            },
            SealedFile {
                path: "probity.toml".into(),
                sha256: sha256(b"t"),
            },
        ],
        anchor,
    )
    .unwrap()
}

#[test]
fn encode_decode_roundtrip_and_signature() {
    let dir = tempfile::tempdir().unwrap();
    let anchor = SoftwareAnchor::generate(&dir.path().join("k")).unwrap();
    let s = seal(&anchor);
    let text = s.encode();
    assert!(text.starts_with("probity-policy-seal 1\nname prod\nversion 7\nfile "));
    // Sorted by path.
    assert!(text.find("probity.toml").unwrap() < text.find("security/").unwrap());
    let back = PolicySeal::decode(text.as_bytes()).unwrap();
    assert_eq!(back, s);
    back.check_signature(&Verifier::new(anchor.public_key().clone()))
        .unwrap();
    let spans = s.spans();
    assert_eq!(
        text.get(spans.version.0..spans.version.0 + spans.version.1),
        Some("version 7")
    );
    let (o, l) = spans.files[1];
    assert!(
        text.get(o..o + l)
            .unwrap()
            .ends_with(" security/blocklist.cedar")
    );
    let (o, l) = spans.signature;
    assert!(text.get(o..o + l).unwrap().starts_with("signature "));
    assert_eq!(o + l + 1, text.len());
}

#[test]
fn non_canonical_spellings_are_refused_with_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let anchor = SoftwareAnchor::generate(&dir.path().join("k")).unwrap();
    let text = seal(&anchor).encode();
    let cases: Vec<(String, usize)> = vec![
        (text.replace("version 7", "version 07"), 3),
        (text.replace("version 7", "version +7"), 3),
        (text.replace("name prod", "name pr od"), 2),
        (text.replace("\n", "\r\n"), 1),
        (text.replacen("file ", "file  ", 1), 4),
        (text.replace("probity.toml", "./probity.toml"), 4),
        (text.replace("probity.toml", "/probity.toml"), 4),
        (text.replace("probity.toml", "zz.toml"), 5),
        (format!("{text}extra\n"), 8),
        (text.trim_end().to_owned(), 0),
        (
            text.replacen("probity-policy-seal 1", "probity-policy-seal 2", 1),
            1,
        ),
    ];
    for (bad, line) in cases {
        let e = PolicySeal::decode(bad.as_bytes()).unwrap_err();
        assert_eq!(e.line, line, "{bad:?}: {e}");
    }
    let upper = text.replace(&hex(&sha256(b"t")), &hex(&sha256(b"t")).to_uppercase());
    assert!(PolicySeal::decode(upper.as_bytes()).is_err());
    let big = vec![b'a'; MAX_SEAL_BYTES + 1];
    assert!(matches!(
        PolicySeal::decode(&big).unwrap_err().problem,
        SealProblem::TooLarge { .. }
    ));
}

/// Truncations, byte flips and duplicated lines of a real seal: never a panic, and
/// either a seal whose re-encoding is the input or a located error.
#[test]
fn mutated_seals_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let anchor = SoftwareAnchor::generate(&dir.path().join("k")).unwrap();
    let good = seal(&anchor).encode().into_bytes();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..5000 {
        let mut b = good.clone();
        match next() % 4 {
            0 => b.truncate((next() as usize) % (good.len() + 1)),
            1 => {
                let i = (next() as usize) % b.len();
                b[i] ^= 1 << (next() % 8);
            }
            2 => {
                let lines: Vec<&[u8]> = good.split_inclusive(|&c| c == b'\n').collect();
                let i = (next() as usize) % lines.len();
                let mut v = Vec::new();
                for (j, l) in lines.iter().enumerate() {
                    v.extend_from_slice(l);
                    if j == i {
                        v.extend_from_slice(l);
                    }
                }
                b = v;
            }
            _ => {
                let i = (next() as usize) % b.len();
                b.insert(i, (next() % 256) as u8);
            }
        }
        match PolicySeal::decode(&b) {
            Ok(s) => assert_eq!(s.encode().as_bytes(), b.as_slice()),
            Err(e) => assert!(e.offset <= b.len(), "{e}"),
        }
    }
}

#[test]
fn relative_names_stay_under_the_directory() {
    let d = Path::new("/p");
    assert_eq!(
        relative_name(d, Path::new("/p/a/./b.cedar")).as_deref(),
        Some("a/b.cedar")
    );
    assert_eq!(
        relative_name(d, Path::new("/p/a/../b.wasm")).as_deref(),
        Some("b.wasm")
    );
    assert_eq!(relative_name(d, Path::new("/p/../q/x")), None);
    assert_eq!(relative_name(d, Path::new("/q/x")), None);
    assert_eq!(relative_name(d, Path::new("/p")), None);
}
