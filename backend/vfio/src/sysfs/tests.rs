//! The inventory and the sysfs changes against a fake sysfs tree.

use std::os::unix::fs::symlink;

use super::*;

struct FakeSys {
    dir: tempfile::TempDir,
}

impl FakeSys {
    fn new() -> FakeSys {
        let dir = tempfile::tempdir().expect("tempdir");
        for d in [
            "bus/pci/devices",
            "bus/pci/drivers/vfio-pci",
            "bus/pci/drivers/igb",
            "kernel/iommu_groups",
        ] {
            fs::create_dir_all(dir.path().join(d)).expect("mkdir");
        }
        fs::write(dir.path().join("bus/pci/drivers_probe"), "").expect("probe");
        FakeSys { dir }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn add(&self, bdf: &str, ids: (&str, &str), driver: Option<&str>, group: Option<u32>) {
        // Real sysfs: /sys/bus/pci/devices/BDF is a link to /sys/devices/pci.../BDF.
        let real = self.root().join("devices/pci0000:00").join(bdf);
        fs::create_dir_all(&real).expect("mkdir");
        symlink(&real, self.root().join("bus/pci/devices").join(bdf)).expect("link");
        fs::write(real.join("vendor"), format!("{}\n", ids.0)).expect("w");
        fs::write(real.join("device"), format!("{}\n", ids.1)).expect("w");
        fs::write(real.join("class"), "0x00ff00\n").expect("w");
        fs::write(real.join("numa_node"), "-1\n").expect("w");
        fs::write(real.join("reset_method"), "flr bus\n").expect("w");
        fs::write(real.join("driver_override"), "(null)\n").expect("w");
        if let Some(d) = driver {
            let ddir = self.root().join("bus/pci/drivers").join(d);
            fs::create_dir_all(&ddir).expect("mkdir");
            symlink(&ddir, real.join("driver")).expect("link");
        }
        if let Some(g) = group {
            let gdir = self.root().join("kernel/iommu_groups").join(g.to_string());
            fs::create_dir_all(gdir.join("devices")).expect("mkdir");
            symlink(&gdir, real.join("iommu_group")).expect("link");
            symlink(&real, gdir.join("devices").join(bdf)).expect("link");
        }
    }

    fn read(&self, bdf: &str, file: &str) -> String {
        fs::read_to_string(device_dir(self.root(), bdf).join(file)).expect("read")
    }
}

#[test]
fn addresses_are_normalized() {
    assert_eq!(normalize_bdf("00:03.0").expect("ok"), "0000:00:03.0");
    assert_eq!(normalize_bdf("0000:0A:1f.7").expect("ok"), "0000:0a:1f.7");
    for bad in [
        "",
        "00:03",
        "0000:00:20.0",
        "0000:00:03.8",
        "x:00:03.0",
        "1:2:3:4.0",
    ] {
        assert!(
            matches!(normalize_bdf(bad), Err(Error::BadAddress(_))),
            "{bad}"
        );
    }
}

#[test]
fn the_inventory_reads_ids_driver_group_sriov_numa_and_reset() {
    let sys = FakeSys::new();
    sys.add(
        "0000:00:03.0",
        ("0x1234", "0x11e8"),
        Some("vfio-pci"),
        Some(3),
    );
    sys.add("0000:01:00.0", ("0x8086", "0x10c9"), Some("igb"), Some(5));
    let pf = device_dir(sys.root(), "0000:01:00.0");
    fs::write(pf.join("sriov_totalvfs"), "7\n").expect("w");
    fs::write(pf.join("sriov_numvfs"), "2\n").expect("w");
    fs::write(pf.join("numa_node"), "1\n").expect("w");
    let all = scan(sys.root()).expect("scan");
    assert_eq!(all.len(), 2);
    assert_eq!(
        all[0],
        PciFunction {
            bdf: "0000:00:03.0".into(),
            vendor: 0x1234,
            device: 0x11e8,
            class: 0x00ff00,
            driver: Some("vfio-pci".into()),
            iommu_group: Some(3),
            sriov: None,
            numa_node: None,
            reset_methods: vec!["flr".into(), "bus".into()],
        }
    );
    assert_eq!(all[1].sriov, Some((7, 2)));
    assert_eq!(all[1].numa_node, Some(1));
    assert_eq!(all[1].driver.as_deref(), Some("igb"));
}

#[test]
fn a_device_bound_to_vfio_in_a_clean_group_is_openable() {
    let sys = FakeSys::new();
    sys.add(
        "0000:00:03.0",
        ("0x1234", "0x11e8"),
        Some("vfio-pci"),
        Some(3),
    );
    sys.add("0000:00:03.1", ("0x1234", "0x11e9"), None, Some(3));
    // A port or bridge of the group bound to its port driver does not spoil it (the kernel
    // allows it too).
    sys.add(
        "0000:00:1c.0",
        ("0x8086", "0xa110"),
        Some("pcieport"),
        Some(3),
    );
    assert_eq!(check_openable(sys.root(), "0000:00:03.0").expect("ok"), 3);
}

#[test]
fn open_checks_name_the_problem() {
    let sys = FakeSys::new();
    sys.add(
        "0000:00:03.0",
        ("0x1234", "0x11e8"),
        Some("vfio-pci"),
        Some(3),
    );
    sys.add("0000:00:03.1", ("0x8086", "0x10c9"), Some("igb"), Some(3));
    sys.add("0000:00:04.0", ("0x1234", "0x11e8"), Some("igb"), Some(4));
    sys.add("0000:00:05.0", ("0x1234", "0x11e8"), None, Some(6));
    sys.add("0000:00:06.0", ("0x1234", "0x11e8"), Some("vfio-pci"), None);
    let e = check_openable(sys.root(), "0000:00:03.0").expect_err("group");
    assert!(
        matches!(&e, Error::GroupNotViable { group: 3, other, driver } if other == "0000:00:03.1" && driver == "igb"),
        "{e}"
    );
    assert!(e.to_string().contains("not viable"), "{e}");
    let e = check_openable(sys.root(), "0000:00:04.0").expect_err("driver");
    assert!(e.to_string().contains("bound to igb, not vfio-pci"), "{e}");
    let e = check_openable(sys.root(), "0000:00:05.0").expect_err("no driver");
    assert!(e.to_string().contains("bound to no driver"), "{e}");
    let e = check_openable(sys.root(), "0000:00:06.0").expect_err("group");
    assert!(matches!(e, Error::NoIommuGroup(_)), "{e}");
    let e = check_openable(sys.root(), "0000:00:07.0").expect_err("none");
    assert!(matches!(e, Error::NoDevice { .. }), "{e}");
}

#[test]
fn bind_vfio_unbinds_overrides_and_probes() {
    let sys = FakeSys::new();
    sys.add("0000:01:00.0", ("0x8086", "0x10c9"), Some("igb"), Some(5));
    // The fake driver's unbind file.
    fs::write(sys.root().join("bus/pci/drivers/igb/unbind"), "").expect("w");
    bind_vfio(sys.root(), "0000:01:00.0").expect("bind");
    assert_eq!(sys.read("0000:01:00.0", "driver_override"), "vfio-pci");
    assert_eq!(
        fs::read_to_string(sys.root().join("bus/pci/drivers/igb/unbind")).expect("r"),
        "0000:01:00.0"
    );
    assert_eq!(
        fs::read_to_string(sys.root().join("bus/pci/drivers_probe")).expect("r"),
        "0000:01:00.0"
    );
    // Already bound: nothing written.
    sys.add(
        "0000:00:03.0",
        ("0x1234", "0x11e8"),
        Some("vfio-pci"),
        Some(3),
    );
    bind_vfio(sys.root(), "0000:00:03.0").expect("bind");
    assert_eq!(sys.read("0000:00:03.0", "driver_override"), "(null)\n");
    assert!(matches!(
        bind_vfio(sys.root(), "0000:09:00.0"),
        Err(Error::NoDevice { .. })
    ));
}

#[test]
fn create_vfs_turns_autoprobe_off_and_sets_the_count() {
    let sys = FakeSys::new();
    sys.add("0000:01:00.0", ("0x8086", "0x10c9"), Some("igb"), Some(5));
    let pf = device_dir(sys.root(), "0000:01:00.0");
    fs::write(pf.join("sriov_totalvfs"), "7\n").expect("w");
    fs::write(pf.join("sriov_numvfs"), "1\n").expect("w");
    fs::write(pf.join("sriov_drivers_autoprobe"), "1\n").expect("w");
    // What the kernel would make: virtfn links.
    sys.add("0000:01:10.0", ("0x8086", "0x10ca"), None, Some(6));
    sys.add("0000:01:10.2", ("0x8086", "0x10ca"), None, Some(7));
    symlink(
        sys.root().join("devices/pci0000:00/0000:01:10.0"),
        pf.join("virtfn0"),
    )
    .expect("l");
    symlink(
        sys.root().join("devices/pci0000:00/0000:01:10.2"),
        pf.join("virtfn1"),
    )
    .expect("l");
    let vfs = create_vfs(sys.root(), "0000:01:00.0", 2).expect("vfs");
    assert_eq!(vfs, ["0000:01:10.0", "0000:01:10.2"]);
    assert_eq!(sys.read("0000:01:00.0", "sriov_drivers_autoprobe"), "0");
    assert_eq!(sys.read("0000:01:00.0", "sriov_numvfs"), "2");
    let e = create_vfs(sys.root(), "0000:01:00.0", 8).expect_err("too many");
    assert!(
        matches!(
            e,
            Error::TooManyVfs {
                total: 7,
                asked: 8,
                ..
            }
        ),
        "{e}"
    );
    sys.add(
        "0000:00:03.0",
        ("0x1234", "0x11e8"),
        Some("vfio-pci"),
        Some(3),
    );
    assert!(matches!(
        create_vfs(sys.root(), "0000:00:03.0", 1),
        Err(Error::NoSriov(_))
    ));
}

#[test]
fn msix_is_read_from_the_capability_list_when_the_whole_config_space_is_readable() {
    let sys = FakeSys::new();
    sys.add(
        "0000:00:04.0",
        ("0x1234", "0x11e8"),
        Some("vfio-pci"),
        Some(4),
    );
    let config = sys.root().join("bus/pci/devices/0000:00:04.0/config");
    let mut c = vec![0u8; 256];
    c[0x06] = 1 << 4; // a capability list
    c[0x34] = 0x40;
    c[0x40] = 0x01; // PM
    c[0x41] = 0x50;
    c[0x50] = 0x05; // MSI, last
    fs::write(&config, &c).expect("w");
    assert_eq!(
        has_msix(sys.root(), "0000:00:04.0"),
        Some(false),
        "MSI only (an edu)"
    );
    c[0x51] = 0x70;
    c[0x70] = 0x11; // MSI-X
    fs::write(&config, &c).expect("w");
    assert_eq!(has_msix(sys.root(), "0000:00:04.0"), Some(true));
    // A list that points back at itself ends.
    c[0x70] = 0x09;
    c[0x71] = 0x40;
    fs::write(&config, &c).expect("w");
    assert_eq!(has_msix(sys.root(), "0000:00:04.0"), Some(false));
    // As a user other than root reads it: 64 bytes, too few to tell.
    fs::write(&config, &c[..64]).expect("w");
    assert_eq!(has_msix(sys.root(), "0000:00:04.0"), None);
    assert_eq!(has_msix(sys.root(), "0000:00:09.0"), None, "no such device");
}

#[test]
fn the_kinds_inventory_lists_the_functions_for_people_and_programs() {
    use switchyard_device::kind::{DeviceKind, Host};
    let sys = FakeSys::new();
    sys.add(
        "0000:00:04.0",
        ("0x1234", "0x11e8"),
        Some("vfio-pci"),
        Some(7),
    );
    sys.add("0000:00:05.0", ("0x8086", "0x10c9"), None, None);
    let host = Host {
        sysfs: sys.root().to_owned(),
    };
    let inv = crate::VfioKind
        .host_inventory(&host)
        .expect("the passthrough kind lists the host")
        .expect("scans");
    assert_eq!(inv.columns.len(), inv.rows[0].len());
    assert_eq!(
        inv.rows
            .iter()
            .map(|r| (r[0].as_str(), r[1].as_str(), r[3].as_str(), r[4].as_str()))
            .collect::<Vec<_>>(),
        [
            ("0000:00:04.0", "1234:11e8", "vfio-pci", "7"),
            ("0000:00:05.0", "8086:10c9", "-", "-")
        ]
    );
    let devices = inv.json["devices"].as_array().expect("devices");
    assert_eq!(devices[0]["bdf"], "0000:00:04.0");
    assert_eq!(devices[0]["driver"], "vfio-pci");
    assert_eq!(devices[0]["iommu_group"], 7);
    assert_eq!(devices[1]["driver"], serde_json::Value::Null);

    let gone = Host {
        sysfs: sys.root().join("nowhere"),
    };
    let e = crate::VfioKind
        .host_inventory(&gone)
        .expect("listed")
        .expect_err("no sysfs");
    assert!(e.starts_with("Cannot scan PCI devices"), "{e}");
}
