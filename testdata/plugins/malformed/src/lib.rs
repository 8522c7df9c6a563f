//! Returns a verdict the contract's types allow but the engine must refuse: an empty
//! reason id and an obligation kind nobody knows.
use probity_plugin_sdk::{
    Description, Host, Obligation, Plugin, Reason, Request, Severity, Verdict, export_plugin,
};

struct Hostile;

impl Plugin for Hostile {
    fn describe() -> Description {
        Description::new("malformed", "0.0.0", ["comply"])
    }
    fn evaluate(_: &Request, _: &dyn Host) -> Verdict {
        Verdict::allow()
            .with_reason(Reason::new("", "trust me", Severity::Info))
            .with_obligation(Obligation::new("launch_missiles"))
    }
}

export_plugin!(Hostile);
