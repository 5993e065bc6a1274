"""The trainer's checkpoints on the driver: where the workers write them, which are complete, retention.

The workers write checkpoint directories themselves (see
:mod:`polytrain.checkpoint.layout`); the driver only names them,
keeps their paths and prunes old ones. With a ``checkpoint_dir`` they go there
(a local path, NFS, or an fsspec URL such as ``s3://bucket/run``); with recovery
on but no ``checkpoint_dir`` they go to a temporary directory of the trainer's
own on the driver's node, deleted at shutdown: a run whose workers span several
nodes needs a ``checkpoint_dir`` on storage every node sees.

:class:`CheckpointManager` also keeps the older in-memory API (``remember`` a
consolidated dict, ``latest``) for states that reach the driver whole.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import Any

from polytrain.checkpoint import layout
from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.directory import SaveRequest
from polytrain.checkpoint.storage import Storage
from polytrain.trainer_api.options.configs import CheckpointConfig


class CheckpointManager:
    """Names, tracks and prunes the checkpoint directories the workers write.

    Args:
        config: where and how many checkpoints to keep (and whether to save asynchronously).
        keep_latest: whether the trainer needs checkpoints at all (retries, elastic
            training or a ``checkpoint_dir``); without it, states loaded by the user are
            not kept either.
    """

    def __init__(self, config: CheckpointConfig, keep_latest: bool) -> None:
        self.config = config
        self.keep_latest = keep_latest
        self.latest: dict[str, Any] | None = None
        self.latest_path: str | None = None
        self._pending: list[str] = []
        self._tmpdir: str | None = None
        self._cleanup: weakref.finalize | None = None

    # ----------------------------------------------------------- locations
    @property
    def asynchronous(self) -> bool:
        """Whether the workers write in the background (``CheckpointConfig.async_save``)."""
        return bool(getattr(self.config, "async_save", False))

    def root(self) -> Storage:
        """Where checkpoint directories go: ``checkpoint_dir``, else this trainer's temporary one."""
        if self.config.checkpoint_dir is not None:
            return Storage(self.config.checkpoint_dir)
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="polytrain-checkpoints-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        return Storage(self._tmpdir)

    def request(
        self, header: dict[str, Any], step_in_epoch: int | None = None, **extra: Any
    ) -> SaveRequest:
        """A fresh, empty checkpoint directory for the state after ``header["epoch"]`` epochs.

        Args:
            header: framework, backend, world_size, epoch (epochs completed), global_step.
            step_in_epoch: batches into the next epoch, for a mid-epoch checkpoint.
            extra: more entries for the checkpoint's ``meta.pt`` (e.g. ``epoch_step``).
        """
        root = self.root()
        name = layout.checkpoint_name(header["epoch"], step_in_epoch)
        root.child(name).remove()  # a leftover of an interrupted run or a re-run epoch
        return SaveRequest(
            url=root.url_of(name), header=dict(header), asynchronous=self.asynchronous, extra=extra
        )

    # ------------------------------------------------------------ tracking
    def record(self, results: list[dict[str, Any]]) -> str | None:
        """The workers wrote (or are writing) a checkpoint; keep its path and prune old ones.

        Args:
            results: what :func:`~polytrain.trainer_api.checkpointing.worker_writer.save_local_state`
                returned on every rank.

        Returns:
            The checkpoint's path when it lies in ``checkpoint_dir``, else None.
        """
        url = results[0]["path"]
        if any(r.get("pending") for r in results):
            self._pending.append(url)
        else:
            self.latest_path = url
        self.latest = None  # the driver holds no tensors
        self.refresh()
        return url if self.config.checkpoint_dir is not None else None

    def refresh(self) -> str | None:
        """Note background saves that committed since; prune. Returns the newest committed path."""
        still = []
        for url in self._pending:
            if layout.is_committed(Storage(url)):
                self.latest_path = url
            else:
                still.append(url)
        self._pending = still[-2:]  # older ones were interrupted (their workers are gone)
        root = self.root()
        keep = {url.rsplit("/", 1)[-1] for url in self._pending}
        if self.latest_path is not None:
            keep.add(self.latest_path.rsplit("/", 1)[-1])
        layout.prune(root, self.config.num_to_keep, keep=keep)
        return self.latest_path

    def restore_point(self) -> str | None:
        """The newest committed checkpoint to restart from (a save still in flight is not one)."""
        return self.refresh() if (self._pending or self.latest_path) else None

    def remember(self, state: dict[str, Any]) -> str | None:
        """Keep a consolidated checkpoint dict that came through the driver; write it to ``checkpoint_dir``.

        Returns:
            The path written, or None without ``checkpoint_dir``.
        """
        self.latest = state
        self.latest_path = None
        directory = self.config.checkpoint_dir
        if directory is None:
            return None
        path = ckpt.save_checkpoint(state, ckpt.epoch_checkpoint_path(directory, state["epoch"]))
        ckpt.prune_checkpoints(directory, self.config.num_to_keep)
        return str(path)

    def loaded(self, state: dict[str, Any] | str) -> None:
        """Note a state (a dict, or a checkpoint path) the user loaded: a restart must not fall back behind it."""
        if not self.keep_latest:
            return
        if isinstance(state, str):
            self.latest, self.latest_path = None, state
        else:
            self.latest, self.latest_path = state, None

    def close(self) -> None:
        """Delete this trainer's temporary checkpoint directory (not ``checkpoint_dir``)."""
        if self._cleanup is not None:
            self._cleanup()
