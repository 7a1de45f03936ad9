//! Building a server on a device whose constructor returns it boxed (a device kind from a
//! registry), and continuing a replaced process's device ([`Server::resume`]).
//!
//! The contract a replacement keeps: the client's DMA windows and interrupt eventfds are
//! restored into the slot's tables before the device is built (a device recovering from
//! its black box may read its rings through them), and the device's own observer and
//! interrupt router ([`DmaObserver`](switchyard_device::DmaObserver),
//! [`IrqRouter`](switchyard_device::IrqRouter)) are given every restored window and eventfd
//! when it takes the slot, before the server serves anything: a passthrough device's IOMMU
//! and the kernel see the client's state exactly as a device that served it from the start.

use std::os::fd::OwnedFd;

use switchyard_device::{DeviceContext, PciDevice};

use crate::continuity::Resumed;
use crate::{DeviceSocket, Server, ServerConfig, ServerError, Unrestored};

impl Server {
    /// [`Server::new`] for a device built boxed (any kind).
    pub fn new_boxed<E>(
        config: ServerConfig,
        build: impl FnOnce(DeviceContext) -> Result<Box<dyn PciDevice>, E>,
    ) -> Result<Self, ServerError>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::build(config, None, build)
    }

    /// [`Server::with_socket`] for a device built boxed (any kind).
    pub fn with_device<E>(
        config: ServerConfig,
        socket: DeviceSocket,
        build: impl FnOnce(DeviceContext) -> Result<Box<dyn PciDevice>, E>,
    ) -> Result<Self, ServerError>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::build(config, Some(socket), build)
    }

    /// Continues the device a replaced process served: restores the client's tables from
    /// `tables` and the descriptors `fd(id)` gives ([`Server::restore_tables`]), builds the
    /// device on them, then hands every window to the device's DMA observer and every
    /// eventfd to its interrupt router. What could not be restored, at any of these steps,
    /// is returned: the caller drops it from its continuity's tables
    /// ([`crate::continuity::Continuity::forget`]) and tells its supervisor.
    pub fn resume<E>(
        config: ServerConfig,
        socket: DeviceSocket,
        tables: &Resumed,
        fd: impl FnMut(u64) -> Option<OwnedFd>,
        build: impl FnOnce(DeviceContext) -> Result<Box<dyn PciDevice>, E>,
    ) -> Result<(Self, Unrestored), ServerError>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut lost = Unrestored::default();
        let server = Self::build(config, Some(socket), |ctx| {
            lost = Self::restore_tables(&ctx, tables, fd);
            build(ctx)
        })?;
        server.hand_tables_to_device(&mut lost);
        Ok((server, lost))
    }

    /// Gives the device in the slot the windows and eventfds already in the tables (see the
    /// module documentation); what it refuses is added to `lost` (a refused window also
    /// leaves the table).
    fn hand_tables_to_device(&self, lost: &mut Unrestored) {
        let ctx = self.slot.context();
        for (iova, size, e) in ctx.dma.replay_to_observer() {
            let mut why = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                why.push_str(&format!(": {s}"));
                source = s.source();
            }
            lost.problems.push(format!(
                "DMA window {iova:#x}+{size:#x} to the device: {why}"
            ));
            lost.windows.push((iova, size));
        }
        let triggers = ctx.irqs.triggers();
        if triggers.is_empty() {
            return;
        }
        self.slot.with(|d| {
            let Some(router) = d.irq_router() else {
                return;
            };
            for (index, vector, file) in triggers {
                if let Err(e) = router.route(index, vector, &[Some(&file)]) {
                    lost.problems
                        .push(format!("interrupt {index}/{vector} to the device: {e}"));
                    lost.vectors.push((index, vector));
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::fs::File;
    use std::sync::{Arc, Mutex};

    use switchyard_device::{
        DeviceDescription, DeviceError, DmaObserver, DmaProt, IrqDesc, IrqRouter, PciDevice,
        RegionDesc,
    };

    use super::*;
    use crate::continuity::WindowRecord;

    const REFUSED: u64 = 0x9000_0000;

    #[derive(Default)]
    struct Seen {
        /// Windows the observer accepted, in the order it was told.
        mapped: Vec<u64>,
        /// Vectors routed, `(index, vector)`.
        routed: Vec<(u32, u32)>,
        /// Windows in the DMA space when the device was built (restored before it).
        at_build: usize,
    }

    struct Iommu(Arc<Mutex<Seen>>);

    impl DmaObserver for Iommu {
        fn mapping(
            &self,
            iova: u64,
            _size: u64,
            _prot: DmaProt,
            _file: Option<(&File, u64)>,
        ) -> Result<(), DeviceError> {
            if iova == REFUSED {
                return Err(DeviceError::Unsupported);
            }
            self.0.lock().expect("lock").mapped.push(iova);
            Ok(())
        }

        fn unmapped(&self, _iova: u64, _size: u64) {}
    }

    /// A passthrough-like device: an IOMMU to program and interrupts to route itself.
    struct Passthrough {
        desc: DeviceDescription,
        seen: Arc<Mutex<Seen>>,
    }

    impl IrqRouter for Passthrough {
        fn route(
            &mut self,
            index: u32,
            start: u32,
            fds: &[Option<&File>],
        ) -> switchyard_device::Result<()> {
            let mut seen = self.seen.lock().expect("lock");
            for (v, fd) in (start..).zip(fds) {
                if fd.is_some() {
                    seen.routed.push((index, v));
                }
            }
            Ok(())
        }
    }

    impl PciDevice for Passthrough {
        fn description(&self) -> &DeviceDescription {
            &self.desc
        }
        fn region_read(&mut self, r: u32, _o: u64, _d: &mut [u8]) -> switchyard_device::Result<()> {
            Err(DeviceError::NoSuchRegion(r))
        }
        fn region_write(&mut self, r: u32, _o: u64, _d: &[u8]) -> switchyard_device::Result<()> {
            Err(DeviceError::NoSuchRegion(r))
        }
        fn reset(&mut self) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn dma_observer(&self) -> Option<Arc<dyn DmaObserver>> {
            Some(Arc::new(Iommu(self.seen.clone())))
        }
        fn irq_router(&mut self) -> Option<&mut dyn IrqRouter> {
            Some(self)
        }
    }

    fn memfd(len: u64) -> std::os::fd::OwnedFd {
        let f = memfd::MemfdOptions::default()
            .create("resume-test")
            .expect("memfd")
            .into_file();
        f.set_len(len).expect("size");
        f.into()
    }

    /// The resume contract: windows and eventfds restored before the device is built (it
    /// may read through them), then every one of them given to the device's IOMMU and
    /// interrupt router before anything is served; what the device refuses is reported and
    /// leaves the tables.
    #[test]
    fn a_resumed_device_sees_every_restored_window_and_eventfd() {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = DeviceSocket::bind(&dir.path().join("s.sock"), 0o600).expect("bind");
        let window = |iova, fd| WindowRecord {
            iova,
            size: 0x1000,
            offset: 0,
            read: true,
            write: true,
            fd: Some(fd),
        };
        let tables = Resumed {
            windows: vec![
                window(0x1000_0000, 10),
                window(REFUSED, 11),
                window(0x2000_0000, 12),
            ],
            vectors: BTreeMap::from([((2, 0), 20), ((2, 3), 21)]),
            ..Resumed::default()
        };
        let mut held: BTreeMap<u64, std::os::fd::OwnedFd> = BTreeMap::new();
        for id in [10, 11, 12] {
            held.insert(id, memfd(0x1000));
        }
        for id in [20, 21] {
            held.insert(
                id,
                switchyard_device::irq::new_eventfd()
                    .expect("eventfd")
                    .into(),
            );
        }
        let seen = Arc::new(Mutex::new(Seen::default()));
        let seen2 = seen.clone();
        let irq = |count| IrqDesc {
            count,
            eventfd: true,
            maskable: true,
            automasked: false,
            noresize: false,
        };
        let (server, lost) = Server::resume(
            ServerConfig::new(dir.path().join("s.sock")),
            socket,
            &tables,
            |id| held.get(&id).and_then(|f| f.try_clone().ok()),
            |ctx| {
                seen2.lock().expect("lock").at_build = ctx.dma.mappings().len();
                Ok::<_, std::io::Error>(Box::new(Passthrough {
                    desc: DeviceDescription {
                        name: "passthrough-mock",
                        regions: vec![RegionDesc::absent(); 9],
                        irqs: vec![irq(0), irq(0), irq(4), irq(1), irq(1)],
                        resettable: true,
                    },
                    seen: seen2.clone(),
                }) as Box<dyn PciDevice>)
            },
        )
        .expect("resume");
        let seen = seen.lock().expect("lock");
        assert_eq!(
            seen.at_build, 3,
            "the tables are restored before the device is built"
        );
        assert_eq!(
            seen.mapped,
            vec![0x1000_0000, 0x2000_0000],
            "the device's IOMMU saw every window it accepts"
        );
        assert_eq!(seen.routed, vec![(2, 0), (2, 3)], "every eventfd routed");
        assert_eq!(lost.windows, vec![(REFUSED, 0x1000)], "{:?}", lost.problems);
        assert!(lost.vectors.is_empty(), "{:?}", lost.problems);
        assert!(
            lost.problems[0].contains("to the device"),
            "{:?}",
            lost.problems
        );
        let left: Vec<u64> = server
            .device_slot()
            .context()
            .dma
            .mappings()
            .iter()
            .map(|m| m.iova)
            .collect();
        assert_eq!(
            left,
            vec![0x1000_0000, 0x2000_0000],
            "a refused window leaves the table"
        );
    }
}
