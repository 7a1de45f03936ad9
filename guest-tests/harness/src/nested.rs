//! Booting the nested host (L1) and telling faults of the nested virtualization under TCG
//! from failures of the code under test.
//!
//! L0 emulates AMD SVM in TCG; L1's KVM runs L2 on it. That stack has faults of its own, seen
//! in CI and reproduced locally at a rate of roughly one in ten L2 boots with a
//! passthrough device, with and without a worker kill:
//!
//! * L1's kernel oopses in a KVM vCPU thread (`Comm: CPU 0/KVM`): a page fault recursing until
//!   the stack guard page, with `knlGS` 0 and the per-CPU base swapped out. The kernel was
//!   running on the *user* GS base after a world switch, which no user-space program (and
//!   nothing of Switchyard's) can cause.
//! * L2's only vCPU spins in kernel mode with interrupts off (seen: in
//!   `native_queued_spin_lock_slowpath`, on a one-CPU guest, so the lock can never be freed)
//!   while its VMM answers QMP and its vCPU thread is running guest code, not waiting for a
//!   vfio-user reply.
//!
//! [`boot_nested`] retries the L1 boot after either signature (at most [`NESTED_ATTEMPTS`]
//! boots in all), says so on stderr, and keeps each failed attempt's console as
//! `serial.attempt-N.log`. Anything else fails at once: wrong results, a VMM waiting on the
//! server, an L2 that stopped in user space or with interrupts enabled, an L1 that hung.

use std::fs;
use std::path::Path;

use crate::{Guest, GuestEnv, GuestOutput, GuestSpec, HarnessError, Result};

/// L1 boots a nested test may take when the earlier ones hit a [`nested_fault`].
pub const NESTED_ATTEMPTS: u32 = 3;

/// Boots L1 with `spec` and waits for it to power off, booting it again (up to
/// [`NESTED_ATTEMPTS`] in all) when a boot ended in a fault of the nested virtualization (see
/// the module docs). Returns the last boot's outcome.
pub fn boot_nested(env: &GuestEnv, dir: &Path, spec: &GuestSpec) -> Result<GuestOutput> {
    let mut attempt = 1;
    loop {
        let out = Guest::boot(env, dir, spec).and_then(Guest::wait);
        let serial = fs::read_to_string(dir.join("serial.log")).unwrap_or_default();
        let fault = nested_fault(&serial);
        match fault {
            Some(fault) if attempt < NESTED_ATTEMPTS => {
                let kept = dir.join(format!("serial.attempt-{attempt}.log"));
                let _ = fs::rename(dir.join("serial.log"), &kept);
                eprintln!(
                    "NESTED-FAULT: L1 boot {attempt} of {NESTED_ATTEMPTS} hit a fault of the \
                     nested virtualization, not of the code under test: {fault}; its console is \
                     kept in {}; booting L1 again",
                    kept.display()
                );
                attempt += 1;
            }
            Some(fault) => {
                return Err(HarnessError::Unclean(format!(
                    "all {NESTED_ATTEMPTS} L1 boots hit a fault of the nested virtualization; \
                     the last: {fault}"
                )));
            }
            None => return out,
        }
    }
}

/// The fault of the nested virtualization a console shows, if any (see the module docs).
pub fn nested_fault(serial: &str) -> Option<String> {
    let lines: Vec<&str> = serial.lines().map(str::trim).collect();
    // L1's kernel oopsing in a KVM vCPU thread (L2 lines are prefixed `L2[name]:`).
    for (i, l) in lines.iter().enumerate() {
        let l1 = !l.starts_with("L2[");
        if l1 && (l.contains("] BUG: ") || l.contains("] Oops: ")) {
            let comm = lines
                .iter()
                .skip(i)
                .take(6)
                .find_map(|c| c.split_once(" Comm: ").map(|(_, rest)| rest));
            if let Some(comm) = comm
                && comm.starts_with("CPU ")
                && comm.contains("/KVM")
            {
                return Some(format!("L1's kernel crashed in a KVM vCPU thread: {l}"));
            }
        }
    }
    // L2 spinning in its kernel with interrupts off, its VMM alive (the diagnosis sy-nested
    // prints when an L2 stops making progress).
    let mut start = 0;
    while let Some(pos) = lines[start..]
        .iter()
        .position(|l| l.starts_with("NESTED: diagnosis of L2["))
    {
        let block_start = start + pos;
        let block: Vec<&str> = lines[block_start + 1..]
            .iter()
            .take_while(|l| !l.starts_with("NESTED: diagnosis of") && !l.starts_with("NESTED-"))
            .copied()
            .collect();
        if let Some(f) = l2_spinning(lines[block_start], &block) {
            return Some(f);
        }
        start = block_start + 1;
    }
    None
}

/// One diagnosis block: the vCPU thread running (`state=R`), registers read over QMP with
/// CPL 0 and IF clear, and RIP in a kernel symbol.
fn l2_spinning(header: &str, block: &[&str]) -> Option<String> {
    let vcpu_running = block.iter().any(|l| l.contains("/KVM` state=R"));
    let cpl0 = block.iter().any(|l| l.contains(" CPL=0 "));
    let rflags = block.iter().find_map(|l| {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix("RFL="))
            .and_then(|h| u64::from_str_radix(h, 16).ok())
    })?;
    let rip = block
        .iter()
        .find_map(|l| l.strip_prefix("NESTED:   L2 RIP="))?;
    let interrupts_off = rflags & (1 << 9) == 0;
    let in_kernel_symbol = rip.contains(" = ") && !rip.ends_with(" = ?");
    (vcpu_running && cpl0 && interrupts_off && in_kernel_symbol).then(|| {
        format!(
            "{} spins in its kernel with interrupts off, its VMM alive: RIP={rip}",
            header
                .trim_start_matches("NESTED: diagnosis of ")
                .trim_end_matches(':')
        )
    })
}

#[cfg(test)]
mod tests {
    use super::nested_fault;

    const L1_OOPS: &str = "\
[  168.513923] BUG: TASK stack guard page was hit at 000000006d99a20d (stack is 000000007ad79fe4..000000000e8006f9)
[  168.517675] Oops: stack guard page: 0000 [#1] PREEMPT SMP NOPTI
[  168.518663] CPU: 0 UID: 0 PID: 389 Comm: CPU 0/KVM Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
[  168.519214] RIP: 0010:exc_page_fault+0x21/0x180
";

    const L2_SPIN: &str = "\
NESTED: diagnosis of L2[vm-1] (VMM pid 316):
NESTED:   task 316 `ld-linux-x86-64` state=S wchan=do_sys_poll syscall=271
NESTED:   task 325 `CPU 0/KVM` state=R wchan=0 syscall=running
NESTED:   L2 registers:
RIP=ffffffff81d1e880 RFL=00000002 [-------] CPL=0 II=0 A20=1 SMM=0 HLT=0
NESTED:   L2 RIP=0xffffffff81d1e880 = native_queued_spin_lock_slowpath+0x70
NESTED-RESULT {\"ok\":false}
";

    #[test]
    fn an_l1_oops_in_a_kvm_vcpu_thread_is_a_nested_fault() {
        let f = nested_fault(L1_OOPS).expect("a fault");
        assert!(f.contains("stack guard page"), "{f}");
    }

    #[test]
    fn an_oops_elsewhere_or_in_l2_is_not() {
        let other = L1_OOPS.replace("Comm: CPU 0/KVM", "Comm: switchyard");
        assert_eq!(nested_fault(&other), None);
        let in_l2: String = L1_OOPS.lines().map(|l| format!("L2[vm]: {l}\n")).collect();
        assert_eq!(nested_fault(&in_l2), None);
    }

    #[test]
    fn an_l2_spinning_with_interrupts_off_is_a_nested_fault() {
        let f = nested_fault(L2_SPIN).expect("a fault");
        assert!(
            f.contains("L2[vm-1]") && f.contains("native_queued_spin_lock_slowpath"),
            "{f}"
        );
    }

    #[test]
    fn an_l2_waiting_on_its_vmm_or_with_interrupts_on_or_in_user_space_is_not() {
        let blocked = L2_SPIN.replace("`CPU 0/KVM` state=R", "`CPU 0/KVM` state=S");
        assert_eq!(
            nested_fault(&blocked),
            None,
            "the vCPU waits (on the server?)"
        );
        let irqs_on = L2_SPIN.replace("RFL=00000002", "RFL=00000246");
        assert_eq!(nested_fault(&irqs_on), None);
        let user = L2_SPIN.replace("CPL=0", "CPL=3");
        assert_eq!(nested_fault(&user), None);
        let no_regs: String = L2_SPIN
            .lines()
            .filter(|l| !l.starts_with("RIP=") && !l.contains("L2 RIP"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(nested_fault(&no_regs), None, "QMP did not answer");
    }
}
