//! Where the time of a 4-byte REGION_READ round trip goes.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use switchyard_client::Client;
use switchyard_proto::{Request, region_read_reply_buffer};
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Op, Settings, fig, pool, read_sizes, timed_access};
use crate::floors::Echo;
use crate::report::{Row, Unit};
use crate::servers::{DeviceKind, Switchyard};
use crate::stats::{Contender, interleaved};

/// The two settings of the decomposition, each with its own floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Blocking,
    Polling,
}

/// One contender of the decomposition: a floor (`note: None`) or a row against its mode's
/// floor.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Part {
    mode: Mode,
    label: String,
    note: Option<&'static str>,
}

/// Where the time of a 4-byte REGION_READ round trip goes, blocking: the floor, a raw client
/// (pre-encoded request, one read of the reply) against the Switchyard server, our client
/// against a fake server that only echoes a canned reply, and our client against Switchyard;
/// and with both sides polling: a polling raw client against a spinning server, against a floor
/// whose two sides poll too.
pub fn decompose(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let mut parts = Vec::new();
    let mut pooled = Vec::new();
    for rep in 0..s.reps() {
        let (p, results) = decompose_once(dir, s, rep)?;
        if !parts.is_empty() && parts != p {
            bail!("decompose: the contenders changed between repetitions");
        }
        parts = p;
        pool(&mut pooled, results);
    }
    for (mode, case) in [
        (Mode::Blocking, "REGION_READ 4 B, blocking"),
        (Mode::Polling, "REGION_READ 4 B, both sides poll"),
    ] {
        let mut floor = None;
        for (part, samples) in parts.iter().zip(pooled.iter_mut()) {
            if part.mode != mode {
                continue;
            }
            let Some(note) = part.note else {
                floor = Some(fig(&part.label, samples, Unit::Micros, 0.0)?);
                continue;
            };
            let floor = floor
                .clone()
                .context("decompose: a floor comes before its rows")?;
            rows.push(Row::new(
                "decompose",
                case.into(),
                "decompose",
                &part.label,
                Some(4),
                Unit::Micros,
                fig(&part.label, samples, Unit::Micros, 0.0)?,
                Some(floor),
                None,
                None,
                note.to_owned(),
            ));
        }
    }
    Ok(())
}

/// One setup of the decomposition: its contenders and their samples, in the same order.
fn decompose_once(dir: &Path, s: &Settings, rep: usize) -> Result<(Vec<Part>, Vec<Vec<u64>>)> {
    let (req_len, reply_len) = read_sizes(4)?;
    let stall = s.stall_timeout();
    let server = Switchyard::start(
        dir,
        &format!("regfile-decompose{rep}"),
        DeviceKind::RegFile,
        Duration::ZERO,
    )?;
    let mut client = server.connect(stall)?;
    let mut req = Vec::new();
    Request::RegionRead {
        offset: SCRATCH,
        region: 0,
        count: 4,
    }
    .encode(0, false, &mut req)?;
    // On a clone of the client's socket: the same socket options (none in full mode).
    let mut raw = Echo::raw_client(client.socket().try_clone()?, req.clone(), reply_len);
    let mut reply = Vec::new();
    region_read_reply_buffer(&mut reply, 0, SCRATCH, 0, 4)?;
    let (a, b) = std::os::unix::net::UnixStream::pair()?;
    let fake = Echo::fake_server(b, req_len, reply)?;
    let mut fake_client = Client::without_handshake(a, crate::servers::vmm_client_config(stall))?;
    let mut floor = Echo::start(req_len, reply_len, Duration::ZERO)?;
    // Both sides polling: the best adaptive polling can do (a client that also polls).
    let spin_server = Switchyard::start(
        dir,
        &format!("regfile-decompose-spin{rep}"),
        DeviceKind::RegFile,
        s.spin,
    )?;
    let spin_client = spin_server.connect(stall)?;
    let mut raw_spin =
        Echo::raw_client(spin_client.socket().try_clone()?, req, reply_len).client_polls(stall)?;
    let mut floor_spin = Echo::start(req_len, reply_len, s.spin)?.client_polls(stall)?;
    let (parts, results) = {
        let part = |mode, label: &str, note| Part {
            mode,
            label: label.to_owned(),
            note,
        };
        let mut b1 = [0u8; 4];
        let mut b2 = [0u8; 4];
        let c = &mut client;
        let fc = &mut fake_client;
        let table = vec![
            (
                part(Mode::Blocking, "AF_UNIX ping-pong, blocking", None),
                Contender::new("floor", || floor.round_trip()),
            ),
            (
                part(
                    Mode::Blocking,
                    "raw client → switchyard",
                    Some(
                        "pre-encoded request, one read of the reply, on switchyard-client's socket: the server's cost",
                    ),
                ),
                Contender::new("raw client", || raw.round_trip()),
            ),
            (
                part(
                    Mode::Blocking,
                    "switchyard-client → fake server",
                    Some("an echo thread that returns a canned reply: the client's cost"),
                ),
                Contender::new("client vs fake", move || {
                    timed_access(fc, Op::Read, 0, SCRATCH, &mut b1)
                }),
            ),
            (
                part(
                    Mode::Blocking,
                    "switchyard-client → switchyard",
                    Some("regfile, as in the round-trip rows"),
                ),
                Contender::new("client vs switchyard", move || {
                    timed_access(c, Op::Read, 0, SCRATCH, &mut b2)
                }),
            ),
            (
                part(
                    Mode::Polling,
                    &format!("AF_UNIX ping-pong, both sides poll ({})", s.spin_label()),
                    None,
                ),
                Contender::new("polling floor", || floor_spin.round_trip()),
            ),
            (
                part(
                    Mode::Polling,
                    &format!("polling raw client → switchyard {}", s.spin_label()),
                    Some("client polls with non-blocking reads; floor: echo polls too"),
                ),
                Contender::new("polling raw client", || raw_spin.round_trip()),
            ),
        ];
        let (parts, mut cs): (Vec<Part>, Vec<Contender<'_>>) = table.into_iter().unzip();
        (parts, interleaved(&mut cs, s.rep_plan())?)
    };
    drop(raw_spin);
    drop(spin_client);
    spin_server.shutdown()?;
    drop(raw);
    drop(fake_client);
    let _ = fake.join();
    drop(client);
    server.shutdown()?;
    Ok((parts, results))
}
