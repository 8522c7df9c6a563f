//! probity
pub mod integrity;
pub mod state;
