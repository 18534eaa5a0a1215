"""The wheel folder that lets scripts/gpu-check run on a GPU machine with no network (driven by scripts/gpu-check).

The GPU machine this check is sized for has Python 3.12 with a CUDA build of torch (and numpy) installed, nothing
else of bsr's, no network, and room for about 64 MiB of files beside the working tree. So, on a machine with pip:

- ``prepare``  builds bsr's own wheel and downloads, for CPython 3.12 on manylinux x86_64, every runtime dependency
  of bsr and of its engine extra except torch and numpy (the GPU machine has both; a CUDA torch is gigabytes): the
  non-CUDA Mooncake wheel (TCP on loopback needs no CUDA), FastAPI, uvicorn, pydantic, google-crc32c, Typer, Rich,
  Textual, ... and what those need. The Mooncake wheel is carried without ``transfer_engine_bench`` (a benchmark
  binary bsr never runs, a fifth of the wheel). Mooncake's binaries also load libibverbs, libnuma and libcurl
  (with what they load) from the system, which a GPU image may lack, so those files are copied from this machine
  into ``libs.tar.xz``. The folder holds ``requirements.txt`` (what to install) and ``MANIFEST.json``.
- ``install``  (on the machine that runs the check) installs ONLY from that folder (``pip --no-index``, no pip
  configuration read) into a fresh ``--target`` directory for the host's own Python, so the preinstalled torch
  stays in use, and says which environment the check's processes need: PYTHONPATH, and LD_LIBRARY_PATH naming a
  folder of only those carried libraries the system lacks (its own copies stay in use for everything else).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".gpu-wheels"
TARGET_PYTHON = "3.12"
# pip matches manylinux tags exactly: every tag a CPython 3.12 wheel of bsr's dependencies is published under.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_12_x86_64",
    "manylinux2010_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
# What the GPU machine's Python already has, and what no wheel folder could carry (a CUDA torch is gigabytes).
HOST_PROVIDES = frozenset({"torch", "numpy"})
# Shared libraries every Linux with a CPython and torch has; anything else a Mooncake binary loads from the system
# is carried.
BASE_LIBRARIES = frozenset(
    {
        "linux-vdso.so.1",
        "ld-linux-x86-64.so.2",
        "libc.so.6",
        "libm.so.6",
        "libpthread.so.0",
        "libdl.so.2",
        "librt.so.1",
        "libutil.so.1",
        "libstdc++.so.6",
        "libgcc_s.so.1",
        "libz.so.1",
        # glibc's own: a copy from another glibc would not load beside the system's.
        "libresolv.so.2",
        "libnsl.so.1",
        "libanl.so.1",
    }
)
# The run tool carries 64 MiB with each run, the working tree (about 4 MiB) included.
SIZE_LIMIT_BYTES = 60 * 2**20
LIB_ARCHIVE = "libs.tar.xz"
# Files of the Mooncake wheel bsr never loads, left out so that the folder fits.
MOONCAKE_UNUSED = frozenset({"mooncake/transfer_engine_bench"})
REQUIREMENTS = "requirements.txt"
MANIFEST = "MANIFEST.json"


class WheelsError(Exception):
    """A wheel folder that cannot be made or used; the message is the one line the user sees."""


@dataclass(frozen=True)
class Installed:
    target: Path
    carried: list[str]  # the libraries taken from the wheel folder because the system lacks them (or dry run)
    env: dict[str, str]  # what the check's processes need on top of the environment


def dist_name(requirement: str) -> str:
    """The normalised distribution name of a PEP 508 requirement ("Foo_bar[x]>=1" -> "foo-bar")."""
    name = re.split(r"[\s\[<>=!~;@(]", requirement.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements(pyproject: dict[str, Any]) -> list[str]:
    """bsr's own dependencies and its engine extra's, less what the GPU machine's Python provides."""
    project = pyproject["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["engine"]]
    return [r for r in wanted if dist_name(r) not in HOST_PROVIDES]


def libraries_to_carry(ldd_output: str, inside: Path) -> dict[str, Path]:
    """The system libraries in ``ldd`` output that a bare GPU image may lack: soname -> file, leaving out the base
    libraries and whatever the wheel itself ships (under ``inside``)."""
    found: dict[str, Path] = {}
    for line in ldd_output.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(/\S+)\s+\(0x", line)
        if not m:
            continue
        soname, path = m.group(1), Path(m.group(2))
        if soname in BASE_LIBRARIES or path.resolve().is_relative_to(inside.resolve()):
            continue
        found[soname] = path
    return found


def missing_libraries(ldd_output: str) -> list[str]:
    return [line.split()[0] for line in ldd_output.splitlines() if "=> not found" in line]


def source_digest(root: Path = ROOT) -> str:
    """A digest of what bsr's wheel is built from (bsr_cli/ and pyproject.toml), so that a wheel folder made from
    other sources is refused instead of checking stale code. Needs no git: the GPU machine has only the files."""
    h = hashlib.sha256()
    files = [root / "pyproject.toml", *(p for p in (root / "bsr_cli").rglob("*") if p.is_file())]
    for path in sorted(f for f in files if "__pycache__" not in f.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _pip(python: str, args: Iterable[str], env: dict[str, str] | None = None, timeout: float = 900) -> None:
    argv = [python, "-m", "pip", *args]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise WheelsError(f"pip {' '.join(args)[:80]}... timed out after {timeout:.0f} s") from e
    if p.returncode != 0:
        lines = [x for x in (p.stderr + p.stdout).splitlines() if x.startswith("ERROR")] or p.stderr.splitlines()
        raise WheelsError(f"pip {next(iter(args))} failed: {(lines or ['no output'])[-1].strip()}")


def _ldd(paths: Iterable[Path], ld_library_path: str | None = None) -> str:
    env = dict(os.environ, LD_LIBRARY_PATH=ld_library_path) if ld_library_path is not None else None
    return "\n".join(
        subprocess.run(["ldd", str(p)], capture_output=True, text=True, timeout=60, env=env).stdout for p in paths
    )


def _mooncake_native_files(unpacked: Path) -> list[Path]:
    pkg = unpacked / "mooncake"
    return sorted(p for p in pkg.iterdir() if p.is_file() and (p.suffix == ".so" or os.access(p, os.X_OK)))


def prepare(dest: Path, python: str = sys.executable) -> dict[str, Any]:
    """Make ``dest`` anew: the wheels, the carried libraries, requirements.txt and MANIFEST.json. Returns the
    manifest. Needs pip with access to a package index (or a cache holding the wheels)."""
    if dest.exists() and any(dest.iterdir()) and not (dest / MANIFEST).exists():
        raise WheelsError(f"{dest} exists and is not a wheel folder made by this script; choose another path")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = pyproject["project"]["version"]
    requirements = runtime_requirements(pyproject)
    work = Path(tempfile.mkdtemp(prefix=".gpu-wheels-", dir=dest.parent))
    try:
        # bsr's own wheel, built from this checkout with the build tools this Python already has.
        _pip(python, ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work), str(ROOT)])
        own = sorted(work.glob(f"bsr-{version}-*.whl"))
        if not own:
            raise WheelsError("pip wheel made no bsr wheel")
        platform_args = [a for tag in PLATFORMS for a in ("--platform", tag)]
        py_args = [
            "--python-version",
            TARGET_PYTHON,
            "--implementation",
            "cp",
            "--abi",
            f"cp{TARGET_PYTHON.replace('.', '')}",
        ]
        _pip(
            python,
            [
                "download",
                "-q",
                "--only-binary=:all:",
                *py_args,
                *platform_args,
                "-d",
                str(work),
                str(own[0]),
                *requirements,
            ],
        )
        stray = sorted(p.name for p in work.glob("*.whl") if dist_name(p.name.split("-")[0]) in HOST_PROVIDES)
        if stray:
            raise WheelsError(f"a dependency pulled in what the GPU machine provides: {', '.join(stray)}")
        libs = _carry_mooncake_libraries(work)
        (work / REQUIREMENTS).write_text("\n".join([f"bsr=={version}", *requirements]) + "\n")
        wheels = sorted(p.name for p in work.glob("*.whl"))
        manifest: dict[str, Any] = {
            "python": TARGET_PYTHON,
            "bsr_source": source_digest(),
            "platforms": list(PLATFORMS),
            "host_provides": sorted(HOST_PROVIDES),
            "wheels": wheels,
            "libraries": libs,
            "bytes": 0,
        }
        manifest["bytes"] = folder_bytes(work) + len(json.dumps(manifest, indent=1)) + 16
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if manifest["bytes"] > SIZE_LIMIT_BYTES:
            raise WheelsError(
                f"the wheel folder is {manifest['bytes'] / 2**20:.1f} MiB, over the "
                f"{SIZE_LIMIT_BYTES / 2**20:.0f} MiB that can travel with a run"
            )
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _slim_wheel(wheel: Path, unused: frozenset[str]) -> None:
    """Rewrite ``wheel`` without the ``unused`` files (and their RECORD lines), everything else byte for byte."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in unused:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(x for x in lines if x.split(",", 1)[0] not in unused).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    slim.replace(wheel)


def _unpack_native(wheel: Path, into: Path) -> list[Path]:
    """Unpack the Mooncake package's files (mode bits kept) and return its binaries and extension modules."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.filename.startswith("mooncake") and not info.is_dir():
                zf.extract(info, into)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    (into / info.filename).chmod(mode)
    return _mooncake_native_files(into)


def _carry_mooncake_libraries(folder: Path) -> list[str]:
    wheel = next(iter(sorted(folder.glob("mooncake_transfer_engine_non_cuda-*.whl"))), None)
    if wheel is None:
        raise WheelsError("no mooncake-transfer-engine-non-cuda wheel was downloaded")
    _slim_wheel(wheel, MOONCAKE_UNUSED)
    with tempfile.TemporaryDirectory() as tmp:
        unpacked = Path(tmp)
        out = _ldd(_unpack_native(wheel, unpacked))
        if missing := missing_libraries(out):
            raise WheelsError(f"this machine lacks what Mooncake loads, so it cannot be copied: {', '.join(missing)}")
        carried = libraries_to_carry(out, unpacked)
    with tarfile.open(folder / LIB_ARCHIVE, "w:xz") as tar:
        for soname, path in sorted(carried.items()):
            tar.add(path.resolve(), arcname=soname)
    return sorted(carried)


def install(wheels: Path, python: str, target: Path, use_all_carried: bool = False) -> Installed:
    """Install bsr from ``wheels`` only into ``target`` for ``python`` (the host's Python with torch).

    Mooncake's system libraries come from the system where it has them; each one it lacks (and what that one
    loads in turn) from the carried copies, which alone go into the folder named by LD_LIBRARY_PATH.
    ``use_all_carried`` (the dry run) takes every carried copy instead, so that the copies are what is checked."""
    if not (wheels / MANIFEST).exists():
        raise WheelsError(f"{wheels} is no wheel folder (no {MANIFEST}); make it with scripts/gpu-check --prepare")
    made_from = json.loads((wheels / MANIFEST).read_text()).get("bsr_source")
    if made_from != source_digest():
        raise WheelsError(
            f"{wheels} holds a bsr built from other sources than this checkout's; make it again with "
            "scripts/gpu-check --prepare"
        )
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONSTRAINT", "PYTHONPATH"):
        env.pop(var, None)
    _pip(
        python,
        [
            "install",
            "-q",
            "--no-index",
            "--find-links",
            str(wheels),
            "--target",
            str(target),
            "-r",
            str(wheels / REQUIREMENTS),
        ],
        env=env,
    )
    natives = _mooncake_native_files(target)
    carried_dir, chosen_dir = target / "_carried_libs", target / "_libs"
    chosen_dir.mkdir()
    with tarfile.open(wheels / LIB_ARCHIVE) as tar:
        tar.extractall(carried_dir, filter="data")
    ld_path = os.pathsep.join(filter(None, [str(chosen_dir), os.environ.get("LD_LIBRARY_PATH")]))
    taken: list[str] = []
    wanted = sorted(p.name for p in carried_dir.iterdir()) if use_all_carried else []
    while True:
        for soname in wanted:
            if soname in taken or not (carried_dir / soname).exists():
                raise WheelsError(f"Mooncake cannot load {soname}: the system lacks it and the wheel folder has none")
            shutil.copyfile(carried_dir / soname, chosen_dir / soname)
            taken.append(soname)
        wanted = missing_libraries(_ldd(natives, ld_path))
        if not wanted:
            break
    extra = {"PYTHONPATH": str(target)}
    if taken:
        extra["LD_LIBRARY_PATH"] = ld_path
    return Installed(target=target, carried=sorted(taken), env=extra)


def main(argv: list[str]) -> int:
    dest = Path(argv[0]) if argv else DEFAULT_DIR
    try:
        manifest = prepare(dest.resolve())
    except WheelsError as e:
        print(f"gpu-check --prepare: {e}", file=sys.stderr)
        return 2
    print(
        f"gpu-check --prepare: {dest} holds {len(manifest['wheels'])} wheels for CPython {manifest['python']} "
        f"and {len(manifest['libraries'])} libraries ({', '.join(manifest['libraries']) or 'none'}): "
        f"{manifest['bytes'] / 2**20:.1f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
