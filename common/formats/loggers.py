"""wandb and tensorboard, a feature: common.tracking.Tracker opens them only where --logger names them."""

import os


class Loggers:
    """The --logger targets besides metrics.jsonl and the console: wandb (its run in run_dir; the mode from
    $WANDB_MODE, passed, as wandb otherwise keeps a process's first init's mode) and tensorboard (run_dir/tensorboard)."""

    def __init__(self, names, run_dir, project: str, experiment: str, config: dict):
        self.wandb = self.tb = None
        if "wandb" in names:
            import wandb

            mode = os.environ.get("WANDB_MODE", "online")
            self.wandb = wandb.init(
                project=project, name=experiment, config=config, dir=str(run_dir), mode=mode, resume="allow"
            )
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

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
