//! Device configuration and its option-string parser (`vram=64M,queues=2`).

use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Errors of the configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// An option name the device does not know.
    #[error("Unknown softgpu option `{0}`; the options are `vram` and `queues`")]
    UnknownOption(String),
    /// An option without `=value`.
    #[error("Option `{0}` needs a value, e.g. `{0}=...`")]
    MissingValue(String),
    /// An option given twice.
    #[error("Option `{0}` is given more than once")]
    DuplicateOption(String),
    /// A VRAM size that is not a number with an optional suffix.
    #[error(
        "Invalid VRAM size `{0}`; expected a number of bytes with an optional K, M or G suffix"
    )]
    BadSize(String),
    /// A queue count that is not a number.
    #[error("Invalid queue count `{0}`; expected a number")]
    BadNumber(String),
    /// VRAM size not a power of two.
    #[error("VRAM size {0} is not a power of two")]
    VramNotPowerOfTwo(u64),
    /// VRAM size below the minimum.
    #[error("VRAM size {0} is below the minimum of 1 MiB")]
    VramTooSmall(u64),
    /// VRAM size above the maximum.
    #[error("VRAM size {0} exceeds the maximum of 64 GiB")]
    VramTooLarge(u64),
    /// Queue count out of range.
    #[error("Queue count {0} is outside the supported range 1 to 8")]
    QueuesOutOfRange(u32),
}

/// Configuration of a [`SoftGpu`](crate::SoftGpu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SoftGpuConfig {
    /// VRAM size in bytes: a power of two in `MIN_VRAM..=MAX_VRAM`.
    pub vram_size: u64,
    /// Number of command queues (and engine threads), `1..=MAX_QUEUES`.
    pub queues: u32,
}

impl Default for SoftGpuConfig {
    fn default() -> Self {
        Self {
            vram_size: Self::DEFAULT_VRAM,
            queues: Self::DEFAULT_QUEUES,
        }
    }
}

impl SoftGpuConfig {
    /// Default VRAM size (64 MiB).
    pub const DEFAULT_VRAM: u64 = 64 << 20;
    /// Smallest VRAM size (1 MiB).
    pub const MIN_VRAM: u64 = 1 << 20;
    /// Largest VRAM size (64 GiB).
    pub const MAX_VRAM: u64 = 64 << 30;
    /// Default number of queues.
    pub const DEFAULT_QUEUES: u32 = 2;
    /// Largest number of queues.
    pub const MAX_QUEUES: u32 = 8;

    /// Checks the values.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let v = self.vram_size;
        if v < Self::MIN_VRAM {
            return Err(ConfigError::VramTooSmall(v));
        }
        if v > Self::MAX_VRAM {
            return Err(ConfigError::VramTooLarge(v));
        }
        if !v.is_power_of_two() {
            return Err(ConfigError::VramNotPowerOfTwo(v));
        }
        if !(1..=Self::MAX_QUEUES).contains(&self.queues) {
            return Err(ConfigError::QueuesOutOfRange(self.queues));
        }
        Ok(())
    }

    /// Parses a comma-separated option list: `vram=<n>[K|M|G]` (binary multiples, suffix case
    /// insensitive) and `queues=<n>`. Omitted options keep their defaults; an empty string is
    /// the default configuration; a leading `softgpu` device name is accepted and skipped.
    pub fn parse_options(s: &str) -> Result<Self, ConfigError> {
        let mut cfg = Self::default();
        let (mut seen_vram, mut seen_queues) = (false, false);
        for (i, item) in s.split(',').map(str::trim).enumerate() {
            if item.is_empty() || (i == 0 && item == "softgpu") {
                continue;
            }
            let (key, value) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None => (item, ""),
            };
            let seen = match key {
                "vram" => &mut seen_vram,
                "queues" => &mut seen_queues,
                _ => return Err(ConfigError::UnknownOption(key.to_owned())),
            };
            if value.is_empty() {
                return Err(ConfigError::MissingValue(key.to_owned()));
            }
            if std::mem::replace(seen, true) {
                return Err(ConfigError::DuplicateOption(key.to_owned()));
            }
            if key == "vram" {
                cfg.vram_size = parse_size(value)?;
            } else {
                cfg.queues = value
                    .parse()
                    .map_err(|_| ConfigError::BadNumber(value.to_owned()))?;
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

fn parse_size(value: &str) -> Result<u64, ConfigError> {
    let bad = || ConfigError::BadSize(value.to_owned());
    let (digits, shift) = match value.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                _ => return Err(bad()),
            };
            (value.get(..i).ok_or_else(bad)?, shift)
        }
        _ => (value, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

impl FromStr for SoftGpuConfig {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse_options(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_options_and_defaults() {
        assert_eq!(
            SoftGpuConfig::parse_options("").expect("empty"),
            SoftGpuConfig::default()
        );
        let c: SoftGpuConfig = "softgpu,vram=64M,queues=2".parse().expect("full");
        assert_eq!(c.vram_size, 64 << 20);
        assert_eq!(c.queues, 2);
        let c = SoftGpuConfig::parse_options("queues=8, vram=1g").expect("spaces");
        assert_eq!((c.vram_size, c.queues), (1 << 30, 8));
        let c = SoftGpuConfig::parse_options("vram=2048K").expect("kib");
        assert_eq!(c.vram_size, 2 << 20);
        let c = SoftGpuConfig::parse_options("vram=1048576,").expect("bytes");
        assert_eq!(c.vram_size, 1 << 20);
    }

    #[test]
    fn reports_clear_errors() {
        let cases: &[(&str, ConfigError)] = &[
            ("colour=red", ConfigError::UnknownOption("colour".into())),
            ("vram", ConfigError::MissingValue("vram".into())),
            ("queues=", ConfigError::MissingValue("queues".into())),
            (
                "queues=1,queues=2",
                ConfigError::DuplicateOption("queues".into()),
            ),
            ("vram=12X", ConfigError::BadSize("12X".into())),
            ("vram=M", ConfigError::BadSize("M".into())),
            ("vram=-1M", ConfigError::BadSize("-1M".into())),
            (
                "vram=99999999999G",
                ConfigError::BadSize("99999999999G".into()),
            ),
            ("queues=two", ConfigError::BadNumber("two".into())),
            ("vram=3M", ConfigError::VramNotPowerOfTwo(3 << 20)),
            ("vram=512K", ConfigError::VramTooSmall(512 << 10)),
            ("vram=128G", ConfigError::VramTooLarge(128 << 30)),
            ("queues=0", ConfigError::QueuesOutOfRange(0)),
            ("queues=9", ConfigError::QueuesOutOfRange(9)),
            (
                "vram=64M,softgpu",
                ConfigError::UnknownOption("softgpu".into()),
            ),
        ];
        for (input, want) in cases {
            let got = SoftGpuConfig::parse_options(input).expect_err(input);
            assert_eq!(&got, want, "{input}");
            let msg = got.to_string();
            assert!(
                msg.starts_with(|c: char| c.is_ascii_uppercase()),
                "sentence case: {msg}"
            );
        }
        assert_eq!(
            ConfigError::UnknownOption("x".into()).to_string(),
            "Unknown softgpu option `x`; the options are `vram` and `queues`"
        );
    }
}
