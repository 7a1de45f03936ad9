//! The failover stall of a pool endpoint (issue 25: "failover stall (fault → first answered
//! request) p50/p99 at 64 MiB and 1 GiB VRAM; goal ≤ 2× the worker-restart stall for
//! transparent failover"), against the worker-restart stall measured on the same rig in the
//! same run.
//!
//! The rig: a real `switchyard daemon --faults` (the release binary, `--switchyard-bin`) on a
//! private state and run directory, with two softgpu boards of the size measured (2 queues,
//! VRAM mapped: the default) in one pool whose failover policy is transparent, and one
//! endpoint. A client (the bench's [`Gpu`] driver: a memfd DMA window, MSI-X vector 0 on an
//! eventfd, both queues enabled) fills 3/4 of VRAM with random data through the BAR2 file the
//! device offers for mmap, as a guest writes into its mapping. Then, one after the other, the
//! same number of times:
//!
//! - restart: `POST /v1/endpoints/{id}/restart` (the SIGKILL drill; it answers once the
//!   replacement serves), then a job on queue 0;
//! - failover: `POST /v1/boards/{board}/fault` `{"kind":"engine"}` on the endpoint's board
//!   (the device kills the engine of its first queue running a command, else of queue 0: every
//!   queue is idle here, so queue 0's; it dies at its next look for work), then a job on
//!   queue 0, which no engine runs until the daemon has moved the lease to the other board
//!   and replaced the worker with one continuing the device there. The failed board is
//!   repaired (`unquarantine`) once the failover is committed, so the endpoint goes back and
//!   forth between the two boards.
//!
//! A stall is the time from just before the POST to the job's completion (its FENCE in guest
//! memory; the client sleeps on its MSI-X interrupt): the job is a 4 KiB FILL of VRAM (outside
//! the filled 3/4) and a FENCE with an interrupt. The daemon's own figure of each failover
//! (`failover.last.stall_ms`: from the device's report to the replacement serving) is
//! reported too. Floor of the failover stall: the restart stall (the goal is ≤ 2×
//! it); floor of the restart stall: a process start of the same binary (spawn to exit of
//! `switchyard --version`), measured between the drills.
//!
//! The daemon and its workers run without `RUST_BACKTRACE`, as the packaged systemd unit runs
//! them: an engine's death is a panic, and with `RUST_BACKTRACE=1` the panic hook prints a
//! symbolized backtrace before the device can report (~120 ms here). The full run measures
//! that too, at 64 MiB ([`runs`]).
//!
//! Correctness, checked every run: each job's FILL is read back through the client's BAR2
//! file (the same VRAM memfd across every failover), every failover is committed as
//! transparent onto the other board, and at the end the VRAM file the serving worker offers
//! is the one the client got first, holds the random data byte for byte, and the device
//! copies samples of it into guest memory correctly. The daemon and every worker it recorded
//! (`<state>/workers/*.pid`, and every pid it reported) are killed on every path; on success
//! none may be left.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use switchyard_client::Client;
use switchyard_control::ControlClient;
use switchyard_softgpu::cmd::{Command, Operand};

use crate::cases::{Settings, fig, human};
use crate::downtime::{fill_random, vram_fd};
use crate::floors::wait_readable;
use crate::gpu::{DATA_OFFSET, Gpu, fence_offset, guest};
use crate::report::{Row, Target, Unit};
use crate::restart::{process_start, xorshift};
use crate::servers::vmm_client_config;
use crate::stats::ns;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The endpoint's id.
const ENDPOINT: &str = "bench";
/// The two boards of the pool.
const BOARDS: [&str; 2] = ["fa", "fb"];
/// The goal: failover stall ≤ this × the restart stall.
const GOAL_RATIO: f64 = 2.0;
/// The client's socket timeout: a replacement must answer within it (QEMU waits 5 s).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the daemon may take to answer, a job to complete or a failover to be committed
/// before the run fails: correctness limits, not timings.
const LIMIT: Duration = Duration::from_secs(20);
/// Guest memory after the control MiB: where the device copies VRAM samples.
const SAMPLE_AREA: u64 = MIB;
/// VRAM samples the device copies into guest memory at the end, and their size.
const SAMPLES: u64 = 16;
const SAMPLE_LEN: u64 = 64 << 10;
const _: () = assert!(SAMPLES * SAMPLE_LEN <= SAMPLE_AREA);
/// The seed of the random VRAM contents.
const SEED: u64 = 0xfa11_0e55_d00d_f00d;

/// One daemon's run.
#[derive(Debug, Clone, Copy)]
struct Run {
    vram: u64,
    /// Drills of each kind.
    drills: usize,
    /// `RUST_BACKTRACE=1` in the daemon's and its workers' environment (a dying engine's panic
    /// then prints a symbolized backtrace before the device reports), else unset, as the
    /// packaged systemd unit runs it.
    backtrace: bool,
}

/// What is measured: each size as packaged, 20 drills each (quick: 64 MiB, 3); in full mode
/// also 64 MiB with `RUST_BACKTRACE=1`, 10 drills.
fn runs(s: &Settings) -> Vec<Run> {
    let run = |vram, drills, backtrace| Run {
        vram,
        drills,
        backtrace,
    };
    if s.quick {
        vec![run(64 * MIB, 3, false)]
    } else {
        vec![
            run(64 * MIB, 20, false),
            run(GIB, 20, false),
            run(64 * MIB, 10, true),
        ]
    }
}

/// Two boards of `vram` (2 queues, mapped VRAM) in pool `p`, failover transparent.
fn config(vram: u64) -> String {
    let mut toml = String::new();
    for b in BOARDS {
        toml += &format!(
            "[[boards]]\nid = \"{b}\"\nvram = \"{}M\"\nqueues = 2\n\n",
            vram / MIB
        );
    }
    let ids: Vec<String> = BOARDS.iter().map(|b| format!("\"{b}\"")).collect();
    toml += &format!(
        "[[pools]]\nname = \"p\"\nboards = [{}]\nfailover = \"transparent\"\n",
        ids.join(", ")
    );
    toml
}

/// Whether `pid` is a running `switchyard worker` (not a zombie).
fn is_worker(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let zombie = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 1..))
        .is_some_and(|rest| rest.trim_start().starts_with('Z'));
    !zombie && cmdline.ends_with(b"\0worker\0")
}

fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(p, sig);
    }
}

/// The processes whose parent is `parent` (from `/proc/*/stat`).
fn children(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // `pid (comm) state ppid ...`; comm may hold anything but a `)` ends it last.
            stat.rfind(')')
                .and_then(|i| stat.get(i + 1..))
                .and_then(|rest| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                == Some(parent)
        })
        .collect()
}

/// `switchyard daemon --faults` on a private state and run directory. Workers outlive their
/// daemon by design, so stopping it ([`Daemon::stop`], also on drop) kills the daemon and
/// then every worker it recorded or reported.
struct Daemon {
    child: Option<Child>,
    state: PathBuf,
    log: PathBuf,
    api: ControlClient,
    /// Every worker pid the daemon reported (its records are rewritten by each replacement).
    seen: Vec<u32>,
}

impl Daemon {
    /// With `backtrace`, `RUST_BACKTRACE=1` in its environment (and its workers'), else none.
    fn start(bin: &Path, dir: &Path, vram: u64, backtrace: bool) -> Result<Daemon> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let conf = dir.join("pool.toml");
        std::fs::write(&conf, config(vram)).context("write the pool configuration")?;
        let (state, run, log) = (dir.join("state"), dir.join("run"), dir.join("daemon.log"));
        let socket = run.join("control.sock");
        let out = File::create(&log).context("create the daemon's log")?;
        let mut cmd = Process::new(bin);
        if backtrace {
            cmd.env("RUST_BACKTRACE", "1");
        } else {
            cmd.env_remove("RUST_BACKTRACE")
                .env_remove("RUST_LIB_BACKTRACE");
        }
        let child = cmd
            .arg("daemon")
            .arg("--faults")
            .arg("--config")
            .arg(&conf)
            .arg("--state-dir")
            .arg(&state)
            .arg("--run-dir")
            .arg(&run)
            .env("RUST_LOG", "warn")
            .env("SWITCHYARD_WORKER_EXE", bin)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .with_context(|| format!("start {} daemon", bin.display()))?;
        let mut child = Some(child);
        let deadline = Instant::now() + LIMIT;
        let api = loop {
            if let Ok(c) = ControlClient::connect(&socket)
                && c.get("/health").is_ok()
            {
                break c;
            }
            let exited = child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() >= deadline {
                if let Some(mut c) = child.take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                bail!(
                    "the daemon {}:\n{}",
                    exited.map_or("does not answer".into(), |s| format!("exited ({s})")),
                    log_tail(&log)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Ok(Daemon {
            child,
            state,
            log,
            api,
            seen: Vec::new(),
        })
    }

    /// `GET /v1/endpoints/{ENDPOINT}` (its worker's pid remembered).
    fn endpoint(&mut self) -> Result<Value> {
        let v = self
            .api
            .get(&format!("/v1/endpoints/{ENDPOINT}"))
            .context("GET the endpoint")?
            .body;
        self.note_pid(&v, "/worker/pid");
        Ok(v)
    }

    fn note_pid(&mut self, v: &Value, pointer: &str) {
        if let Some(pid) = v.pointer(pointer).and_then(Value::as_u64) {
            self.seen.extend(u32::try_from(pid).ok());
        }
    }

    /// Waits until the endpoint's worker runs, on a board other than `off` if given; returns
    /// the endpoint.
    fn wait_running(&mut self, off: Option<&str>) -> Result<Value> {
        let deadline = Instant::now() + LIMIT;
        loop {
            let e = self.endpoint()?;
            let board = e.pointer("/lease/board").and_then(Value::as_str);
            if e.pointer("/worker/state").and_then(Value::as_str) == Some("running")
                && board.is_some_and(|b| Some(b) != off)
            {
                return Ok(e);
            }
            ensure!(
                Instant::now() < deadline,
                "the endpoint's worker does not run (off {off:?}) within {LIMIT:?}: {e}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Every worker pid known: reported, and recorded in `<state>/workers/*.pid`.
    fn worker_pids(&self) -> Vec<u32> {
        let mut pids = self.seen.clone();
        if let Ok(dir) = std::fs::read_dir(self.state.join("workers")) {
            for f in dir.flatten() {
                if let Some(pid) = std::fs::read_to_string(f.path())
                    .ok()
                    .and_then(|t| t.split_whitespace().next()?.parse().ok())
                {
                    pids.push(pid);
                }
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Kills the daemon (stopped first, so that it starts no worker meanwhile), then every
    /// worker it recorded, reported or had as a child; returns those still running after 5 s.
    fn stop(&mut self) -> Vec<u32> {
        let Some(mut child) = self.child.take() else {
            return Vec::new();
        };
        signal(child.id(), rustix::process::Signal::STOP);
        let mut pids = children(child.id());
        let _ = child.kill();
        let _ = child.wait();
        pids.extend(self.worker_pids());
        pids.sort_unstable();
        pids.dedup();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left: Vec<u32> = pids.iter().copied().filter(|&p| is_worker(p)).collect();
            if left.is_empty() || Instant::now() >= deadline {
                return left;
            }
            for &p in &left {
                signal(p, rustix::process::Signal::KILL);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the daemon; fails if a worker is left.
    fn finish(mut self) -> Result<()> {
        let left = self.stop();
        ensure!(
            left.is_empty(),
            "workers still running after the daemon and they were killed: {left:?}"
        );
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The last lines of the daemon's log.
fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(30);
    format!(
        "--- {} (tail) ---\n{}",
        log.display(),
        lines[from..].join("\n")
    )
}

/// Reads what the eventfd counted, if anything (never blocks).
fn drain(irq: &File) -> Result<()> {
    let mut pfd = [rustix::event::PollFd::new(
        irq,
        rustix::event::PollFlags::IN,
    )];
    let zero = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    if rustix::event::poll(&mut pfd, Some(&zero)).context("poll the eventfd")? > 0 {
        let mut b = [0u8; 8];
        (&*irq).read_exact(&mut b).context("read the eventfd")?;
    }
    Ok(())
}

/// The client and what it checks.
struct Guest {
    gpu: Gpu,
    /// BAR2's file, as the client got it first.
    vram: File,
    /// Bytes of random data at the start of VRAM.
    data_len: u64,
    /// Where the jobs FILL.
    scratch: u64,
    /// Jobs run, and the last FENCE value on queue 0.
    jobs: u64,
}

impl Guest {
    /// One job on queue 0: a 4 KiB FILL of VRAM and a FENCE with an interrupt on vector 0.
    /// Returns once the FENCE is in guest memory, sleeping on the vector's eventfd (drained
    /// before the drill) until then, as a driver does: a job that completes after a failover
    /// or a restart wakes the client only through its interrupt, so one lost by the
    /// replacement fails the run (after [`LIMIT`]).
    fn job(&mut self) -> Result<()> {
        self.jobs += 1;
        let v = self.jobs;
        let cmds = [
            Command::fill(Operand::Vram(self.scratch), 4096, pattern(v)),
            Command::fence(guest(fence_offset(0)), v, Some(0)),
        ];
        let tail = self.gpu.enqueue(0, &cmds)?;
        self.gpu.doorbell(0, tail, false)?;
        let deadline = Instant::now() + LIMIT;
        while self.gpu.mem_load_u64(fence_offset(0))? != v {
            let left = deadline.saturating_duration_since(Instant::now());
            ensure!(!left.is_zero(), "job {v}: not completed within {LIMIT:?}");
            wait_readable(&self.gpu.irq, Some(left))
                .with_context(|| format!("job {v}: its interrupt"))?;
            drain(&self.gpu.irq)?;
        }
        Ok(())
    }

    /// The last job's FILL is in VRAM, as the client's BAR2 file shows it.
    fn check_job(&self) -> Result<()> {
        let mut page = [0u8; 4096];
        self.vram
            .read_exact_at(&mut page, self.scratch)
            .context("read the job's page through BAR2")?;
        let want = pattern(self.jobs).to_le_bytes();
        ensure!(
            page.chunks_exact(4).all(|w| w == want),
            "job {}: its FILL is not in VRAM",
            self.jobs
        );
        Ok(())
    }
}

/// The FILL pattern of job `n` (never zero).
fn pattern(n: u64) -> u32 {
    (n as u32).wrapping_mul(0x9e37_79b9) | 1
}

/// The offset of the first byte of `f`'s first `size` bytes that differs from what
/// [`fill_random`] wrote with `seed`.
fn first_mismatch(f: &File, size: u64, seed: u64) -> Result<Option<u64>> {
    let mut want = vec![0u8; MIB as usize];
    let mut got = vec![0u8; MIB as usize];
    let mut x = seed | 1;
    let mut off = 0;
    while off < size {
        for w in want.chunks_exact_mut(8) {
            w.copy_from_slice(&xorshift(&mut x).to_le_bytes());
        }
        let len = usize::try_from((size - off).min(MIB))?;
        let (want, got) = (&want[..len], &mut got[..len]);
        f.read_exact_at(got, off).context("read VRAM")?;
        if want != got {
            let i = want.iter().zip(got.iter()).position(|(a, b)| a != b);
            return Ok(Some(off + i.unwrap_or(0) as u64));
        }
        off += MIB;
    }
    Ok(None)
}

/// Where sample `i` goes in guest memory.
fn sample(i: u64) -> Operand {
    guest(DATA_OFFSET + i * SAMPLE_LEN)
}

/// After every drill: the serving worker offers the VRAM file the client got first, and it
/// holds the data; the device copies samples of it into guest memory correctly; no queue is
/// in error.
fn check_vram(g: &mut Guest) -> Result<()> {
    let now = vram_fd(&mut g.gpu.client).context("BAR2's file after the drills")?;
    let (a, b) = (
        rustix::fs::fstat(g.vram.as_fd())?,
        rustix::fs::fstat(now.as_fd())?,
    );
    ensure!(
        (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino),
        "the serving worker offers another VRAM file than the first one"
    );
    if let Some(off) = first_mismatch(&now, g.data_len, SEED)? {
        bail!("VRAM differs from the data written before the drills at {off:#x}");
    }
    g.check_job()?;
    // One sample in each sixteenth of the data, at a different page offset in each.
    let stride = g.data_len / SAMPLES;
    let src = |i: u64| i * stride + (i * 4096) % (stride - SAMPLE_LEN);
    let done = 0x5a5a;
    let cmds: Vec<Command> = (0..SAMPLES)
        .map(|i| Command::copy(Operand::Vram(src(i)), sample(i), SAMPLE_LEN))
        .chain([Command::fence(guest(fence_offset(1)), done, None)])
        .collect();
    let tail = g.gpu.enqueue(1, &cmds)?;
    g.gpu.doorbell(1, tail, false)?;
    crate::cases::wait_fences(&g.gpu, &[(fence_offset(1), done)], LIMIT)
        .context("the sample copies")?;
    let mut want = vec![0u8; SAMPLE_LEN as usize];
    for i in 0..SAMPLES {
        now.read_exact_at(&mut want, src(i)).context("read VRAM")?;
        for (k, w) in (0..).step_by(8).zip(want.chunks_exact(8)) {
            let got = g.gpu.mem_load_u64(DATA_OFFSET + i * SAMPLE_LEN + k)?;
            let w = u64::from_le_bytes(w.try_into()?);
            ensure!(
                got == w,
                "sample {i}: the device copied {got:#x} from VRAM {:#x}, which holds {w:#x}",
                src(i) + k
            );
        }
    }
    g.gpu.check_queues()
}

/// The per-drill times of one VRAM size, ns.
#[derive(Debug, Default)]
struct Samples {
    /// `POST .../restart` → the job after it completed.
    restart: Vec<u64>,
    /// `POST .../restart` answered (the replacement serves).
    restart_post: Vec<u64>,
    /// `POST .../fault` → the job after it completed.
    failover: Vec<u64>,
    /// The daemon's `failover.last.stall_ms` (report → replacement serving).
    daemon: Vec<u64>,
    /// The floor: spawn to exit of `switchyard --version`.
    process: Vec<u64>,
}

/// The restart drill → the next job done. Returns the stall and the POST's own time.
fn restart_once(d: &mut Daemon, g: &mut Guest) -> Result<(Duration, Duration)> {
    drain(&g.gpu.irq)?;
    let t0 = Instant::now();
    let reply = d
        .api
        .post(&format!("/v1/endpoints/{ENDPOINT}/restart"), &())
        .context("POST restart")?;
    let posted = t0.elapsed();
    g.job()?;
    let stall = t0.elapsed();
    d.note_pid(&reply.body, "/replaced_pid");
    d.note_pid(&reply.body, "/worker/pid");
    ensure!(
        reply.body.pointer("/worker/state").and_then(Value::as_str) == Some("running"),
        "the restart's replacement does not serve: {}",
        reply.body
    );
    g.check_job()?;
    Ok((stall, posted))
}

/// The engine fault on the endpoint's board → the next job done; then the failover's
/// commit, checked, and the failed board repaired. Returns the stall and the daemon's.
fn failover_once(d: &mut Daemon, g: &mut Guest) -> Result<(Duration, f64)> {
    let before = d.wait_running(None)?;
    let from = before
        .pointer("/lease/board")
        .and_then(Value::as_str)
        .context("the endpoint has no board")?
        .to_owned();
    let last = before.pointer("/failover/last").cloned();
    drain(&g.gpu.irq)?;
    let t0 = Instant::now();
    let reply = d
        .api
        .post(
            &format!("/v1/boards/{from}/fault"),
            &json!({ "kind": "engine" }),
        )
        .with_context(|| format!("POST fault on {from}"))?;
    g.job()?;
    let stall = t0.elapsed();
    ensure!(
        reply.body["endpoints"] == json!([ENDPOINT]),
        "the fault reached {}",
        reply.body
    );
    // Committed: the lease on the other board, a new last failover, transparent.
    let deadline = Instant::now() + LIMIT;
    let e = loop {
        let e = d.wait_running(Some(&from))?;
        let now = e.pointer("/failover/last");
        if now.is_some() && now != last.as_ref() {
            break e;
        }
        ensure!(
            Instant::now() < deadline,
            "the failover off {from} is not committed within {LIMIT:?}: {e}"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    ensure!(
        e.pointer("/failover/last/mode").and_then(Value::as_str) == Some("transparent"),
        "not a transparent failover: {e}"
    );
    let daemon_ms = e
        .pointer("/failover/last/stall_ms")
        .and_then(Value::as_f64)
        .with_context(|| format!("no stall_ms: {e}"))?;
    g.check_job()?;
    d.api
        .post(&format!("/v1/boards/{from}/unquarantine"), &())
        .with_context(|| format!("POST unquarantine {from}"))?;
    Ok((stall, daemon_ms))
}

/// One VRAM size: a daemon, a client, `drills` of each kind (after one warm-up each).
fn run_size(dir: &Path, s: &Settings, run: &Run) -> Result<Samples> {
    let mut d = Daemon::start(&s.switchyard_bin, dir, run.vram, run.backtrace)?;
    let r = drive(&mut d, run.vram, run.drills, &s.switchyard_bin);
    match r {
        Ok(samples) => {
            d.finish()?;
            Ok(samples)
        }
        Err(e) => {
            let tail = log_tail(&d.log);
            drop(d);
            Err(e.context(tail))
        }
    }
}

fn drive(d: &mut Daemon, vram: u64, drills: usize, bin: &Path) -> Result<Samples> {
    let created = d
        .api
        .post("/v1/endpoints", &json!({ "id": ENDPOINT, "pool": "p" }))
        .context("create the endpoint")?
        .body;
    let socket = created
        .pointer("/endpoint/socket")
        .and_then(Value::as_str)
        .map(PathBuf::from)
        .with_context(|| format!("no socket: {created}"))?;
    d.wait_running(None)?;
    let client = Client::connect_with(&socket, vmm_client_config(Some(CLIENT_TIMEOUT)))
        .with_context(|| format!("connect {}", socket.display()))?;
    let mut gpu = Gpu::setup(client, SAMPLE_AREA)?;
    let file = vram_fd(&mut gpu.client)?;
    let data_len = vram / 4 * 3;
    fill_random(&file, data_len, SEED).context("fill 3/4 of VRAM through BAR2")?;
    let mut g = Guest {
        gpu,
        vram: file,
        data_len,
        scratch: data_len,
        jobs: 0,
    };
    g.job()?;
    g.check_job()?;
    // One of each unrecorded.
    restart_once(d, &mut g)?;
    failover_once(d, &mut g)?;
    let mut rng = SEED ^ vram;
    let mut out = Samples::default();
    for i in 0..drills {
        // 5-15 ms apart, the endpoint serving.
        std::thread::sleep(Duration::from_micros(5_000 + xorshift(&mut rng) % 10_000));
        d.wait_running(None)?;
        let (stall, posted) = restart_once(d, &mut g).with_context(|| format!("restart {i}"))?;
        out.restart.push(ns(stall));
        out.restart_post.push(ns(posted));
        std::thread::sleep(Duration::from_micros(5_000 + xorshift(&mut rng) % 10_000));
        let (stall, daemon_ms) =
            failover_once(d, &mut g).with_context(|| format!("failover {i}"))?;
        out.failover.push(ns(stall));
        out.daemon.push((daemon_ms * 1e6) as u64);
        out.process.push(ns(process_start(bin)?));
    }
    check_vram(&mut g)?;
    Ok(out)
}

/// Nearest-rank percentile of samples (ns), in ms.
fn pct_ms(samples: &[u64], p: f64) -> f64 {
    let mut s = samples.to_vec();
    s.sort_unstable();
    let n = s.len();
    let idx = ((p * n as f64).ceil() as usize).clamp(1, n.max(1)) - 1;
    s.get(idx).copied().unwrap_or_default() as f64 / 1e6
}

/// See the [module](self) documentation.
pub fn failover(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let bin = &s.switchyard_bin;
    if !bin.is_file() {
        bail!(
            "{} not found: build it (`cargo build --release -p switchyard`, which scripts/bench.sh does) or pass --switchyard-bin",
            bin.display()
        );
    }
    for run in runs(s) {
        let (size, drills) = (human(run.vram), run.drills);
        let (env, tag) = if run.backtrace {
            ("RUST_BACKTRACE=1", "-bt")
        } else {
            ("RUST_BACKTRACE unset", "")
        };
        let sub = dir.join(format!("failover-{}{tag}", run.vram / MIB));
        let mut m = run_size(&sub, s, &run).with_context(|| format!("{size} VRAM, {env}"))?;
        let variant = format!("softgpu, switchyard daemon (release), {env}");
        let p99_ratio = pct_ms(&m.failover, 0.99) / pct_ms(&m.restart, 0.99);
        let restart_fig = fig(
            "worker restart: POST restart → first job done",
            &mut m.restart,
            Unit::Millis,
            0.0,
        )?;
        rows.push(Row::new(
            "failover",
            format!("failover {size}: engine fault → first job done"),
            "failover",
            &variant,
            Some(run.vram),
            Unit::Millis,
            fig("fault → first job done", &mut m.failover, Unit::Millis, 0.0)?,
            Some(restart_fig.clone()),
            None,
            Some(Target {
                floor_ratio: GOAL_RATIO,
                beat_peer: false,
                plus: 0.0,
            }),
            format!(
                "p99 ratio {p99_ratio:.2}×; {drills} failovers alternating between two boards (the failed one repaired after each), each from just before POST /v1/boards/{{id}}/fault {{\"kind\":\"engine\"}} to a 4 KiB FILL + FENCE with interrupt on queue 0 (the dead engine's) completed by the replacement on the other board; 3/4 of VRAM random data, verified after; floor: {}, same rig, interleaved; goal: issue 25's ≤ {GOAL_RATIO}× the restart stall",
                restart_fig.name
            ),
        ));
        rows.push(Row::new(
            "failover",
            format!("failover {size}: daemon stall_ms (report → replacement serving)"),
            "failover-part",
            &variant,
            Some(run.vram),
            Unit::Millis,
            fig("daemon stall_ms", &mut m.daemon, Unit::Millis, 0.0)?,
            Some(restart_fig.clone()),
            None,
            None,
            "information only: the daemon's failover.last.stall_ms, from the worker's board-failure report reaching the daemon to the replacement's ready note (the client's job can beat the note); ratio against the restart stall".into(),
        ));
        if run.backtrace {
            continue;
        }
        let process = fig(
            "process start: spawn to exit of `switchyard --version`",
            &mut m.process,
            Unit::Millis,
            0.0,
        )?;
        rows.push(Row::new(
            "failover",
            format!("failover {size}: worker restart, POST restart → first job done"),
            "failover-part",
            &variant,
            Some(run.vram),
            Unit::Millis,
            restart_fig,
            Some(process.clone()),
            None,
            None,
            format!(
                "the failover's floor: POST /v1/endpoints/{{id}}/restart (SIGKILL drill, answered once the replacement serves) → the same job completed; floor: {}, between the drills",
                process.name
            ),
        ));
        rows.push(Row::new(
            "failover",
            format!("failover {size}: worker restart, POST answered"),
            "failover-part",
            &variant,
            Some(run.vram),
            Unit::Millis,
            fig("POST restart answered", &mut m.restart_post, Unit::Millis, 0.0)?,
            None,
            None,
            None,
            "information only: the restart request alone (kill, replacement spawned and ready, the reply)".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_has_two_boards_in_one_transparent_pool() {
        let c = config(GIB);
        assert_eq!(c.matches("[[boards]]").count(), 2);
        assert!(c.contains("vram = \"1024M\""));
        assert!(c.contains("boards = [\"fa\", \"fb\"]"));
        assert!(c.contains("failover = \"transparent\""));
    }

    #[test]
    fn children_are_found_by_their_parent() {
        let mut child = Process::new("sleep")
            .arg("10")
            .spawn()
            .expect("spawn sleep");
        let found = children(std::process::id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(found.contains(&child.id()), "{found:?}");
        assert!(!is_worker(child.id()));
    }

    #[test]
    fn patterns_are_never_zero_and_percentiles_take_the_nearest_rank() {
        assert!((0..1000).all(|n| pattern(n) != 0));
        let v: Vec<u64> = (1..=20).map(|i| i * 1_000_000).collect();
        assert_eq!(pct_ms(&v, 0.5), 10.0);
        assert_eq!(pct_ms(&v, 0.99), 20.0);
    }
}
