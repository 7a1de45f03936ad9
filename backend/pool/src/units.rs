//! Byte counts for people (a leaf module: errors, shapes and the configuration use it).

use std::fmt;

/// A byte count for people: `64 MiB`, `1 GiB`, `1536 KiB`, `1000 bytes`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Size(pub u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match binary_unit(self.0) {
            (n, Some(unit)) => write!(f, "{n} {unit}iB"),
            (n, None) => write!(f, "{n} bytes"),
        }
    }
}

/// `n` in its largest exact binary unit: `(64, Some('M'))` for 64 MiB, `(n, None)` when no
/// unit divides it.
pub(crate) fn binary_unit(n: u64) -> (u64, Option<char>) {
    for (shift, unit) in [(30, 'G'), (20, 'M'), (10, 'K')] {
        if n != 0 && n.is_multiple_of(1u64 << shift) {
            return (n >> shift, Some(unit));
        }
    }
    (n, None)
}
