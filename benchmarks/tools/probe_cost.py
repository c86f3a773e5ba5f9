"""What the diagnostics probes cost on GPT-2 small (issue: ≤ 2% of step time at the default
interval). Times a compiled bf16 training micro-step and one ``probe_record`` call (defaults, and
with the δ analysis on one layer), then states the cost per step at probe_every=100 both for one
micro-batch per step and for the paper's 16 micro-batches per step. JSON to $OUT/probe_cost.json."""
import json
import os
import time

import torch

from stableflash.diagnostics.probes import probe_record
from stableflash.model import GPT, model_config
from stableflash.train.config import TrainConfig

dev = torch.device("cuda")
cfg = TrainConfig()
mcfg = model_config("gpt2-small")
torch.manual_seed(0)
model = GPT(mcfg, attention="sdpa").to(dev)
net = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
B = 16
x = torch.randint(0, mcfg.vocab_size, (B, mcfg.block_size), device=dev)
y = torch.randint(0, mcfg.vocab_size, (B, mcfg.block_size), device=dev)


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = net(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn, n):
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return sorted(out)[len(out) // 2]


for _ in range(5):
    step()
step_ms = timed(step, 20)
rows = {"model": "gpt2-small", "micro_batch": B, "probe_every": cfg.probe_every, "probe_seqs": cfg.probe_seqs,
        "step_ms": step_ms, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
for name, layers in (("probes (default)", ()), ("probes + δ analysis of layer 2", (2,))):
    def probe():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            probe_record(model, x, y, n_seq=cfg.probe_seqs, delta_layers=layers, delta_policy=cfg.delta_policy)
    probe()                                                   # first call: allocations, lazy inits
    ms = timed(probe, 5)
    rows[name] = {"probe_ms": ms, "cost_1_micro": ms / (cfg.probe_every * step_ms),
                  "cost_16_micro": ms / (cfg.probe_every * 16 * step_ms)}
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_cost.json"), "w"), indent=1)
print(f"GPT-2 small, micro-batch {B}x{mcfg.block_size}, compiled bf16 step: {step_ms:.1f} ms ({rows['gpu']})")
for name in ("probes (default)", "probes + δ analysis of layer 2"):
    r = rows[name]
    print(f"{name:34s} {r['probe_ms']:8.1f} ms per probe; at probe_every={cfg.probe_every}: "
          f"{r['cost_1_micro']:.2%} of step time (1 micro-batch/step), {r['cost_16_micro']:.3%} (16, the paper's)")
