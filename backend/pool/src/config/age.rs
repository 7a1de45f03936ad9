//! `[daemon] events_max_age`: a duration written for people (`"30d"`, `"12h"`).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use utoipa::ToSchema;

/// A duration in whole seconds, written as an integer (seconds) or a string with an `s`, `m`,
/// `h` or `d` suffix: `"30d"`, `"12h"`, `"90m"`, `3600`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Age(pub u64);

impl Age {
    const UNITS: [(char, u64); 4] = [('d', 86_400), ('h', 3_600), ('m', 60), ('s', 1)];

    /// Parses `"30d"`, `"12h"`, `"90m"`, `"45s"` or `"3600"` (seconds).
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let (digits, unit) = match s.char_indices().last() {
            Some((i, c)) if c.is_ascii_alphabetic() => {
                let c = c.to_ascii_lowercase();
                let unit = Self::UNITS.iter().find(|(u, _)| *u == c)?.1;
                (s.get(..i)?, unit)
            }
            _ => (s, 1),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let n: u64 = digits.parse().ok()?;
        n.checked_mul(unit).map(Age)
    }

    /// The duration in milliseconds (saturating).
    pub fn as_millis(self) -> u64 {
        self.0.saturating_mul(1000)
    }
}

impl fmt::Display for Age {
    /// The shortest exact form: `30d`, `12h`, `90m`, `45s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (c, unit) = Self::UNITS
            .into_iter()
            .find(|(_, unit)| self.0 != 0 && self.0.is_multiple_of(*unit))
            .unwrap_or(('s', 1));
        write!(f, "{}{c}", self.0 / unit)
    }
}

impl Serialize for Age {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl super::suffixed::Suffixed for Age {
    const WHAT: &'static str = "duration";
    const BASE: &'static str = "seconds";
    const EXAMPLE: &'static str = "30d";
    const UNITS: &'static str = "s, m, h or d";
    const PATTERN: &'static str = "^[0-9]+[sSmMhHdD]?$";
    const DESCRIPTION: &'static str = "Seconds, or a string with an s, m, h or d suffix";
    fn from_base(n: u64) -> Self {
        Age(n)
    }
    fn parse_suffixed(s: &str) -> Option<Self> {
        Age::parse(s)
    }
}

impl<'de> Deserialize<'de> for Age {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        super::suffixed::deserialize(d)
    }
}

impl utoipa::PartialSchema for Age {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        super::suffixed::schema::<Age>()
    }
}

impl ToSchema for Age {}

#[cfg(test)]
mod tests {
    use super::Age;

    #[test]
    fn parses_and_prints_the_shortest_form() {
        for (text, secs, shown) in [
            ("30d", 30 * 86_400, "30d"),
            ("12H", 12 * 3_600, "12h"),
            ("90m", 5_400, "90m"),
            ("3600", 3_600, "1h"),
            ("61s", 61, "61s"),
        ] {
            let age = Age::parse(text).expect(text);
            assert_eq!(age.0, secs, "{text}");
            assert_eq!(age.to_string(), shown, "{text}");
        }
        for bad in ["", "d", "1w", "-1d", "1.5h", "99999999999999999999d"] {
            assert_eq!(Age::parse(bad), None, "{bad}");
        }
    }
}
