"""The paper's mechanism (Claims 1-3) measured at the kernel level on synthetic inputs.

GPT-2's failing layer had rows whose score maximum is attained by several keys, a feature of V
that is mostly negative, and an upstream gradient dO sharing the sign of the output error. We
build inputs with exactly that, plus two variations (the tied keys split across key blocks, and a
control whose maxima are unique), run the emulated flash attention under a policy and a
row-maximum rule, and compare with float64:

- fraction of P̄ entries exactly 1 after rounding to the P̄ format;
- mean signed error of Ō (against exp(S − m)·V with the kernel's own m) and of O, in ulps of the
  output format, over the negative features of V;
- δ_lp − δ_hp with δ = rowsum(dO ∘ O): its mean per token, its sum over the tokens of a sequence
  (averaged over sequences and heads), and the t-statistic of the mean (how many standard errors
  it lies from zero, over independent groups of rows).
"""
from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass

import torch

from stableflash.attention import reference
from stableflash.attention.emulated import emulated_forward
from stableflash.attention.policy import PrecisionPolicy
from stableflash.attention.shift import RULES, ShiftRule
from stableflash.numerics import get_format, round_to, ulp

INPUTS = ("tied", "tied-split", "control")
POLICIES = ("paper", "fa2")
RULE_KINDS = RULES


@dataclass(frozen=True)
class ProbeConfig:
    """Sizes and knobs of the probe; the defaults run in well under a minute on 2 CPU cores."""

    batch: int = 4
    heads: int = 8
    seq_len: int = 512
    head_dim: int = 64
    groups: int = 8
    ties: int = 2
    block_size: int = 64
    max_logit: float = 14.0
    beta: float = 2.0
    eps: float = 1e-3
    seed: int = 0
    low: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq_len", "head_dim", "groups", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; accepted: a positive int")
        if self.head_dim < self.groups + 1:
            raise ValueError(f"head_dim={self.head_dim} is invalid for groups={self.groups}; accepted: "
                             "head_dim > groups (one feature of q and k routes each group)")
        if not 2 <= self.ties <= self.block_size:
            raise ValueError(f"ties={self.ties} is invalid; accepted: 2 to block_size ({self.block_size})")
        if self.groups * self.ties > self.seq_len:
            raise ValueError(f"groups × ties = {self.groups * self.ties} tied keys do not fit in "
                             f"seq_len={self.seq_len}; accepted: groups × ties <= seq_len")
        if not (math.isfinite(self.max_logit) and self.max_logit > 0):
            raise ValueError(f"max_logit={self.max_logit!r} is invalid; accepted: a finite number > 0")
        ShiftRule("paper", self.beta, self.eps)        # validates beta and eps
        get_format(self.low)


def make_inputs(cfg: ProbeConfig, kind: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """q, k, v, dO in float32 holding values of the low format, shape (B, H, N, d).

    The queries of each head fall into ``groups`` groups (query i in group i mod groups). Feature
    g of q and k routes group g: its queries have q_g = 1, and ``ties`` keys share one vector k*
    with k*_g = max_logit/scale, so that every query of the group scores exactly the same value,
    about ``max_logit``, on those keys: a row maximum attained ``ties`` times. Ordinary keys score
    near 0, so P̄ elsewhere is about exp(−max_logit): the small same-sign residue of the paper's
    worked example. "tied" puts a group's tied keys in one key block, "tied-split" in different
    key blocks (needs ties ≤ number of blocks), "control" lowers all but one copy by a random gap
    in [0.5, 3] so that every maximum is unique. V's features 0..d/2−1 are negative
    (−1 − |N(0,1)|), the rest N(0,1); dO is negative in the same features.
    """
    B, H, N, d, G = cfg.batch, cfg.heads, cfg.seq_len, cfg.head_dim, cfg.groups
    g = generator
    scale = d ** -0.5

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    q = randn(B, H, N, d) * 0.3
    q[..., :G] = 0.0
    q[..., torch.arange(N), torch.arange(N) % G] = 1.0
    k = randn(B, H, N, d) * 0.3
    k[..., :G] = 0.0
    k_star = randn(B, H, G, d) * 0.3                   # one shared key vector per group
    k_star[..., :G] = 0.0
    k_star[..., torch.arange(G), torch.arange(G)] = cfg.max_logit / scale
    positions = _tie_positions(cfg, kind == "tied-split", g)          # (B, H, G, ties)
    for t in range(cfg.ties):
        key = k_star.clone()
        if kind == "control" and t > 0:
            gap = 0.5 + 2.5 * torch.rand(B, H, G, generator=g)
            key[..., torch.arange(G), torch.arange(G)] -= gap / scale
        k.scatter_(2, positions[..., t].unsqueeze(-1).expand(B, H, G, d), key)
    neg = slice(0, d // 2)
    v = randn(B, H, N, d)
    v[..., neg] = -1.0 - randn(B, H, N, d // 2).abs()
    do = randn(B, H, N, d)
    do[..., neg] = -randn(B, H, N, d // 2).abs()
    low = get_format(cfg.low)
    return {name: round_to(t, low) for name, t in (("q", q), ("k", k), ("v", v), ("do", do))}


def _tie_positions(cfg: ProbeConfig, split: bool, g: torch.Generator) -> torch.Tensor:
    """(B, H, groups, ties) distinct key positions: each group's tied keys in one key block, or
    (``split``) each in a different key block."""
    N, bs = cfg.seq_len, cfg.block_size
    n_blocks = math.ceil(N / bs)
    if split and cfg.ties > n_blocks:
        raise ValueError(f"ties={cfg.ties} cannot be split over {n_blocks} key blocks; accepted: "
                         "ties <= seq_len / block_size")
    out = torch.empty(cfg.batch, cfg.heads, cfg.groups, cfg.ties, dtype=torch.int64)
    for b in range(cfg.batch):
        for h in range(cfg.heads):
            free = [(blk * bs + torch.randperm(min(bs, N - blk * bs), generator=g)).tolist()
                    for blk in range(n_blocks)]
            for grp in range(cfg.groups):
                order = torch.randperm(n_blocks, generator=g).tolist()
                if split:
                    blocks = [blk for blk in order if free[blk]][: cfg.ties]
                else:
                    blocks = [next(blk for blk in order if len(free[blk]) >= cfg.ties)] * cfg.ties
                if len(blocks) < cfg.ties:
                    raise ValueError(f"groups={cfg.groups}, ties={cfg.ties} do not fit in seq_len={N}")
                out[b, h, grp] = torch.tensor([free[blk].pop() for blk in blocks])
    return out


def measure(inputs: dict[str, torch.Tensor], policy: PrecisionPolicy, rule: ShiftRule,
            cfg: ProbeConfig) -> dict[str, float]:
    """One row of the probe table: run the kernel, compare with float64.

    Rows of one group share their tied keys, so their errors are correlated; the t-statistic is
    taken over the (sequence, head, group) means, which are independent.
    """
    q, k, v, do = inputs["q"], inputs["k"], inputs["v"], inputs["do"]
    scale = cfg.head_dim ** -0.5
    res = emulated_forward(q, k, v, causal=False, scale=scale, policy=policy, rule=rule,
                           block_q=cfg.block_size, block_k=cfg.block_size)
    out_fmt = policy.point("out")[0]
    obar_hp, _ = reference.unnormalized(q, k, v, res.shift, scale=scale)
    o_hp = reference.attention(q, k, v, scale=scale)
    neg = slice(0, cfg.head_dim // 2)
    obar_err = ((res.acc.double() - obar_hp) / ulp(obar_hp, out_fmt))[..., neg]
    o_err = ((res.out.double() - o_hp) / ulp(o_hp, out_fmt))[..., neg]
    d_err = (do * res.out).sum(-1).double() - reference.delta(o_hp, do)     # δ_lp − δ_hp per token
    B, H, N = d_err.shape
    G = cfg.groups
    unit = d_err.view(B, H, N // G, G).mean(2) if N % G == 0 else \
        torch.stack([d_err[..., i::G].mean(-1) for i in range(G)], -1)
    n = unit.numel()
    return {
        "pbar_one_frac": res.pbar_ones.sum().item() / (d_err.numel() * k.shape[2]),
        "rows_with_repeated_pbar_one": (res.pbar_ones > 1).double().mean().item(),
        "obar_err_ulp": obar_err.mean().item(),
        "o_err_ulp": o_err.mean().item(),
        "delta_err_mean": d_err.mean().item(),
        "delta_err_sum_per_seq": d_err.sum(-1).mean().item(),
        "delta_err_t": (unit.mean() / (unit.std() / math.sqrt(n))).item() if n > 1 else 0.0,
        "nonfinite_outputs": int((~torch.isfinite(res.out)).sum().item()),
    }


# "paper" policy variants with single rounding points raised to fp32: where does the bias live?
ABLATIONS = {"paper": {}, "paper, row_sum fp32": {"row_sum": "fp32"}, "paper, acc fp32": {"acc": "fp32"},
             "paper, acc+row_sum fp32": {"acc": "fp32", "row_sum": "fp32"},
             "paper, scores fp32": {"scores": "fp32"}, "paper, p_bar fp32": {"p_bar": "fp32"}}


def run_probe(cfg: ProbeConfig = ProbeConfig(), progress: bool = False, ablate: bool = False) -> dict:
    """Every (policy, rule, input) combination; returns a JSON-serialisable dict.

    With ``ablate``, also the tied inputs under each variant of ``ABLATIONS`` (key "ablation").
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    g = torch.Generator().manual_seed(cfg.seed)
    inputs = {kind: make_inputs(cfg, kind, g) for kind in INPUTS}
    policies = {name: PrecisionPolicy.preset(name, low=cfg.low) for name in POLICIES}
    combos = [(p, r, i) for p in POLICIES for r in RULE_KINDS for i in INPUTS]
    if ablate:
        base = PrecisionPolicy.preset("paper", low=cfg.low)
        policies.update({name: base.replace(**change) for name, change in ABLATIONS.items() if change})
        combos += [(p, r, "tied") for p in ABLATIONS if p != "paper" for r in RULE_KINDS]
    rows = []
    for pol_name, rule_kind, kind in tqdm(combos, desc="probe", disable=not progress, leave=False):
        rule = ShiftRule(rule_kind, cfg.beta, cfg.eps)
        rows.append({"policy": pol_name, "rule": rule_kind, "inputs": kind,
                     **measure(inputs[kind], policies[pol_name], rule, cfg)})
    return {
        "config": asdict(cfg),
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 2),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def format_table(result: dict) -> str:
    """The probe's rows as a terminal table (rich), with a one-line legend."""
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    table = Table(title=f"stableflash probe — {cfg['low']}, B={cfg['batch']} H={cfg['heads']} "
                        f"N={cfg['seq_len']} d={cfg['head_dim']}, {cfg['groups']} groups × {cfg['ties']} "
                        f"tied maxima ≈ {cfg['max_logit']}, key block {cfg['block_size']}, "
                        f"β={cfg['beta']}, seed {cfg['seed']}")
    for col, justify in (("policy", "left"), ("rule", "left"), ("inputs", "left"), ("P̄=1 frac", "right"),
                         ("Ō err (ulp)", "right"), ("O err (ulp)", "right"), ("mean δ_lp−δ_hp", "right"),
                         ("Σ_T per seq", "right"), ("t", "right")):
        table.add_column(col, justify=justify)
    last = None
    for r in result["rows"]:
        if last is not None and (r["policy"], r["rule"]) != last:
            table.add_section()
        last = (r["policy"], r["rule"])
        table.add_row(r["policy"], r["rule"], r["inputs"], f"{r['pbar_one_frac']:.5f}",
                      f"{r['obar_err_ulp']:+.4f}", f"{r['o_err_ulp']:+.4f}", f"{r['delta_err_mean']:+.3e}",
                      f"{r['delta_err_sum_per_seq']:+.3e}", f"{r['delta_err_t']:+.1f}")
    console = Console(width=140, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(table)
        console.print("Ō and O errors: mean signed error on V's negative features against float64, in ulps "
                      "of the output format.\nt: the mean δ error in standard errors over independent row "
                      f"groups (|t| > 5: a clear bias). Finished in {result['seconds']} s.")
    return cap.get()
