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

import torch
import torch.nn.functional as F

from stableflash.attention import emulated, reference
from stableflash.attention.masking import Masking
from stableflash.attention.policy import PrecisionPolicy, resolve_policy
from stableflash.attention.shift import ShiftRule
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
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
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

    def observe(self, o: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
        if self.warned or torch.compiler.is_compiling():
            return
        if o.device.type != "cuda":
            if not bool(torch.isfinite(o).all()) and all(bool(torch.isfinite(t).all()) for t in inputs):
                self._warn(stacklevel=4)
            return
        if torch.cuda.is_current_stream_capturing():
            return
        self.poll(stacklevel=4)
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


def _triton_reason(q: torch.Tensor, k: torch.Tensor, policy: PrecisionPolicy) -> str | None:
    """Why the Triton backend cannot take these inputs, or None if it can."""
    tri = _triton_module()
    if tri is None:
        return "Triton is not installed"
    if q.device.type != "cuda":
        return f"the tensors are on {q.device}, not CUDA"
    try:
        tri.check_inputs(q, k)
        tri.launch.check_policy(policy, q.dtype)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _pick_auto(q: torch.Tensor, k: torch.Tensor, rule: ShiftRule, policy, resolved: PrecisionPolicy,
               softcap: float | None = None, delta_changed: bool = False) -> str:
    if not rule.stabilized and not delta_changed and policy is None and softcap is None:
        return "sdpa"
    why_not = _triton_reason(q, k, resolved)
    if why_not is None:
        return "triton"
    reason = ("a precision policy was given" if policy is not None else
              f"the stabilized softmax (rule {rule.kind!r}) was asked for" if rule.stabilized else
              f"δ from {resolved.delta} was asked for (a consistent δ)" if delta_changed else
              "soft-capped scores were asked for")
    key = f"auto-emulated:{reason}:{why_not}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"backend='auto' chose 'emulated' (the PyTorch tiled emulation, correct but slow) "
                      f"because {reason} and the fused Triton kernel cannot run here ({why_not}); pass "
                      "stabilize='none' to use torch SDPA", stacklevel=3)
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
                    block_k: int = DEFAULT_BLOCK_K, softcap: float | None = None) -> torch.Tensor:
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

    The causal mask is aligned to the top left, as SDPA's ``is_causal``: query i sees keys j ≤ i.
    With seq_q = 2 and seq_k = 5 (1 = kept, 0 = masked):

        1 0 0 0 0
        1 1 0 0 0

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
                nothing needs stabilizing, else "triton" where it can run, else "emulated" with a
                warning.
            "triton": the fused kernels; CUDA, float16/bfloat16, head_dim 16, 32, 64, 128 or 256;
                policies "fa2" and "paper" and the variants
                ``stableflash.attention.triton.launch.SUPPORT`` lists.
            "emulated": tiled FlashAttention-2 in PyTorch under any ``policy`` (slow; any device).
            "reference": float64, returned in q's dtype.
            "sdpa": torch.nn.functional.scaled_dot_product_attention (cannot be stabilized where
                stabilizing changes anything).
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

    Returns:
        O: (batch, heads_q, seq_q, head_dim) in q's dtype and on q's device, differentiable with
        respect to q, k and v.

    Raises:
        TypeError or ValueError naming the argument, the value given and what is accepted, for any
        input or option a backend cannot take.
    """
    _check_tensors(q, k, v)
    scale, block_q, block_k = _check_options(causal, scale, block_q, block_k)
    softcap = check_softcap(softcap)
    stab = parse_stabilize(stabilize, beta, eps)
    rule = stab.rule
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; accepted: {', '.join(BACKENDS)}")
    resolved = resolve_policy(policy, q.dtype)          # validates the policy argument (memoized)
    as_asked, resolved = resolved, stab.policy_for(resolved)      # a consistent δ where asked (memoized)
    delta_changed = resolved.delta != as_asked.delta
    if backend == "auto":
        backend = _pick_auto(q, k, rule, policy, resolved, softcap, delta_changed)
        if backend == "triton" and block_k != DEFAULT_BLOCK_K:
            backend = "emulated"                   # the emulation takes any key block
        log.info("flash_attention: backend='auto' picked %r", backend)
    if policy is not None and backend in ("reference", "sdpa"):
        raise ValueError(f"policy={policy!r} is honoured only by backend='emulated' or 'triton'; "
                         f"got backend={backend!r}")
    scale_val = q.shape[-1] ** -0.5 if scale is None else scale

    if backend == "sdpa":
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
        return F.scaled_dot_product_attention(q, _expand_kv(q, k), _expand_kv(q, v), is_causal=causal,
                                              scale=scale_val)
    o = _attention(q, k, v, backend, causal, scale_val, rule, resolved, block_q, block_k, softcap)
    if rule.kind == "paper":
        _paper_watch.observe(o, (q, k, v))
    return o


# built once: torch.compile cannot construct a Masking (its Window default) inside a traced call
_MASKINGS = {False: Masking(), True: Masking(causal=True)}

def _attention(q, k, v, backend, causal, scale_val, rule, resolved, block_q, block_k, softcap) -> torch.Tensor:
    """The checked call on a backend other than SDPA."""
    if backend == "reference":
        return reference.attention(q, _expand_kv(q, k), _expand_kv(q, v), causal=causal, scale=scale_val,
                                   rule=rule, softcap=softcap).to(q.dtype)
    bad = [h for h in resolved.hp_heads if h >= q.shape[1]]
    if bad:
        raise ValueError(f"policy.hp_heads={resolved.hp_heads} names heads {bad}, but q has "
                         f"{q.shape[1]} heads; accepted: 0 to {q.shape[1] - 1}")
    if backend == "triton":
        tri = _triton_module()
        if tri is None:
            raise ValueError("backend='triton' needs the triton package (pip install 'stableflash[triton]')")
        tri.check_inputs(q, k)
        return tri.triton_attention(q, k, v, masking=_MASKINGS[bool(causal)], scale=scale_val, rule=rule,
                                    policy=resolved, softcap=softcap,
                                    block_k=None if block_k == DEFAULT_BLOCK_K else block_k)[0]
    return emulated.emulated_attention(q, _expand_kv(q, k), _expand_kv(q, v), causal=causal, scale=scale_val,
                                       policy=resolved, rule=rule, block_q=block_q, block_k=block_k, softcap=softcap)
