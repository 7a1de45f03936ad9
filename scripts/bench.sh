#!/usr/bin/env bash
# Builds and runs the benchmarks (backend/bench, docs/performance.md): vfio-user round trips,
# posted and multi writes, softgpu COPY and interrupt delivery, swap and migration downtime,
# the crash-continuity journal's cost, the restart stall of a pool worker and the failover stall
# of a pool endpoint, each against its floor (and the vfio_user crate's server where it has an
# equivalent) measured in the same run. The restart case runs `switchyard worker` processes of
# the release `switchyard` binary built here (--switchyard-bin PATH to use another); the
# failover and api cases run its `switchyard daemon` and kill it and its workers when done (the
# failover case's daemon logs to a file in the run's temporary directory; a failure shows its
# tail).
#
#   scripts/bench.sh            # full run (a few minutes): table + target/bench/results.json
#   scripts/bench.sh --quick    # CI: seconds, every case exercised, timings never asserted;
#                               # clients and interrupt waits give up after 30 s, so a
#                               # stalled server fails the run instead of hanging it
#
# Extra arguments go to switchyard-bench (e.g. --only round-trip,copy  --spin-us 20).
# Also writes target/bench/latency.svg (the plot) and target/bench/results.md (the table).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --locked -p switchyard-bench -p switchyard
target_dir=$(cargo metadata --format-version 1 --no-deps --locked |
  sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
target_dir=${target_dir:-target}
out="$target_dir/bench"
# The restart case's `switchyard worker` processes log to this terminal (a few lines per
# restart at info): warnings only unless RUST_LOG says otherwise.
export RUST_LOG="${RUST_LOG:-warn}"
mkdir -p "$out"
"$target_dir/release/switchyard-bench" "$@" \
  --json "$out/results.json" --svg "$out/latency.svg" --markdown "$out/results.md"
echo "results: $out/results.json, plot: $out/latency.svg"
