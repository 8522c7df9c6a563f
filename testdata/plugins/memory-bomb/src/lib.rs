//! Allocates until the memory cap stops it (through the SDK's call arena, as an SDK
//! plugin would).
use probity_plugin_sdk::{Description, Host, Plugin, Request, Verdict, export_plugin};

struct Hostile;

impl Plugin for Hostile {
    fn describe() -> Description {
        Description::new("memory-bomb", "0.0.0", ["comply"])
    }
    fn evaluate(_: &Request, _: &dyn Host) -> Verdict {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(std::hint::black_box(vec![7u8; 1 << 20]));
            if std::hint::black_box(hoard.len()) == usize::MAX {
                return Verdict::Abstain;
            }
        }
    }
}

export_plugin!(Hostile);
