//! Returns a verdict the contract's types allow but the engine must refuse: an empty
//! reason id and an obligation kind nobody knows.
wit_bindgen::generate!({ path: "../../../plugins/wit", world: "plugin" });

use exports::probity::plugin::evaluator::{Description, Guest, Outcome, Request, Verdict};

struct Hostile;

fn describe(name: &str) -> Description {
    Description {
        name: name.into(),
        version: "0.0.0".into(),
        actions: vec!["comply".into()],
    }
}

use exports::probity::plugin::evaluator::{Obligation, Reason, Severity};

impl Guest for Hostile {
    fn describe() -> Description {
        describe("malformed")
    }
    fn evaluate(_: Request) -> Verdict {
        Verdict::Allow(Outcome {
            reasons: vec![Reason {
                id: String::new(),
                message: "trust me".into(),
                severity: Severity::Info,
            }],
            obligations: vec![Obligation {
                kind: "launch_missiles".into(),
                target: None,
                parameters: vec![],
            }],
        })
    }
}

export!(Hostile);
