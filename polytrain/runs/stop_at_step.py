"""Stopping a running call after the same step on every rank (driver side).

When a node of the group drains, the run loop has every worker stop after the
*same* step inside the running call (the ranks run collectives together; one
that stopped early would leave the others waiting forever). :func:`agree_on_stop`
settles that step through the workers' monitor channel, answered by each
worker's stop gate (:mod:`polytrain.trainer_api.torch.stopping`) while its batch
loop runs. The worker calls are injected (:func:`ask_workers` in production), so
the agreement is tested without a cluster.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

from polytrain.launchers.base import WorkerGroup

#: Rounds of :func:`agree_on_stop` before it gives up (each is one monitor round trip).
MAX_ROUNDS = 20


def stop_target(taken: Iterable[int], unit: int = 1, margin: int = 1) -> int:
    """The batch count (of the running call) every rank can still stop after.

    ``taken``: the batches each rank has started. The target is the next step
    boundary (a multiple of ``unit``, the batches per optimizer step) after the
    furthest rank's batch, plus ``margin`` steps for the request to arrive.
    """
    furthest = max(taken, default=0)
    return (math.ceil(furthest / unit) + margin) * unit


def agree_on_stop(
    ask: Callable[[dict[str, Any]], list[dict[str, Any] | None]],
    unit: int = 1,
    max_rounds: int = MAX_ROUNDS,
) -> int | None:
    """Settle the batch of the running call after which every rank stops; None if that failed.

    ``ask(request)`` sends one request to every rank (through the monitor channel,
    answered while the batch loop runs) and returns each rank's reply in rank order
    (None: no reply). Requests: ``{"target": None}`` asks where each rank is;
    ``{"target": T}`` proposes T: a rank that has not started batch T + 1 accepts
    and, once at T, waits for the verdict; one past T refuses. ``{"target": T,
    "final": True}`` stops every rank after T; ``{"cancel": True}`` withdraws the
    proposal. Replies: ``{"ok": bool, "taken": batches started}``.

    A rank that refused raises the target past it, and the proposal goes out again:
    ranks waiting at the old target move on to the new one, so no rank ever stops
    at a step another has passed.
    """
    replies = ask({"target": None})
    for _ in range(max_rounds):
        if any(reply is None for reply in replies):
            break  # a worker did not answer: the call's own failure handling takes over
        target = stop_target((int(r["taken"]) for r in replies if r is not None), unit)
        replies = ask({"target": target})
        if all(reply is not None and reply.get("ok") for reply in replies):
            ask({"target": target, "final": True})
            return target
    ask({"cancel": True})
    return None


def ask_workers(
    group: WorkerGroup, request: dict[str, Any], timeout_s: float = 10.0
) -> list[dict[str, Any] | None]:
    """Send ``request`` to every worker's stop handler (monitor channel); replies in rank order.

    A worker that does not answer within ``timeout_s`` (or whose call failed) yields None.
    """
    refs = [group.monitor_single_async(r, "stop_request", request) for r in range(len(group))]
    replies: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(replies) < len(refs) and time.monotonic() < deadline:
        for rank, ref in enumerate(refs):
            if rank not in replies:
                done, value = group.poll(ref)
                if done:
                    replies[rank] = value
        if len(replies) < len(refs):
            time.sleep(0.002)
    return [r if isinstance(r := replies.get(rank), dict) else None for rank in range(len(refs))]
