"""Side-by-side benchmarks of node-agent/rdzv-server and torchrun: ``python -m bench``.

procs.py         processes of one trial: launch stamps, polling, /proc readings, cleanup by tag
launch_cases.py  cases 1-6, the same worker scripts under both launchers
scale.py         case 7, simulated agents against one rdzv-server (ours alone)
simagents.py     the simulated-agent client process
report.py        statistics, docs/benchmarks.md and docs/rendezvous_scale.png
workers/         the worker scripts; each stamps time.time() as its first statement
"""
