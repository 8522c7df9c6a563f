//! The saved audit log position: it parses and renders back to the same bytes, or it is
//! an error within the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use probity_agent::elevation::{PositionError, parse_position, render_position};

fuzz_target!(|data: &[u8]| {
    match parse_position(data) {
        Ok(p) => assert_eq!(parse_position(render_position(&p).as_bytes()), Ok(p)),
        Err(PositionError::Syntax { column, .. }) => assert!(column <= data.len() + 1),
        Err(_) => {}
    }
});
