"""Preloaded by test_numa_binding.py: the CPUs the interpreter could run on when it imported
this module, as a library sizing its thread pool at import (OpenMP) would see them."""

import os

CPUS = sorted(os.sched_getaffinity(0))
