"""The training loop of `tessera train`: one function every rank runs, whatever the strategy.

Resume is exact by construction: the batch of a step is a pure function of (seed, step), and a
checkpoint holds the model, the optimizer, every rank's RNG state and the step, so a resumed run
takes the same path as one that never stopped (bit for bit on CPU).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.checkpoint import series
from tessera.checkpoint.files import load_checkpoint, save_checkpoint
from tessera.errors import CheckpointError
from tessera.runtime.context import Context, init
from tessera.runtime.flight_recorder import dump_on_failure, install_signal_dump, reached
from tessera.strategies import Engine
from tessera.train.build_model import build_model
from tessera.train.callbacks import CallbackRunner
from tessera.train.config import TrainConfig
from tessera.train.config_build import config_to_dict
from tessera.train.engine_setup import (
    build_engine,
    lr_at,
    lr_scheduler,
    make_optimizer,
    restore_lr_scheduler,
)
from tessera.train.evaluation import Evaluator
from tessera.train.faults import FaultInjector
from tessera.train.metrics import (
    MetricsLog,
    gather_rank_metrics,
    note_restart,
    peak_memory_mb,
    read_events,
    read_metrics,
)
from tessera.train.mfu import ModelFlops
from tessera.train.reporting import Reporter
from tessera.train.resume_rules import check_resume_config, check_resume_world
from tessera.train.workload import Workload, build_workload
from tessera.train.workload import corpus_batches as corpus_batches  # noqa: F401 - was here
from tessera.train.workload import next_token_loss as next_token_loss  # noqa: F401 - was here

__all__ = ["lr_at", "make_optimizer", "train_worker"]


def _gather_objects(value: Any, ctx: Context) -> list[Any]:
    if ctx.world_size == 1:
        return [value]
    boxes: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(boxes, value)
    return boxes


def _save(engine: Engine, ctx: Context, run_dir: Path, step: int, extra: dict[str, Any]) -> None:
    """Collective: write checkpoints/step-N/ whole (see `checkpoint_series`), then prune.

    Every rank writes its files into the partial folder, hashes a share of them, and rank 0
    commits the manifest and renames the folder; only then are older checkpoints deleted.
    """
    partial = series.partial_folder(run_dir, step)
    if ctx.is_main:
        series.begin_save(run_dir, step)
    _barrier(ctx)  # nobody writes before the partial folder is fresh
    state = engine.save_files(partial)  # collective; sharded engines write their own files
    rng_states = _gather_objects(torch.get_rng_state(), ctx)
    if ctx.is_main:
        save_checkpoint(
            partial / series.STATE_FILE, {"step": step, "engine": state, "rng": rng_states, **extra}
        )
    if ctx.world_size > 1:
        reached(f"checkpoint of step {step}: files written")
    _barrier(ctx)  # every file is written
    shares = _gather_objects(series.hash_share(partial, ctx.rank, ctx.world_size), ctx)
    if ctx.is_main:
        files = {name: entry for share in shares for name, entry in share.items()}
        strategy = extra["config"]["strategy"]
        series.commit(partial, step, files, world_size=ctx.world_size, strategy=strategy)
        series.prune(run_dir, extra["config"]["keep_checkpoints"])
    _barrier(ctx)  # no rank goes on (and could fail) before the checkpoint is committed


def _barrier(ctx: Context) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def _find_checkpoint(run_dir: Path, ctx: Context) -> Path:
    """Rank 0 picks the newest verified checkpoint and tells the others (all load the same)."""
    found: list[Any] = [None]
    if ctx.is_main:
        path = series.latest_checkpoint(run_dir)
        series.clean_stale(run_dir)  # what saves killed before their rename left behind
        found = [str(path) if path is not None else None]
    if ctx.world_size > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        raise CheckpointError(
            f"cannot resume {run_dir}: it holds no complete checkpoint whose checksums verify"
        )
    return Path(found[0])


def _check_identity(path: Path, state: dict[str, Any], workload: Workload) -> None:
    """Refuse a checkpoint of another workload (model, data, loss or vocabulary)."""
    for key, value in workload.identity.items():
        if state.get(key) == value:
            continue
        if key == "tokenizer":
            raise CheckpointError(f"{path} was trained on another corpus (its vocabulary differs)")
        saved = state.get(key) or {}
        differing = sorted(k for k in {*saved, *value} if saved.get(k) != value.get(k))
        raise CheckpointError(
            f"{path} was trained on another workload (differing: {', '.join(differing)})"
        )


def _restore(
    engine: Engine,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    ctx: Context,
    run_dir: Path,
    workload: Workload,
    config: TrainConfig,
) -> tuple[int, Any]:
    """Load the newest checkpoint; its step, and the loader's position (a stream's, else None)."""
    path = _find_checkpoint(run_dir, ctx)
    state = load_checkpoint(path)
    _check_identity(path, state, workload)
    if "config" in state:
        check_resume_config(state["config"], config, where=str(path))
    saved_world = len(state["rng"])
    check_resume_world(config.strategy, saved_world, ctx.world_size)
    engine.load_files(path.parent, state["engine"])
    step = int(state["step"])
    restore_lr_scheduler(scheduler, state.get("scheduler"), step)
    if saved_world == ctx.world_size:
        torch.set_rng_state(state["rng"][ctx.rank])
    else:
        # Another world size splits each batch differently, so no saved stream fits a rank:
        # dropout draws from a fresh stream per (seed, step, rank). Exact resume needs the
        # same world size; this one continues the same training, not the same random masks.
        torch.manual_seed(hash((config.seed, step, ctx.rank)) & 0x7FFF_FFFF_FFFF_FFFF)
    return step, state.get("loader")


def train_worker(
    config: TrainConfig, run_dir: str, resume: bool, callbacks: Sequence[Any] = ()
) -> dict[str, Any] | None:
    """Train on this rank; rank 0 writes the run folder and returns the summary.

    `callbacks` (`tessera.train.callbacks`) are called on rank 0; every rank gets them.

    If a collective times out (or anything fails), every rank writes its flight record to
    `run_dir/hang-rank-N.json` (`tessera.comm.flight_recorder`); a rank stopped by SIGTERM
    (the launcher's, torchrun's) writes one too, which tells where a hung rank was stuck.
    """
    ctx = init(timeout_s=config.timeout_s)
    if ctx.world_size > 1:  # a spawned rank: the signal handlers are this process's own
        install_signal_dump()
    with dump_on_failure(run_dir):
        return _train(ctx, config, run_dir, resume, callbacks)


def _to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of a batch (nested dicts, tuples, lists) on `device`; host-to-GPU copies are
    queued without waiting (`non_blocking`: asynchronous from pinned memory, the loader's for
    CUDA; the step's kernels follow them on the same stream)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return tuple(_to_device(value, device) for value in batch)
    return batch


def _step_batches(
    workload: Workload, ctx: Context, start: int, stop: int, position: Any
) -> Iterable[Any]:
    """This rank's batches of steps `start .. stop - 1`: the loader's (workers fetch them
    ahead; a stream's from `position`, its checkpointed place), or computed in this process for
    the demo's in-memory windows."""
    if workload.loader is None:
        return (workload.batches(step, ctx.rank, ctx.world_size) for step in range(start, stop))
    return workload.loader(
        start=start,
        stop=stop,
        rank=ctx.rank,
        world_size=ctx.world_size,
        pin_memory=ctx.device.type == "cuda",
        state=position,
    )


def _settle_steps(config: TrainConfig, workload: Workload) -> TrainConfig:
    """With --epochs, the run's steps: epochs * steps per epoch (the config as written keeps
    --epochs; checkpoints keep the steps it came to)."""
    if not config.loader.epochs or workload.steps_per_epoch is None:
        return config
    return dataclasses.replace(config, steps=config.loader.epochs * workload.steps_per_epoch)


def _train(
    ctx: Context, config: TrainConfig, run_dir: str, resume: bool, callbacks: Sequence[Any]
) -> dict[str, Any] | None:
    """Build the run (workload, model, engine, loader), restore it if resuming, run the steps;
    rank 0 returns the summary.

    Why so long: the step loop reads in the order a step happens (wait for the batch, train,
    time it, observe, checkpoint), and its timers and loader are its own locals; cut apart,
    they would travel through arguments.
    """
    config.check_world_size(ctx.world_size)
    out = Path(run_dir)
    workload = build_workload(config)  # the demo GPT, or --model / --data / --loss
    config = _settle_steps(config, workload)  # --epochs
    model, init_fn = build_model(workload, config, ctx.device, announce=ctx.is_main)
    model_flops = ModelFlops.for_run(model, ctx.device, ctx.world_size)  # for MFU, before splits
    if config.activation_checkpointing:
        from tessera.memory import checkpoint_activations

        checkpoint_activations(model)
    engine = build_engine(config, model, workload.loss_fn, ctx, init_fn=init_fn)
    scheduler = lr_scheduler(engine, config)  # a function of the step: resume stays exact
    start, position = (
        _restore(engine, scheduler, ctx, out, workload, config) if resume else (0, None)
    )
    watch = _Watchers.start(config, workload, ctx, out, start, callbacks, model_flops)
    faults = FaultInjector.from_env(out, ctx.rank, config, sharded=engine.sharded_checkpoint)
    extra = {**workload.identity, "config": config_to_dict(config)}
    stopped_at: int | None = None
    wall_start = last_end = time.perf_counter()  # a step's time runs from the one before's end
    source = _step_batches(workload, ctx, start, config.steps, position)
    batches = iter(source)  # starts the loader's workers: the first step waits for them
    for step in range(start, config.steps):
        faults.at_step(step + 1)  # TESSERA_FAULT: off unless set
        if ctx.world_size > 1:
            reached(f"step {step + 1}")  # names a rank that stops, if a gloo call times out
        waited = time.perf_counter()
        batch = _to_device(next(batches), ctx.device)  # what the loader had not fetched yet
        data_s = time.perf_counter() - waited
        # an (inputs, targets) pair or a dict: the engine applies the batch rule
        # (tessera.strategies.batch) with the workload's loss
        loss = engine.train_step(batch)
        lr = engine.optimizer.param_groups[0]["lr"]  # this step's, set by the scheduler
        engine.step()  # clips to config.grad_clip, then the optimizer step
        scheduler.step()
        step_end = time.perf_counter()
        step_s = step_end - last_end
        done = step + 1
        measured = {
            "loss": loss,
            "step_s": step_s,
            "data_s": data_s,
            "comm_s": engine.comm_seconds,
        }
        evaluated_s = watch.evaluator.spent_s
        stop = _observe(watch, engine, ctx, config, done, measured, lr)
        skipped_s = watch.evaluator.spent_s - evaluated_s  # not the next step's time
        if watch.reporter is not None:
            watch.reporter.advance()
        if (
            stop
            or done == config.steps
            or (config.checkpoint_every and done % config.checkpoint_every == 0)
        ):
            saving = time.perf_counter()
            loader = source.state_dict() if hasattr(source, "state_dict") else None  # a stream's
            _save(
                engine,
                ctx,
                out,
                done,
                {**extra, "scheduler": scheduler.state_dict(), "loader": loader},
            )
            skipped_s += time.perf_counter() - saving
        if stop:  # a callback raised StopTraining on rank 0; every rank ends here
            stopped_at = done
            break
        # the next step's time holds this one's logging, not its evaluation or checkpoint
        last_end = step_end + skipped_s
    if watch.reporter is not None:
        watch.reporter.close()
    sample = _sample(engine, workload, ctx.is_main, out)
    engine.close()  # e.g. offload="nvme": its swap files go now, not at interpreter exit
    if not ctx.is_main:
        return None
    summary = _summary(out, config, ctx, sample, time.perf_counter() - wall_start, start)
    if stopped_at is not None:
        summary["steps_this_run"] = stopped_at - start
    summary["stopped_at"] = stopped_at  # None: ran to --steps
    summary["stop_reason"] = watch.callbacks.stop_reason
    summary["unit"] = workload.unit
    summary["mfu_peak"] = model_flops.peak_source
    if workload.sample is None:
        summary["sample_note"] = "no sample.txt: it is generated for the demo GPT only"
    return summary


def _sample(engine: Engine, workload: Workload, is_main: bool, out: Path) -> str:
    """The demo GPT's text sample, written to sample.txt on rank 0; "" for a user's model.

    Only the sample needs the whole model, gathered on every rank (collective for strategies
    that shard it): a user's model is never gathered, so no rank of a zero3 run holds it."""
    if workload.sample is None:
        return ""
    weights = engine.full_state_dict()
    if not is_main:
        return ""
    sample = workload.sample({name: t.detach().cpu() for name, t in weights.items()})
    (out / "sample.txt").write_text(sample)
    return sample


@dataclass
class _Watchers:
    """What watches the steps: metrics.jsonl and the progress display / TensorBoard (rank 0's,
    else None), the evaluation, the callbacks."""

    log: MetricsLog | None
    reporter: Reporter | None
    evaluator: Evaluator
    callbacks: CallbackRunner
    tokens_per_step: int
    """Tokens of one optimizer step, or 0 when the items are not token ids."""
    samples_per_step: int
    steps_per_epoch: int | None
    model_flops: ModelFlops
    """For the MFU of each logged record (its peak is measured on rank 0 only, when first asked)."""

    @classmethod
    def start(
        cls,
        config: TrainConfig,
        workload: Workload,
        ctx: Context,
        out: Path,
        start: int,
        callbacks: Sequence[Any],
        model_flops: ModelFlops,
    ) -> _Watchers:
        """The watchers of a run that starts after step `start` (metrics.jsonl continues there,
        and says so where the run restarted)."""
        log = MetricsLog(out / "metrics.jsonl", resume_from_step=start) if ctx.is_main else None
        note_restart(log, start, ctx.world_size)
        reporter = None
        if ctx.is_main:
            title = f"{config.strategy} x{ctx.world_size}"
            reporter = Reporter(config, out, start, workload.unit, title)
        evaluator = Evaluator(config, workload, ctx, _to_device)
        runner = CallbackRunner(callbacks, ctx)
        tokens = workload.tokens_per_step if workload.unit == "tokens" else 0
        per_epoch = workload.steps_per_epoch
        return cls(
            log, reporter, evaluator, runner, tokens, config.step_batch_size, per_epoch, model_flops
        )


def _observe(
    watch: _Watchers,
    engine: Engine,
    ctx: Context,
    config: TrainConfig,
    done: int,
    measured: dict[str, Any],
    lr: float,
) -> bool:
    """After step `done`: evaluate if due, gather the step's record and log it (every
    log_every, at evaluations, at the end), call the callbacks; collective. True: stop now
    (a callback raised StopTraining), after evaluating the model the run ends with if the run
    evaluates and this step was not an evaluation's: its loss goes into the logged record, the
    callbacks are not called again)."""
    evaluated = watch.evaluator.due(done)
    val_loss = watch.evaluator.run(engine) if evaluated else None
    logged = done % config.log_every == 0 or done == config.steps or evaluated
    if not (logged or watch.callbacks.active):
        return False
    measured = {
        **measured,
        "loss": float(measured["loss"]),  # a StepLoss: read from the device at logged steps only
        "peak_mem_mb": peak_memory_mb(ctx.device),
        "model_state_mb": _model_state_mb(engine),
    }
    ranks = gather_rank_metrics(measured, ctx.device)
    record = _record(done, ranks, watch.tokens_per_step, lr, samples=watch.samples_per_step)
    if watch.steps_per_epoch is not None:
        record["epoch"] = done / watch.steps_per_epoch  # epochs done, as Hugging Face logs it
    if watch.log is not None:  # rank 0, where the record is logged and the callbacks run
        # model FLOPs are counted per token, or per sample for data that is not token ids
        record["mfu"] = watch.model_flops.mfu(record.get("tokens_per_s", record["samples_per_s"]))
    if engine.loss_scaler is not None:  # fp16: the same on every rank (global check)
        record["loss_scale"] = engine.loss_scale
        record["skipped"] = engine.skipped_steps
    if val_loss is not None:
        record["val_loss"] = val_loss
        watch.callbacks.eval_end(done, record)
    watch.callbacks.step_end(done, record)
    stop = watch.callbacks.should_stop()
    if stop and not evaluated and watch.evaluator.every > 0:  # the model the run ends with
        record["val_loss"] = watch.evaluator.run(engine)  # every rank knows `stop`: collective
    if (logged or stop) and watch.log is not None and watch.reporter is not None:
        watch.log.write(record)
        watch.reporter.report(record)
    return stop


def _record(
    step: int, ranks: list[dict[str, float]], tokens: int, lr: float, *, samples: int = 0
) -> dict[str, Any]:
    """One logged step from every rank's measurements: `samples_per_s` (with `samples` per
    step) and `tokens_per_s` (with `tokens` per step; 0: items are not token ids) over the
    slowest rank's step time, which includes its wait for the batch (`data_s`)."""
    slowest = max(
        r["step_s"] for r in ranks
    )  # a synchronous step lasts as long as its slowest rank
    comm = max(r["comm_s"] for r in ranks)
    record: dict[str, Any] = {"step": step, "loss": statistics.fmean(r["loss"] for r in ranks)}
    record["lr"] = lr  # (train_step gives every rank the global mean: their mean is it)
    if samples:
        record["samples_per_s"] = samples / slowest
    if tokens:
        record["tokens_per_s"] = tokens / slowest
    data = max(r.get("data_s", 0.0) for r in ranks)
    record.update(step_s=slowest, compute_s=max(0.0, slowest - comm - data), comm_s=comm)
    if all("data_s" in r for r in ranks):
        record["data_s"] = data
    record["peak_mem_mb"] = [round(r["peak_mem_mb"], 1) for r in ranks]
    if all(r["model_state_mb"] >= 0 for r in ranks):
        record["model_state_mb"] = [round(r["model_state_mb"], 3) for r in ranks]
    return record


def _model_state_mb(engine: Engine) -> float:
    """This rank's model-state megabytes, or -1 when the strategy does not measure them."""
    measured = engine.model_state_bytes()
    return -1.0 if measured is None else measured / 2**20


def _summary(
    out: Path, config: TrainConfig, ctx: Context, sample: str, wall_s: float, start: int
) -> dict[str, Any]:
    from tessera.viz import plot_loss

    records = read_metrics(out / "metrics.jsonl")
    plot_loss(records, out / "loss.png", title=f"{config.strategy}, {ctx.world_size} ranks")
    this_run = [r for r in records if r["step"] > start] or records
    evaluated = [r for r in records if "val_loss" in r]
    median = statistics.median
    return {
        "run_dir": str(out),
        "strategy": config.strategy,
        "world_size": ctx.world_size,
        "steps": config.steps,
        "steps_this_run": config.steps - start,
        "first_loss": records[0]["loss"] if records else float("nan"),
        "final_loss": records[-1]["loss"] if records else float("nan"),
        **{
            key: median(r[key] for r in this_run)
            for key in ("step_s", "data_s")
            if this_run and all(key in r for r in this_run)
        },
        **{  # all the logged steps' items over all their time, data waits included: the
            # wall-clock rate (a median of per-step rates is not, when waits are uneven)
            key: sum(r[key] * r["step_s"] for r in this_run) / sum(r["step_s"] for r in this_run)
            for key in ("samples_per_s", "tokens_per_s")
            if this_run and all(key in r for r in this_run)
        },
        "comm_s": median(r["comm_s"] for r in this_run),
        "mfu": median(r.get("mfu", float("nan")) for r in this_run),
        "peak_mem_mb": this_run[-1]["peak_mem_mb"],
        "model_state_mb": this_run[-1].get("model_state_mb"),
        "wall_s": wall_s,
        "restarts": len(read_events(out / "metrics.jsonl", "restart")),
        "val_loss": evaluated[-1]["val_loss"] if evaluated else None,
        "sample": sample,
    }
