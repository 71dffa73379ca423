"""wandb and tensorboard, a feature: common.tracking.Tracker opens them only where --logger names them."""

import inspect
import json
import os

from common.errors import UsageError

# What the run itself passes each tracker, and the flag that sets it
OWN = {"project": "--project-name", "name": "--experiment-name", "config": "the run's flags", "dir": "--output-dir",
       "mode": "$WANDB_MODE", "resume": "--resume", "log_dir": "--output-dir (its tensorboard/ folder)"}  # fmt: skip


def _takes(names) -> dict[str, set]:
    """{tracker: the keyword arguments its constructor takes} of the --logger names."""
    takes = {}
    if "wandb" in names:
        import wandb

        takes["wandb"] = set(inspect.signature(wandb.init).parameters)
    if "tensorboard" in names:
        from torch.utils.tensorboard import SummaryWriter

        takes["tensorboard"] = set(inspect.signature(SummaryWriter).parameters)
    return takes


def tracker_kwargs(text: str | None, names) -> dict[str, dict]:
    """{tracker: its arguments} from --tracker-kwargs' JSON object; a key no --logger tracker takes, or one the
    run sets itself, is a UsageError naming it."""
    if not text:
        return {}
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(
            f"--tracker-kwargs {text}: not JSON ({e.msg}); pass an object such as " + """'{"entity": "team"}'"""
        ) from None
    if not isinstance(given, dict):
        raise UsageError(f"--tracker-kwargs {text}: a JSON {type(given).__name__}; pass an object of arguments")
    takes = _takes(names)
    for key in given:
        if key in OWN:
            raise UsageError(f"--tracker-kwargs: {key!r} is set by the run ({OWN[key]}); set it there")
        if not any(key in keys for keys in takes.values()):
            raise UsageError(f"--tracker-kwargs: {key!r} is an argument of none of {', '.join(takes)}'s constructors")
    return {name: {k: v for k, v in given.items() if k in keys} for name, keys in takes.items()}


class Loggers:
    """The --logger targets besides metrics.jsonl and the console: wandb (its run in run_dir; the mode from
    $WANDB_MODE, passed, as wandb otherwise keeps a process's first init's mode) and tensorboard (run_dir/tensorboard),
    each with its share of --tracker-kwargs' arguments (`extra`, tracker_kwargs' JSON)."""

    def __init__(self, names, run_dir, project: str, experiment: str, config: dict, extra: str | None = None):
        self.wandb = self.tb = None
        more = tracker_kwargs(extra, names)
        if "wandb" in names:
            import wandb

            mode = os.environ.get("WANDB_MODE", "online")
            self.wandb = wandb.init(
                project=project,
                name=experiment,
                config=config,
                dir=str(run_dir),
                mode=mode,
                resume="allow",
                **more.get("wandb", {}),
            )
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"), **more.get("tensorboard", {}))

    def log(self, metrics: dict, step: int, generations: list[dict] | None = None) -> None:
        """A step's record; validation's generations (common.rollout.evaluate) as a wandb table."""
        if self.wandb is not None:
            if generations:
                import wandb

                columns = list(generations[0])
                table = wandb.Table(columns=columns, data=[[g[c] for c in columns] for g in generations])
                self.wandb.log({"val/generations": table}, step=step)
            self.wandb.log(metrics, step=step)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()
