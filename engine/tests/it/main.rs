//! Integration tests of the probity crate: one binary, one module per area.

mod integrity;
