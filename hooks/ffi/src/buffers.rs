//! Buffers handed to the caller (JSON answers), and `probity_free`.
//!
//! Why this module exists: memory allocated by Rust must be freed by Rust, and a caller
//! that frees a buffer twice, or frees a pointer that never came from here, must get an
//! error rather than a corrupted heap. Every buffer handed out is registered by its
//! address; `probity_free` releases only registered ones.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::ProbityStatus;
use crate::error::Failure;

/// Buffers the caller holds, by address. Each ends with a NUL after its length, so a C
/// caller may also read it as a string.
static OUTSTANDING: Mutex<Option<HashMap<usize, Vec<u8>>>> = Mutex::new(None);

/// Registers `bytes` (plus a NUL) and returns its address and length (without the NUL).
pub(crate) fn hand_out(mut bytes: Vec<u8>) -> (*mut u8, usize) {
    let len = bytes.len();
    bytes.push(0);
    let ptr = bytes.as_mut_ptr();
    OUTSTANDING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(ptr as usize, bytes);
    (ptr, len)
}

/// Releases a buffer from [`hand_out`]. Null is a no-op.
pub(crate) fn release(ptr: *mut u8) -> Result<(), Failure> {
    if ptr.is_null() {
        return Ok(());
    }
    let freed = OUTSTANDING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_mut()
        .and_then(|m| m.remove(&(ptr as usize)));
    // Dropped outside the lock.
    match freed {
        Some(_) => Ok(()),
        None => Err(Failure::new(
            ProbityStatus::StaleHandle,
            format!("{ptr:p} is not a buffer from probity, or was already freed"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_freed_once_and_a_second_free_is_refused() {
        let (ptr, len) = hand_out(b"{}".to_vec());
        assert_eq!(len, 2);
        release(ptr).unwrap();
        let e = release(ptr).unwrap_err();
        assert_eq!(e.status, ProbityStatus::StaleHandle);
        assert!(e.message.contains("already freed"), "{}", e.message);
        release(std::ptr::null_mut()).unwrap();
    }

    #[test]
    fn a_foreign_pointer_is_refused() {
        let mut mine = [0u8; 4];
        assert!(release(mine.as_mut_ptr()).is_err());
    }
}
