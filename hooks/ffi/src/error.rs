//! Failures at the boundary: a status code for the caller's `switch`, a message for its
//! log, and the guard that keeps every panic on this side.
//!
//! Why this module exists: a C caller gets one integer back from each call. What went
//! wrong in words (naming the file, the field, the chunk) waits in a thread-local slot,
//! read with `probity_last_error()`, because a message cannot travel through the
//! return value and must not need freeing.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::ProbityStatus;

/// A failed call: its status and what to tell the caller.
#[derive(Debug)]
pub(crate) struct Failure {
    pub status: ProbityStatus,
    pub message: String,
}

impl Failure {
    pub fn new(status: ProbityStatus, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ProbityStatus::InvalidArgument, message)
    }

    /// `error` with its chain of causes, `: `-separated (messages here never repeat
    /// their cause, so the whole chain is what a person needs).
    pub fn chain(status: ProbityStatus, error: &dyn std::error::Error) -> Self {
        Self::new(status, chain(error))
    }
}

/// `error` and its sources as one line.
pub(crate) fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        // Transparent wrappers repeat their source's text; say it once.
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

thread_local! {
    /// The message of the last failed call on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Keeps `message` as this thread's last error.
pub(crate) fn set_last_error(message: &str) {
    // A C string ends at the first NUL: replace any inside the message.
    let bytes: Vec<u8> = message
        .bytes()
        .map(|b| if b == 0 { b'?' } else { b })
        .collect();
    let text = CString::new(bytes).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = text);
}

/// This thread's last error, valid until the next failing call on this thread.
pub(crate) fn last_error() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}

/// Runs one entry point: its failure becomes a status and this thread's last error,
/// and a panic becomes [`ProbityStatus::Internal`] instead of crossing into C.
pub(crate) fn entry(body: impl FnOnce() -> Result<(), Failure>) -> ProbityStatus {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => ProbityStatus::Ok,
        Ok(Err(failure)) => {
            set_last_error(&failure.message);
            failure.status
        }
        Err(payload) => {
            set_last_error(&format!(
                "internal error (a panic in probity, please report it): {}",
                panic_message(payload.as_ref())
            ));
            ProbityStatus::Internal
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "no message"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: last_error points into this thread's slot, unchanged until the next failure.
        unsafe { CStr::from_ptr(last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let status = entry(|| panic!("boom at chunk 3"));
        assert_eq!(status, ProbityStatus::Internal);
        assert!(last().contains("boom at chunk 3"), "{}", last());
    }

    #[test]
    fn a_failure_sets_the_message_and_success_keeps_it() {
        assert_eq!(
            entry(|| Err(Failure::invalid("bad flags 0x8"))),
            ProbityStatus::InvalidArgument
        );
        assert_eq!(entry(|| Ok(())), ProbityStatus::Ok);
        assert_eq!(last(), "bad flags 0x8");
    }

    #[test]
    fn a_nul_inside_a_message_does_not_cut_it() {
        set_last_error("a\0b");
        assert_eq!(last(), "a?b");
    }

    #[test]
    fn the_last_error_is_per_thread() {
        set_last_error("main");
        std::thread::spawn(|| {
            assert_eq!(last(), "");
            set_last_error("other");
        })
        .join()
        .unwrap();
        assert_eq!(last(), "main");
    }

    #[test]
    fn a_chain_names_each_cause_once() {
        let io = std::io::Error::other("disk gone");
        let wrapped = std::io::Error::other(io);
        assert_eq!(chain(&wrapped), "disk gone");
    }
}
