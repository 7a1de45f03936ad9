//! Interrupt delivery: a FENCE's MSI-X message to the client's eventfd.

use std::cell::RefCell;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use switchyard_softgpu::cmd::Command;

use crate::cases::{Settings, fig, write_sizes};
use crate::floors::{RoundTripThenWake, wait_readable};
use crate::gpu::{Gpu, fence_offset, guest};
use crate::report::{Row, Target, Unit};
use crate::servers::{DeviceKind, Switchyard};
use crate::stats::{Contender, interleaved};

/// Interrupt delivery: FENCE with MSI-X vector 0 → the client's eventfd readable. End to end
/// (doorbell sent → eventfd readable) against a 4-byte REGION_WRITE-sized ping-pong plus an
/// eventfd wake-up, both in one floor sample; the part after the doorbell's reply is reported
/// without a floor (the fence is often delivered before the reply, so it has no fair floor).
pub fn interrupt(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let stall = s.stall_timeout();
    let block = Switchyard::start(
        dir,
        "softgpu-irq-block",
        DeviceKind::SoftGpu,
        Duration::ZERO,
    )?;
    let spin = Switchyard::start(dir, "softgpu-irq-spin", DeviceKind::SoftGpu, s.spin)?;
    let mut gpus = [
        Gpu::setup(block.connect(stall)?, 0)?,
        Gpu::setup(spin.connect(stall)?, 0)?,
    ];
    let labels = [
        s.variant_label(DeviceKind::SoftGpu, false),
        s.variant_label(DeviceKind::SoftGpu, true),
    ];
    let (wreq, wreply) = write_sizes(4)?;
    let mut floor_b = RoundTripThenWake::start(wreq, wreply, Duration::ZERO)?;
    let mut floor_s = RoundTripThenWake::start(wreq, wreply, s.spin)?;
    let after_reply: [RefCell<Vec<u64>>; 2] = Default::default();
    let early = [RefCell::new(0usize), RefCell::new(0usize)];
    let mut seq = 0u64;
    let seq = RefCell::new(&mut seq);
    let plan = s.latency_plan();
    let mut results = {
        // Order: the floors (blocking, spin), then ours (blocking, spin).
        let mut cs = vec![
            Contender::new("floor blocking", || floor_b.once()),
            Contender::new("floor spin", || floor_s.once()),
        ];
        for ((gpu, after_reply), early) in gpus.iter_mut().zip(&after_reply).zip(&early) {
            let seq = &seq;
            cs.push(Contender::new("irq", move || {
                let v = {
                    let mut s = seq.borrow_mut();
                    **s += 1;
                    **s
                };
                let tail = gpu.enqueue(0, &[Command::fence(guest(fence_offset(0)), v, Some(0))])?;
                let t_send = Instant::now();
                gpu.doorbell(0, tail, false)?;
                let t_reply = Instant::now();
                if gpu.mem_load_u64(fence_offset(0))? == v {
                    *early.borrow_mut() += 1;
                }
                wait_readable(&gpu.irq, stall)?;
                let t_irq = Instant::now();
                let mut b = [0u8; 8];
                (&gpu.irq).read_exact(&mut b)?;
                if gpu.mem_load_u64(fence_offset(0))? != v {
                    bail!("interrupt before the fence value");
                }
                after_reply
                    .borrow_mut()
                    .push(crate::stats::ns(t_irq - t_reply));
                Ok(t_irq - t_send)
            }));
        }
        interleaved(&mut cs, plan)?
    };
    let [fb, fs, ours @ ..] = results.as_mut_slice() else {
        bail!("interrupt: missing floor samples");
    };
    let floors = [
        fig(
            "4 B REGION_WRITE-sized AF_UNIX ping-pong, blocking, + eventfd wake-up",
            fb,
            Unit::Micros,
            0.0,
        )?,
        fig(
            &format!(
                "4 B REGION_WRITE-sized AF_UNIX ping-pong, echo {}, + eventfd wake-up",
                s.spin_label()
            ),
            fs,
            Unit::Micros,
            0.0,
        )?,
    ];
    let warm = plan.warmup;
    for ((((label, samples), floor), after_reply), early) in labels
        .iter()
        .zip(ours.iter_mut())
        .zip(floors)
        .zip(&after_reply)
        .zip(&early)
    {
        let note = format!(
            "end to end: the doorbell REGION_WRITE round trip, the engine's FENCE and the MSI-X eventfd; floor: {}, timed back to back in one sample",
            floor.name
        );
        rows.push(Row::new(
            "interrupt",
            "FENCE irq: doorbell sent → eventfd readable".into(),
            "irq-e2e",
            label,
            None,
            Unit::Micros,
            fig(label, samples, Unit::Micros, 0.0)?,
            Some(floor),
            None,
            Some(Target {
                floor_ratio: 1.2,
                beat_peer: false,
                plus: 0.0,
            }),
            note,
        ));
        let total = samples.len() + warm;
        let early_pct = 100.0 * *early.borrow() as f64 / total.max(1) as f64;
        let mut all = after_reply.borrow_mut();
        // This vector also holds the warm-up samples; keep only the timed ones.
        let skip = all.len().saturating_sub(samples.len());
        let mut timed: Vec<u64> = all.drain(skip..).collect();
        rows.push(Row::new(
            "interrupt",
            "FENCE irq: doorbell reply → eventfd readable".into(),
            "irq",
            label,
            None,
            Unit::Micros,
            fig(label, &mut timed, Unit::Micros, 0.0)?,
            None,
            None,
            None,
            format!(
                "information only, no floor: from REGION_WRITE(doorbell) returning to poll() on the MSI-X eventfd returning; the fence was already in memory when the reply arrived in {early_pct:.0}% of samples"
            ),
        ));
    }
    for g in &mut gpus {
        g.check_queues()?;
    }
    drop(gpus);
    block.shutdown()?;
    spin.shutdown()
}
