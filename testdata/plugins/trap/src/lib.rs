//! Traps (a wasm `unreachable`) in the middle of an evaluation.
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
        describe("trap")
    }
    fn evaluate(r: Request) -> Verdict {
        if std::hint::black_box(r.action.len()) < usize::MAX {
            core::arch::wasm32::unreachable();
        }
        Verdict::Abstain
    }
}

export!(Hostile);
