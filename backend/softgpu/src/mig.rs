//! The softgpu's migration stream: VRAM pages and the device state, as MIG_DATA bytes.
//!
//! # Format (version 1, little-endian)
//!
//! A sequence of records, each a 16-byte header `tag u32 | count u32 | offset u64`, some
//! followed by data:
//!
//! | tag | record | count | offset | data |
//! |---|---|---|---|---|
//! | `"SYGM"` | begin (first, once) | format version (1) | VRAM size | — |
//! | 2 | pages | pages (≥ 1) | VRAM byte offset, page aligned | `count` × 4096 bytes |
//! | 3 | zero pages | pages (≥ 1) | VRAM byte offset, page aligned | — |
//! | 4 | device state | bytes (≤ 1 MiB) | 0 | [`SoftGpuState`](crate::SoftGpuState) JSON |
//! | 5 | end (last, once) | 0 | 0 | — |
//! | 6 | padding (accepted, no longer sent) | bytes | 0 | `count` bytes to skip |
//!
//! The destination starts from zeroed VRAM and applies records in order; a page may come
//! several times (the last copy wins). The device state comes after the last VRAM record.
//!
//! Every read holds the connection (a guest's register accesses wait behind it), so a
//! PRE_COPY read visits at most [`SCAN_BUDGET`] pages and returns what it found, possibly
//! nothing: a short read says "nothing more for now", and the next read goes on where this
//! one stopped (the pass is not restarted). No padding: what the stream still holds is
//! served as numbers instead ([`MigSource::pending`]: GET_PRECOPY_INFO and MIG_DATA_SIZE),
//! so the VMM knows when an idle device is done. STOP_COPY reads have no budget (the guest
//! is stopped). Tag 6 (padding, sent by sources before the sizes were served) is still
//! accepted by the sink, so the format stays version 1: a new source's stream is one an
//! older destination reads, and an older source's stream loads here.
//!
//! # Which pages are sent
//!
//! The guest writes VRAM through its own mapping of the memfd, which the server cannot watch
//! (no write-protection or soft-dirty bit reaches another process's page tables). So changes
//! are found by content: the source keeps a 64-bit xxh3 hash of what the destination holds for
//! every page (initially the hash of a zero page) and each round copies the VRAM's data
//! extents (`SEEK_DATA`; holes are zero and cost nothing) into the outgoing buffer, hashes
//! each page there and keeps only the pages whose hash changed. The hash is taken of the very
//! bytes sent, so a page written while it is copied is caught by a later round. In PRE_COPY
//! rounds repeat while the device runs; STOP_COPY runs one final round on the stopped device,
//! then sends the state. The final round reads every data page once (hashing at memory
//! speed), so downtime grows with the VRAM in use, far slower than a full copy.
//!
//! With `vram_mmap=off` the client cannot map VRAM and every write goes through the device,
//! which logs it ([`Vram::mark`]). Then only the first round reads all of VRAM; later rounds,
//! the final one included, visit just the pages logged since they were last taken, so the
//! downtime after pre-copy depends on what was written, not on the VRAM size.
//!
//! When the client migrates the mapped VRAM itself, as its RAM (it asked with
//! `VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS` and the server agreed; ARCHITECTURE.md,
//! "Mapped VRAM without a pass over it"), the guest's writes through the mapping are the
//! client's to send, and the device's writes are in the log all the same: a stream started
//! in PRE_COPY clears the log and no round reads all of VRAM; every round, the final one
//! included, sends each logged page (without the hash comparison: the destination's copy of
//! a page may have come from the client's stream). A STOP_COPY without pre-copy keeps the
//! full round.

use std::fs::File;

use xxhash_rust::xxh3::xxh3_64;

use crate::vram::Vram;

/// Page size of the stream.
pub(crate) const PAGE: u64 = 4096;
const PAGE_BYTES: usize = PAGE as usize;
/// Record header size.
const REC: usize = 16;
/// Format version.
pub(crate) const FORMAT: u32 = 1;
const TAG_BEGIN: u32 = u32::from_le_bytes(*b"SYGM");
const TAG_PAGES: u32 = 2;
const TAG_ZERO: u32 = 3;
const TAG_STATE: u32 = 4;
const TAG_END: u32 = 5;
const TAG_PAD: u32 = 6;
/// Bytes a page costs in the stream at most (its data and, at worst, a record of its own).
const PAGE_COST: u64 = PAGE + REC as u64;
/// Pages a PRE_COPY read may visit (16 MiB: about a millisecond of copying and hashing).
pub(crate) const SCAN_BUDGET: u64 = 4096;
/// Largest device-state record.
pub(crate) const MAX_STATE: u32 = 1 << 20;

/// Why an incoming stream was refused.
#[derive(Debug, thiserror::Error)]
pub enum MigStreamError {
    /// The stream does not start with a begin record of this format.
    #[error("Migration stream does not start with a softgpu format {FORMAT} header")]
    BadBegin,
    /// The stream was made for another VRAM size.
    #[error("Migration stream carries {theirs} bytes of VRAM, this device has {ours}")]
    VramSize {
        /// VRAM size in the stream.
        theirs: u64,
        /// VRAM size of this device.
        ours: u64,
    },
    /// A record has an unknown tag or impossible fields.
    #[error("Invalid migration record (tag {tag:#x}, count {count}, offset {offset:#x})")]
    BadRecord {
        /// Tag.
        tag: u32,
        /// Count.
        count: u32,
        /// Offset.
        offset: u64,
    },
    /// Bytes arrived after the end record.
    #[error("Migration data after the end of the stream")]
    Trailing,
    /// The stream ended early.
    #[error("Migration stream is incomplete")]
    Incomplete,
    /// An earlier error poisoned the stream.
    #[error("Migration stream was refused earlier")]
    Poisoned,
}

fn header(tag: u32, count: u32, offset: u64) -> [u8; REC] {
    let mut h = [0u8; REC];
    h[..4].copy_from_slice(&tag.to_le_bytes());
    h[4..8].copy_from_slice(&count.to_le_bytes());
    h[8..].copy_from_slice(&offset.to_le_bytes());
    h
}

fn zero_hash() -> u64 {
    xxh3_64(&[0u8; PAGE_BYTES])
}

/// Where the outgoing stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Begin,
    Scan,
    State,
    End,
    Done,
}

/// Counters of an outgoing stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceStats {
    /// Completed rounds over VRAM.
    pub rounds: u64,
    /// Page records' pages sent.
    pub pages_sent: u64,
    /// PRE_COPY reads that ran out of scan budget before their buffer was full (they
    /// returned what they had found; the next read went on from there).
    pub budget_stops: u64,
    /// Pages sent as zero records.
    pub pages_zeroed: u64,
    /// Pages read and hashed (sent or not).
    pub pages_visited: u64,
}

/// The outgoing stream (PRE_COPY, STOP_COPY).
#[derive(Debug)]
pub(crate) struct MigSource {
    vram_size: u64,
    pages: u64,
    /// Hash of what the destination holds, per page.
    sent: Vec<u64>,
    zero: u64,
    cursor: u64,
    /// `[cursor, extent_end)` is a hole (`in_hole`) or data; recomputed past its end.
    extent_end: u64,
    in_hole: bool,
    /// A record that did not fit the last read: `carry[carry_pos..]` goes out first.
    carry: Vec<u8>,
    carry_pos: usize,
    step: Step,
    /// The device is stopped: this round is the last one, then the state follows.
    last_round: bool,
    /// The write log is complete (see the module documentation).
    tracked: bool,
    /// This round reads every data page; otherwise only pages of the write log.
    full_round: bool,
    /// The client migrates the mapped VRAM itself (see the module documentation): every
    /// logged page is sent, whatever the destination was last sent of it by this stream,
    /// because the client's own stream writes those pages too.
    client_mapped: bool,
    /// Write-log bits taken from word `word - 1` and not visited yet.
    bits: u64,
    word: usize,
    /// Logged pages `[cursor, run_end)` are being visited.
    run_end: u64,
    /// Pages visited by the current read.
    visited: u64,
    /// A whole round is complete (for a write log: every page was read once).
    first_pass_done: bool,
    /// Data pages of the current full round not visited yet (from the backing's allocated
    /// size at the round's start: an upper bound on what the round may still send).
    round_data_left: u64,
    /// Pages sent (as data or zero records) by the current round.
    round_sent: u64,
    /// Without a write log: pages the last complete round after the first found changed,
    /// the estimate of what the next round sends.
    hash_dirty: u64,
    /// When the device stopped (PRE_COPY → STOP_COPY, or a stream begun stopped).
    stopped_at: Option<std::time::Instant>,
    stats: SourceStats,
}

/// Pages of data (allocated blocks) of the VRAM backing: holes cost nothing to send.
fn data_pages(vram: &Vram) -> u64 {
    match rustix::fs::fstat(vram.file()) {
        Ok(st) => (u64::try_from(st.st_blocks).unwrap_or(0) * 512)
            .div_ceil(PAGE)
            .min(vram.size() / PAGE),
        Err(_) => vram.size() / PAGE,
    }
}

impl MigSource {
    /// A stream for `vram_size` bytes of VRAM; `stopped`: the device is already stopped
    /// (STOP_COPY), so the first round is the last. `client_mapped`: the client migrates
    /// the mapped VRAM itself from now on (PRE_COPY only; a STOP_COPY without pre-copy
    /// cannot know what the device wrote before it, so it reads all of VRAM as usual).
    pub(crate) fn new(vram: &Vram, stopped: bool, client_mapped: bool) -> Self {
        let vram_size = vram.size();
        let pages = vram_size / PAGE;
        let zero = zero_hash();
        let client_mapped = client_mapped && !stopped && !vram.tracked();
        let tracked = vram.tracked() || client_mapped;
        if tracked {
            // The first round reads everything; the log then holds what changed since.
            for w in 0..vram.written_words() {
                vram.take_written(w);
            }
        }
        Self {
            vram_size,
            pages,
            sent: vec![zero; usize::try_from(pages).unwrap_or(0)],
            zero,
            cursor: 0,
            extent_end: 0,
            in_hole: false,
            carry: Vec::new(),
            carry_pos: 0,
            step: Step::Begin,
            last_round: stopped,
            tracked,
            // With the client sending the mapped VRAM, the log holds all this stream owes
            // (what the device writes from now on): no round reads all of VRAM.
            full_round: !client_mapped,
            client_mapped,
            bits: 0,
            word: 0,
            run_end: 0,
            visited: 0,
            // With the client sending the mapped VRAM there is no first pass: nothing is
            // initial, the log is all that is pending.
            first_pass_done: client_mapped,
            round_data_left: data_pages(vram),
            round_sent: 0,
            hash_dirty: 0,
            stopped_at: stopped.then(std::time::Instant::now),
            stats: SourceStats::default(),
        }
    }

    /// What the stream holds beyond the pages of the current pass: `(initial, dirty)`
    /// pages. Initial: data pages the first pass has not visited. Dirty: with a write log,
    /// the pages logged and not sent since (exact); without one, what the last complete
    /// round after the first found changed (an estimate: the guest's writes are invisible).
    fn pending_pages(&self, vram: &Vram) -> (u64, u64) {
        let initial = if self.first_pass_done {
            0
        } else {
            self.round_data_left
        };
        let dirty = if self.tracked {
            let mut logged: u64 = (0..vram.written_words())
                .map(|w| u64::from(vram.peek_written(w).count_ones()))
                .sum();
            if !self.full_round {
                logged += u64::from(self.bits.count_ones());
                logged += self.run_end.saturating_sub(self.cursor);
            }
            logged
        } else if self.first_pass_done {
            self.hash_dirty
        } else {
            0
        };
        (initial, dirty)
    }

    /// `(initial, dirty)` bytes still to send while the device runs
    /// (`vfio_precopy_info`), records included (an upper bound on their overhead).
    pub(crate) fn pending(&self, vram: &Vram) -> (u64, u64) {
        let (initial, dirty) = self.pending_pages(vram);
        let begin = if self.step == Step::Begin {
            REC as u64
        } else {
            0
        };
        let carried = (self.carry.len() - self.carry_pos) as u64;
        (initial * PAGE_COST + begin + carried, dirty * PAGE_COST)
    }

    /// Bytes from here to the end of the stream if the device stopped now: what is pending,
    /// the device state (`state_len` bytes) and the end record.
    pub(crate) fn stop_copy_size(&self, vram: &Vram, state_len: u64) -> u64 {
        let (initial, dirty) = self.pending(vram);
        let tail = match self.step {
            Step::Begin | Step::Scan => 2 * REC as u64 + state_len,
            Step::State => 2 * REC as u64 + state_len,
            Step::End => REC as u64,
            Step::Done => 0,
        };
        initial + dirty + tail
    }

    /// The whole stream of a device that stopped now, without a stream begun: every data
    /// page, the device state, the begin and end records.
    pub(crate) fn full_stream_size(vram: &Vram, state_len: u64) -> u64 {
        data_pages(vram) * PAGE_COST + 3 * REC as u64 + state_len
    }

    /// The device has stopped (PRE_COPY → STOP_COPY): finish with a round that covers
    /// everything not yet sent as it is now. With a complete write log and the first round
    /// done, that is the logged pages (those taken but not visited go back into the log);
    /// with the log's first round in progress (the VMM switched over with little of it left),
    /// the rest of that round, then the logged pages (the log holds every write since the
    /// stream began); otherwise it is every data page.
    pub(crate) fn device_stopped(&mut self, vram: &Vram) {
        // What the switchover leaves to the device's stop-and-copy: with QEMU's
        // `switchover-ack` no initial bytes (the destination acked their load first).
        let (initial, dirty) = self.pending(vram);
        tracing::info!(
            initial_bytes = initial,
            dirty_bytes = dirty,
            "the device stopped for the switchover"
        );
        self.last_round = true;
        self.stopped_at = Some(std::time::Instant::now());
        if self.tracked && self.full_round {
            // Not from page 0 again: what was visited is in the log if it changed since.
            return;
        }
        if self.tracked && !self.full_round {
            if self.bits != 0 {
                vram.restore_written(self.word - 1, self.bits);
            }
            if self.cursor < self.run_end {
                vram.mark(self.cursor * PAGE, (self.run_end - self.cursor) * PAGE);
            }
        }
        self.new_round(vram);
    }

    /// Starts the next round from page 0 (the first one after a full round reads the log).
    /// A round that got to the end is complete: its findings become the estimate.
    fn new_round(&mut self, vram: &Vram) {
        if self.cursor >= self.pages {
            if self.first_pass_done && !self.tracked {
                self.hash_dirty = self.round_sent;
            }
            self.first_pass_done = true;
            if self.tracked {
                self.full_round = false;
            }
        }
        self.round_sent = 0;
        if self.full_round {
            self.round_data_left = data_pages(vram);
        }
        self.cursor = 0;
        self.extent_end = 0;
        self.bits = 0;
        self.word = 0;
        self.run_end = 0;
    }

    pub(crate) fn stats(&self) -> SourceStats {
        self.stats
    }

    /// Time since the device stopped (the device's share of the downtime, once the stream
    /// is complete); `None` before.
    pub(crate) fn stop_copy_time(&self) -> Option<std::time::Duration> {
        self.stopped_at.map(|t| t.elapsed())
    }

    /// Whether the client sends the mapped VRAM (this stream sends only logged pages).
    pub(crate) fn client_mapped(&self) -> bool {
        self.client_mapped
    }

    /// Fills `out` with the next stream bytes; fewer than `out.len()` means the current
    /// PRE_COPY round, or the whole stream, is complete. `state` encodes the device state
    /// (called once, after the last round).
    pub(crate) fn read(
        &mut self,
        vram: &Vram,
        state: &mut dyn FnMut() -> std::io::Result<Vec<u8>>,
        out: &mut [u8],
    ) -> std::io::Result<usize> {
        let mut n = self.drain_carry(out, 0);
        self.visited = 0;
        while n < out.len() {
            match self.step {
                Step::Begin => {
                    n = self.put(out, n, header(TAG_BEGIN, FORMAT, self.vram_size), &[]);
                    self.step = Step::Scan;
                }
                Step::Scan => {
                    if self.cursor >= self.pages {
                        self.stats.rounds += 1;
                        // A write log's first round is followed by a round over the log,
                        // also when it was the device's last.
                        let log_round_follows = self.tracked && self.full_round;
                        self.new_round(vram);
                        if self.last_round && log_round_follows {
                            continue;
                        }
                        if self.last_round {
                            self.step = Step::State;
                            continue;
                        }
                        // A PRE_COPY round is complete: this read ends short.
                        return Ok(n);
                    }
                    n = self.scan(vram, out, n);
                    if n < out.len()
                        && self.over_budget()
                        && self.carry.is_empty()
                        && self.cursor < self.pages
                    {
                        // What this read found, possibly nothing; the next goes on from here.
                        self.stats.budget_stops += 1;
                        return Ok(n);
                    }
                }
                Step::State => {
                    let bytes = state()?;
                    let len = u32::try_from(bytes.len())
                        .ok()
                        .filter(|&l| l <= MAX_STATE)
                        .ok_or_else(|| std::io::Error::other("device state too large"))?;
                    n = self.put(out, n, header(TAG_STATE, len, 0), &bytes);
                    self.step = Step::End;
                }
                Step::End => {
                    n = self.put(out, n, header(TAG_END, 0, 0), &[]);
                    self.step = Step::Done;
                    if let Some(t) = self.stopped_at {
                        tracing::info!(
                            stop_copy_ms = t.elapsed().as_secs_f64() * 1e3,
                            pages_sent = self.stats.pages_sent,
                            "outgoing migration stream complete"
                        );
                    }
                }
                Step::Done => break,
            }
        }
        Ok(n)
    }

    /// A page of the current round was read.
    fn visit(&mut self) {
        self.visited += 1;
        self.stats.pages_visited += 1;
        if self.full_round {
            self.round_data_left = self.round_data_left.saturating_sub(1);
        }
    }

    /// A PRE_COPY read has visited its share of pages.
    fn over_budget(&self) -> bool {
        !self.last_round && self.visited >= SCAN_BUDGET
    }

    fn drain_carry(&mut self, out: &mut [u8], n: usize) -> usize {
        let rest = &self.carry[self.carry_pos..];
        let k = rest.len().min(out.len() - n);
        out[n..n + k].copy_from_slice(&rest[..k]);
        self.carry_pos += k;
        if self.carry_pos == self.carry.len() {
            self.carry.clear();
            self.carry_pos = 0;
        }
        n + k
    }

    /// Appends a record at `out[n..]`, or as much of it as fits (the rest is carried).
    fn put(&mut self, out: &mut [u8], n: usize, hdr: [u8; REC], data: &[u8]) -> usize {
        if out.len() - n >= REC + data.len() {
            out[n..n + REC].copy_from_slice(&hdr);
            out[n + REC..n + REC + data.len()].copy_from_slice(data);
            return n + REC + data.len();
        }
        debug_assert!(self.carry.is_empty());
        self.carry.extend_from_slice(&hdr);
        self.carry.extend_from_slice(data);
        self.drain_carry(out, n)
    }

    /// Classifies the pages from `cursor` on as hole or data (`SEEK_DATA`/`SEEK_HOLE`; a
    /// backing without them is all data).
    fn refresh_extent(&mut self, file: &File) {
        if self.cursor < self.extent_end {
            return;
        }
        let off = self.cursor * PAGE;
        use rustix::fs::{SeekFrom, seek};
        match seek(file, SeekFrom::Data(off)) {
            Ok(d) if d / PAGE <= self.cursor => {
                let end = seek(file, SeekFrom::Hole(off)).unwrap_or(self.vram_size);
                self.in_hole = false;
                self.extent_end = end.div_ceil(PAGE).clamp(self.cursor + 1, self.pages);
            }
            Ok(d) => {
                self.in_hole = true;
                self.extent_end = (d / PAGE).min(self.pages);
            }
            Err(rustix::io::Errno::NXIO) => {
                self.in_hole = true;
                self.extent_end = self.pages;
            }
            Err(_) => {
                self.in_hole = false;
                self.extent_end = self.pages;
            }
        }
    }

    /// Advances the round from `cursor`, appending records at `out[n..]`, until `out` is
    /// full or the round is complete.
    fn scan(&mut self, vram: &Vram, out: &mut [u8], mut n: usize) -> usize {
        if !self.full_round {
            return self.scan_logged(vram, out, n);
        }
        while self.cursor < self.pages
            && n < out.len()
            && self.carry.is_empty()
            && !self.over_budget()
        {
            self.refresh_extent(vram.file());
            let end = self.extent_end;
            if self.in_hole {
                n = self.scan_hole(out, n, end);
            } else if out.len() - n >= REC + PAGE_BYTES {
                n = self.scan_data(vram, out, n, end);
            } else {
                n = self.scan_data_one(vram, out, n, end);
            }
        }
        n
    }

    /// Visits the pages of the write log, run by run, until `out` is full or the log is
    /// exhausted (then `cursor` is past the end: the round is complete).
    fn scan_logged(&mut self, vram: &Vram, out: &mut [u8], mut n: usize) -> usize {
        while n < out.len() && self.carry.is_empty() && !self.over_budget() {
            if self.cursor >= self.run_end {
                while self.bits == 0 {
                    if self.word >= vram.written_words() {
                        self.cursor = self.pages;
                        return n;
                    }
                    self.bits = vram.take_written(self.word);
                    self.word += 1;
                }
                let base = (self.word as u64 - 1) * 64;
                let lo = u64::from(self.bits.trailing_zeros());
                let len = u64::from((!(self.bits >> lo)).trailing_zeros());
                let mask = if len == 64 {
                    u64::MAX
                } else {
                    ((1u64 << len) - 1) << lo
                };
                self.bits &= !mask;
                self.cursor = (base + lo).min(self.pages);
                self.run_end = (base + lo + len).min(self.pages);
                continue;
            }
            let end = self.run_end;
            n = if out.len() - n >= REC + PAGE_BYTES {
                self.scan_data(vram, out, n, end)
            } else {
                self.scan_data_one(vram, out, n, end)
            };
        }
        n
    }

    /// Hole pages are zero: only pages the destination holds as non-zero need a record.
    fn scan_hole(&mut self, out: &mut [u8], mut n: usize, end: u64) -> usize {
        while self.cursor < end && n < out.len() {
            let c = self.cursor as usize;
            if self.sent[c] == self.zero {
                self.cursor += 1;
                continue;
            }
            let start = self.cursor;
            while self.cursor < end && self.sent[self.cursor as usize] != self.zero {
                self.sent[self.cursor as usize] = self.zero;
                self.cursor += 1;
            }
            let count = (self.cursor - start) as u32;
            self.stats.pages_zeroed += u64::from(count);
            self.round_sent += u64::from(count);
            n = self.put(out, n, header(TAG_ZERO, count, start * PAGE), &[]);
        }
        n
    }

    /// Copies data pages straight into `out` behind a record header, keeping those whose
    /// hash changed; one record per run of changed pages.
    fn scan_data(&mut self, vram: &Vram, out: &mut [u8], n: usize, end: u64) -> usize {
        let mut d = n + REC;
        let mut first = 0;
        let mut count = 0u32;
        while self.cursor < end && d + PAGE_BYTES <= out.len() && !self.over_budget() {
            let p = self.cursor;
            self.cursor += 1;
            self.visit();
            let dst = &mut out[d..d + PAGE_BYTES];
            if let Some(s) = vram.slice(p * PAGE, PAGE) {
                s.copy_to(dst);
            }
            let h = xxh3_64(dst);
            let slot = &mut self.sent[p as usize];
            if h == *slot && !self.client_mapped {
                if count > 0 {
                    break;
                }
                continue;
            }
            *slot = h;
            if count == 0 {
                first = p;
            }
            count += 1;
            d += PAGE_BYTES;
        }
        if count == 0 {
            return n;
        }
        out[n..n + REC].copy_from_slice(&header(TAG_PAGES, count, first * PAGE));
        self.stats.pages_sent += u64::from(count);
        self.round_sent += u64::from(count);
        d
    }

    /// Too little room in `out` for a page: find the next changed page and carry its record.
    fn scan_data_one(&mut self, vram: &Vram, out: &mut [u8], n: usize, end: u64) -> usize {
        let mut page = vec![0u8; PAGE_BYTES];
        while self.cursor < end && !self.over_budget() {
            let p = self.cursor;
            self.cursor += 1;
            self.visit();
            if let Some(s) = vram.slice(p * PAGE, PAGE) {
                s.copy_to(&mut page);
            }
            let h = xxh3_64(&page);
            if h != self.sent[p as usize] || self.client_mapped {
                self.sent[p as usize] = h;
                self.stats.pages_sent += 1;
                self.round_sent += 1;
                return self.put(out, n, header(TAG_PAGES, 1, p * PAGE), &page);
            }
        }
        n
    }
}

/// What the incoming stream is in the middle of.
#[derive(Debug)]
enum Pending {
    /// Collecting a record header.
    Header,
    /// Page data for VRAM at `offset`, `left` bytes to go.
    Pages { offset: u64, left: u64 },
    /// Device-state bytes, `left` to go.
    State { left: usize },
    /// Padding, `left` bytes to skip.
    Skip { left: u64 },
}

/// The incoming stream (RESUMING): applies VRAM records as they arrive and keeps the state.
#[derive(Debug)]
pub(crate) struct MigSink {
    vram_size: u64,
    hdr: [u8; REC],
    hdr_len: usize,
    pending: Pending,
    begun: bool,
    ended: bool,
    state: Option<Vec<u8>>,
    poisoned: bool,
}

impl MigSink {
    /// A sink for a device with `vram_size` bytes of VRAM, which the caller has zeroed.
    pub(crate) fn new(vram_size: u64) -> Self {
        Self {
            vram_size,
            hdr: [0; REC],
            hdr_len: 0,
            pending: Pending::Header,
            begun: false,
            ended: false,
            state: None,
            poisoned: false,
        }
    }

    /// Consumes the next chunk of the stream. An error poisons the sink.
    pub(crate) fn write(&mut self, vram: &Vram, data: &[u8]) -> Result<(), MigStreamError> {
        if self.poisoned {
            return Err(MigStreamError::Poisoned);
        }
        let r = self.consume(vram, data);
        if r.is_err() {
            self.poisoned = true;
        }
        r
    }

    fn consume(&mut self, vram: &Vram, mut data: &[u8]) -> Result<(), MigStreamError> {
        while !data.is_empty() {
            if self.ended {
                return Err(MigStreamError::Trailing);
            }
            match &mut self.pending {
                Pending::Header => {
                    let k = (REC - self.hdr_len).min(data.len());
                    self.hdr[self.hdr_len..self.hdr_len + k].copy_from_slice(&data[..k]);
                    self.hdr_len += k;
                    data = &data[k..];
                    if self.hdr_len == REC {
                        self.hdr_len = 0;
                        self.record(vram)?;
                    }
                }
                Pending::Pages { offset, left } => {
                    let k = usize::try_from(*left).unwrap_or(usize::MAX).min(data.len());
                    if let Some(s) = vram.slice(*offset, k as u64) {
                        s.copy_from(&data[..k]);
                        vram.host_wrote(*offset, k as u64);
                    }
                    *offset += k as u64;
                    *left -= k as u64;
                    data = &data[k..];
                    if *left == 0 {
                        self.pending = Pending::Header;
                    }
                }
                Pending::Skip { left } => {
                    let k = usize::try_from(*left).unwrap_or(usize::MAX).min(data.len());
                    *left -= k as u64;
                    data = &data[k..];
                    if *left == 0 {
                        self.pending = Pending::Header;
                    }
                }
                Pending::State { left } => {
                    let k = (*left).min(data.len());
                    let buf = self.state.get_or_insert_with(Vec::new);
                    buf.extend_from_slice(&data[..k]);
                    *left -= k;
                    data = &data[k..];
                    if *left == 0 {
                        self.pending = Pending::Header;
                    }
                }
            }
        }
        Ok(())
    }

    /// Acts on a complete record header.
    fn record(&mut self, vram: &Vram) -> Result<(), MigStreamError> {
        let h = self.hdr;
        let tag = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let count = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let offset = u64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
        let bad = MigStreamError::BadRecord { tag, count, offset };
        if !self.begun {
            if tag != TAG_BEGIN || count != FORMAT {
                return Err(MigStreamError::BadBegin);
            }
            if offset != self.vram_size {
                return Err(MigStreamError::VramSize {
                    theirs: offset,
                    ours: self.vram_size,
                });
            }
            self.begun = true;
            return Ok(());
        }
        match tag {
            TAG_PAGES | TAG_ZERO => {
                let len = u64::from(count) * PAGE;
                let fits = offset.is_multiple_of(PAGE)
                    && count > 0
                    && offset.checked_add(len).is_some_and(|e| e <= self.vram_size);
                if !fits || self.state.is_some() {
                    return Err(bad);
                }
                if tag == TAG_PAGES {
                    self.pending = Pending::Pages { offset, left: len };
                } else {
                    vram.zero_range(offset, len);
                }
            }
            TAG_STATE if offset == 0 && count <= MAX_STATE && self.state.is_none() => {
                self.state = Some(Vec::with_capacity(count as usize));
                if count > 0 {
                    self.pending = Pending::State {
                        left: count as usize,
                    };
                }
            }
            TAG_PAD if offset == 0 => {
                if count > 0 {
                    self.pending = Pending::Skip {
                        left: u64::from(count),
                    };
                }
            }
            TAG_END if count == 0 && offset == 0 && self.state.is_some() => {
                self.ended = true;
            }
            _ => return Err(bad),
        }
        Ok(())
    }

    /// The complete stream's device state; an error if the stream is incomplete or was
    /// refused.
    pub(crate) fn finish(self) -> Result<Vec<u8>, MigStreamError> {
        if self.poisoned {
            return Err(MigStreamError::Poisoned);
        }
        if !self.ended {
            return Err(MigStreamError::Incomplete);
        }
        self.state.ok_or(MigStreamError::Incomplete)
    }
}
