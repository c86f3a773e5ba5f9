"""Where a diagnostics probe's time goes on GPT-2 small (GPU): torch.profiler over one
``probe_record`` call after a warm-up call; the top operators by self CPU and by CUDA time."""
import os

import torch
from torch.profiler import ProfilerActivity, profile

from stableflash.diagnostics.probes import probe_record, weight_spectra
from stableflash.model import GPT, model_config

dev = torch.device("cuda")
torch.manual_seed(0)
model = GPT(model_config("gpt2-small"), attention="sdpa").to(dev)
x = torch.randint(0, 50257, (2, 1024), device=dev)
for _ in range(2):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        probe_record(model, x, x, n_seq=2)
torch.cuda.synchronize()
for name, fn in (("weight_spectra", lambda: weight_spectra(model)),
                 ("probe_record", lambda: probe_record(model, x, x, n_seq=2))):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    open(os.path.join(os.environ.get("OUT", "/tmp"), f"profile-{name}.txt"), "w").write(table)
    print(name)
    print(table[-3000:])
