//! A global allocator that counts the allocations of the threads that ask it to, for tests
//! that check a path does not allocate (`switchyard-proto`'s `no_alloc` test). Implementing
//! [`GlobalAlloc`] is `unsafe`, hence here.
//!
//! ```
//! use switchyard_sys::alloc_count::{CountingAlloc, allocations};
//!
//! #[global_allocator]
//! static GLOBAL: CountingAlloc = CountingAlloc;
//!
//! fn main() {
//!     let mut v: Vec<u8> = Vec::with_capacity(16);
//!     assert_eq!(allocations(|| v.extend_from_slice(b"warm")), 0);
//!     assert_eq!(allocations(|| drop(Vec::<u8>::with_capacity(16))), 1);
//! }
//! ```

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// Whether allocations on this thread are being counted.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    /// Allocations (and reallocations) counted on this thread.
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

/// Forwards to [`System`], counting allocations of threads that opted in ([`allocations`]).
/// Counts only where it is the `#[global_allocator]`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CountingAlloc;

fn count() {
    // `try_with`: the thread-locals may already be gone while a thread exits.
    // They are const-initialised without destructors, so this never allocates.
    let counting = COUNTING.try_with(Cell::get).unwrap_or(false);
    if counting {
        let _ = ALLOCS.try_with(|n| n.set(n.get().saturating_add(1)));
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees carry over; counting only touches
// const-initialised thread-locals and never allocates or unwinds.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract for `layout`.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller upholds `GlobalAlloc::alloc_zeroed`'s contract for `layout`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` (all allocations go through it) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: `ptr` was allocated by `System` with `layout`; the caller upholds the rest
        // of `GlobalAlloc::realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Runs `f` and returns how many allocations (and reallocations) it made on this thread; 0
/// unless [`CountingAlloc`] is the global allocator.
pub fn allocations(f: impl FnOnce()) -> usize {
    ALLOCS.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCS.with(Cell::get)
}
