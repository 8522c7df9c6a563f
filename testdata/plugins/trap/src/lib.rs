//! Traps (a wasm `unreachable`) in the middle of an evaluation.
use probity_plugin_sdk::{Description, Host, Plugin, Request, Verdict, export_plugin};

struct Hostile;

impl Plugin for Hostile {
    fn describe() -> Description {
        Description::new("trap", "0.0.0", ["comply"])
    }
    fn evaluate(r: &Request, _: &dyn Host) -> Verdict {
        if std::hint::black_box(r.action.len()) < usize::MAX {
            core::arch::wasm32::unreachable();
        }
        Verdict::Abstain
    }
}

export_plugin!(Hostile);
