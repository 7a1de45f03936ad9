//! How L1 boots an L2 and reads what it reports: the kernel command line, a cloud-hypervisor
//! [`VmSpec`], and an L2 test's rc and JSON summary lines.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;
use switchyard_qemu::GUEST_BOOT_ARGS;

use crate::procs::{Vm, VmSpec};
use crate::{
    CLOUD_HYPERVISOR, EDU_TIMEOUT, L2_CMDLINE, L2_INITRAMFS, L2_KERNEL, L2_MEMORY_MIB, L2_TIMEOUT,
};

/// Set by `--l2-verbose`: L2 boots without `quiet` (kernel messages with timestamps).
pub static L2_VERBOSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn l2_cmdline(test: &str, args: &[&str]) -> String {
    let mut c = format!("{L2_CMDLINE} {GUEST_BOOT_ARGS} sy.test={test}");
    if L2_VERBOSE.load(std::sync::atomic::Ordering::Relaxed) {
        c = c.replace(" quiet", "");
    }
    for a in args {
        c.push_str(" sy.arg=");
        c.push_str(a);
    }
    c
}

pub fn l2_spec(name: &str, cmdline: String) -> VmSpec<'_> {
    VmSpec {
        name,
        binary: Path::new(CLOUD_HYPERVISOR),
        kernel: Path::new(L2_KERNEL),
        initramfs: Path::new(L2_INITRAMFS),
        cmdline,
        memory_mib: L2_MEMORY_MIB,
        user_devices: vec![],
        api_socket: None,
        vfio_devices: vec![],
        extra_args: vec![],
    }
}

pub fn json_after(line: &str, prefix: &str) -> Result<Value> {
    let j = line
        .strip_prefix(prefix)
        .with_context(|| format!("`{line}` does not start with `{prefix}`"))?;
    serde_json::from_str(j.trim()).with_context(|| format!("bad JSON after `{prefix}`"))
}

/// Waits for an L2 test's rc line and its JSON summary line, then for the VMM to exit.
pub fn l2_outcome(vm: &mut Vm, test: &str, summary: &str) -> Result<(i32, Value, Option<i32>)> {
    let timeout = if test == "sy-edu" {
        EDU_TIMEOUT
    } else {
        L2_TIMEOUT
    };
    let rc_line = vm.wait_line(&format!("GUEST: test {test} rc="), timeout)?;
    let rc: i32 = rc_line
        .rsplit('=')
        .next()
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("bad rc line `{rc_line}`"))?;
    let s = match vm.find_line(summary) {
        Some(l) => json_after(&l, summary)?,
        None => Value::Null,
    };
    let status = vm.wait_exit(Duration::from_secs(60))?;
    Ok((rc, s, status.code()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l2s_boot_with_the_arguments_for_a_loaded_tcg_host() {
        let c = l2_cmdline("sygpu-driver", &["--noiommu"]);
        let words: Vec<&str> = c.split_whitespace().collect();
        assert!(words.contains(&"no_timer_check"), "{c}");
        assert!(words.contains(&"sy.test=sygpu-driver"), "{c}");
        assert_eq!(words.last(), Some(&"sy.arg=--noiommu"), "{c}");
    }
}
