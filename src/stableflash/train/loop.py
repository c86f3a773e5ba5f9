"""The training loop: one function, ``train``, readable top to bottom.

Data order is a pure function of (seed, step, global micro-batch index), so a run resumed from a
checkpoint draws exactly what an uninterrupted run draws, and a DDP run over W ranks consumes the
same global batch as a one-process run with the same ``grad_accum`` (rank r takes micro-batches
r, r + W, r + 2W, ...). Every consumed batch is recorded; ``replay=RUN_DIR`` consumes another
run's record instead (the paper's method for comparing attention variants on identical data).
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as torch_dist

from stableflash.diagnostics.delta import DeltaTracker
from stableflash.diagnostics.monitor import Monitor, stabilized_choice_spec
from stableflash.diagnostics.probes import probe_record
from stableflash.files import remove_stale_temps, write_text_atomic
from stableflash.model import build_model as _build, model_config
from stableflash.model.spec import upgrade_stored_spec
from stableflash.progress import progress_bar
from stableflash.train import checkpoint
from stableflash.train.config import (DistInfo, TrainConfig, check_parallel, ckpt_format, monitor_config,
                                      resolve_grad_accum, validate)
from stableflash.train.data import BatchRecorder, BatchSampler, ReplaySampler, RunData, eval_batches, read_meta
from stableflash.train.metrics import History, MetricsWriter, truncate_after
from stableflash.train.stopping import ExplosionStop
from stableflash.train.optim import build_optimizer, lr_at

log = logging.getLogger(__name__)

# tokens of train.bin searched for the end-of-text token under attn_mask_type=block_causal
_EOT_PROBE = 1 << 20
# dense bf16 peak of one GPU of the kinds this project is measured on, for MFU (override with peak_tflops,
# also one GPU's)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def resolve_data_dir(data: str, dist: DistInfo | None = None) -> Path:
    """``"embedded"`` → the prepared default corpus; ``"packages"`` → the installed-packages corpus
    (``train.packages_corpus``; under torchrun rank 0 alone reads the packages and prepares it, and
    sends its folder to the other ranks, which wait for it); anything else is a folder of token files."""
    if data == "embedded":
        from stableflash.train.corpus import default_data_dir
        return Path(default_data_dir())
    if data == "packages":
        from stableflash.train.packages_corpus import default_packages_dir
        if dist is None or dist.world_size == 1:
            return Path(default_packages_dir())
        shared = [str(default_packages_dir()) if dist.is_main else None]
        torch_dist.broadcast_object_list(shared, src=0)
        return Path(shared[0])
    return Path(data)


def _device(cfg: TrainConfig, dist: DistInfo) -> torch.device:
    if cfg.device == "auto":
        return torch.device(f"cuda:{dist.local_rank}" if torch.cuda.is_available() else "cpu")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={cfg.device!r} but CUDA is not available here; accepted: auto or cpu")
    return torch.device(cfg.device)


def _peak_flops(cfg: TrainConfig, device: torch.device) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)


class GlobalReplay:
    """Replays a recorded run whatever its world size: micro-batches are keyed by their global
    index, so each (step, index) lives in exactly one rank's record."""

    def __init__(self, run_or_batches_dir: Path, batch_size: int, block_size: int, data):
        d = Path(run_or_batches_dir)
        d = d / "batches" if (d / "batches").is_dir() else d
        ranks = sorted(int(p.stem[4:]) for p in d.glob("rank*.json"))
        if not ranks:
            raise FileNotFoundError(f"replay={run_or_batches_dir}: no recorded batches (batches/rank*.json) there")
        self.dir = d
        self.samplers = [ReplaySampler(d, r, batch_size, block_size, data) for r in ranks]

    def indices(self, step: int, micro: int):
        for sampler in self.samplers:
            try:
                return sampler.indices(step, micro)
            except ValueError:
                continue
        raise ValueError(f"replay: step {step}, micro-batch {micro} was never recorded in {self.dir} "
                         f"({len(self.samplers)} rank files)")


def document_eot(cfg: TrainConfig, meta: dict, data_dir: Path) -> int | None:
    """The end-of-text id that ends each document under ``attn_mask_type="block_causal"``:
    ``cfg.eot_token`` when set, else the data's (``read_meta``'s ``eot_token``); None for "causal".
    A ValueError naming the data when it has none."""
    if cfg.attn_mask_type != "block_causal":
        return None
    if cfg.eot_token is not None:
        return cfg.eot_token
    if meta.get("eot_token") is None:
        source = data_dir / meta["meta_file"] if meta.get("meta_file") else data_dir
        raise ValueError(f"attn_mask_type=block_causal needs the end-of-text token that ends each document, and "
                         f"data={cfg.data!r} has none ({source}: tokenizer {meta.get('tokenizer')!r}, no eot_token); "
                         "accepted: data whose documents end with one (stableflash data prepare --tokenizer gpt2, "
                         "or \"eot_token\": ID in its meta.json), or --set eot_token=ID naming the id that ends "
                         "each document")
    return int(meta["eot_token"])


def build_model(cfg: TrainConfig, vocab_size: int, eot_token: int | None = None):
    """The model of ``cfg`` (GPT or Llama, by preset): the preset with the explicit overrides. The
    vocabulary is ``cfg.vocab_size`` when set (at least the data's), else the preset's, or the
    data's rounded up to a multiple of 64 (as nanoGPT pads GPT-2's 50257 to 50304) when the
    preset's is smaller. Under ``attn_mask_type="block_causal"`` the model splits its rows into
    documents after ``eot_token`` (see :func:`document_eot`)."""
    mcfg = model_config(cfg.model, **cfg.model_overrides())
    vocab = cfg.vocab_size or mcfg.vocab_size
    if cfg.vocab_size and vocab < vocab_size:
        raise ValueError(f"vocab_size={vocab} is smaller than the data's vocabulary ({vocab_size}); "
                         f"accepted: >= {vocab_size}, or leave vocab_size unset to take the data's")
    if vocab < vocab_size:
        vocab = -(-vocab_size // 64) * 64
        log.info("vocab_size %d: the data's vocabulary (%d) rounded up to a multiple of 64; model %s's "
                 "preset has %d", vocab, vocab_size, cfg.model, mcfg.vocab_size)
    return _build(replace(mcfg, vocab_size=vocab, attn_mask_type=cfg.attn_mask_type, eot_token=eot_token),
                  attention=cfg.attention)


def shard_model(model) -> None:
    """Shard ``model`` over the process group with FSDP2: ``fully_shard`` on each transformer block,
    then on the whole model (embeddings, final norm, head). Parameters stay float32 (sharded), as in
    the DDP path the forward's precision is set by autocast, so both compute the same arithmetic."""
    from torch.distributed.fsdp import fully_shard
    blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == model.config.n_layer]
    for block in blocks[0]:
        fully_shard(block)
    fully_shard(model)


@contextlib.contextmanager
def unsharded(model):
    """Every parameter of a model sharded by FSDP2 whole on every rank for the duration, through a
    forward and a backward (the probes read whole weights, and their δ analysis runs a backward);
    resharded after. Every rank must enter it (it all-gathers). A model not sharded is left as it is."""
    from torch.distributed.fsdp import FSDPModule
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.unshard()
    for m in sharded:                                 # the root keeps its own (unsharded after forward)
        if m is not model:
            m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    try:
        yield model
    finally:
        for m in sharded:
            if m is not model:
                m.set_reshard_after_forward(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
            m.reshard()


def _restore(run_dir: Path, cfg: TrainConfig, model, optimizer, device: torch.device) -> dict:
    """Load run_dir's checkpoint (``checkpoint.find``: ckpt.pt or the latest sharded folder) into the
    model, the optimizer and the RNGs; returns it. Loaded on the CPU: the RNG states must stay CPU
    tensors, and load_state_dict moves the rest. Under FSDP, and for a sharded checkpoint, every
    rank must call it."""
    path = checkpoint.find(run_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {run_dir} (neither {checkpoint.CHECKPOINT} nor "
                                f"{checkpoint.SHARDED}/step-N/); a run writes one every ckpt_every steps")
    if path.is_dir():
        try:
            state = checkpoint.load_sharded_checkpoint(path, cfg.to_dict(), model, optimizer)
            checkpoint.check_optimizer_fits(optimizer, path)
        except (RuntimeError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"checkpoint {path} does not fit this run: {str(exc).strip().splitlines()[0]}") from None
        _set_rng(state, device)
        return state
    state = checkpoint.load(run_dir, cfg.to_dict(), map_location="cpu")
    checkpoint.check_fits(state, model, path)
    try:
        if cfg.parallel == "fsdp":
            checkpoint.load_sharded(model, optimizer, state)
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        checkpoint.check_optimizer_fits(optimizer, path)
        _set_rng(state, device)
    except (RuntimeError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"checkpoint {path} does not fit this run: {str(exc).strip().splitlines()[0]}") from None
    return state


def _set_rng(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["rng"]["cpu"])
    if device.type == "cuda" and state["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)


# what the main process of a run writes besides config.json and ckpt.pt (a folder holding any of them
# holds a run); batches/ is left out: the other ranks of a starting run write there
RUN_FILES = ("metrics.jsonl", "probes.jsonl", "summary.json")
# the files train() rewrites atomically: temporary files of killed writes of them are removed
_REWRITTEN = (checkpoint.CHECKPOINT, "metrics.jsonl", "probes.jsonl", "summary.json", "config.json")


def _run_files(run_dir: Path) -> list[str]:
    """The files of RUN_FILES in run_dir."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


class Interrupted(KeyboardInterrupt):
    """Raised by :func:`train` once a SIGINT (Ctrl-C) or SIGTERM has stopped it cleanly: the
    checkpoint of the last completed step is saved and summary.json says "interrupted" (after a
    second signal, which stops at once, the last checkpoint is the one kept). ``summary`` is that
    summary, ``signum`` the first signal, ``exit_code`` 128 + signum (130, 143), what shells and
    schedulers expect. A KeyboardInterrupt, so that code running several trainings stops too."""

    def __init__(self, summary: dict, signum: int, message: str):
        super().__init__(message)
        self.summary, self.signum, self.exit_code = summary, signum, 128 + signum

    def __reduce__(self):                 # whole, through a worker process's result (repro --parallel)
        return type(self), (self.summary, self.signum, str(self))


class _StopSignals:
    """SIGINT and SIGTERM while training: the first asks the loop to stop after the current step
    (:meth:`requested`), a second raises KeyboardInterrupt at once. Installed in the main thread only
    (the one signals reach), and not over a signal the process ignores (a background job's SIGINT);
    :meth:`restore` puts the previous handlers back."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def install(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous = signal.getsignal(sig)
                if previous is not signal.SIG_IGN and previous is not None:
                    self._previous[sig] = previous
                    signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        # os.write: a signal may arrive while the progress bar is writing to the buffered sys.stderr
        os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step and saving its checkpoint "
                    f"({again} again stops at once without saving)\n".encode())

    def requested(self, dist: DistInfo, device: torch.device) -> int:
        """The signal that asked to stop (0 for none), agreed by every rank."""
        signum = self.signum or 0
        if dist.world_size > 1:
            flag = torch.tensor([signum], device=device)
            torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
            signum = int(flag.item())
            self.signum = self.signum or signum or None
        return signum


@torch.no_grad()
def evaluate(model, sampler: BatchSampler, batches, autocast, device) -> float:
    """Mean loss over fixed validation batches."""
    was_training = model.training
    model.eval()
    losses = []
    for idx in batches:
        x, y = sampler.get_batch(idx, device)
        with autocast():
            _, loss = model(x, y)
        losses.append(loss.float().item())
    model.train(was_training)
    return sum(losses) / len(losses)


def _init_process_group(dist: DistInfo, device: torch.device, cfg: TrainConfig) -> str | None:
    """Join torchrun's process group (NCCL for CUDA devices, gloo for the CPU); its backend, or None
    in a one-process run."""
    if dist.world_size == 1:
        return None
    if not torch_dist.is_initialized():
        # imported before the group exists: its functions take ``group=group.WORLD`` as a default
        # argument, which would otherwise keep the group (and gloo's threads) alive to the process's
        # end; DistributedDataParallel imports it
        import torch.distributed.nn  # noqa: F401
        torch_dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    backend = str(torch_dist.get_backend())
    if dist.is_main:
        log.info("distributed: %d ranks, process-group backend %s, grad_accum %d (%d per rank per step)",
                 dist.world_size, backend, cfg.grad_accum, cfg.grad_accum // dist.world_size)
    return backend


def check_run_dir(run_dir: Path) -> None:
    """A clear error when ``run_dir`` cannot be a run folder: it, or the first of its parents that
    exists, is not a folder."""
    for path in (run_dir, *run_dir.parents):
        if path.exists():
            if not path.is_dir():
                what = "is" if path == run_dir else f"is inside {path}, which is"
                raise ValueError(f"run folder {run_dir} {what} a file, not a folder; accepted: a folder "
                                 "(made if missing)")
            return


def _make_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"run folder {run_dir} cannot be made: {exc.strerror or exc}") from None


def train(cfg: TrainConfig, run_dir: Path, resume: bool = False, progress: bool = True,
          allow_data_change: bool = False) -> dict:
    """Train per ``cfg`` into ``run_dir`` (metrics.jsonl, ckpt.pt or ckpt/step-N/, batches/, data.json,
    summary.json).

    ``resume`` continues from run_dir's checkpoint. Resuming, or replaying another run, on data
    whose fingerprint changed since that run recorded it is refused unless ``allow_data_change``.
    Returns the summary (also in summary.json): ``status`` is "finished", "nonfinite" when a loss
    or gradient norm stopped being finite, or "exploded" when ``stop_after_explosion`` stopped it
    (either stops before that step's update; the last good checkpoint stays).
    """
    validate(cfg)
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    dist = DistInfo.from_env()
    cfg = resolve_grad_accum(cfg, dist.world_size)
    check_parallel(cfg, dist.world_size)
    fsdp = cfg.parallel == "fsdp"
    device = _device(cfg, dist)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist_backend = _init_process_group(dist, device, cfg)

    data_dir = resolve_data_dir(cfg.data, dist)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data={cfg.data!r}: no folder {data_dir}; accepted: 'embedded', 'packages' or a "
                                "folder with "
                                "train.bin and val.bin (stableflash data prepare makes one)")
    meta = read_meta(data_dir)
    data_check = RunData(data_dir, run_dir, meta, resume=resume, replay=cfg.replay, allow_change=allow_data_change)
    torch.manual_seed(cfg.seed)                       # same initial weights on every rank
    eot = document_eot(cfg, meta, data_dir)
    model = build_model(cfg, meta["vocab_size"], eot).to(device)
    block = model.config.block_size
    train_data, val_data = data_check.load(meta["vocab_size"], block)     # every id range-checked
    if eot is not None and dist.is_main and not (train_data[:_EOT_PROBE] == eot).any():
        log.warning("attn_mask_type=block_causal: the end-of-text token %d does not occur in the first %d tokens "
                    "of %s, so documents are not split there; is eot_token the id that ends this data's documents?",
                    eot, min(len(train_data), _EOT_PROBE), data_dir / "train.bin")
    if fsdp:
        shard_model(model)                            # before the optimizer: it steps the shards
    optimizer = build_optimizer(model, cfg, device.type)
    _make_run_dir(run_dir)                # after the checks above: a run that cannot start leaves no folder

    step0, history, monitor_state = 0, History(), None
    stopper = ExplosionStop(cfg.stop_after_explosion)
    has_checkpoint = checkpoint.find(run_dir) is not None
    if resume and not has_checkpoint and (_run_files(run_dir) or (run_dir / "config.json").is_file()):
        if dist.is_main:                              # it stopped before its first checkpoint: start it again
            log.warning("%s has no checkpoint (the run stopped before its first one, ckpt_every=%d): starting "
                        "again from step 0, its earlier records dropped", run_dir, cfg.ckpt_every)
    elif resume:
        state = _restore(run_dir, cfg, model, optimizer, device)
        step0 = state["step"]
        monitor_state = state.get("monitor")                          # rank 0's, as it was at the save
        switched = state.get("attention", cfg.attention)             # a monitor may have switched layers
        configured = state["config"].get("attention", cfg.attention)  # the spec the run was started with
        if "config_version" not in state["config"]:                  # a checkpoint of the earlier spec grammar
            switched, configured = upgrade_stored_spec(switched), upgrade_stored_spec(configured)
        if cfg.attention != configured:               # --set attention=... on resume: a fork with new arithmetic
            if dist.is_main:
                log.info("resuming %s at step %d with attention %r (it ran with %r)", run_dir, step0,
                         cfg.attention, switched)
            switched = cfg.attention
        model.set_attention(switched)
    refusal = None                                    # decided by rank 0, which the other ranks follow
    if not resume and dist.is_main:
        found = _run_files(run_dir)
        if has_checkpoint:
            refusal = (f"{run_dir} already holds a run; resume it (stableflash train --resume {run_dir}) or "
                       "choose another --out")
        elif found:
            refusal = (f"{run_dir} already holds a run without a checkpoint ({', '.join(found)}; it stopped "
                       f"before its first one); start it again from step 0 with stableflash train --resume "
                       f"{run_dir}, or choose another --out")
    if not resume and dist.world_size > 1:
        shared = [refusal]
        torch_dist.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal:
        raise ValueError(refusal)
    if resume and dist.is_main:
        for name in _REWRITTEN:                       # left by writes that were killed; never valid
            remove_stale_temps(run_dir / name)
        checkpoint.remove_stale_sharded(run_dir)

        def keep(record: dict) -> None:               # the records before the checkpoint's step
            history.add(record)
            stopper.replay((record,))                 # a resumed run keeps its running minimum and streak

        truncate_after(run_dir / "metrics.jsonl", step0, on_kept=keep)
        truncate_after(run_dir / "probes.jsonl", step0)
        if step0 >= cfg.max_iters:
            log.warning("%s is already at step %d (max_iters=%d): nothing to train; its summary keeps the "
                        "final and best validation losses of its records (continue it with --set max_iters=N, "
                        "N > %d)", run_dir, step0, cfg.max_iters, step0)
    if resume and dist.world_size > 1:               # rank 0 read the records
        shared = [(stopper.running_min, stopper.above_since, history)]
        torch_dist.broadcast_object_list(shared, src=0)
        stopper.running_min, stopper.above_since, history = shared[0]
    if dist.is_main:
        write_text_atomic(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
        data_check.record()                                                 # run_dir/data.json

    sampler = BatchSampler(train_data, block, cfg.batch_size, cfg.seed)
    source = GlobalReplay(Path(cfg.replay), cfg.batch_size, block, train_data) if cfg.replay else sampler
    recorder = BatchRecorder(run_dir, dist.rank, batch_size=cfg.batch_size, block_size=block, seed=cfg.seed,
                             data_path=str(data_dir), start_step=step0)
    val_batches = eval_batches(val_data, block, cfg.batch_size, cfg.eval_iters, cfg.seed)
    val_sampler = BatchSampler(val_data, block, cfg.batch_size, cfg.seed)

    net = torch.compile(model) if cfg.compile else model
    if dist.world_size > 1 and not fsdp:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype)
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")
    kernels = device.type == "cuda" and amp_dtype is not None      # the fused kernels take bf16 / fp16 only
    accum = cfg.grad_accum // dist.world_size
    tokens_per_step = cfg.batch_size * block * cfg.grad_accum         # over every rank
    peak = _peak_flops(cfg, device)
    if peak:
        peak *= dist.world_size                   # MFU: the run's FLOP/s over the peak of all its GPUs
    metrics = MetricsWriter(run_dir, cfg.tensorboard, enabled=dist.is_main)

    monitor = Monitor(monitor_config(cfg))
    if monitor_state is not None and dist.is_main:
        try:
            monitor.load_state_dict(json.loads(monitor_state))
        except ValueError as exc:                     # json's errors are ValueErrors too
            log.warning("the checkpoint's monitor state cannot be read (%s): the monitor starts afresh at step %d, "
                        "its first values those after the resume", exc, step0)
    logit_indicators = (cfg.monitor_max_logit, cfg.monitor_max_logit_growth, cfg.monitor_max_logit_rise)
    if cfg.monitor in ("switch", "rollback") and all(v is None for v in logit_indicators) and dist.is_main:
        log.warning("monitor=%s with the default indicators acts too late on most of the failing "
                    "configurations measured; warned by the largest attention logit "
                    "(--set monitor_max_logit=200, in the units of the GPT-2 and Llama presets) it acts in "
                    "time on every run it was measured on (docs/diagnostics.md)", cfg.monitor)
    tracker = DeltaTracker()
    probes = open(run_dir / "probes.jsonl", "a") if dist.is_main and cfg.probe_every else None

    saved = step0 if resume and has_checkpoint else None     # the step of the checkpoint on disk
    fresh = True                                      # whether the model, optimizer and RNGs are what it holds
    sharded_ckpt = ckpt_format(cfg) == "sharded"
    # every rank takes part in a save: under FSDP (a full one gathers the shards), and in a sharded one
    all_save = fsdp or (sharded_ckpt and dist.world_size > 1)

    def save_checkpoint(done: int) -> None:
        """Rank 0 writes a full checkpoint, every rank its shard of a sharded one; see ``all_save``."""
        nonlocal saved, fresh
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
        watched = json.dumps(monitor.state_dict()) if dist.is_main else None     # rank 0 observes
        if sharded_ckpt:
            if dist.world_size > 1:                   # rank 0's RNG states and monitor, as ckpt.pt keeps
                shared = [rng, watched]
                torch_dist.broadcast_object_list(shared, src=0)
                rng, watched = shared
            checkpoint.save_sharded(run_dir, model, optimizer, done, cfg.to_dict(), str(model.attention_spec), rng,
                                    rank=dist.rank, monitor=watched)
            saved, fresh = done, True
            return
        if fsdp:
            model_state, optimizer_state = checkpoint.sharded_full_state(model, optimizer)
        else:
            model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
        if dist.is_main:
            path = checkpoint.save(run_dir, {
                "model": model_state, "optimizer": optimizer_state, "step": done,
                "config": cfg.to_dict(), "attention": str(model.attention_spec), "rng": rng, "monitor": watched})
            checkpoint.remove_other_format(run_dir, path)
        saved, fresh = done, True                     # after the write: a save cut short saved nothing

    status, last, best_val = "finished", history.last, history.best_val_loss
    bar = progress_bar(total=cfg.max_iters, initial=step0, disable=not (progress and dist.is_main), desc="train")
    step = step0
    stop, signum, at_once = _StopSignals().install(), 0, False
    try:
        while step < cfg.max_iters:
            lr = lr_at(step, cfg)
            optimizer.set_lr(lr)
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                g = micro * dist.world_size + dist.rank        # global micro-batch index
                idx = source.indices(step, g)
                recorder.record(step, g, idx)
                x, y = sampler.get_batch(idx, device)
                sync = contextlib.nullcontext()
                if fsdp:                                       # reduce-scatter on the last micro-batch only
                    model.set_requires_gradient_sync(micro == accum - 1)
                elif dist.world_size > 1 and micro < accum - 1:
                    sync = net.no_sync()
                with sync, autocast():
                    _, loss = net(x, y)
                scaler.scale(loss / accum).backward()
                loss_sum += loss.detach().float()
            if scaler.is_enabled():
                for opt in optimizer.optimizers.values():
                    scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
            if fsdp:
                grad_norm = grad_norm.full_tensor()   # the norm over every rank's shards
            loss_mean = loss_sum / accum
            if dist.world_size > 1:
                torch_dist.all_reduce(loss_mean, op=torch_dist.ReduceOp.AVG)
            loss_val, norm_val = loss_mean.item(), grad_norm.item()
            if cfg.stop_on_nonfinite and not (math.isfinite(loss_val) and math.isfinite(norm_val)):
                status = "nonfinite"
                metrics.event(step, "nonfinite", loss=loss_val, grad_norm=norm_val,
                              message="loss or gradient norm is not finite; stopped before this step's update")
                log.warning("step %d: loss %s, grad norm %s — stopping; the last checkpoint is kept", step,
                            loss_val, norm_val)
                break
            if stopper.observe(step, loss_val):
                status = "exploded"
                metrics.write({"step": step, "loss": loss_val, "lr": lr, "grad_norm": norm_val})
                metrics.event(step, "exploded", loss=loss_val, since=stopper.above_since,
                              message=f"loss above {stopper.factor:g} x its running minimum "
                                      f"({stopper.running_min:.4g}) since step {stopper.above_since}; "
                                      f"stopped (stop_after_explosion={cfg.stop_after_explosion})")
                log.warning("step %d: loss %.4g has stayed above %g x its running minimum since step %d — "
                            "stopping; the last checkpoint is kept", step, loss_val, stopper.factor,
                            stopper.above_since)
                break
            if scaler.is_enabled():
                for opt in optimizer.optimizers.values():
                    scaler.step(opt)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            last = {"step": step, "loss": loss_val, "lr": lr, "grad_norm": norm_val, "ms": dt * 1e3,
                    "tokens_per_s": tokens_per_step / dt}
            if peak:
                last["mfu"] = model.flops_per_token() * tokens_per_step / dt / peak
            done = step + 1
            if done % cfg.eval_every == 0 or done == cfg.max_iters:
                last["val_loss"] = evaluate(model, val_sampler, val_batches, autocast, device)
                best_val = min(best_val, last["val_loss"])
            if step % cfg.log_every == 0 or done == cfg.max_iters or "val_loss" in last:
                metrics.write(last)
            bar.set_postfix(loss=f"{loss_val:.4f}", lr=f"{lr:.2e}")

            # diagnostics: probes on rank 0 (under FSDP on every rank, rank 0 recording), the
            # monitor's decision shared with every rank
            events = monitor.observe_loss(step, loss_val) if dist.is_main else []
            if cfg.probe_every and step % cfg.probe_every == 0 and (probes is not None or fsdp):
                t_probe = time.perf_counter()
                px, py = x, y
                if g != cfg.grad_accum - 1:           # the step's last global micro-batch, as one process probes
                    px, py = sampler.get_batch(source.indices(step, cfg.grad_accum - 1), device)
                with unsharded(model) if fsdp else contextlib.nullcontext(), autocast():
                    record = probe_record(model, px, py, n_seq=cfg.probe_seqs, delta_layers=cfg.delta_layer_list(),
                                          delta_policy=cfg.delta_policy)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if probes is not None:
                    record["probe_ms"] = (time.perf_counter() - t_probe) * 1e3      # what the probes cost
                    for layer, info in (record.get("delta") or {}).items():
                        info["running_sum"] = tracker.update(step, int(layer), info.get("sum_over_tokens") or 0.0)
                    events += monitor.observe_probe(step, record)
                    probes.write(json.dumps({"step": step, **record, "monitor": monitor.state()}) + "\n")
                    probes.flush()
            for event in events:
                metrics.write({**event, "loss": loss_val})
                log.warning("step %d: monitor: %s", step, event["message"])
            act = monitor.layers_to_act_on(events, model.config.n_layer) if dist.is_main else []
            if dist.world_size > 1:
                shared = [act]
                torch_dist.broadcast_object_list(shared, src=0)
                act = shared[0]
            if act:
                spec = model.attention_spec
                for layer in act:
                    spec = spec.with_layers([layer], stabilized_choice_spec(str(spec.choice(layer)), kernels,
                                                                            cfg.monitor_switch_to))
                if monitor.config.action == "rollback" and checkpoint.find(run_dir) is not None:
                    state = _restore(run_dir, cfg, model, optimizer, device)
                    metrics.write({"step": step, "loss": loss_val, "event": "monitor_action", "action": "rollback",
                                   "to_step": state["step"], "layers": act,
                                   "message": f"restored the checkpoint of step {state['step']}"})
                    done = state["step"]
                    fresh = False                     # restored, then switched below: not what is on disk
                    recorder.close()
                    recorder = BatchRecorder(run_dir, dist.rank, batch_size=cfg.batch_size, block_size=block,
                                             seed=cfg.seed, data_path=str(data_dir), start_step=done)
                model.set_attention(spec)
                metrics.write({"step": step, "loss": loss_val, "event": "monitor_action", "action": "switch",
                               "layers": act, "attention": str(spec),
                               "message": f"layers {act} switched to stabilized attention "
                                          f"({cfg.monitor_switch_to}) from step {done}"})
            if (dist.is_main or all_save) and (done % cfg.ckpt_every == 0 or done == cfg.max_iters) and done == step + 1:
                save_checkpoint(done)
            bar.n = step = done
            bar.refresh()
            if step < cfg.max_iters:
                signum = stop.requested(dist, device)     # SIGINT / SIGTERM: stop here, this step complete
                if signum:
                    status = "interrupted"
                    break
        if status == "interrupted" and (dist.is_main or all_save) and (saved != step or not fresh):
            save_checkpoint(step)
    except KeyboardInterrupt:                         # a second signal: stopped at once, mid-step
        status, signum, at_once = "interrupted", stop.signum or signal.SIGINT, True
    finally:
        bar.close()
        metrics.close()
        recorder.close()
        if probes is not None:
            probes.close()
        stop.restore()
    summary = {"status": status, "steps": step, "final_loss": last.get("loss"),
               "best_val_loss": best_val if math.isfinite(best_val) else None, "attention": cfg.attention,
               "final_attention": str(model.attention_spec), "attn_mask_type": cfg.attn_mask_type,
               "eot_token": eot, "config_version": cfg.config_version,
               "world_size": dist.world_size, "dist_backend": dist_backend, "grad_accum": cfg.grad_accum,
               "device": str(device), "data": str(data_dir), "data_meta": meta,
               "data_fingerprint": data_check.fingerprint["sha256"]}
    if status == "interrupted":
        summary.update(signal=signal.Signals(signum).name, checkpoint_step=saved)
    if dist.is_main:
        write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=str))
    if at_once:                                       # other ranks may be inside a collective: no barrier
        raise Interrupted(summary, signum, _interrupted_message(summary, run_dir, at_once))
    if dist.world_size > 1:
        # every rank reaches here before any tears the group down; then DDP's hold on the group is
        # released, so that destroying it ends gloo's worker threads now, with the interpreter alive,
        # rather than leaving them running into its shutdown (_init_process_group says why nothing
        # else holds it)
        torch_dist.barrier()
        del net
        gc.collect()
        torch_dist.destroy_process_group()
    if status == "interrupted":
        raise Interrupted(summary, signum, _interrupted_message(summary, run_dir, at_once))
    return summary


def _interrupted_message(summary: dict, run_dir: Path, at_once: bool) -> str:
    """One line on what an interrupted run kept and how to continue it."""
    name, done, ckpt = summary["signal"], summary["steps"], summary["checkpoint_step"]
    path = checkpoint.find(run_dir) or run_dir / checkpoint.CHECKPOINT
    if not at_once:
        head = f"interrupted by {name} after {done} steps: checkpoint of step {ckpt} saved in {path}"
    elif ckpt is None:
        head = f"stopped at once by a second {name} after {done} steps, before any checkpoint: nothing saved"
    else:
        head = (f"stopped at once by a second {name} after {done} steps: nothing saved since the checkpoint "
                f"of step {ckpt} ({path})")
    return f"{head}; continue with: stableflash train --resume {run_dir}"
