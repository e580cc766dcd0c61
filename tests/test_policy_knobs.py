"""Each knob has one home: every policy field has one validator, and the trainer's flag for it
takes its default from there and is refused by that same validator, not by a check of its own.

The validator of a field is found, not declared: the function that raises on a bad value (the
innermost tessera frame of the ValueError). The trainer's refusal of the same bad value must
come from that very function (the cause of its ConfigError), so a second check of the knob in
`tessera.train` (the trainer once checked `bucket_cap_mb`, the schedule, the offload group...
itself) fails this test.
"""

from __future__ import annotations

import dataclasses
import traceback
import typing
from pathlib import Path
from typing import Any

import pytest

import tessera
from tessera.strategies.registry import builtin_policies
from tessera.train import TrainConfig, build_config
from tessera.zero.policy import OffloadPolicy

PACKAGE = Path(tessera.__file__).parent

BAD: dict[tuple[str, str], Any] = {
    ("DDPPolicy", "bucket_cap_mb"): 0.0,
    ("DDPPolicy", "algorithm"): "telepathy",
    ("DDPPolicy", "find_unused_parameters"): "yes",
    ("TorchDDPPolicy", "find_unused_parameters"): "yes",
    ("LocalSGDPolicy", "average_every"): 0,
    ("LocalSGDPolicy", "algorithm"): "telepathy",
    ("ZeroPolicy", "bucket_cap_mb"): -1.0,
    ("ZeroPolicy", "mixed_precision"): "fp8",
    ("ZeroPolicy", "offload"): "gpu",
    ("ZeroPolicy", "init_fn"): 3,
    ("OffloadPolicy", "device"): "gpu",
    ("OffloadPolicy", "nvme_buffer_mb"): 0.0,
    ("OffloadPolicy", "params"): "yes",
    ("OffloadPolicy", "moments"): "fp16",
    ("OffloadPolicy", "delayed_update"): "yes",
    ("OffloadPolicy", "delayed_update_after"): 0,
    ("PipelinePolicy", "split"): ["a", "a"],
    ("PipelinePolicy", "microbatches"): 0,
    ("PipelinePolicy", "schedule"): "zigzag",
    ("PipelinePolicy", "virtual_stages"): 0,
    ("PipelinePolicy", "defer_weight_grads"): "yes",
    ("TensorPolicy", "plan"): {},
    ("HybridPolicy", "dp"): 0,
    ("HybridPolicy", "tp"): 0,
    ("HybridPolicy", "pp"): -1,
    ("HybridPolicy", "zero"): 3,
    ("HybridPolicy", "pipeline"): "1f1b",
    ("HybridPolicy", "tensor"): {},
    ("HybridPolicy", "data"): 25.0,
    ("PSPolicy", "servers"): 0,
    ("PSPolicy", "workers"): 0,
    ("PSPolicy", "consistency"): "eventual",
    ("PSPolicy", "staleness"): -1,
    ("PSPolicy", "slow_worker"): "9:2",
}
"""A value each policy field refuses."""

NO_VALUE_CHECK = {
    ("OffloadPolicy", "nvme_dir"): "a folder, checked where the files go (optim.swap_files)",
    ("ZeroPolicy", "units"): "module classes or name patterns, checked against the model",
}
"""Fields without a check of their value alone, and where they are checked instead."""

TRAINER_FORM = {"split": "a,a", "offload": "gpu"}
"""Knobs whose command-line form differs from the policy's value: a bad one in that form."""

NOT_THE_POLICY = {
    "split": "goes with --model (a user's model), then checked by PipelinePolicy as here",
    "tp_plan": "a file; the trainer offers column, row and embedding (config_sources.read_tp_plan)",
    "nvme_dir": "a folder that must exist (optim.swap_files.check_swap_dir)",
}
"""Trainer knobs checked where their form is read, before the policy sees them."""


def _policies() -> list[type]:
    """Every policy class of tessera's strategies (the parameter server's job's too), with the
    parts they hold."""
    found: list[type] = []
    for cls in builtin_policies():
        for each in (cls, *typing.get_type_hints(cls).values(), OffloadPolicy):
            if isinstance(each, type) and dataclasses.is_dataclass(each) and each not in found:
                found.append(each)
    return found


def _validator(exc: BaseException) -> str:
    """`file:function` of the innermost tessera frame that raised `exc`."""
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    ours = [f for f in frames if f.f_code.co_filename.startswith(str(PACKAGE))]
    code = ours[-1].f_code
    return f"{Path(code.co_filename).relative_to(PACKAGE)}:{code.co_qualname}"


def _field_validators() -> dict[tuple[str, str], str]:
    """(policy, field) -> its validator, found by building the policy with the field's bad value."""
    validators = {}
    for cls in _policies():
        for field in dataclasses.fields(cls):
            key = (cls.__name__, field.name)
            if key in NO_VALUE_CHECK:
                continue
            assert key in BAD, f"{key}: a new policy field; give it a check and a bad value here"
            with pytest.raises(ValueError) as caught:
                cls(**{field.name: BAD[key]})
            validators[key] = _validator(caught.value)
    return validators


def test_every_policy_field_has_a_validator_in_its_library():
    validators = _field_validators()
    assert len(validators) + len(NO_VALUE_CHECK) == sum(
        len(dataclasses.fields(cls)) for cls in _policies()
    )
    for key, where in validators.items():
        # its library's code (a policy, or the check it calls), never the trainer's or setup's
        assert not where.startswith(("train/", "strategies/", "cli.py")), (key, where)
    # a knob two policies hold has one validator: ZeRO's bucket size is DDP's
    assert validators["ZeroPolicy", "bucket_cap_mb"] == validators["DDPPolicy", "bucket_cap_mb"]
    assert validators["HybridPolicy", "dp"] == validators["HybridPolicy", "tp"]


def test_every_trainer_knob_takes_its_default_and_its_check_from_its_policy():
    validators = _field_validators()
    knobs = [f for f in dataclasses.fields(TrainConfig) if "policy" in f.metadata]
    assert {f.name for f in knobs} >= {"bucket_cap_mb", "schedule", "offload_moments", "dp"}
    for knob in knobs:
        home, name = knob.metadata["policy"]
        assert knob.default == home.__dataclass_fields__[name].default, knob.name  # declared once
        if knob.name in NOT_THE_POLICY:
            continue
        key = (home.__name__, name)
        bad = TRAINER_FORM.get(knob.name, BAD.get(key))
        if not isinstance(bad, type(knob.default)) and knob.default is not None:
            continue  # a wrong type: refused by the config's type check, before any policy
        layer = {"offload": "cpu"} if home is OffloadPolicy else {}
        with pytest.raises(tessera.errors.ConfigError) as caught:
            build_config({"strategy": "zero2", **layer, knob.name: bad})
        cause = caught.value.__cause__
        assert cause is not None, f"--{knob.name} {bad!r}: refused by the trainer's own check"
        expected = validators.get(key) or _validator_of_part(home, name, bad)
        assert _validator(cause) == expected, (knob.name, _validator(cause), expected)


def _validator_of_part(home: type, name: str, bad: Any) -> str:
    with pytest.raises(ValueError) as caught:
        home(**{name: bad})
    return _validator(caught.value)


def test_the_hybrid_policy_holds_its_parts_policies_and_takes_their_knobs_by_name():
    from tessera.data_parallel.policy import DDPPolicy
    from tessera.pipeline.policy import HybridPolicy, PipelinePolicy
    from tessera.strategies.entry import make_policy
    from tessera.tensor_parallel.policy import TensorPolicy

    knobs = {"microbatches": 8, "plan": {"fc*": "column"}, "bucket_cap_mb": 5.0}
    flat = make_policy("hybrid", {"dp": 2, **knobs, "find_unused_parameters": True})
    parts = HybridPolicy(
        dp=2,
        pipeline=PipelinePolicy(microbatches=8),
        tensor=TensorPolicy(plan={"fc*": "column"}),
        data=DDPPolicy(bucket_cap_mb=5.0, find_unused_parameters=True),
    )
    assert flat == parts and (flat.microbatches, flat.bucket_cap_mb, flat.plan) == (
        8, 5.0, {"fc*": "column"}
    )  # fmt: skip
    # no knob of a part is a field of the mix: one default each, in its part
    names = {f.name for f in dataclasses.fields(HybridPolicy)}
    assert names == {"dp", "tp", "pp", "zero", "pipeline", "tensor", "data"}
    # grad_accum K: tessera.setup runs K times the micro-batches through dataclasses.replace
    assert dataclasses.replace(flat, microbatches=16).pipeline == PipelinePolicy(microbatches=16)
    assert dataclasses.replace(flat, microbatches=16).data == flat.data


def _hybrid_accumulates(_: Any = None) -> tuple[int, int]:
    """One rank: the micro-batches of a hybrid engine set up with grad_accum 2, and the dp part's
    bucket size it holds."""
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    engine = tessera.setup(
        model, lambda p: torch.optim.SGD(p, lr=0.1), strategy="hybrid", grad_accum=2,
        microbatches=2, bucket_cap_mb=5.0,
    )  # fmt: skip
    return engine.policy.microbatches, engine.policy.data.bucket_cap_mb


def test_setup_runs_the_hybrids_accumulation_as_micro_batches(run_ranks):
    # grad_accum K runs K times the policy's micro-batches (a knob of its pipeline part)
    assert run_ranks(_hybrid_accumulates, 1)[0] == (4, 5.0)
