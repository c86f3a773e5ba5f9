"""``flash_attention``: the one public entry to every attention backend.

It validates its arguments at the boundary (so a mistake is a clear ValueError/TypeError that
names the argument, never a crash deep inside a kernel) and dispatches to a backend.
"""
from __future__ import annotations

import atexit
import collections
import logging
import math
import numbers
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from stableflash.attention import emulated, reference
from stableflash.attention.masking import Alignment, Masking, Window, draw_seed, visible
from stableflash.attention.policy import PrecisionPolicy, resolve_policy
from stableflash.attention.shift import ShiftRule, finite
from stableflash.attention.stabilization import Stabilization, parse_stabilize

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "emulated", "reference", "sdpa")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
_warned: set[str] = set()


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seq, head_dim); "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got q={q.device}, k={k.device}, v={v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v must have the same batch (dim 0); got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[1] < 1:
            raise ValueError(f"{name} has 0 heads (dim 1): shape {tuple(t.shape)}; accepted: at least 1 head")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"k and v must have the same heads (dim 1), and q's heads must be a multiple of "
                         f"them (grouped-query attention); got q={tuple(q.shape)}, k={tuple(k.shape)}, "
                         f"v={tuple(v.shape)}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same sequence length (dim 2); got k={tuple(k.shape)}, "
                         f"v={tuple(v.shape)}")
    if not (q.shape[3] == k.shape[3] == v.shape[3]):
        raise ValueError(f"q, k, v must have the same head_dim (dim 3); got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    d = q.shape[3]
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim={d} is unsupported; accepted: 1 to {MAX_HEAD_DIM}")
    if min(q.shape[2], k.shape[2]) < 1:
        raise ValueError(f"sequence lengths must be >= 1; got q seq={q.shape[2]}, k seq={k.shape[2]}")


def _positive_real(value, name: str, none_means: str) -> float | None:
    """``value`` as a float when it is a finite real number > 0 of any numeric type (Python, NumPy:
    ``numbers.Real``, bool excepted), None as None; ValueError naming ``name`` otherwise."""
    if value is None:
        return None
    accepted = f"None ({none_means}) or a finite number > 0"
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{name}={value!r} is a tensor; accepted: {accepted} — pass float(t), which reads a GPU "
                         "tensor back to the host once, outside the call")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not finite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid; accepted: {accepted}")
    return float(value)


def _check_options(causal, scale, block_q, block_k) -> tuple[float | None, int | None, int]:
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} must be a bool")
    scale = _positive_real(scale, "scale", "1/sqrt(head_dim)")
    blocks = []
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b is None and name == "block_q":
            blocks.append(None)
            continue
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
            accepted = "a positive int or None" if name == "block_q" else "a positive int"
            raise ValueError(f"{name}={b!r} is invalid; accepted: {accepted}")
        blocks.append(int(b))
    return scale, *blocks


def check_softcap(value, name: str = "softcap") -> float | None:
    """A logit cap as a float, or None (off); ValueError naming ``name`` for anything else."""
    return _positive_real(value, name, "off")


def check_dropout(value, name: str = "dropout_p") -> float:
    """A dropout probability as a float in [0, 1); ValueError naming ``name`` for anything else."""
    if isinstance(value, torch.Tensor):
        raise ValueError(f"{name}={value!r} is a tensor; accepted: a number with 0 <= {name} < 1")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name}={value!r} is invalid; accepted: a number with 0 <= {name} < 1")
    return float(value)


def check_attn_mask(attn_mask, q: torch.Tensor, n_k: int, name: str = "attn_mask") -> torch.Tensor | None:
    """``attn_mask`` expanded (a view, broadcast dims of stride 0) to (batch, heads_q, seq_q, seq_k),
    or None; TypeError/ValueError naming it for a mask that is not a bool or floating tensor on
    q's device broadcastable to that shape (as torch SDPA's)."""
    if attn_mask is None:
        return None
    B, H, n_q = q.shape[:3]
    want = (B, H, n_q, n_k)
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{name} must be None or a torch.Tensor; got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(f"{name} has dtype {attn_mask.dtype}; accepted: torch.bool (True takes part, as torch SDPA's) "
                        "or a floating dtype (added to the scores)")
    if attn_mask.device != q.device:
        raise ValueError(f"{name} is on {attn_mask.device} and q on {q.device}; accepted: a mask on q's device")
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or not all(a == 1 or a == b for a, b in zip(shape[::-1], want[::-1])):
        raise ValueError(f"{name} has shape {shape}, which does not broadcast to (batch, heads, seq_q, seq_k) = "
                         f"{want}; accepted: any shape broadcastable to it (as torch SDPA's attn_mask)")
    return attn_mask.reshape((1,) * (4 - len(shape)) + shape).expand(want)


def check_masking(causal, align, window, name: str = "window", unbounded=(None,)) -> Masking:
    """The positional mask of ``causal``, ``align`` and ``window``; errors naming the argument."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} must be a bool")
    return Masking(causal, Alignment.parse(align, "align"), Window.parse(window, name, unbounded))


PAPER_RULE_NONFINITE = (
    "flash_attention(stabilize='paper') returned non-finite values. With finite inputs this is the paper's rule "
    "itself: on a row whose maximum is tied at a large score it subtracts beta times that maximum, every "
    "exp(score - shift) underflows to 0, and the row's output is 0/0 = NaN (docs/design.md, 'Row-maximum rules'). "
    "stabilize='tie-shift' bounds the shift and cannot underflow; a smaller beta delays it.")


class _NonFiniteWatch:
    """Warns once per process (RuntimeWarning, ``PAPER_RULE_NONFINITE``) when an output of the
    paper's rule holds a NaN or infinity, without making the GPU wait.

    On the CPU the output is checked when it is returned (one pass over it, next to the attention's
    cost), and the warning is skipped when the inputs themselves were not finite. On CUDA the check
    is queued behind the attention: one reduction over O, its one-byte result copied to pinned host
    memory and a CUDA event recorded; a later call (or the process's exit) reads the results whose
    events have completed, and never waits on one that has not. Nothing is checked while
    torch.compile traces or a CUDA graph is captured, nor after the warning."""

    MAX_PENDING = 64

    def __init__(self) -> None:
        self.warned = False
        self.pending: collections.deque = collections.deque()
        self._exit_hook = False

    def observe(self, o: torch.Tensor, inputs: tuple[torch.Tensor, ...], stacklevel: int = 5) -> None:
        """``stacklevel``: the warning's as ``_warn`` takes it from here (5: the caller of
        ``flash_attention``, which reaches this through ``Call.run``)."""
        if self.warned or torch.compiler.is_compiling():
            return
        if o.device.type != "cuda":
            if not bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(t).all()) for t in inputs):
                self._warn(stacklevel=stacklevel)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        self.poll(stacklevel=stacklevel)
        if self.warned or len(self.pending) >= self.MAX_PENDING:
            return
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(torch.isfinite(o.detach()).all(), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending.append((host, done))
        if not self._exit_hook:
            self._exit_hook = True
            atexit.register(self.poll, wait=True)

    def poll(self, wait: bool = False, stacklevel: int = 2) -> None:
        """Read the queued results that are ready (``wait``: all of them); warn on a non-finite one."""
        while self.pending and not self.warned:
            host, done = self.pending[0]
            if wait:
                done.synchronize()
            elif not done.query():
                return
            self.pending.popleft()
            if not bool(host):
                self._warn(stacklevel + 1)
                self.pending.clear()

    def _warn(self, stacklevel: int) -> None:
        self.warned = True
        warnings.warn(PAPER_RULE_NONFINITE, RuntimeWarning, stacklevel=stacklevel)


_paper_watch = _NonFiniteWatch()


def _triton_module():
    """The Triton backend, or None when Triton is not installed."""
    try:
        from stableflash.attention import triton as tri
    except ImportError:
        return None
    return tri


def _triton_reason(q: torch.Tensor, k: torch.Tensor, policy: PrecisionPolicy, masking: Masking = Masking(),
                   attn_mask: torch.Tensor | None = None, varlen: bool = False,
                   dropout_p: float = 0.0) -> str | None:
    """Why the Triton backend cannot take these inputs, or None if it can."""
    tri = _triton_module()
    if tri is None:
        return "Triton is not installed"
    if q.device.type != "cuda":
        return f"the tensors are on {q.device}, not CUDA"
    try:
        tri.check_inputs(q, k, masking=masking, attn_mask=attn_mask, varlen=varlen, dropout_p=dropout_p)
        tri.launch.check_policy(policy, q.dtype)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _pick_auto(q: torch.Tensor, k: torch.Tensor, rule: ShiftRule, policy, resolved: PrecisionPolicy,
               softcap: float | None = None, delta_changed: bool = False, masking: Masking = Masking(),
               attn_mask: torch.Tensor | None = None, varlen: bool = False, dropout_p: float = 0.0,
               return_lse: bool = False, depth: int = 1) -> str:
    """"sdpa" where nothing needs stabilizing and SDPA can express the call, else "triton" where
    the kernels take it, else "emulated" (with a warning, once per reason)."""
    stabilizing = rule.stabilized or delta_changed or policy is not None or softcap is not None
    # SDPA's own masks: none, or causal aligned top-left; a window or a bottom-right diagonal it takes
    # only as a dense boolean mask, which its kernels read in full (slower than the kernels' band
    # on an H100: docs/kernels.md), so those go to the kernels
    sdpa_native = masking.window.unbounded and (not masking.causal or masking.align is Alignment.TOP_LEFT
                                                or q.shape[2] == k.shape[2])
    if not stabilizing and not varlen and not return_lse and sdpa_native:
        return "sdpa"
    why_not = _triton_reason(q, k, resolved, masking, attn_mask, varlen, dropout_p)
    if why_not is None:
        return "triton"
    if not stabilizing and not varlen and not return_lse:
        return "sdpa"
    reason = ("a precision policy was given" if policy is not None else
              f"the stabilized softmax (rule {rule.kind!r}) was asked for" if rule.stabilized else
              f"δ from {resolved.delta} was asked for (a consistent δ)" if delta_changed else
              "soft-capped scores were asked for" if softcap is not None else
              "a varlen batch (cu_seqlens) was given, which torch SDPA cannot take" if varlen else
              "the log-sum-exp was asked for (return_lse=True), which torch SDPA does not return")
    key = f"auto-emulated:{reason}:{why_not}"
    if key not in _warned and not torch.compiler.is_compiling():
        _warned.add(key)
        hint = "; pass stabilize='none' to use torch SDPA" if stabilizing and not varlen and not return_lse else ""
        warnings.warn(f"backend='auto' chose 'emulated' (the PyTorch tiled emulation, correct but slow) "
                      f"because {reason} and the fused Triton kernel cannot run here ({why_not}){hint}",
                      stacklevel=3 + depth)
    return "emulated"


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """K or V repeated over the query heads that share it (grouped-query attention)."""
    group = q.shape[1] // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


DEFAULT_BLOCK_K = 64           # the emulated backend's key block unless block_k says otherwise


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, stabilize: bool | str | Stabilization = True, beta: float = 2.0,
                    eps: float = 1e-3, backend: str = "auto",
                    policy: PrecisionPolicy | str | None = None, block_q: int | None = None,
                    block_k: int = DEFAULT_BLOCK_K, softcap: float | None = None,
                    align: str | Alignment = "top-left", window: tuple[int | None, int | None] | Window | None = None,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                    return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention softmax(Q·Kᵀ·scale)·V in torch SDPA's layout, stabilized for low-precision training.

    Why it is stabilized: in a bf16 or fp16 flash attention, a softmax row with several equal
    maxima gets P̄ = exp(S − max) = 1 at each of them, the rounding of P̄V is then biased, and the
    backward's δ = rowsum(dO ∘ O) carries that bias into dQ and W_Q's update until training
    explodes (arXiv 2510.04212). With ``stabilize=True`` (the default) the forward is the standard
    one, bit for bit, and the backward takes δ from a source consistent with its own P instead of
    the rounded stored O; the row-maximum rules change the forward's shift instead. Both are exact
    in real arithmetic. The runs and costs behind the default: docs/mitigations.md.

    Grouped-query attention: k and v may have fewer heads than q when that number divides q's;
    query head h then uses key/value head h // (heads_q // heads_kv).

    Masks (``stableflash.attention.masking`` defines them for every backend). Query i sees key j
    when i + offset − left ≤ j ≤ i + offset + right, with ``window=(left, right)`` (None:
    unbounded), right at most 0 under ``causal``, and offset 0 for ``align="top-left"`` (SDPA's
    ``is_causal``) or seq_k − seq_q for ``align="bottom-right"`` (FlashAttention's: what decoding
    and a prefill that continues a KV cache need). With seq_q = 2 and seq_k = 5, causal
    (1 = kept, 0 = masked):

        top-left        bottom-right
        1 0 0 0 0       1 1 1 1 0
        1 1 0 0 0       1 1 1 1 1

    The scores are S = Q·Kᵀ·scale, soft-capped if asked, plus ``attn_mask`` (a boolean one: True
    takes part, as SDPA's), then the positional mask. A query that sees no key gets output 0,
    log-sum-exp −inf and no gradient (never NaN). Dropout drops each softmax entry with probability
    ``dropout_p`` and scales the others by 1/(1 − dropout_p), forward and backward alike; on the
    stableflash backends the decisions come from a seed drawn from torch's default generator per
    call (``torch.manual_seed`` reproduces a call; activation checkpointing replays it).

    Arguments:
        q: (batch, heads_q, seq_q, head_dim), float16, bfloat16, float32 or float64.
        k: (batch, heads_kv, seq_k, head_dim), q's dtype and device; heads_kv divides heads_q.
        v: (batch, heads_kv, seq_k, head_dim), like k.
        causal: bool, default False. Apply the causal mask above.
        scale: float > 0 or None, default None (1 / sqrt(head_dim)). Multiplies Q·Kᵀ. Here and in
            beta, eps and softcap any real number type is taken (a NumPy scalar too), not a tensor.
        stabilize: a stabilization name, True, False or a Stabilization; default True, which is
            "consistent-delta". What is stabilized: the row-maximum rule and the source of δ
            (``stableflash.attention.stabilization`` lists the names).
            "consistent-delta" (True): the standard row maximum; δ from the source
                ``policy.consistent_delta_source`` names for the policy's rounding, where the policy's
                δ reads the stored O — for bf16/fp16 the stored O plus its rounding residual (2 more
                bytes per element of O kept for the backward), for an fp8 P̄ the O of a 16-bit P̄V
                computed beside it, under rounded scores or accumulators dP·P. Nothing changes where
                nothing is rounded before δ (float32/float64 inputs with no policy).
            "none" (False or None): the standard row maximum, δ as the policy says (plain flash
                attention).
            "tie-shift": rows whose maximum is tied (in a key block, or with earlier blocks) are
                shifted by a bounded amount, so that no tied P̄ is 1 and ℓ cannot underflow; δ as the
                policy says.
            "paper": the paper's Algorithm 3 as published (a tied row subtracts β·max for a positive
                max, 0 for a negative one); δ as the policy says. Where that shift underflows a row
                (tied at a large max) the row is NaN, and a RuntimeWarning says so once per process
                (checked without making the GPU wait: ``_NonFiniteWatch``).
            "all-shift": the tie-shift's bounded shift on every row.
            A rule + "+consistent-delta" ("tie-shift+consistent-delta", ...): that rule and the δ of
                "consistent-delta".
            A Stabilization: its rule, with its own parameters, and its δ choice.
        beta: float > 1, default 2.0. The rules' shift factor β (for a stabilization given by name).
        eps: float ≥ 0, default 1e-3. Scores within eps of the row maximum count as tied (for a
            stabilization given by name).
        backend: default "auto".
            "auto": the fastest backend that honours the other arguments — torch's SDPA where
                nothing needs stabilizing and SDPA can express the call (not with return_lse),
                else "triton" where it can run, else "emulated" with a warning.
            "triton": the fused kernels; CUDA, float16/bfloat16, head_dim 16, 32, 64, 128 or 256;
                policies "fa2" and "paper" and the variants
                ``stableflash.attention.triton.launch.SUPPORT`` lists.
            "emulated": tiled FlashAttention-2 in PyTorch under any ``policy`` (slow; any device).
            "reference": float64, returned in q's dtype.
            "sdpa": torch.nn.functional.scaled_dot_product_attention (cannot be stabilized where
                stabilizing changes anything, nor return the log-sum-exp; a window or bottom-right
                alignment goes to it as a boolean mask, and its dropout draws from torch's own
                generator).
        policy: a PrecisionPolicy, a preset name ("fa2", "paper", "fp32", "fp64") or None, default
            None (what a real kernel does for q's dtype). Where each intermediate is rounded and to
            which format; honoured by "emulated" and "triton" only.
        block_q: int ≥ 1 or None, default None (all rows). Query rows the emulated backend
            processes at once; memory only, the result does not depend on it.
        block_k: int ≥ 1, default 64. The emulated backend's key block, which sets where the
            running maximum and accumulator are updated and hence the rounding. The kernels choose
            their own tiles, except under the "paper" policy, where a block_k other than the
            default sets the forward's key block (a power of two from 16 to 512, block_k·head_dim
            ≤ 32768), as in the emulation.
        softcap: float > 0 or None, default None (off). Scores become softcap·tanh(S / softcap)
            before the softmax: an architectural control, not exact softmax attention.
        align: "top-left" or "bottom-right" (or a ``masking.Alignment``), default "top-left".
            Where the causal diagonal and the window's centre sit when seq_q ≠ seq_k (above).
        window: (left, right) or None, default None (no window). A sliding window: query i sees
            keys from its diagonal − left to its diagonal + right; each side an int ≥ 0 or None
            (unbounded on that side); a ``masking.Window`` too.
        attn_mask: a tensor or None, default None. Boolean (True = takes part, as torch SDPA's) or
            floating (added to the scores after the soft-cap), of any shape broadcastable to
            (batch, heads_q, seq_q, seq_k), on q's device.
        dropout_p: float in [0, 1), default 0.0. Attention dropout, applied whenever > 0 (as torch
            SDPA's; a module passes 0 outside training).
        return_lse: bool, default False. Also return the log-sum-exp of each row's scores.

    Returns:
        O: (batch, heads_q, seq_q, head_dim) in q's dtype and on q's device, differentiable with
        respect to q, k and v. With ``return_lse``: (O, lse), lse (batch, heads_q, seq_q) float32,
        the natural log of each row's sum of exp(S) (before dropout), −inf on a row that sees no
        key; no gradient flows through it.

    Raises:
        TypeError or ValueError naming the argument, the value given and what is accepted, for any
        input or option a backend cannot take.
    """
    key = kept = None
    if attn_mask is None:                      # a signature seen before runs its kept Call unchecked
        key = signature((q, k, v), (causal, scale, stabilize, beta, eps, backend, policy, block_q, block_k, softcap,
                                    align, window, dropout_p, return_lse))
        kept = remembered(key)
        if kept is not None and not VERIFY:
            return kept.run(q, k, v)
    _check_tensors(q, k, v)
    masking = check_masking(causal, align, window)
    attn_mask = check_attn_mask(attn_mask, q, k.shape[2])
    call = keep(key, decide(q, k, v, masking=masking, scale=scale, stabilize=stabilize, beta=beta, eps=eps,
                            backend=backend, policy=policy, block_q=block_q, block_k=block_k, softcap=softcap,
                            attn_mask=attn_mask, dropout_p=dropout_p, return_lse=return_lse), kept)
    return call.run(q, k, v, attn_mask)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, masking: Masking, scale, stabilize, beta, eps,
           backend: str, policy, block_q, block_k, softcap, attn_mask: torch.Tensor | None, dropout_p,
           return_lse, varlen: tuple | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``flash_attention`` after the tensors, masks and mask argument were checked (``attn_mask``
    expanded to (B, H, Nq, Nk)); ``varlen``: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k) checked, with q, k, v (1, H, total, d). ``packed``: the (B, N, 3, H, d) tensor
    whose views q, k and v are (``flash_attn_qkvpacked_func``): the Triton backend then returns one
    gradient for it; the other backends reach it through the views."""
    call = decide(q, k, v, masking=masking, scale=scale, stabilize=stabilize, beta=beta, eps=eps, backend=backend,
                  policy=policy, block_q=block_q, block_k=block_k, softcap=softcap, attn_mask=attn_mask,
                  dropout_p=dropout_p, return_lse=return_lse, varlen=varlen is not None, depth=2)
    return call.run(q, k, v, attn_mask, varlen, packed, depth=2)


class Call(NamedTuple):
    """What ``decide`` made of one call's options: the backend and everything it is handed besides
    the tensors, checked. ``run`` computes the call on its tensors. Everything here follows from the
    options and the tensors' types, shapes, dtypes and devices alone, so the public entries keep a
    Call per signature of those (``remembered``) and a repeated call runs it without the checks."""

    backend: str
    picked: bool                       # chosen by backend="auto" (logged on every call)
    masking: Masking
    scale: float
    rule: ShiftRule
    policy: PrecisionPolicy            # resolved, with the stabilization's δ
    block_q: int | None
    block_k: int
    softcap: float | None
    dropout_p: float
    return_lse: bool
    kernels: tuple | None              # the Triton backend's ``launch.kernel_call``, without attn_mask or varlen

    def run(self, q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None,
            attn_mask: torch.Tensor | None = None, varlen: tuple | None = None,
            packed: torch.Tensor | None = None, depth: int = 1) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The call on these tensors (checked by ``decide`` for this signature). q, k, v may be None
        where ``packed`` is given: its views are made where a backend reads them. ``depth``: the
        library's frames above this one up to the user's call (warnings point at the user's line)."""
        if self.picked and not torch.compiler.is_compiling():
            log.info("flash_attention: backend='auto' picked %r", self.backend)
        if self.kernels is not None and attn_mask is None and varlen is None:
            o, lse = _triton_module().launch.run_kernels(q, k, v, self.scale, self.kernels, packed)
        else:
            if q is None:
                q, k, v = _views(packed)
            if self.backend == "sdpa":
                return _sdpa(q, k, v, self.masking, attn_mask, self.dropout_p, self.scale)
            o, lse = _attention(q, k, v, self.backend, self.masking, self.scale, self.rule, self.policy, self.block_q,
                                self.block_k, self.softcap, attn_mask, self.dropout_p, varlen, packed)
        if self.rule.kind == "paper":
            if q is None:
                q, k, v = _views(packed)
            _paper_watch.observe(o, (q, k, v), stacklevel=4 + depth)
        return (o, lse) if self.return_lse else o


def _views(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as (B, H, N, d) views of a packed (B, N, 3, H, d) tensor, made as the entry makes them
    (``unbind`` along dimension 2, whose backward gives the packed tensor one contiguous gradient)."""
    return tuple(t.transpose(1, 2) for t in packed.unbind(2))


def decide(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, masking: Masking, scale, stabilize, beta, eps,
           backend: str, policy, block_q, block_k, softcap, attn_mask: torch.Tensor | None, dropout_p,
           return_lse, varlen: bool = False, depth: int = 1) -> Call:
    """The ``Call`` of ``attend``'s arguments (``varlen``: whether packed sequences are given),
    every option checked; TypeError or ValueError naming the argument otherwise. ``depth``: the
    library's frames above this one up to the user's call (warnings point at the user's line)."""
    scale, block_q, block_k = _check_options(masking.causal, scale, block_q, block_k)
    softcap = check_softcap(softcap)
    dropout_p = check_dropout(dropout_p)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse={return_lse!r} must be a bool")
    stab = parse_stabilize(stabilize, beta, eps)
    rule = stab.rule
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")
    resolved = resolve_policy(policy, q.dtype)          # validates the policy argument (memoized)
    as_asked, resolved = resolved, stab.policy_for(resolved)      # a consistent δ where asked (memoized)
    delta_changed = resolved.delta != as_asked.delta
    picked = backend == "auto"
    if picked:
        # "triton" only where the kernels' input checks pass (``_triton_reason``)
        backend = _pick_auto(q, k, rule, policy, resolved, softcap, delta_changed, masking, attn_mask,
                             varlen, dropout_p, return_lse, depth)
        if backend == "triton" and block_k != DEFAULT_BLOCK_K:
            backend = "emulated"                   # the emulation takes any key block
    if policy is not None and backend in ("reference", "sdpa"):
        raise ValueError(f"policy={policy!r} is honoured only by backend='emulated' or 'triton'; "
                         f"got backend={backend!r}")
    scale_val = q.shape[-1] ** -0.5 if scale is None else scale
    kernels = None
    if backend == "sdpa":
        _check_sdpa(stabilize, rule, delta_changed, resolved, softcap, varlen, return_lse)
    elif backend in ("emulated", "triton"):
        bad = [h for h in resolved.hp_heads if h >= q.shape[1]]
        if bad:
            raise ValueError(f"policy.hp_heads={resolved.hp_heads} names heads {bad}, but q has "
                             f"{q.shape[1]} heads; accepted: 0 to {q.shape[1] - 1}")
    if backend == "triton":
        tri = _triton_module()
        if tri is None:
            raise ValueError("backend='triton' needs the triton package (pip install 'stableflash[triton]')")
        if not picked:
            tri.check_inputs(q, k, masking=masking, attn_mask=attn_mask, varlen=varlen, dropout_p=dropout_p)
        if attn_mask is None and not varlen:
            kernels = tri.launch.kernel_call(q, k, masking=masking, rule=rule, policy=resolved, softcap=softcap,
                                             block_k=_kernel_block(block_k), dropout_p=dropout_p)
    return Call(backend, picked, masking, scale_val, rule, resolved, block_q, block_k, softcap, dropout_p, return_lse,
                kernels)


# the Calls of recent signatures (``remembered``): what a repeated call runs without the checks
_CALLS: dict = {}
MAX_CALLS = 256


def _typed(value):
    """``value`` with its type, and a tuple's items each with theirs: keys that tell True from 1 and
    1 from 1.0 (which compare equal) apart. (Another tuple class, a Window, keeps what it holds as
    given: the entries take it unchecked.)"""
    if isinstance(value, tuple):
        return value.__class__, tuple(map(_typed, value))
    return value.__class__, value


def signature(tensors: tuple, options: tuple) -> tuple | None:
    """The key of a call whose ``Call`` may be kept: each tensor's shape, dtype and device, the
    options and their types (a tuple's items typed too: True and 1, 1 and 1.0 compare equal); None
    where a Call is not kept — a tensor that is not a plain ``torch.Tensor`` (a subclass, a traced
    value), or while torch.compile traces (the checks are traced into the graph instead). A key with an
    unhashable option is never found nor kept (``remembered``, ``keep``)."""
    if torch.compiler.is_compiling():
        return None
    key = []
    for t in tensors:
        if t.__class__ is not torch.Tensor:
            return None
        key += (t.shape, t.dtype, t.device)
    types = tuple(map(type, options))
    key += (options, types)
    if tuple in types:                         # a plain tuple (a window's sides): its items typed too
        key.append(tuple(_typed(x) for x in options if x.__class__ is tuple))
    return tuple(key)


def remembered(key: tuple | None) -> Call | None:
    """The Call kept for ``signature`` key, or None (also for a key that cannot be hashed)."""
    if key is None:
        return None
    try:
        return _CALLS.get(key)
    except TypeError:                          # an unhashable option
        return None


# on: a call whose Call was kept is checked and decided again, and the two must be equal (the tests
# run with it, as the kernels' launch cache with its VERIFY)
VERIFY = False


def keep(key: tuple | None, call: Call, kept: Call | None = None) -> Call:
    """``call``, kept for ``key`` (nothing kept for None or an unhashable key; the store emptied first
    when it holds MAX_CALLS). ``kept``: what ``remembered`` gave for the key under ``VERIFY``, which must equal it."""
    if kept is not None:
        assert kept == call, f"a kept Call differs from its signature's decision: {kept} against {call}"
    if key is None:
        return call
    try:
        hash(key)
    except TypeError:                          # an unhashable option: nothing kept
        return call
    if len(_CALLS) >= MAX_CALLS:
        _CALLS.clear()
    _CALLS[key] = call
    return call


def forget_calls() -> None:
    """Forget every kept Call: the next call of each signature is checked and decided again (what a
    test that stands in for the kernels or their checks needs)."""
    _CALLS.clear()


def _kernel_block(block_k: int) -> int | None:
    """The kernels' key block for ``block_k``: None (their own tiles) for the default."""
    return None if block_k == DEFAULT_BLOCK_K else block_k


def _check_sdpa(stabilize, rule, delta_changed, resolved, softcap, varlen, return_lse) -> None:
    """What torch's SDPA cannot do, refused naming the argument."""
    if softcap is not None:
        raise ValueError(f"backend='sdpa' cannot soft-cap the scores (softcap={softcap}); accepted with sdpa: "
                         "softcap=None — use backend='triton' or 'emulated'")
    if rule.stabilized:
        raise ValueError(f"backend='sdpa' cannot apply the row-maximum rule of stabilize={stabilize!r}; "
                         "pass stabilize='none', or use backend='triton' or 'emulated'")
    if delta_changed:
        raise ValueError(f"backend='sdpa' cannot take δ from {resolved.delta} (stabilize={stabilize!r} asks for "
                         "a consistent δ, and torch's SDPA reads its stored O); pass stabilize='none', or use "
                         "backend='triton' or 'emulated'")
    if varlen:
        raise ValueError("backend='sdpa' cannot take a varlen batch (cu_seqlens); accepted with sdpa: padded "
                         "(batch, seq) tensors — use backend='auto', 'triton', 'emulated' or 'reference'")
    if return_lse:
        raise ValueError("backend='sdpa' cannot return the log-sum-exp (return_lse=True); accepted with sdpa: "
                         "return_lse=False — use backend='auto', 'triton', 'emulated' or 'reference'")


def _sdpa(q, k, v, masking: Masking, attn_mask, dropout_p: float, scale: float) -> torch.Tensor:
    """torch's SDPA; a mask other than top-left causal goes to it as a boolean mask."""
    n_q, n_k = q.shape[2], k.shape[2]
    top_left = masking.align is Alignment.TOP_LEFT or n_q == n_k
    is_causal = masking.causal and masking.window.unbounded and top_left and attn_mask is None
    mask = attn_mask
    if masking.masks_anything and not is_causal:
        seen = visible(n_q, n_k, masking, q.device)
        if mask is None:
            mask = seen
        elif mask.dtype == torch.bool:
            mask = mask & seen
        else:
            mask = mask.masked_fill(~seen, -math.inf)
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)                       # SDPA takes a float mask in q's dtype
    return F.scaled_dot_product_attention(q, _expand_kv(q, k), _expand_kv(q, v), attn_mask=mask,
                                          dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def _attention(q, k, v, backend, masking, scale_val, rule, resolved, block_q, block_k, softcap, attn_mask,
               dropout_p, varlen, packed=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A call ``decide`` checked, on a backend other than SDPA: (O, LSE)."""
    cu_q, cu_k, max_q, max_k = varlen if varlen is not None else (None,) * 4
    if backend == "reference":
        kw = dict(masking=masking, scale=scale_val, rule=rule, softcap=softcap, dropout_p=dropout_p,
                  seed=draw_seed() if dropout_p > 0 else None, return_lse=True)
        if varlen is not None:
            o, lse = reference.attention_varlen(q, _expand_kv(q, k), _expand_kv(q, v), cu_q, cu_k, **kw)
        else:
            o, lse = reference.attention(q, _expand_kv(q, k), _expand_kv(q, v), attn_mask=attn_mask, **kw)
        return o.to(q.dtype), lse.float()
    if backend == "triton":
        return _triton_module().triton_attention(
            q, k, v, masking=masking, scale=scale_val, rule=rule, policy=resolved, softcap=softcap,
            block_k=_kernel_block(block_k), attn_mask=attn_mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=dropout_p, packed=packed)
    return emulated.emulated_attention(q, _expand_kv(q, k), _expand_kv(q, v), causal=masking.causal,
                                       scale=scale_val, policy=resolved, rule=rule, block_q=block_q, block_k=block_k,
                                       softcap=softcap, masking=masking, attn_mask=attn_mask, dropout_p=dropout_p,
                                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
