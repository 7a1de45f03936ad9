//! The checks of the optional groups: migration, swap, recovery, relocation.

use std::collections::BTreeMap;

use switchyard_device::blackbox::BlackBox;
use switchyard_device::kind::Build;
use switchyard_device::{DeviceDescription, DeviceError, MigArc, PciDevice, Result};

use crate::probe::{Slot, chain};
use crate::{Moves, Subject};

/// Longest migration stream the check reads before it calls the stream endless.
const MAX_STREAM: usize = 1 << 30;
/// A relocation's pre-copy rounds stop once one copies at most this much (the worker's rule).
const SETTLED_BYTES: u64 = 256 << 10;
/// ... or after this many rounds.
const MAX_ROUNDS: u32 = 12;

fn step(s: &mut Slot, arc: MigArc) {
    let r = s.guarded(
        || format!("the migration arc {arc:?}"),
        |d| d.migration().map(|m| m.step(arc)),
    );
    match r {
        Some(Ok(())) => {}
        Some(Err(e)) => s.fail(format_args!(
            "the migration arc {arc:?} failed: {}",
            chain(&e)
        )),
        None => s.fail("migration() went away"),
    }
}

/// Reads the outgoing stream until a short read: a first read of 7 bytes, then 65521 at a
/// time (neither divides anything a device might align to).
fn read_stream(s: &mut Slot, out: &mut Vec<u8>, what: &str) {
    let mut len = 7;
    loop {
        let mut buf = vec![0u8; len];
        let r = s.guarded(
            || format!("reading the {what} stream"),
            |d| d.migration().map(|m| m.read(&mut buf)),
        );
        let n = match r {
            Some(Ok(n)) => n,
            Some(Err(e)) => s.fail(format_args!(
                "reading the {what} stream failed: {}",
                chain(&e)
            )),
            None => s.fail("migration() went away"),
        };
        if n > buf.len() {
            s.fail(format_args!(
                "a read of {len} bytes of the {what} stream says it gave {n}"
            ));
        }
        out.extend_from_slice(&buf[..n]);
        if n < len {
            return;
        }
        if out.len() > MAX_STREAM {
            s.fail(format_args!(
                "the {what} stream never ends ({} bytes read)",
                out.len()
            ));
        }
        len = 65521;
    }
}

/// Writes `stream` in chunks of 1, 7 and 4093 bytes, then 65536 at a time.
fn write_stream(s: &mut Slot, stream: &[u8]) -> Result<()> {
    let mut at = 0;
    for n in [1usize, 7, 4093]
        .into_iter()
        .chain(std::iter::repeat(65536))
    {
        if at >= stream.len() {
            return Ok(());
        }
        let chunk = &stream[at..(at + n).min(stream.len())];
        s.guarded(
            || format!("writing {} bytes of the stream at {at}", chunk.len()),
            |d| {
                d.migration()
                    .map_or(Err(DeviceError::Unsupported), |m| m.write(chunk))
            },
        )?;
        at += chunk.len();
    }
    Ok(())
}

/// Loads `stream` into a fresh device as a destination does (STOP, RESUMING, the stream,
/// STOP, RUNNING) and compares its config space with `expected`.
fn resume(subject: &Subject, stream: &[u8], expected: &[u8], what: &str) {
    let mut b = subject.slot("migration");
    if b.device.migration().is_none() {
        b.fail("a fresh device offers no migration");
    }
    step(&mut b, MigArc::Stop);
    step(&mut b, MigArc::StartResuming);
    if let Err(e) = write_stream(&mut b, stream) {
        b.fail(format_args!(
            "the destination refuses the {what} stream: {}",
            chain(&e)
        ));
    }
    step(&mut b, MigArc::EndResuming);
    step(&mut b, MigArc::Run);
    b.assert_config(
        expected,
        &format!("a device resumed from the {what} stream"),
    );
    b.answers(&format!("resumed from the {what} stream"));
}

/// Where migration is declared: RUNNING→STOP→RUNNING; after a driver programmed the device,
/// the STOP_COPY stream (and, where the device offers PRE_COPY, a PRE_COPY + STOP_COPY
/// stream) loads into a fresh device whose config space is then the source's, with the
/// stream written in odd chunks; the source runs again after each stream; a fresh device
/// given half a stream refuses to load it, and answers after an abort. The source is dropped
/// before any destination is built (a passthrough device can be opened once). Where it is
/// not declared: `migration()` is `None`.
pub fn migration(subject: &Subject) {
    let mut a = subject.slot("migration");
    let offered = a.device.migration().is_some();
    if !subject.declared().migration {
        if offered {
            a.fail("migration declared absent, the device answers Some");
        }
        return;
    }
    if !offered {
        a.fail("migration declared present, the device answers None");
    }
    step(&mut a, MigArc::Stop);
    a.answers("in STOP");
    step(&mut a, MigArc::Run);
    a.answers("after STOP and RUNNING again");
    a.program();
    let expected = a.config();
    let precopy = a.device.migration().is_some_and(|m| m.caps().precopy);
    let mut streams = Vec::new();
    let mut stop_copy = Vec::new();
    step(&mut a, MigArc::Stop);
    step(&mut a, MigArc::StartStopCopy);
    read_stream(&mut a, &mut stop_copy, "STOP_COPY");
    step(&mut a, MigArc::EndStopCopy);
    step(&mut a, MigArc::Run);
    a.assert_config(&expected, "the source after its STOP_COPY stream");
    streams.push(("STOP_COPY", stop_copy));
    if precopy {
        let mut pre = Vec::new();
        step(&mut a, MigArc::StartPreCopy);
        read_stream(&mut a, &mut pre, "PRE_COPY");
        step(&mut a, MigArc::PreCopyToStopCopy);
        read_stream(&mut a, &mut pre, "PRE_COPY then STOP_COPY");
        step(&mut a, MigArc::EndStopCopy);
        step(&mut a, MigArc::Run);
        a.assert_config(&expected, "the source after its PRE_COPY stream");
        streams.push(("PRE_COPY", pre));
    }
    drop(a);
    for (what, stream) in &streams {
        if stream.is_empty() {
            panic!("{}: migration: the {what} stream is empty", subject.name());
        }
        resume(subject, stream, &expected, what);
    }
    let stream = &streams[0].1;
    let mut c = subject.slot("migration");
    step(&mut c, MigArc::Stop);
    step(&mut c, MigArc::StartResuming);
    let half = &stream[..stream.len() / 2];
    let loaded = write_stream(&mut c, half).and_then(|()| {
        c.guarded(
            || "loading half a stream".into(),
            |d| {
                d.migration().map_or(Err(DeviceError::Unsupported), |m| {
                    m.step(MigArc::EndResuming)
                })
            },
        )
    });
    if loaded.is_ok() {
        c.fail(format_args!(
            "a device given {} of the {} bytes of a STOP_COPY stream loaded it",
            half.len(),
            stream.len()
        ));
    }
    c.guarded(
        || "abort() after a refused stream".into(),
        |d| {
            if let Some(m) = d.migration() {
                m.abort();
            }
        },
    );
    if c.desc().resettable
        && let Err(e) = c.guarded(|| "reset() after a refused stream".into(), |d| d.reset())
    {
        c.fail(format_args!(
            "a reset after a refused stream failed: {}",
            chain(&e)
        ));
    }
    c.answers("after a refused stream and an abort");
}

/// A device of another kind with the shape of the one it pretends to replace.
struct Foreign(DeviceDescription);

impl PciDevice for Foreign {
    fn description(&self) -> &DeviceDescription {
        &self.0
    }
    fn region_read(&mut self, region: u32, _: u64, _: &mut [u8]) -> Result<()> {
        Err(DeviceError::NoSuchRegion(region))
    }
    fn region_write(&mut self, region: u32, _: u64, _: &[u8]) -> Result<()> {
        Err(DeviceError::NoSuchRegion(region))
    }
    fn reset(&mut self) -> Result<()> {
        Err(DeviceError::Unsupported)
    }
}

/// Hands `a`'s slot over to `next` the way the server's swap does (`DeviceSlot::swap`, the
/// old device parked through its quiesce handle beforehand): the server's own shape rule
/// ([`switchyard_server::same_shape`]), the old device's `check_successor`, `hand_over`;
/// then `next` takes the slot and `a` is dropped. Returns the new slot.
fn hand_over(mut a: Slot, next: Box<dyn PciDevice>, detached: bool) -> Slot {
    let Some(quiesce) = a.device.swappable().map(|w| w.quiesce()) else {
        a.fail("the hand-over needs swappable(), which is None");
    };
    let parked = quiesce.park();
    if let Err(e) = switchyard_server::same_shape(a.desc(), next.description(), detached) {
        a.fail(format_args!("the server would refuse the successor: {e}"));
    }
    let mut next = next;
    let checked = a.guarded(
        || "check_successor()".into(),
        |d| d.swappable().map(|w| w.check_successor(&*next)),
    );
    if let Some(Err(why)) = checked {
        a.fail(format_args!(
            "check_successor refuses the device's own successor: {why}"
        ));
    }
    let handed = a.guarded(
        || "hand_over()".into(),
        |d| d.swappable().map(|w| w.hand_over(&mut *next)),
    );
    if let Some(Err(e)) = handed {
        a.fail(format_args!("hand_over failed: {}", chain(&e)));
    }
    drop(parked);
    let Slot { name, ctx, device } = a;
    let slot = Slot::install(name, ctx, next);
    // The old device stays parked for good; its threads are joined outside the slot.
    drop(device);
    slot
}

/// Where swap is declared: a successor from the device's own factory, built on the same
/// context, passes the server's shape rule and `check_successor`, is handed the state with
/// the old device parked, and then answers with the old device's config space; a device of
/// another kind with the same shape is refused (and the refusal changes nothing). Where it
/// is not declared: `swappable()` is `None`.
pub fn swap(subject: &Subject) {
    let mut a = subject.slot("swap");
    let offered = a.device.swappable().is_some();
    if !subject.declared().swap {
        if offered {
            a.fail("swap declared absent, the device answers Some");
        }
        return;
    }
    if !offered {
        a.fail("swap declared present, the device answers None");
    }
    a.program();
    let expected = a.config();
    let foreign = Foreign(a.desc().clone());
    let refused = a.guarded(
        || "check_successor() of a device of another kind".into(),
        |d| d.swappable().map(|w| w.check_successor(&foreign)),
    );
    if let Some(Ok(())) = refused {
        a.fail("check_successor accepts a device of another kind with the same shape");
    }
    let factory = a.device.swappable().map(|w| w.successor());
    let Some(factory) = factory else {
        a.fail("swappable() went away");
    };
    let ctx = a.ctx.clone();
    let next = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| factory(ctx))) {
        Ok(Ok(next)) => next,
        Ok(Err(e)) => a.fail(format_args!("the successor factory fails: {}", chain(&e))),
        Err(p) => a.fail(format_args!(
            "the successor factory panicked: {}",
            crate::probe::panic_message(&*p)
        )),
    };
    a.assert_config(
        &expected,
        "the device after a refused successor and a successor built",
    );
    let mut b = hand_over(a, next, false);
    b.assert_config(&expected, "the successor after the hand-over");
    b.answers("after the hand-over");
    if b.device.swappable().is_none() {
        b.fail("the successor cannot be swapped in turn");
    }
}

/// Where recovery is declared: a device built with a black box of the subject's records is
/// programmed by a driver; its held objects are taken, it is dropped, and the subject's
/// rebuild on a fresh context with the black box (opened again, as a replacement process
/// does) and those objects gives a device with the same config space, which answers; a
/// rebuild without a black box is refused. Where it is not declared: `recoverable()` is
/// `None` and a rebuild with a black box is refused.
pub fn recovery(subject: &Subject) {
    if subject.declared().recovery && !subject.rebuilds() {
        panic!(
            "{}: recovery: declared present, but the subject gives no way to rebuild a device",
            subject.name()
        );
    }
    let records = subject.black_box_records();
    let bb = BlackBox::create(&records).unwrap_or_else(|e| {
        panic!(
            "{}: recovery: its black-box records {records:?} cannot be laid out: {e}",
            subject.name()
        )
    });
    let mut a = subject.slot_with("recovery", |ctx| Build {
        black_box: Some(bb.clone()),
        ..Build::new(ctx)
    });
    let offered = a.device.recoverable().is_some();
    if !subject.declared().recovery {
        if offered {
            a.fail("recovery declared absent, the device answers Some");
        }
        drop(a);
        let rebuilt = subject.recover(Build {
            black_box: Some(bb),
            ..Build::new(crate::probe::context())
        });
        if let Some(Ok(_)) = rebuilt {
            panic!(
                "{}: recovery: declared absent, yet the kind rebuilt a device from a black box",
                subject.name()
            );
        }
        return;
    }
    if !offered {
        a.fail("recovery declared present, the device answers None");
    }
    a.program();
    let expected = a.config();
    let held = a.guarded(
        || "held_objects()".into(),
        |d| d.recoverable().map(|r| r.held_objects()),
    );
    let objects: BTreeMap<_, _> = match held {
        Some(Ok(objects)) => objects.into_iter().collect(),
        Some(Err(e)) => a.fail(format_args!("held_objects() fails: {}", chain(&e))),
        None => a.fail("recoverable() went away"),
    };
    let name = a.name.clone();
    drop(a);
    let without = subject.recover(Build::new(crate::probe::context()));
    match without {
        None => panic!(
            "{name}: recovery declared present, but the subject gives no way to rebuild a device"
        ),
        Some(Ok(_)) => panic!("{name}: a rebuild without a black box succeeded"),
        Some(Err(_)) => {}
    }
    let file = bb
        .file()
        .try_clone()
        .unwrap_or_else(|e| panic!("{name}: cannot duplicate the black box: {e}"));
    let reopened = BlackBox::open(file)
        .unwrap_or_else(|e| panic!("{name}: the black box does not open again: {e}"));
    let ctx = crate::probe::context();
    let build = Build {
        black_box: Some(reopened),
        objects,
        ..Build::new(ctx.clone())
    };
    let rebuilt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| subject.recover(build)));
    let device = match rebuilt {
        Ok(Some(Ok(d))) => d,
        Ok(Some(Err(e))) => panic!("{name}: the rebuild fails: {}", chain(&e)),
        Ok(None) => unreachable!("checked above"),
        Err(p) => panic!(
            "{name}: the rebuild panicked: {}",
            crate::probe::panic_message(&*p)
        ),
    };
    let mut b = Slot::install(name, ctx, device);
    b.assert_config(&expected, "the rebuilt device");
    b.answers("rebuilt");
}

/// Where relocation is declared: after a driver programmed the device, a relocation
/// (`begin_relocation(false)`, or for [`Moves::Detached`] `begin_relocation(true)` with the
/// client gone and `begin_relocation(false)` refused) names its target objects, runs
/// pre-copy rounds as a worker does (until one copies at most 256 KiB, at most 12), builds
/// the parked successor on the slot's context, runs one more round on it, and is swapped in
/// the way the server does ([`swap`]'s hand-over, with the detached shape rule for a detached
/// move); the successor answers with the same config space and reports a relocation of at
/// least the rounds run. Where it is not declared: `relocatable()` is `None`.
pub fn relocation(subject: &Subject) {
    let mut a = subject.slot("relocation");
    let offered = a.device.relocatable().is_some();
    let moves = subject.declared().relocation;
    if moves == Moves::No {
        if offered {
            a.fail("relocation declared absent, the device answers Some");
        }
        return;
    }
    if !offered {
        a.fail("relocation declared present, the device answers None");
    }
    a.program();
    let expected = a.config();
    let detached = moves == Moves::Detached;
    if detached {
        let under_client = a.guarded(
            || "begin_relocation(false)".into(),
            |d| d.relocatable().map(|r| r.begin_relocation(false).is_ok()),
        );
        if under_client == Some(true) {
            a.fail("relocation declared detached only, yet begin_relocation(false) succeeded");
        }
        a.disconnect();
    }
    let begun = a.guarded(
        || format!("begin_relocation({detached})"),
        |d| d.relocatable().map(|r| r.begin_relocation(detached)),
    );
    let mut relocation = match begun {
        Some(Ok(r)) => r,
        Some(Err(e)) => a.fail(format_args!(
            "begin_relocation({detached}) fails: {}",
            chain(&e)
        )),
        None => a.fail("relocatable() went away"),
    };
    match relocation.targets() {
        Ok(t) if !t.is_empty() && t.iter().all(|(n, _)| !n.is_empty()) => {}
        Ok(t) => a.fail(format_args!(
            "the relocation names no target object, or one without a name: {:?}",
            t.iter().map(|(n, _)| n).collect::<Vec<_>>()
        )),
        Err(e) => a.fail(format_args!(
            "the relocation's targets() fails: {}",
            chain(&e)
        )),
    }
    let mut rounds = 0u32;
    loop {
        let n = relocation.round().unwrap_or_else(|e| {
            a.fail(format_args!(
                "pre-copy round {} fails: {}",
                rounds + 1,
                chain(&e)
            ))
        });
        rounds += 1;
        if relocation.rounds() != rounds {
            a.fail(format_args!(
                "{rounds} rounds ran, the relocation counts {}",
                relocation.rounds()
            ));
        }
        if n <= SETTLED_BYTES || rounds >= MAX_ROUNDS {
            break;
        }
    }
    let mut next = relocation.successor(a.ctx.clone()).unwrap_or_else(|e| {
        a.fail(format_args!(
            "the relocation's successor cannot be built: {}",
            chain(&e)
        ))
    });
    match next.relocatable().map(|r| r.relocation_round()) {
        Some(Ok(_)) => {}
        Some(Err(e)) => a.fail(format_args!(
            "the successor's catch-up round fails: {}",
            chain(&e)
        )),
        None => a.fail("the relocation's successor is not relocatable"),
    }
    let mut b = hand_over(a, next, detached);
    b.assert_config(&expected, "the relocated device");
    b.answers("relocated");
    match b.device.relocatable().map(|r| r.relocation_stats()) {
        Some(Some(stats)) if stats.rounds >= rounds => {}
        Some(Some(stats)) => b.fail(format_args!(
            "the relocated device reports {} rounds, {rounds} ran: {stats:?}",
            stats.rounds
        )),
        Some(None) => {
            b.fail("the relocated device reports no relocation (relocation_stats() is None)")
        }
        None => b.fail("the relocated device is not relocatable"),
    }
}
