"""import torch, init_process_group("gloo") via env://, one all_reduce, then exit 0."""

import time

T0 = time.time()

from _ev import emit  # noqa: E402

emit("start", T0)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

emit("imported")
dist.init_process_group("gloo")
emit("init_done")
x = torch.ones(1)
dist.all_reduce(x)
emit("ready", value=float(x.item()))
dist.destroy_process_group()
