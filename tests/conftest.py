"""The suite's tiers, set in one place (``pytest -m unit`` is the inner loop):

- ``unit``: pure or in-process, no child process and no socket: the wire, the machines, the
  command lines, GPUs and NUMA on fake sysfs trees, history, status, snapshots, the journal.
- ``proc``: files under the unit folders that start processes or open sockets (real workers,
  real servers on loopback, Chromium, a subprocess's import check).
- ``e2e``: real programs together: ``tests/integration/`` (less the soak runs), the deploy
  files, the benchmarks' smoke run, the wheel installed outside the checkout.
- ``soak``: long randomised campaigns: the chaos campaign, the server fuzzer, the model-based
  test of the server machine.

``scripts/test.sh`` runs them in that order, failing fast; ``proc`` and ``e2e`` together in
parallel (``pytest-xdist``, ``--dist loadgroup``), since their time is mostly waiting on
processes; ``soak`` alone (its campaigns load a live server or a job on purpose, and judge
what it does under that load). Tests that share a machine-wide resource are one
``xdist_group`` (network namespaces and the Slurm cluster in them), so they never run at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent

# Files under tests/{protocol,edge,node_agent,rdzv_server} that start processes or open sockets.
PROC = {
    "edge/test_tls.py",
    "node_agent/cli/test_args.py",
    "node_agent/cli/test_rdzv_conf_unknown.py",
    "node_agent/cli/test_tls_args.py",
    "node_agent/gpu/test_gpu_health.py",
    "node_agent/gpu/test_gpus.py",
    "node_agent/gpu/test_gpus_amd_intel.py",
    "node_agent/machine/test_commit_agent.py",
    "node_agent/machine/test_page_values.py",
    "node_agent/progress/test_should_stop.py",
    "node_agent/progress/test_stacks.py",
    "node_agent/progress/test_worker_page.py",
    "node_agent/rdzv/test_client.py",
    "node_agent/rdzv/test_etcd_log.py",
    "node_agent/rdzv/test_rdzv.py",
    "node_agent/rdzv/test_static_ranks.py",
    "node_agent/rdzv/test_takeover.py",
    "node_agent/snapshots/test_channel.py",
    "node_agent/snapshots/test_replica_tls.py",
    "node_agent/snapshots/test_restore_fetch.py",
    "node_agent/store/test_store_env.py",
    "node_agent/store/test_store_host.py",
    "node_agent/supervisor/test_signal_witness.py",
    "node_agent/supervisor/test_supervisor.py",
    "node_agent/supervisor/test_warm.py",
    "node_agent/test_api.py",
    "node_agent/test_elastic_launch.py",
    "node_agent/test_liveness.py",
    "node_agent/test_runner.py",
    "node_agent/test_runtime_dir.py",
    "node_agent/test_worker_env.py",
    "node_agent/worker/test_dcp_snapshots_gloo.py",
    "node_agent/worker/test_snapshot_callback_rules.py",
    "node_agent/worker/test_snapshot_import.py",
    "rdzv_server/test_auth.py",
    "rdzv_server/test_cli.py",
    "rdzv_server/test_dashboard.py",
    "rdzv_server/test_http.py",
    "rdzv_server/test_journal.py",
    "rdzv_server/test_limits.py",
    "rdzv_server/test_listeners.py",
    "rdzv_server/test_progress_surfaces.py",
    "rdzv_server/test_service.py",
    "rdzv_server/test_service_faults.py",
    "rdzv_server/test_tls.py",
    "rdzv_server/test_untrusted_values.py",
}
SOAK = {
    "integration/test_chaos.py",
    "integration/test_server_fuzz.py",
    "rdzv_server/test_model.py",
}
E2E_TOP = {"test_deploy.py", "test_bench_smoke.py", "test_fresh_install.py"}
# One machine-wide resource each: never two of a group at once under xdist.
GROUPS = {
    "integration/test_multihost.py": "netns",
    "integration/test_loopback_endpoint.py": "netns",
    "integration/test_slurm.py": "netns",
    # One build and install of the wheel and sdist (its module fixture) for both tests, not one
    # per xdist worker that happens to take one of them (27 s each).
    "test_fresh_install.py": "fresh_install",
}
TIERS = ("unit", "proc", "e2e", "soak")


def tier_of(rel: str) -> str:
    if rel in SOAK:
        return "soak"
    if rel.startswith("integration/") or rel in E2E_TOP:
        return "e2e"
    if rel in PROC:
        return "proc"
    return "unit"


# First: xdist's own hook (on each worker) reads the xdist_group marks into the node ids that
# --dist loadgroup schedules by; run after it, a group mark here is silently ignored.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = Path(item.fspath).resolve().relative_to(HERE).as_posix()
        item.add_marker(getattr(pytest.mark, tier_of(rel)))
        group = GROUPS.get(rel)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup`` every grouped test's id must carry its group (``@name``), or
    xdist spreads the group over workers at once: pytest 9.2 keeps node ids where xdist 3.8
    cannot add it, and nothing said so (the netns and fresh-install tests ran side by side)."""
    if not session.config.getoption("loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"--dist loadgroup would not group {len(lost)} tests (e.g. {lost[0]}): "
            "check the pytest and pytest-xdist pins"
        )
