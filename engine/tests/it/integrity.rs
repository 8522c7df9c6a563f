//! Integrity integration tests.
