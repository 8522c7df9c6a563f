//! Never returns: the epoch deadline must stop it.
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
        describe("looping")
    }
    fn evaluate(_: Request) -> Verdict {
        let mut n: u64 = 0;
        loop {
            n = std::hint::black_box(n.wrapping_add(1));
        }
    }
}

export!(Hostile);
