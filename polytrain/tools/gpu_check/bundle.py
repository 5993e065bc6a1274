"""The offline bundles: what the GPU node lacks, as wheels, with a manifest and checksums.

    python -m polytrain.tools.gpu_check prepare --out DIR [--ray] [--polytrain-only]
    python -m polytrain.tools.gpu_check verify DIR
    python -m polytrain.tools.gpu_check split FILE --max-mib 60 --out DIR
    python -m polytrain.tools.gpu_check join DIR --out FILE

``prepare`` runs where the package registries are (pip's ordinary client): it
builds polytrain's own wheel from this checkout, DeepSpeed's and fairscale's
wheels from their PyPI source distributions (``DS_BUILD_OPS=0``: pure-Python
``py3-none-any`` wheels, whose CUDA ops DeepSpeed compiles at run time when a
model needs one; the check needs none), and downloads the wheels of what the
target image lacks (:data:`TARGET_LACKS`) for CPython 3.12 on manylinux x86_64,
at the versions installed here (tested with DeepSpeed here). It writes
``manifest.json`` (name, version, file, sha256, size, how it was made) and
``SHA256SUMS`` (for ``sha256sum -c`` on the node) and refuses a bundle over
:data:`MAX_MIB`. With ``--ray`` it makes the second, optional bundle: Ray's wheel
(76 MiB for CPython 3.12) split into parts of at most 60 MiB, plus what Ray needs
beyond the target image.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

#: The largest bundle (and Ray part) that travels to the node in one piece.
MAX_MIB = 60.0
#: Where the wheels go: CPython 3.12 on x86_64 Linux (the target image's Python).
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
#: Built from their source distributions (no wheels on PyPI): name, version.
BUILT = (("deepspeed", "0.19.8"), ("fairscale", "0.4.13"))
#: What DeepSpeed needs and the target image (its package list: docs/gpu-check.md) lacks.
#: typing-extensions is there, maybe older than pydantic needs: the bundle brings its own.
TARGET_LACKS = ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                "typing-extensions")  # fmt: skip
#: The second bundle: Ray, and what Ray needs beyond the target image.
RAY = ("ray", "2.60.0")
RAY_LACKS = ("jsonschema", "jsonschema-specifications", "referencing", "rpds-py")
#: Fallback versions where this environment has none installed.
DEFAULT_VERSIONS = {
    "hjson": "3.1.0",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",
}
MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"


def sha256(path: Path) -> str:
    """The file's SHA-256 (hex)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _mib(size: int) -> float:
    return size / 2**20


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}"
        )


def _installed_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return DEFAULT_VERSIONS[name]


def repo_root() -> Path:
    """The checkout this polytrain was imported from (where ``setup.cfg`` is)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "setup.cfg").exists():
        raise RuntimeError(f"prepare builds polytrain's wheel from a checkout; {root} is none.")
    return root


def build_polytrain(out: Path) -> Path:
    """polytrain's own wheel from this checkout (pure Python, no dependencies pulled).

    Built from a copy of the package's files, so the checkout gains no build folders.
    """
    root = repo_root()
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "src"
        source.mkdir()
        for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
            if (root / name).exists():
                shutil.copy2(root / name, source / name)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(root / "polytrain", source / "polytrain", ignore=ignore)
        build = Path(scratch) / "wheel"
        _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(build), str(source))
        (wheel,) = build.glob("polytrain-*.whl")
        target = out / wheel.name
        shutil.move(str(wheel), target)
    return target


def build_from_sdist(out: Path, name: str, version: str) -> Path:
    """A ``py3-none-any`` wheel built from the package's source distribution (no compiled ops)."""
    env = {**os.environ, "DS_BUILD_OPS": "0", "BUILD_CUDA_EXTENSIONS": "0"}
    with tempfile.TemporaryDirectory() as build:
        _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", build, f"{name}=={version}",
             env=env)  # fmt: skip
        (wheel,) = Path(build).glob("*.whl")
        if not wheel.name.endswith("-py3-none-any.whl"):
            raise RuntimeError(f"{name} built {wheel.name}, not a pure py3-none-any wheel")
        target = out / wheel.name
        shutil.move(str(wheel), target)
    return target


def download(out: Path, requirement: str, python_version: str = PYTHON_VERSION) -> Path:
    """The requirement's wheel for CPython ``python_version`` on manylinux x86_64 (or a pure one)."""
    with tempfile.TemporaryDirectory() as scratch:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
             "--implementation", "cp", *platforms, "-q", "-d", scratch, requirement)  # fmt: skip
        (wheel,) = Path(scratch).glob("*.whl")
        target = out / wheel.name
        shutil.move(str(wheel), target)
    return target


def _entry(path: Path, how: str) -> dict[str, Any]:
    name, version = path.name.split("-")[:2]
    return {"name": name, "version": version, "file": path.name, "sha256": sha256(path),
            "size": path.stat().st_size, "how": how}  # fmt: skip


def write_manifest(
    out: Path, entries: list[dict[str, Any]], kind: str, python_version: str = PYTHON_VERSION
) -> dict[str, Any]:
    """``manifest.json`` and ``SHA256SUMS`` for ``entries``.

    Raises:
        RuntimeError: the bundle is larger than :data:`MAX_MIB`.
    """
    total = sum(e["size"] for e in entries)
    manifest = {
        "bundle": kind,
        "python": python_version,
        "platforms": list(PLATFORMS),
        "files": entries,
        "total_bytes": total,
        "total_mib": round(_mib(total), 2),
        "max_mib": MAX_MIB,
    }
    if _mib(total) > MAX_MIB:
        raise RuntimeError(f"the {kind} bundle is {_mib(total):.1f} MiB, over {MAX_MIB:g} MiB: "
                           + ", ".join(f"{e['file']} {_mib(e['size']):.1f}" for e in entries))  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / SUMS).write_text("".join(f"{e['sha256']}  {e['file']}\n" for e in entries))
    return manifest


def prepare(
    out: Path, polytrain_only: bool = False, python_version: str = PYTHON_VERSION
) -> dict[str, Any]:
    """The check's bundle in ``out`` (emptied first): see the module's docstring.

    ``python_version``: the target's Python (the compiled wheels, pydantic-core's, are
    per version); the tests prepare one for the Python they run on.
    """
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    entries = [_entry(build_polytrain(out), "built from this checkout")]
    if not polytrain_only:
        for name, version in BUILT:
            entries.append(_entry(build_from_sdist(out, name, version), "built from its sdist"))
        for name in TARGET_LACKS:
            wheel = download(out, f"{name}=={_installed_version(name)}", python_version)
            entries.append(_entry(wheel, "downloaded"))
    script = repo_root() / "scripts" / "gpu_check.sh"
    if script.exists():  # the node gets the bundle only: the script travels in it
        shutil.copy2(script, out / script.name)
    kind = "gpu-check" if not polytrain_only else "polytrain-only"
    return write_manifest(out, entries, kind, python_version)


def split(path: Path, out: Path, max_mib: float = MAX_MIB) -> list[dict[str, Any]]:
    """``path`` cut into ``<name>.partN`` files of at most ``max_mib``, with ``<name>.parts.json``."""
    out.mkdir(parents=True, exist_ok=True)
    limit = int(max_mib * 2**20)
    parts = []
    with path.open("rb") as handle:
        for index in range(1, 1000):
            block = handle.read(limit)
            if not block:
                break
            part = out / f"{path.name}.part{index}"
            part.write_bytes(block)
            parts.append(_part_entry(part))
    record = {"file": path.name, "sha256": sha256(path), "size": path.stat().st_size,
              "parts": parts}  # fmt: skip
    (out / f"{path.name}.parts.json").write_text(json.dumps(record, indent=1) + "\n")
    return parts


def _part_entry(part: Path) -> dict[str, Any]:
    return {"file": part.name, "sha256": sha256(part), "size": part.stat().st_size}


def join(folder: Path, out: Path) -> Path:
    """Reassemble the one split file in ``folder`` into ``out`` (a folder), checking every sum.

    Raises:
        RuntimeError: a part or the whole does not match its recorded SHA-256.
    """
    (record_path,) = folder.glob("*.parts.json")
    record = json.loads(record_path.read_text())
    target = out / record["file"]
    with target.open("wb") as handle:
        for part in record["parts"]:
            path = folder / part["file"]
            if sha256(path) != part["sha256"]:
                raise RuntimeError(f"{path}: its SHA-256 differs from {record_path}'s")
            handle.write(path.read_bytes())
    if sha256(target) != record["sha256"]:
        raise RuntimeError(f"{target}: the joined parts' SHA-256 differs from the original's")
    return target


def prepare_ray(out: Path, python_version: str = PYTHON_VERSION) -> dict[str, Any]:
    """The second bundle: Ray's wheel in parts of at most 60 MiB and Ray's missing dependencies."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        wheel = download(Path(scratch), f"{RAY[0]}=={RAY[1]}", python_version)
        parts = split(wheel, out)
    entries = [{**p, "name": RAY[0], "version": RAY[1], "how": f"part of {wheel.name}"}
               for p in parts]  # fmt: skip
    for name in RAY_LACKS:
        version = _installed_version_or_none(name)
        requirement = f"{name}=={version}" if version else name
        entries.append(_entry(download(out, requirement, python_version), "downloaded"))
    # Each part travels alone (at most 60 MiB); the whole second bundle is larger.
    manifest = {"bundle": "ray", "python": python_version, "files": entries,
                "total_mib": round(_mib(sum(e["size"] for e in entries)), 2),
                "max_mib_per_file": MAX_MIB}  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / SUMS).write_text("".join(f"{e['sha256']}  {e['file']}\n" for e in entries))
    return manifest


def _installed_version_or_none(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def verify(folder: Path) -> list[str]:
    """What is wrong with the bundle in ``folder`` (empty: it matches its manifest)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    problems = []
    listed = {e["file"] for e in manifest["files"]}
    for entry in manifest["files"]:
        path = folder / entry["file"]
        if not path.exists():
            problems.append(f"{entry['file']}: missing")
        elif path.stat().st_size != entry["size"] or sha256(path) != entry["sha256"]:
            problems.append(f"{entry['file']}: size or SHA-256 differs from the manifest")
    extra = sorted(p.name for p in folder.glob("*.whl") if p.name not in listed)
    problems += [f"{name}: not in the manifest" for name in extra]
    total = sum(e["size"] for e in manifest["files"])
    if manifest["bundle"] != "ray" and _mib(total) > MAX_MIB:
        problems.append(f"{_mib(total):.1f} MiB in all, over {MAX_MIB:g} MiB")
    return problems


def main(argv: list[str]) -> int:
    """``prepare``, ``verify``, ``split`` or ``join`` (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m polytrain.tools.gpu_check")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="build the offline bundle")
    p.add_argument("--out", default="gpu_bundle")
    p.add_argument("--ray", action="store_true", help="the second bundle: Ray in parts")
    p.add_argument(
        "--polytrain-only",
        action="store_true",
        help="polytrain's wheel alone (no DeepSpeed, fairscale or their needs)",
    )
    p.add_argument(
        "--python-version",
        default=PYTHON_VERSION,
        help=f"the target's Python, for compiled wheels (default {PYTHON_VERSION})",
    )
    v = commands.add_parser("verify", help="check a bundle against its manifest")
    v.add_argument("folder")
    s = commands.add_parser("split", help="cut a file into parts of at most --max-mib")
    s.add_argument("file")
    s.add_argument("--out", required=True)
    s.add_argument("--max-mib", type=float, default=MAX_MIB)
    j = commands.add_parser("join", help="reassemble a split file, checking the sums")
    j.add_argument("folder")
    j.add_argument("--out", required=True)
    args = parser.parse_args(argv)  # fmt: skip
    if args.command == "prepare":
        if args.ray:
            manifest = prepare_ray(Path(args.out), args.python_version)
        else:
            manifest = prepare(Path(args.out), args.polytrain_only, args.python_version)
        for entry in manifest["files"]:
            print(f"{entry['file']:70s} {_mib(entry['size']):7.2f} MiB  {entry.get('how', '')}")
        print(f"{manifest['total_mib']} MiB in {args.out}")
        return 0
    if args.command == "verify":
        problems = verify(Path(args.folder))
        print("\n".join(problems) or f"{args.folder}: every file matches the manifest")
        return 1 if problems else 0
    if args.command == "split":
        for part in split(Path(args.file), Path(args.out), args.max_mib):
            print(f"{part['file']} {_mib(part['size']):.2f} MiB")
        return 0
    print(join(Path(args.folder), Path(args.out)))
    return 0
