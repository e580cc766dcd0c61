"""The training configuration: typed, loadable from YAML, overridable from the command line.

Every check that can fail runs here, in the launching process, before any worker starts: a wrong
type or an impossible value costs the user one clear message instead of N tracebacks from ranks.
Precedence: defaults < the YAML file (`--config`) < command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError
from tessera.strategies.registry import (
    OWN_ENTRY_POINTS,
    STRATEGIES,
    capabilities,
    check_compile,
)
from tessera.train.config_data import (
    LoaderSettings,
    check_eval_and_logging,
    check_loader_options,
)
from tessera.train.config_knobs import StrategyKnobs
from tessera.train.config_optimizer import check_optimizer_options
from tessera.train.config_sources import (
    job_world_size,
    load_yaml,
    read_tp_plan,
    torchrun_world,
)
from tessera.train.config_strategy import (
    check_knob_values,
    check_memory_options,
    check_model_parallel,
)

__all__ = [
    "LoaderSettings",
    "ModelSettings",
    "TrainConfig",
    "job_world_size",
    "load_yaml",
    "read_tp_plan",
    "torchrun_world",
]



def _option(default: Any, help_text: str) -> Any:
    """A config field whose help text is shown by `tessera train --help`."""
    return field(default=default, metadata={"help": help_text})


@dataclass(kw_only=True, frozen=True)
class ModelSettings:
    """Shape of the character-level GPT; the vocabulary comes from the corpus."""

    n_layer: int = _option(4, "Number of transformer blocks.")
    n_head: int = _option(4, "Attention heads per block; must divide n_embd.")
    n_embd: int = _option(128, "Width of the residual stream.")
    block_size: int = _option(128, "Context length in characters and length of each window.")
    dropout: float = _option(0.0, "Dropout probability (0 keeps runs comparable bit for bit).")

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")


@dataclass(kw_only=True, frozen=True)
class TrainConfig(StrategyKnobs):
    """One training run of `tessera train`: the run's own fields, and (inherited) each
    strategy's knobs, generated from the policies that declare them (`config_knobs`)."""

    strategy: str = _option(
        "ddp", "How training is split over ranks (torch-ddp: PyTorch's DDP, the anchor)."
    )
    nproc: int = _option(
        2,
        "Processes on this machine; auto: one per GPU (CUDA), else one per CPU core. Under "
        "tessera run / torchrun they are started already: leave it out, or it must equal -n.",
    )
    steps: int = _option(450, "Total optimizer steps; a resumed run continues up to this number.")
    seed: int = _option(0, "Seed of the model's initialisation and of the data order.")
    batch_size: int = _option(
        32,
        "Global micro-batch in sequences, split over the ranks; one optimizer step takes "
        "batch_size * grad_accum.",
    )
    grad_accum: int = _option(
        1,
        "Gradient accumulation: micro-batches per optimizer step, gradients reduced over ranks "
        "once, after the last (--batch-size 8 --grad-accum 4 equals --batch-size 32).",
    )
    optimizer: str = _option(
        "adamw",
        "adamw (betas 0.9, 0.95), sgd (momentum 0.9), or PKG.MODULE:CLASS (a torch.optim."
        "Optimizer subclass, given lr and, if it takes it, weight_decay).",
    )
    optimizer_args: str | None = _option(
        None,
        "JSON object of optimizer keyword arguments applied on top of lr and weight_decay, e.g. "
        "'{\"betas\": [0.9, 0.99]}'.",
    )
    lr_schedule: str = _option(
        "cosine",
        "After warmup: cosine (to lr/10 over decay_steps), linear (to lr/10 over decay_steps), "
        "constant, or PKG.MODULE:FN, FN(step) -> multiplier of lr (no warmup added; a function "
        "of the 0-based step only, so resume stays exact).",
    )
    lr: float = _option(3e-3, "Peak learning rate, reached after warmup_steps.")
    warmup_steps: int = _option(10, "Linear learning-rate warmup, in steps.")
    decay_steps: int | None = _option(
        None,
        "Cosine decay to lr/10 over this many steps after warmup; 0 keeps lr constant. Unset: "
        "--model: --steps minus warmup (a --resume further stretches it); the demo GPT: 450.",
    )
    weight_decay: float = _option(
        0.1, "AdamW's weight decay (not SGD's), on parameters of 2+ dims: not biases, norms."
    )
    grad_clip: float = _option(1.0, "Clip the global gradient norm to this; 0 turns it off.")
    mixed_precision: str | None = _option(
        None,
        "bf16 or fp16: compute under autocast (zero1-3 bf16: bf16 weights), gradients reduced in "
        "it, fp32 master weights and optimizer state; fp16 with dynamic loss scaling (loss_scale "
        "and skipped steps in metrics.jsonl). Every strategy but ps.",
    )
    loss_scale_init: float = _option(2.0**16, "fp16: the first loss scale.")
    loss_scale_growth_interval: int = _option(
        2000, "fp16: double the loss scale after this many steps without inf/nan."
    )
    meta_init: bool = _option(
        True,
        "zero3: build the model on the meta device, each rank materialising only its shard "
        "(through the model's init_module or each module's reset_parameters); off: build it whole.",
    )
    activation_checkpointing: bool = _option(
        False,
        "Recompute each GPT block's activations in backward (single, ddp, torch-ddp, local-sgd, "
        "zero1-3).",
    )
    compile: bool = _option(False, "torch.compile the model (not zero3, pipeline, tensor, ps).")
    model_factory: str | None = field(
        default=None,
        metadata={
            "flag": "--model",
            "help": "Your model: PKG.MODULE:FACTORY (a function () -> nn.Module) or hf:CLASS (a "
            "transformers class built from --model-config, nothing downloaded); needs --data. "
            "Unset: the demo GPT on --corpus.",
        },
    )
    model_config: str | None = _option(
        None,
        "hf: models: JSON file of the config class's arguments (Auto classes: with model_type).",
    )
    data: str | None = _option(
        None,
        "--model's data: PKG.MODULE:FACTORY (() -> map-style Dataset of (inputs, targets) or dict "
        "items), FILE.txt, FILE.jsonl or a datasets.save_to_disk DIR; text becomes items "
        "{input_ids, labels} of block_size tokens.",
    )
    tokenizer: str | None = _option(
        None, "Text data: a Hugging Face tokenizer.json file; default one token per character."
    )
    loss: str | None = _option(
        None,
        "PKG.MODULE:FN: loss(output, targets) for (inputs, targets) items, loss(output, batch) for "
        "dict items; default for dict items: the model's own output.loss.",
    )
    eval_data: str | None = _option(
        None, "Held-out data, as --data: loaded and checked before training starts."
    )
    corpus: str = _option("stdlib", "Text to train on: stdlib (Python's own source) or a path.")
    corpus_bytes: int = _option(1_000_000, "How many bytes of the corpus to read.")
    log_every: int = _option(1, "Write a metrics.jsonl line every this many steps.")
    checkpoint_every: int = _option(50, "Checkpoint every this many steps (and at the end).")
    keep_checkpoints: int = _option(
        2,
        "Checkpoints kept (counting only those that verify); older ones are deleted once a "
        "newer one is complete.",
    )
    sample_tokens: int = _option(200, "Characters to generate at the end; 0 skips the sample.")
    timeout_s: float = _option(300.0, "Bound in seconds of every blocking wait between ranks.")
    out: str | None = _option(None, "Run folder (default runs/<timestamp>).")
    progress: bool = _option(
        True, "Show progress on rank 0: a bar on a terminal, else a plain line every log_every."
    )
    eval_every: int = _option(
        0,
        "Evaluate the mean loss over eval_batches held-out batches every this many steps and at "
        "the end (val_loss in metrics.jsonl); 0: never. Held out: the corpus's last tenth (the "
        "demo never trains on it) or --eval-data.",
    )
    eval_batches: int = _option(
        0,
        "Held-out batches per evaluation, the same ones every time; 0: one pass over all of "
        "--eval-data (the demo: 4 batches of its held-out text).",
    )
    log_with: str | None = _option(
        None,
        "tensorboard, mlflow or wandb (comma-separated for several): also log the metrics there "
        "(event files, a local mlruns store, an offline wandb run; all in the run folder).",
    )
    options: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "The options of a strategy added with register_strategy: its policy's "
            "fields (each also a flag --FIELD).",
            "cli": False,
        },
    )
    model: ModelSettings = field(
        default_factory=ModelSettings, metadata={"help": "The GPT's shape."}
    )
    loader: LoaderSettings = field(
        default_factory=LoaderSettings, metadata={"help": "How --data becomes batches."}
    )

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES and self.strategy not in OWN_ENTRY_POINTS:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}; choose one of "
                f"{sorted([*STRATEGIES, *OWN_ENTRY_POINTS])}"
            )
        if self.nproc < 1:
            raise ConfigError(f"nproc must be at least 1, got {self.nproc}")
        for name in (
            "steps",
            "batch_size",
            "grad_accum",
            "log_every",
            "corpus_bytes",
            "keep_checkpoints",
            "loss_scale_growth_interval",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "decay_steps",
            "checkpoint_every",
            "sample_tokens",
            "grad_clip",
        ):
            if (getattr(self, name) or 0) < 0:  # (decay_steps None: the default)
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("lr", "timeout_s", "loss_scale_init"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.mixed_precision not in (None, "bf16", "fp16"):
            raise ConfigError(
                f"mixed_precision must be bf16, fp16 or unset, got {self.mixed_precision!r}"
            )
        if self.mixed_precision and self.strategy in OWN_ENTRY_POINTS:
            raise ConfigError(f"mixed_precision does not apply to strategy {self.strategy}")
        check_memory_options(self)  # --offload and its group, --activation-checkpointing
        check_compile(self.strategy, self.compile)  # refused, with the reason, where it can't
        check_optimizer_options(self)  # --optimizer(-args), --lr-schedule, --grad-accum
        self._check_workload_options()
        check_knob_values(self)  # each strategy knob by its policy (the files named: read)
        check_eval_and_logging(self)  # --eval-every, --eval-batches, --log-with
        check_loader_options(self)  # --num-workers, --epochs, --collate, --input-keys
        self.check_world_size(job_world_size(self.nproc))
        if self.corpus != "stdlib" and not Path(self.corpus).exists():
            raise ConfigError(f"corpus not found: {self.corpus} (no such file or folder)")

    @property
    def step_batch_size(self) -> int:
        """Sequences (items) of one optimizer step over all ranks: batch_size * grad_accum."""
        return self.batch_size * self.grad_accum

    def _check_workload_options(self) -> None:
        """--model and its companions: what goes with what, and the files they name exist.

        Importing the factories, reading the data and one forward of the model run in
        `tessera.train.preflight`, still before any rank starts.
        """
        from tessera.data.imports import is_reference
        from tessera.data.sources import check_data_spec

        companions = ("data", "model_config", "tokenizer", "loss", "eval_data", "split", "tp_plan")
        if self.model_factory is None:
            given = [name for name in companions if getattr(self, name) is not None]
            if given:
                raise ConfigError(
                    f"{_flag_name(given[0])} goes with --model: the demo GPT trains on --corpus"
                )
            return
        spec = self.model_factory
        if not (spec.startswith("hf:") and spec[3:].isidentifier()) and not is_reference(spec):
            raise ConfigError(f"--model {spec!r} is neither PKG.MODULE:FACTORY nor hf:CLASS")
        if self.data is None:
            raise ConfigError(f"--model {spec} needs --data (FILE.txt, FILE.jsonl, DIR, factory)")
        if self.strategy in OWN_ENTRY_POINTS:
            raise ConfigError(f"strategy {self.strategy} trains the demo GPT only, not --model")
        check_data_spec(self.data)
        if self.eval_data is not None:
            check_data_spec(self.eval_data, "--eval-data")
        for name in ("model_config", "tokenizer", "tp_plan"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{_flag_name(name)} {path}: no such file")
        if self.loss is not None and not is_reference(self.loss):
            raise ConfigError(f"--loss {self.loss!r} is not PKG.MODULE:FN")
        takes = capabilities(self.strategy).takes
        if self.split is not None and not takes("split"):
            raise ConfigError(f"--split cuts pipeline stages: strategy {self.strategy} has none")
        if self.tp_plan is not None:
            if not takes("tp_plan"):
                raise ConfigError(
                    f"--tp-plan splits layers over tensor-parallel ranks: strategy "
                    f"{self.strategy} does not"
                )
            read_tp_plan(self.tp_plan)

    def check_world_size(self, world_size: int) -> None:
        """Refuse a world size this config cannot run on, before any rank starts.

        Everything an engine would refuse at set-up from the config and the number of ranks alone
        is checked here, so that the user gets one message instead of a traceback per rank.
        """
        caps = capabilities(self.strategy)
        if caps.check_world is not None:  # its own processes, whatever nproc says
            world = torchrun_world()
            return caps.check_world(self, None if world is None else world[0])
        if caps.one_process and world_size != 1:
            raise ConfigError(
                f"strategy {self.strategy!r} runs one process; got {world_size} ranks"
            )
        if self.batch_size % world_size:
            raise ConfigError(
                f"batch_size ({self.batch_size}) must be divisible by the number of ranks "
                f"({world_size})"
            )
        if caps.layout is not None:  # (hybrid's: dp x tp x pp must be the world size)
            check_model_parallel(self, *caps.layout(self, world_size))


def _flag_name(name: str) -> str:
    """The command-line flag of config field `name`."""
    meta = TrainConfig.__dataclass_fields__[name].metadata
    return meta.get("flag", "--" + name.replace("_", "-"))
