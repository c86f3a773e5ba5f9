"""The benchmark's providers of stableflash's kernels compute attention (run through the Triton interpreter
without a GPU), including the δ-source variants that docs/mitigations.md times."""
import pytest
import torch

pytest.importorskip("triton")

from stableflash.attention import reference  # noqa: E402
from stableflash.bench.attention import VARIANTS, provider_fn  # noqa: E402


@pytest.mark.parametrize("name", list(VARIANTS))
def test_our_providers_match_float64_with_gradients(name):
    gen = torch.Generator().manual_seed(0)
    shape = (1, 2 if torch.cuda.is_available() else 1, 40, 16)      # the interpreter: a program per head
    q, k, v, do = (torch.randn(*shape, generator=gen).bfloat16() for _ in range(4))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want = reference.attention(q64, k64, v64, causal=True, softcap=30.0 if name == "stableflash-tie-shift-softcap" else None)
    want.backward(do.double())
    device = "cuda" if torch.cuda.is_available() else "cpu"         # CPU: the Triton interpreter
    q, k, v, do = (t.to(device) for t in (q, k, v, do))
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    got = provider_fn(name, shape, True, device)(q, k, v, True)
    got.backward(do)
    got = got.cpu()
    # the tolerance is about 2.5 rounding steps at 1 of the narrowest format O passes through:
    # bf16 (2^-7), for the accelerated reproduction's arithmetic e8m5 (2^-5), for fp8 e4m3 about one
    # step (2^-3)
    tol = 8e-2 if "e8m5" in name else 1.5e-1 if "fp8" in name else 2e-2     # e4m3: 2^-3 at 1
    assert (got.double() - want).abs().max().item() <= tol
    for g, w in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        # gradients: δ = rowsum(dO ∘ O) reads O at the provider's format; fp8's 3 mantissa bits carry
        # about 4× e8m5's error into it
        gtol = 2e-1 if "fp8" in name else 5e-2
        assert (g.cpu().double() - w).abs().max().item() <= gtol * max(1.0, w.abs().max().item())


def test_timed_rows_reach_the_caller_one_by_one_and_a_failure_is_its_rows_error():
    """``time_jobs`` hands the partial result to ``on_row`` after every row (the CLI writes it, so
    a benchmark cut short keeps what it measured); a provider that fails gets an "error" row."""
    from stableflash.bench.attention import flops, time_jobs

    shape = (2, 4, 256, 64)
    jobs = [(shape, "fwd", "stableflash"), (shape, "fwd", "flex"), (shape, "fwd+bwd", "stableflash")]
    times = {"stableflash": 2.0}

    def timer(shape, mode, name):
        if name == "flex":
            raise RuntimeError("no FlexAttention here")
        return times[name] * (3.5 if mode == "fwd+bwd" else 1.0)

    seen = []
    result = time_jobs(jobs, timer, {"rows": [], "complete": False}, True,
                       on_row=lambda r: seen.append((len(r["rows"]), r["complete"])))
    assert seen == [(1, False), (2, False), (3, False)]
    assert result["complete"] is True
    first, failed, last = result["rows"]
    assert first["ms"] == 2.0 and first["tflops"] == pytest.approx(flops(shape, True, "fwd") / 2.0 / 1e9)
    assert failed["error"] == "RuntimeError: no FlexAttention here" and "ms" not in failed
    assert last["ms"] == 7.0


def test_a_row_records_the_tuners_choices_it_made():
    """Rows that made the kernels' tuners choose carry those choices ("tuned"); a row whose keys
    were tuned before, or a peer with no tuner, carries none."""
    from stableflash.bench.attention import new_choices, time_jobs

    state = {"fwd": {}, "dq": {}}
    shape = (2, 4, 256, 64)

    def timer(shape, mode, name):
        if name == "stableflash":
            state["fwd"].setdefault("(256, 256, 64, True, 1)", "BLOCK_M: 128, BLOCK_N: 64")
            state["dq"].setdefault("(256, 256, 64, True)", "BLOCK_M: 64, BLOCK_N: 64")
        if name == "stableflash-none":
            state["fwd"].setdefault("(256, 256, 64, True, 0)", "BLOCK_M: 64, BLOCK_N: 64")
            state["dq"].setdefault("(256, 256, 64, True)", "BLOCK_M: 128, BLOCK_N: 32")   # tuned already
        return 1.0

    def choices():
        return {k: dict(v) for k, v in state.items()}

    jobs = [(shape, "fwd+bwd", "stableflash"), (shape, "fwd+bwd", "stableflash-none"), (shape, "fwd+bwd", "sdpa-flash"),
            (shape, "fwd+bwd", "stableflash")]
    def timings(names):
        return {n: {"BLOCK_M: 64, BLOCK_N: 64": [0.5, 0.4, 0.6]} for n in names}

    stable, standard, sdpa, again = time_jobs(jobs, timer, {"rows": []}, True, choices=choices,
                                              timings=timings)["rows"]
    assert stable["tuned"] == {"fwd": {"(256, 256, 64, True, 1)": "BLOCK_M: 128, BLOCK_N: 64"},
                               "dq": {"(256, 256, 64, True)": "BLOCK_M: 64, BLOCK_N: 64"}}
    assert standard["tuned"] == {"fwd": {"(256, 256, 64, True, 0)": "BLOCK_M: 64, BLOCK_N: 64"}}
    assert sorted(stable["tuner_ms"]) == ["dq", "fwd"] and list(standard["tuner_ms"]) == ["fwd"]
    assert "tuned" not in sdpa and "tuned" not in again and "tuner_ms" not in again
    assert new_choices({"fwd": {"a": 1}}, {"fwd": {"a": 1, "b": 2}, "dq": {}}) == {"fwd": {"b": 2}}


def test_the_kernels_tuners_are_listed_by_name():
    from stableflash.attention.triton.op import TUNERS, tuned_choices, tuner_timings

    got = tuned_choices()
    assert sorted(got) == sorted(TUNERS) == ["delta_pass", "dkdv", "dq", "fwd", "fwd_tma"]
    assert all(isinstance(v, dict) for v in got.values())
    assert tuner_timings(["fwd", "dq"]).keys() == {"fwd", "dq"}


def test_the_json_is_replaced_whole(tmp_path):
    import json

    from stableflash.files import write_text_atomic

    out = tmp_path / "deeper" / "bench.json"
    write_text_atomic(out, json.dumps({"rows": [1]}))
    write_text_atomic(out, json.dumps({"rows": [1, 2]}))
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]      # no temporary file left


def test_a_timing_the_benchmark_does_not_have_is_refused_by_name():
    from stableflash.bench.attention import BenchConfig

    with pytest.raises(ValueError, match=r"timing='cudagraph' is invalid; accepted: events, graph"):
        BenchConfig(timing="cudagraph")


def test_a_layout_the_benchmark_does_not_have_is_refused_by_name():
    from stableflash.bench.attention import BenchConfig

    with pytest.raises(ValueError, match=r"layout='bshd' is invalid; accepted: bhnd, bnhd"):
        BenchConfig(layout="bshd")


def test_the_model_layout_hands_attention_views_of_a_fused_qkv_buffer():
    """"bnhd": q, k, v are (B, H, N, d) views of one (B, N, 3, H, d) buffer (strides N·3·H·d, d,
    3·H·d, 1) and dO a view of a (B, N, H, d) one; "bhnd": contiguous tensors; the same values
    drawn in either case would differ, the shapes and dtypes do not."""
    from stableflash.bench.attention import _inputs

    B, H, N, d = 2, 3, 5, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = _inputs((B, H, N, d), torch.bfloat16, torch.device("cpu"), gen, "bnhd")
    assert all(t.shape == (B, H, N, d) and t.dtype == torch.bfloat16 for t in (q, k, v, do))
    assert q.stride() == k.stride() == v.stride() == (N * 3 * H * d, d, 3 * H * d, 1)
    assert do.stride() == (N * H * d, d, H * d, 1)
    assert k.data_ptr() - q.data_ptr() == H * d * q.element_size() and q.untyped_storage().data_ptr() == \
        v.untyped_storage().data_ptr()
    assert all(t.is_contiguous() for t in _inputs((B, H, N, d), torch.bfloat16, torch.device("cpu"), gen))


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_time_one_keeps_the_layouts_strides_for_the_provider(monkeypatch, layout):
    """The provider sees the layout's strides in both modes (the fwd+bwd leaves are detached views,
    not copies)."""
    import triton.testing

    from stableflash.bench import attention as bench

    strides = []
    monkeypatch.setattr(bench, "provider_fn", lambda *a: lambda q, k, v, causal: strides.append(q.stride()) or q + k + v)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or 1.0)
    cfg = bench.BenchConfig(shapes=((1, 2, 8, 4),), providers=("sdpa-default",), layout=layout)
    for mode in ("fwd", "fwd+bwd"):
        bench.time_one("sdpa-default", (1, 2, 8, 4), mode, cfg, torch.float32, torch.device("cpu"),
                       torch.Generator().manual_seed(0))
    want = (8 * 3 * 2 * 4, 4, 3 * 2 * 4, 1) if layout == "bnhd" else (2 * 8 * 4, 8 * 4, 4, 1)
    assert strides == [want, want]


@pytest.mark.parametrize("timing, bench", [("events", "do_bench"), ("graph", "do_bench_cudagraph")])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_each_timing_times_the_call_it_names(monkeypatch, timing, bench, mode):
    """``time_one`` hands the provider's call to triton.testing's benchmark of its timing: the call
    computes the output (fwd, no graph kept) or the gradients of q, k, v (fwd+bwd). The benchmark is
    replaced by one that runs the call twice and checks what it computed (CPU: the interpreter)."""
    import triton.testing

    from stableflash.bench.attention import BenchConfig, time_one

    ran = []

    def fake(fn, *args, **kwargs):
        seen = []
        real_grad = torch.autograd.grad
        monkeypatch.setattr(torch.autograd, "grad",
                            lambda o, leaves, do: seen.append(real_grad(o, leaves, do)) or seen[-1])
        fn()
        fn()
        monkeypatch.setattr(torch.autograd, "grad", real_grad)
        ran.append((bench, len(seen), torch.is_grad_enabled()))
        if seen:
            assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in seen[-1])
        return 1.25

    from stableflash.attention.triton import op as triton_op
    monkeypatch.setattr(triton_op, "AUTOTUNE", False)      # the autotuner would call do_bench itself on a GPU
    other = {"do_bench": "do_bench_cudagraph", "do_bench_cudagraph": "do_bench"}[bench]
    monkeypatch.setattr(triton.testing, bench, fake)
    monkeypatch.setattr(triton.testing, other, lambda *a, **k: pytest.fail(f"{other} used for {timing}"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    cfg = BenchConfig(shapes=((1, 2, 40, 16),), providers=("stableflash-none",), modes=(mode,), timing=timing)
    assert time_one("stableflash-none", (1, 2, 40, 16), mode, cfg, torch.bfloat16, device, gen) == 1.25
    assert ran == [(bench, 2 if mode == "fwd+bwd" else 0, True)]


@pytest.mark.gpu                     # CUDA graphs need a GPU
@pytest.mark.gpu_timing              # a graph replay lasts the whole repetition time: other processes' kernels
def test_graph_timing_measures_the_gpus_time_on_the_gpu():   # on the GPU fall inside it
    """On the GPU: the CUDA-graph timing of our kernel and of SDPA flash at a small shape, where the
    host's launch time is a large part of a Python-launched call, is positive and not above the
    Python-launched timing by more than noise: each kind's fastest of three interleaved timings."""
    from stableflash.bench.attention import BenchConfig, time_one

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (2, 4, 256, 64)
    for name in ("stableflash-none", "sdpa-flash"):
        runs = [{t: time_one(name, shape, "fwd+bwd", BenchConfig(shapes=(shape,), providers=(name,), timing=t),
                             torch.bfloat16, torch.device("cuda"), gen) for t in ("events", "graph")}
                for _ in range(3)]
        ms = {t: min(r[t] for r in runs) for t in ("events", "graph")}
        assert 0 < ms["graph"] <= 1.2 * ms["events"], (name, runs)


def test_sdpa_default_is_torchs_own_choice_and_a_peer():
    """"sdpa-default" calls SDPA with no backend forced (what a user's model runs; cuDNN on Hopper),
    is one of the peers every ratio is taken against, and agrees with float64 attention to bf16-level
    error on CPU, where torch picks its math kernel."""
    from stableflash.bench.attention import PEERS, PROVIDERS, BenchConfig, provider_fn

    assert "sdpa-default" in PROVIDERS and PEERS[0] == "sdpa-default"
    assert "sdpa-default" in BenchConfig().providers
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 64, 32, generator=gen) for _ in range(3))
    fn = provider_fn("sdpa-default", (2, 3, 64, 32), True, torch.device("cpu"))
    got = fn(*(t.bfloat16() for t in (q, k, v)), causal=True).double()
    s = (q.double() @ k.double().transpose(-1, -2)) / 32 ** 0.5
    s = s.masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(s, -1) @ v.double()
    assert ((got - want).norm() / want.norm()).item() < 1e-2     # bf16 inputs: about 2^-8 relative


def test_the_correctness_check_covers_rows_with_tied_maxima():
    """The tied inputs give every causal row from 2·TIED_PERIOD − 1 on (which sees every distinct key
    twice) its largest score at least twice; the check reports the errors on them beside those on random inputs (here for SDPA
    on the CPU, bf16 inputs: bf16-level errors)."""
    from stableflash.bench.attention import TIED_PERIOD, check, tied_inputs

    gen = torch.Generator().manual_seed(3)
    q, k, v, _ = tied_inputs((1, 2, 64, 16), torch.float32, torch.device("cpu"), gen)
    s = (q @ k.transpose(-1, -2)).masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    ties = (s == s.amax(-1, keepdim=True)).sum(-1)
    assert bool((ties[..., 2 * TIED_PERIOD - 1:] >= 2).all()) and bool((ties[..., :TIED_PERIOD] == 1).all())
    errs = check("sdpa-default", True, torch.bfloat16, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert set(errs) == {"O", "dQ", "dK", "dV", "O tied", "dQ tied", "dK tied", "dV tied"}
    assert all(0 < e < 3e-2 for e in errs.values()), errs
