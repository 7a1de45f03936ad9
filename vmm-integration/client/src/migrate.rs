//! Moving a device between two vfio-user servers with VFIO migration v2, the way a VMM does it:
//! one orchestrator holding a client of the source and one of the destination.
//!
//! A [`Migration`] walks the steps in order:
//!
//! 1. [`Migration::prepare_destination`]: destination RUNNING → RESUMING (outside the downtime;
//!    the destination discards its device state).
//! 2. Optionally pre-copy while the source keeps running: [`Migration::pre_copy`] (RUNNING →
//!    PRE_COPY, then rounds until one moves little or a round limit), or
//!    [`Migration::start_pre_copy`] and [`Migration::pre_copy_round`] one at a time.
//! 3. [`Migration::switchover`]: source → STOP_COPY, the rest of the stream, destination
//!    RESUMING → RUNNING (the server walks RESUMING → STOP → RUNNING, loading the state on the
//!    way). Its [`Switchover::downtime`] is the time the device ran nowhere.
//!
//! Every MIG_DATA_READ reply is written to the destination straight from the source client's
//! receive buffer (no copy in between). A failed step puts the source back into RUNNING (the
//! guest keeps its device) and says so in [`MigrationError`]; the destination is left as it is
//! (RESUMING or ERROR) for the caller to discard or reset. After a switchover the source stays
//! in STOP_COPY: the caller stops or releases it.
//!
//! ```no_run
//! use switchyard_client::Client;
//! use switchyard_client::migrate::{Migration, PreCopyPlan};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut src = Client::connect("/run/src.sock")?;
//! let mut dst = Client::connect("/run/dst.sock")?;
//! let mut mig = Migration::new(&mut src, &mut dst);
//! mig.prepare_destination()?;
//! let rounds = mig.pre_copy(&PreCopyPlan::default())?;
//! let done = mig.switchover()?;
//! println!("{} rounds, downtime {:?}", rounds.len(), done.downtime);
//! # Ok(())
//! # }
//! ```

use std::borrow::BorrowMut;
use std::fmt;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use switchyard_proto::consts::{
    VFIO_DEVICE_STATE_PRE_COPY, VFIO_DEVICE_STATE_RESUMING, VFIO_DEVICE_STATE_RUNNING,
    VFIO_DEVICE_STATE_STOP_COPY,
};

use crate::{Client, ClientError};

/// One of the two devices of a migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The device being migrated away from.
    Source,
    /// The device being migrated to.
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

/// A step of a migration, as named in a [`MigrationError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// [`Migration::ensure_supported`]: reading the devices' migration flags.
    CheckSupport,
    /// [`Migration::prepare_destination`]: destination RUNNING → RESUMING.
    PrepareDestination,
    /// Source RUNNING → PRE_COPY.
    StartPreCopy,
    /// A PRE_COPY round of MIG_DATA.
    PreCopyRound,
    /// Source PRE_COPY or RUNNING → STOP_COPY.
    StopCopy,
    /// The STOP_COPY stream of MIG_DATA.
    Stream,
    /// Destination RESUMING → RUNNING.
    ResumeDestination,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::CheckSupport => "Reading the migration flags",
            Step::PrepareDestination => "Destination RUNNING → RESUMING",
            Step::StartPreCopy => "Source RUNNING → PRE_COPY",
            Step::PreCopyRound => "A PRE_COPY round",
            Step::StopCopy => "Source → STOP_COPY",
            Step::Stream => "The STOP_COPY stream",
            Step::ResumeDestination => "Destination RESUMING → RUNNING",
        })
    }
}

/// Where a [`Migration`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Nothing done to the source yet (the destination may be RESUMING).
    Idle,
    /// The source is in PRE_COPY.
    PreCopy,
    /// The destination runs; the source is in STOP_COPY.
    SwitchedOver,
    /// A step failed or [`Migration::abort`] was called; the source was put back into RUNNING
    /// if it had left it.
    Aborted,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Idle => "not started",
            Phase::PreCopy => "in pre-copy",
            Phase::SwitchedOver => "switched over",
            Phase::Aborted => "aborted",
        })
    }
}

/// What became of the source after a failed step.
#[derive(Debug)]
#[non_exhaustive]
pub enum Recovery {
    /// The source had not left RUNNING: nothing to undo.
    NotNeeded,
    /// The source was set RUNNING again.
    SourceRunning,
    /// Setting the source RUNNING again failed too (a device in ERROR needs DEVICE_RESET).
    Failed(ClientError),
}

impl Recovery {
    /// Whether the source runs (again or still).
    pub fn source_runs(&self) -> bool {
        !matches!(self, Recovery::Failed(_))
    }
}

impl fmt::Display for Recovery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recovery::NotNeeded => f.write_str("the source did not leave RUNNING"),
            Recovery::SourceRunning => f.write_str("the source runs again"),
            Recovery::Failed(e) => write!(f, "the source could not be set RUNNING again: {e}"),
        }
    }
}

/// Errors returned by [`Migration`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrationError {
    /// A device does not offer the migration flags asked for.
    #[error("The {side} offers migration flags {offered:#x}, not {wanted:#x}")]
    Unsupported {
        /// The device.
        side: Side,
        /// Its `VFIO_MIGRATION_*` flags.
        offered: u64,
        /// The flags asked for.
        wanted: u64,
    },
    /// A step was called when the migration was not ready for it; nothing was sent.
    #[error("{step} was called while the migration is {phase}")]
    OutOfOrder {
        /// The step called.
        step: Step,
        /// Where the migration stood.
        phase: Phase,
    },
    /// A command of a step failed.
    #[error("{step} failed at the {side}; {recovery}")]
    Client {
        /// The step.
        step: Step,
        /// The device whose command failed.
        side: Side,
        /// The client's error.
        #[source]
        source: ClientError,
        /// What became of the source.
        recovery: Recovery,
    },
    /// A device reports another state than the one it was set to.
    #[error("{step}: the {side} reports state {got}, not {asked}; {recovery}")]
    State {
        /// The step.
        step: Step,
        /// The device.
        side: Side,
        /// The state asked for.
        asked: u32,
        /// The state echoed.
        got: u32,
        /// What became of the source.
        recovery: Recovery,
    },
}

impl MigrationError {
    /// What became of the source, for an error of a step that sent commands.
    pub fn recovery(&self) -> Option<&Recovery> {
        match self {
            MigrationError::Client { recovery, .. } | MigrationError::State { recovery, .. } => {
                Some(recovery)
            }
            MigrationError::Unsupported { .. } | MigrationError::OutOfOrder { .. } => None,
        }
    }

    /// The client's error, if a command failed.
    pub fn client_error(&self) -> Option<&ClientError> {
        match self {
            MigrationError::Client { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// When [`Migration::pre_copy`] stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreCopyPlan {
    /// Pre-copy ends after a round that moved fewer bytes than this ...
    pub converged_below: u64,
    /// ... or after this many rounds (at least one round runs).
    pub max_rounds: u32,
}

impl Default for PreCopyPlan {
    /// Rounds until one moves less than 1 MiB, at most 5.
    fn default() -> Self {
        PreCopyPlan {
            converged_below: 1 << 20,
            max_rounds: 5,
        }
    }
}

/// The figures of one round of MIG_DATA: a PRE_COPY round, or the STOP_COPY stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Round {
    /// MIG_DATA bytes moved.
    pub bytes: u64,
    /// MIG_DATA_READ round trips to the source, summed.
    pub reads: Duration,
    /// MIG_DATA_WRITE round trips to the destination, summed.
    pub writes: Duration,
    /// The longest MIG_DATA_READ: in PRE_COPY, what a guest's register access could have
    /// waited behind on the source's connection.
    pub read_max: Duration,
}

/// The figures of a [`Migration::switchover`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Switchover {
    /// Source → STOP_COPY called … destination → RUNNING returned: the device ran nowhere.
    pub downtime: Duration,
    /// In the downtime: the source's transition to STOP_COPY.
    pub to_stop_copy: Duration,
    /// In the downtime: the rest of the stream.
    pub stream: Round,
    /// In the downtime: the destination's RESUMING → RUNNING.
    pub resume: Duration,
}

/// A migration from the device behind one client to the device behind another.
///
/// `S` and `D` are anything that lends a [`Client`]: `&mut Client`, `Client`, or a caller's
/// own wrapper (see [`Migration::source`]). Dropping a migration sends nothing: call
/// [`Migration::abort`] to give up on one that has started.
pub struct Migration<S, D> {
    src: S,
    dst: D,
    chunk: u32,
    phase: Phase,
    /// The source may have left RUNNING (a state change to it was sent).
    source_left_running: bool,
}

impl<S, D> fmt::Debug for Migration<S, D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Migration")
            .field("chunk", &self.chunk)
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

/// Why a step failed, before the source's recovery.
enum Cause {
    Client(ClientError),
    State { asked: u32, got: u32 },
}

impl<S: BorrowMut<Client>, D: BorrowMut<Client>> Migration<S, D> {
    /// A migration from `src` to `dst`; sends nothing. MIG_DATA moves in chunks of the
    /// smaller of the two connections' negotiated `max_data_xfer_size`.
    pub fn new(src: S, dst: D) -> Self {
        let (s, d): (&Client, &Client) = (src.borrow(), dst.borrow());
        let chunk = s
            .negotiated_caps()
            .max_data_xfer_size
            .min(d.negotiated_caps().max_data_xfer_size)
            .max(1);
        Migration {
            src,
            dst,
            chunk,
            phase: Phase::Idle,
            source_left_running: false,
        }
    }

    /// MIG_DATA moves in chunks of `chunk` bytes (at most the connections' negotiated
    /// `max_data_xfer_size`, or the servers refuse the reads).
    pub fn with_chunk(mut self, chunk: NonZeroU32) -> Self {
        self.chunk = chunk.get();
        self
    }

    /// The size of a MIG_DATA_READ.
    pub fn chunk(&self) -> u32 {
        self.chunk
    }

    /// Where the migration stands.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The source's side, e.g. for the guest's register accesses during pre-copy.
    pub fn source(&mut self) -> &mut S {
        &mut self.src
    }

    /// The destination's side.
    pub fn destination(&mut self) -> &mut D {
        &mut self.dst
    }

    /// Both sides back.
    pub fn into_parts(self) -> (S, D) {
        (self.src, self.dst)
    }

    fn src(&mut self) -> &mut Client {
        self.src.borrow_mut()
    }

    fn dst(&mut self) -> &mut Client {
        self.dst.borrow_mut()
    }

    /// Fails with [`MigrationError::Unsupported`] unless both devices offer all of `flags`
    /// (`VFIO_MIGRATION_*`). Changes no state.
    pub fn ensure_supported(&mut self, flags: u64) -> Result<(), MigrationError> {
        for side in [Side::Source, Side::Destination] {
            let c = match side {
                Side::Source => self.src(),
                Side::Destination => self.dst(),
            };
            let offered = match c.migration_flags() {
                Ok(f) => f,
                Err(e) => return Err(self.fail(Step::CheckSupport, side, Cause::Client(e))),
            };
            if offered & flags != flags {
                return Err(MigrationError::Unsupported {
                    side,
                    offered,
                    wanted: flags,
                });
            }
        }
        Ok(())
    }

    /// Destination RUNNING → RESUMING (it discards its device state, VRAM included). Not
    /// needed if the destination is RESUMING already.
    pub fn prepare_destination(&mut self) -> Result<(), MigrationError> {
        self.expect(Step::PrepareDestination, &[Phase::Idle])?;
        self.set_state(
            Step::PrepareDestination,
            Side::Destination,
            VFIO_DEVICE_STATE_RESUMING,
        )
    }

    /// Source RUNNING → PRE_COPY: the device keeps running while its data moves.
    pub fn start_pre_copy(&mut self) -> Result<(), MigrationError> {
        self.expect(Step::StartPreCopy, &[Phase::Idle])?;
        self.source_left_running = true;
        self.set_state(Step::StartPreCopy, Side::Source, VFIO_DEVICE_STATE_PRE_COPY)?;
        self.phase = Phase::PreCopy;
        Ok(())
    }

    /// One PRE_COPY round: MIG_DATA from the source to the destination until a short read.
    pub fn pre_copy_round(&mut self) -> Result<Round, MigrationError> {
        self.expect(Step::PreCopyRound, &[Phase::PreCopy])?;
        self.move_until_short(Step::PreCopyRound)
    }

    /// Starts PRE_COPY (unless started) and runs rounds until `plan` says stop; returns the
    /// rounds.
    pub fn pre_copy(&mut self, plan: &PreCopyPlan) -> Result<Vec<Round>, MigrationError> {
        if self.phase == Phase::Idle {
            self.start_pre_copy()?;
        }
        let mut rounds = Vec::new();
        loop {
            let round = self.pre_copy_round()?;
            rounds.push(round);
            if round.bytes < plan.converged_below || rounds.len() >= plan.max_rounds as usize {
                return Ok(rounds);
            }
        }
    }

    /// Source → STOP_COPY, the rest of the stream to the destination, destination RESUMING →
    /// RUNNING. The source stays in STOP_COPY.
    pub fn switchover(&mut self) -> Result<Switchover, MigrationError> {
        self.expect(Step::StopCopy, &[Phase::Idle, Phase::PreCopy])?;
        self.source_left_running = true;
        let t0 = Instant::now();
        self.set_state(Step::StopCopy, Side::Source, VFIO_DEVICE_STATE_STOP_COPY)?;
        let t1 = Instant::now();
        let stream = self.move_until_short(Step::Stream)?;
        let t2 = Instant::now();
        self.set_state(
            Step::ResumeDestination,
            Side::Destination,
            VFIO_DEVICE_STATE_RUNNING,
        )?;
        let t3 = Instant::now();
        self.phase = Phase::SwitchedOver;
        Ok(Switchover {
            downtime: t3 - t0,
            to_stop_copy: t1 - t0,
            stream,
            resume: t3 - t2,
        })
    }

    /// Gives up: the source back into RUNNING if it left it. After a switchover (the
    /// destination runs) or a failed step (which recovered already) there is nothing to undo.
    #[must_use = "the source may not run"]
    pub fn abort(&mut self) -> Recovery {
        match self.phase {
            Phase::Idle | Phase::PreCopy => {
                self.phase = Phase::Aborted;
                self.recover()
            }
            Phase::SwitchedOver | Phase::Aborted => Recovery::NotNeeded,
        }
    }

    fn expect(&self, step: Step, phases: &[Phase]) -> Result<(), MigrationError> {
        if phases.contains(&self.phase) {
            Ok(())
        } else {
            Err(MigrationError::OutOfOrder {
                step,
                phase: self.phase,
            })
        }
    }

    /// Sets `side`'s state and checks the echo.
    fn set_state(&mut self, step: Step, side: Side, state: u32) -> Result<(), MigrationError> {
        let c = match side {
            Side::Source => self.src(),
            Side::Destination => self.dst(),
        };
        match c.set_mig_state(state) {
            Ok(got) if got == state => Ok(()),
            Ok(got) => Err(self.fail(step, side, Cause::State { asked: state, got })),
            Err(e) => Err(self.fail(step, side, Cause::Client(e))),
        }
    }

    /// MIG_DATA_READs from the source, each written to the destination from the receive
    /// buffer, until a short read (the end of a PRE_COPY round, or of the stream in
    /// STOP_COPY).
    fn move_until_short(&mut self, step: Step) -> Result<Round, MigrationError> {
        let chunk = self.chunk;
        let src: &mut Client = self.src.borrow_mut();
        let dst: &mut Client = self.dst.borrow_mut();
        let mut round = Round::default();
        let failed = loop {
            let t0 = Instant::now();
            let data = match src.mig_data_read_ref(chunk) {
                Ok(d) => d,
                Err(e) => break (Side::Source, e),
            };
            let t1 = Instant::now();
            round.read_max = round.read_max.max(t1 - t0);
            if !data.is_empty()
                && let Err(e) = dst.mig_data_write(data)
            {
                break (Side::Destination, e);
            }
            round.writes += t1.elapsed();
            round.reads += t1 - t0;
            round.bytes += data.len() as u64;
            if data.len() < chunk as usize {
                return Ok(round);
            }
        };
        Err(self.fail(step, failed.0, Cause::Client(failed.1)))
    }

    /// Ends the migration after a failed step, putting the source back into RUNNING.
    fn fail(&mut self, step: Step, side: Side, cause: Cause) -> MigrationError {
        self.phase = Phase::Aborted;
        let recovery = self.recover();
        match cause {
            Cause::Client(source) => MigrationError::Client {
                step,
                side,
                source,
                recovery,
            },
            Cause::State { asked, got } => MigrationError::State {
                step,
                side,
                asked,
                got,
                recovery,
            },
        }
    }

    fn recover(&mut self) -> Recovery {
        if !std::mem::take(&mut self.source_left_running) {
            return Recovery::NotNeeded;
        }
        match self.src().set_mig_state(VFIO_DEVICE_STATE_RUNNING) {
            Ok(VFIO_DEVICE_STATE_RUNNING) => Recovery::SourceRunning,
            Ok(got) => Recovery::Failed(ClientError::UnexpectedReply(format!(
                "the source reports state {got} after being set RUNNING"
            ))),
            Err(e) => Recovery::Failed(e),
        }
    }
}
