"""δ = rowsum(dO ∘ O) under low precision: the analysis behind the paper's Claims 1-3.

The backward pass of flash attention forms dS = P ∘ (dP − δ) with δ_T = Σ_i dO_Ti·O_Ti. When O is
the low-precision output O_lp instead of the exact O_hp, δ carries the error

    δ_lp − δ_hp = Σ_i dO_Ti·(O_lp − O_hp)_Ti,

which is biased when dO and the output error share their sign in some features (Claim 2). That
error reaches W_Q's gradient as a sum over tokens of rank-1 terms (Claim 1):

    ΔdW_Q = α·Σ_T (δ_lp − δ_hp)[T]·(PK)[T] ⊗ X[T],   α = −scale,

and the rank-1 terms (PK)[T] ⊗ X[T] of different tokens point in similar directions, so a biased
δ error accumulates instead of cancelling. The output error itself comes from rows whose maximum is
attained several times (Claim 3): several P̄ = 1 terms add same-sign low-precision values of V, and
a small same-sign residue breaks every rounding tie the same way; `obar_running_error` follows
that accumulation key by key for one row.

Everything here runs the emulated kernel (``stableflash.attention.emulated``) under a
PrecisionPolicy and a ShiftRule and compares with the float64 reference on the same rounded inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from stableflash.attention import reference
from stableflash.attention.emulated import emulated_delta, emulated_forward
from stableflash.attention.policy import PRESETS, PrecisionPolicy, resolve_policy
from stableflash.attention.shift import RULES, ShiftRule
from stableflash.numerics import round_to

__all__ = ["delta_errors", "sign_agreement", "summarize_delta_errors", "delta_summary", "DeltaTracker", "obar_running_error",
           "policy_and_rule", "attention_probs", "rank1_terms", "rank1_cosine", "mean_offdiag", "delta_gradient_error"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------- argument checks

def _check_tensor(name: str, t: object, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; accepted: float16, bfloat16, float32, float64")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions; got shape {tuple(t.shape)}")
    return t


def policy_and_rule(policy: PrecisionPolicy | str | None, rule: ShiftRule | str,
             dtype: torch.dtype) -> tuple[PrecisionPolicy, ShiftRule]:
    """(PrecisionPolicy, ShiftRule) from a preset name or object; a preset is built for ``dtype``
    (fp16 inputs get low = fp16, others bf16), as ``flash_attention`` does."""
    if isinstance(policy, str) and policy not in PRESETS:
        raise ValueError(f"policy={policy!r} is not a preset; accepted: {', '.join(PRESETS)} or a PrecisionPolicy")
    if policy is not None and not isinstance(policy, (str, PrecisionPolicy)):
        raise TypeError(f"policy={policy!r} is invalid; accepted: a PrecisionPolicy or one of {', '.join(PRESETS)}")
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"rule={rule!r} is not a rule; accepted: {', '.join(RULES)} or a ShiftRule")
        rule = ShiftRule(rule)
    elif not isinstance(rule, ShiftRule):
        raise TypeError(f"rule={rule!r} is invalid; accepted: a ShiftRule or one of {', '.join(RULES)}")
    return resolve_policy(policy, dtype), rule


def _check_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale={scale!r} is invalid; accepted: None (1/sqrt(head_dim)) or a finite number > 0")
    return float(scale)


def _check_block(block: int) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block={block!r} is invalid; accepted: a positive int")
    return block


def _round_inputs(policy: PrecisionPolicy, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the policy's compute dtype, rounded to its ``inputs`` format, as the kernel sees them."""
    fmt, mode = policy.point("inputs")
    return tuple(round_to(t.detach().to(policy.compute_dtype), fmt, mode) for t in tensors)


# ----------------------------------------------------------------------------- δ errors (Claim 2)

def delta_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                 policy: PrecisionPolicy | str = "paper", rule: ShiftRule | str = "standard",
                 causal: bool = True, scale: float | None = None, block: int = 64) -> dict[str, torch.Tensor]:
    """δ_lp − δ_hp and the output error behind it, for q, k, v, dO of shape (B, H, T, d).

    q, k, v, dO are first rounded to the policy's ``inputs`` format (the values the kernel sees).
    O_lp is the emulated kernel's stored output (``emulated_forward`` with tiles of ``block``),
    O_hp = softmax(QKᵀ·scale)·V in float64 on the same rounded inputs.
    δ_lp is the kernel's δ (for the usual source "dO·O": rowsum(dO ∘ O_lp) in the compute dtype,
    float32 for the low-precision presets; the policy's "dP·P" or "recompute_fp32" sources are
    honoured), δ_hp = rowsum(dO ∘ O_hp) in float64.

    Returns float64 tensors:
    ``per_token`` (B, H, T) = δ_lp − δ_hp; ``sum_over_tokens`` (B, H) = Σ_T (δ_lp − δ_hp);
    ``output_error`` (B, H, T, d) = O_lp − O_hp; ``sign_agreement`` (H, d) = fraction of the
    (batch, token) positions where sign(dO) = sign(O_lp − O_hp), over positions where neither is
    exactly 0 (NaN where there is none); and ``delta_lp``, ``delta_hp`` (B, H, T).
    k and v may have fewer heads, each shared by H / H_k query heads (grouped-query attention).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do)):
        _check_tensor(name, t, 4)
    if (k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1] or q.shape[3] != k.shape[3]):
        raise ValueError(f"k and v must have one shape (B, H_k, T_k, d) matching q's batch and head_dim, with "
                         f"q's heads a multiple of H_k; got q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}")
    if k.shape[1] != q.shape[1]:                          # grouped-query attention: one K/V head per group
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    if do.shape != q.shape:
        raise ValueError(f"do must have q's shape {tuple(q.shape)}; got {tuple(do.shape)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} must be a bool")
    pol, shift_rule = policy_and_rule(policy, rule, q.dtype)
    scale = _check_scale(scale, q.shape[-1])
    block = _check_block(block)
    q_r, k_r, v_r, do_r = _round_inputs(pol, q, k, v, do)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        res = emulated_forward(q_r, k_r, v_r, causal=causal, scale=scale, policy=pol, rule=shift_rule,
                               block_q=block, block_k=block)
        delta_lp = emulated_delta(q_r, k_r, v_r, res.out, res.lse, do_r, causal=causal, scale=scale,
                                  policy=pol, block_q=block, block_k=block)
        o_hp = reference.attention(q_r, k_r, v_r, causal=causal, scale=scale)
        delta_hp = reference.delta(o_hp, do_r)
        output_error = res.out.double() - o_hp
        per_token = delta_lp.double() - delta_hp
    return {
        "per_token": per_token,
        "sum_over_tokens": per_token.sum(dim=-1),
        "output_error": output_error,
        "sign_agreement": sign_agreement(do_r, output_error),
        "delta_lp": delta_lp.double(),
        "delta_hp": delta_hp,
    }


def sign_agreement(do: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """(H, d): fraction of (batch, token) positions with sign(dO) = sign(err), both nonzero.

    do, err: (B, H, T, d). NaN for a (head, feature) without any such position.
    """
    valid = (do != 0) & (err != 0)
    agree = valid & (torch.sign(do.double()) == torch.sign(err.double()))
    n_valid = valid.sum(dim=(0, 2)).double()
    return agree.sum(dim=(0, 2)).double() / n_valid          # 0/0 → NaN


def _json_float(x: float) -> float | None:
    """x as a float, or None where it is not finite (JSON has no NaN)."""
    x = float(x)
    return x if math.isfinite(x) else None


def summarize_delta_errors(errors: dict[str, torch.Tensor]) -> dict:
    """The JSON-friendly summary of a ``delta_errors`` result (floats and lists; None for NaN):

    ``per_token_mean``: mean over (B, H, T) of δ_lp − δ_hp; ``per_token_abs_mean``;
    ``sum_over_tokens``: Σ_T (δ_lp − δ_hp) averaged over (B, H);
    ``sum_over_tokens_per_head``: the same averaged over B only (H values);
    ``sign_agreement_per_feature``: sign agreement averaged over heads (d values);
    ``sign_agreement_mean`` and ``sign_agreement_max``: its mean and max over features;
    ``output_error_mean``: mean of O_lp − O_hp; ``tokens``: T.
    """
    per_token, sums, sign = errors["per_token"], errors["sum_over_tokens"], errors["sign_agreement"]
    per_feature = sign.nanmean(dim=0)
    finite = per_feature[torch.isfinite(per_feature)]
    return {
        "per_token_mean": _json_float(per_token.mean()),
        "per_token_abs_mean": _json_float(per_token.abs().mean()),
        "sum_over_tokens": _json_float(sums.mean()),
        "sum_over_tokens_per_head": [_json_float(x) for x in sums.mean(dim=0).tolist()],
        "sign_agreement_per_feature": [_json_float(x) for x in per_feature.tolist()],
        "sign_agreement_mean": _json_float(finite.mean()) if finite.numel() else None,
        "sign_agreement_max": _json_float(finite.max()) if finite.numel() else None,
        "output_error_mean": _json_float(errors["output_error"].mean()),
        "tokens": int(per_token.shape[-1]),
    }


def delta_summary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                  policy: PrecisionPolicy | str = "paper", rule: ShiftRule | str = "standard",
                  causal: bool = True, scale: float | None = None, block: int = 64) -> dict:
    """``summarize_delta_errors(delta_errors(q, k, v, do, ...))``, plus the policy and rule used."""
    pol, shift_rule = policy_and_rule(policy, rule, q.dtype if isinstance(q, torch.Tensor) else torch.float32)
    summary = summarize_delta_errors(delta_errors(q, k, v, do, policy=pol, rule=shift_rule, causal=causal,
                                                  scale=scale, block=block))
    return {"policy": pol.name, "rule": shift_rule.kind, **summary}


# ----------------------------------------------------------------------------- running sum over steps

@dataclass
class DeltaTracker:
    """Running sum over training steps of Σ_T (δ_lp − δ_hp), per layer (the paper's Fig. 5).

    ``update(step, layer, value)`` adds ``value`` (one number, or one number per head) to the
    layer's running sum; ``running[layer]`` is the sum so far (a float or a list per head);
    ``history[layer]`` the (step, running sum) pairs.
    """

    running: dict[int, float | list[float]] = field(default_factory=dict)
    history: dict[int, list[tuple[int, float | list[float]]]] = field(default_factory=dict)

    def update(self, step: int, layer: int, value: float | Sequence[float] | torch.Tensor) -> float | list[float]:
        """Add one step's Σ_T (δ_lp − δ_hp) of ``layer``; returns the new running sum."""
        for name, x in (("step", step), ("layer", layer)):
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise ValueError(f"{name}={x!r} is invalid; accepted: an int >= 0")
        last = self.history.get(layer)
        if last and step <= last[-1][0]:
            raise ValueError(f"step={step} for layer {layer} is not after the last step {last[-1][0]}; "
                             "accepted: increasing steps per layer")
        new = _as_numbers(value)
        old = self.running.get(layer)
        if old is not None and isinstance(old, list) != isinstance(new, list):
            raise ValueError(f"value={value!r} does not match layer {layer}'s running sum {old!r}; accepted: "
                             "always one number, or always one number per head")
        if isinstance(new, list):
            if old is not None and len(old) != len(new):
                raise ValueError(f"value has {len(new)} entries but layer {layer}'s running sum has "
                                 f"{len(old)}; accepted: one number per head, always the same heads")
            total = new if old is None else [a + b for a, b in zip(old, new)]
        else:
            total = new if old is None else old + new
        self.running[layer] = total
        self.history.setdefault(layer, []).append((step, total))
        return total

    def as_dict(self) -> dict:
        """{"running": {layer: sum}, "history": {layer: [[step, sum], ...]}}, layers as strings."""
        return {"running": {str(layer): total for layer, total in self.running.items()},
                "history": {str(layer): [[s, t] for s, t in pairs] for layer, pairs in self.history.items()}}


def _as_numbers(value: float | Sequence[float] | torch.Tensor) -> float | list[float]:
    if isinstance(value, torch.Tensor):
        if value.dim() > 1:
            raise ValueError(f"value has shape {tuple(value.shape)}; accepted: a number or one number per head")
        return float(value) if value.dim() == 0 else [float(x) for x in value.tolist()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                for x in value):
        return [float(x) for x in value]
    raise TypeError(f"value={value!r} is invalid; accepted: a number, a list of numbers or a 0-/1-d tensor")


# ----------------------------------------------------------------------------- Ō along one row (Claim 3)

def obar_running_error(q_row: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       policy: PrecisionPolicy | str = "paper", rule: ShiftRule | str = "standard",
                       scale: float | None = None, block: int = 1) -> torch.Tensor:
    """(n_steps, d): Ō_lp − Ō_hp after each key block of one query row (the paper's Eq. 5 view).

    Ō = Σ_j P̄_j·V_j with P̄_j = exp(S_j − m), accumulated along the key axis as the policy does:
    P̄ rounded to ``p_bar``, the accumulator rounded to ``acc`` after every ``block`` keys, with the
    shift m of the emulated kernel (rule and policy as given). Ō_hp = Σ_j exp(S_j − m)·V_j in
    float64 over the same keys, with the same m, on the same rounded inputs. n_steps = ⌈N / block⌉.

    Implementation: ``emulated_forward`` on the growing prefixes k[:j·block], v[:j·block] with key
    tiles of ``block``. The kernel handles key blocks in order, so its state after j blocks is the
    final state of the prefix run: the numbers are the kernel's own, by construction, at
    O(N²/block) cost (meant for rows of up to a few thousand keys).
    """
    _check_tensor("q_row", q_row, 1)
    _check_tensor("k", k, 2)
    _check_tensor("v", v, 2)
    if k.shape != v.shape or k.shape[1] != q_row.shape[0] or k.shape[0] < 1:
        raise ValueError(f"k and v must have shape (N, d) with N >= 1 and d = q_row's {q_row.shape[0]}; "
                         f"got q_row={tuple(q_row.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}")
    pol, shift_rule = policy_and_rule(policy, rule, q_row.dtype)
    scale = _check_scale(scale, q_row.shape[0])
    block = _check_block(block)
    q4, k4, v4 = (t.reshape(1, 1, -1, q_row.shape[0]) for t in _round_inputs(pol, q_row, k, v))
    n = k.shape[0]
    errors = []
    with torch.no_grad(), torch.autocast(q_row.device.type, enabled=False):
        for stop in range(block, n + block, block):
            stop = min(stop, n)
            kj, vj = k4[:, :, :stop], v4[:, :, :stop]
            res = emulated_forward(q4, kj, vj, causal=False, scale=scale, policy=pol, rule=shift_rule,
                                   block_q=1, block_k=block)
            obar_hp, _ = reference.unnormalized(q4, kj, vj, res.shift, scale=scale)
            errors.append((res.acc.double() - obar_hp).reshape(-1))
    return torch.stack(errors)


# ----------------------------------------------------------------------------- rank-1 terms (Claim 1)

def attention_probs(q: torch.Tensor, k: torch.Tensor, *, causal: bool = True,
                    scale: float | None = None) -> torch.Tensor:
    """P = softmax(QKᵀ·scale) in float64 for q (..., T_q, d), k (..., T_k, d), causal top-left aligned."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        raise TypeError(f"q and k must be torch.Tensors; got {type(q).__name__}, {type(k).__name__}")
    if q.dim() < 2 or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (..., T_q, d) and k (..., T_k, d) must share leading dims and d; "
                         f"got q={tuple(q.shape)}, k={tuple(k.shape)}")
    scale = _check_scale(scale, q.shape[-1])
    return torch.softmax(reference.scores(q, k, causal=causal, scale=scale), dim=-1)


def rank1_terms(p: torch.Tensor, k: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) = (PK, X): the factors of the rank-1 terms a_t ⊗ b_t = (PK)[t] ⊗ X[t] of one head.

    p: softmax probabilities (T, T); k: the head's keys (T, d); x: the layer input (T, C).
    Returns PK (T, d) in float64 and X (T, C) in float64.
    """
    _check_tensor("p", p, 2)
    _check_tensor("k", k, 2)
    _check_tensor("x", x, 2)
    if p.shape[1] != k.shape[0] or p.shape[0] != x.shape[0]:
        raise ValueError(f"p (T, T_k), k (T_k, d) and x (T, C) do not fit; got p={tuple(p.shape)}, "
                         f"k={tuple(k.shape)}, x={tuple(x.shape)}")
    return p.double() @ k.double(), x.double()


def _unit_rows(a: torch.Tensor) -> torch.Tensor:
    """Rows of a (float64) divided by their norms; zero rows stay zero."""
    a = a.double()
    norms = a.norm(dim=-1, keepdim=True)
    return torch.where(norms > 0, a / norms.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(a))


def rank1_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(T, T) cosine similarities between the rank-1 matrices a_t b_tᵀ, without forming them.

    ⟨a_i b_iᵀ, a_j b_jᵀ⟩_F = (a_i·a_j)(b_i·b_j) and ‖a_i b_iᵀ‖_F = ‖a_i‖‖b_i‖, so
    cos(a_i b_iᵀ, a_j b_jᵀ) = cos(a_i, a_j)·cos(b_i, b_j). a: (T, d1), b: (T, d2); float64;
    a term with a zero factor has cosine 0 with everything.
    """
    _check_tensor("a", a, 2)
    _check_tensor("b", b, 2)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a and b must have the same number of rows T; got a={tuple(a.shape)}, b={tuple(b.shape)}")
    ua, ub = _unit_rows(a), _unit_rows(b)
    return (ua @ ua.T) * (ub @ ub.T)


def mean_offdiag(m: torch.Tensor) -> float:
    """Mean of the off-diagonal entries of a square matrix (T ≥ 2): Σ_{i≠j} m_ij / (T² − T)."""
    _check_tensor("m", m, 2)
    t = m.shape[0]
    if m.shape[1] != t or t < 2:
        raise ValueError(f"m must be square with at least 2 rows; got shape {tuple(m.shape)}")
    m = m.double()
    return float((m.sum() - m.diagonal().sum()) / (t * t - t))


def delta_gradient_error(delta_err: torch.Tensor, p: torch.Tensor, k: torch.Tensor, x: torch.Tensor, *,
                         scale: float) -> torch.Tensor:
    """ΔdW_Q (d, C) of one head caused by an error in δ alone (Claim 1), in float64:

    dS = P ∘ (dP − δ) and dQ = scale·dS·K, so an error e = δ_lp − δ_hp changes dQ[T] by
    −scale·e_T·(PK)[T]; with q = X·W_Qᵀ (the head's rows of W_Q), dW_Q = dQᵀX, hence

        ΔdW_Q = α·Σ_T e_T·(PK)[T] ⊗ X[T] = α·(PK)ᵀ·diag(e)·X,   α = −scale.

    delta_err: (T,); p: (T, T_k); k: (T_k, d); x: the layer input (T, C).
    """
    _check_tensor("delta_err", delta_err, 1)
    pk, xx = rank1_terms(p, k, x)
    if delta_err.shape[0] != pk.shape[0]:
        raise ValueError(f"delta_err has {delta_err.shape[0]} tokens but p has {pk.shape[0]} rows; "
                         "accepted: one δ error per query row")
    scale = _check_scale(scale, k.shape[-1])
    return -scale * (pk * delta_err.double().unsqueeze(-1)).T @ xx
