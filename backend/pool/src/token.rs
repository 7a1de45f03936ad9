//! Endpoints' migration tokens ([`Endpoint::migration_token`](crate::Endpoint::migration_token)).

use switchyard_device::secret;

use crate::error::PoolError;

/// A new migration token: 128 bits from the system's random source, as 32 lowercase
/// hexadecimal characters ([`switchyard_device::secret`]).
pub fn new_migration_token() -> Result<String, PoolError> {
    secret::new_secret().map_err(PoolError::Random)
}

/// Whether `s` is a migration token (32 lowercase hexadecimal characters).
pub fn is_migration_token(s: &str) -> bool {
    secret::is_secret(s)
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
