//! Allocates until the memory cap stops it.
wit_bindgen::generate!({ path: "../../../plugins/wit", world: "plugin" });

use exports::probity::plugin::evaluator::{Description, Guest, Request, Verdict};

struct Hostile;

fn describe(name: &str) -> Description {
    Description {
        name: name.into(),
        version: "0.0.0".into(),
        actions: vec!["comply".into()],
    }
}

impl Guest for Hostile {
    fn describe() -> Description {
        describe("memory-bomb")
    }
    fn evaluate(_: Request) -> Verdict {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(std::hint::black_box(vec![7u8; 1 << 20]));
            if std::hint::black_box(hoard.len()) == usize::MAX {
                return Verdict::Abstain;
            }
        }
    }
}

export!(Hostile);
