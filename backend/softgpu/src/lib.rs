//! SoftGpu: Switchyard's software GPU, a PCI device a guest driver can really use.
//!
//! It is modelled on how real GPUs are driven: memory-mapped registers in BAR0, device memory
//! (VRAM) in a prefetchable 64-bit BAR2, MSI-X in BAR4, and command rings in guest memory that
//! engine threads (one per queue) fetch and execute after a doorbell write. Everything a
//! driver needs is in the tables below. An MSI mode (`irq=msi`, [`IrqMode::Msi`]) replaces
//! MSI-X with a single MSI vector; see [Interrupt modes](#interrupt-modes).
//!
//! # PCI identity
//!
//! | field | value |
//! |---|---|
//! | vendor:device | `1234:5347` |
//! | subsystem | `1234:0001` |
//! | revision | 1 |
//! | class | `0x030200` (display controller, 3D controller) |
//! | interrupt pin | 0 (no INTx; MSI-X, or MSI in MSI mode) |
//! | capabilities | power management, PCI Express endpoint (FLR capable), then MSI-X (16 vectors, table BAR4+0x0, PBA BAR4+0x800) or, in MSI mode, MSI (1 vector, 64-bit address, no per-vector masking) |
//!
//! Vendor `0x1234` is the de-facto test vendor QEMU uses for its own devices (e.g. `edu` is
//! `1234:11e8`); the only in-tree Linux driver on that vendor is bochs-drm for `1234:1111`, so
//! no host or guest driver binds `1234:5347` by accident.
//!
//! # Regions
//!
//! | index | what | size | access |
//! |---|---|---|---|
//! | 0 (BAR0) | registers, 32-bit non-prefetchable | 64 KiB | trapped; 4-byte aligned 4-byte accesses and 8-byte aligned 8-byte accesses (low half first); the doorbell page `0x8000..0x9000` is also offered as a sparse mmap area (a memfd; see [Mapped doorbells](#mapped-doorbells)) |
//! | 2 (BAR2) | VRAM, 64-bit prefetchable | `vram_size` | mmap (one sparse area covering the BAR, backed by a memfd; not offered with `vram_mmap=off`) and trapped reads/writes of any size and alignment |
//! | 4 (BAR4) | MSI-X table at 0x0, PBA at 0x800, 32-bit non-prefetchable; absent (and BAR4 unimplemented) in MSI mode | 4 KiB | trapped; 4- or 8-byte aligned |
//! | 7 | PCI config space | 4 KiB | trapped, any size |
//!
//! Other regions are absent. Interrupts ([`SoftGpuConfig::irq_counts`]): INTx 0, MSI 0,
//! MSI-X 16 (eventfd, maskable), ERR 1 (eventfd), REQ 1 (eventfd); in MSI mode INTx 0, MSI 1
//! (eventfd, maskable), MSI-X 0, ERR 1 (eventfd), REQ 1 (eventfd). "Maskable" means `SET_IRQS` MASK/UNMASK: a masked
//! vector's messages are held and one is sent on unmask.
//!
//! The driver must set **Memory Space** and **Bus Master** in the PCI command register:
//! engines execute commands only while bus mastering is enabled (clearing it pauses them at
//! the next command boundary; queues with pending work then read `PAUSED`).
//!
//! # BAR0 registers
//!
//! All registers are 32 bits, little-endian. "64" marks a 64-bit pair (LO at the given
//! offset, HI at +4). Reads of undefined offsets (and of queues beyond `NUM_QUEUES`) return 0;
//! writes to them and to read-only registers are ignored.
//!
//! | offset | name | access | description |
//! |---|---|---|---|
//! | 0x000 | `MAGIC` | RO | `0x50475953` (bytes `"SYGP"`) |
//! | 0x004 | `VERSION` | RO | `0x00010001` (major 1, minor 1) |
//! | 0x008 | `FEATURES` | RO | `0x1ff`: bit 0 COPY, 1 FILL, 2 SAXPY, 3 GEMM, 4 REDUCE, 5 FENCE, 6 VRAM operands, 7 queue recovery, 8 doorbell page |
//! | 0x00c | `NUM_QUEUES` | RO | number of queues (1–8) |
//! | 0x010 | `VRAM_SIZE` | RO 64 | VRAM size in bytes |
//! | 0x018 | `FENCE_COUNT` | RO 64 | incremented by every completed FENCE (all queues) |
//! | 0x020 | `INT_STATUS` | RO | bit q: queue q completed a command with `FLAG_IRQ`; bit 16+q: queue q stopped on an error |
//! | 0x024 | `INT_MASK` | RW | same bits; a set bit suppresses that source's MSI-X (or MSI) message (status still latches). Power-on 0 |
//! | 0x028 | `INT_ACK` | WO | write 1s to clear `INT_STATUS` bits; reads 0 |
//! | 0x02c | `SCRATCH` | RW | no side effects |
//! | 0x030 | `DEV_CONTROL` | WO | bit 0 RESET: registers, queues, interrupt state, fence counter to power-on, VRAM zeroed; config space and MSI-X table kept. Reads 0 |
//! | 0x034 | `DEV_STATUS` | RO | bit 0 bus master enabled, bit 1 halted (client disconnected; cleared by the next register write), bit 2 some queue in error, bit 3 stopped by the host (a migration STOP state, [`SoftGpu::set_running`]; or engines parked for a swap) |
//! | 0x038 | `MSIX_VECTOR_COUNT` | RO | number of MSI-X vectors: 16; 0 in MSI mode (a driver can tell the modes apart by it) |
//! | 0x03c | `RING_ENTRY_SIZE` | RO | 64 |
//! | 0x040 | `MAX_RING_ENTRIES` | RO | 65536 |
//! | 0x044 | `MAX_XFER_BYTES` | RO | 2^28: largest COPY/FILL length |
//! | 0x048 | `MAX_ELEMENTS` | RO | 2^26: largest SAXPY/REDUCE `n` |
//! | 0x04c | `MAX_GEMM_DIM` | RO | 4096: largest M, N and K |
//! | 0x050 | `MAX_GEMM_WORK` | RO 64 | 2^36: largest `M*N*K` (every GEMM of `MAX_GEMM_DIM`) |
//!
//! Queue `q` (0 ≤ q < `NUM_QUEUES`) has its block at `0x1000 + q * 0x100`:
//!
//! | offset | name | access | description |
//! |---|---|---|---|
//! | 0x00 | `RING_BASE` | RW 64 | ring IOVA, 64-byte aligned; writes ignored while enabled |
//! | 0x08 | `RING_SIZE` | RW | entries, power of two 1–65536; writes ignored while enabled |
//! | 0x0c | `HEAD` | RO | free-running index of the next command to execute; slot = `index & (RING_SIZE-1)` |
//! | 0x10 | `TAIL` | RW | free-running index one past the last submitted command; a write is a doorbell |
//! | 0x14 | `DOORBELL` | RW | write: new tail, wakes the engine (in mapped mode: a kick, value ignored); read: tail |
//! | 0x18 | `CONTROL` | RW | bit 0 ENABLE, bit 1 RESET (W1, reads 0), bit 2 RECOVER (W1, reads 0), bit 3 MAPPED (mapped doorbell); see below |
//! | 0x1c | `STATUS` | RO | 0 STOPPED, 1 IDLE, 2 RUNNING, 3 ERROR, 4 PAUSED (work pending, but bus mastering off or device halted/stopped) |
//! | 0x20 | `ERROR_CODE` | RO | `ERR_*` below; 0 when not in error |
//! | 0x24 | `ERROR_INDEX` | RO | free-running index of the faulting command (HEAD at the time of a ring error) |
//! | 0x28 | `ERROR_ADDR` | RO 64 | faulting address (see error codes) |
//! | 0x30 | `COMPLETION_VECTOR` | RW | MSI-X vector of completion interrupts; power-on `q`. In MSI mode stored and read back but unused |
//! | 0x34 | `ERROR_VECTOR` | RW | MSI-X vector of error interrupts; power-on `8 + q`. In MSI mode stored and read back but unused |
//! | 0x38 | `COMPLETED` | RO 64 | commands completed |
//! | 0x40 | `ERROR_OPCODE` | RO | opcode of the faulting command |
//!
//! In MSI-X mode, vectors ≥ 16 never send a message. In MSI mode every message goes to the
//! single MSI vector whatever these registers hold (see [Interrupt modes](#interrupt-modes)).
//!
//! **Doorbells.** `TAIL`/`DOORBELL` accept a value only if `tail - HEAD ≤ RING_SIZE`
//! (wrapping u32 arithmetic); otherwise the write is refused and the queue enters ERROR with
//! `ERR_BAD_DOORBELL`. Doorbells are accepted while the queue is disabled or in error (the
//! commands run once it is enabled / recovered).
//!
//! # Mapped doorbells
//!
//! A trapped doorbell is a VM exit, a message to the server and a wake-up of the engine. With
//! a mapped doorbell a submission is a store into memory the engine watches: the guest never
//! exits, as with the doorbell pages and user-mode queues of real GPUs.
//!
//! **The page.** BAR0 `0x8000..0x9000` (`DOORBELL_PAGE`) is ordinary memory shared by the
//! guest and the device: the server offers it as a sparse mmap area of BAR0 (a VMM maps it
//! into the guest like VRAM; the rest of BAR0 stays trapped) and also serves trapped 4-byte
//! accesses to it (a trapped write to `DB_TAIL` stores and kicks, so a client that does not
//! map the page still works). Queue `q` has a 64-byte slot at `0x8000 + 0x40 * q`:
//!
//! | slot offset | name | written by | meaning |
//! |---|---|---|---|
//! | 0x0 | `DB_TAIL` | driver | the queue's tail, as a `TAIL` write would give it |
//! | 0x4 | `DB_NEED_KICK` | device | non-zero: the engine sleeps, ring `DOORBELL` after publishing a tail |
//!
//! The rest of the page reads 0 and is reserved. Like VRAM, the page belongs to the device
//! slot, not to one device object: swaps, moves and a pool worker's restart keep the very
//! page the guest mapped; a migration carries the tails in the device state and the
//! destination writes them into its own page.
//!
//! **Mode.** `CONTROL` bit 3 (`MAPPED`) selects the mode per queue; every `CONTROL` write
//! sets it to the bit written (RESET and RECOVER are processed first). Entering mapped mode
//! stores the queue's `TAIL` into `DB_TAIL`, so the driver continues from there. In mapped
//! mode the device takes the tail from `DB_TAIL` (checked like a `TAIL` write: more than
//! `RING_SIZE` commands in flight is `ERR_BAD_DOORBELL`, and the driver must correct `DB_TAIL`
//! before `RECOVER`), a `TAIL`/`DOORBELL` write is a *kick* (the device re-reads `DB_TAIL`;
//! the value written is ignored), and `TAIL` reads the last tail the device took. A queue
//! RESET in mapped mode also writes 0 to `DB_TAIL`. A device reset clears the page.
//!
//! **Protocol and memory ordering.** To submit, the driver:
//!
//! 1. writes the commands into the ring;
//! 2. makes them visible before the tail: a release fence (`sfence`/`dmb ishst`; on x86 the
//!    stores are ordered, a compiler barrier suffices for write-back memory);
//! 3. stores the new tail into `DB_TAIL` (one aligned 32-bit store);
//! 4. issues a **full fence** (`mfence`, `lock`-prefixed op, `dmb ish`: store→load order);
//! 5. reads `DB_NEED_KICK`; if it is non-zero, writes `DOORBELL` (any value).
//!
//! The engine, before it sleeps, sets `DB_NEED_KICK`, issues a full fence and reads `DB_TAIL`
//! once more; if it changed it clears the flag and runs. So either the engine sees the new
//! tail or the driver sees the flag (the Dekker pattern NVMe shadow doorbells and virtio's
//! event index rely on): no submission is stranded. A kick that finds nothing new costs a
//! trapped write, nothing else. The engine clears `DB_NEED_KICK` when it wakes.
//!
//! **Polling.** After running out of work an engine polls `DB_TAIL` for a bounded, adaptive
//! budget before it sleeps (the `spin` option, default 200 µs, as KVM's halt polling; `spin=0` never polls): it grows
//! when the next submission came soon after the engine went to sleep and shrinks to nothing
//! when sleeps are long (the rule KVM's halt polling uses), so a busy queue never sleeps and
//! an idle device burns no CPU. The same poll serves trapped doorbells: a `DOORBELL` write
//! that finds its engine polling only bumps a counter, with no wake-up. At most one engine of
//! a device polls at a time (the others sleep at once and are reached by kicks), so whatever
//! a client submits, a device's polling costs at most one core.
//!
//! **`CONTROL` writes** are processed in this order: RESET (if set) abandons the running
//! command (results discarded), sets head = tail = 0, clears the error state and `COMPLETED`,
//! disables the queue, and keeps ring base, ring size and vectors; RECOVER (if set and the
//! queue is in error) clears the error and, for command errors, moves HEAD to
//! `ERROR_INDEX + 1` (the bad command is skipped; for `ERR_BAD_DOORBELL`/`ERR_BAD_RING` HEAD
//! is unchanged); finally bit 0 sets the enable state. So recovering a running queue is a
//! write of `RECOVER | ENABLE` (`0x5`); a write without bit 0 disables the queue. Enabling
//! is ignored while the queue is in error; it checks the ring (`ERR_BAD_RING`, the queue stays
//! disabled) and that `TAIL - HEAD ≤ RING_SIZE` (else `ERR_BAD_DOORBELL` and TAIL is reset to
//! HEAD). Disabling and RESET take effect at the next command boundary (RESET also abandons
//! a long command at its next internal checkpoint): STATUS reads RUNNING until the engine has
//! let go of its command, and the driver must wait for STOPPED before reusing the ring or
//! operand memory.
//!
//! **Errors** stop the queue: STATUS = ERROR, `ERROR_CODE`/`ERROR_INDEX`/`ERROR_ADDR`/
//! `ERROR_OPCODE` are set, `INT_STATUS` bit 16+q latches and the error vector (MSI mode: the
//! MSI vector) fires. Every operand range is validated before anything is written, so a
//! faulting command writes nothing. The driver acks the interrupt (`INT_ACK`) and writes
//! `RECOVER | ENABLE`.
//!
//! | code | name | `ERROR_ADDR` |
//! |---|---|---|
//! | 1 | `BAD_OPCODE` | IOVA of the ring slot |
//! | 2 | `BAD_COMMAND`: reserved bits/space bits set, misaligned operand, FENCE vector ≥ 16, guest range wraps past 2^64 | the misaligned or wrapping operand's address, else the ring slot IOVA |
//! | 3 | `DMA_UNMAPPED`: guest range not fully mapped (or a message-based DMA transfer failed) | first unmapped IOVA |
//! | 4 | `DMA_PERMISSION`: e.g. a write into a read-only window | first IOVA lacking the permission |
//! | 5 | `VRAM_RANGE`: VRAM range beyond the VRAM size | the operand's VRAM offset |
//! | 6 | `LIMIT`: length/dimension above the `MAX_*` registers | IOVA of the ring slot |
//! | 7 | `RING_FETCH`: the command itself could not be read | faulting IOVA in the ring |
//! | 8 | `BAD_DOORBELL`: tail beyond head + ring size | the refused tail value |
//! | 9 | `BAD_RING`: enable with an invalid ring size/base | ring base |
//! | 10 | `INTERRUPTED`: the device was restarted while this command ran (see [Restarts](#restarts)); its outputs are undefined; commands before it completed, none after it ran. `RECOVER` skips it | IOVA of the ring slot |
//! | 11 | `DEVICE_LOST`: the device failed for good (its VRAM is lost, see [Device failure](#device-failure-the-err-interrupt)): no command will complete, on any queue; give up on the device | IOVA of the ring slot |
//!
//! # Commands
//!
//! A ring entry is 64 bytes, little-endian (see [`cmd`] for the encoder):
//!
//! | offset | size | field | meaning |
//! |---|---|---|---|
//! | 0x00 | 1 | opcode | below |
//! | 0x01 | 1 | flags | bit 0 IRQ: raise the completion interrupt when done; others must be 0 |
//! | 0x02 | 1 | space | bit i: operand `addr[i]` is a VRAM offset (else a guest IOVA); bits of unused operands must be 0 |
//! | 0x03 | 1 | reserved | must be 0 |
//! | 0x04 | 4 | imm32 | FILL pattern, SAXPY `a` (f32 bits), FENCE vector |
//! | 0x08 | 8×3 | addr0, addr1, addr2 | operand addresses |
//! | 0x20 | 8×3 | arg0, arg1, arg2 | sizes |
//! | 0x38 | 8 | imm64 | FENCE value |
//!
//! | opcode | command | operands | semantics |
//! |---|---|---|---|
//! | 0x00 | NOP | — | completes |
//! | 0x01 | COPY | src=addr0, dst=addr1, len=arg0 (bytes, ≤ 2^28) | any space to any space, any length/alignment; overlapping VRAM→VRAM copies behave like `memmove`; overlapping guest→guest copies are unspecified |
//! | 0x02 | FILL | dst=addr0, len=arg0 (≤ 2^28), pattern=imm32 | byte i of the range = byte `i % 4` of the little-endian pattern |
//! | 0x03 | SAXPY | x=addr0, y=addr1, n=arg0 (≤ 2^26), a=imm32 | `y[i] = a*x[i] + y[i]` in f32 (multiply rounded, then add rounded; no FMA). x, y 4-byte aligned; identical or disjoint |
//! | 0x04 | GEMM | A=addr0, B=addr1, C=addr2, M=arg0, N=arg1, K=arg2 | `C[M×N] = A[M×K]·B[K×N]`, dense row-major f32. For each `C[i][j]`: `acc = 0.0f32; for k in 0..K ascending: acc = acc + A[i][k]*B[k][j]` (product rounded, then sum rounded; no FMA). Dims ≤ 4096 (`M*N*K` ≤ 2^36); 4-byte aligned; C must not overlap A or B |
//! | 0x05 | REDUCE | x=addr0, out=addr1, n=arg0 (≤ 2^26) | `acc = 0.0f32; for i in 0..n ascending: acc = acc + x[i]`; writes `acc` as one f32 (4 bytes) at out. 4-byte aligned |
//! | 0x06 | FENCE | dst=addr0, value=imm64, vector=imm32 | after all earlier commands of the queue: writes the u64 value at dst (8-byte aligned, guest or VRAM), then increments `FENCE_COUNT`; with flag IRQ latches `INT_STATUS` bit q and (unless masked in `INT_MASK`) fires MSI-X `vector` (must be < 16 in both modes; ignored without IRQ) instead of the queue's completion vector; in MSI mode the MSI vector |
//!
//! Zero lengths are valid no-ops (GEMM with K = 0 writes zeros to C); their operands are still
//! checked (alignment, a VRAM offset ≤ VRAM size). Commands execute in ring order, one at a
//! time per queue; queues run concurrently and independently, each on its own engine thread.
//! A driver that needs ordering between queues uses FENCE values or interrupts.
//!
//! # Interrupt modes
//!
//! The `irq` option ([`SoftGpuConfig::irq`]) selects how interrupts are signalled. Everything
//! else (registers, commands, `INT_STATUS`/`INT_MASK`/`INT_ACK`) is the same in both modes.
//!
//! **MSI-X** (`irq=msix`, the default, like real GPUs): 16 vectors; each queue routes its
//! completion and error interrupts to its `COMPLETION_VECTOR`/`ERROR_VECTOR`, a FENCE with
//! IRQ to its own vector.
//!
//! **MSI** (`irq=msi`): one MSI vector and neither an MSI-X capability nor BAR4. Every
//! interrupt source (completions, FENCE vectors, errors) sends MSI vector 0; the driver tells
//! them apart through `INT_STATUS` (and acks them through `INT_ACK` as usual). The per-queue
//! vector registers and the FENCE vector keep their formats and checks (a FENCE vector ≥ 16
//! is still `ERR_BAD_COMMAND`) but do not route anything; `MSIX_VECTOR_COUNT` reads 0. Use
//! this mode where MSI-X is a problem, e.g. PCIe hot-unplug under QEMU 11.1, whose
//! `vfio-user-pci` aborts when removing a device with MSI-X.
//!
//! The mode is part of the configuration: a saved state restores only into a device of the
//! same mode.
//!
//! # MSI-X and MSI delivery
//!
//! A vector fires only while MSI-X (MSI) is enabled in the config space; a source raised
//! while it is disabled only latches its `INT_STATUS` bit, and no message is sent later when
//! it is enabled. Clients that emulate the MSI-X table themselves (QEMU, Cloud Hypervisor)
//! mask vectors by re-routing eventfds or through `SET_IRQS` MASK; for them the device ignores
//! its own table. Once a client writes the table through BAR4, the table's per-vector masks
//! and the function mask apply and masked vectors go pending in the PBA; a pending vector is
//! sent once it is unmasked while MSI-X is enabled and the function is not masked. MSI has no
//! per-vector masking; clients mask it through `SET_IRQS` on the MSI index.
//!
//! # Device failure: the ERR interrupt
//!
//! The device offers the VFIO error index (`VFIO_PCI_ERR_IRQ_INDEX`, one eventfd vector), as
//! vfio-pci does for devices with AER; a VMM that finds it enables error recovery (QEMU warns
//! "Could not enable error recovery for the device" without it) and stops the VM when it is
//! signalled. The device signals it only when it has failed for good: an engine thread died
//! (a panic while executing a command), so that queue will never run another command, or its
//! VRAM failed. Guest driver mistakes (bad commands, bad DMA addresses, bad doorbells) are not
//! device failures: they stop the queue and fire its error vector as described under Errors.
//!
//! Under a pool, a failure goes to the failure hook first ([`SoftGpu::set_failure_hook`]),
//! once per device, from the thread that found it: an engine that died (`state_intact`: the
//! registers are in the black box, VRAM in its memfd, so a replacement continues the device),
//! or VRAM that failed (its contents lost). If the hook takes it (the pool fails the device
//! over), ERR is not signalled. The other queues, register accesses and resets keep working;
//! a dead queue accepts doorbells but completes nothing. Failed VRAM fails BAR2 accesses
//! (`EIO`), migration and relocation, and no engine completes a command any more (a client
//! mapping of VRAM is not affected): every queue with work pending or running stops with
//! `ERR_DEVICE_LOST` at once (a queue error, as under Errors, so the driver learns of it
//! without waiting for a timeout), and so does an idle one when it is given work.
//! [`FaultInjection`] simulates both (`engine`, `vram`).
//!
//! # Resets
//!
//! FLR (PCI Express Device Control bit 15) and `DEVICE_RESET` ([`PciDevice::reset`]) return
//! everything to power-on: registers, queues, MSI-X table, config space (MSI-X or MSI
//! disabled), and VRAM (zeroed by punching a hole into the memfd). Both wait for the engines
//! to drop their current command. With `vram_reset=keep`
//! ([`SoftGpuConfig::keep_vram_on_reset`]) no reset touches VRAM, as a real GPU's memory
//! survives a function reset: a guest whose device is unplugged and plugged back (a pool's
//! guest-visible move) finds its VRAM as it left it.
//!
//! # Restarts
//!
//! A pool daemon can keep a device alive across the death of the process that serves it
//! (`kill -9`, a crash, an upgrade). The device mirrors its state into a black box (a sealed
//! memfd of [`BlackBox`] records the daemon keeps, [`SoftGpu::with_black_box`]): every change
//! is published before the register access that made it is answered and before the interrupt
//! it raises is sent, and a command's "in flight" marker before the command starts. A
//! replacement process resumes the device from the black box and the VRAM memfd
//! ([`SoftGpu::recover`]), on the same DMA windows and eventfds. To the guest, the restart is a
//! stall, with two visible traces:
//!
//! - a command that was running is run again from its start when that gives the same result
//!   (its outputs do not overlap its inputs: NOP, FILL, FENCE, COPY, GEMM and REDUCE without
//!   overlap); otherwise (SAXPY, overlapping operands) its queue stops with `ERR_INTERRUPTED`
//!   on it, and the driver handles it like any queue error (`INT_ACK`, `RECOVER | ENABLE`,
//!   then resubmits the work from fresh inputs if it needs it);
//! - an interrupt raised just before the restart may be delivered twice (never not at all):
//!   drivers read `INT_STATUS`, as they must for shared vectors anyway.
//!
//! `FENCE_COUNT`, `COMPLETED`, `HEAD` and `INT_STATUS` move together with a command's
//! completion, so no completion is lost or counted twice.
//!
//! # State
//!
//! [`SoftGpuState`] is the whole device state except VRAM contents, which stay in the memfd
//! ([`SoftGpu::vram_file`]) and are referenced by identity ([`VramRef`]). Save quiesces the
//! engines at a command boundary; restore rejects states of another configuration.
//!
//! # Migration and swaps
//!
//! The device implements VFIO migration v2 with PRE_COPY ([`Migratable::step`]):
//! STOP parks the engines after their current command (queues with work read `PAUSED`; a
//! command waiting for the client's DMA reply is abandoned instead and runs again later);
//! PRE_COPY streams VRAM while the device runs, in rounds; STOP_COPY sends what changed since,
//! then the state; RESUMING applies a stream on zeroed VRAM and loads the state at its end.
//! The stream format and how changed pages are found (content hashes when the client may map
//! VRAM, a write log with `vram_mmap=off`) are documented in `mig.rs`. Pending commands travel
//! in the guest's rings and run on the destination once it is RUNNING.
//!
//! A swap replaces the device under a connected client in two phases: [`SoftGpu::successor`]
//! builds a parked device on the same VRAM memfd (same DMA windows and eventfds), which is
//! checked ([`Swappable::check_successor`]) before [`Swappable::hand_over`] moves the state
//! into it and lets it run; every command runs exactly once across the swap, and a refused
//! swap runs nothing on the successor.
//!
//! Engines are held by several owners at once (a migration STOP, [`EngineControl::park`]
//! guards, a successor waiting for its state, a device that handed its state over, a
//! disconnected client); they run only when none holds them. Waiting for them from a device
//! call cancels the server's DMA through the client (windows without fd), whose replies the
//! waiting thread would have to route: such a command is abandoned without an error and runs
//! again from its start when the engines run again.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod accel;
pub mod cmd;
mod config;
mod device;
mod doorbell;
mod error;
mod exec;
mod fault;
mod identity;
mod kind;
mod mig;
mod mirror;
mod pci;
mod recover;
pub mod regs;
mod relocate;
mod state;
mod swap;
mod vram;

#[cfg(test)]
mod tests;

use std::fs::File;
use std::sync::Arc;
use std::thread::JoinHandle;

#[cfg(doc)]
use switchyard_device::FaultInjection;
#[cfg(doc)]
use switchyard_device::blackbox::BlackBox;
use switchyard_device::config::{Bar, BarKind, ConfigSpace, MsixLayout, PciIds};
use switchyard_device::{
    CONFIG_REGION_INDEX, DeviceContext, DeviceDescription, DeviceError, IrqDesc, IrqIndex, MigArc,
    Migratable, MigrationCaps, NUM_PCI_REGIONS, PciDevice, PrecopyInfo, Quiesce, QuiesceGuard,
    RegionDesc, RegionMmap, SparseArea, SuccessorFactory, Swappable,
};

pub use config::{ConfigError, IrqMode, SoftGpuConfig};
pub use error::SoftGpuError;
pub use identity::VramRef;
pub use kind::SoftGpuKind;
pub use mig::{MigStreamError, SourceStats};
pub use mirror::{COLD_RECORD, HOT_RECORD};
pub use recover::{QueueRecovery, Recovery};
pub use relocate::{Relocation, RelocationStats};
pub use state::{QueueState, STATE_FORMAT, SoftGpuState, StateError};
pub use swap::{EngineControl, Parked};

use device::{Holds, Shared};

/// Region index of the registers.
pub const BAR_REGS: u32 = 0;
/// Region index of VRAM.
pub const BAR_VRAM: u32 = 2;
/// Region index of the MSI-X table and PBA (absent in [`IrqMode::Msi`]).
pub const BAR_MSIX: u32 = 4;

/// What a device's engines did since it was created (carried to a successor by a swap or a
/// move; a replacement process after a crash starts from zero). Not device state: for a
/// pool's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkStats {
    /// Commands completed.
    pub commands: u64,
    /// Bytes the completed commands produced (their output operands).
    pub bytes: u64,
    /// Commands that stopped their queue with an error.
    pub errors: u64,
    /// Commands in flight when the last process died, run again by this one (recovery).
    pub replayed: u64,
    /// Commands in flight when the last process died that could not run again: their
    /// queues stopped with `ERR_INTERRUPTED` (recovery).
    pub interrupted: u64,
}

/// A migration stream in progress.
#[derive(Debug)]
enum Migration {
    Idle,
    Save(Box<mig::MigSource>),
    Load(Box<mig::MigSink>),
}

/// The slot's memory object holding softgpu VRAM (see [`DeviceContext::memory`]).
const VRAM_OBJECT: &str = "softgpu.vram";

/// The software GPU. See the crate documentation for the programming model.
#[derive(Debug)]
pub struct SoftGpu {
    config: SoftGpuConfig,
    desc: DeviceDescription,
    shared: Arc<Shared>,
    engines: Vec<JoinHandle<()>>,
    migration: Migration,
    /// The client migrates the mapped VRAM (and doorbell page) itself, as its RAM
    /// ([`Migratable::set_client_migrates_mapped`]); the next outgoing stream sends only
    /// what the device wrote.
    client_mapped: bool,
    /// A relocation this parked successor finishes when it is handed the state.
    incoming: Option<relocate::Incoming>,
    /// What the relocation that brought the device onto its VRAM copied.
    relocated: Option<RelocationStats>,
}

fn pci_ids() -> PciIds {
    PciIds {
        vendor: regs::PCI_VENDOR_ID,
        device: regs::PCI_DEVICE_ID,
        subsystem_vendor: regs::PCI_SUBSYSTEM_VENDOR_ID,
        subsystem: regs::PCI_SUBSYSTEM_ID,
        revision: regs::PCI_REVISION,
        class: regs::PCI_CLASS,
    }
}

fn build_config_space(config: &SoftGpuConfig) -> ConfigSpace {
    let mut cs = ConfigSpace::new(pci_ids());
    cs.add_bar(
        0,
        Bar {
            size: regs::BAR0_SIZE,
            kind: BarKind::Mem32 {
                prefetchable: false,
            },
        },
    );
    cs.add_bar(
        2,
        Bar {
            size: config.vram_size,
            kind: BarKind::Mem64 { prefetchable: true },
        },
    );
    if config.irq == IrqMode::Msix {
        cs.add_bar(
            4,
            Bar {
                size: regs::BAR4_SIZE,
                kind: BarKind::Mem32 {
                    prefetchable: false,
                },
            },
        );
    }
    cs.add_pm_cap();
    cs.add_pcie_cap();
    match config.irq {
        IrqMode::Msix => {
            cs.add_msix_cap(MsixLayout {
                vectors: regs::MSIX_VECTORS as u16,
                table_bar: BAR_MSIX as u8,
                table_offset: regs::MSIX_TABLE_OFFSET as u32,
                pba_bar: BAR_MSIX as u8,
                pba_offset: regs::MSIX_PBA_OFFSET as u32,
            });
        }
        // One vector: Multiple Message Capable = log2(1).
        IrqMode::Msi => {
            cs.add_msi_cap(0);
        }
    }
    cs.seal();
    cs
}

impl SoftGpu {
    /// Creates a device and starts its engines. Its VRAM (a sealed memfd, zeroed when new) is
    /// the slot's: the memory object `"softgpu.vram"` of `ctx.memory`, made here if the slot
    /// has none yet, so that a device replacing this one is lent the same VRAM.
    pub fn new(config: SoftGpuConfig, ctx: DeviceContext) -> Result<SoftGpu, SoftGpuError> {
        config.validate()?;
        let vram = ctx.memory.get_or_try_insert(VRAM_OBJECT, || {
            vram::Vram::create(config.vram_size, !config.vram_mmap)
        })?;
        Self::on_slot_vram(config, ctx, vram, Holds::default())
    }

    /// Creates a device on an existing VRAM backing file of exactly `config.vram_size` bytes
    /// (the contents are kept), which becomes the slot's VRAM object.
    pub fn with_vram(
        config: SoftGpuConfig,
        ctx: DeviceContext,
        vram: Arc<File>,
    ) -> Result<SoftGpu, SoftGpuError> {
        config.validate()?;
        let vram = Arc::new(vram::Vram::adopt(
            vram,
            config.vram_size,
            !config.vram_mmap,
        )?);
        ctx.memory.insert(VRAM_OBJECT, vram.clone());
        Self::start(config, ctx, vram, Holds::default())
    }

    /// Builds the device that is to replace the one in the slot whose context is `ctx` (a
    /// swap: the server's `DeviceSlot::swap`), on the slot's VRAM as it is mapped there: no
    /// new mapping, no page faults, nothing to unmap when the old device goes. It starts
    /// parked with power-on registers, touching nothing, and runs only once
    /// [`Swappable::hand_over`] has given it the old device's state. Building (starting engine
    /// threads) is the slow part of a swap: do it before taking the slot.
    pub fn successor(config: SoftGpuConfig, ctx: DeviceContext) -> Result<SoftGpu, SoftGpuError> {
        config.validate()?;
        let vram = ctx
            .memory
            .get::<vram::Vram>(VRAM_OBJECT)
            .ok_or(StateError::Inconsistent(
                "the slot has no softgpu VRAM to take over",
            ))?;
        let holds = Holds {
            successor: true,
            ..Holds::default()
        };
        Self::on_slot_vram(config, ctx, vram, holds)
    }

    fn on_slot_vram(
        config: SoftGpuConfig,
        ctx: DeviceContext,
        vram: Arc<vram::Vram>,
        holds: Holds,
    ) -> Result<SoftGpu, SoftGpuError> {
        if vram.size() != config.vram_size || vram.tracked() == config.vram_mmap {
            return Err(
                StateError::Inconsistent("the slot's VRAM is of another configuration").into(),
            );
        }
        Self::start(config, ctx, vram, holds)
    }

    fn start(
        config: SoftGpuConfig,
        ctx: DeviceContext,
        vram: Arc<vram::Vram>,
        holds: Holds,
    ) -> Result<SoftGpu, SoftGpuError> {
        let counts = config.irq_counts();
        for (index, &needed) in (0u32..).zip(&counts) {
            let got = ctx.irqs.count(index);
            if got < needed {
                return Err(SoftGpuError::IrqCount { index, needed, got });
            }
        }
        // The slot's doorbell page, like its VRAM: a successor keeps the page the guest mapped.
        let bells = ctx
            .memory
            .get_or_try_insert(doorbell::DOORBELL_OBJECT, doorbell::DoorbellPage::create)?;
        let mut regions: Vec<RegionDesc> =
            (0..NUM_PCI_REGIONS).map(|_| RegionDesc::absent()).collect();
        regions[BAR_REGS as usize] = RegionDesc {
            mmap: Some(RegionMmap {
                file: bells.file().clone(),
                file_offset: 0,
                areas: vec![SparseArea {
                    offset: regs::DOORBELL_PAGE,
                    size: regs::DOORBELL_PAGE_SIZE,
                }],
            }),
            ..RegionDesc::trapped(regs::BAR0_SIZE)
        };
        regions[BAR_VRAM as usize] = RegionDesc {
            size: config.vram_size,
            read: true,
            write: true,
            mmap: config.vram_mmap.then(|| RegionMmap {
                file: vram.file().clone(),
                file_offset: 0,
                areas: vec![SparseArea {
                    offset: 0,
                    size: config.vram_size,
                }],
            }),
        };
        if config.irq == IrqMode::Msix {
            regions[BAR_MSIX as usize] = RegionDesc::trapped(regs::BAR4_SIZE);
        }
        regions[CONFIG_REGION_INDEX as usize] =
            RegionDesc::trapped(switchyard_device::config::CONFIG_SIZE as u64);
        let none = IrqDesc {
            count: 0,
            eventfd: false,
            maskable: false,
            automasked: false,
            noresize: true,
        };
        let vectors = |count: u32, noresize: bool, maskable: bool| {
            if count == 0 {
                none
            } else {
                IrqDesc {
                    count,
                    eventfd: true,
                    maskable,
                    automasked: false,
                    noresize,
                }
            }
        };
        // Like vfio-pci: MSI-X may be resized (vectors added while enabled), MSI may not. MSI
        // and MSI-X are maskable: the server applies SET_IRQS MASK/UNMASK (`Interrupts`). ERR
        // and REQ are single trigger-only eventfds, as vfio-pci offers them.
        let irqs = vec![
            none,
            vectors(counts[IrqIndex::Msi as usize], true, true),
            vectors(counts[IrqIndex::Msix as usize], false, true),
            vectors(counts[IrqIndex::Err as usize], true, false),
            vectors(counts[IrqIndex::Req as usize], true, false),
        ];
        let desc = DeviceDescription {
            name: "softgpu",
            regions,
            irqs,
            resettable: true,
        };
        let shared = Arc::new(Shared::new(
            config,
            ctx,
            vram,
            bells,
            build_config_space(&config),
            holds,
        ));
        let mut gpu = SoftGpu {
            config,
            desc,
            shared,
            engines: Vec::new(),
            migration: Migration::Idle,
            client_mapped: false,
            incoming: None,
            relocated: None,
        };
        for q in 0..config.queues as usize {
            let shared = gpu.shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("softgpu-q{q}"))
                .spawn(move || shared.run_engine(q))
                .map_err(SoftGpuError::Thread)?;
            gpu.engines.push(handle);
        }
        Ok(gpu)
    }

    /// The configuration.
    pub fn config(&self) -> SoftGpuConfig {
        self.config
    }

    /// The VRAM backing file (a memfd unless adopted), e.g. to copy VRAM for migration.
    pub fn vram_file(&self) -> &Arc<File> {
        self.shared.vram.file()
    }

    /// Identity of the VRAM backing.
    pub fn vram_identity(&self) -> VramRef {
        self.shared.vram.identity()
    }

    /// Parks the engines at a command boundary (`false`; waits for the running commands to
    /// complete, cancelling waits on the client) or lets them run again (`true`). For the
    /// owner of the device's run state, the STOP states of a migration; other holds
    /// ([`EngineControl::park`], a swap) are independent of it. Not part of the saved state;
    /// a new device runs.
    pub fn set_running(&self, running: bool) {
        self.shared.set_running(running);
    }

    /// A handle that parks the engines from another thread.
    pub fn engine_control(&self) -> EngineControl {
        EngineControl(self.shared.clone())
    }

    /// Counters of the outgoing migration stream, if one is open.
    pub fn migration_stats(&self) -> Option<SourceStats> {
        match &self.migration {
            Migration::Save(src) => Some(src.stats()),
            _ => None,
        }
    }

    /// What the engines did so far.
    pub fn work_stats(&self) -> WorkStats {
        self.shared.lock().work
    }

    /// A snapshot of the device state, taken with the engines quiesced at a command boundary.
    pub fn snapshot(&self) -> SoftGpuState {
        self.shared.snapshot()
    }

    /// Validates and loads a state. Commands that were running are abandoned (their results
    /// are discarded) and the engines continue from the loaded heads. VRAM contents are not
    /// touched: if `state.vram` names another backing, the caller must have copied the VRAM.
    pub fn load(&self, state: SoftGpuState) -> Result<(), StateError> {
        let state = self.prepare(state)?;
        self.shared.load(state, None);
        Ok(())
    }

    /// Validates `state` for this device and points it at this device's VRAM.
    fn prepare(&self, mut state: SoftGpuState) -> Result<SoftGpuState, StateError> {
        state.validate(
            self.config,
            self.shared.vram.size(),
            &self.shared.config_def,
        )?;
        if state.vram != self.shared.vram.identity() {
            tracing::debug!(
                saved = ?state.vram,
                ours = ?self.shared.vram.identity(),
                "restoring a state saved with another VRAM backing"
            );
        }
        state.vram = self.shared.vram.identity();
        state
            .config_space
            .restore_masks_from(&self.shared.config_def);
        Ok(state)
    }

    /// Checks a register-style access to `region` (`size` bytes): in range, 4 or 8 bytes,
    /// naturally aligned.
    fn access_ok(region: u32, size: u64, offset: u64, len: usize) -> Result<(), DeviceError> {
        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(DeviceError::OutOfRange {
                region,
                offset,
                len,
            });
        }
        if !matches!(len, 4 | 8) || !offset.is_multiple_of(len as u64) {
            return Err(DeviceError::BadAccess {
                region,
                offset,
                len,
            });
        }
        Ok(())
    }

    fn vram_slice(
        &self,
        offset: u64,
        len: usize,
    ) -> Result<vm_memory::VolatileSlice<'_, ()>, DeviceError> {
        self.shared
            .vram
            .slice(offset, len as u64)
            .ok_or(DeviceError::OutOfRange {
                region: BAR_VRAM,
                offset,
                len,
            })
    }

    fn config_out_of_range(offset: u64, len: usize) -> DeviceError {
        DeviceError::OutOfRange {
            region: CONFIG_REGION_INDEX,
            offset,
            len,
        }
    }
}

impl Drop for SoftGpu {
    fn drop(&mut self) {
        self.shared.shutdown();
        for h in self.engines.drain(..) {
            if h.join().is_err() {
                tracing::error!("a softgpu engine thread panicked");
            }
        }
    }
}
