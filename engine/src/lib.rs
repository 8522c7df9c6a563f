//! probity
