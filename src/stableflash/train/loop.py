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
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as torch_dist

from stableflash.diagnostics.delta import DeltaTracker
from stableflash.diagnostics.monitor import Monitor, stabilized_choice_spec
from stableflash.diagnostics.probes import probe_record
from stableflash.model import build_model as _build, model_config
from stableflash.model.spec import upgrade_stored_spec
from stableflash.train import checkpoint
from stableflash.train.config import DistInfo, TrainConfig, monitor_config, validate
from stableflash.train.data import BatchRecorder, BatchSampler, ReplaySampler, eval_batches, load_split, read_meta
from stableflash.train.metrics import MetricsWriter, read_metrics, truncate_after
from stableflash.train.stopping import ExplosionStop
from stableflash.train.optim import build_optimizer, lr_at

log = logging.getLogger(__name__)

# dense bf16 peak of the GPUs this project is measured on, for MFU (override with peak_tflops)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def resolve_data_dir(data: str) -> Path:
    """``"embedded"`` → the prepared default corpus; anything else is a folder of token files."""
    if data == "embedded":
        from stableflash.train.corpus import default_data_dir
        return Path(default_data_dir())
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


def build_model(cfg: TrainConfig, vocab_size: int):
    """The model of ``cfg`` (GPT or Llama, by preset): the preset with the explicit overrides, vocab
    at least the data's."""
    mcfg = model_config(cfg.model, **cfg.model_overrides())
    vocab = cfg.vocab_size or mcfg.vocab_size
    if vocab < vocab_size:
        raise ValueError(f"vocab_size={vocab} is smaller than the data's vocabulary ({vocab_size}); "
                         f"accepted: >= {vocab_size}")
    return _build(replace(mcfg, vocab_size=vocab), attention=cfg.attention)


def _restore(run_dir: Path, cfg: TrainConfig, model, optimizer, device: torch.device) -> dict:
    """Load run_dir's checkpoint into the model, the optimizer and the RNGs; returns it. Loaded on
    the CPU: the RNG states must stay CPU tensors, and load_state_dict moves the rest."""
    state = checkpoint.load(run_dir, cfg.to_dict(), map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if device.type == "cuda" and state["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)
    return state


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


def resolve_grad_accum(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """``cfg`` with ``grad_accum`` for ``world_size`` ranks: unset (None), one micro-batch per rank;
    set, the micro-batches per step over all ranks (nanoGPT's gradient_accumulation_steps), which
    the ranks must divide."""
    if cfg.grad_accum is None:
        return replace(cfg, grad_accum=world_size)
    if cfg.grad_accum % world_size:
        raise ValueError(f"grad_accum={cfg.grad_accum} (micro-batches per step over all ranks) is not a multiple of "
                         f"the {world_size} ranks; accepted: a multiple of {world_size}, or grad_accum unset (none) "
                         "for one micro-batch per rank")
    return cfg


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


def _quiet_monitor(bar_cls):
    """``bar_cls`` without tqdm's monitor thread, which tqdm starts for every bar, disabled ones too,
    and leaves running (a daemon thread) into the interpreter's shutdown."""
    return type(bar_cls.__name__, (bar_cls,), {"monitor_interval": 0})


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


def train(cfg: TrainConfig, run_dir: Path, resume: bool = False, progress: bool = True) -> dict:
    """Train per ``cfg`` into ``run_dir`` (metrics.jsonl, ckpt.pt, batches/, summary.json).

    ``resume`` continues from run_dir's checkpoint. Returns the summary (also in summary.json):
    ``status`` is "finished", "nonfinite" when a loss or gradient norm stopped being finite, or
    "exploded" when ``stop_after_explosion`` stopped it (either stops before that step's update;
    the last good checkpoint stays).
    """
    from tqdm.auto import tqdm

    validate(cfg)
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    dist = DistInfo.from_env()
    cfg = resolve_grad_accum(cfg, dist.world_size)
    device = _device(cfg, dist)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist_backend = _init_process_group(dist, device, cfg)

    data_dir = resolve_data_dir(cfg.data)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data={cfg.data!r}: no folder {data_dir}; accepted: 'embedded' or a folder with "
                                "train.bin and val.bin (stableflash data prepare makes one)")
    meta = read_meta(data_dir)
    torch.manual_seed(cfg.seed)                       # same initial weights on every rank
    model = build_model(cfg, meta["vocab_size"]).to(device)
    block = model.config.block_size
    train_data = load_split(data_dir, "train", meta["vocab_size"], block)
    val_data = load_split(data_dir, "val", meta["vocab_size"], block)
    optimizer = build_optimizer(model, cfg, device.type)
    _make_run_dir(run_dir)                # after the checks above: a run that cannot start leaves no folder

    step0 = 0
    if resume:
        state = _restore(run_dir, cfg, model, optimizer, device)
        step0 = state["step"]
        switched = state.get("attention", cfg.attention)             # a monitor may have switched layers
        if "config_version" not in state.get("config", {}):          # a checkpoint of the earlier spec grammar
            switched = upgrade_stored_spec(switched)
        model.set_attention(switched)
        if dist.is_main:
            truncate_after(run_dir / "metrics.jsonl", step0)
            truncate_after(run_dir / "probes.jsonl", step0)
    elif dist.is_main and (run_dir / checkpoint.CHECKPOINT).exists():
        raise ValueError(f"{run_dir} already holds a run; resume it (stableflash train --resume {run_dir}) or "
                         "choose another --out")
    if dist.is_main:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    sampler = BatchSampler(train_data, block, cfg.batch_size, cfg.seed)
    source = GlobalReplay(Path(cfg.replay), cfg.batch_size, block, train_data) if cfg.replay else sampler
    recorder = BatchRecorder(run_dir, dist.rank, batch_size=cfg.batch_size, block_size=block, seed=cfg.seed,
                             data_path=str(data_dir), start_step=step0)
    val_batches = eval_batches(val_data, block, cfg.batch_size, cfg.eval_iters, cfg.seed)
    val_sampler = BatchSampler(val_data, block, cfg.batch_size, cfg.seed)

    net = torch.compile(model) if cfg.compile else model
    if dist.world_size > 1:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.dtype)
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "fp16")
    kernels = device.type == "cuda" and amp_dtype is not None      # the fused kernels take bf16 / fp16 only
    accum = cfg.grad_accum // dist.world_size
    tokens_per_step = cfg.batch_size * block * cfg.grad_accum
    peak = _peak_flops(cfg, device)
    metrics = MetricsWriter(run_dir, cfg.tensorboard, enabled=dist.is_main)

    monitor = Monitor(monitor_config(cfg))
    if cfg.monitor in ("switch", "rollback") and cfg.monitor_max_logit is None and dist.is_main:
        log.warning("monitor=%s with the default indicators acts too late on most of the failing "
                    "configurations measured; warned by the largest attention logit "
                    "(--set monitor_max_logit=200, in the units of the GPT-2 and Llama presets) it acts in "
                    "time on every run it was measured on (docs/diagnostics.md)", cfg.monitor)
    stopper = ExplosionStop(cfg.stop_after_explosion)
    if step0 and cfg.stop_after_explosion:            # a resumed run keeps its running minimum and streak
        if dist.is_main and (run_dir / "metrics.jsonl").exists():
            stopper.replay(read_metrics(run_dir / "metrics.jsonl"))
        if dist.world_size > 1:                       # rank 0 holds the metrics
            state = [(stopper.running_min, stopper.above_since)]
            torch_dist.broadcast_object_list(state, src=0)
            stopper.running_min, stopper.above_since = state[0]
    tracker = DeltaTracker()
    probes = open(run_dir / "probes.jsonl", "a") if dist.is_main and cfg.probe_every else None

    def save_checkpoint(done: int) -> None:
        checkpoint.save(run_dir, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
            "config": cfg.to_dict(), "attention": str(model.attention_spec),
            "rng": {"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}})

    status, last, best_val = "finished", {}, math.inf
    bar = _quiet_monitor(tqdm)(total=cfg.max_iters, initial=step0, disable=not (progress and dist.is_main),
                               desc="train")
    step = step0
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
                sync = net.no_sync() if dist.world_size > 1 and micro < accum - 1 else contextlib.nullcontext()
                with sync, autocast():
                    _, loss = net(x, y)
                scaler.scale(loss / accum).backward()
                loss_sum += loss.detach().float()
            if scaler.is_enabled():
                for opt in optimizer.optimizers.values():
                    scaler.unscale_(opt)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
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

            # diagnostics: probes on rank 0, the monitor's decision shared with every rank
            events = monitor.observe_loss(step, loss_val) if dist.is_main else []
            if probes is not None and step % cfg.probe_every == 0:
                t_probe = time.perf_counter()
                with autocast():
                    record = probe_record(model, x, y, n_seq=cfg.probe_seqs, delta_layers=cfg.delta_layer_list(),
                                          delta_policy=cfg.delta_policy)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                record["probe_ms"] = (time.perf_counter() - t_probe) * 1e3      # what the probes cost
                for layer, info in (record.get("delta") or {}).items():
                    info["running_sum"] = tracker.update(step, int(layer), info.get("sum_over_tokens") or 0.0)
                probes.write(json.dumps({"step": step, **record}) + "\n")
                probes.flush()
                events += monitor.observe_probe(step, record)
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
                if monitor.config.action == "rollback" and (run_dir / checkpoint.CHECKPOINT).exists():
                    state = _restore(run_dir, cfg, model, optimizer, device)
                    metrics.write({"step": step, "loss": loss_val, "event": "monitor_action", "action": "rollback",
                                   "to_step": state["step"], "layers": act,
                                   "message": f"restored the checkpoint of step {state['step']}"})
                    done = state["step"]
                    recorder.close()
                    recorder = BatchRecorder(run_dir, dist.rank, batch_size=cfg.batch_size, block_size=block,
                                             seed=cfg.seed, data_path=str(data_dir), start_step=done)
                model.set_attention(spec)
                metrics.write({"step": step, "loss": loss_val, "event": "monitor_action", "action": "switch",
                               "layers": act, "attention": str(spec),
                               "message": f"layers {act} switched to stabilized attention "
                                          f"({cfg.monitor_switch_to}) from step {done}"})
            if dist.is_main and (done % cfg.ckpt_every == 0 or done == cfg.max_iters) and done == step + 1:
                save_checkpoint(done)
            bar.n = step = done
            bar.refresh()
    finally:
        bar.close()
        metrics.close()
        recorder.close()
        if probes is not None:
            probes.close()
    summary = {"status": status, "steps": (last.get("step", step0 - 1) + 1), "final_loss": last.get("loss"),
               "best_val_loss": best_val if math.isfinite(best_val) else None, "attention": cfg.attention,
               "final_attention": str(model.attention_spec), "config_version": cfg.config_version,
               "world_size": dist.world_size, "dist_backend": dist_backend, "grad_accum": cfg.grad_accum,
               "device": str(device), "data": str(data_dir), "data_meta": meta}
    if dist.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if dist.world_size > 1:
        # every rank reaches here before any tears the group down; then DDP's hold on the group is
        # released, so that destroying it ends gloo's worker threads now, with the interpreter alive,
        # rather than leaving them running into its shutdown (_init_process_group says why nothing
        # else holds it)
        torch_dist.barrier()
        del net
        gc.collect()
        torch_dist.destroy_process_group()
    return summary
