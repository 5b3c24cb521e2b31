#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what the tests need, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
# System parts the tests start for real: Chromium + ChromeDriver (the dashboard test), etcd,
# Slurm and munge (test_slurm.py: a controller and two nodes in network namespaces).
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
command -v etcd >/dev/null || need+=(etcd-server)
PATH="$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null || need+=(slurmctld)
PATH="$PATH:/usr/sbin:/sbin" command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
PATH="$PATH:/usr/sbin:/sbin" command -v munged >/dev/null || need+=(munge)
if [ "${#need[@]}" -gt 0 ]; then
  echo "installing ${need[*]} (Debian packages)" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# compat: a plain path entry in a .pth; the default editable finder adds ~12 ms to every Python
# process of the venv (agents and workers), which the start-up benchmarks would count.
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]' --config-settings editable_mode=compat 2> >(grep -v "^WARNING: Location" >&2)
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff . | head -40; exit 1; }
.venv/bin/mypy  # the packages, as [tool.mypy] in pyproject.toml says
# The tiers in order, failing fast (tests/conftest.py sets them): the unit tier first, in one
# process (CPU-bound: about a minute); then proc and e2e in parallel, since most of their time
# is waiting on processes (joins, timeouts, start-ups); then the soak campaigns, alone. With
# arguments, one plain pytest run of them.
run() {
  set +e
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    exit 1
  fi
  [ "$rc" -eq 0 ] || exit "$rc"
}
if [ "$#" -gt 0 ]; then
  run "$@"
  exit 0
fi
run -m unit --durations=15
run -m "proc or e2e" -n "${TEST_WORKERS:-4}" --dist loadgroup --durations=25
# The soak campaigns stress a live server or a whole job on purpose: alone, not beside others.
run -m soak --durations=5
