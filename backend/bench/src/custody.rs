//! The cost of the custody account and budget (issue 21) on the round trip.
//!
//! With crash continuity, every descriptor a client sends is put into custody (one `sendmsg`
//! on the custody channel) and entered in the worker's account of what it holds for the
//! client (a `BTreeSet` of custody ids); a descriptor no table refers to any more is released
//! (a release note) and leaves the account. With a budget (`ServerConfig::fd_budget`, what
//! the pool daemon sets for every worker), a read whose descriptors would take the account
//! past it is refused. The account is kept with or without a budget; the budget adds the
//! check. Measured on the path where both work, a SET_IRQS that replaces the eventfd of MSI-X
//! vector 0, and on a REGION_READ, which carries no descriptor, as the reference.

use std::collections::BTreeSet;
use std::hint::black_box;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use switchyard_client::Client;
use switchyard_proto::consts::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_PCI_MSIX_IRQ_INDEX,
};
use switchyard_proto::{IrqAction, IrqData, Reply, Request, SetIrqs};
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Settings, Variant, fig, pool, read_sizes, shutdown_all};
use crate::floors::Echo;
use crate::report::{Figure, Row, Unit};
use crate::servers::{BENCH_FD_BUDGET, DeviceKind};
use crate::stats::{Contender, Plan, interleaved};

/// Pre-made eventfds the SET_IRQS contenders take in turn: each SET_IRQS sends a duplicate
/// (`SCM_RIGHTS`), so the server always receives a new descriptor to put into custody.
const EVENTFDS: usize = 8;

/// Account operations per sample of the in-process account row (one is a few ns: too short
/// to time alone).
const ACCOUNT_BATCH: u32 = 1000;

/// The operations of the case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CustodyOp {
    /// SET_IRQS of one eventfd on MSI-X vector 0, replacing the previous one.
    SetIrqs,
    /// A 4-byte REGION_READ of BAR0 `SCRATCH`.
    Read,
}

impl CustodyOp {
    fn key(self) -> &'static str {
        match self {
            CustodyOp::SetIrqs => "set-irqs",
            CustodyOp::Read => "read",
        }
    }

    fn case(self) -> &'static str {
        match self {
            CustodyOp::SetIrqs => "SET_IRQS 1 eventfd (replaces one)",
            CustodyOp::Read => "REGION_READ 4 B",
        }
    }

    /// What the path does with the custody account.
    fn path(self) -> &'static str {
        match self {
            CustodyOp::SetIrqs => {
                "the new eventfd goes into custody (a sendmsg on the custody SOCK_SEQPACKET channel, its id entered in the account, checked against the budget where there is one) and the one it replaces is released (a release note, its id removed)"
            }
            CustodyOp::Read => "no descriptor: the account is not on this path (the reference)",
        }
    }

    /// Byte counts of the request and its reply: (request, reply).
    fn sizes(self) -> Result<(usize, usize)> {
        match self {
            CustodyOp::Read => read_sizes(4),
            CustodyOp::SetIrqs => set_irqs_sizes(),
        }
    }
}

/// Byte counts of a SET_IRQS of one eventfd: (request, reply). The descriptor travels as
/// `SCM_RIGHTS`, outside these bytes.
fn set_irqs_sizes() -> Result<(usize, usize)> {
    let mut req = Vec::new();
    Request::DeviceSetIrqs(SetIrqs {
        argsz: 20,
        action: IrqAction::Trigger,
        data: IrqData::Eventfd,
        index: VFIO_PCI_MSIX_IRQ_INDEX,
        start: 0,
        count: 1,
    })
    .encode(0, false, &mut req)?;
    let mut reply = Vec::new();
    Reply::DeviceSetIrqs.encode(0, &mut reply)?;
    Ok((req.len(), reply.len()))
}

fn timed_set_irqs(c: &mut Client, efd: &OwnedFd) -> Result<Duration> {
    let t0 = Instant::now();
    c.set_irqs(
        VFIO_PCI_MSIX_IRQ_INDEX,
        VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD,
        0,
        1,
        &[efd.as_fd()],
    )?;
    Ok(t0.elapsed())
}

fn timed_read(c: &mut Client, buf: &mut [u8]) -> Result<Duration> {
    let t0 = Instant::now();
    c.region_read(BAR_REGS, SCRATCH, buf)?;
    Ok(t0.elapsed())
}

/// `ACCOUNT_BATCH` times what the account does on a replacing SET_IRQS, in process: enter the
/// new id, remove the replaced one (the set holds one id between samples, as the worker's).
fn account_batch(set: &mut BTreeSet<u64>, next: &mut u64) -> Duration {
    let t0 = Instant::now();
    for _ in 0..ACCOUNT_BATCH {
        set.insert(black_box(*next + 1));
        set.remove(black_box(&*next));
        *next += 1;
    }
    black_box(&*set);
    t0.elapsed()
}

/// Waits (up to 5 s) until the keeper of `v` has received at least `want` descriptors; returns
/// how many it has.
fn custody_received_at_least(v: &Variant, want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = v.server.custody_received();
        if got >= want || Instant::now() >= deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// SET_IRQS (one eventfd, replacing the previous one on MSI-X vector 0) and 4-byte
/// REGION_READ round trips, blocking, against two journaled softgpu servers, as a pool worker
/// serves it, without and with the pool's default descriptor budget (1024); the AF_UNIX floor
/// sized like each request and reply interleaved with both; pooled over [`Settings::reps`]
/// setups like the journal case. Rows: each server against the floor, the budget server
/// against the one without (the cost of the budget on the round trip), and the account's
/// operations alone, in process (information only).
pub fn custody(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    const KINDS: [DeviceKind; 2] = [DeviceKind::SoftGpuJournal, DeviceKind::SoftGpuJournalBudget];
    const OPS: [CustodyOp; 2] = [CustodyOp::SetIrqs, CustodyOp::Read];
    let efds: Vec<OwnedFd> = (0..EVENTFDS)
        .map(|_| rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC))
        .collect::<rustix::io::Result<_>>()
        .context("eventfd")?;
    let plan = s.rep_plan();
    let mut pooled: Vec<Vec<Vec<u64>>> = vec![Vec::new(); OPS.len()];
    for rep in 0..s.reps() {
        let tag = format!("custody{rep}");
        let mut vs = KINDS
            .iter()
            .map(|&kind| Variant::start(dir, kind, None, s, &tag))
            .collect::<Result<Vec<_>>>()?;
        // Positive control: the budget reached the server's custody account (through
        // `ServerConfig::fd_budget` and `Server::set_continuity`), and only that server's.
        let budgets: Vec<Option<usize>> = vs.iter().map(|v| v.server.custody_budget()).collect();
        if budgets != [None, Some(BENCH_FD_BUDGET as usize)] {
            bail!(
                "custody: budgets {budgets:?}, expected none and {BENCH_FD_BUDGET}: the budget is not configured"
            );
        }
        for (&op, pooled) in OPS.iter().zip(pooled.iter_mut()) {
            let (req, reply) = op.sizes()?;
            let mut floor = Echo::start(req, reply, Duration::ZERO)?;
            // Order: the floor, then the servers in `KINDS` order (read back below).
            let mut cs = vec![Contender::new("floor blocking", || floor.round_trip())];
            for v in vs.iter_mut() {
                let c = &mut v.client;
                let mut ring = efds.iter().cycle();
                let mut buf = [0u8; 4];
                cs.push(Contender::new("switchyard", move || match op {
                    CustodyOp::SetIrqs => timed_set_irqs(c, ring.next().context("no eventfds")?),
                    CustodyOp::Read => timed_read(c, &mut buf),
                }));
            }
            pool(pooled, interleaved(&mut cs, plan)?);
        }
        // Positive control: continuity was on in both servers: the black box, VRAM, the
        // connection and every eventfd sent went into custody; the account holds exactly the
        // eventfd vector 0 has now (the replaced ones were released) and refused nothing.
        let sent = plan.warmup + plan.samples;
        for (kind, v) in KINDS.iter().zip(&vs) {
            let got = custody_received_at_least(v, 3 + sent);
            let account = v.server.custody_account();
            if got < 3 + sent || account != Some((1, 0)) {
                bail!(
                    "custody: {}: {got} descriptors went into custody (expected black box + VRAM + connection + {sent} eventfds) and the account is {account:?} (expected one held, none refused): continuity is off or the account does not follow",
                    kind.name()
                );
            }
        }
        shutdown_all(vs)?;
    }

    // The account's own operations, in process, on a set of the same size as the worker's.
    let mut set = BTreeSet::from([0u64]);
    let mut next = 0u64;
    let mut acct = vec![Contender::new("account", || {
        Ok(account_batch(&mut set, &mut next))
    })];
    let account_plan = if s.quick {
        Plan::new(10, 100, 1)
    } else {
        Plan::new(100, 2000, 1)
    };
    let mut acct = interleaved(&mut acct, account_plan)?;

    let mut set_irqs_plain_p50 = None;
    for (&op, results) in OPS.iter().zip(pooled.iter_mut()) {
        let (req, reply) = op.sizes()?;
        let [fb, plain, budget] = results.as_mut_slice() else {
            bail!("custody: expected the floor and two servers");
        };
        let case = op.case();
        let floor = fig("AF_UNIX ping-pong, blocking", fb, Unit::Micros, 0.0)?;
        let plain_label = "softgpu journaled, no budget";
        let budget_label = "softgpu journaled, budget 1024";
        let plain = fig(plain_label, plain, Unit::Micros, 0.0)?;
        let budget = fig(budget_label, budget, Unit::Micros, 0.0)?;
        if op == CustodyOp::SetIrqs {
            set_irqs_plain_p50 = Some(plain.p50);
        }
        let sizes = format!(
            "{req} B request / {reply} B reply{}",
            if op == CustodyOp::SetIrqs {
                " + 1 eventfd (SCM_RIGHTS; the floor sends none)"
            } else {
                ""
            }
        );
        let path = op.path();
        rows.push(Row::new(
            "custody",
            case.into(),
            op.key(),
            plain_label,
            None,
            Unit::Micros,
            plain.clone(),
            Some(floor.clone()),
            None,
            None,
            format!(
                "{sizes}; crash continuity as a pool worker serves it, ServerConfig::fd_budget None (the account is kept, never checked); {path}; floor: {}",
                floor.name
            ),
        ));
        rows.push(Row::new(
            "custody",
            case.into(),
            op.key(),
            budget_label,
            None,
            Unit::Micros,
            budget.clone(),
            Some(floor.clone()),
            None,
            None,
            format!(
                "{sizes}; the same with fd_budget Some(1024), the pool's default fds_per_endpoint; {path}; floor: {}",
                floor.name
            ),
        ));
        rows.push(Row::new(
            "custody",
            format!("{case}: budget cost"),
            op.key(),
            budget_label,
            None,
            Unit::Micros,
            budget,
            Some(Figure {
                name: format!("{plain_label}, same run"),
                ..plain
            }),
            None,
            None,
            format!(
                "ratio = budget / no-budget journaled server at p50, both interleaved with the floor above in the same run: what fd_budget adds (the check against the account; the account itself is kept by both); {path}"
            ),
        ));
    }
    let per_op = |f: Figure| Figure {
        p50: f.p50 / f64::from(ACCOUNT_BATCH),
        p99: f.p99 / f64::from(ACCOUNT_BATCH),
        ..f
    };
    let account_label = "BTreeSet insert + remove, in process";
    let account = per_op(fig(
        account_label,
        acct.first_mut().context("custody: no account samples")?,
        Unit::Micros,
        0.0,
    )?);
    let share = set_irqs_plain_p50
        .map(|p| format!("{:.2} %", account.p50 / p * 100.0))
        .unwrap_or_else(|| "-".into());
    rows.push(Row::new(
        "custody",
        "custody account alone".into(),
        "account",
        account_label,
        None,
        Unit::Micros,
        account,
        None,
        None,
        None,
        format!(
            "information only, no floor: one id entered and the replaced one removed in a BTreeSet<u64> holding one id, as the account does on each SET_IRQS above, timed in batches of {ACCOUNT_BATCH} (per pair shown; no lock, no syscall); {share} of the no-budget SET_IRQS round trip at p50"
        ),
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_irqs_of_one_eventfd_is_header_and_irq_set() {
        // 16-byte header + 20-byte vfio_irq_set; the reply is a bare header.
        assert_eq!(set_irqs_sizes().expect("sizes"), (36, 16));
    }

    #[test]
    fn account_batch_keeps_one_id() {
        let mut set = BTreeSet::from([0u64]);
        let mut next = 0;
        account_batch(&mut set, &mut next);
        account_batch(&mut set, &mut next);
        assert_eq!(next, 2 * u64::from(ACCOUNT_BATCH));
        assert_eq!(set.into_iter().collect::<Vec<_>>(), [next]);
    }
}
