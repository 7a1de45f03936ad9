//! Counts written for people, one reader for all of them: an integer, or a string of digits
//! with a unit suffix (sizes: `"64M"`; durations: `"30d"`). serde's visitor and the OpenAPI
//! schema are the same for each; only the units differ.

use std::fmt;

use serde::Deserializer;

/// A count with unit suffixes ([`ByteSize`](super::ByteSize), [`Age`](super::Age)).
pub(super) trait Suffixed: Sized {
    /// What it is, for errors: `size`.
    const WHAT: &'static str;
    /// Its base unit, for errors: `bytes`.
    const BASE: &'static str;
    /// An example, for errors: `64M`.
    const EXAMPLE: &'static str;
    /// The suffixes, for errors: `K, M, G or T`.
    const UNITS: &'static str;
    /// The schema's pattern of the string form.
    const PATTERN: &'static str;
    /// The schema's description.
    const DESCRIPTION: &'static str;
    /// A count of the base unit.
    fn from_base(n: u64) -> Self;
    /// The string form; `None` when it is not one.
    fn parse_suffixed(s: &str) -> Option<Self>;
}

/// Deserializes a [`Suffixed`] from an integer or a string.
pub(super) fn deserialize<'de, T: Suffixed, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
    struct V<T>(std::marker::PhantomData<T>);
    impl<T: Suffixed> serde::de::Visitor<'_> for V<T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(
                f,
                "a {}: a number of {} or a string like \"{}\" ({})",
                T::WHAT,
                T::BASE,
                T::EXAMPLE,
                T::UNITS
            )
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<T, E> {
            Ok(T::from_base(v))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<T, E> {
            u64::try_from(v)
                .map(T::from_base)
                .map_err(|_| E::custom(format!("invalid {} {v}: negative", T::WHAT)))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
            T::parse_suffixed(v).ok_or_else(|| {
                E::custom(format!(
                    "invalid {} \"{v}\"; expected a number of {} with an optional {} suffix",
                    T::WHAT,
                    T::BASE,
                    T::UNITS
                ))
            })
        }
    }
    d.deserialize_any(V(std::marker::PhantomData))
}

/// The OpenAPI schema of a [`Suffixed`]: a non-negative integer, or a string of its pattern.
pub(super) fn schema<T: Suffixed>() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, SchemaType, Type};
    OneOfBuilder::new()
        .item(
            ObjectBuilder::new()
                .schema_type(SchemaType::new(Type::Integer))
                .minimum(Some(0)),
        )
        .item(
            ObjectBuilder::new()
                .schema_type(SchemaType::new(Type::String))
                .pattern(Some(T::PATTERN)),
        )
        .description(Some(T::DESCRIPTION))
        .into()
}
