//! The only place raw pointers from C become Rust values: byte ranges, strings and out
//! parameters, each checked for null (and alignment, and UTF-8) before use.
//!
//! Why this module exists: these conversions are the unsafe surface of the library.
//! Every function here states what it needs from the caller (the contract the header
//! documents for each argument); everything past this module is safe Rust.

use std::ffi::{CStr, c_char};

use crate::ProbityStatus;
use crate::buffers;
use crate::error::Failure;

fn null(what: &str) -> Failure {
    Failure::new(ProbityStatus::NullPointer, format!("{what} is NULL"))
}

/// The `len` bytes at `ptr`; `ptr` may be null when `len` is 0.
///
/// # Safety
///
/// Unless `len` is 0, `ptr` is null or points to `len` initialized bytes that stay valid
/// and unmodified until the returned slice is dropped (within the call).
pub(crate) unsafe fn bytes<'a>(
    ptr: *const u8,
    len: usize,
    what: &str,
) -> Result<&'a [u8], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(null(what));
    }
    if isize::try_from(len).is_err() {
        return Err(Failure::invalid(format!(
            "{what}: length {len} is too large"
        )));
    }
    // SAFETY: non-null, len fits isize, and the caller guarantees `len` readable bytes
    // that nothing writes while the call runs; u8 has no alignment requirement.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// The `len` writable bytes at `ptr`; `ptr` may be null when `len` is 0.
///
/// # Safety
///
/// Unless `len` is 0, `ptr` is null or points to `len` bytes the caller lets this call
/// write, which nothing else reads or writes until the returned slice is dropped.
/// Callers of this function only ever write into the slice, never read from it, so the
/// bytes' earlier content does not matter (memory that comes across the C boundary is
/// opaque to the compiler, hence initialized from Rust's point of view).
pub(crate) unsafe fn bytes_mut<'a>(
    ptr: *mut u8,
    len: usize,
    what: &str,
) -> Result<&'a mut [u8], Failure> {
    if len == 0 {
        return Ok(&mut []);
    }
    if ptr.is_null() {
        return Err(null(what));
    }
    if isize::try_from(len).is_err() {
        return Err(Failure::invalid(format!(
            "{what}: length {len} is too large"
        )));
    }
    // SAFETY: non-null, len fits isize, u8 needs no alignment, and the caller lets this
    // call alone write `len` bytes there until it returns.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr, len) })
}

/// The NUL-terminated UTF-8 string at `ptr`, or `None` for null.
///
/// # Safety
///
/// `ptr` is null or points to a NUL-terminated string that stays valid and unmodified
/// for the call.
pub(crate) unsafe fn optional_str<'a>(
    ptr: *const c_char,
    what: &str,
) -> Result<Option<&'a str>, Failure> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, and the caller guarantees a NUL-terminated string valid for the call.
    let c = unsafe { CStr::from_ptr(ptr) };
    c.to_str().map(Some).map_err(|e| {
        Failure::new(
            ProbityStatus::NotUtf8,
            format!("{what} is not UTF-8 (at byte {})", e.valid_up_to()),
        )
    })
}

/// The NUL-terminated UTF-8 string at `ptr`; null is refused.
///
/// # Safety
///
/// As [`optional_str`].
pub(crate) unsafe fn required_str<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Failure> {
    // SAFETY: the caller's guarantee is passed on unchanged.
    unsafe { optional_str(ptr, what) }?.ok_or_else(|| null(what))
}

/// Several string arguments at once: `(pointer, name, required)` each; a required one
/// that is NULL is refused, an optional one is `None`.
///
/// # Safety
///
/// As [`optional_str`] for each pointer.
pub(crate) unsafe fn strings<'a, const N: usize>(
    args: [(*const c_char, &str, bool); N],
) -> Result<[Option<&'a str>; N], Failure> {
    let mut out = [None; N];
    for (slot, (ptr, what, required)) in out.iter_mut().zip(args) {
        *slot = if required {
            // SAFETY: the caller's guarantee for each pointer is passed on.
            Some(unsafe { required_str(ptr, what) }?)
        } else {
            // SAFETY: as above.
            unsafe { optional_str(ptr, what) }?
        };
    }
    Ok(out)
}

/// An out parameter: a place the caller gave for one value.
pub(crate) struct Out<T>(*mut T);

impl<T: Copy> Out<T> {
    /// Checks `ptr` and stores `initial` there, so the caller sees a defined value
    /// whatever happens next.
    ///
    /// # Safety
    ///
    /// `ptr` is null or valid for writes of one `T` for the whole call, and nothing else
    /// accesses it meanwhile.
    pub unsafe fn new(ptr: *mut T, initial: T, what: &str) -> Result<Self, Failure> {
        if ptr.is_null() {
            return Err(null(what));
        }
        if !ptr.is_aligned() {
            return Err(Failure::invalid(format!("{what} is not aligned")));
        }
        let mut out = Self(ptr);
        out.set(initial);
        Ok(out)
    }

    /// Stores `value`.
    pub fn set(&mut self, value: T) {
        // SAFETY: `new` checked the pointer for null and alignment, and its caller
        // guaranteed it writable for the call; `T: Copy` has no drop to skip.
        unsafe { self.0.write(value) }
    }
}

/// Where a returned buffer goes: its address and its length.
pub(crate) struct OutBuffer {
    data: Out<*mut u8>,
    len: Out<usize>,
}

impl OutBuffer {
    /// Checks both places and sets them to NULL and 0.
    ///
    /// # Safety
    ///
    /// As [`Out::new`] for each pointer.
    pub unsafe fn new(data: *mut *mut u8, len: *mut usize, what: &str) -> Result<Self, Failure> {
        // SAFETY: the caller's guarantees are passed on.
        let data = unsafe { Out::new(data, std::ptr::null_mut(), what) }?;
        // SAFETY: as above.
        let len = unsafe { Out::new(len, 0, &format!("the length of {what}")) }?;
        Ok(Self { data, len })
    }

    /// Hands `bytes` to the caller (to be freed with `probity_free`).
    pub fn put(&mut self, bytes: Vec<u8>) {
        let (ptr, len) = buffers::hand_out(bytes);
        self.data.set(ptr);
        self.len.set(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_and_non_utf8_strings_are_refused_by_name() {
        // SAFETY: null is allowed by the contract.
        let e = unsafe { required_str(std::ptr::null(), "the path") }.unwrap_err();
        assert_eq!(e.status, ProbityStatus::NullPointer);
        assert_eq!(e.message, "the path is NULL");
        let bad = b"ab\xffc\0";
        // SAFETY: a NUL-terminated array that outlives the call.
        let e = unsafe { required_str(bad.as_ptr().cast(), "the node") }.unwrap_err();
        assert_eq!(e.status, ProbityStatus::NotUtf8);
        assert_eq!(e.message, "the node is not UTF-8 (at byte 2)");
    }

    #[test]
    fn an_empty_range_may_be_null_and_a_nonempty_one_may_not() {
        // SAFETY: null with length 0 is allowed.
        let empty = unsafe { bytes(std::ptr::null(), 0, "x") };
        assert!(empty.unwrap().is_empty());
        // SAFETY: null is checked before use.
        let e = unsafe { bytes(std::ptr::null(), 3, "the request") }.unwrap_err();
        assert_eq!(e.status, ProbityStatus::NullPointer);
    }

    #[test]
    fn an_out_buffer_starts_null_and_is_registered_when_filled() {
        let mut data: *mut u8 = std::ptr::dangling_mut::<u8>();
        let mut len: usize = 99;
        // SAFETY: both locals outlive the OutBuffer.
        let mut out = unsafe { OutBuffer::new(&mut data, &mut len, "the answer") }.unwrap();
        assert!(data.is_null() && len == 0);
        out.put(b"[]".to_vec());
        assert_eq!(len, 2);
        crate::buffers::release(data).unwrap();
    }
}
