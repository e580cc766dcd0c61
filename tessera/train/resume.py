"""What a resume checks before any rank starts: the run folder holds a run, and this one matches it.

`config_layers_for_resume` reads the saved config of `--resume DIR` as the lowest config layer
(the command line's flags override it); `check_resume` refuses a resume with another config or a
world size the checkpoint cannot load on. Both read only config.yaml and the checkpoint series'
manifests, never a checkpoint's tensors: the ranks check again against the checkpoint they load.
One module of its own because the command line, the job (`run`) and the restart supervisor
(`restarts`) all ask it, and none of them may import another for it without a cycle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.checkpoint import series
from tessera.errors import CheckpointError, ConfigError
from tessera.train.config import TrainConfig, job_world_size, load_yaml
from tessera.train.resume_rules import (
    check_resume_config,
    check_resume_world,
    config_differences,
)

__all__ = ["check_fresh_out", "check_resume", "config_layers_for_resume"]


def config_layers_for_resume(run_dir: str | Path) -> dict[str, Any]:
    """The saved config of a run to resume, as the lowest config layer; checks it can resume."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"cannot resume {run_dir}: no config.yaml there (not a tessera run)")
    if not series.has_checkpoint(run_dir):
        raise ConfigError(
            f"cannot resume {run_dir}: it holds no complete checkpoint "
            f"({series.CHECKPOINTS_DIR}/step-N/ with its {series.MANIFEST_FILE})"
        )
    return load_yaml(run_dir / "config.yaml")


def check_resume(config: TrainConfig, run_dir: str | Path) -> None:
    """Before any rank starts: refuse a resume of `run_dir` with another config or world size.

    Reads config.yaml and the newest checkpoint's manifest only (no checkpoint is loaded); the
    ranks check again against the checkpoint they load.
    """
    run_dir = Path(run_dir)
    if (run_dir / "config.yaml").is_file():
        check_resume_config(load_yaml(run_dir / "config.yaml"), config, where=str(run_dir))
    complete = series.complete_checkpoints(run_dir)
    done = series.checkpoint_step(complete[0]) if complete else 0
    if config.steps < done:
        raise ConfigError(
            f"cannot resume {run_dir} with --steps {config.steps}: it has done {done} steps "
            f"(its newest checkpoint); --steps is the total to reach, give at least {done}"
        )
    if complete:
        try:
            saved_world = int(series.read_manifest(complete[0])["world_size"])
        except (CheckpointError, KeyError, ValueError):
            return  # the ranks fall back to an older checkpoint, and check that one
        check_resume_world(config.strategy, saved_world, job_world_size(config.nproc))


def _logged_steps(run_dir: Path) -> int:
    """Step records in the run folder's metrics.jsonl (0 without one)."""
    from tessera.train.metrics import read_metrics  # (light: json lines)

    return len(read_metrics(run_dir / "metrics.jsonl"))


def check_fresh_out(config: TrainConfig, run_dir: str | Path) -> None:
    """Before a new run (no --resume) writes into `run_dir`: refuse to replace another run.

    A folder holding a checkpoint is refused by the caller (resume it instead). One that logged
    steps but holds no checkpoint (the run died before its first) may be started over by the
    same config, which redoes that same run; another config (another model, other data) would
    replace it without a word, so it is refused, naming the keys that differ.
    """
    run_dir = Path(run_dir)
    logged = _logged_steps(run_dir)
    if not logged:
        return
    saved = run_dir / "config.yaml"
    differing = config_differences(load_yaml(saved), config) if saved.is_file() else ["config"]
    if differing:
        raise ConfigError(
            f"{run_dir} holds another run ({logged} logged steps in metrics.jsonl, no checkpoint;"
            f" differing: {', '.join(differing)}): choose another --out, or delete that folder "
            "to replace it"
        )
