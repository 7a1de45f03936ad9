//! Telling a guest whose kernel panicked while it booted, before its test's own code ran, from
//! a test that failed ([`boot_state`]).
//!
//! A TCG guest on a loaded host can panic in early boot for reasons of the emulation, not of
//! the code under test (the boot-time timer check was one, now skipped:
//! [`switchyard_qemu::GUEST_BOOT_ARGS`]). The guest's `/init` prints `GUEST: test NAME start`
//! (images/README.md) just before it runs the test: a kernel panic before that line is a boot
//! failure, which [`Guest`](crate::Guest) boots again once (at most [`BOOT_ATTEMPTS`] boots),
//! saying so on stderr (`BOOT-PANIC:`, shown even when the test passes) and keeping the failed
//! boot's console as `serial.boot-1.log`. A panic after that line is the test's failure and is
//! never retried; so is a second boot panic.

use crate::complete_lines;

/// Boots a guest may take: a second one only when the first panicked before its test's code
/// ran.
pub const BOOT_ATTEMPTS: u32 = 2;

/// What a kernel prints when it panics (then `panic=-1` and QEMU's `-no-reboot` end QEMU).
const KERNEL_PANIC: &str = "Kernel panic - not syncing";

/// How far a guest's boot has come, by its console ([`boot_state`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootState {
    /// Neither a kernel panic nor the test's start yet.
    Booting,
    /// `/init` reached the test (`GUEST: test NAME start`, or `... not found`): from here on a
    /// kernel panic is the test's failure.
    TestStarted,
    /// The kernel panicked before the test's code ran: the panic's line.
    Panicked(String),
}

/// What the (complete) lines of a guest's console say about the boot of the guest running
/// `test`: whichever came first of the test's start and a kernel panic. An L1's console also
/// carries its L2s' lines (`L2[name]: ...`): those are the L2s', not the guest's.
pub fn boot_state(serial: &str, test: &str) -> BootState {
    let marker = format!("GUEST: test {test} ");
    for l in complete_lines(serial).lines().map(str::trim) {
        if l.starts_with("L2[") {
            continue;
        }
        if l.starts_with(&marker) {
            return BootState::TestStarted;
        }
        if l.contains(KERNEL_PANIC) {
            return BootState::Panicked(l.to_owned());
        }
    }
    BootState::Booting
}

#[cfg(test)]
mod tests {
    use super::{BootState, boot_state};

    /// The soak test's guest under load before `no_timer_check` (issue 33's panic line, with
    /// the kernel's lines around a panic).
    const TIMER_PANIC: &str = "\
[    0.412345] DMAR-IR: Enabled IRQ remapping in xapic mode
[    0.634567] Kernel panic - not syncing: timer doesn't work through Interrupt-remapped IO-APIC
[    0.635000] CPU: 0 UID: 0 PID: 1 Comm: swapper/0 Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
[    0.640000] ---[ end Kernel panic - not syncing: timer doesn't work through Interrupt-remapped IO-APIC ]---
";

    const STARTED: &str = "\
GUEST: boot kernel=6.12.117+deb13-amd64 modules=5/5 test=sygpu-driver uptime=2.71
GUEST: pci 0000:00:03.0 vendor=0x1234 device=0x5347 class=0x030200 driver=none iommu_group=1
GUEST: test sygpu-driver start args=--soak
";

    #[test]
    fn a_panic_before_the_test_started_is_a_boot_failure() {
        assert_eq!(
            boot_state(TIMER_PANIC, "sygpu-driver"),
            BootState::Panicked(
                "[    0.634567] Kernel panic - not syncing: timer doesn't work through \
                 Interrupt-remapped IO-APIC"
                    .into()
            )
        );
        // Any panic counts, after `/init` said it booted too (its modules, its PCI list).
        let late = "GUEST: boot kernel=6.12 modules=5/5 test=sygpu-driver uptime=2.71\n\
             [    3.1] Kernel panic - not syncing: Attempted to kill init! exitcode=0x0000000b\n";
        assert!(matches!(
            boot_state(late, "sygpu-driver"),
            BootState::Panicked(l) if l.contains("Attempted to kill init")
        ));
    }

    #[test]
    fn a_panic_after_the_test_started_is_the_tests_failure() {
        let after = format!("{STARTED}{TIMER_PANIC}");
        assert_eq!(boot_state(&after, "sygpu-driver"), BootState::TestStarted);
        assert_eq!(boot_state(STARTED, "sygpu-driver"), BootState::TestStarted);
        // A test that is not in the image still ends the boot (it fails with rc 127).
        let missing = "GUEST: test nosuch not found\n";
        assert_eq!(boot_state(missing, "nosuch"), BootState::TestStarted);
        // Another test's marker is not this one's.
        let other = format!("GUEST: test hotplug start args=\n{TIMER_PANIC}");
        assert!(matches!(
            boot_state(&other, "sygpu-driver"),
            BootState::Panicked(_)
        ));
    }

    #[test]
    fn a_boot_still_running_is_neither() {
        assert_eq!(boot_state("", "sygpu-driver"), BootState::Booting);
        let head: String = STARTED.lines().take(2).map(|l| format!("{l}\n")).collect();
        assert_eq!(boot_state(&head, "sygpu-driver"), BootState::Booting);
        // Lines QEMU is still writing do not count yet.
        let partial = "GUEST: test sygpu-driver sta";
        assert_eq!(boot_state(partial, "sygpu-driver"), BootState::Booting);
        let partial = "[    0.6] Kernel panic - not syncing: timer doesn't";
        assert_eq!(boot_state(partial, "sygpu-driver"), BootState::Booting);
    }

    #[test]
    fn an_l2s_lines_in_an_l1_console_are_not_the_l1s() {
        let l2: String = TIMER_PANIC
            .lines()
            .map(|l| format!("L2[vm1]: {l}\n"))
            .collect();
        assert_eq!(boot_state(&l2, "nested"), BootState::Booting);
        let l2_started = "L2[vm1]: GUEST: test nested start args=\n";
        assert_eq!(
            boot_state(&format!("{l2_started}{TIMER_PANIC}"), "nested"),
            BootState::Panicked(
                "[    0.634567] Kernel panic - not syncing: timer doesn't work through \
                 Interrupt-remapped IO-APIC"
                    .into()
            )
        );
    }
}
