//! Device configuration. Its options (`vram=64M,queues=2,irq=msix,vram_mmap=on`) are parsed
//! by the kind ([`SoftGpuKind::config`](crate::SoftGpuKind::config)), from the kind
//! registry's canonical options.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Errors of the configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// An interrupt mode other than `msix` or `msi`.
    #[error("Invalid interrupt mode `{0}`; expected `msix` or `msi`")]
    BadIrqMode(String),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configurations_serialized_before_an_option_existed_get_its_old_behaviour() {
        let old: SoftGpuConfig =
            serde_json::from_str(r#"{"vram_size":1048576,"queues":1,"irq":"msi"}"#)
                .expect("decode");
        assert!(old.vram_mmap, "VRAM mappable");
        let old: SoftGpuConfig =
            serde_json::from_str(r#"{"vram_size":1048576,"queues":1}"#).expect("decode");
        assert_eq!(old.irq, IrqMode::Msix);
    }

    #[test]
    fn interrupt_modes_round_trip_and_size_the_irq_table() {
        for mode in [IrqMode::Msix, IrqMode::Msi] {
            assert_eq!(mode.to_string().parse::<IrqMode>(), Ok(mode));
            assert_eq!(mode.to_string().to_uppercase().parse::<IrqMode>(), Ok(mode));
            let json = serde_json::to_string(&mode).expect("encode");
            assert_eq!(json, format!("\"{mode}\""));
        }
        let msi = SoftGpuConfig {
            irq: IrqMode::Msi,
            ..SoftGpuConfig::default()
        };
        assert_eq!(msi.irq_counts(), [0, 1, 0, 1, 1]);
        assert_eq!(SoftGpuConfig::default().irq_counts(), [0, 0, 16, 1, 1]);
        let e = "msi-x".parse::<IrqMode>().expect_err("msi-x");
        assert_eq!(
            e.to_string(),
            "Invalid interrupt mode `msi-x`; expected `msix` or `msi`"
        );
    }
}
