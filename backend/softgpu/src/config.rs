//! Device configuration and its option-string parser
//! (`vram=64M,queues=2,irq=msix,vram_mmap=on`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Errors of the configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// An option name the device does not know.
    #[error(
        "Unknown softgpu option `{0}`; the options are `vram`, `queues`, `irq`, `vram_mmap`, `vram_reset` and `spin`"
    )]
    UnknownOption(String),
    /// An option without `=value`.
    #[error("Option `{0}` needs a value, e.g. `{0}=...`")]
    MissingValue(String),
    /// An option given twice.
    #[error("Option `{0}` is given more than once")]
    DuplicateOption(String),
    /// A VRAM size that is not a number with an optional suffix.
    #[error(
        "Invalid VRAM size `{0}`; expected a number of bytes with an optional K, M, G or T suffix"
    )]
    BadSize(String),
    /// A queue count that is not a number.
    #[error("Invalid queue count `{0}`; expected a number")]
    BadNumber(String),
    /// An interrupt mode other than `msix` or `msi`.
    #[error("Invalid interrupt mode `{0}`; expected `msix` or `msi`")]
    BadIrqMode(String),
    /// An on/off option with another value.
    #[error("Invalid value `{1}` for `{0}`; expected `on` or `off`")]
    BadSwitch(String, String),
    /// A `vram_reset` other than `zero` or `keep`.
    #[error("Invalid value `{0}` for `vram_reset`; expected `zero` or `keep`")]
    BadVramReset(String),
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
    /// A polling budget that is not a number.
    #[error("Invalid polling budget `{0}`; expected a number of microseconds")]
    BadSpin(String),
    /// Polling budget out of range.
    #[error("Polling budget {0} µs exceeds the maximum of 10000 µs")]
    SpinTooLarge(u32),
}

/// How the device signals interrupts (the `irq=` option). See the crate documentation,
/// "Interrupt modes".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IrqMode {
    /// MSI-X: 16 vectors, table and PBA in BAR4, per-queue vector routing (`irq=msix`, the
    /// default, like real GPUs).
    #[default]
    Msix,
    /// MSI with a single vector that every interrupt source shares; no MSI-X capability and no
    /// BAR4 (`irq=msi`). For VMMs that cannot hot-unplug MSI-X vfio-user devices (QEMU 11.1's
    /// `vfio-user-pci` aborts when removing one).
    Msi,
}

impl IrqMode {
    /// The option value: `msix` or `msi`.
    pub fn as_str(self) -> &'static str {
        match self {
            IrqMode::Msix => "msix",
            IrqMode::Msi => "msi",
        }
    }

    /// MSI-X vectors of the device in this mode (16, or 0 for MSI).
    pub fn msix_vectors(self) -> u32 {
        match self {
            IrqMode::Msix => crate::regs::MSIX_VECTORS,
            IrqMode::Msi => 0,
        }
    }

    /// MSI vectors of the device in this mode (0, or 1 for MSI).
    pub fn msi_vectors(self) -> u32 {
        match self {
            IrqMode::Msix => 0,
            IrqMode::Msi => 1,
        }
    }
}

impl fmt::Display for IrqMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for IrqMode {
    type Err = ConfigError;

    /// `msix` or `msi`, ASCII case insensitive.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("msix") {
            Ok(IrqMode::Msix)
        } else if s.eq_ignore_ascii_case("msi") {
            Ok(IrqMode::Msi)
        } else {
            Err(ConfigError::BadIrqMode(s.to_owned()))
        }
    }
}

/// Configuration of a [`SoftGpu`](crate::SoftGpu).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SoftGpuConfig {
    /// VRAM size in bytes: a power of two in `MIN_VRAM..=MAX_VRAM`.
    pub vram_size: u64,
    /// Number of command queues (and engine threads), `1..=MAX_QUEUES`.
    pub queues: u32,
    /// Interrupt mode. Part of the device's identity: a saved state only restores into a
    /// device of the same mode. (States saved before the option existed are MSI-X.)
    #[serde(default)]
    pub irq: IrqMode,
    /// The client may mmap VRAM (BAR2). Off (`vram_mmap=off`), every VRAM access is trapped:
    /// slower for the guest, but the device sees every write, so migration rounds send only
    /// the pages written since the last round and the final round does not read all of VRAM
    /// (see the migration stream in `mig.rs`). Part of the device's identity like `irq`.
    #[serde(default = "default_true")]
    pub vram_mmap: bool,
    /// Resets (FLR, `DEVICE_RESET`, `DEV_CONTROL.RESET`) keep VRAM's contents
    /// (`vram_reset=keep`), as a real GPU's memory survives a function reset; by default they
    /// zero it (`vram_reset=zero`). With `keep`, a guest that loses its device and gets it
    /// back (a hot-unplug and re-plug, e.g. a pool moving it to another board) finds its VRAM
    /// as it left it. A pool gives every new lease fresh VRAM either way.
    #[serde(default)]
    pub keep_vram_on_reset: bool,
    /// The longest an engine polls for new work (a mapped doorbell's `DB_TAIL`, a trapped
    /// doorbell) after it ran out, in µs, before it sleeps (`spin=`, default
    /// [`SoftGpuConfig::DEFAULT_SPIN_US`]); the budget in use adapts between 0 and this (see
    /// the crate documentation, "Mapped doorbells"). 0 never polls. A host setting, not part
    /// of the device's identity: a state moves between devices whose budgets differ.
    #[serde(default = "default_spin")]
    pub spin_us: u32,
}

fn default_spin() -> u32 {
    SoftGpuConfig::DEFAULT_SPIN_US
}

fn default_true() -> bool {
    true
}

impl Default for SoftGpuConfig {
    fn default() -> Self {
        Self {
            vram_size: Self::DEFAULT_VRAM,
            queues: Self::DEFAULT_QUEUES,
            irq: IrqMode::default(),
            vram_mmap: true,
            keep_vram_on_reset: false,
            spin_us: Self::DEFAULT_SPIN_US,
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
    /// Default polling budget of an engine (µs): KVM's default halt-polling budget.
    pub const DEFAULT_SPIN_US: u32 = 200;
    /// Largest polling budget (µs).
    pub const MAX_SPIN_US: u32 = 10_000;

    /// Whether a state saved by a device of `other` fits a device of this configuration:
    /// equal but for host settings (`spin`).
    pub fn same_device(&self, other: &SoftGpuConfig) -> bool {
        SoftGpuConfig {
            spin_us: 0,
            ..*self
        } == SoftGpuConfig {
            spin_us: 0,
            ..*other
        }
    }

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
        if self.spin_us > Self::MAX_SPIN_US {
            return Err(ConfigError::SpinTooLarge(self.spin_us));
        }
        Ok(())
    }

    /// Vectors per VFIO IRQ index (INTx, MSI, MSI-X, ERR, REQ) of a device with this
    /// configuration, e.g. to size an [`Interrupts`](switchyard_device::Interrupts) table:
    /// `[0, 0, 16, 1, 1]` for MSI-X, `[0, 1, 0, 1, 1]` for MSI. The device reports the same
    /// through its description (`irq_counts()`). The ERR index (one vector) is what lets a VMM
    /// enable error recovery; see [Device failure](crate#device-failure-the-err-interrupt).
    pub fn irq_counts(&self) -> [u32; 5] {
        [0, self.irq.msi_vectors(), self.irq.msix_vectors(), 1, 1]
    }

    /// Parses a comma-separated option list: `vram=<n>[K|M|G]` (binary multiples, suffix case
    /// insensitive), `queues=<n>`, `irq=msix|msi`, `vram_mmap=on|off`,
    /// `vram_reset=zero|keep` (case insensitive) and `spin=<µs>`.
    /// Omitted options keep
    /// their defaults; an empty string is the default configuration; a leading `softgpu`
    /// device name is accepted and skipped.
    pub fn parse_options(s: &str) -> Result<Self, ConfigError> {
        let mut cfg = Self::default();
        let (mut seen_vram, mut seen_queues, mut seen_irq, mut seen_mmap, mut seen_reset) =
            (false, false, false, false, false);
        let mut seen_spin = false;
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
                "irq" => &mut seen_irq,
                "vram_mmap" => &mut seen_mmap,
                "vram_reset" => &mut seen_reset,
                "spin" => &mut seen_spin,
                _ => return Err(ConfigError::UnknownOption(key.to_owned())),
            };
            if value.is_empty() {
                return Err(ConfigError::MissingValue(key.to_owned()));
            }
            if std::mem::replace(seen, true) {
                return Err(ConfigError::DuplicateOption(key.to_owned()));
            }
            match key {
                "vram" => {
                    cfg.vram_size = switchyard_device::parse_size(value)
                        .map_err(|_| ConfigError::BadSize(value.to_owned()))?;
                }
                "irq" => cfg.irq = value.parse()?,
                "spin" => {
                    cfg.spin_us = value
                        .parse()
                        .map_err(|_| ConfigError::BadSpin(value.to_owned()))?;
                }
                "vram_mmap" => {
                    cfg.vram_mmap = match value.to_ascii_lowercase().as_str() {
                        "on" => true,
                        "off" => false,
                        _ => return Err(ConfigError::BadSwitch(key.into(), value.into())),
                    }
                }
                "vram_reset" => {
                    cfg.keep_vram_on_reset = match value.to_ascii_lowercase().as_str() {
                        "keep" => true,
                        "zero" => false,
                        _ => return Err(ConfigError::BadVramReset(value.into())),
                    }
                }
                _ => {
                    cfg.queues = value
                        .parse()
                        .map_err(|_| ConfigError::BadNumber(value.to_owned()))?;
                }
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }
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
        let c = SoftGpuConfig::parse_options("spin=0").expect("spin");
        assert_eq!(c.spin_us, 0);
        let c = SoftGpuConfig::parse_options("spin=10000").expect("largest spin");
        assert_eq!(c.spin_us, SoftGpuConfig::MAX_SPIN_US);
        assert!(c.same_device(&SoftGpuConfig::default()));
        let c = SoftGpuConfig::parse_options("queues=8, vram=1g").expect("spaces");
        assert_eq!((c.vram_size, c.queues), (1 << 30, 8));
        let c = SoftGpuConfig::parse_options("vram=2048K").expect("kib");
        assert_eq!(c.vram_size, 2 << 20);
        let c = SoftGpuConfig::parse_options("vram=1048576,").expect("bytes");
        assert_eq!(c.vram_size, 1 << 20);
        assert_eq!(c.irq, IrqMode::Msix, "MSI-X by default");
        assert!(c.vram_mmap, "VRAM mappable by default");
        let c = SoftGpuConfig::parse_options("vram_mmap=OFF,vram=4M").expect("mmap off");
        assert!(!c.vram_mmap && c.vram_size == 4 << 20);
        // A configuration serialized before the option existed maps VRAM.
        let old: SoftGpuConfig =
            serde_json::from_str(r#"{"vram_size":1048576,"queues":1,"irq":"msi"}"#)
                .expect("decode");
        assert!(old.vram_mmap);
    }

    #[test]
    fn parses_the_interrupt_mode() {
        let c = SoftGpuConfig::parse_options("softgpu,irq=msi").expect("msi");
        assert_eq!(
            c,
            SoftGpuConfig {
                irq: IrqMode::Msi,
                ..SoftGpuConfig::default()
            }
        );
        assert_eq!(c.irq_counts(), [0, 1, 0, 1, 1]);
        let c = SoftGpuConfig::parse_options("irq=msix,vram=8M").expect("msix");
        assert_eq!((c.irq, c.vram_size), (IrqMode::Msix, 8 << 20));
        assert_eq!(c.irq_counts(), [0, 0, 16, 1, 1]);
        let c = SoftGpuConfig::parse_options("queues=1, irq = MSI ").expect("case, spaces");
        assert_eq!((c.irq, c.queues), (IrqMode::Msi, 1));
        for mode in [IrqMode::Msix, IrqMode::Msi] {
            assert_eq!(mode.to_string().parse::<IrqMode>(), Ok(mode));
            let json = serde_json::to_string(&mode).expect("encode");
            assert_eq!(json, format!("\"{mode}\""));
        }
        // A configuration serialized before the option existed is MSI-X.
        let old: SoftGpuConfig =
            serde_json::from_str(r#"{"vram_size":1048576,"queues":1}"#).expect("decode");
        assert_eq!(old.irq, IrqMode::Msix);
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
            ("irq", ConfigError::MissingValue("irq".into())),
            ("irq=", ConfigError::MissingValue("irq".into())),
            ("irq=intx", ConfigError::BadIrqMode("intx".into())),
            ("irq=msi-x", ConfigError::BadIrqMode("msi-x".into())),
            (
                "irq=msi,irq=msix",
                ConfigError::DuplicateOption("irq".into()),
            ),
            ("vram=3M", ConfigError::VramNotPowerOfTwo(3 << 20)),
            ("vram=512K", ConfigError::VramTooSmall(512 << 10)),
            ("vram=128G", ConfigError::VramTooLarge(128 << 30)),
            ("queues=0", ConfigError::QueuesOutOfRange(0)),
            ("queues=9", ConfigError::QueuesOutOfRange(9)),
            ("spin=fast", ConfigError::BadSpin("fast".into())),
            ("spin=-1", ConfigError::BadSpin("-1".into())),
            ("spin=10001", ConfigError::SpinTooLarge(10_001)),
            ("spin=5,spin=6", ConfigError::DuplicateOption("spin".into())),
            (
                "vram_mmap=maybe",
                ConfigError::BadSwitch("vram_mmap".into(), "maybe".into()),
            ),
            ("vram_mmap", ConfigError::MissingValue("vram_mmap".into())),
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
            "Unknown softgpu option `x`; the options are `vram`, `queues`, `irq`, `vram_mmap`, `vram_reset` and `spin`"
        );
        assert_eq!(
            ConfigError::BadIrqMode("intx".into()).to_string(),
            "Invalid interrupt mode `intx`; expected `msix` or `msi`"
        );
    }
}
