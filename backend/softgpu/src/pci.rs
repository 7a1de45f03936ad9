//! The softgpu as a vfio-user device: regions, interrupts, reset and the migration steps the
//! server drives ([`PciDevice`]).

use super::*;

impl PciDevice for SoftGpu {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        match region {
            BAR_REGS => {
                Self::access_ok(BAR_REGS, regs::BAR0_SIZE, offset, data.len())?;
                if let Some(page) = doorbell_offset(offset) {
                    for (i, chunk) in data.chunks_exact_mut(4).enumerate() {
                        let v = self
                            .shared
                            .bells
                            .load(page + 4 * i, std::sync::atomic::Ordering::SeqCst);
                        chunk.copy_from_slice(&v.to_le_bytes());
                    }
                    return Ok(());
                }
                let g = self.shared.lock();
                for (i, chunk) in data.chunks_exact_mut(4).enumerate() {
                    chunk.copy_from_slice(&g.read32(offset + 4 * i as u64).to_le_bytes());
                }
                Ok(())
            }
            BAR_VRAM => {
                self.shared.vram_access()?;
                self.vram_slice(offset, data.len())?.copy_to(data);
                Ok(())
            }
            BAR_MSIX if self.config.irq == IrqMode::Msix => {
                Self::access_ok(BAR_MSIX, regs::BAR4_SIZE, offset, data.len())?;
                let g = self.shared.lock();
                if offset < regs::MSIX_PBA_OFFSET {
                    g.st.msix.table_read(offset - regs::MSIX_TABLE_OFFSET, data);
                } else {
                    g.st.msix.pba_read(offset - regs::MSIX_PBA_OFFSET, data);
                }
                Ok(())
            }
            CONFIG_REGION_INDEX => {
                let g = self.shared.lock();
                if g.st.config_space.read(offset, data) {
                    Ok(())
                } else {
                    Err(Self::config_out_of_range(offset, data.len()))
                }
            }
            _ => Err(DeviceError::NoSuchRegion(region)),
        }
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        match region {
            BAR_REGS => {
                Self::access_ok(BAR_REGS, regs::BAR0_SIZE, offset, data.len())?;
                if let Some(page) = doorbell_offset(offset) {
                    self.doorbell_page_write(page, data);
                    return Ok(());
                }
                let mut g = self.shared.lock();
                for (i, chunk) in data.chunks_exact(4).enumerate() {
                    let v = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                    g = self.shared.write32(g, offset + 4 * i as u64, v);
                }
                let wake = device::Shared::take_pending_wake(&mut g);
                drop(g);
                self.shared.wake_pending(wake);
                Ok(())
            }
            BAR_VRAM => {
                self.shared.vram_access()?;
                self.vram_slice(offset, data.len())?.copy_from(data);
                self.shared.vram.mark(offset, data.len() as u64);
                self.shared.vram.host_wrote(offset, data.len() as u64);
                Ok(())
            }
            BAR_MSIX if self.config.irq == IrqMode::Msix => {
                Self::access_ok(BAR_MSIX, regs::BAR4_SIZE, offset, data.len())?;
                let mut g = self.shared.lock();
                if offset < regs::MSIX_PBA_OFFSET {
                    let held = g.msix_held();
                    let table = offset - regs::MSIX_TABLE_OFFSET;
                    let sink = device::OwedSink::default();
                    g.st.msix.table_write(table, data, held, &sink);
                    g.owe(&sink);
                    g.cold_changed();
                }
                // PBA writes are ignored.
                Ok(())
            }
            CONFIG_REGION_INDEX => {
                let mut g = self.shared.lock();
                g.cold_changed();
                let fx =
                    g.st.config_space
                        .write(offset, data)
                        .ok_or_else(|| Self::config_out_of_range(offset, data.len()))?;
                if fx.flr {
                    tracing::debug!("function level reset");
                    drop(self.shared.reset(g, true));
                } else {
                    self.shared
                        .config_changed(&mut g, fx.command, fx.msix_control);
                }
                Ok(())
            }
            _ => Err(DeviceError::NoSuchRegion(region)),
        }
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        let g = self.shared.lock();
        drop(self.shared.reset(g, true));
        Ok(())
    }

    fn fresh_open(&mut self) -> Result<(), DeviceError> {
        let mut g = self.shared.lock();
        self.shared.fresh_pci(&mut g);
        Ok(())
    }

    fn client_disconnected(&mut self) {
        self.client_mapped = false;
        self.shared.halt();
    }

    fn migration(&mut self) -> Option<&mut dyn Migratable> {
        Some(self)
    }

    fn swappable(&mut self) -> Option<&mut dyn Swappable> {
        Some(self)
    }

    fn recoverable(&self) -> Option<&dyn switchyard_device::Recoverable> {
        Some(self)
    }

    fn relocatable(&mut self) -> Option<&mut dyn switchyard_device::Relocatable> {
        Some(self)
    }

    fn telemetry(&self) -> Option<&dyn switchyard_device::Telemetry> {
        Some(self)
    }

    fn faults(&self) -> Option<&dyn switchyard_device::FaultInjection> {
        Some(self)
    }

    fn failure_unhandled(&self) {
        self.shared.faults.unhandled(&self.shared.irqs);
    }

    fn dma_observer(&self) -> Option<Arc<dyn switchyard_device::DmaObserver>> {
        self.shared.accel.get().and_then(|a| a.dma_observer())
    }
}

/// The offset in the doorbell page of a (checked) BAR0 access at `offset`, if it is one.
fn doorbell_offset(offset: u64) -> Option<usize> {
    let page = offset.checked_sub(regs::DOORBELL_PAGE)?;
    (page < regs::DOORBELL_PAGE_SIZE).then_some(page as usize)
}

impl SoftGpu {
    /// A trapped write into the doorbell page (a client that does not map it): stores the
    /// words; a `DB_TAIL` of a queue is also a kick, as a mapped store followed by a
    /// `DOORBELL` write would be.
    fn doorbell_page_write(&self, page: usize, data: &[u8]) {
        let mut kick = 0u32;
        for (i, chunk) in data.chunks_exact(4).enumerate() {
            let at = page + 4 * i;
            let v = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
            self.shared
                .bells
                .store(at, v, std::sync::atomic::Ordering::SeqCst);
            let q = at / regs::DB_STRIDE as usize;
            if at % regs::DB_STRIDE as usize == regs::DB_TAIL as usize
                && q < self.config.queues as usize
            {
                kick |= 1 << q;
            }
        }
        if kick != 0 {
            let mut g = self.shared.lock();
            for q in 0..self.config.queues as usize {
                if kick & (1 << q) != 0 {
                    self.shared.kick(&mut g, q);
                }
            }
            let wake = device::Shared::take_pending_wake(&mut g);
            drop(g);
            self.shared.wake_pending(wake);
        }
    }

    /// The device state as one serialized blob ([`SoftGpuState`], VRAM by reference).
    pub fn save_state(&mut self) -> Result<Vec<u8>, DeviceError> {
        self.snapshot()
            .to_bytes()
            .map_err(|e| DeviceError::BadState(Box::new(e)))
    }

    /// Restores a blob made by [`SoftGpu::save_state`].
    pub fn restore_state(&mut self, state: &[u8]) -> Result<(), DeviceError> {
        let st = SoftGpuState::from_bytes(state).map_err(|e| DeviceError::BadState(Box::new(e)))?;
        self.load(st)
            .map_err(|e| DeviceError::BadState(Box::new(e)))
    }
}

impl Migratable for SoftGpu {
    fn caps(&self) -> MigrationCaps {
        // P2P: quiescing is holding the engines (no command starts, so no DMA and no
        // interrupt from them; the one running finishes first), registers still served.
        MigrationCaps {
            precopy: true,
            p2p: true,
        }
    }

    fn step(&mut self, arc: MigArc) -> Result<(), DeviceError> {
        let vram = &self.shared.vram;
        let size = vram.size();
        match arc {
            MigArc::Stop | MigArc::EnterP2p => self.shared.set_running(false),
            MigArc::Run | MigArc::LeaveP2p => self.shared.set_running(true),
            // Quiesced and stopped are one for the engines: the registers take no guest
            // accesses in STOP (its vCPUs are stopped).
            MigArc::StopFromP2p | MigArc::P2pFromStop => {}
            MigArc::StartPreCopy | MigArc::StartPreCopyP2p => {
                self.migration = Migration::Save(Box::new(mig::MigSource::new(
                    vram,
                    false,
                    self.client_mapped,
                )));
            }
            MigArc::AbortPreCopy | MigArc::AbortPreCopyP2p | MigArc::EndStopCopy => {
                if let Migration::Save(src) = &self.migration {
                    let st = src.stats();
                    let stop_copy_us = src
                        .stop_copy_time()
                        .map_or(0, |t| u64::try_from(t.as_micros()).unwrap_or(u64::MAX));
                    tracing::info!(
                        stop_copy_us,
                        client_mapped = src.client_mapped(),
                        rounds = st.rounds,
                        pages_sent = st.pages_sent,
                        pages_zeroed = st.pages_zeroed,
                        budget_stops = st.budget_stops,
                        completed = arc == MigArc::EndStopCopy,
                        "outgoing migration stream closed"
                    );
                }
                self.migration = Migration::Idle;
            }
            MigArc::PreCopyToStopCopy | MigArc::PreCopyP2pToStopCopy => {
                self.shared.set_running(false);
                match &mut self.migration {
                    Migration::Save(src) => src.device_stopped(vram),
                    _ => {
                        self.migration =
                            Migration::Save(Box::new(mig::MigSource::new(vram, true, false)));
                    }
                }
            }
            MigArc::StartStopCopy => {
                self.migration = Migration::Save(Box::new(mig::MigSource::new(vram, true, false)));
            }
            MigArc::StartResuming => {
                // The stream's pages apply on zeroed VRAM; the state comes last.
                vram.zero();
                self.migration = Migration::Load(Box::new(mig::MigSink::new(size)));
            }
            MigArc::EndResuming => {
                let sink = match std::mem::replace(&mut self.migration, Migration::Idle) {
                    Migration::Load(sink) => sink,
                    _ => return Err(DeviceError::BadState("no incoming stream".into())),
                };
                let bytes = sink
                    .finish()
                    .map_err(|e| DeviceError::BadState(Box::new(e)))?;
                self.restore_state(&bytes)?;
            }
        }
        Ok(())
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize, DeviceError> {
        let Migration::Save(src) = &mut self.migration else {
            return Err(DeviceError::BadState("no outgoing stream".into()));
        };
        let shared = &self.shared;
        shared.vram_access()?;
        let mut state = || shared.snapshot().to_bytes().map_err(std::io::Error::other);
        let n = src.read(&shared.vram, &mut state, buf)?;
        // VRAM that failed while it was read gave no data: this chunk is no stream.
        shared.vram_access()?;
        Ok(n)
    }

    fn write(&mut self, data: &[u8]) -> Result<(), DeviceError> {
        let Migration::Load(sink) = &mut self.migration else {
            return Err(DeviceError::BadState("no incoming stream".into()));
        };
        self.shared.vram_access()?;
        sink.write(&self.shared.vram, data)
            .map_err(|e| DeviceError::BadState(Box::new(e)))?;
        self.shared.vram_access()
    }

    fn abort(&mut self) {
        self.migration = Migration::Idle;
        self.shared.set_running(true);
    }

    /// BAR0 (its mapped doorbell page: the device state carries the tails, and the
    /// destination writes them into its page after the client's copy) and, when the client
    /// may map it, BAR2 (VRAM: the device logs every write it makes there, `Vram::mark`).
    fn client_migratable_regions(&self) -> u64 {
        let vram = if self.config.vram_mmap { 1 << 2 } else { 0 };
        1 | vram
    }

    fn set_client_migrates_mapped(&mut self, on: bool) {
        self.client_mapped = on;
    }

    fn precopy_info(&mut self) -> Option<PrecopyInfo> {
        let Migration::Save(src) = &self.migration else {
            return None;
        };
        let (initial_bytes, dirty_bytes) = src.pending(&self.shared.vram);
        Some(PrecopyInfo {
            initial_bytes,
            dirty_bytes,
        })
    }

    fn stop_copy_size(&mut self) -> Option<u64> {
        // The state record's real size: the state is small and encoded in microseconds.
        let state_len = self
            .shared
            .snapshot()
            .to_bytes()
            .map_or(u64::from(mig::MAX_STATE), |b| b.len() as u64);
        let vram = &self.shared.vram;
        Some(match &self.migration {
            Migration::Save(src) => src.stop_copy_size(vram, state_len),
            _ => mig::MigSource::full_stream_size(vram, state_len),
        })
    }
}
