#!/usr/bin/env python3
"""By-hand smoke check of a live migration under QEMU (issue 24; not part of scripts/test.sh).

Starts two `switchyard serve` softgpu servers, boots a TCG guest (no vIOMMU) on QEMU_WRAPPER
against the first, has the guest write the softgpu's SCRATCH register and a VRAM word through its
BAR mapping (busybox devmem), starts a second QEMU with `-incoming unix:` against the second
server, runs QMP `migrate`, and reads both values back in the destination guest.
Exit 0 when the migration completed and the destination read the values the source wrote.

usage: migrate-smoke.py [QEMU_WRAPPER [WORKDIR]]
  QEMU_WRAPPER  default: the patched QEMU of scripts/build-qemu.sh (--print-path)
  WORKDIR       default: a new temporary directory (logs: serve-*.log, qemu-*.log, console-*.log)
  SMOKE_DEVICE  environment: the softgpu options (default softgpu,vram=16M,queues=2)
Needs scripts/setup.sh's cache (kernel, initramfs-base, firmware) and a built switchyard
(target/release/switchyard).
"""
import json, os, re, socket, subprocess, sys, time

import tempfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
if len(sys.argv) > 1:
    QEMU = sys.argv[1]
else:
    QEMU = subprocess.run([REPO + "/scripts/build-qemu.sh", "--print-path"], check=True,
                          capture_output=True, text=True).stdout.strip()
W = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="sy-migrate-smoke-")
VM = os.environ.get("SWITCHYARD_CACHE", REPO + "/.cache/vmtools")
SERVE = REPO + "/target/release/switchyard"
DEVICE = os.environ.get("SMOKE_DEVICE", "softgpu,vram=16M,queues=2")
os.makedirs(W, exist_ok=True)
for f in os.listdir(W):
    if f.endswith(".sock"):
        os.unlink(os.path.join(W, f))

procs = []


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def start(args, logname, env=None):
    f = open(os.path.join(W, logname), "w")
    p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env)
    procs.append(p)
    return p


def wait_path(p, t=30):
    end = time.time() + t
    while not os.path.exists(p):
        if time.time() > end:
            raise SystemExit(f"timeout waiting for {p}")
        time.sleep(0.1)


class Qmp:
    def __init__(self, path):
        wait_path(path)
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(path)
        self.f = self.s.makefile("rw")
        json.loads(self.f.readline())
        self.cmd("qmp_capabilities")

    def cmd(self, c, **a):
        self.f.write(json.dumps({"execute": c, "arguments": a}) + "\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "event" in r:
                log("QMP EVENT", r["event"], json.dumps(r.get("data")))
                continue
            return r


class Console:
    def __init__(self, path, logname):
        wait_path(path)
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(path)
        self.s.settimeout(0.2)
        self.buf = b""
        self.log = open(os.path.join(W, logname), "ab")

    def pump(self):
        try:
            d = self.s.recv(65536)
            if d:
                self.buf += d
                self.log.write(d)
                self.log.flush()
        except socket.timeout:
            pass

    def expect(self, pat, t=120):
        end = time.time() + t
        while pat.encode() not in self.buf:
            if time.time() > end:
                raise SystemExit(f"timeout waiting for {pat!r}; tail: {self.buf[-500:]!r}")
            self.pump()
        i = self.buf.index(pat.encode()) + len(pat)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out.decode(errors="replace")

    def run(self, cmd, t=60):
        tag = f"__DONE{int(time.time()*1000) % 100000}__"
        self.s.sendall((cmd + f"; echo {tag}\n").encode())
        # The echoed command line has "echo TAG"; the output line starts with TAG.
        return self.expect("\n" + tag, t)


def qemu_args(sock, con, qmp, extra):
    dev = json.dumps({"driver": "vfio-user-pci", "id": "gpu0",
                      "socket": {"type": "unix", "path": sock}})
    return [QEMU, "-accel", "tcg", "-machine", "q35,memory-backend=mem0",
            "-object", "memory-backend-memfd,id=mem0,size=512M,share=on", "-m", "512",
            "-smp", "1", "-nodefaults", "-display", "none", "-no-reboot",
            "-kernel", VM + "/vmlinux", "-initrd", VM + "/initramfs-base.cpio.gz",
            "-append", "console=ttyS0 panic=-1 quiet no_timer_check sy.shell",
            "-serial", f"unix:{con},server=on,wait=off",
            "-qmp", f"unix:{qmp},server=on,wait=off",
            "-device", dev] + extra


def main():
    env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "info"))
    start([SERVE, "serve", "--socket", W + "/src.sock", "--device", DEVICE], "serve-src.log", env)
    start([SERVE, "serve", "--socket", W + "/dst.sock", "--device", DEVICE], "serve-dst.log", env)
    wait_path(W + "/src.sock")
    wait_path(W + "/dst.sock")
    log("servers up")
    src = start(qemu_args(W + "/src.sock", W + "/con-src.sock", W + "/qmp-src.sock", []),
                "qemu-src.log")
    con = Console(W + "/con-src.sock", "console-src.log")
    q = Qmp(W + "/qmp-src.sock")
    con.expect("GUEST: shell", 180)
    con.expect("/ # ", 30)
    log("source guest booted")
    out = con.run("for d in /sys/bus/pci/devices/*; do [ $(cat $d/vendor) = 0x1234 ] && "
                  "[ $(cat $d/device) = 0x5347 ] && echo BDF=${d##*/}; done")
    bdf = re.search(r"BDF=([0-9a-f:.]+)\r", out).group(1)
    res = con.run(f"sed 's/^/RES=/' /sys/bus/pci/devices/{bdf}/resource")
    bars = [int(m, 16) for m in re.findall(r"RES=(0x[0-9a-f]+) ", res)]
    bar0 = bars[0]
    vram_bar = next(b for i, b in enumerate(bars[1:6], 1) if b)
    log(f"device {bdf} bar0={bar0:#x} vram bar={vram_bar:#x}")
    con.run(f"echo 1 > /sys/bus/pci/devices/{bdf}/enable 2>/dev/null; "
            f"setpci -s {bdf} COMMAND=0x6 2>/dev/null; true")
    con.run(f"devmem {bar0 + 0x2c:#x} 32 0xdeadbeef; devmem {vram_bar + 0x1000:#x} 32 0x5a5a1234")
    rd = (f"echo R1=$(devmem {bar0 + 0x2c:#x} 32) R2=$(devmem {vram_bar + 0x1000:#x} 32)")
    before = con.run(rd)
    log("source reads:", re.findall(r"R\d=0x[0-9A-Fa-f]+", before))

    dst = start(qemu_args(W + "/dst.sock", W + "/con-dst.sock", W + "/qmp-dst.sock",
                          ["-incoming", f"unix:{W}/mig.sock"]), "qemu-dst.log")
    cond = Console(W + "/con-dst.sock", "console-dst.log")
    qd = Qmp(W + "/qmp-dst.sock")
    wait_path(W + "/mig.sock")
    t0 = time.time()
    log("migrate:", q.cmd("migrate", uri=f"unix:{W}/mig.sock"))
    st = None
    while time.time() - t0 < 300:
        r = q.cmd("query-migrate")["return"]
        st = r.get("status")
        if st in ("completed", "failed", "cancelled"):
            break
        time.sleep(1)
    log("migration", st, json.dumps(r))
    log("destination status:", qd.cmd("query-status"))
    if st != "completed":
        log("source still:", q.cmd("query-status"))
        return 1
    after = cond.run(rd, 120)
    got = re.findall(r"R\d=0x[0-9A-Fa-f]+", after)
    want = re.findall(r"R\d=0x[0-9A-Fa-f]+", before)
    log("destination reads:", got)
    if got != want:
        log(f"FAIL: the destination reads {got}, the source wrote {want}")
        return 1
    log(f"PASS: device state migrated (logs in {W})")
    return 0


rc = 1
try:
    log("QEMU:", QEMU, "workdir:", W)
    rc = main()
finally:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
sys.exit(rc)
