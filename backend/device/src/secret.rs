//! Random secrets written as text: the pool's migration tokens, the daemon's worker nonces,
//! the origin tokens a server checks. One format for all: 16 bytes from the kernel's random
//! source as 32 lowercase hexadecimal characters.

use std::io::{self, Read};

/// Random bytes of a secret.
pub const SECRET_BYTES: usize = 16;
/// Characters of a secret's text.
pub const SECRET_LEN: usize = 2 * SECRET_BYTES;

/// A new secret: [`SECRET_BYTES`] from `/dev/urandom`, as [`SECRET_LEN`] lowercase hex digits.
pub fn new_secret() -> io::Result<String> {
    let mut bytes = [0u8; SECRET_BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `s` is a secret's text: exactly [`SECRET_LEN`] characters of `0-9a-f`.
pub fn is_secret(s: &str) -> bool {
    s.len() == SECRET_LEN
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_fresh_and_well_formed() {
        let a = new_secret().expect("secret");
        let b = new_secret().expect("secret");
        assert!(is_secret(&a) && is_secret(&b), "{a} {b}");
        assert_ne!(a, b);
        for bad in ["", "xyz", &a.to_uppercase(), &a[1..], &format!("{a}0")] {
            assert!(!is_secret(bad), "{bad}");
        }
    }
}
