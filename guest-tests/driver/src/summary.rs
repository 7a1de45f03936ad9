//! The machine-readable last lines: `SYGPU-SUMMARY {json}` (the VFIO run, [`Summary`]; the
//! no-IOMMU run, [`NoIommuSummary`]) and `SYGPU-PROBE {json}`.

use serde::Serialize;

/// `conclude`, `passed` and `line` of a workload summary (one with `result`, `reason`,
/// `steps`, `jobs_run`, `jobs_verified`, `error_test_ok`, `vram_mmap_ok` and `soak`).
macro_rules! workload_summary {
    ($t:ty) => {
        impl $t {
            /// Decides pass/fail: `failure` (the first error, if any) or any unmet criterion
            /// fails.
            pub fn conclude(&mut self, failure: Option<String>) {
                let reason = failure.or_else(|| {
                    unmet(
                        &self.steps,
                        self.jobs_run,
                        self.jobs_verified,
                        self.error_test_ok,
                        self.vram_mmap_ok,
                    )
                    .or_else(|| {
                        self.soak
                            .as_ref()
                            .filter(|s| !s.ok)
                            .map(|_| "soak did not pass".to_owned())
                    })
                });
                self.result = if reason.is_none() { "pass" } else { "fail" };
                self.reason = reason;
            }

            /// Whether the run passed.
            pub fn passed(&self) -> bool {
                self.result == "pass"
            }

            /// The `SYGPU-SUMMARY {json}` line.
            pub fn line(&self) -> String {
                json_line("SYGPU-SUMMARY", self)
            }
        }
    };
}

/// Interrupts received.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Interrupts {
    /// Eventfd signals per vector (index = vector): 16 MSI-X vectors, or the one MSI vector.
    pub per_vector: Vec<u64>,
    /// Sum over all vectors.
    pub total: u64,
}

/// One step of the workload.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Step {
    /// Name.
    pub name: String,
    /// Passed.
    pub ok: bool,
    /// Wall time in milliseconds.
    pub ms: u64,
}

/// The result of a full/quick run (`SYGPU-SUMMARY`). Field order is the JSON key order.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Summary {
    /// `"pass"` or `"fail"`.
    pub result: &'static str,
    /// Why it failed (`null` on pass).
    pub reason: Option<String>,
    /// `"full"` or `"quick"`.
    pub mode: &'static str,
    /// PCI address used.
    pub bdf: Option<String>,
    /// IOMMU group.
    pub iommu_group: Option<u32>,
    /// Queues the device has (all were used).
    pub queues: u32,
    /// VRAM size.
    pub vram_bytes: u64,
    /// Interrupt mode: `"msix"` or `"msi"` (`null` if the run failed before it was known).
    pub irq_mode: Option<&'static str>,
    /// Data jobs submitted (COPY, FILL, SAXPY, GEMM, REDUCE).
    pub jobs_run: u64,
    /// Jobs whose results (or expected fault) were verified.
    pub jobs_verified: u64,
    /// Bytes the engines read plus wrote for the jobs.
    pub bytes_moved: u64,
    /// FENCEs submitted.
    pub fences: u64,
    /// Fence waits that ended with their interrupt (and the fence value in memory).
    pub fence_irq_waits: u64,
    /// Commands the device reported `ERR_INTERRUPTED` for (restarted under them); each
    /// interrupted step ran again.
    pub interrupted_by_restart: u64,
    /// How the workload published its tails: `"trapped"` or `"mapped"` (`--doorbell`).
    pub doorbell: &'static str,
    /// Tails the workload published (one per submission).
    pub submissions: u64,
    /// Of those, with mapped doorbells, the ones that found the engine asleep
    /// (`DB_NEED_KICK`) and kicked it with a trapped `Q_DOORBELL` write; 0 when trapped.
    pub kicks: u64,
    /// Interrupts per vector.
    pub interrupts: Interrupts,
    /// Bad-DMA error test passed.
    pub error_test_ok: bool,
    /// VRAM mmap coherence test passed.
    pub vram_mmap_ok: bool,
    /// Steps run, in order.
    pub steps: Vec<Step>,
    /// The `--latency` figures (`null` without it).
    pub latency: Option<Latency>,
    /// The `--soak` run (`null` without it).
    pub soak: Option<Soak>,
    /// Wall time of the whole run.
    pub duration_ms: u64,
}

impl Summary {
    /// An empty (failing until proven otherwise) summary.
    pub fn new(mode: &'static str) -> Summary {
        Summary {
            result: "fail",
            reason: None,
            mode,
            bdf: None,
            iommu_group: None,
            queues: 0,
            vram_bytes: 0,
            irq_mode: None,
            jobs_run: 0,
            jobs_verified: 0,
            bytes_moved: 0,
            fences: 0,
            fence_irq_waits: 0,
            interrupted_by_restart: 0,
            doorbell: "trapped",
            submissions: 0,
            kicks: 0,
            interrupts: Interrupts {
                per_vector: vec![0; 16],
                total: 0,
            },
            error_test_ok: false,
            vram_mmap_ok: false,
            steps: Vec::new(),
            latency: None,
            soak: None,
            duration_ms: 0,
        }
    }
}

workload_summary!(Summary);

/// The first pass criterion of a workload run that is not met: every step passed, every job
/// (at least one) verified, the error test and the VRAM mapping test passed.
fn unmet(
    steps: &[Step],
    jobs_run: u64,
    jobs_verified: u64,
    error_test_ok: bool,
    vram_mmap_ok: bool,
) -> Option<String> {
    if steps.is_empty() || steps.iter().any(|s| !s.ok) {
        Some("not every step passed".into())
    } else if jobs_run == 0 || jobs_verified != jobs_run {
        Some(format!("{jobs_verified} of {jobs_run} jobs verified"))
    } else if !error_test_ok {
        Some("error test did not pass".into())
    } else if !vram_mmap_ok {
        Some("VRAM mmap test did not pass".into())
    } else {
        None
    }
}

/// Two percentiles of a latency, in microseconds (0.1 µs resolution).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
}

/// The `--latency` figures of one doorbell mode.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LatencyMode {
    /// NOP + FENCE: submission until the fence value is seen in guest memory.
    pub nop_fence_us: Percentiles,
    /// 4 KiB COPY + FENCE, the same way (the bytes checked after each job).
    pub copy_4k_us: Percentiles,
    /// NOP + FENCE jobs back to back (the next submitted when the previous fence is seen).
    pub jobs_per_s: f64,
    /// Tails published while measuring (warm-ups excluded).
    pub submissions: u64,
    /// Of those, the kicks (`DB_NEED_KICK` found set; always 0 when trapped).
    pub kicks: u64,
}

/// Mapped over trapped, same run (below 1: mapped is faster for latencies; above 1: for
/// jobs/s).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LatencyRatios {
    /// NOP + FENCE p50.
    pub nop_fence_p50: f64,
    /// NOP + FENCE p90.
    pub nop_fence_p90: f64,
    /// 4 KiB COPY + FENCE p50.
    pub copy_4k_p50: f64,
    /// 4 KiB COPY + FENCE p90.
    pub copy_4k_p90: f64,
    /// Back-to-back jobs/s.
    pub jobs_per_s: f64,
}

/// The `--latency` run ([`crate::latency`]): both doorbell modes on one queue, same run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Latency {
    /// Jobs per figure.
    pub jobs: u64,
    /// The queue measured.
    pub queue: u32,
    /// Bytes per COPY job.
    pub copy_bytes: u64,
    /// Wall time of the measurement.
    pub ms: u64,
    /// Trapped doorbells.
    pub trapped: LatencyMode,
    /// Mapped doorbells.
    pub mapped: LatencyMode,
    /// Mapped over trapped.
    pub mapped_over_trapped: LatencyRatios,
}

/// The `--soak S` run ([`crate::soak`]). Field order is the JSON key order.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Soak {
    /// The `S` asked for.
    pub seconds: u64,
    /// Data jobs of the verified mix (COPY guest -> VRAM -> guest, FILL, SAXPY + REDUCE,
    /// GEMM) submitted; the region's FILLs and read-back COPYs are not among them (they are
    /// in the summary's `jobs_run`, as every soak job is).
    pub jobs: u64,
    /// Of those, the ones whose results matched the CPU reference bit for bit.
    pub jobs_verified: u64,
    /// Bytes of the device-dirtied region.
    pub region_bytes: u64,
    /// Times the device rewrote the whole region (one per iteration).
    pub region_writes: u64,
    /// 4 KiB pages of the region found not holding the pattern of the device's last write
    /// to them: in the read-backs during the loop and in the CPU check of the whole region
    /// after the device went idle (a page counts once per check that found it).
    pub region_stale_pages: u64,
    /// Iterations that read the region back (COPY into a second buffer) before rewriting
    /// it; the CPU checked each read-back against the previous write's pattern.
    pub region_readbacks: u64,
    /// Of `region_stale_pages`, those found in the read-backs.
    pub readback_stale_pages: u64,
    /// `--soak-vram`: bytes of VRAM the engine filled before the loop ([`crate::vram_soak`]).
    pub vram_filled_bytes: u64,
    /// `--soak-vram`: CPU writes of the VRAM CPU region (one per iteration).
    pub vram_cpu_writes: u64,
    /// `--soak-vram`: VRAM pages found stale (CPU region during and after the loop, filled
    /// pages after it).
    pub vram_stale_pages: u64,
    /// Wall time of the loop and the final check.
    pub ms: u64,
    /// Every job verified, at least one region write, no stale page, nothing failed.
    pub ok: bool,
}

/// The DMA memory of a no-IOMMU run.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Hugepages {
    /// Bytes per hugepage (2 MiB).
    pub page_bytes: u64,
    /// Hugepages used.
    pub count: usize,
    /// `MAP_LOCKED` was accepted.
    pub locked: bool,
    /// Runs of physically adjacent hugepages.
    pub runs: usize,
    /// Bytes of the longest run (the largest DMA buffer possible).
    pub largest_run_bytes: u64,
}

/// The result of a `--noiommu` run (`SYGPU-SUMMARY`). Field order is the JSON key order.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct NoIommuSummary {
    /// `"pass"` or `"fail"`.
    pub result: &'static str,
    /// Why it failed (`null` on pass).
    pub reason: Option<String>,
    /// `"full"` or `"quick"`.
    pub mode: &'static str,
    /// `"none"`.
    pub iommu: &'static str,
    /// `"hugepage-physical"`: DMA memory is hugepages, bus address = physical address.
    pub dma: &'static str,
    /// `"polled"`: no interrupts; `INT_STATUS` and fence values are polled.
    pub interrupts: &'static str,
    /// PCI address used.
    pub bdf: Option<String>,
    /// Queues the device has (all were used).
    pub queues: u32,
    /// VRAM size.
    pub vram_bytes: u64,
    /// `"mmap"` (`resource2` mapped) or `"pread"` (file I/O on it); `null` before it was known.
    pub vram_access: Option<&'static str>,
    /// The device's own interrupt mode (`"msix"`/`"msi"`, from its capabilities), unused.
    pub device_irq_mode: Option<&'static str>,
    /// The DMA memory.
    pub hugepages: Hugepages,
    /// The sizes were shrunk so every buffer fits one run of adjacent hugepages.
    pub sizes_shrunk: bool,
    /// Data jobs submitted (COPY, FILL, SAXPY, GEMM, REDUCE).
    pub jobs_run: u64,
    /// Jobs whose results (or expected fault) were verified.
    pub jobs_verified: u64,
    /// Bytes the engines read plus wrote for the jobs.
    pub bytes_moved: u64,
    /// FENCEs submitted.
    pub fences: u64,
    /// Fence waits that ended with their queue's `INT_STATUS` completion bit (polled) and
    /// the fence value in memory.
    pub fence_polled_waits: u64,
    /// `INT_STATUS` reads of the polled waits.
    pub status_polls: u64,
    /// How the workload published its tails: `"trapped"` or `"mapped"` (`--doorbell`).
    pub doorbell: &'static str,
    /// Tails the workload published (one per submission).
    pub submissions: u64,
    /// Of those, with mapped doorbells, the ones that kicked a sleeping engine; 0 when trapped.
    pub kicks: u64,
    /// Bad-DMA error test passed (the unmapped bus address case).
    pub error_test_ok: bool,
    /// VRAM mapping coherence test passed.
    pub vram_mmap_ok: bool,
    /// What did not run, and why.
    pub skipped: Vec<String>,
    /// Steps run, in order.
    pub steps: Vec<Step>,
    /// The `--latency` figures (`null` without it).
    pub latency: Option<Latency>,
    /// The `--soak` run (`null` without it).
    pub soak: Option<Soak>,
    /// Wall time of the whole run.
    pub duration_ms: u64,
}

impl NoIommuSummary {
    /// An empty (failing until proven otherwise) summary.
    pub fn new(mode: &'static str) -> NoIommuSummary {
        NoIommuSummary {
            result: "fail",
            reason: None,
            mode,
            iommu: "none",
            dma: "hugepage-physical",
            interrupts: "polled",
            bdf: None,
            queues: 0,
            vram_bytes: 0,
            vram_access: None,
            device_irq_mode: None,
            hugepages: Hugepages::default(),
            sizes_shrunk: false,
            jobs_run: 0,
            jobs_verified: 0,
            bytes_moved: 0,
            fences: 0,
            fence_polled_waits: 0,
            status_polls: 0,
            doorbell: "trapped",
            submissions: 0,
            kicks: 0,
            error_test_ok: false,
            vram_mmap_ok: false,
            skipped: Vec::new(),
            steps: Vec::new(),
            latency: None,
            soak: None,
            duration_ms: 0,
        }
    }
}

workload_summary!(NoIommuSummary);

/// The result of `--probe` (`SYGPU-PROBE`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq, Default)]
pub struct ProbeSummary {
    /// `"pass"` or `"fail"`.
    pub result: &'static str,
    /// Why it failed (`null` on pass).
    pub reason: Option<String>,
    /// PCI address.
    pub bdf: Option<String>,
    /// Vendor ID (config space).
    pub vendor: u16,
    /// Device ID (config space).
    pub device: u16,
    /// Class code (config space).
    pub class: u32,
    /// Capability IDs in list order.
    pub capabilities: Vec<u8>,
    /// D-state from PMCSR before any MMIO (0 = D0).
    pub power_state: u8,
    /// Runtime PM was set to `on` for the probe (a driver was bound; restored afterwards).
    pub runtime_pm_forced_on: bool,
    /// Memory space decoding was already enabled.
    pub memory_was_enabled: bool,
    /// Clearing and setting Memory Space through the sysfs `config` file read back correctly.
    pub config_write_ok: bool,
    /// BAR0 size from sysfs `resource`.
    pub bar0_bytes: u64,
    /// `MAGIC` as text (`"SYGP"`).
    pub magic: String,
    /// `VERSION`.
    pub version: u32,
    /// `FEATURES`.
    pub features: u32,
    /// `NUM_QUEUES`.
    pub num_queues: u32,
    /// `VRAM_SIZE`.
    pub vram_bytes: u64,
    /// SCRATCH write/read-back worked.
    pub scratch_ok: bool,
    /// Wall time.
    pub duration_ms: u64,
}

impl ProbeSummary {
    /// The `SYGPU-PROBE {json}` line.
    pub fn line(&self) -> String {
        json_line("SYGPU-PROBE", self)
    }
}

/// The result of `--stamp` / `--check-stamp` (`SYGPU-STAMP`).
#[derive(Debug, Clone, Serialize, PartialEq, Eq, Default)]
pub struct StampSummary {
    /// `"pass"` or `"fail"`.
    pub result: &'static str,
    /// Why it failed (`null` on pass).
    pub reason: Option<String>,
    /// `"write"` or `"check"`.
    pub action: &'static str,
    /// PCI address.
    pub bdf: Option<String>,
    /// The seed.
    pub seed: u64,
    /// VRAM offset of the stamp.
    pub offset: u64,
    /// Its length.
    pub bytes: u64,
    /// The stamp read through the BAR2 mapping matched.
    pub mapping_ok: bool,
    /// An engine COPY of the stamp into DMA memory matched.
    pub engine_ok: bool,
    /// Wall time.
    pub duration_ms: u64,
}

impl StampSummary {
    /// The `SYGPU-STAMP {json}` line.
    pub fn line(&self) -> String {
        json_line("SYGPU-STAMP", self)
    }
}

fn json_line<T: Serialize>(tag: &str, v: &T) -> String {
    match serde_json::to_string(v) {
        Ok(j) => format!("{tag} {j}"),
        Err(e) => format!(
            "{tag} {{\"result\":\"fail\",\"reason\":{}}}",
            serde_json::Value::String(format!("cannot serialize summary: {e}"))
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passing() -> Summary {
        let mut s = Summary::new("quick");
        s.bdf = Some("0000:00:04.0".into());
        s.iommu_group = Some(3);
        s.queues = 2;
        s.vram_bytes = 64 << 20;
        s.irq_mode = Some("msix");
        s.jobs_run = 5;
        s.jobs_verified = 5;
        s.bytes_moved = 1234;
        s.fences = 9;
        s.fence_irq_waits = 8;
        s.interrupts = Interrupts {
            per_vector: vec![1; 16],
            total: 16,
        };
        s.error_test_ok = true;
        s.vram_mmap_ok = true;
        s.steps = vec![Step {
            name: "identity".into(),
            ok: true,
            ms: 3,
        }];
        s.duration_ms = 42;
        s
    }

    #[test]
    fn pass_line_format() {
        let mut s = passing();
        s.conclude(None);
        assert!(s.passed());
        let line = s.line();
        assert_eq!(
            line,
            "SYGPU-SUMMARY {\"result\":\"pass\",\"reason\":null,\"mode\":\"quick\",\
             \"bdf\":\"0000:00:04.0\",\"iommu_group\":3,\"queues\":2,\"vram_bytes\":67108864,\
             \"irq_mode\":\"msix\",\"jobs_run\":5,\"jobs_verified\":5,\"bytes_moved\":1234,\"fences\":9,\"fence_irq_waits\":8,\"interrupted_by_restart\":0,\
             \"doorbell\":\"trapped\",\"submissions\":0,\"kicks\":0,\
             \"interrupts\":{\"per_vector\":[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],\"total\":16},\
             \"error_test_ok\":true,\"vram_mmap_ok\":true,\
             \"steps\":[{\"name\":\"identity\",\"ok\":true,\"ms\":3}],\"latency\":null,\"soak\":null,\"duration_ms\":42}"
        );
        assert!(!line.contains('\n'));
        let v: serde_json::Value =
            serde_json::from_str(line.strip_prefix("SYGPU-SUMMARY ").expect("tag")).expect("json");
        assert_eq!(v["interrupts"]["total"], 16);
        // MSI mode: one vector.
        let mut s = passing();
        s.irq_mode = Some("msi");
        s.interrupts = Interrupts {
            per_vector: vec![57],
            total: 57,
        };
        s.conclude(None);
        assert!(s.passed());
        assert!(s.line().contains("\"irq_mode\":\"msi\",\"jobs_run\":5,"));
        assert!(
            s.line()
                .contains("\"interrupts\":{\"per_vector\":[57],\"total\":57}")
        );
        // Unknown before the device was opened.
        assert!(Summary::new("full").line().contains("\"irq_mode\":null"));
    }

    #[test]
    fn doorbell_and_latency_in_the_line() {
        let mode = |p50: f64, kicks: u64| LatencyMode {
            nop_fence_us: Percentiles {
                p50,
                p90: p50 + 1.0,
            },
            copy_4k_us: Percentiles {
                p50: p50 + 5.0,
                p90: p50 + 9.5,
            },
            jobs_per_s: 1e6 / p50,
            submissions: 400,
            kicks,
        };
        let mut s = passing();
        s.doorbell = "mapped";
        s.submissions = 120;
        s.kicks = 31;
        s.latency = Some(Latency {
            jobs: 200,
            queue: 0,
            copy_bytes: 4096,
            ms: 900,
            trapped: mode(100.0, 0),
            mapped: mode(40.0, 7),
            mapped_over_trapped: LatencyRatios {
                nop_fence_p50: 0.4,
                nop_fence_p90: 0.41,
                copy_4k_p50: 0.43,
                copy_4k_p90: 0.46,
                jobs_per_s: 2.5,
            },
        });
        s.conclude(None);
        assert!(s.passed());
        let line = s.line();
        assert!(
            line.contains("\"doorbell\":\"mapped\",\"submissions\":120,\"kicks\":31,"),
            "{line}"
        );
        let v: serde_json::Value =
            serde_json::from_str(line.strip_prefix("SYGPU-SUMMARY ").expect("tag")).expect("json");
        let l = &v["latency"];
        assert_eq!(l["jobs"], 200);
        assert_eq!(l["trapped"]["nop_fence_us"]["p50"], 100.0);
        assert_eq!(l["mapped"]["copy_4k_us"]["p90"], 49.5);
        assert_eq!(l["mapped"]["jobs_per_s"], 25000.0);
        assert_eq!(l["mapped"]["kicks"], 7);
        assert_eq!(l["mapped_over_trapped"]["jobs_per_s"], 2.5);
        let mut n = NoIommuSummary::new("quick");
        n.doorbell = "mapped";
        assert!(
            n.line()
                .contains("\"doorbell\":\"mapped\",\"submissions\":0,\"kicks\":0,")
        );
        assert!(
            n.line()
                .contains("\"latency\":null,\"soak\":null,\"duration_ms\":0}")
        );
    }

    #[test]
    fn soak_in_the_line() {
        let soak = Soak {
            seconds: 30,
            jobs: 400,
            jobs_verified: 400,
            region_bytes: 4 << 20,
            region_writes: 180,
            region_stale_pages: 0,
            region_readbacks: 179,
            readback_stale_pages: 0,
            vram_filled_bytes: 0,
            vram_cpu_writes: 0,
            vram_stale_pages: 0,
            ms: 30_012,
            ok: true,
        };
        let mut s = passing();
        s.soak = Some(soak.clone());
        s.conclude(None);
        assert!(s.passed());
        assert!(
            s.line().contains(
                "\"soak\":{\"seconds\":30,\"jobs\":400,\"jobs_verified\":400,\"region_bytes\":4194304,\
                 \"region_writes\":180,\"region_stale_pages\":0,\"region_readbacks\":179,\
                 \"readback_stale_pages\":0,\"vram_filled_bytes\":0,\"vram_cpu_writes\":0,\
                 \"vram_stale_pages\":0,\"ms\":30012,\"ok\":true},\"duration_ms\":42}"
            ),
            "{}",
            s.line()
        );
        // A soak that did not pass fails the run even without a failure message.
        let mut n = NoIommuSummary::new("full");
        n.steps = s.steps.clone();
        (n.jobs_run, n.jobs_verified, n.error_test_ok, n.vram_mmap_ok) = (5, 5, true, true);
        n.soak = Some(Soak {
            region_stale_pages: 3,
            ok: false,
            ..soak
        });
        n.conclude(None);
        assert_eq!(n.reason.as_deref(), Some("soak did not pass"));
        n.conclude(Some("soak: 3 of 1024 4 KiB pages ...".into()));
        assert!(!n.passed());
        let v: serde_json::Value =
            serde_json::from_str(n.line().strip_prefix("SYGPU-SUMMARY ").expect("tag"))
                .expect("json");
        assert_eq!(v["soak"]["region_stale_pages"], 3);
        assert_eq!(v["soak"]["ok"], false);
    }

    #[test]
    fn fail_reasons() {
        let mut s = passing();
        s.conclude(Some("step copy: byte 7 differs".into()));
        assert!(!s.passed());
        assert!(
            s.line()
                .contains("\"result\":\"fail\",\"reason\":\"step copy: byte 7 differs\"")
        );
        let mut s = passing();
        s.jobs_verified = 4;
        s.conclude(None);
        assert_eq!(s.reason.as_deref(), Some("4 of 5 jobs verified"));
        let mut s = passing();
        s.error_test_ok = false;
        s.conclude(None);
        assert_eq!(s.reason.as_deref(), Some("error test did not pass"));
        let mut s = passing();
        s.vram_mmap_ok = false;
        s.conclude(None);
        assert!(!s.passed());
        let mut s = Summary::new("full");
        s.conclude(None);
        assert!(!s.passed(), "nothing ran");
        // Quotes and newlines in a reason stay inside one JSON line.
        let mut s = passing();
        s.conclude(Some("bad \"thing\"\nhere".into()));
        assert!(!s.line().contains('\n'));
        assert!(s.line().contains("bad \\\"thing\\\"\\nhere"));
    }

    #[test]
    fn noiommu_line_format() {
        let mut s = NoIommuSummary::new("quick");
        assert!(
            s.line().starts_with(
                "SYGPU-SUMMARY {\"result\":\"fail\",\"reason\":null,\"mode\":\"quick\",\"iommu\":\"none\",\"dma\":\"hugepage-physical\",\"interrupts\":\"polled\","
            ),
            "{}",
            s.line()
        );
        s.steps = vec![Step {
            name: "copy".into(),
            ok: true,
            ms: 1,
        }];
        s.jobs_run = 3;
        s.jobs_verified = 3;
        s.error_test_ok = true;
        s.conclude(None);
        assert_eq!(s.reason.as_deref(), Some("VRAM mmap test did not pass"));
        s.vram_mmap_ok = true;
        s.conclude(None);
        assert!(s.passed());
        s.conclude(Some("step fill: timeout".into()));
        assert!(!s.passed());
        let v: serde_json::Value =
            serde_json::from_str(s.line().strip_prefix("SYGPU-SUMMARY ").expect("tag"))
                .expect("json");
        assert_eq!(v["hugepages"]["count"], 0);
        assert_eq!(v["reason"], "step fill: timeout");
    }

    #[test]
    fn probe_line_format() {
        let p = ProbeSummary {
            result: "pass",
            bdf: Some("0000:00:04.0".into()),
            vendor: 0x1234,
            device: 0x5347,
            class: 0x030200,
            capabilities: vec![1, 16, 17],
            bar0_bytes: 65536,
            magic: "SYGP".into(),
            version: 0x10000,
            features: 0xff,
            num_queues: 2,
            vram_bytes: 64 << 20,
            scratch_ok: true,
            config_write_ok: true,
            duration_ms: 5,
            ..ProbeSummary::default()
        };
        assert_eq!(
            p.line(),
            "SYGPU-PROBE {\"result\":\"pass\",\"reason\":null,\"bdf\":\"0000:00:04.0\",\
             \"vendor\":4660,\"device\":21319,\"class\":197120,\"capabilities\":[1,16,17],\
             \"power_state\":0,\"runtime_pm_forced_on\":false,\"memory_was_enabled\":false,\
             \"config_write_ok\":true,\"bar0_bytes\":65536,\"magic\":\"SYGP\",\
             \"version\":65536,\"features\":255,\"num_queues\":2,\"vram_bytes\":67108864,\
             \"scratch_ok\":true,\"duration_ms\":5}"
        );
    }
}
