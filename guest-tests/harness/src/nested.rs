//! Booting the nested host (L1) and telling faults of the nested virtualization under TCG
//! from failures of the code under test.
//!
//! L0 emulates AMD SVM in TCG; L1's KVM runs L2 on it. That stack has faults of its own, seen
//! in CI and reproduced locally with and without a worker kill, whatever the L2 was doing. All
//! look like an interrupt taken where it must be held (IF or GIF clear): in the window after a
//! world switch where the GS base is not yet the kernel's, or inside an IRQ-off critical
//! section whose lock the handler then wants. L2s booted by QEMU in x2APIC mode hit them in
//! most runs of the passthrough test; `nox2apic` makes them rarer, yet about one L1 boot in
//! three still hits one (CI included):
//!
//! * A kernel, L1's (in a KVM vCPU thread, in `init`) or an L2's (in `swapper` during early
//!   boot, before any driver touched the device), crashes in its own page fault handler:
//!   running on the *user* GS base, so `current` reads as NULL and the handler faults on
//!   `current->mm` (`exc_page_fault+0x21`, `RBP` 0x900, the offset of `mm`) until the stack
//!   guard page; or with an *L1* kernel address in L2's CR2 (the page fault recursing at
//!   `exc_page_fault+0x19` into a double fault). Nothing in user space (none of Switchyard's)
//!   and no device can swap a kernel's GS base or put L1's addresses into L2's CR2: L0's
//!   emulation of the world switch leaks state.
//! * An L2's only vCPU spins in kernel mode with interrupts off (seen: in
//!   `native_queued_spin_lock_slowpath`; on one CPU the lock can never be freed) while its
//!   VMM answers QMP and its vCPU thread is running guest code, not waiting for a vfio-user
//!   reply.
//!
//! * An L2 triple-faults (its VMM says so: cloud-hypervisor's `Guest likely triple-faulted`,
//!   KVM's shutdown exit) right after its driver finished with the device: the driver's last
//!   words are `SYGPU: shutdown: ... bus master off` and `SYGPU: done: pass`, and the L2 says
//!   nothing more before it reboots. With bus mastering off the device cannot write guest
//!   memory (the softgpu's engines are gated by it), so nothing of ours can have corrupted the
//!   CPU state a triple fault needs (seen once in CI's cloud-hypervisor hot-plug scenario).
//! * L1's kernel finds a kernel stack corrupted: `corrupted stack end detected inside
//!   scheduler` in a KVM vCPU thread (`Comm: vcpu0`) of an L2's VMM, or `Thread overran stack,
//!   or stack corrupted` with the idle task jumping to a small address (`RIP: 0010:0x10`,
//!   `swapper/0`), each right after an L2 started (seen in the cloud-hypervisor pool scenario
//!   and in the QEMU/KVM one). User space (a VMM, Switchyard) cannot write a kernel stack; L1's
//!   own kernel code does not either without the emulated world switch under it.
//! * L1's stack protector finds a kernel stack corrupted (`Kernel panic - not syncing:
//!   stack-protector: Kernel stack is corrupted in: __schedule`) within
//!   [`STACK_PROTECTOR_WINDOW`] of L1's clock after `sy-nested` started an L2's VMM (it says
//!   when: `NESTED: start L2[NAME] at L1 uptime S s`), the same fault class (seen in CI beside
//!   two busy loops, in the physical-devices scenario). The same message in an L2, before any
//!   L2 started, or later than the window after the last one did, is not this signature and
//!   fails the test.
//!
//! * L1 triple-faults after an L2 started: its QEMU logs `Triple fault` (`-d cpu_reset`) and,
//!   with `-no-reboot`, exits without a word from L1's kernel. Nothing in L1's user space can
//!   make its kernel lose its CPU state without a crash report; the emulated world switch can.
//!   (Suspected, not yet seen in a log: CI once had an L1 end in the physical-devices scenario
//!   with exit status 0, no panic, no `GUEST: poweroff`; the reset log says from now on
//!   whether it was this.)
//!
//! [`boot_nested`] boots L1 again after any of these signatures (at most [`NESTED_ATTEMPTS`] boots in
//! all), says so on stderr (`NESTED-FAULT:`, shown even when the test passes) and keeps each
//! failed boot's console as `serial.attempt-N.log`. Anything else fails at once: wrong
//! results, other kernel crashes, a VMM waiting on the server, an L2 stopped in user space or
//! with interrupts enabled, an L1 that hung.

use std::fs;
use std::io::Write;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use crate::{Guest, GuestEnv, GuestOutput, GuestSpec, HarnessError, Result};

/// L1 boots a nested test may take when the earlier ones hit a [`nested_fault`].
pub const NESTED_ATTEMPTS: u32 = 5;

/// Boots L1 with `spec` and waits for it to power off, booting it again (up to
/// [`NESTED_ATTEMPTS`] in all) when a boot hit a fault of the nested virtualization (see the
/// module docs). The console is watched while L1 runs: a boot with a fault is stopped at once
/// (an L1 whose kernel crashed may hang rather than reboot). Returns the last boot's outcome.
pub fn boot_nested(env: &GuestEnv, dir: &Path, spec: &GuestSpec) -> Result<GuestOutput> {
    let mut attempt = 1;
    loop {
        let started = Instant::now();
        let mut guest = Guest::boot(env, dir, spec)?;
        let mut fault = None;
        while guest.exited().is_none() && started.elapsed() < spec.timeout {
            fault = nested_fault(&guest.serial_text());
            if fault.is_some() {
                break;
            }
            thread::sleep(Duration::from_secs(1));
        }
        let fault = match fault {
            Some(fault) => {
                // A moment to finish printing (or to reboot), then L1 is stopped.
                let grace = Instant::now();
                while guest.exited().is_none() && grace.elapsed() < Duration::from_secs(15) {
                    thread::sleep(Duration::from_millis(200));
                }
                drop(guest);
                fault
            }
            None => {
                let out = guest.wait();
                let serial = fs::read_to_string(dir.join("serial.log")).unwrap_or_default();
                let qemu = fs::read_to_string(dir.join("qemu.log")).unwrap_or_default();
                let fault = nested_fault(&serial).or_else(|| {
                    out.is_err()
                        .then(|| l1_triple_fault(&serial, &qemu))
                        .flatten()
                });
                match fault {
                    Some(fault) => fault,
                    None => return out,
                }
            }
        };
        if attempt == NESTED_ATTEMPTS {
            return Err(HarnessError::Unclean(format!(
                "all {NESTED_ATTEMPTS} L1 boots hit a fault of the nested virtualization; \
                 the last: {fault}"
            )));
        }
        let kept = dir.join(format!("serial.attempt-{attempt}.log"));
        let _ = fs::rename(dir.join("serial.log"), &kept);
        // Past the test harness's capture: said even when a later boot passes.
        let _ = writeln!(
            std::io::stderr(),
            "NESTED-FAULT: L1 boot {attempt} of {NESTED_ATTEMPTS} hit a fault of the nested \
             virtualization, not of the code under test: {fault}; its console is kept in {}; \
             booting L1 again",
            kept.display()
        );
        attempt += 1;
    }
}

/// What L0's QEMU logs (`-d cpu_reset`, which [`GuestSpec::nested`](crate::GuestSpec::nested)
/// turns on) when L1 itself triple-faults. An L2's triple fault is not this: L0 turns it into
/// a shutdown exit to L1's KVM.
pub const L1_TRIPLE_FAULT: &str = "Triple fault";

/// L1 triple-faulting (its QEMU reset it and, with `-no-reboot`, exited: no kernel message
/// and no `GUEST: poweroff`) after an L2 started: L1's kernel did not crash by itself (it
/// would have said so), its CPU state was lost in the emulated world switch (see the module
/// docs). Before any L2 started it is not this signature.
fn l1_triple_fault(serial: &str, qemu_log: &str) -> Option<String> {
    if !qemu_log.lines().any(|l| l.trim() == L1_TRIPLE_FAULT) {
        return None;
    }
    let lines: Vec<&str> = serial.lines().map(str::trim).collect();
    let (name, at) = lines.iter().rev().find_map(|l| l2_started(l))?;
    Some(format!(
        "L1 triple-faulted (its QEMU logged `{L1_TRIPLE_FAULT}`) after L2[{name}] started at L1 \
         uptime {at} s"
    ))
}

/// What a kernel oops shows when the page fault handler itself faulted (Debian's 6.12 build,
/// which L1 and L2 boot): RIP in `exc_page_fault` or `error_entry`, the handler's read of
/// `current->mm` in a backtrace (`+0x21`), or `RBP` holding that offset (0x900, `current`
/// read as NULL).
const PF_HANDLER_FAULTED: [&str; 4] = [
    "RIP: 0010:exc_page_fault+",
    "RIP: 0010:error_entry+",
    "exc_page_fault+0x21/",
    "RBP: 0000000000000900",
];

/// The fault of the nested virtualization a console shows, if any (see the module docs).
pub fn nested_fault(serial: &str) -> Option<String> {
    let lines: Vec<&str> = serial.lines().map(str::trim).collect();
    // A kernel (L1's, or an L2's: its lines are prefixed `L2[name]: `) whose page fault
    // handler faulted.
    for (i, l) in lines.iter().enumerate() {
        let (who, text) = match l.strip_prefix("L2[").and_then(|r| r.split_once("]: ")) {
            Some((name, text)) => (format!("L2[{name}]"), text),
            None => ("L1".to_owned(), *l),
        };
        if !(text.contains("] BUG: ") || text.contains("] Oops: ")) {
            continue;
        }
        let prefix = format!("{who}: ");
        let mut block = lines.iter().skip(i).take(80).filter(|b| {
            if who == "L1" {
                !b.starts_with("L2[")
            } else {
                b.starts_with(&prefix)
            }
        });
        if block.any(|b| PF_HANDLER_FAULTED.iter().any(|f| b.contains(f))) {
            return Some(format!(
                "{who}'s kernel crashed in its own page fault handler: {text}"
            ));
        }
    }
    if let Some(f) = l2_triple_fault_after_its_driver(&lines) {
        return Some(f);
    }
    if let Some(f) = l1_vcpu_stack_corrupted(&lines) {
        return Some(f);
    }
    if let Some(f) = l1_stack_protector_after_l2_start(&lines) {
        return Some(f);
    }
    // L2 spinning in its kernel with interrupts off, its VMM alive (the diagnosis sy-nested
    // prints when an L2 stops making progress).
    lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("NESTED: diagnosis of L2["))
        .find_map(|(i, header)| {
            let block: Vec<&str> = lines[i + 1..]
                .iter()
                .take_while(|l| !l.starts_with("NESTED: diagnosis of") && !l.starts_with("NESTED-"))
                .copied()
                .collect();
            l2_spinning(header, &block)
        })
}

/// L1's kernel finding a kernel stack corrupted (see the module docs).
fn l1_vcpu_stack_corrupted(lines: &[&str]) -> Option<String> {
    const SIGNS: [&str; 2] = [
        "Kernel panic - not syncing: corrupted stack end detected inside scheduler",
        "Thread overran stack, or stack corrupted",
    ];
    lines.iter().enumerate().find_map(|(i, l)| {
        if l.starts_with("L2[") || !SIGNS.iter().any(|s| l.contains(s)) {
            return None;
        }
        let comm = lines[i + 1..]
            .iter()
            .take(4)
            .find_map(|b| b.split_once(" Comm: "))
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("a task");
        Some(format!(
            "L1's kernel found the kernel stack of {comm} corrupted: {l}"
        ))
    })
}

/// How long (seconds of L1's clock) after `sy-nested` started an L2's VMM L1's stack protector
/// finding a kernel stack corrupted is a fault of the nested virtualization: an L2's boot, when
/// its world switches are the most frequent, with room for a loaded host (see the module docs).
pub const STACK_PROTECTOR_WINDOW: f64 = 30.0;

/// L1's stack protector finding a kernel stack corrupted right after an L2 started (see the
/// module docs).
fn l1_stack_protector_after_l2_start(lines: &[&str]) -> Option<String> {
    const SIGN: &str = "Kernel panic - not syncing: stack-protector: Kernel stack is corrupted in:";
    // The last L2 started so far: its name and L1's uptime then.
    let mut started: Option<(&str, f64)> = None;
    for l in lines {
        if let Some(start) = l2_started(l) {
            started = Some(start);
            continue;
        }
        if l.starts_with("L2[") || !l.contains(SIGN) {
            continue;
        }
        let (Some((name, at)), Some(t)) = (started, kernel_time(l)) else {
            continue;
        };
        // Console order puts the panic after the start; the two clocks may differ a little.
        if (-1.0..=STACK_PROTECTOR_WINDOW).contains(&(t - at)) {
            return Some(format!(
                "L1's stack protector found a kernel stack corrupted {:.1} s after L2[{name}] \
                 started: {l}",
                (t - at).max(0.0)
            ));
        }
    }
    None
}

/// The L2 and L1's uptime in a `sy-nested` line `NESTED: start L2[NAME] at L1 uptime S s: ...`.
fn l2_started(line: &str) -> Option<(&str, f64)> {
    let (name, rest) = line
        .strip_prefix("NESTED: start L2[")?
        .split_once("] at L1 uptime ")?;
    let (secs, _) = rest.split_once(" s:")?;
    Some((name, secs.parse().ok()?))
}

/// The timestamp of a kernel console line (`[   45.175589] ...`), in seconds since boot.
fn kernel_time(line: &str) -> Option<f64> {
    let (t, _) = line.strip_prefix('[')?.split_once(']')?;
    t.trim().parse().ok()
}

/// What cloud-hypervisor logs when KVM reports its guest's shutdown (a triple fault).
const TRIPLE_FAULT: &str = "Guest likely triple-faulted";

/// An L2 whose VMM reported a triple fault (in the VMM log sy-nested prints, `<dir>/NAME-ch.log`)
/// and whose console's last words before it said nothing more were its driver's, done with the
/// device and bus mastering off (see the module docs).
fn l2_triple_fault_after_its_driver(lines: &[&str]) -> Option<String> {
    let mut section: Option<&str> = None;
    for l in lines {
        if let Some(path) = l
            .strip_prefix("NESTED: ==== ")
            .and_then(|r| r.strip_suffix(" ===="))
        {
            section = path
                .rsplit('/')
                .next()
                .and_then(|f| f.strip_suffix("-ch.log"));
            continue;
        }
        let Some(name) = section.filter(|_| l.contains(TRIPLE_FAULT)) else {
            continue;
        };
        let prefix = format!("L2[{name}]: ");
        let said: Vec<&str> = lines
            .iter()
            .filter_map(|l| l.strip_prefix(prefix.as_str()))
            .collect();
        // The driver's shutdown, then its verdict, then nothing but a new boot.
        let done = said
            .iter()
            .rposition(|t| t.starts_with("SYGPU: done: pass"))?;
        let shut_down = done
            .checked_sub(1)
            .and_then(|i| said.get(i))
            .is_some_and(|t| t.starts_with("SYGPU: shutdown:") && t.contains("bus master off"));
        let then = said.get(done + 1);
        if shut_down && then.is_none_or(|t| t.starts_with("GUEST: boot ")) {
            return Some(format!(
                "L2[{name}] triple-faulted after its driver had turned bus mastering off and finished"
            ));
        }
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
    use super::{
        L1_TRIPLE_FAULT, STACK_PROTECTOR_WINDOW, TRIPLE_FAULT, l1_triple_fault, nested_fault,
    };

    #[test]
    fn l1_triple_faulting_after_an_l2_started_is_a_nested_fault_but_not_before() {
        let serial = "NESTED: start L2[vm2-edu0] at L1 uptime 120.5 s: /usr/bin/qemu -accel kvm\n\
                      L2[vm2-edu0]: [    1.0] Linux version 6.12\n";
        let qemu =
            format!("CPU Reset (CPU 0)\nEAX=00000000\n{L1_TRIPLE_FAULT}\nCPU Reset (CPU 0)\n");
        let f = l1_triple_fault(serial, &qemu).expect("a nested fault");
        assert!(f.contains("L2[vm2-edu0]") && f.contains("120.5"), "{f}");
        assert_eq!(
            l1_triple_fault(serial, "CPU Reset (CPU 0)\n"),
            None,
            "no triple fault"
        );
        assert_eq!(
            l1_triple_fault("GUEST: test nested start args=pool-edu\n", &qemu),
            None,
            "before any L2 started"
        );
    }

    /// L1 beside two busy loops (issue 33's panic line): an L2's QEMU started in the
    /// physical-devices scenario, then L1's stack protector fires.
    const L1_STACK_PROTECTOR: &str = "\
NESTED: start L2[edu] at L1 uptime 61.37 s: /usr/bin/qemu -accel kvm -cpu host -m 512
[   63.402518] Kernel panic - not syncing: stack-protector: Kernel stack is corrupted in: __schedule+0x1046/0x1050
[   63.403311] CPU: 1 UID: 0 PID: 0 Comm: swapper/1 Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
";

    #[test]
    fn l1s_stack_protector_right_after_an_l2_started_is_a_nested_fault() {
        let f = nested_fault(L1_STACK_PROTECTOR).expect("a nested fault");
        assert!(
            f.contains("L2[edu]") && f.contains("2.0 s after") && f.contains("__schedule"),
            "{f}"
        );
        // Near the window's end, still.
        let edge = L1_STACK_PROTECTOR.replace("[   63.402518]", "[   91.360000]");
        assert!(nested_fault(&edge).is_some(), "{edge}");
    }

    #[test]
    fn the_stack_protector_elsewhere_is_not() {
        // The same message in an L2's kernel.
        let l2 = L1_STACK_PROTECTOR.replace("[   63.", "L2[edu]: [    3.");
        assert_eq!(nested_fault(&l2), None);
        // In L1 before any L2 started (the start line after it, or none).
        let lines: Vec<&str> = L1_STACK_PROTECTOR.lines().collect();
        let before = format!("{}\n{}\n{}\n", lines[1], lines[2], lines[0]);
        assert_eq!(nested_fault(&before), None);
        let no_l2 = format!("{}\n{}\n", lines[1], lines[2]);
        assert_eq!(nested_fault(&no_l2), None);
        // Later than the window after the last L2 started.
        let late_at = 61.37 + STACK_PROTECTOR_WINDOW + 5.0;
        let late = L1_STACK_PROTECTOR.replace("[   63.402518]", &format!("[{late_at:12.6}]"));
        assert_eq!(nested_fault(&late), None, "{late}");
        // A start line that does not say when (an older sy-nested) times nothing.
        let untimed = L1_STACK_PROTECTOR.replace("L2[edu] at L1 uptime 61.37 s: ", "");
        assert_eq!(nested_fault(&untimed), None);
        // Another panic in the window is not this signature.
        let other = L1_STACK_PROTECTOR.replace(
            "stack-protector: Kernel stack is corrupted in: __schedule+0x1046/0x1050",
            "Attempted to kill init! exitcode=0x00000009",
        );
        assert_eq!(nested_fault(&other), None);
    }

    /// L1, CI: an L2's cloud-hypervisor vCPU thread, right after the L2 started.
    const L1_VCPU_STACK: &str = "\
NESTED: start /usr/bin/cloud-hypervisor --kernel /l2/vmlinux --user-device socket=/tmp/vm1.sock,id=gpu0
[   45.175589] Kernel panic - not syncing: corrupted stack end detected inside scheduler
[   45.176519] CPU: 0 UID: 0 PID: 245 Comm: vcpu0 Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
[   45.177025] Hardware name: QEMU Standard PC (Q35 + ICH9, 2009), BIOS 1.17.0-debian-1.17.0-1~bpo13+1 04/01/2014
[   45.179203]  panic+0x118/0x2db
";

    /// L1, CI: its idle task, right after an L2's QEMU started.
    const L1_IDLE_STACK: &str = "\
[   10.270408] BUG: kernel NULL pointer dereference, address: 0000000000000010
[   10.272572] #PF: supervisor instruction fetch in kernel mode
[   10.273344] Thread overran stack, or stack corrupted
[   10.273523] Oops: Oops: 0010 [#1] PREEMPT SMP NOPTI
[   10.273986] CPU: 0 UID: 0 PID: 0 Comm: swapper/0 Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
[   10.274582] RIP: 0010:0x10
[   10.281763] Kernel panic - not syncing: Attempted to kill the idle task!
";

    #[test]
    fn a_corrupted_kernel_stack_in_l1_is_a_nested_fault_but_not_in_l2() {
        let f = nested_fault(L1_VCPU_STACK).expect("a nested fault");
        assert!(f.contains("vcpu0"), "{f}");
        let f = nested_fault(L1_IDLE_STACK).expect("a nested fault");
        assert!(f.contains("swapper/0"), "{f}");
        // A plain NULL dereference in L1, without the stack's corruption, is not.
        let plain = L1_IDLE_STACK.replace(
            "[   10.273344] Thread overran stack, or stack corrupted\n",
            "",
        );
        assert_eq!(nested_fault(&plain), None);
        // Nor the stack's corruption in an L2's kernel.
        let l2: String = L1_VCPU_STACK
            .lines()
            .map(|l| format!("L2[pool]: {l}\n"))
            .collect();
        assert_eq!(nested_fault(&l2), None);
    }

    /// L1, CI: the KVM vCPU thread of an L2's QEMU.
    const L1_OOPS: &str = "\
[  168.513923] BUG: TASK stack guard page was hit at 000000006d99a20d (stack is 000000007ad79fe4..000000000e8006f9)
[  168.517675] Oops: stack guard page: 0000 [#1] PREEMPT SMP NOPTI
[  168.518663] CPU: 0 UID: 0 PID: 389 Comm: CPU 0/KVM Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
[  168.519214] RIP: 0010:exc_page_fault+0x21/0x180
[  168.520733] RSP: 0018:ffffc900007a0000 EFLAGS: 00000093
[  168.521304] RBP: 0000000000000900 R08: 0000000000000000 R09: 0000000000000000
[  168.521443] FS:  0000000000000000(0000) GS:ffff88813cc00000(0000) knlGS:0000000000000000
";

    /// An L2 in early boot, locally.
    const L2_OOPS: &str = "\
L2[vm2-remove]: [    3.383344] BUG: TASK stack guard page was hit at (____ptrval____) (stack is (____ptrval____)..(____ptrval____))
L2[vm2-remove]: [    3.383344] Oops: stack guard page: 0000 [#1] PREEMPT SMP NOPTI
L2[vm2-remove]: [    3.383344] CPU: 0 UID: 0 PID: 1 Comm: swapper/0 Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
[   50.000000] kvm: kvm [384]: vcpu0, guest rIP: 0xffffffff81099068 Unhandled WRMSR(0xc0010007) = 0xffff
L2[vm2-remove]: [    3.383344] RIP: 0000:0x0
L2[vm2-remove]: [    3.383344] RBP: 0000000000000900 R08: 0000000000000000 R09: 0000000000000000
";

    /// An L2 whose CR2 held an L1 address: the handler recursing into a double fault.
    const L2_DF: &str = "\
L2[vm1-edu0]: [    5.910149] BUG: #DF stack guard page was hit at 000000002770d38a (stack is 000000006e24c6f4..00000000819ab764)
L2[vm1-edu0]: [    5.910149] Oops: stack guard page: 0000 [#1] PREEMPT SMP NOPTI
L2[vm1-edu0]: [    5.910149] CPU: 0 UID: 0 PID: 1 Comm: swapper/0 Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
L2[vm1-edu0]: [    5.910149] RIP: 0010:exc_page_fault+0x19/0x180
L2[vm1-edu0]: [    5.910149] RBP: ffff88813cc351c0 R08: 0000000000000000 R09: 0000000000000000
";

    /// A kernel crash of another kind (a NULL dereference in a driver).
    const OTHER_OOPS: &str = "\
[   87.339692] BUG: kernel NULL pointer dereference, address: 0000000000000010
[   87.343166] CPU: 0 UID: 0 PID: 1 Comm: init Not tainted 6.12.117+deb13-amd64 #1  Debian 6.12.117-1
[   87.344011] RIP: 0010:vfio_pci_core_read+0x1a/0x60 [vfio_pci_core]
[   87.346123] RBP: ffffc90000017a00 R08: 000000000000005f R09: 0000000000000001
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
    fn a_kernel_faulting_in_its_page_fault_handler_is_a_nested_fault_in_l1_or_l2() {
        let f = nested_fault(L1_OOPS).expect("L1");
        assert!(
            f.starts_with("L1's kernel") && f.contains("stack guard page"),
            "{f}"
        );
        let f = nested_fault(L2_OOPS).expect("L2");
        assert!(f.starts_with("L2[vm2-remove]'s kernel"), "{f}");
        let f = nested_fault(L2_DF).expect("L2 #DF");
        assert!(f.starts_with("L2[vm1-edu0]'s kernel"), "{f}");
    }

    #[test]
    fn other_kernel_crashes_are_not() {
        assert_eq!(nested_fault(OTHER_OOPS), None);
        // The fingerprint has to be in the crashing kernel's own lines.
        let mixed = format!("{}L2[vm]: [ 1.0] RBP: 0000000000000900\n", OTHER_OOPS);
        assert_eq!(nested_fault(&mixed), None);
    }

    #[test]
    fn an_l2_spinning_with_interrupts_off_is_a_nested_fault() {
        let f = nested_fault(L2_SPIN).expect("a fault");
        assert!(
            f.contains("L2[vm-1]") && f.contains("native_queued_spin_lock_slowpath"),
            "{f}"
        );
    }

    /// CI, the cloud-hypervisor hot-plug scenario: the L2 triple-faulted right after its
    /// driver's second round.
    const L2_TRIPLE: &str = "\
L2[hot]: HOTPLUG: present round=2 bdf=0000:00:02.0
L2[hot]: SYGPU: step final: ok (7 ms): FENCE_COUNT 26 matches; all queues idle
L2[hot]: SYGPU: doorbells: trapped, 36 submissions, 0 kicks
L2[hot]: SYGPU: shutdown: queues reset, bus master off, device enable restored if this run set it, hugepages freed
L2[hot]: SYGPU: done: pass in 1468 ms
[   33.814571] kvm: kvm [216]: vcpu0, guest rIP: 0xffffffff81099068 Unhandled WRMSR(0xc0010007) = 0xffff
NESTED: diagnosis of L2[hot] (VMM pid 216):
NESTED:   task 216 `cloud-hyperviso` state=S wchan=futex_wait_queue syscall=202
NESTED: ==== /tmp/nested/ch-hotplug/hot-ch.log ====
cloud-hypervisor:   0.684886s: <vcpu0> WARN:vmm/src/cpu.rs:278 -- Kernel lacks CONFIG_SCHED_CORE support - no SMT isolation
cloud-hypervisor:  12.135395s: <vcpu0> ERROR:hypervisor/src/kvm/mod.rs:2587 -- Guest likely triple-faulted
NESTED: ==== /tmp/nested/ch-hotplug/hot-serial.log ====
SYGPU: done: pass in 943 ms
NESTED-RESULT {\"ok\":false,\"scenario\":\"ch-hotplug\"}
";

    #[test]
    fn an_l2_triple_faulting_after_its_driver_finished_is_a_nested_fault() {
        let f = nested_fault(L2_TRIPLE).expect("a fault");
        assert!(f.starts_with("L2[hot] triple-faulted"), "{f}");
        let rebooted = L2_TRIPLE.replace(
            "[   33.814571]",
            "L2[hot]: GUEST: boot kernel=6.12 test=hotplug\n[   33.814571]",
        );
        assert!(nested_fault(&rebooted).is_some(), "then a new boot");
    }

    #[test]
    fn an_l2_triple_faulting_while_its_device_could_write_is_not() {
        // The driver still ran (no verdict), failed, or bus mastering was still on; or the L2
        // said more after its driver: any of these and the device may have been the cause.
        let running = L2_TRIPLE.replace("L2[hot]: SYGPU: done: pass in 1468 ms\n", "");
        assert_eq!(nested_fault(&running), None);
        let failed = L2_TRIPLE.replace("SYGPU: done: pass", "SYGPU: done: FAIL");
        assert_eq!(nested_fault(&failed), None);
        let bus_master = L2_TRIPLE.replace("bus master off, ", "");
        assert_eq!(nested_fault(&bus_master), None);
        let more = L2_TRIPLE.replace(
            "[   33.814571]",
            "L2[hot]: HOTPLUG: run round=2 rc=0\n[   33.814571]",
        );
        assert_eq!(nested_fault(&more), None);
        // No triple fault reported, or reported for another L2.
        let no_triple = L2_TRIPLE.replace(TRIPLE_FAULT, "Guest shut down");
        assert_eq!(nested_fault(&no_triple), None);
        let other = L2_TRIPLE.replace("hot-ch.log", "vm-ch.log");
        assert_eq!(nested_fault(&other), None);
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
