//! The call arena: the guest's default allocator, a bump allocator that never frees.
//!
//! Probity gives every plugin call a fresh instance and throws its memory away
//! afterwards, so the general-purpose allocator's bookkeeping (free lists, coalescing,
//! the frees themselves) is work with no use: freeing is done by the host, all at
//! once. The arena hands out memory by bumping a pointer through chunks taken from
//! the system allocator. A free of the most recent allocation gives it back (so
//! stack-like temporaries are reused) and a reallocation of it grows in place;
//! anything else is reclaimed when the call ends.
//!
//! The price: a plugin that allocates and frees in a long loop grows its memory
//! where the system allocator would reuse it, up to the manifest's `memory_mib`
//! limit, where the call fails closed ("memory limit"). Such a plugin opts out with
//! `export_plugin!(MyPlugin, allocator = system)`.
//!
//! The bump arithmetic is plain safe code, tested natively; only the `GlobalAlloc`
//! glue, compiled for wasm32 alone (a single-threaded target), touches raw pointers.

// The arithmetic is used by the wasm32 glue alone, and tested everywhere.
#![cfg_attr(
    not(all(target_arch = "wasm32", not(target_feature = "atomics"))),
    allow(dead_code)
)]

/// Where an allocation of `size` bytes aligned to `align` (a power of two) starts in
/// a chunk whose free space is `next..end`, and where the free space then starts.
/// `None` when it does not fit.
pub(crate) fn bump(next: usize, end: usize, size: usize, align: usize) -> Option<(usize, usize)> {
    let start = next.checked_add(align.checked_sub(1)?)? & !(align - 1);
    let after = start.checked_add(size)?;
    (after <= end).then_some((start, after))
}

/// Smallest chunk taken from the system allocator.
pub(crate) const CHUNK_BYTES: usize = 16 * 1024;

/// The size of the chunk to take for an allocation that did not fit.
pub(crate) fn chunk_for(size: usize, align: usize) -> usize {
    size.saturating_add(align).max(CHUNK_BYTES)
}

// Single-threaded wasm only: the glue's loads and stores are not atomic as pairs, so
// a wasm build with threads (`+atomics`) keeps the system allocator.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
pub use glue::CallArena;

#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
#[allow(
    unsafe_code,
    reason = "a global allocator is an unsafe trait implementation over raw pointers"
)]
mod glue {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    use super::{bump, chunk_for};

    /// The call arena (see the module docs). `export_plugin!` installs it as the
    /// global allocator of a plugin's wasm build.
    pub struct CallArena {
        /// Start of the free space in the current chunk (0: no chunk yet).
        next: AtomicUsize,
        /// End of the current chunk.
        end: AtomicUsize,
        /// Start of the most recent allocation, which may be freed or grown in place.
        last: AtomicUsize,
    }

    impl CallArena {
        /// An arena with no chunk yet.
        pub const fn new() -> Self {
            Self {
                next: AtomicUsize::new(0),
                end: AtomicUsize::new(0),
                last: AtomicUsize::new(0),
            }
        }
    }

    impl Default for CallArena {
        fn default() -> Self {
            Self::new()
        }
    }

    // SAFETY: this is compiled only for wasm32 without threads (no `atomics` target
    // feature; wasm32-wasip2 has none), so the loads and stores below never race
    // (the atomics are there to make the static `Sync` without unsafe, not for
    // ordering). Every pointer returned lies inside a chunk obtained from `System`
    // with room for `layout.size()` bytes at `layout.align()`, and chunks are never
    // returned, so no two live allocations overlap and none dangles.
    unsafe impl GlobalAlloc for CallArena {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let (size, align) = (layout.size(), layout.align());
            let (next, end) = (self.next.load(Relaxed), self.end.load(Relaxed));
            let placed = if next == 0 {
                None
            } else {
                bump(next, end, size, align)
            };
            let (start, after) = match placed {
                Some(p) => p,
                None => {
                    let chunk = chunk_for(size, align);
                    let Ok(chunk_layout) = Layout::from_size_align(chunk, align.max(16)) else {
                        return std::ptr::null_mut();
                    };
                    // SAFETY: `chunk_layout` has a non-zero size.
                    let base = unsafe { System.alloc(chunk_layout) } as usize;
                    if base == 0 {
                        return std::ptr::null_mut();
                    }
                    let Some(p) = bump(base, base + chunk, size, align) else {
                        return std::ptr::null_mut();
                    };
                    self.end.store(base + chunk, Relaxed);
                    p
                }
            };
            self.next.store(after, Relaxed);
            self.last.store(start, Relaxed);
            start as *mut u8
        }

        unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
            // Only the most recent allocation can be given back; the rest waits for
            // the end of the call.
            if ptr as usize == self.last.load(Relaxed) {
                self.next.store(ptr as usize, Relaxed);
                self.last.store(0, Relaxed);
            }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            let start = ptr as usize;
            if start == self.last.load(Relaxed)
                && let Some(after) = start.checked_add(new_size)
                && after <= self.end.load(Relaxed)
            {
                self.next.store(after, Relaxed);
                return ptr;
            }
            let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
                return std::ptr::null_mut();
            };
            // SAFETY: the caller guarantees a non-zero `new_size` valid for `layout`'s
            // alignment.
            let fresh = unsafe { self.alloc(new_layout) };
            if !fresh.is_null() {
                // SAFETY: `ptr` holds `layout.size()` readable bytes; `fresh` is a new
                // allocation of at least `new_size` bytes and cannot overlap `ptr`.
                unsafe {
                    std::ptr::copy_nonoverlapping(ptr, fresh, layout.size().min(new_size));
                }
            }
            fresh
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_and_do_not_overlap() {
        let (a, next) = bump(1001, 2000, 10, 8).unwrap();
        assert_eq!(a, 1008);
        assert_eq!(next, 1018);
        let (b, next) = bump(next, 2000, 4, 4).unwrap();
        assert_eq!(b, 1020);
        assert_eq!(next, 1024);
    }

    #[test]
    fn an_allocation_that_does_not_fit_asks_for_a_chunk_big_enough() {
        assert_eq!(bump(1000, 1010, 11, 1), None);
        assert_eq!(bump(1000, 1010, 10, 1), Some((1000, 1010)));
        assert_eq!(bump(usize::MAX - 2, usize::MAX, 1, 8), None);
        let big = 3 * CHUNK_BYTES;
        let chunk = chunk_for(big, 64);
        assert!(bump(4096, 4096 + chunk, big, 64).is_some());
        assert_eq!(chunk_for(1, 8), CHUNK_BYTES);
    }
}
