# shellcheck shell=bash
# scripts/lib/cloud-hypervisor.sh — sourced, not run, by scripts/setup.sh, scripts/test.sh and
# scripts/bench-nested.sh. cloud-hypervisor is optional (docs/cloud-hypervisor.md): no package
# registry ships it, so a fresh clone may have none. These say where the setup cache is, whether
# cloud-hypervisor is installed in it, and what does not run without it.

# What needs cloud-hypervisor: the cargo test names of the nested tests that run L2 guests under
# it (guest-tests/harness/tests/nested_guest.rs), and the scripts (scripts/NAME.sh).
SY_CH_TESTS=(cloud_hypervisor_l2_guests_use_the_softgpu_served_in_l1)
SY_CH_SCRIPTS=(bench-nested)

# sy_cache REPO: the setup cache, as scripts/setup.sh computes it.
sy_cache() { printf '%s\n' "${SWITCHYARD_CACHE:-$1/.cache/vmtools}"; }

# sy_ch_installed CACHE: whether scripts/setup.sh installed cloud-hypervisor and ch-remote there.
sy_ch_installed() { [ -x "$1/ch/cloud-hypervisor" ] && [ -x "$1/ch/ch-remote" ]; }

# sy_ch_not_run: what does not run without cloud-hypervisor, for a message ("a, b, c").
sy_ch_not_run() {
  local out="" x
  for x in "${SY_CH_TESTS[@]}" "${SY_CH_SCRIPTS[@]}"; do out+="${out:+, }$x"; done
  printf '%s\n' "$out"
}

# sy_ch_plan CACHE: sets SY_CH_SKIP, the arguments for the guest tests' test binaries that leave
# out (by exact name) the tests needing cloud-hypervisor, and SY_CH_NOT_RUN, what will not run;
# both empty when cloud-hypervisor is installed in CACHE.
# shellcheck disable=SC2034  # both are read by the scripts that source this
sy_ch_plan() {
  SY_CH_SKIP=()
  SY_CH_NOT_RUN=""
  if sy_ch_installed "$1"; then return 0; fi
  local t
  SY_CH_SKIP=(--exact)
  for t in "${SY_CH_TESTS[@]}"; do SY_CH_SKIP+=(--skip "$t"); done
  SY_CH_NOT_RUN=$(sy_ch_not_run)
}
