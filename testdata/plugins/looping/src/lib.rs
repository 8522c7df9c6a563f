//! Never returns: the epoch deadline must stop it. Written with the SDK, as a plugin
//! author would, so the SDK's own glue is under test too.
use probity_plugin_sdk::{Description, Host, Plugin, Request, Verdict, export_plugin};

struct Hostile;

impl Plugin for Hostile {
    fn describe() -> Description {
        Description::new("looping", "0.0.0", ["comply"])
    }
    fn evaluate(_: &Request, _: &dyn Host) -> Verdict {
        let mut n: u64 = 0;
        loop {
            n = std::hint::black_box(n.wrapping_add(1));
        }
    }
}

export_plugin!(Hostile);
