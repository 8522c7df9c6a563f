//! What Slurm's commands and the sidecar answer, and the reasons written back: nodes
//! or an error naming a line, an answer or an error, a token of hex digits or none,
//! and a reason on one bounded line with Probity's prefix; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_slurm::{client, commands, nodes, reason};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    match which % 4 {
        0 => match nodes::parse_nodes(&text) {
            Ok(found) => {
                for node in found {
                    assert!(!node.name.is_empty() && !node.state.is_empty());
                }
            }
            Err(e) => assert!(e.line >= 1),
        },
        1 => {
            let _ = client::parse_answer(rest);
        }
        2 => {
            if let Some(token) = commands::submission_in(&text) {
                assert!(!token.is_empty() && token.len() <= 128);
                assert!(token.chars().all(|c| c.is_ascii_alphanumeric()));
            }
        }
        _ => {
            let line = reason::one_line(&text);
            assert!(line.starts_with(reason::PREFIX) || line.len() <= reason::MAX_REASON);
            assert!(line.len() <= reason::MAX_REASON);
            assert!(!line.chars().any(char::is_control));
        }
    }
});
