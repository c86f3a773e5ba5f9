"""Cheap measurements taken during training (the paper's Figs. 3, 11 and 13).

- ``spectral_norm`` / ``weight_spectra``: the largest singular value of W_Q, W_K, W_V, W_O, whole
  and per head. In the failing BF16 run, W_Q's spectral norm grows in one layer before the loss
  explodes.
- ``row_max_stats``: how often a row's score maximum is attained more than once, how many P̄ round
  to exactly 1, and the largest logit, per head: the precondition of the biased rounding.
- ``AttentionProbe``: a context manager that records q, k (and v, the layer input x and dO) of every
  attention layer through the layers' ``observer`` hook.
- ``probe_record``: one JSON-serialisable record per probed training step, which leaves the model,
  its gradients and the RNG exactly as it found them.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Iterable

import torch

from stableflash.attention.policy import PrecisionPolicy, parse_point
from stableflash.attention.reference import causal_mask
from stableflash.attention.shift import ShiftRule
from stableflash.diagnostics.delta import delta_summary, policy_and_rule
from stableflash.numerics import round_to

__all__ = ["spectral_norm", "spectral_norms", "weight_spectra", "row_max_stats", "AttentionProbe", "probe_record"]

CHUNK_ELEMENTS = 1 << 25         # scores per chunk in row_max_stats (128 MiB of fp32)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BREAKDOWN = 1e-4                # a Krylov vector this small relative to its image spans nothing new


# ----------------------------------------------------------------------------- spectral norms

def _check_iters(iters: int) -> int:
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters={iters!r} is invalid; accepted: an int >= 1")
    return iters


def _start_vector(n: int, device: torch.device) -> torch.Tensor:
    """The deterministic start vector: ones/√n plus a fixed perturbation (0.1·sin(1 + i)/√n), so that
    it has a component along any top singular vector, even one orthogonal to the ones vector."""
    i = torch.arange(n, dtype=torch.float32, device=device)
    v = 1.0 + 0.1 * torch.sin(1.0 + i)
    return v / v.norm()


def spectral_norms(w: torch.Tensor, iters: int = 30) -> torch.Tensor:
    """σ_max of each matrix of a batch w (..., m, n), as a float64 tensor of shape (...).

    Power iteration on WᵀW (or WWᵀ, the smaller Gram matrix) in float32 from a fixed start vector,
    with σ_max read off the whole Krylov space of the iterates rather than the last one
    (Lanczos with full reorthogonalisation, Rayleigh–Ritz): the same ``iters`` matrix-vector
    products, but the estimate converges even when σ₁ ≈ σ₂, where 30 plain power steps miss a
    square Gaussian matrix's norm by ~2%. The estimate never exceeds σ_max (up to rounding).
    Matrices with non-finite entries give NaN; zero matrices give 0.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor; got {type(w).__name__}")
    if w.dtype not in _FLOAT_DTYPES or w.dim() < 2:
        raise ValueError(f"w must be a floating matrix (or batch of matrices), shape (..., m, n); "
                         f"got dtype {w.dtype}, shape {tuple(w.shape)}")
    iters = _check_iters(iters)
    a = w.detach().float()
    if a.shape[-2] < a.shape[-1]:
        a = a.transpose(-1, -2)                       # (..., m, p) with p ≤ m: iterate in R^p
    batch, (m, p) = a.shape[:-2], a.shape[-2:]
    if a.numel() == 0:
        return torch.zeros(batch, dtype=torch.float64, device=w.device)
    a = a.reshape(-1, m, p)
    finite = torch.isfinite(a).flatten(1).all(dim=1)
    a = torch.where(finite.view(-1, 1, 1), a, torch.zeros_like(a))
    basis = _krylov_basis(a, min(iters + 1, p))
    av = torch.bmm(a, basis).double()
    ritz = torch.linalg.eigvalsh(av.transpose(1, 2) @ av)[:, -1]
    sigma = ritz.clamp_min(0).sqrt()
    sigma = torch.where(finite, sigma, torch.full_like(sigma, math.nan))
    return sigma.reshape(batch)


def _krylov_basis(a: torch.Tensor, size: int) -> torch.Tensor:
    """(batch, p, size) orthonormal basis of span{v₀, AᵀA v₀, (AᵀA)² v₀, ...} for a (batch, m, p).

    Each new vector is AᵀA times the previous one, orthogonalised twice against all before it;
    where that leaves (almost) nothing, the space is invariant and the remaining columns are 0.
    """
    nb, _, p = a.shape
    basis = a.new_zeros(nb, p, size)
    v = _start_vector(p, a.device).expand(nb, p)
    basis[:, :, 0] = v
    for j in range(1, size):
        w = torch.bmm(a.transpose(1, 2), torch.bmm(a, v.unsqueeze(-1))).squeeze(-1)
        before = w.norm(dim=1)
        prev = basis[:, :, :j]
        for _ in range(2):                             # classical Gram-Schmidt, twice
            w = w - torch.bmm(prev, torch.bmm(prev.transpose(1, 2), w.unsqueeze(-1))).squeeze(-1)
        after = w.norm(dim=1, keepdim=True)
        fresh = after.squeeze(1) > _BREAKDOWN * before
        v = torch.where(fresh.unsqueeze(1), w / after.clamp_min(1e-30), torch.zeros_like(w))
        basis[:, :, j] = v
    return basis


def spectral_norm(w: torch.Tensor, iters: int = 30) -> float:
    """σ_max(w) = max ‖w x‖/‖x‖ of one matrix w (m, n), by power iteration (see ``spectral_norms``)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor; got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"w must be a matrix (2 dimensions); got shape {tuple(w.shape)}")
    return float(spectral_norms(w, iters))


def _norms_of(mats: list[torch.Tensor], iters: int) -> list[float]:
    """spectral norms of a list of matrices, batched over matrices of equal shape."""
    out: list[float] = [math.nan] * len(mats)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, m in enumerate(mats):
        by_shape.setdefault(tuple(m.shape), []).append(i)
    for idx in by_shape.values():
        norms = spectral_norms(torch.stack([mats[i] for i in idx]), iters).tolist()
        for i, s in zip(idx, norms):
            out[i] = s
    return out


def _attention_layers(model: Any) -> list:
    if not hasattr(model, "attention_layers"):
        raise TypeError(f"model={type(model).__name__} has no attention_layers(); accepted: a stableflash GPT "
                        "or any model whose attention_layers() returns modules with q_weight(), k_weight(), "
                        "v_weight(), o_weight(), n_head and observer")
    return list(model.attention_layers())


def weight_spectra(model: Any, iters: int = 30) -> dict[str, list]:
    """Spectral norms of every layer's W_Q, W_K, W_V, W_O, per head and whole.

    Head h owns rows h·hd:(h+1)·hd of W_Q, W_K, W_V (shape (hd, n_embd)) and the same columns of
    W_O. Returns {"q", "k", "v", "o": [[σ per head] per layer], "q_full", "k_full", "v_full",
    "o_full": [σ per layer]} as plain floats (NaN for non-finite weights). Duck-typed: any model
    whose ``attention_layers()`` give modules with ``n_head`` and q/k/v/o_weight() works.
    """
    iters = _check_iters(iters)
    layers = _attention_layers(model)
    heads: list[torch.Tensor] = []
    fulls: list[torch.Tensor] = []
    counts: list[tuple[int, int, int, int]] = []
    with torch.no_grad():
        for layer in layers:
            n_head = layer.n_head
            ws = [layer.q_weight(), layer.k_weight(), layer.v_weight(), layer.o_weight()]
            hd = ws[0].shape[0] // n_head
            per = []
            for kind, w in zip("qkvo", ws):
                w = w.detach()
                fulls.append(w)
                if kind == "o":                        # head h: columns h·hd:(h+1)·hd, transposed
                    blocks = list(w.T.reshape(-1, hd, w.shape[0]))
                else:                                  # head h: rows h·hd:(h+1)·hd
                    blocks = list(w.reshape(-1, hd, w.shape[1]))
                heads.extend(blocks)
                per.append(len(blocks))
            counts.append(tuple(per))
        head_norms = _norms_of(heads, iters)
        full_norms = _norms_of(fulls, iters)
    out: dict[str, list] = {key: [] for key in ("q", "k", "v", "o", "q_full", "k_full", "v_full", "o_full")}
    pos = 0
    for li, per in enumerate(counts):
        for j, (kind, n) in enumerate(zip("qkvo", per)):
            out[kind].append(head_norms[pos: pos + n])
            pos += n
            out[f"{kind}_full"].append(full_norms[4 * li + j])
    return out


# ----------------------------------------------------------------------------- row maxima

def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: float16, bfloat16, float32, float64")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seq, head_dim); got shape {tuple(t.shape)}")
    if (q.shape[0] != k.shape[0] or q.shape[1] % max(k.shape[1], 1) or q.shape[3] != k.shape[3]
            or min(q.shape[2], k.shape[2]) < 1):
        raise ValueError(f"q (B, H, T_q, d) and k (B, H_k, T_k, d) must share B and d, with H a multiple of H_k "
                         f"and T ≥ 1; got q={tuple(q.shape)}, k={tuple(k.shape)}")


def _check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps={eps!r} is invalid; accepted: a finite number >= 0")
    return float(eps)


def row_max_stats(q: torch.Tensor, k: torch.Tensor, *, causal: bool = True, scale: float | None = None,
                  eps: float = 1e-3, p_bar_format: str = "bf16") -> dict[str, torch.Tensor]:
    """Per head (float64 tensors of shape (H,)), over all batches and query rows of q, k (B, H, T, d)
    (k may have fewer heads, each shared by H / H_k query heads):

    S = q·kᵀ·scale in float32 (−inf where masked; causal is top-left aligned, so row i sees keys 0..i)
    and rm = rowmax(S);
    ``repeated_max_frac``: fraction of rows whose maximum is attained more than once,
    #{j : S_j ≥ rm − eps} > 1 (the test of attention/shift.py); row 0 of a causal row has one key
    and so one maximum;
    ``pbar_one_count``: mean over rows of #{j : round(exp(S_j − rm)) = 1} in ``p_bar_format``
    (a format name, optionally with ":mode");
    ``max_logit``: max of S over the visible entries;
    ``sink_frac``: fraction of the rows that see more than one key whose maximum is attained at key
    0, S_0 ≥ rm − eps (an attention sink on the first token, as the paper's Appendix D reports for
    Llama-3.1-8B); ``sink_repeated_frac``: of those rows, the fraction where the maximum at key 0 is
    also attained elsewhere (a sink that makes a repeated maximum), over the same rows.
    Query rows are processed in chunks of at most CHUNK_ELEMENTS scores (B·H·rows·T_k), so a
    GPT-2 layer with two sequences goes in one chunk (one pass of a few kernels, no host syncs).
    """
    _check_qk(q, k)
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} must be a bool")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale!r} is invalid; accepted: None (1/sqrt(head_dim)) or a finite number > 0")
    eps = _check_eps(eps)
    fmt, mode = parse_point(p_bar_format, "p_bar_format")
    below_one = 1.0 - 2.0 ** -(fmt.man_bits + 1)      # the largest value of fmt below 1
    B, H, n_q, _ = q.shape
    n_k = k.shape[2]
    if k.shape[1] != H:                                   # grouped-query attention: k shared by heads
        k = k.repeat_interleave(H // k.shape[1], dim=1)
    qf, kt = q.detach().float(), k.detach().float().transpose(-1, -2)
    repeated = torch.zeros(H, dtype=torch.float64, device=q.device)
    ones = torch.zeros(H, dtype=torch.float64, device=q.device)
    top = torch.full((H,), -math.inf, dtype=torch.float64, device=q.device)
    sinks, sink_ties, multi = (torch.zeros(H, dtype=torch.float64, device=q.device) for _ in range(3))
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        rows_per_chunk = max(1, CHUNK_ELEMENTS // (B * H * n_k))
        for i0 in range(0, n_q, rows_per_chunk):
            i1 = min(i0 + rows_per_chunk, n_q)
            s = torch.matmul(qf[:, :, i0:i1], kt) * scale                    # (B, H, c, n_k)
            if causal:
                mask = causal_mask(n_q, n_k, q.device)[i0:i1]
                s = s.masked_fill(mask, -math.inf)
            rm = s.amax(dim=-1, keepdim=True)
            valid = torch.isfinite(rm)
            ties = ((s >= rm - eps) & valid).sum(dim=-1)
            repeated += (ties > 1).sum(dim=(0, 2)).double()
            several = torch.isfinite(s).sum(dim=-1) > 1                      # rows that see two keys or more
            at_first = (s[..., 0] >= rm[..., 0] - eps) & several
            multi += several.sum(dim=(0, 2)).double()
            sinks += at_first.sum(dim=(0, 2)).double()
            sink_ties += (at_first & (ties > 1)).sum(dim=(0, 2)).double()
            p_bar = torch.exp(s - torch.where(valid, rm, torch.zeros_like(rm)))
            if mode == "rne":       # rounds to 1 exactly from the midpoint between below_one and 1 up
                hit = p_bar >= 1.0 - 2.0 ** -(fmt.man_bits + 2)
            else:
                near_one = p_bar >= below_one                                  # only these can round to 1
                hit = torch.zeros_like(near_one)
                hit[near_one] = round_to(p_bar[near_one], fmt, mode) == 1
            ones += hit.sum(dim=(0, 2, 3)).double()
            top = torch.maximum(top, torch.where(valid, rm, torch.full_like(rm, -math.inf)).amax(dim=(0, 2, 3)).double())
    rows = B * n_q
    return {"repeated_max_frac": repeated / rows, "pbar_one_count": ones / rows, "max_logit": top,
            "sink_frac": sinks / multi.clamp(min=1), "sink_repeated_frac": sink_ties / multi.clamp(min=1)}


# ----------------------------------------------------------------------------- the observer

def _check_n_seq(n_seq: int) -> int:
    if isinstance(n_seq, bool) or not isinstance(n_seq, int) or n_seq < 1:
        raise ValueError(f"n_seq={n_seq!r} is invalid; accepted: an int >= 1")
    return n_seq


def _check_layer_list(name: str, layers: Iterable[int], n_layers: int) -> tuple[int, ...]:
    try:
        out = tuple(layers)
    except TypeError:
        raise TypeError(f"{name}={layers!r} is invalid; accepted: a sequence of layer indices") from None
    bad = [i for i in out if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"{name}={out!r} holds {bad}; accepted: layer indices 0 to {n_layers - 1}")
    return tuple(sorted(set(out)))


class AttentionProbe:
    """Records what every attention layer of ``model`` sees, through the layers' ``observer`` hook.

    Inside ``with AttentionProbe(model, n_seq=2) as probe:`` each forward pass stores, per layer
    index (position in ``model.attention_layers()``), the detached q and k of the first ``n_seq``
    sequences, (B, H, T, hd), in ``probe.q`` and ``probe.k``; with ``keep_v`` also v in ``probe.v``.
    For the layers in ``grad_layers`` it also keeps v, the attention input x (B, T, C) in
    ``probe.x``, and registers a hook on the attention output y that stores dO = ∂loss/∂y in
    ``probe.do`` when a backward pass runs (``probe.outputs`` holds those y, for
    ``torch.autograd.grad``). A later forward overwrites the earlier one's records.

    While installed it replaces the layers' previous observers (they are not called); on exit,
    even after an exception, the previous observers are put back.
    """

    def __init__(self, model: Any, *, n_seq: int = 2, keep_v: bool = False, grad_layers: Iterable[int] = ()):
        self.model = model
        self.layers = _attention_layers(model)
        self.n_seq = _check_n_seq(n_seq)
        if not isinstance(keep_v, bool):
            raise TypeError(f"keep_v={keep_v!r} must be a bool")
        self.keep_v = keep_v
        self.grad_layers = _check_layer_list("grad_layers", grad_layers, len(self.layers))
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.x: dict[int, torch.Tensor] = {}
        self.do: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._saved: list | None = None

    def __enter__(self) -> "AttentionProbe":
        if self._saved is not None:
            raise RuntimeError("this AttentionProbe is already installed; it cannot be entered twice")
        self._saved = [layer.observer for layer in self.layers]
        try:
            for i, layer in enumerate(self.layers):
                layer.observer = partial(self._observe, i)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self._restore()
        return False

    def _restore(self) -> None:
        if self._saved is not None:
            for layer, observer in zip(self.layers, self._saved):
                layer.observer = observer
        self._saved = None
        self.outputs.clear()                           # drop the references to the autograd graph

    def _observe(self, index: int, module: Any, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, y: torch.Tensor) -> None:
        n = self.n_seq
        self.q[index] = q[:n].detach().clone()
        self.k[index] = k[:n].detach().clone()
        if self.keep_v or index in self.grad_layers:
            self.v[index] = v[:n].detach().clone()
        if index in self.grad_layers:
            self.x[index] = x[:n].detach().clone()
            self.do.pop(index, None)
            if y.requires_grad:
                self.outputs[index] = y
                y.register_hook(partial(self._store_do, index))

    def _store_do(self, index: int, grad: torch.Tensor) -> None:
        self.do[index] = grad[: self.n_seq].detach().clone()

    def row_stats(self, eps: float = 1e-3, p_bar_format: str = "bf16",
                  scale: float | None = None) -> dict[str, list[list[float]]]:
        """``row_max_stats`` of every recorded layer (causal): {"repeated_max_frac", "pbar_one_count",
        "max_logit", "sink_frac", "sink_repeated_frac": [[value per head] per layer]}, plain floats."""
        missing = [i for i in range(len(self.layers)) if i not in self.q]
        if missing:
            raise RuntimeError(f"no forward pass recorded for layers {missing}; run the model inside the probe first")
        out: dict[str, list[list[float]]] = {}
        for i in range(len(self.layers)):
            stats = row_max_stats(self.q[i], self.k[i], causal=True, scale=scale, eps=eps,
                                  p_bar_format=p_bar_format)
            for key, per_head in stats.items():          # every statistic row_max_stats returns
                out.setdefault(key, []).append(per_head.tolist())
        return out


# ----------------------------------------------------------------------------- one record per step

def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _jsonable(obj: Any) -> Any:
    """obj with every non-finite float replaced by None (JSON has no NaN or infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _jsonable(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(value) for value in obj]
    return obj


def probe_record(model: Any, x: torch.Tensor, y: torch.Tensor | None, *, n_seq: int = 2, eps: float = 1e-3,
                 delta_layers: Iterable[int] = (), delta_policy: PrecisionPolicy | str = "paper",
                 delta_rule: ShiftRule | str = "standard", p_bar_format: str = "bf16", iters: int = 30) -> dict:
    """One JSON-serialisable record of a training step's attention numerics:

    {"n_seq": int, "seq_len": int,
     "spectral": weight_spectra(model, iters),
     "row": AttentionProbe.row_stats(eps, p_bar_format) on the first ``n_seq`` sequences of x,
     "delta": {str(layer): delta_summary(q, k, v, dO, policy=delta_policy, rule=delta_rule)}}

    It runs the model (in eval mode: no dropout) on x[:n_seq] with an AttentionProbe installed;
    if ``delta_layers`` is non-empty, with targets y[:n_seq] and ∂loss/∂y of those layers' attention
    outputs by ``torch.autograd.grad`` (dO of the mean loss over the n_seq sequences), so no
    parameter's ``.grad`` is touched. Autocast is whatever the caller has active. Afterwards it
    restores every module's training flag, every parameter's ``.grad`` (tensor or None, the same
    objects), and the CPU and CUDA RNG states, even after an exception: training runs bit for bit
    the same with or without probes. Non-finite floats are written as None.
    """
    layers = _attention_layers(model)
    n_seq = _check_n_seq(n_seq)
    eps = _check_eps(eps)
    parse_point(p_bar_format, "p_bar_format")
    iters = _check_iters(iters)
    delta_layers = _check_layer_list("delta_layers", delta_layers, len(layers))
    policy_and_rule(delta_policy, delta_rule, torch.float32)
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a (batch, T) tensor of token ids; got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if delta_layers and not isinstance(y, torch.Tensor):
        raise ValueError(f"y={y!r} is invalid with delta_layers={delta_layers}; accepted: the targets tensor "
                         "(the δ analysis needs dO from a backward pass)")
    grads = [(p, p.grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    rng = _rng_state()
    try:
        model.eval()
        xs = x[:n_seq]
        with AttentionProbe(model, n_seq=n_seq, grad_layers=delta_layers) as probe:
            if delta_layers:
                with torch.enable_grad():
                    _, loss = model(xs, y[:n_seq])
                    missing = [i for i in delta_layers if i not in probe.outputs]
                    if missing:
                        raise ValueError(f"delta_layers={delta_layers}: the attention outputs of layers {missing} "
                                         "do not require grad; accepted: layers whose parameters require grad")
                    torch.autograd.grad(loss, [probe.outputs[i] for i in delta_layers])   # hooks store dO
            else:
                with torch.no_grad():
                    model(xs)
        record = {
            "n_seq": int(xs.shape[0]),
            "seq_len": int(xs.shape[1]),
            "spectral": weight_spectra(model, iters),
            "row": probe.row_stats(eps, p_bar_format),
            "delta": {str(i): delta_summary(probe.q[i], probe.k[i], probe.v[i], probe.do[i], policy=delta_policy,
                                            rule=delta_rule, causal=True) for i in delta_layers},
        }
    finally:
        for module, training in modes:
            module.training = training
        for p, g in grads:
            p.grad = g
        _set_rng_state(rng)
    return _jsonable(record)
