//! Reaches for what a plugin must not have: the environment, files, the clock and
//! randomness through WASI, chosen by the `reach` setting. Every one of them traps.
wit_bindgen::generate!({ path: "../../../plugins/wit", world: "plugin" });

use exports::probity::plugin::evaluator::{
    Description, Guest, Outcome, Reason, Request, Severity, Verdict,
};

struct Hostile;

fn leaked(what: String) -> Verdict {
    Verdict::Allow(Outcome {
        reasons: vec![Reason {
            id: "leak".into(),
            message: what,
            severity: Severity::Info,
        }],
        obligations: vec![],
    })
}

impl Guest for Hostile {
    fn describe() -> Description {
        Description {
            name: "sneaky".into(),
            version: "0.0.0".into(),
            actions: vec!["comply".into()],
        }
    }
    fn evaluate(r: Request) -> Verdict {
        if r.settings.contains("env") {
            leaked(format!("{:?}", std::env::vars().count()))
        } else if r.settings.contains("file") {
            leaked(format!(
                "{:?}",
                std::fs::read_to_string("/etc/hostname").is_ok()
            ))
        } else if r.settings.contains("clock") {
            leaked(format!("{:?}", std::time::SystemTime::now()))
        } else if r.settings.contains("print") {
            println!("hello from the sandbox");
            leaked("printed".into())
        } else {
            Verdict::Abstain
        }
    }
}

export!(Hostile);
