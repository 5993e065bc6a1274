"""TensorBoardLogger: scalars and hyperparameters as TensorBoard event files."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from polytrain.compat.imports import MissingDependencyError, install_hint, module_available
from polytrain.loggers.base import Logger, flatten_params, scalar_metrics


class TensorBoardLogger(Logger):
    """Writes event files to ``save_dir/<name>`` with ``torch.utils.tensorboard`` (or tensorboardX).

    Every metric is a scalar at ``global_step=step`` (``train/loss``, ``val/loss``,
    ...), plus an ``epoch`` scalar, so plots can use either axis. The run's
    information is written once through TensorBoard's hparams plugin (the HPARAMS
    tab) and as a text summary.

    Args:
        save_dir: the parent directory.
        name: the sub-directory the events go to (``tensorboard``).
        writer_kwargs: more arguments for ``SummaryWriter`` (``flush_secs``, ...).

    Raises:
        MissingDependencyError: neither ``tensorboard`` nor ``tensorboardX`` is installed.
    """

    name: ClassVar[str] = "tensorboard"

    def __init__(
        self, save_dir: str | Path, name: str = "tensorboard", **writer_kwargs: Any
    ) -> None:
        if not (module_available("tensorboard") or module_available("tensorboardX")):
            raise MissingDependencyError(
                "TensorBoardLogger needs 'tensorboard' (for torch.utils.tensorboard) or "
                f"'tensorboardX'; install it with: {install_hint('tensorboard')}"
            )
        self.log_dir = Path(save_dir) / name
        self.writer_kwargs = writer_kwargs
        self.writer: Any = None
        self._last_axis: tuple[int, int] | None = None

    def _modules(self) -> tuple[Any, Any]:
        # torch.utils.tensorboard needs the tensorboard package; tensorboardX is self-contained.
        if module_available("tensorboard"):
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        else:
            from tensorboardX import SummaryWriter
            from tensorboardX.summary import hparams
        return SummaryWriter, hparams

    def start(self, run_info: Mapping[str, Any]) -> None:
        """Open the writer; record the run's information once."""
        summary_writer, hparams = self._modules()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = summary_writer(log_dir=str(self.log_dir), **self.writer_kwargs)
        params = flatten_params(run_info)
        if params:
            file_writer = (
                self.writer._get_file_writer()
                if hasattr(self.writer, "_get_file_writer")
                else self.writer.file_writer
            )
            for summary in hparams(params, {}):
                file_writer.add_summary(summary)
            table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
            self.writer.add_text("run_info", f"| key | value |\n|---|---|\n{table}", 0)
        self.writer.flush()

    def log_metrics(self, metrics: Mapping[str, Any], step: int, epoch: int, prefix: str) -> None:
        """One scalar per metric at ``step``, and the epoch."""
        for tag, value in scalar_metrics(metrics, prefix).items():
            self.writer.add_scalar(tag, value, global_step=step)
        if self._last_axis != (step, epoch):  # once per step, not once per prefix
            self.writer.add_scalar("epoch", epoch, global_step=step)
            self._last_axis = (step, epoch)
        self.writer.flush()

    def finish(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
