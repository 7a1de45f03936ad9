//! Where a guest test's prerequisites live ([`GuestEnv`]: QEMU, the kernel, the server, the
//! driver, the static L1 binaries) and the initramfs images built from them.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::{HarnessError, Result};

/// Where everything a guest test needs lives.
#[derive(Debug, Clone)]
pub struct GuestEnv {
    /// Repository root.
    pub repo: PathBuf,
    /// The setup cache (`SWITCHYARD_CACHE` or `.cache/vmtools`).
    pub cache: PathBuf,
    /// The QEMU wrapper.
    pub qemu: PathBuf,
    /// The PVH guest kernel.
    pub vmlinux: PathBuf,
    /// The `switchyard` binary (`SWITCHYARD_BIN`, else `target/{release,debug}/switchyard`).
    pub switchyard: PathBuf,
    /// The static in-guest driver (`SYGPU_DRIVER`, else the static release build).
    pub driver: PathBuf,
    /// Scratch and logs (`target/guest-tests`).
    pub work: PathBuf,
}

const SETUP_HINT: &str = "run scripts/setup.sh (or scripts/test.sh, which sets everything up)";

const CH_HINT: &str = "this test needs the static cloud-hypervisor v54 and ch-remote, which \
     scripts/setup.sh copies into the setup cache from SWITCHYARD_CH_DIR (no package registry \
     ships them; scripts/test.sh leaves the test out without them); see docs/cloud-hypervisor.md";

/// Whether a nested scenario of `sy-nested` runs its L2s under cloud-hypervisor: the `ch-*`
/// scenarios and `mmio-bench` (guest-tests/nested says the same on the L1 side).
pub fn needs_cloud_hypervisor(scenario: &str) -> bool {
    scenario.starts_with("ch-") || scenario.starts_with("mmio-bench")
}

fn must_exist(what: &'static str, path: PathBuf, hint: &'static str) -> Result<PathBuf> {
    if path.exists() {
        Ok(path)
    } else {
        Err(HarnessError::Missing { what, path, hint })
    }
}

impl GuestEnv {
    /// Finds QEMU, the kernel, the server and the driver.
    pub fn discover() -> Result<GuestEnv> {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let repo = repo.canonicalize().unwrap_or(repo);
        let cache = std::env::var_os("SWITCHYARD_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo.join(".cache/vmtools"));
        Self::discover_in(repo, cache)
    }

    /// [`GuestEnv::discover`] with the setup cache at `cache`.
    fn discover_in(repo: PathBuf, cache: PathBuf) -> Result<GuestEnv> {
        let qemu = must_exist("QEMU", cache.join("qemu"), SETUP_HINT)?;
        let vmlinux = must_exist("guest kernel", cache.join("vmlinux"), SETUP_HINT)?;
        let target = repo.join("target");
        let switchyard = match std::env::var_os("SWITCHYARD_BIN") {
            Some(p) => PathBuf::from(p),
            None => [
                target.join("release/switchyard"),
                target.join("debug/switchyard"),
            ]
            .into_iter()
            .filter(|p| p.exists())
            .max_by_key(|p| fs::metadata(p).and_then(|m| m.modified()).ok())
            .unwrap_or_else(|| target.join("debug/switchyard")),
        };
        let switchyard = must_exist(
            "switchyard binary",
            switchyard,
            "build it with `cargo build -p switchyard` or set SWITCHYARD_BIN",
        )?;
        let driver = std::env::var_os("SYGPU_DRIVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| target.join("x86_64-unknown-linux-gnu/release/sygpu-driver"));
        let driver = must_exist(
            "static in-guest driver",
            driver,
            "build it with `RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build --release \
             -p sygpu-driver --target x86_64-unknown-linux-gnu` or set SYGPU_DRIVER",
        )?;
        let work = target.join("guest-tests");
        fs::create_dir_all(&work)
            .map_err(|e| HarnessError::Io(format!("mkdir {}", work.display()), e))?;
        Ok(GuestEnv {
            repo,
            cache,
            qemu,
            vmlinux,
            switchyard,
            driver,
            work,
        })
    }

    /// The setup cache's cloud-hypervisor (`ch/cloud-hypervisor`, `ch-remote` beside it), which
    /// the nested scenarios that run L2s under it need ([`needs_cloud_hypervisor`]). It is
    /// optional in `scripts/setup.sh`; a test that needs it and runs without it fails with this
    /// error, which names docs/cloud-hypervisor.md.
    pub fn cloud_hypervisor(&self) -> Result<PathBuf> {
        let ch = must_exist(
            "cloud-hypervisor",
            self.cache.join("ch/cloud-hypervisor"),
            CH_HINT,
        )?;
        must_exist("ch-remote", self.cache.join("ch/ch-remote"), CH_HINT)?;
        Ok(ch)
    }

    /// The patched QEMU whose `vfio-user-pci` live-migrates a device (issue 24's patches in
    /// vmm-integration/qemu/patches): the setup cache's `qemu-migration` wrapper, which
    /// `scripts/build-qemu.sh` writes (scripts/test.sh runs it).
    pub fn migration_qemu(&self) -> Result<PathBuf> {
        must_exist(
            "patched QEMU (live migration)",
            self.cache.join("qemu-migration"),
            "run scripts/build-qemu.sh (scripts/test.sh does; about 5 minutes on 2 cores, then \
             cached outside the clone)",
        )
    }

    /// The environment for a test; a missing prerequisite fails the test with a message saying
    /// how to set it up.
    pub fn for_test() -> GuestEnv {
        GuestEnv::discover().unwrap_or_else(|e| panic!("guest test environment incomplete: {e}"))
    }

    /// The test initramfs `target/guest-tests/initramfs.cpio.gz`: the base image plus the
    /// driver (built once per test process). It is built under a name of this process and
    /// renamed into place, so processes building it at the same time never see a partial
    /// archive, and a build never leaves a file behind.
    pub fn initramfs(&self) -> Result<PathBuf> {
        static BUILT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
        BUILT
            .get_or_init(|| {
                let add = vec!["--add".into(), self.driver.clone().into_os_string()];
                self.build_image("initramfs.cpio.gz", &add)
            })
            .clone()
            .map_err(HarnessError::Initramfs)
    }

    /// The L1 image of the nested tests, `target/guest-tests/initramfs-l1.cpio.gz`: a guest
    /// that plays the host (`build-initramfs.sh --nested`: KVM modules, cloud-hypervisor,
    /// ch-remote; `--qemu`: QEMU for L2s with KVM) with a static `switchyard`, `sy-nested`,
    /// the kernel and the L2 image (the driver, `sy-mmio`, `sy-edu`) under `/l2/`. Built once
    /// per test process.
    pub fn nested_initramfs(&self) -> Result<PathBuf> {
        static BUILT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
        let bins = self.nested_binaries()?;
        BUILT
            .get_or_init(|| {
                let mut l2_add: Vec<std::ffi::OsString> = vec!["--strip".into()];
                for b in [&self.driver, &bins.sy_mmio, &bins.sy_edu] {
                    l2_add.push("--add".into());
                    l2_add.push(b.clone().into_os_string());
                }
                let l2 = self.build_image("initramfs-l2.cpio.gz", &l2_add)?;
                let mut add: Vec<std::ffi::OsString> =
                    vec!["--nested".into(), "--qemu".into(), "--strip".into()];
                let mut put = |from: &Path, to: &str| {
                    let mut a = from.as_os_str().to_owned();
                    a.push(":");
                    a.push(to);
                    add.push("--add".into());
                    add.push(a);
                };
                put(&bins.switchyard, "/usr/bin/switchyard");
                put(&bins.sy_nested, "/usr/bin/sy-nested");
                put(&self.driver, "/usr/bin/sygpu-driver");
                put(&self.vmlinux, "/l2/vmlinux");
                put(&l2, "/l2/initramfs.cpio.gz");
                self.build_image("initramfs-l1.cpio.gz", &add)
            })
            .clone()
            .map_err(HarnessError::Initramfs)
    }

    /// The static binaries an L1 image needs: `switchyard` (`SWITCHYARD_STATIC_BIN`) and
    /// `sy-nested` (`SY_NESTED_BIN`), by default from the static release build.
    pub fn nested_binaries(&self) -> Result<NestedBinaries> {
        let static_dir = self.repo.join("target/x86_64-unknown-linux-gnu/release");
        let pick = |var: &str, name: &str| {
            std::env::var_os(var)
                .map(PathBuf::from)
                .unwrap_or_else(|| static_dir.join(name))
        };
        const HINT: &str = "build them with `RUSTFLAGS=\"-C target-feature=+crt-static\" cargo \
             build --release -p switchyard -p sy-nested --target x86_64-unknown-linux-gnu` \
             (scripts/test.sh does)";
        let sy_nested = must_exist("static sy-nested", pick("SY_NESTED_BIN", "sy-nested"), HINT)?;
        let sy_mmio = must_exist("static sy-mmio", sy_nested.with_file_name("sy-mmio"), HINT)?;
        let sy_edu = must_exist("static sy-edu", sy_nested.with_file_name("sy-edu"), HINT)?;
        Ok(NestedBinaries {
            switchyard: must_exist(
                "static switchyard",
                pick("SWITCHYARD_STATIC_BIN", "switchyard"),
                HINT,
            )?,
            sy_nested,
            sy_mmio,
            sy_edu,
        })
    }

    /// Runs `images/build-initramfs.sh` into `work/NAME`: built under a name of this process
    /// and renamed into place, so processes building it at the same time never see a partial
    /// archive, and a failed build leaves nothing behind.
    fn build_image(
        &self,
        name: &str,
        args: &[std::ffi::OsString],
    ) -> std::result::Result<PathBuf, String> {
        let out = self.work.join(name);
        let tmp = self
            .work
            .join(format!(".{name}.{}.tmp", std::process::id()));
        let built = Command::new(self.repo.join("images/build-initramfs.sh"))
            .arg(&tmp)
            .args(args)
            .env("SWITCHYARD_CACHE", &self.cache)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| format!("images/build-initramfs.sh: {e}"))
            .and_then(|status| {
                if status.success() {
                    Ok(())
                } else {
                    Err(format!("images/build-initramfs.sh exited with {status}"))
                }
            })
            .and_then(|()| {
                fs::rename(&tmp, &out)
                    .map_err(|e| format!("rename {} to {}: {e}", tmp.display(), out.display()))
            });
        if let Err(e) = built {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(out)
    }

    /// A static binary for the guest: `$var` if set, else `target/x86_64-unknown-linux-gnu/
    /// release/NAME` (what `RUSTFLAGS="-C target-feature=+crt-static" cargo build --release
    /// -p PACKAGE --target x86_64-unknown-linux-gnu` makes).
    pub fn static_binary(&self, name: &str, var: &str) -> Result<PathBuf> {
        let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
            self.repo
                .join("target/x86_64-unknown-linux-gnu/release")
                .join(name)
        });
        if path.exists() {
            Ok(path)
        } else {
            Err(HarnessError::Initramfs(format!(
                "static {name} not found at {} (set {var} or build it: RUSTFLAGS=\"-C \
                 target-feature=+crt-static\" cargo build --release --target \
                 x86_64-unknown-linux-gnu)",
                path.display()
            )))
        }
    }

    /// An initramfs `target/guest-tests/NAME.cpio.gz`: the base image plus `files` (each in
    /// `/usr/bin`), built now (under a name of this process, then renamed into place).
    pub fn initramfs_with(&self, name: &str, files: &[PathBuf]) -> Result<PathBuf> {
        let out = self.work.join(format!("{name}.cpio.gz"));
        let tmp = self
            .work
            .join(format!(".{name}.cpio.gz.{}.tmp", std::process::id()));
        let mut cmd = Command::new(self.repo.join("images/build-initramfs.sh"));
        cmd.arg(&tmp);
        for f in files {
            cmd.arg("--add").arg(f);
        }
        let status = cmd
            .env("SWITCHYARD_CACHE", &self.cache)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| HarnessError::Initramfs(format!("images/build-initramfs.sh: {e}")))?;
        if !status.success() {
            let _ = fs::remove_file(&tmp);
            return Err(HarnessError::Initramfs(format!(
                "images/build-initramfs.sh exited with {status}"
            )));
        }
        fs::rename(&tmp, &out).map_err(|e| {
            HarnessError::Io(format!("rename {} to {}", tmp.display(), out.display()), e)
        })?;
        Ok(out)
    }

    /// A log directory for `test`, emptied.
    pub fn log_dir(&self, test: &str) -> Result<PathBuf> {
        let dir = self.work.join("logs").join(test);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)
            .map_err(|e| HarnessError::Io(format!("mkdir {}", dir.display()), e))?;
        Ok(dir)
    }
}

/// Static binaries for an L1 image ([`GuestEnv::nested_binaries`]).
#[derive(Debug, Clone)]
pub struct NestedBinaries {
    /// `switchyard`, linked statically.
    pub switchyard: PathBuf,
    /// `sy-nested` (guest-tests/nested), linked statically.
    pub sy_nested: PathBuf,
    /// `sy-mmio` (guest-tests/nested), next to `sy-nested`; runs in L2.
    pub sy_mmio: PathBuf,
    /// `sy-edu` (guest-tests/nested), next to `sy-nested`; runs in L2.
    pub sy_edu: PathBuf,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_prerequisites_are_an_error_that_says_how_to_set_them_up() {
        let cache = std::env::temp_dir().join(format!("sy-empty-cache.{}", std::process::id()));
        fs::create_dir_all(&cache).expect("mkdir");
        let err = GuestEnv::discover_in(PathBuf::from("/nonexistent"), cache.clone())
            .expect_err("an empty cache has no QEMU");
        let _ = fs::remove_dir(&cache);
        let HarnessError::Missing { what, path, .. } = &err else {
            panic!("not a Missing error: {err:?}");
        };
        assert_eq!((*what, path), ("QEMU", &cache.join("qemu")));
        let msg = err.to_string();
        assert!(msg.contains("run scripts/setup.sh"), "{msg}");
        assert!(!msg.contains("SKIP"), "no skip switch is offered: {msg}");
    }

    #[test]
    fn a_cache_without_cloud_hypervisor_fails_the_tests_that_need_it() {
        let cache = std::env::temp_dir().join(format!("sy-ch-cache.{}", std::process::id()));
        let env = GuestEnv {
            repo: PathBuf::from("/nonexistent"),
            cache: cache.clone(),
            qemu: cache.join("qemu"),
            vmlinux: cache.join("vmlinux"),
            switchyard: PathBuf::from("/nonexistent/switchyard"),
            driver: PathBuf::from("/nonexistent/sygpu-driver"),
            work: cache.join("work"),
        };
        let err = env.cloud_hypervisor().expect_err("no ch/ in the cache");
        let msg = err.to_string();
        assert!(msg.starts_with("cloud-hypervisor not found at "), "{msg}");
        assert!(msg.contains("docs/cloud-hypervisor.md"), "{msg}");
        fs::create_dir_all(cache.join("ch")).expect("mkdir");
        fs::write(cache.join("ch/cloud-hypervisor"), "").expect("write");
        let msg = env
            .cloud_hypervisor()
            .expect_err("no ch-remote")
            .to_string();
        assert!(msg.starts_with("ch-remote not found at "), "{msg}");
        fs::write(cache.join("ch/ch-remote"), "").expect("write");
        let found = env.cloud_hypervisor();
        let _ = fs::remove_dir_all(&cache);
        assert_eq!(
            found.expect("both there"),
            cache.join("ch/cloud-hypervisor")
        );

        for s in [
            "ch-workload",
            "ch-hotplug",
            "ch-viommu",
            "ch-pool",
            "mmio-bench-quick",
        ] {
            assert!(needs_cloud_hypervisor(s), "{s}");
        }
        for s in [
            "qemu-softgpu",
            "qemu-edu",
            "pool-edu",
            "vf-probe",
            "irq-bench-quick",
        ] {
            assert!(!needs_cloud_hypervisor(s), "{s}");
        }
    }
}
