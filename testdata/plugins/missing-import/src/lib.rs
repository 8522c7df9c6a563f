//! Imports a network interface the host does not provide: loading must fail to link.
wit_bindgen::generate!({ path: ["../../../plugins/wit", "wit"], world: "probity:evil/evil", generate_all });

use exports::probity::plugin::evaluator::{Description, Guest, Request, Verdict};

struct Hostile;

impl Guest for Hostile {
    fn describe() -> Description {
        Description {
            name: "missing-import".into(),
            version: "0.0.0".into(),
            actions: vec!["comply".into()],
        }
    }
    fn evaluate(_: Request) -> Verdict {
        if probity::evil::net::connect("203.0.113.1:443") {
            Verdict::Abstain
        } else {
            Verdict::Abstain
        }
    }
}

export!(Hostile);
