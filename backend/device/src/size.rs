//! Byte sizes written for people, one rule for every crate (a kind's options, a pool's
//! configuration, the command lines): a decimal integer with an optional binary suffix, `K`,
//! `M`, `G` or `T` (KiB = 1024), also written `KiB`, `MiB`, `GiB` or `TiB` (either case):
//! `4096`, `64M`, `1g`, `128MiB`. Surrounding whitespace is ignored; a sign, a fraction or a
//! space between number and suffix is refused, and so is a size beyond `u64` (never wrapped).

/// A text that is not a size by [`parse_size`]'s rule; it names the text and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "Invalid size `{text}`: {problem}; expected a whole number of bytes with an optional K, M, G \
     or T suffix (binary; KiB, MiB, GiB or TiB too)"
)]
pub struct SizeError {
    text: String,
    problem: String,
}

impl SizeError {
    fn new(text: &str, problem: impl Into<String>) -> Self {
        SizeError {
            text: text.to_owned(),
            problem: problem.into(),
        }
    }

    /// The text that was refused.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// Parses a byte size by the module's rule: `"64M"` is 67108864, `"2KiB"` 2048, `"10"` 10.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(SizeError::new(text, "empty"));
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    if digits.is_empty() {
        return Err(SizeError::new(text, "it does not start with a digit"));
    }
    if !suffix.chars().all(|c| c.is_ascii_alphabetic()) {
        return Err(SizeError::new(text, "not a whole number and a suffix"));
    }
    let shift = match suffix.to_ascii_uppercase().as_str() {
        "" => 0,
        "K" | "KIB" => 10,
        "M" | "MIB" => 20,
        "G" | "GIB" => 30,
        "T" | "TIB" => 40,
        _ => return Err(SizeError::new(text, format!("unknown suffix `{suffix}`"))),
    };
    let too_large = || SizeError::new(text, "too large (more than 2^64 - 1 bytes)");
    let n: u64 = digits.parse().map_err(|_| too_large())?;
    n.checked_mul(1u64 << shift).ok_or_else(too_large)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(text: &str) -> String {
        let e = parse_size(text).expect_err(text);
        assert_eq!(e.text(), text);
        assert!(e.to_string().contains(&format!("`{text}`")), "{e}");
        e.problem
    }

    #[test]
    fn plain_numbers_are_bytes() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("007"), Ok(7));
        assert_eq!(parse_size(&u64::MAX.to_string()), Ok(u64::MAX));
    }

    #[test]
    fn each_suffix_is_a_power_of_1024_in_either_case_and_either_spelling() {
        for (i, (short, long)) in [("K", "KiB"), ("M", "MiB"), ("G", "GiB"), ("T", "TiB")]
            .into_iter()
            .enumerate()
        {
            let want = 3u64 << (10 * (i + 1));
            for suffix in [
                short.to_owned(),
                short.to_ascii_lowercase(),
                long.to_owned(),
                long.to_ascii_lowercase(),
                long.to_ascii_uppercase(),
            ] {
                assert_eq!(parse_size(&format!("3{suffix}")), Ok(want), "3{suffix}");
            }
        }
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        assert_eq!(parse_size("16777215T"), Ok(16_777_215u64 << 40));
        assert!(problem("16777216T").contains("too large"));
        assert!(problem("18446744073709551616").contains("too large"));
        assert!(problem("99999999999999999999999K").contains("too large"));
    }

    #[test]
    fn empty_and_blank_are_refused() {
        assert_eq!(problem(""), "empty");
        assert_eq!(problem("   "), "empty");
    }

    #[test]
    fn garbage_is_refused_naming_the_text() {
        assert_eq!(problem("12X"), "unknown suffix `X`");
        assert_eq!(problem("64MB"), "unknown suffix `MB`");
        assert_eq!(problem("1.5G"), "not a whole number and a suffix");
        assert_eq!(problem("M"), "it does not start with a digit");
        assert_eq!(problem("-1"), "it does not start with a digit");
        assert_eq!(problem("+1"), "it does not start with a digit");
        assert_eq!(problem("0x10"), "not a whole number and a suffix");
        assert_eq!(problem("1KK"), "unknown suffix `KK`");
    }

    #[test]
    fn surrounding_whitespace_is_ignored_inner_whitespace_refused() {
        assert_eq!(parse_size(" 64M\t"), Ok(64 << 20));
        assert_eq!(parse_size("\n4096 "), Ok(4096));
        assert_eq!(problem("64 M"), "not a whole number and a suffix");
        assert_eq!(problem("6 4"), "not a whole number and a suffix");
    }
}
