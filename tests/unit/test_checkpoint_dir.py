"""Checkpoint directories: layout, commit marker, range reads, validation, retention, conversion.

Ranks are simulated in one process: each "rank" writes its part exactly as a
worker does (``write_part``), rank 0 last since it commits. The real multi-worker
paths are in tests/integration/test_checkpoint_dir.py.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle

import pytest
import torch

from polytrain.checkpoint import layout
from polytrain.checkpoint import single_file as ckpt
from polytrain.checkpoint.convert import read_directory, to_consolidated, to_sharded
from polytrain.checkpoint.directory import (
    DirReader,
    SaveRequest,
    commit,
    meta_bytes,
    plan_pieces,
    snapshot,
    write_part,
)
from polytrain.checkpoint.pieces import LocalState, Piece, assemble, split_state
from polytrain.checkpoint.storage import Storage
from polytrain.cli.checkpoint import add_checkpoint
from polytrain.errors import CheckpointError, ConfigError
from polytrain.trainer_api.checkpointing.manager import CheckpointManager
from polytrain.trainer_api.options.configs import CheckpointConfig


def cli_main(argv: list[str]) -> int:
    """``polytrain checkpoint ...`` through the subcommand's own parser (cli.py registers it)."""
    parser = argparse.ArgumentParser(prog="polytrain")
    add_checkpoint(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


HEADER = {"framework": "torch", "backend": "ddp", "world_size": 2, "epoch": 1, "global_step": 4}


def _trained_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3)
    )
    optimizer = torch.optim.Adam(
        [{"params": model[0].parameters(), "lr": 0.2}, {"params": model[2].parameters()}], lr=0.1
    )
    for _ in range(2):
        model(torch.randn(4, 5)).sum().backward()
        optimizer.step()
    return {
        "format": ckpt.FORMAT,
        "version": ckpt.VERSION,
        "framework": "torch",
        "backend": "ddp",
        "world_size": 2,
        "epoch": 1,
        "models": [model.state_dict()],
        "optimizers": [optimizer.state_dict()],
        "schedulers": [],
        "scaler": None,
        "operator": {"note": "kept"},
        "global_step": 4,
    }


def _write(url: str, locals_: list[LocalState], full: dict) -> None:
    """Write ``locals_`` (one per simulated rank) as the workers would; rank 0 commits."""
    meta = {**{k: v for k, v in full.items() if k not in ("models", "optimizers")}}
    meta.update(locals_[0].skeleton)
    request = SaveRequest(url=url, header=HEADER, commit_timeout_s=5)
    world = len(locals_)
    for rank in reversed(range(world)):
        mine = snapshot(plan_pieces(locals_[rank].pieces, rank, world), copy=True)
        write_part(request, rank, world, mine, meta_bytes(meta) if rank == 0 else None)


def _assert_same(a: dict, b: dict) -> None:
    for ma, mb in zip(a["models"], b["models"], strict=True):
        assert ma.keys() == mb.keys()
        for key in ma:
            assert torch.equal(ma[key], mb[key]), key
    for oa, ob in zip(a["optimizers"], b["optimizers"], strict=True):
        assert oa["param_groups"] == ob["param_groups"]
        assert oa["state"].keys() == ob["state"].keys()
        for index, entry in oa["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, ob["state"][index][key]), (index, key)


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "ckpt" / "checkpoint_000001")
        return
    name = f"memory://polytrain-test/{os.getpid()}/{id(request)}/checkpoint_000001"
    yield name
    Storage(name).remove()


# ------------------------------------------------------------------ round trips
def test_replicated_state_round_trips_and_is_spread_over_the_ranks(url):
    full = _trained_state()
    locals_ = [split_state(full, replicated=True, with_skeleton=r == 0) for r in range(2)]
    _write(url, locals_, full)
    checkpoint = layout.open_checkpoint(url, framework="torch")
    files = checkpoint.manifest["files"]
    # both ranks wrote about half of the bytes (each replicated tensor exactly once)
    sizes = [files[layout.rank_file(r, "bin")]["bytes"] for r in range(2)]
    assert min(sizes) > 0.3 * sum(sizes)
    assert checkpoint.manifest["epoch"] == 1 and checkpoint.manifest["global_step"] == 4
    with DirReader(checkpoint) as reader:
        tensors = assemble(reader.skeleton, reader, reader.paths())
    _assert_same(full, tensors)
    assert checkpoint.meta["operator"] == {"note": "kept"}
    # the consolidated dict of a directory is a valid consolidated checkpoint
    ckpt.validate_checkpoint(read_directory(url), "converted", "torch")


def test_ranges_written_by_some_ranks_are_read_back_at_any_split(tmp_path):
    """Resharding at the reader: pieces cut one way, read cut another way."""
    weight = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    path = ("models", 0, "w")
    flat = weight.reshape(-1)
    cuts = [(0, 7), (7, 16), (16, 30)]  # three writers, uneven, across row boundaries
    locals_ = []
    for rank, (lo, hi) in enumerate(cuts):
        piece = Piece(path, (5, 6), flat[lo:hi], start=lo)
        skeleton = {"models": [{}], "optimizers": []} if rank == 0 else None
        locals_.append(LocalState([piece], skeleton))
    url = str(tmp_path / "checkpoint_000001")
    _write(url, locals_, {**_trained_state(), "models": [{}], "optimizers": []})
    with DirReader(layout.open_checkpoint(url)) as reader:
        assert reader.shape(path) == (5, 6)
        assert torch.equal(reader.read(path).reshape(5, 6), weight)
        for start, numel in [(0, 15), (15, 15), (5, 3), (6, 11), (29, 1), (0, 30)]:
            assert torch.equal(reader.read(path, start, numel), flat[start : start + numel])
        with pytest.raises(CheckpointError, match="outside tensor"):
            reader.read(path, 25, 10)


def test_planner_writes_every_replicated_tensor_exactly_once():
    pieces = [
        Piece(("models", 0, f"t{i}"), (n,), torch.zeros(n), replicated=True)
        for i, n in enumerate([100, 90, 50, 40, 10, 5, 5])
    ]
    own = Piece(("models", 0, "shard"), (8,), torch.zeros(4), start=4)
    for world in (1, 2, 3):
        plans = [plan_pieces([*pieces, own], rank, world) for rank in range(world)]
        written = [p.path for plan in plans for p in plan if p.replicated]
        assert sorted(written) == sorted(p.path for p in pieces)
        assert all(own in plan for plan in plans)  # a rank's own range is always its to write
        loads = [sum(p.numel for p in plan if p.replicated) for plan in plans]
        assert max(loads) - min(loads) <= 100


# ---------------------------------------------------------------- refusals
def test_a_directory_without_its_commit_marker_is_never_loaded(url):
    full = _trained_state()
    _write(url, [split_state(full, replicated=True)], full)
    Storage(url).remove(layout.MARKER)
    with pytest.raises(CheckpointError, match="no COMMITTED marker"):
        layout.open_checkpoint(url)


def test_commit_waits_for_every_rank_and_gives_up_without_a_marker(tmp_path):
    full = _trained_state()
    url = str(tmp_path / "checkpoint_000001")
    local = split_state(full, replicated=True)
    request = SaveRequest(url=url, header=HEADER, commit_timeout_s=0.3)
    mine = snapshot(plan_pieces(local.pieces, 0, 2), copy=False)
    with pytest.raises(CheckpointError, match=r"rank_00001.json.*did not appear"):
        write_part(request, 0, 2, mine, meta_bytes({**full, **local.skeleton}))
    assert not Storage(url).exists(layout.MARKER)


def test_pieces_that_leave_a_gap_are_not_committed(tmp_path):
    path = ("models", 0, "w")
    piece = Piece(path, (10,), torch.zeros(6), start=0)  # elements 6..9 written by nobody
    url = str(tmp_path / "checkpoint_000001")
    storage = Storage(url)
    write_part(
        SaveRequest(url=url, header=HEADER, commit_timeout_s=1), 1, 2, [], None
    )  # rank 1 wrote nothing
    with pytest.raises(CheckpointError, match="6 of its 10 elements"):
        write_part(
            SaveRequest(url=url, header=HEADER, commit_timeout_s=1),
            0,
            2,
            [piece],
            meta_bytes({**_trained_state(), "models": [{}], "optimizers": []}),
        )
    assert not storage.exists(layout.MARKER)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate_bin", "truncated or corrupted"),
        ("delete_bin", "file 'rank_00001.bin' is missing"),
        ("garbage_manifest", "not valid JSON"),
        ("foreign_manifest", "not a polytrain checkpoint directory"),
        ("bad_dtype", "has dtype"),
        ("garbage_meta", "Could not read meta.pt"),
    ],
)
def test_damaged_directories_raise_checkpoint_error(tmp_path, damage, message):
    full = _trained_state()
    url = str(tmp_path / "checkpoint_000001")
    _write(url, [split_state(full, replicated=True, with_skeleton=r == 0) for r in range(2)], full)
    folder = tmp_path / "checkpoint_000001"
    manifest = json.loads((folder / layout.MANIFEST).read_text())
    if damage == "truncate_bin":
        data = (folder / "rank_00000.bin").read_bytes()
        (folder / "rank_00000.bin").write_bytes(data[: len(data) // 2])
    elif damage == "delete_bin":
        (folder / "rank_00001.bin").unlink()
    elif damage == "garbage_manifest":
        (folder / layout.MANIFEST).write_text("{not json")
    elif damage == "foreign_manifest":
        (folder / layout.MANIFEST).write_text(json.dumps({"format": "someone-else"}))
    elif damage == "bad_dtype":
        next(iter(manifest["tensors"].values()))["dtype"] = "__import__('os')"
        (folder / layout.MANIFEST).write_text(json.dumps(manifest))
    elif damage == "garbage_meta":
        size = (folder / layout.META).stat().st_size
        (folder / layout.META).write_bytes(b"\x00" * size)  # same size, not a torch file
    with pytest.raises(CheckpointError, match=message):
        layout.open_checkpoint(url)


def test_meta_is_never_unpickled_beyond_plain_types(tmp_path):
    class Evil:
        def __reduce__(self):
            return (exec, (f"open({str(tmp_path / 'PWNED')!r}, 'w').close()",))

    full = _trained_state()
    url = str(tmp_path / "checkpoint_000001")
    _write(url, [split_state(full, replicated=True)], full)
    (tmp_path / "checkpoint_000001" / layout.META).write_bytes(pickle.dumps({"x": Evil()}))
    meta_size = (tmp_path / "checkpoint_000001" / layout.META).stat().st_size
    manifest_path = tmp_path / "checkpoint_000001" / layout.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][layout.META]["bytes"] = meta_size
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="Could not read meta.pt"):
        layout.open_checkpoint(url)
    assert not (tmp_path / "PWNED").exists()


def test_a_checkpoint_of_another_framework_is_refused(tmp_path):
    full = _trained_state()
    url = str(tmp_path / "checkpoint_000001")
    _write(url, [split_state(full, replicated=True)], full)
    with pytest.raises(CheckpointError, match="tensorflow trainer"):
        layout.open_checkpoint(url, framework="tensorflow")


def test_remote_protocol_without_its_package_is_a_config_error():
    with pytest.raises(ConfigError, match=r"s3://bucket/run.*(s3fs|Install)"):
        Storage("s3://bucket/run")


# --------------------------------------------------------------- retention
def _commit_empty(root: Storage, name: str, committed: bool = True) -> None:
    folder = root.child(name)
    folder.makedirs()
    folder.write_bytes("rank_00000.json", json.dumps({"rank": 0, "entries": []}).encode())
    if committed:
        commit(folder, HEADER, 1, 1)


def test_prune_keeps_the_newest_committed_and_the_pending(tmp_path):
    root = Storage(tmp_path)
    for name in ("checkpoint_000001", "checkpoint_000002", "checkpoint_000003.00000010"):
        _commit_empty(root, name)
    _commit_empty(root, "checkpoint_000002.00000005", committed=False)  # interrupted
    _commit_empty(root, "checkpoint_000004", committed=False)  # still being written
    deleted = layout.prune(root, num_to_keep=2)
    assert deleted == ["checkpoint_000001", "checkpoint_000002.00000005"]
    assert root.listdir() == [
        "checkpoint_000002",
        "checkpoint_000003.00000010",
        "checkpoint_000004",
    ]
    assert layout.latest_committed(root).endswith("checkpoint_000003.00000010")


def test_manager_names_fresh_directories_and_tracks_commits(tmp_path):
    manager = CheckpointManager(CheckpointConfig(checkpoint_dir=str(tmp_path)), keep_latest=True)
    request = manager.request({**HEADER, "epoch": 2}, epoch_step=0)
    assert request.url == os.path.join(str(tmp_path), "checkpoint_000002")
    assert request.extra == {"epoch_step": 0}
    full = _trained_state()
    locals_ = [split_state(full, replicated=True, with_skeleton=r == 0) for r in range(2)]
    _write(request.url, locals_, full)
    assert manager.record([{"path": request.url}, {"path": request.url}]) == request.url
    assert manager.restore_point() == request.url
    # a pending (background) save is not a restore point until it commits
    pending = manager.request({**HEADER, "epoch": 3})
    manager.record([{"path": pending.url, "pending": True}])
    assert manager.restore_point() == request.url
    _write(pending.url, locals_, full)
    assert manager.restore_point() == pending.url


def test_without_checkpoint_dir_the_manager_uses_a_temporary_directory_it_deletes():
    manager = CheckpointManager(CheckpointConfig(), keep_latest=True)
    root = manager.root()
    assert os.path.isdir(root.url)
    manager.close()
    assert not os.path.exists(root.url)


# -------------------------------------------------------------- conversion
def test_convert_directory_to_file_and_back_through_the_cli(tmp_path, capsys):
    full = _trained_state()
    src = str(tmp_path / "checkpoint_000001")
    _write(src, [split_state(full, replicated=True, with_skeleton=r == 0) for r in range(2)], full)
    one_file = tmp_path / "model.pt"
    assert cli_main(["checkpoint", "convert", src, str(one_file)]) == 0
    consolidated = ckpt.load_checkpoint(one_file, framework="torch")
    _assert_same(full, consolidated)
    assert consolidated["operator"] == {"note": "kept"} and consolidated["global_step"] == 4
    again = tmp_path / "again"
    assert cli_main(["checkpoint", "convert", str(one_file), str(again), "--shards", "3"]) == 0
    manifest = layout.open_checkpoint(again).manifest
    assert manifest["writers"] == 3 and manifest["epoch"] == 1
    _assert_same(full, read_directory(again))
    assert cli_main(["checkpoint", "inspect", str(again)]) == 0
    assert '"layout": "directory"' in capsys.readouterr().out


def test_convert_refuses_a_non_empty_destination(tmp_path):
    source = tmp_path / "model.pt"
    ckpt.save_checkpoint(_trained_state(), source)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        to_sharded(source, tmp_path / "busy")
    with pytest.raises(CheckpointError, match="no COMMITTED marker"):
        to_consolidated(tmp_path / "busy", tmp_path / "out.pt")
