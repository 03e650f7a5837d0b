"""Does a second torch.profiler session in one process record GPU activity after a first one
stopped (kineto's TEARDOWN_CUPTI on or off), started from a plain loop or from inside an
optimizer's step post-hook (where ``kasoku profile -- python SCRIPT.py`` steps its window)?

    python research/probes/cupti_second_session.py {loop,hook}

Prints the number of kernels each session's trace holds.
"""
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, schedule

where = sys.argv[1]
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), fused=True)
x = torch.randn(64, 512, device="cuda")
traces = []
state = {"n": 0, "prof": None, "work": None}
ACT = [ProfilerActivity.CPU, ProfilerActivity.CUDA]


def kernels(path):
    ev = json.load(open(path))["traceEvents"]
    return sum(1 for e in ev if e.get("cat") == "kernel")


def boundary():
    n = state["n"] = state["n"] + 1
    if n == 3:
        state["prof"] = profile(activities=ACT, schedule=schedule(wait=0, warmup=1, active=3),
                                on_trace_ready=lambda p: p.export_chrome_trace(f1))
        state["prof"].__enter__()
    elif state["prof"] is not None:
        state["prof"].step()
        if n == 7:
            torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)
            state["prof"] = None
            state["work"] = profile(activities=ACT, record_shapes=True)
            state["work"].__enter__()
    elif state["work"] is not None and n == 8:
        torch.cuda.synchronize()
        state["work"].__exit__(None, None, None)
        state["work"].export_chrome_trace(f2)
        state["work"] = None


d = tempfile.mkdtemp()
f1, f2 = os.path.join(d, "a.json"), os.path.join(d, "b.json")
if where == "hook":
    opt.register_step_post_hook(lambda o, a, k: boundary())
for _ in range(12):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if where == "loop":
        boundary()
print(where, "TEARDOWN_CUPTI", os.environ.get("TEARDOWN_CUPTI"), "kernels:", kernels(f1), kernels(f2))
