//! The suite on two mocks: a device with no optional group (made by a closure), and a
//! recording device kind with migration, swap, recovery and telemetry (no relocation) that
//! logs what the suite did to it. Each mock also comes with faults, one per check, each of
//! which that check (and only that check) must catch: the suite can fail.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use switchyard_conformance::{
    CHECKS, Groups, Moves, Subject, checks, conformance_tests, run, run_all,
};
use switchyard_device::blackbox::{Record, RecordSpec};
use switchyard_device::config::{Bar, BarKind, ConfigSpace, PciIds};
use switchyard_device::kind::{
    Build, DeviceKind, DirtyLog, KindConfig, KindError, KindOptions, Profile, opt,
};
use switchyard_device::{
    CONFIG_REGION_INDEX, DeviceContext, DeviceDescription, DeviceError, IrqDesc, MigArc,
    Migratable, MigrationCaps, PciDevice, Quiesce, QuiesceGuard, Recoverable, RegionDesc,
    SuccessorFactory, Swappable, Telemetry, WorkCounters,
};

/// BAR0 of both mocks: trapped memory.
const BAR0: u64 = 0x1000;
/// The recording mock's black-box record.
const RECORD: &str = "mock.state";

fn config_definition(device: u16) -> ConfigSpace {
    let mut c = ConfigSpace::new(PciIds {
        vendor: 0x1b36,
        device,
        subsystem_vendor: 0x1af4,
        subsystem: 0x1100,
        revision: 1,
        class: 0x0b_40_00,
    });
    c.add_bar(
        0,
        Bar {
            size: BAR0,
            kind: BarKind::Mem32 {
                prefetchable: false,
            },
        },
    );
    c.add_pm_cap();
    c.seal();
    c
}

fn description(name: &'static str) -> DeviceDescription {
    let mut regions = vec![RegionDesc::absent(); 9];
    regions[0] = RegionDesc::trapped(BAR0);
    regions[CONFIG_REGION_INDEX as usize] =
        RegionDesc::trapped(switchyard_device::config::CONFIG_SIZE as u64);
    let none = IrqDesc {
        count: 0,
        eventfd: false,
        maskable: false,
        automasked: false,
        noresize: true,
    };
    let intx = IrqDesc {
        count: 1,
        eventfd: true,
        maskable: true,
        automasked: true,
        noresize: true,
    };
    DeviceDescription {
        name,
        regions,
        irqs: vec![intx, none, none, none, none],
        resettable: true,
    }
}

/// A BAR0 access's bytes, if it is in range.
fn bar0_range(offset: u64, len: usize) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(len)?;
    (end <= BAR0 as usize).then_some(start..end)
}

fn out_of_range(region: u32, offset: u64, len: usize) -> DeviceError {
    DeviceError::OutOfRange {
        region,
        offset,
        len,
    }
}

// ---------------------------------------------------------------------------------------------
// The plain mock: the core and nothing else.

/// What a plain mock gets wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PlainFault {
    None,
    /// BAR0 reads index the memory without a bounds check.
    PanicsPastTheEnd,
    /// A reset comes back with another device ID.
    ResetChangesIdentity,
    /// Says it cannot reset, and resets anyway.
    ResetsWithoutSayingSo,
    /// Reads guest memory on every access after the client left.
    DmaAfterTheClientLeft,
    /// Keeps what a client wrote into config space for the next one.
    KeepsConfigForTheNextClient,
}

struct Plain {
    desc: DeviceDescription,
    config: ConfigSpace,
    bar0: Vec<u8>,
    fault: PlainFault,
    ctx: DeviceContext,
    gone: bool,
}

impl Plain {
    fn new(ctx: DeviceContext, fault: PlainFault) -> Self {
        let mut desc = description("plain-mock");
        desc.resettable = fault != PlainFault::ResetsWithoutSayingSo;
        Self {
            desc,
            config: config_definition(0x0100),
            bar0: vec![0; BAR0 as usize],
            fault,
            ctx,
            gone: false,
        }
    }

    fn touch_dma(&self) {
        if self.gone && self.fault == PlainFault::DmaAfterTheClientLeft {
            let mut b = [0u8; 4];
            let _ = self.ctx.dma.read(0x1000, &mut b);
        }
    }
}

impl PciDevice for Plain {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> switchyard_device::Result<()> {
        self.touch_dma();
        match region {
            0 if self.fault == PlainFault::PanicsPastTheEnd => {
                let start = offset as usize;
                data.copy_from_slice(&self.bar0[start..start + data.len()]);
                Ok(())
            }
            0 => {
                let r = bar0_range(offset, data.len())
                    .ok_or_else(|| out_of_range(0, offset, data.len()))?;
                data.copy_from_slice(&self.bar0[r]);
                Ok(())
            }
            CONFIG_REGION_INDEX if self.config.read(offset, data) => Ok(()),
            CONFIG_REGION_INDEX => Err(out_of_range(region, offset, data.len())),
            _ => Err(DeviceError::NoSuchRegion(region)),
        }
    }

    fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
    ) -> switchyard_device::Result<()> {
        self.touch_dma();
        match region {
            0 => {
                let r = bar0_range(offset, data.len())
                    .ok_or_else(|| out_of_range(0, offset, data.len()))?;
                self.bar0[r].copy_from_slice(data);
                Ok(())
            }
            CONFIG_REGION_INDEX => self
                .config
                .write(offset, data)
                .map(|_| ())
                .ok_or_else(|| out_of_range(region, offset, data.len())),
            _ => Err(DeviceError::NoSuchRegion(region)),
        }
    }

    fn reset(&mut self) -> switchyard_device::Result<()> {
        self.config = if self.fault == PlainFault::ResetChangesIdentity {
            config_definition(0x0101)
        } else {
            config_definition(0x0100)
        };
        self.bar0.fill(0);
        Ok(())
    }

    fn fresh_open(&mut self) -> switchyard_device::Result<()> {
        if self.fault != PlainFault::KeepsConfigForTheNextClient {
            self.config.reset();
        }
        Ok(())
    }

    fn client_disconnected(&mut self) {
        self.gone = true;
    }
}

fn plain(fault: PlainFault) -> Subject {
    Subject::from_fn("plain-mock", move |b: Build| {
        Ok(Box::new(Plain::new(b.ctx, fault)) as Box<dyn PciDevice>)
    })
    .declares(Groups::NONE)
}

conformance_tests!(plain_mock, plain(PlainFault::None));

// ---------------------------------------------------------------------------------------------
// The recording mock: a kind with migration, swap, recovery and telemetry.

/// What a recording mock gets wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The destination ignores the stream it loads (it keeps its fresh state).
    LoadsNothing,
    /// The destination loads whatever it is given, half a stream included.
    LoadsAnything,
    /// `check_successor` accepts any device.
    AcceptsAnySuccessor,
    /// The rebuild ignores the black box (a fresh device).
    RecoversFresh,
    /// Telemetry counters that go backwards.
    CountersGoBackwards,
    /// The profile says the device moves; it cannot.
    ProfileSaysMovable,
    /// The device has MSI-X vectors its profile does not mention.
    UndeclaredMsix,
}

/// Everything the suite did to the devices of one subject, in order.
type Log = Arc<Mutex<Vec<String>>>;

fn log(log: &Log, event: impl Into<String>) {
    log.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(event.into());
}

/// The mock's kind; with its only option checked, also its configuration.
#[derive(Debug, Clone)]
struct RecordingKind {
    log: Log,
    fault: Fault,
}

impl RecordingKind {
    fn bar0(options: &KindOptions) -> Result<u64, KindError> {
        opt::only(options, &["bar0"])?;
        match opt::size(options, "bar0")?.unwrap_or(BAR0) {
            BAR0 => Ok(BAR0),
            other => Err(KindError::option("bar0", format!("{other} is not {BAR0}"))),
        }
    }
}

impl DeviceKind for RecordingKind {
    fn name(&self) -> &'static str {
        "recording-mock"
    }

    fn summary(&self) -> &'static str {
        "a mock that records what was done to it"
    }

    fn options_help(&self) -> &'static str {
        "bar0=SIZE  BAR0's size (4K, the only one)"
    }

    fn configure(&self, options: &KindOptions) -> Result<Box<dyn KindConfig>, KindError> {
        Self::bar0(options)?;
        Ok(Box::new(self.clone()))
    }
}

impl KindConfig for RecordingKind {
    fn options(&self) -> KindOptions {
        let mut canonical = KindOptions::new();
        canonical.insert("bar0".into(), BAR0.into());
        canonical
    }

    fn profile(&self) -> Profile {
        Profile {
            movable: self.fault == Fault::ProfileSaysMovable,
            dirty_log: DirtyLog::AllMapped,
            ..Profile::default()
        }
    }

    fn black_box_records(&self) -> Vec<RecordSpec> {
        vec![RecordSpec::new(RECORD, 64 << 10)]
    }

    fn build(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        log(&self.log, "build");
        Ok(Box::new(Recording::new(self, b, None)?))
    }

    fn recover(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        let bb = b
            .black_box
            .clone()
            .ok_or(KindError::NoRecovery("recording-mock"))?;
        let record = bb
            .record(RECORD)
            .map_err(|e| KindError::build("recording-mock", e))?;
        let saved = match self.fault {
            Fault::RecoversFresh => None,
            _ => record
                .read()
                .map_err(|e| KindError::build("recording-mock", e))?,
        };
        log(
            &self.log,
            format!("recover with {} objects", b.objects.len()),
        );
        Ok(Box::new(Recording::new(self, b, saved)?))
    }
}

#[derive(Default)]
struct Mig {
    /// The outgoing stream and how much of it was read.
    out: Vec<u8>,
    at: usize,
    /// The incoming stream so far.
    incoming: Vec<u8>,
}

/// Parks of one device, by its quiesce handle.
#[derive(Default)]
struct Parks(AtomicU32);

struct Park(Arc<Parks>);

impl Drop for Park {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Handle(Arc<Parks>, Log);

impl Quiesce for Handle {
    fn park(&self) -> QuiesceGuard {
        self.0.0.fetch_add(1, Ordering::SeqCst);
        log(&self.1, "park");
        QuiesceGuard::new(Park(self.0.clone()))
    }
}

struct Recording {
    kind: RecordingKind,
    desc: DeviceDescription,
    definition: ConfigSpace,
    config: ConfigSpace,
    bar0: Vec<u8>,
    ctx: DeviceContext,
    mirror: Option<Record>,
    mig: Mig,
    parks: Arc<Parks>,
    writes: u64,
    reads: u64,
}

/// The device state as bytes: the config space and BAR0, as JSON.
fn encode(config: &ConfigSpace, bar0: &[u8]) -> Vec<u8> {
    serde_json::to_vec(&(config, bar0)).expect("a state encodes")
}

fn decode(bytes: &[u8], definition: &ConfigSpace) -> Result<(ConfigSpace, Vec<u8>), DeviceError> {
    let (mut config, bar0): (ConfigSpace, Vec<u8>) =
        serde_json::from_slice(bytes).map_err(|e| DeviceError::BadState(Box::new(e)))?;
    if bar0.len() != BAR0 as usize {
        return Err(DeviceError::BadState("BAR0 of another size".into()));
    }
    config.restore_masks_from(definition);
    Ok((config, bar0))
}

impl Recording {
    fn new(kind: &RecordingKind, b: Build, saved: Option<Vec<u8>>) -> Result<Self, KindError> {
        let definition = config_definition(0x0200);
        let mirror = b
            .black_box
            .as_ref()
            .map(|bb| bb.record(RECORD))
            .transpose()
            .map_err(|e| KindError::build("recording-mock", e))?;
        let (config, bar0) = match saved {
            Some(s) => {
                decode(&s, &definition).map_err(|e| KindError::build("recording-mock", e))?
            }
            None => (definition.clone(), vec![0; BAR0 as usize]),
        };
        let mut desc = description("recording-mock");
        if kind.fault == Fault::UndeclaredMsix {
            desc.irqs[2] = IrqDesc {
                count: 4,
                eventfd: true,
                maskable: true,
                automasked: false,
                noresize: false,
            };
        }
        let mut d = Self {
            kind: kind.clone(),
            desc,
            definition,
            config,
            bar0,
            ctx: b.ctx,
            mirror,
            mig: Mig::default(),
            parks: Arc::default(),
            writes: 0,
            reads: 0,
        };
        d.publish();
        Ok(d)
    }

    fn log(&self, event: impl Into<String>) {
        log(&self.kind.log, event);
    }

    fn publish(&mut self) {
        let state = encode(&self.config, &self.bar0);
        if let Some(m) = &mut self.mirror {
            m.publish(&state).expect("the mock's state fits its record");
        }
    }

    /// One frame of the stream: its length, then the state.
    fn frame(&self) -> Vec<u8> {
        let state = encode(&self.config, &self.bar0);
        let mut f = (state.len() as u32).to_le_bytes().to_vec();
        f.extend(state);
        f
    }

    /// Loads the last complete frame of the incoming stream; anything left over is an error.
    fn load(&mut self) -> switchyard_device::Result<()> {
        let stream = std::mem::take(&mut self.mig.incoming);
        if self.kind.fault == Fault::LoadsNothing {
            return Ok(());
        }
        let mut at = 0;
        let mut last = None;
        while at + 4 <= stream.len() {
            let len =
                u32::from_le_bytes([stream[at], stream[at + 1], stream[at + 2], stream[at + 3]])
                    as usize;
            let Some(body) = stream.get(at + 4..at + 4 + len) else {
                break;
            };
            last = Some(body);
            at += 4 + len;
        }
        let complete = at == stream.len() && last.is_some();
        if !complete {
            if self.kind.fault == Fault::LoadsAnything {
                return Ok(());
            }
            return Err(DeviceError::BadState(
                format!(
                    "an incomplete stream ({} bytes, {at} in whole frames)",
                    stream.len()
                )
                .into(),
            ));
        }
        let (config, bar0) = decode(last.unwrap_or_default(), &self.definition)?;
        self.config = config;
        self.bar0 = bar0;
        self.publish();
        Ok(())
    }
}

impl PciDevice for Recording {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> switchyard_device::Result<()> {
        self.reads += 1;
        match region {
            0 => {
                let r = bar0_range(offset, data.len())
                    .ok_or_else(|| out_of_range(0, offset, data.len()))?;
                data.copy_from_slice(&self.bar0[r]);
                Ok(())
            }
            CONFIG_REGION_INDEX if self.config.read(offset, data) => Ok(()),
            CONFIG_REGION_INDEX => Err(out_of_range(region, offset, data.len())),
            _ => Err(DeviceError::NoSuchRegion(region)),
        }
    }

    fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
    ) -> switchyard_device::Result<()> {
        match region {
            0 => {
                let r = bar0_range(offset, data.len())
                    .ok_or_else(|| out_of_range(0, offset, data.len()))?;
                self.bar0[r].copy_from_slice(data);
            }
            CONFIG_REGION_INDEX => {
                self.config
                    .write(offset, data)
                    .ok_or_else(|| out_of_range(region, offset, data.len()))?;
            }
            _ => return Err(DeviceError::NoSuchRegion(region)),
        }
        self.writes += 1;
        self.publish();
        Ok(())
    }

    fn reset(&mut self) -> switchyard_device::Result<()> {
        self.log("reset");
        self.config = self.definition.clone();
        self.bar0.fill(0);
        self.publish();
        Ok(())
    }

    fn fresh_open(&mut self) -> switchyard_device::Result<()> {
        self.log("fresh_open");
        self.config = self.definition.clone();
        self.publish();
        Ok(())
    }

    fn client_disconnected(&mut self) {
        let parked = self.parks.0.load(Ordering::SeqCst);
        self.log(format!(
            "client_disconnected with {} DMA windows, parked {parked}",
            self.ctx.dma.mappings().len()
        ));
    }

    fn migration(&mut self) -> Option<&mut dyn Migratable> {
        Some(self)
    }

    fn swappable(&mut self) -> Option<&mut dyn Swappable> {
        Some(self)
    }

    fn recoverable(&self) -> Option<&dyn Recoverable> {
        Some(self)
    }

    fn telemetry(&self) -> Option<&dyn Telemetry> {
        Some(self)
    }
}

impl Migratable for Recording {
    fn caps(&self) -> MigrationCaps {
        MigrationCaps {
            precopy: true,
            p2p: false,
        }
    }

    fn step(&mut self, arc: MigArc) -> switchyard_device::Result<()> {
        self.log(format!("{arc:?}"));
        match arc {
            MigArc::Stop | MigArc::Run | MigArc::AbortPreCopy => {}
            MigArc::StartPreCopy | MigArc::StartStopCopy => {
                self.mig.out = self.frame();
                self.mig.at = 0;
            }
            MigArc::PreCopyToStopCopy => {
                let last = self.frame();
                self.mig.out.extend(last);
            }
            MigArc::EndStopCopy => self.mig = Mig::default(),
            MigArc::StartResuming => self.mig.incoming.clear(),
            MigArc::EndResuming => self.load()?,
            // Not offered (caps: no P2P).
            MigArc::EnterP2p
            | MigArc::LeaveP2p
            | MigArc::StopFromP2p
            | MigArc::P2pFromStop
            | MigArc::StartPreCopyP2p
            | MigArc::AbortPreCopyP2p
            | MigArc::PreCopyP2pToStopCopy => {
                return Err(switchyard_device::DeviceError::Unsupported);
            }
        }
        Ok(())
    }

    fn read(&mut self, buf: &mut [u8]) -> switchyard_device::Result<usize> {
        let rest = &self.mig.out[self.mig.at..];
        let n = rest.len().min(buf.len());
        buf[..n].copy_from_slice(&rest[..n]);
        self.mig.at += n;
        Ok(n)
    }

    fn write(&mut self, data: &[u8]) -> switchyard_device::Result<()> {
        self.mig.incoming.extend_from_slice(data);
        Ok(())
    }

    fn abort(&mut self) {
        self.log("abort");
        self.mig = Mig::default();
    }
}

impl Swappable for Recording {
    fn quiesce(&self) -> Arc<dyn Quiesce> {
        Arc::new(Handle(self.parks.clone(), self.kind.log.clone()))
    }

    fn successor(&self) -> SuccessorFactory {
        let kind = self.kind.clone();
        Box::new(move |ctx| {
            log(&kind.log, "successor");
            Recording::new(&kind, Build::new(ctx), None)
                .map(|d| Box::new(d) as Box<dyn PciDevice>)
                .map_err(|e| DeviceError::Failed(Box::new(e)))
        })
    }

    fn check_successor(&self, next: &dyn PciDevice) -> Result<(), &'static str> {
        if self.kind.fault == Fault::AcceptsAnySuccessor {
            return Ok(());
        }
        next.as_any()
            .downcast_ref::<Recording>()
            .map(|_| ())
            .ok_or("another kind of device")
    }

    fn hand_over(&mut self, next: &mut dyn PciDevice) -> switchyard_device::Result<()> {
        let parked = self.parks.0.load(Ordering::SeqCst);
        self.log(format!("hand_over, parked {parked}"));
        let next = next
            .as_any_mut()
            .downcast_mut::<Recording>()
            .ok_or(DeviceError::Unsupported)?;
        next.config = self.config.clone();
        next.bar0.clone_from(&self.bar0);
        next.mirror = self.mirror.take();
        next.writes = self.writes;
        next.reads = self.reads;
        next.publish();
        Ok(())
    }
}

impl Recoverable for Recording {
    fn held_objects(&self) -> switchyard_device::Result<Vec<(String, std::fs::File)>> {
        Ok(Vec::new())
    }
}

impl Telemetry for Recording {
    fn work(&self) -> WorkCounters {
        let commands = if self.kind.fault == Fault::CountersGoBackwards {
            u64::MAX - self.reads
        } else {
            self.writes
        };
        WorkCounters {
            commands,
            bytes: 0,
            errors: 0,
            ..WorkCounters::default()
        }
    }
}

/// The groups the recording mock offers.
const RECORDING_GROUPS: Groups = Groups {
    migration: true,
    swap: true,
    recovery: true,
    relocation: Moves::No,
    telemetry: true,
};

fn recording_with(fault: Fault) -> (Subject, Log) {
    let log = Log::default();
    let kind = RecordingKind {
        log: log.clone(),
        fault,
    };
    (
        Subject::kind(kind, KindOptions::new()).declares(RECORDING_GROUPS),
        log,
    )
}

fn recording() -> Subject {
    recording_with(Fault::None).0
}

conformance_tests!(recording_mock, recording());

// ---------------------------------------------------------------------------------------------
// The suite drives the devices as it says.

fn events(log: &Log) -> Vec<String> {
    log.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The positions of `wanted` in `log`, in order, each after the previous one.
fn in_order(log: &[String], wanted: &[&str]) -> Result<(), String> {
    let mut from = 0;
    for w in wanted {
        match log[from..].iter().position(|e| e == w) {
            Some(i) => from += i + 1,
            None => return Err(format!("no `{w}` after event {from} in {log:?}")),
        }
    }
    Ok(())
}

#[test]
fn migration_walks_the_arcs_then_streams_to_fresh_devices() {
    let (subject, log) = recording_with(Fault::None);
    checks::migration(&subject);
    let log = events(&log);
    in_order(
        &log,
        &[
            "build",
            "Stop",
            "Run",
            "Stop",
            "StartStopCopy",
            "EndStopCopy",
            "Run",
            "StartPreCopy",
            "PreCopyToStopCopy",
            "EndStopCopy",
            "Run",
            // The STOP_COPY stream, then the PRE_COPY one, each into a fresh device.
            "build",
            "Stop",
            "StartResuming",
            "EndResuming",
            "Run",
            "build",
            "Stop",
            "StartResuming",
            "EndResuming",
            "Run",
            // Half a stream: refused, then aborted and reset.
            "build",
            "Stop",
            "StartResuming",
            "EndResuming",
            "abort",
            "reset",
        ],
    )
    .expect("the migration check's sequence");
    assert_eq!(log.iter().filter(|e| *e == "build").count(), 4, "{log:?}");
}

#[test]
fn the_client_leaves_with_the_device_parked_and_no_window_left() {
    let (subject, log) = recording_with(Fault::None);
    checks::client_gone(&subject);
    let log = events(&log);
    in_order(
        &log,
        &[
            "park",
            "client_disconnected with 0 DMA windows, parked 1",
            // The second notice comes with the sensor window mapped and the park over.
            "client_disconnected with 1 DMA windows, parked 0",
            "reset",
        ],
    )
    .expect("the client-gone sequence");
}

#[test]
fn a_swap_hands_over_from_a_parked_device_to_its_own_successor() {
    let (subject, log) = recording_with(Fault::None);
    checks::swap(&subject);
    in_order(
        &events(&log),
        &["build", "successor", "park", "hand_over, parked 1"],
    )
    .expect("the swap sequence");
}

#[test]
fn a_recovery_rebuilds_from_the_black_box_after_refusing_to_without_it() {
    let (subject, log) = recording_with(Fault::None);
    checks::recovery(&subject);
    let log = events(&log);
    in_order(&log, &["build", "recover with 0 objects"]).expect("the recovery sequence");
    // The rebuild without a black box was refused before it built anything.
    assert_eq!(
        log.iter().filter(|e| e.starts_with("recover")).count(),
        1,
        "{log:?}"
    );
}

#[test]
fn every_check_passes_on_both_mocks_through_run_all() {
    for subject in [plain(PlainFault::None), recording()] {
        let results = run_all(&subject);
        assert_eq!(results.len(), CHECKS.len());
        for (name, r) in results {
            assert_eq!(r, Ok(()), "{} {name}", subject.name());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The suite fails: each fault is caught by its check, and only by it.

/// Runs every check on `subject` and returns the failures by check name.
fn failures(subject: &Subject) -> BTreeMap<&'static str, String> {
    run_all(subject)
        .into_iter()
        .filter_map(|(name, r)| r.err().map(|e| (name, e)))
        .collect()
}

/// Asserts `subject` fails exactly `check`, with a message containing `needle`.
fn fails_only(subject: &Subject, check: &str, needle: &str) {
    let f = failures(subject);
    assert_eq!(f.keys().copied().collect::<Vec<_>>(), vec![check], "{f:#?}");
    assert!(f[check].contains(needle), "{check}: {}", f[check]);
}

#[test]
fn a_device_that_panics_past_the_end_of_a_region_fails_region_bounds() {
    fails_only(
        &plain(PlainFault::PanicsPastTheEnd),
        "region_bounds",
        "region 0: a read of 4 bytes at 0x1000 panicked",
    );
}

#[test]
fn a_reset_that_changes_the_identity_fails_reset() {
    fails_only(
        &plain(PlainFault::ResetChangesIdentity),
        "reset",
        "after a reset the device id reads 0x101, after the build 0x100",
    );
}

#[test]
fn a_device_that_resets_while_it_says_it_cannot_fails_reset() {
    fails_only(
        &plain(PlainFault::ResetsWithoutSayingSo),
        "reset",
        "cannot reset, yet reset() succeeded",
    );
}

#[test]
fn a_device_that_reads_guest_memory_after_the_client_left_fails_client_gone() {
    fails_only(
        &plain(PlainFault::DmaAfterTheClientLeft),
        "client_gone",
        "DMA reads and 0 DMA writes",
    );
}

#[test]
fn a_device_that_keeps_the_config_of_the_last_client_fails_fresh_open() {
    fails_only(
        &plain(PlainFault::KeepsConfigForTheNextClient),
        "fresh_open",
        "for a new client (after fresh_open): the config space differs",
    );
}

#[test]
fn a_destination_that_loads_nothing_fails_migration() {
    fails_only(
        &recording_with(Fault::LoadsNothing).0,
        "migration",
        "a device resumed from the STOP_COPY stream: the config space differs",
    );
}

#[test]
fn a_destination_that_loads_half_a_stream_fails_migration() {
    fails_only(
        &recording_with(Fault::LoadsAnything).0,
        "migration",
        "bytes of a STOP_COPY stream loaded it",
    );
}

#[test]
fn a_device_that_accepts_any_successor_fails_swap() {
    fails_only(
        &recording_with(Fault::AcceptsAnySuccessor).0,
        "swap",
        "accepts a device of another kind",
    );
}

#[test]
fn a_rebuild_that_ignores_the_black_box_fails_recovery() {
    fails_only(
        &recording_with(Fault::RecoversFresh).0,
        "recovery",
        "the rebuilt device: the config space differs",
    );
}

#[test]
fn counters_that_go_backwards_fail_capabilities() {
    fails_only(
        &recording_with(Fault::CountersGoBackwards).0,
        "capabilities",
        "the work counters went backwards",
    );
}

#[test]
fn a_profile_that_disagrees_with_the_device_fails_capabilities() {
    fails_only(
        &recording_with(Fault::ProfileSaysMovable).0,
        "capabilities",
        "the profile says movable = true, the subject declares relocation No",
    );
    fails_only(
        &recording_with(Fault::UndeclaredMsix).0,
        "capabilities",
        "the profile says msix = false, the device has MSI-X vectors",
    );
}

#[test]
fn groups_declared_but_not_offered_fail_their_checks() {
    let subject = plain(PlainFault::None).declares(Groups {
        migration: true,
        swap: true,
        recovery: true,
        relocation: Moves::UnderClient,
        telemetry: true,
    });
    let f = failures(&subject);
    assert_eq!(
        f.keys().copied().collect::<Vec<_>>(),
        vec![
            "capabilities",
            "migration",
            "recovery",
            "relocation",
            "swap"
        ],
        "{f:#?}"
    );
    for group in ["migration", "swap", "recovery", "relocation", "telemetry"] {
        assert!(
            f["capabilities"].contains(&format!(
                "{group} declared present, the device answers None"
            )),
            "{}",
            f["capabilities"]
        );
    }
    assert!(
        f["relocation"].contains("relocation declared present"),
        "{}",
        f["relocation"]
    );
}

#[test]
fn groups_offered_but_not_declared_fail_their_checks() {
    let subject = recording().declares(Groups::NONE);
    let f = failures(&subject);
    assert_eq!(
        f.keys().copied().collect::<Vec<_>>(),
        vec!["capabilities", "migration", "recovery", "swap"],
        "{f:#?}"
    );
    assert!(
        f["swap"].contains("swap declared absent, the device answers Some"),
        "{}",
        f["swap"]
    );
}

#[test]
fn a_mock_that_declares_recovery_needs_a_way_to_rebuild() {
    // The recording device made by a closure, without `recovered_by`: the device is
    // recoverable, but nothing can rebuild it.
    let kind = RecordingKind {
        log: Log::default(),
        fault: Fault::None,
    };
    let build_kind = kind.clone();
    let subject = Subject::from_fn("recording-by-closure", move |b| build_kind.build(b))
        .declares(RECORDING_GROUPS);
    let err = run(&subject, checks::recovery).expect_err("no way to rebuild");
    assert!(err.contains("gives no way to rebuild"), "{err}");
    // With one, it passes.
    let rebuild = kind.clone();
    let subject = Subject::from_fn("recording-by-closure", move |b| kind.build(b))
        .recovered_by(rebuild.black_box_records(), move |b| rebuild.recover(b))
        .declares(RECORDING_GROUPS);
    assert_eq!(run(&subject, checks::recovery), Ok(()));
}
