//! Endpoints' migration tokens ([`Endpoint::migration_token`](crate::Endpoint::migration_token)).

use std::io::Read;

use crate::error::PoolError;

/// Random bytes of a token (it is written as twice as many hexadecimal characters).
const TOKEN_BYTES: usize = 16;

/// A new migration token: 128 bits from the system's random source, as 32 lowercase
/// hexadecimal characters.
pub fn new_migration_token() -> Result<String, PoolError> {
    let mut bytes = [0u8; TOKEN_BYTES];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(PoolError::Random)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `s` is a migration token (32 lowercase hexadecimal characters).
pub fn is_migration_token(s: &str) -> bool {
    s.len() == 2 * TOKEN_BYTES
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_fresh_and_well_formed() {
        let a = new_migration_token().expect("token");
        let b = new_migration_token().expect("token");
        assert!(is_migration_token(&a) && is_migration_token(&b), "{a} {b}");
        assert_ne!(a, b);
        for bad in ["", "xyz", &a.to_uppercase(), &a[1..]] {
            assert!(!is_migration_token(bad), "{bad}");
        }
    }
}
