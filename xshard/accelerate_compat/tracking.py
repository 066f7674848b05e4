"""Experiment trackers for ``Accelerator(log_with=...)``: ``init_trackers``, ``log``, ``end_training``.

Each tracker writes through its real library, on the main process only (the others hold no
tracker, as in Accelerate):

- ``"tensorboard"``: ``torch.utils.tensorboard.SummaryWriter`` in ``<logging_dir>/<project_name>``
  (needs the ``tensorboard`` package); the run's config becomes hparams and ``hparams.yml``.
- ``"wandb"``: ``wandb.init(project=project_name)``; ``"mlflow"``: an MLflow run named after the project.
- ``"all"``: every one of those whose package is installed.
- an object with ``name``, ``store_init_configuration(config)``, ``log(values, step)`` and
  ``finish()`` (Accelerate's ``GeneralTracker`` subclasses have them): used as it is.

A tracker name whose package is missing, or that xshard does not know, fails in the constructor
(before any training) with the package to install or the names it knows.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ..runtime.rank_logging import get_logger

__all__ = ["MLflowTracker", "TRACKERS", "TensorBoardTracker", "TrackerError", "WandBTracker", "find",
           "resolve", "start"]

log = get_logger("xshard.tracking")


class TensorBoardTracker:
    """Scalars, text and dicts of scalars to TensorBoard event files."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = Path(logging_dir) / run_name
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """The run's config as TensorBoard hparams (non-scalar values as text) and ``hparams.yml``."""
        import yaml

        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in _flatten(values).items()}
        self.writer.add_hparams(flat, metric_dict={})
        self.writer.flush()
        (self.logging_dir / "hparams.yml").write_text(yaml.safe_dump(flat))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Numbers as scalars, strings as text, dicts of numbers as grouped scalars."""
        for key, value in values.items():
            if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
                value = value.item()
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
            else:
                raise TypeError(f"log(): {key!r} is a {type(value).__name__}; TensorBoard takes numbers, strings "
                                "and dicts of numbers")
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker:
    """A Weights & Biases run (``wandb.init(project=run_name, **kwargs)``)."""

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, logging_dir: Any = None, **kwargs: Any) -> None:
        import wandb

        self.run = wandb.init(project=run_name, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker:
    """An MLflow run in the experiment named after the project."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, run_name: str, logging_dir: Any = None, **kwargs: Any) -> None:
        import mlflow

        experiment = mlflow.set_experiment(run_name)
        self.run = mlflow.start_run(experiment_id=experiment.experiment_id, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import mlflow

        mlflow.log_params({k: str(v)[:500] for k, v in _flatten(values).items()})

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        import mlflow

        numbers = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        mlflow.log_metrics(numbers, step=step, **kwargs)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


#: tracker name -> (class, import name, pip package)
TRACKERS: dict[str, tuple[type[TensorBoardTracker | WandBTracker | MLflowTracker], str, str]] = {
    "tensorboard": (TensorBoardTracker, "tensorboard", "tensorboard"),
    "wandb": (WandBTracker, "wandb", "wandb"),
    "mlflow": (MLflowTracker, "mlflow", "mlflow"),
}
_ELSEWHERE = ("comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")


class TrackerError(ValueError):
    """``log_with`` names a tracker that cannot run here (unknown, or its package is missing)."""


def resolve(log_with: list[Any], logging_dir: str | None) -> list[Any]:
    """Tracker names (checked now) and tracker objects, in order; ``"all"`` is every installed one."""
    chosen: list[Any] = []
    for item in log_with:
        name = getattr(item, "value", item)  # LoggerType members
        if not isinstance(name, str):
            for method in ("log", "store_init_configuration", "finish"):
                if not callable(getattr(item, method, None)):
                    raise TrackerError(f"log_with: {item!r} is not a tracker: it needs a {method}() method "
                                       "(subclass accelerate's GeneralTracker, or name one of "
                                       f"{', '.join(TRACKERS)})")
            chosen.append(item)
            continue
        name = name.lower()
        if name == "all":
            chosen.extend(n for n, (_, module, _) in TRACKERS.items() if importlib.util.find_spec(module))
            continue
        if name not in TRACKERS:
            known = ", ".join([*TRACKERS, "all"])
            hint = " (not supported by xshard)" if name in _ELSEWHERE else ""
            raise TrackerError(f"log_with={name!r}{hint}: use one of {known}, or pass a tracker object with "
                               "log(), store_init_configuration() and finish()")
        _, module, package = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise TrackerError(f"log_with={name!r} needs the {package} package: pip install {package}")
        chosen.append(name)
    for name in chosen:
        if isinstance(name, str) and TRACKERS[name][0].requires_logging_directory and not logging_dir:
            raise TrackerError(f"log_with={name!r} writes files: pass project_dir=... (or "
                               "project_config=ProjectConfiguration(logging_dir=...)) to the Accelerator")
    return list(dict.fromkeys(chosen))


def start(chosen: list[Any], project_name: str, logging_dir: str | None, config: dict[str, Any] | None,
          init_kwargs: dict[str, dict[str, Any]] | None) -> list[Any]:
    """Create the trackers for one run and store its config (main process only)."""
    init_kwargs = init_kwargs or {}
    started = []
    for item in chosen:
        if isinstance(item, str):
            # choose() refused a tracker that writes files without logging_dir
            cls: Any = TRACKERS[item][0]
            tracker = cls(project_name, logging_dir, **init_kwargs.get(item, {}))
        else:
            tracker = item
        if config is not None:
            tracker.store_init_configuration(config)
        started.append(tracker)
        log.info("tracking with %s", getattr(tracker, "name", type(tracker).__name__))
    return started


class _Blank:
    """What ``get_tracker`` returns on processes without trackers: every call does nothing."""

    name = "blank"
    tracker = None

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def find(trackers: list[Any], name: str, unwrap: bool) -> Any:
    """The running tracker called ``name`` (its library object with ``unwrap``); a blank one elsewhere."""
    for tracker in trackers:
        if getattr(tracker, "name", None) == name:
            return getattr(tracker, "tracker", tracker) if unwrap else tracker
    if trackers:
        raise ValueError(f"get_tracker({name!r}): the running trackers are "
                         f"{', '.join(str(getattr(t, 'name', t)) for t in trackers)}")
    return _Blank()


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out
