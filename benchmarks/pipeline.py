"""tessera pipelines (GPipe, 1F1B, naive) vs torch.distributed.pipelining, side by side in one run.

Model (issue 6): 8 blocks of Linear(512, 1024) - GELU - Linear(1024, 512), batch 64, MSE loss, SGD;
cut into 2 and 4 equal stages, m = 4, 8, 16 micro-batches. Engines alternate in rounds (tessera
GPipe, tessera 1F1B, the same two with weight gradients computed inside B ("eager W") instead of
tessera's default deferred W pass, the same two with their links over gloo instead of shared
memory ("gloo links", issue 11), torch GPipe, torch 1F1B, one step each, repeated) on the same
split and batch; a step is timed from a barrier to its end on the slowest rank; medians over rounds.
Also reported: one process on the whole model (rank 0 alone, the others
wait), the ideal pipelined step `(one-process / p) / (1 - idle)` with the closed-form idle
share, tessera's measured idle share (mean over stages, from its timeline) against the closed
form, the peak bytes of activations saved for backward on stage 0 (a saved-tensor hook
counting live bytes, parameters excluded) and, for the deferred W pass, the bytes of linear
inputs and output gradients it keeps until then (`pipe.deferral.peak_bytes`).

    python benchmarks/pipeline.py [--quick] [--microbatches 4 8] [--rounds 12]

Writes benchmarks/results/pipeline.{json,md}, docs/pipeline_{gpipe,1f1b}.{png,json} and the
timeline of the RNN wavefront, docs/wavefront_lstm.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.pipeline import Pipeline, idle_fraction, measured_idle_fraction

HERE = Path(__file__).parent
RESULTS, DOCS = HERE / "results", HERE.parent / "docs"
BATCH, WIDTH, HIDDEN, BLOCKS = 64, 512, 1024, 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
            for _ in range(BLOCKS)
        ]
    )


class SavedBytes:
    """Live bytes of tensors autograd saved for backward (parameters excluded); keeps the peak."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        if tensor.untyped_storage().data_ptr() in self.skip:
            return tensor
        return _Box(tensor, self)

    @staticmethod
    def unpack(box: object) -> torch.Tensor:
        return box.tensor if isinstance(box, _Box) else box


class _Box:
    __slots__ = ("tensor", "size", "owner")

    def __init__(self, tensor: torch.Tensor, owner: SavedBytes) -> None:
        self.tensor, self.owner = tensor, owner
        self.size = tensor.numel() * tensor.element_size()
        owner.live += self.size
        owner.peak = max(owner.peak, owner.live)

    def __del__(self) -> None:
        self.owner.live -= self.size


TARGET = 1.5
"""Issue 11's target for `vs torch` (tessera's default engines, m = 4 and 8, 2 and 4 stages)."""
TARGET_M = (4, 8)


def _tessera_engine(schedule: str, m: int, num_stages: int, defer: bool = True, shm: bool = True):
    pipe = Pipeline(
        _model(),
        num_microbatches=m,
        schedule=schedule,
        balance=[BLOCKS // num_stages] * num_stages,
        defer_weight_grads=defer,
        shm_links=shm,
    )
    if shm:  # one host: every link must have found shared memory, or the row would mislead
        assert set(map(pipe.links.transport, pipe.links.channels)) == {"shm"}
        assert len(pipe.links.channels) == (1 if pipe.is_first or pipe.is_last else 2)
    optimizer = torch.optim.SGD(pipe.module.parameters(), lr=1e-3)

    def step(x, y):
        pipe.train_step(x, y, F.mse_loss)
        optimizer.step()
        optimizer.zero_grad()

    return step, list(pipe.module.parameters()), pipe


def _torch_engine(schedule: str, m: int, num_stages: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, per = dist.get_rank(), BLOCKS // num_stages
    module = nn.Sequential(*list(_model())[rank * per : (rank + 1) * per])
    stage = PipelineStage(module, rank, num_stages, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    runner = cls(stage, n_microbatches=m, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step(x, y):
        if rank == 0:
            runner.step(x)
        elif rank == num_stages - 1:
            runner.step(target=y, losses=[])
        else:
            runner.step()
        optimizer.step()
        optimizer.zero_grad()

    return step, list(module.parameters()), None


def _timed(step, params, x, y) -> tuple[float, int]:
    saved = SavedBytes(params)
    dist.barrier()
    began = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        step(x, y)
    took = torch.tensor([time.perf_counter() - began])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took), saved.peak


def _one_process(x, y, steps: int, m: int = 1, model_fn=None) -> float:
    """Median step of the whole model (`model_fn()`, default `_model()`) on rank 0 while the
    other ranks wait; with m > 1 the batch is processed as m accumulated micro-batches (the
    compute a pipeline of m cannot avoid)."""
    times = []
    if dist.get_rank() == 0:
        model = (model_fn or _model)()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(steps + 1):
            began = time.perf_counter()
            for x_part, y_part in zip(x.chunk(m), y.chunk(m)):
                (F.mse_loss(model(x_part), y_part) / m).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - began)
    box = [statistics.median(times[1:]) if times else 0.0]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _bench(num_stages: int, microbatches: list[int], rounds: int) -> dict:
    tessera.init()
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    one = _one_process(x, y, rounds)
    rows, timelines = [], {}
    naive_step, naive_params, _ = _tessera_engine("naive", 1, num_stages)
    for m in microbatches:
        one_micro = _one_process(x, y, rounds, m)
        engines = {
            "tessera gpipe": _tessera_engine("gpipe", m, num_stages),
            "tessera 1f1b": _tessera_engine("1f1b", m, num_stages),
            "tessera gpipe eager-W": _tessera_engine("gpipe", m, num_stages, defer=False),
            "tessera 1f1b eager-W": _tessera_engine("1f1b", m, num_stages, defer=False),
            "tessera gpipe gloo-links": _tessera_engine("gpipe", m, num_stages, shm=False),
            "tessera 1f1b gloo-links": _tessera_engine("1f1b", m, num_stages, shm=False),
            "torch gpipe": _torch_engine("gpipe", m, num_stages),
            "torch 1f1b": _torch_engine("1f1b", m, num_stages),
        }
        if m == microbatches[0]:
            engines["tessera naive (m=1)"] = (naive_step, naive_params, None)
        times = {name: [] for name in engines}
        peaks, idle = {}, {}
        for step, params, _ in engines.values():
            _timed(step, params, x, y)  # warm-up (torch infers shapes on its first step)
        for _ in range(rounds):  # engines interleaved step by step: they see the same load
            for name, (step, params, pipe) in engines.items():
                took, peaks[name] = _timed(step, params, x, y)
                times[name].append(took)
                if pipe is not None:
                    events = pipe.gather_timeline()
                    mean_idle = statistics.fmean(measured_idle_fraction(events))
                    idle.setdefault(name, []).append(mean_idle)
                    timelines.setdefault((name, m), []).append((took, events))
        for name in engines:
            schedule = name.split()[1]
            closed = idle_fraction(schedule, num_stages, 1 if "naive" in name else m)
            rows.append(
                {
                    "stages": num_stages,
                    "m": 1 if "naive" in name else m,
                    "engine": name,
                    "step_ms": statistics.median(times[name]) * 1e3,
                    "peak_saved_mb_stage0": _stage0(peaks[name]) / 2**20,
                    "w_stash_mb_stage0": _stage0(_stash_bytes(engines[name][2])) / 2**20,
                    "measured_idle": statistics.median(idle[name]) if name in idle else None,
                    "closed_form_idle": closed,
                    "ideal_ms": one / num_stages / (1 - closed) * 1e3,
                    # the same, from one process running m micro-batches: per-micro-batch
                    # overhead of small matmuls included, communication and contention not
                    "ideal_microbatched_ms": (one if "naive" in name else one_micro)
                    / num_stages
                    / (1 - closed)
                    * 1e3,
                }
            )
    return {
        "one_process_ms": one * 1e3,
        "rows": rows,
        # the drawn timeline is the step of median duration, not an outlier
        "timelines": {
            key: sorted(runs, key=lambda run: run[0])[len(runs) // 2][1]
            for key, runs in timelines.items()
        }
        if dist.get_rank() == 0
        else {},
    }


def _stash_bytes(pipe: Pipeline | None) -> int:
    deferral = pipe.deferral if pipe is not None else None
    return deferral.peak_bytes if deferral is not None else 0


def _stage0(peak: int) -> int:
    box = torch.tensor([peak if dist.get_rank() == 0 else 0])
    dist.all_reduce(box)
    return int(box)


def _table(results: list[dict]) -> list[str]:
    lines = [
        "| stages | m | engine | step ms | vs torch (same schedule) | target | ideal ms "
        "| step / ideal "
        "| ideal at micro-batch size ms | step / that | measured idle | closed-form idle "
        "| peak saved MB (stage 0) | W stash MB (stage 0) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        by = {(r["engine"], r["m"]): r for r in result["rows"]}
        for r in result["rows"]:
            schedule = r["engine"].split()[1]
            anchor = by.get((f"torch {schedule}", r["m"]))
            ratio = (
                f"**{anchor['step_ms'] / r['step_ms']:.2f}**"
                if anchor and "tessera" in r["engine"]
                else ""
            )
            idle = f"{r['measured_idle']:.3f}" if r["measured_idle"] is not None else ""
            target = ""
            if r["engine"] in ("tessera gpipe", "tessera 1f1b") and r["m"] in TARGET_M:
                met = anchor["step_ms"] / r["step_ms"] >= TARGET
                target = f">= {TARGET} {'met' if met else 'missed'}"
            lines.append(
                f"| {r['stages']} | {r['m']} | {r['engine']} | {r['step_ms']:.1f} | {ratio} | "
                f"{target} | "
                f"{r['ideal_ms']:.1f} | {r['step_ms'] / r['ideal_ms']:.2f} | "
                f"{r['ideal_microbatched_ms']:.1f} | "
                f"{r['step_ms'] / r['ideal_microbatched_ms']:.2f} | "
                f"{idle} | "
                f"{r['closed_form_idle']:.3f} | {r['peak_saved_mb_stage0']:.1f} | "
                f"{r['w_stash_mb_stage0']:.1f} |"
            )
    return lines


def _breakdown(results: list[dict]) -> list[str]:
    """Where each stage's time goes in the drawn (median) step, m = 8: compute, waiting for a
    message (recv, the copy out included) and posting sends (a copy into the ring; over gloo,
    the isend), in ms, so the link's share is read from the measured timeline."""
    lines = [
        "| stages | engine | stage | step span ms | F | B | W | recv wait | send | idle share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for (name, _m), events in sorted(result["breakdown"].items()):
            span = (max(e.end for e in events) - min(e.start for e in events)) * 1e3
            idle = measured_idle_fraction(events)
            for stage in range(result["rows"][0]["stages"]):
                ms = {k: 0.0 for k in ("F", "B", "W", "recv", "send")}
                for e in events:
                    if e.stage == stage:
                        ms[e.kind] += e.duration * 1e3
                lines.append(
                    f"| {result['rows'][0]['stages']} | {name} | {stage} | {span:.1f} | "
                    + " | ".join(f"{ms[k]:.1f}" for k in ms)
                    + f" | {idle[stage]:.2f} |"
                )
    return lines


def _links(sizes: list[int], rounds: int, block: int = 25) -> list[dict]:
    """2 ranks: round trips of one message over a stage link, shared memory vs gloo,
    interleaved in blocks of `block`; medians of the sender's send call and of the round trip."""
    from tessera.pipeline.links import Links

    ctx = tessera.init()
    peer = 1 - ctx.rank
    links = {
        "shm": Links(None, 60.0, shm_with=(peer,), slots=4),
        "gloo": Links(None, 60.0),
    }
    assert links["shm"].transport(peer) == "shm" and links["gloo"].transport(peer) == "gloo"
    rows = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        send_s = {name: [] for name in links}
        trip_s = {name: [] for name in links}
        for _ in range(rounds):
            for name, link in links.items():
                dist.barrier()
                for tag in range(block):
                    if ctx.rank == 0:
                        began = time.perf_counter()
                        work = link.send(x, peer, tag)
                        sent = time.perf_counter()
                        link.recv(x.shape, x.dtype, peer, tag)
                        trip_s[name].append(time.perf_counter() - began)
                        send_s[name].append(sent - began)
                        link.wait(work, "link benchmark send")
                    else:
                        got = link.recv(x.shape, x.dtype, peer, tag)
                        link.wait(link.send(got, peer, tag), "link benchmark send")
        for name in links:
            rows.append(
                {
                    "bytes": nbytes,
                    "transport": name,
                    "send_call_us": statistics.median(send_s[name] or [0.0]) * 1e6,
                    "round_trip_us": statistics.median(trip_s[name] or [0.0]) * 1e6,
                }
            )
    return rows


def _links_table(rows: list[dict]) -> list[str]:
    lines = [
        "| message | transport | send call µs (median) | round trip µs (median) |"
        " round trip gloo / shm |",
        "|---|---|---|---|---|",
    ]
    trips = {(r["bytes"], r["transport"]): r["round_trip_us"] for r in rows}
    for r in rows:
        ratio = ""
        if r["transport"] == "shm":
            ratio = f"**{trips[(r['bytes'], 'gloo')] / r['round_trip_us']:.2f}**"
        lines.append(
            f"| {r['bytes'] // 1024} KB | {r['transport']} | {r['send_call_us']:.0f} | "
            f"{r['round_trip_us']:.0f} | {ratio} |"
        )
    return lines


def _wavefront(hidden: int, steps: int) -> list:
    """A 4-layer LSTM split one layer per rank: forward and backward timeline of one call."""
    from tessera.pipeline import wavefront

    ctx = tessera.init()
    torch.manual_seed(0)
    lstm = nn.LSTM(hidden, hidden, num_layers=ctx.world_size)
    split = wavefront(lstm)
    x = torch.randn(steps, 32, hidden)
    for _ in range(2):  # the second call is the measured one
        out, _ = split(x)
        out.square().mean().backward()
    return split.gather_timeline()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 stages, m = 4 and 8, fewer steps")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    ms = sorted(set(args.microbatches) | {8})  # m = 8: the drawn timelines
    plan = [(2, [4, 8])] if args.quick else [(2, ms), (4, ms)]
    rounds = 4 if args.quick else args.rounds
    results = []
    for num_stages, ms in plan:
        result = tessera.launch(_bench, num_stages, num_stages, ms, rounds, deadline_s=1800)[0]
        print(f"{num_stages} stages: one process {result['one_process_ms']:.1f} ms/step")
        if num_stages == 2:
            from tessera.viz.timeline import pipeline_timeline

            for name, links in [("gpipe", ""), ("1f1b", ""), ("1f1b", " gloo-links")]:
                events = result["timelines"][(f"tessera {name}{links}", 8)]
                stem = f"pipeline_{name}" + ("_gloo_links" if links else "")
                pipeline_timeline(
                    events,
                    DOCS / f"{stem}.png",
                    title=f"tessera {name}{links}, 2 stages, m = 8 (measured, the median step)",
                )
                pipeline_timeline(events, DOCS / f"{stem}.json")
        timelines = result.pop("timelines")
        result["breakdown"] = {
            key: events
            for key, events in timelines.items()
            if key[1] == 8 and key[0] in ("tessera 1f1b", "tessera 1f1b gloo-links")
        }
        results.append(result)
    from tessera.viz.timeline import pipeline_timeline

    events = tessera.launch(_wavefront, 4, 1024, 16, deadline_s=600)[0]
    title = "wavefront LSTM (hidden 1024, batch 32), 4 layers on 4 ranks, 16 time steps"
    pipeline_timeline(events, DOCS / "wavefront_lstm.png", title=title)
    lines = _table(results)
    print("\n".join(lines))
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, 1 thread per "
        f"rank, torch {torch.__version__}"
    )
    breakdown = _breakdown(results)
    print("\n".join(breakdown))
    # the link alone: an 8-row and a 32-row activation of this model (m = 8 and m = 2)
    link_rows = tessera.launch(_links, 2, [16 << 10, 64 << 10, 1 << 20], 8, deadline_s=600)[0]
    link_lines = _links_table(link_rows)
    print("\n".join(link_lines))
    for result in results:
        result.pop("breakdown")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline.json").write_text(
        json.dumps({"machine": machine, "results": results, "links": link_rows}, indent=2) + "\n"
    )
    header = [
        "## pipeline: tessera GPipe / 1F1B / naive vs torch.distributed.pipelining",
        "",
        f"{machine}; 8 blocks of Linear(512,1024)-GELU-Linear(1024,512), batch 64, SGD, one "
        "machine (2 cores: 4 stages oversubscribe them). tessera's stage links go through "
        "shared-memory rings (`gloo-links` rows: through gloo, as before issue 11); torch's "
        "through gloo. The target column is issue 11's (`vs torch` >= 1.5 at m = 4 and 8). "
        "One process: "
        + ", ".join(
            f"{r['one_process_ms']:.1f} ms/step ({r['rows'][0]['stages']}-stage run)"
            for r in results
        )
        + ". `vs torch` = torch step time / tessera step time for the same schedule and m "
        "(above 1: tessera faster). Ideal = (one process / p) / (1 - closed-form idle). Idle = "
        "share of the step a stage does no F, B or W (mean over stages, tessera's measured "
        "timeline). Ideal at micro-batch size: the same formula from one process running the "
        "batch as m accumulated micro-batches (small matmuls cost more per row on CPU). "
        "Peak saved MB = activations held for backward on stage 0 (GPipe holds m "
        "micro-batches, 1F1B at most p); W stash MB = what tessera's deferred W pass keeps "
        "from each micro-batch's B until the end of the step (linear inputs and output "
        "gradients: O(m) for both schedules), 0 for eager-W. Both tessera and torch run in the "
        "same processes, whose glibc malloc `tessera.init()` sets to keep freed memory.",
        "",
    ]
    footer = [
        "",
        "Measured timelines of the median step, 2 stages, m = 8 (blue F, orange B, red W pass, "
        "grey waits, green sends; chrome traces beside them as .json, for Perfetto):",
        "",
        "![tessera GPipe](docs/pipeline_gpipe.png)",
        "![tessera 1F1B](docs/pipeline_1f1b.png)",
        "",
        "The same 1F1B with its link over gloo (before issue 11), for comparison:",
        "",
        "![tessera 1F1B, gloo links](docs/pipeline_1f1b_gloo_links.png)",
        "",
        "Where the time goes in the median 1F1B step at m = 8 (ms per stage, from the measured "
        "timeline): the step is bounded by its longest stage's F + B + W plus the time it "
        "waits for messages; the links' own cost is the send column (and the copy out inside "
        "recv wait).",
        "",
        *breakdown,
        "",
        "One stage link alone, 2 ranks: a message sent to the peer and sent back (round trip), "
        "shared-memory ring vs gloo, interleaved in blocks of 25; send call = time until the "
        "sender's send returns (ring: the copy into a slot; gloo: posting the isend).",
        "",
        *link_lines,
    ]
    (RESULTS / "pipeline.md").write_text("\n".join(header + lines + footer) + "\n")


if __name__ == "__main__":
    main()
