"""scripts/gpu-check's wheel folder (scripts/gpu_check_wheels.py) and its verdict (scripts/gpu_check.py): what is
carried to a GPU machine that has only Python 3.12 with torch, and which outcome passes there. The end-to-end
dry run (``scripts/gpu-check --dry-run``) needs the network once and ~4 GB for its stand-in Python, so it is run
by hand; these are the decisions it rests on."""

from __future__ import annotations

import json
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
import gpu_check_wheels as wheels  # noqa: E402


def test_carried_requirements_are_bsrs_and_the_engine_extras_without_what_the_gpu_machine_has() -> None:
    reqs = wheels.runtime_requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    names = {wheels.dist_name(r) for r in reqs}
    assert not names & {"torch", "numpy"}  # a CUDA torch is gigabytes; the GPU machine has both
    # What the GPU machine lacks: the non-CUDA Mooncake wheel, the admin API's stack, checksums, the CLI's own.
    assert {"mooncake-transfer-engine-non-cuda", "fastapi", "uvicorn", "pydantic", "google-crc32c"} <= names
    assert {"typer", "rich", "httpx", "textual", "pyyaml", "prometheus-client"} <= names


def test_dist_name_normalises_a_requirement() -> None:
    assert wheels.dist_name("prometheus_client>=0.24,<1") == "prometheus-client"
    assert wheels.dist_name("Foo.Bar[x] ; python_version<'3.12'") == "foo-bar"
    assert wheels.dist_name("torch==2.13.0") == "torch"


LDD = """\
\tlinux-vdso.so.1 (0x00007ffd)
\tlibetcd_wrapper.so => {wheel}/mooncake/libetcd_wrapper.so (0x00007fde7600)
\tlibglog-6ed04f2c.so.0.0.0 => {wheel}/mooncake/../mooncake_transfer_engine_non_cuda.libs/libglog.so (0x00007f)
\tlibibverbs.so.1 => /lib/x86_64-linux-gnu/libibverbs.so.1 (0x00007f7d1102c000)
\tlibnl-3.so.200 => /lib/x86_64-linux-gnu/libnl-3.so.200 (0x00007f)
\tlibstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007f)
\tlibresolv.so.2 => /lib/x86_64-linux-gnu/libresolv.so.2 (0x00007f)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)
\tlibnuma.so.1 => not found
\t/lib64/ld-linux-x86-64.so.2 (0x00007f)
"""


def test_the_system_libraries_mooncake_loads_are_carried_but_not_the_base_ones_nor_the_wheels_own(
    tmp_path: Path,
) -> None:
    out = LDD.format(wheel=tmp_path)
    carried = wheels.libraries_to_carry(out, tmp_path)
    assert sorted(carried) == ["libibverbs.so.1", "libnl-3.so.200"]
    assert carried["libibverbs.so.1"] == Path("/lib/x86_64-linux-gnu/libibverbs.so.1")
    assert wheels.missing_libraries(out) == ["libnuma.so.1"]


def test_slimming_the_mooncake_wheel_drops_the_unused_file_and_its_record_line_only(tmp_path: Path) -> None:
    whl = tmp_path / "mooncake_transfer_engine_non_cuda-0.3.13.post1-cp312-cp312-manylinux_2_28_x86_64.whl"
    record = "mooncake/store.so,sha256=a,3\nmooncake/transfer_engine_bench,sha256=b,5\nx.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("mooncake/store.so", b"elf")
        zf.writestr("mooncake/transfer_engine_bench", b"bench")
        zf.writestr("x.dist-info/RECORD", record)
    wheels._slim_wheel(whl, wheels.MOONCAKE_UNUSED)
    with zipfile.ZipFile(whl) as zf:
        assert sorted(zf.namelist()) == ["mooncake/store.so", "x.dist-info/RECORD"]
        assert zf.read("mooncake/store.so") == b"elf"
        assert zf.read("x.dist-info/RECORD").decode() == "mooncake/store.so,sha256=a,3\nx.dist-info/RECORD,,\n"


def test_install_refuses_a_folder_that_is_no_wheel_folder(tmp_path: Path) -> None:
    (tmp_path / "some.whl").write_bytes(b"")
    with pytest.raises(wheels.WheelsError, match="no wheel folder"):
        wheels.install(tmp_path, sys.executable, tmp_path / "site")


def test_install_refuses_a_wheel_folder_made_from_other_sources(tmp_path: Path) -> None:
    (tmp_path / wheels.MANIFEST).write_text(json.dumps({"bsr_source": "0" * 16}))
    with pytest.raises(wheels.WheelsError, match="other sources than this checkout"):
        wheels.install(tmp_path, sys.executable, tmp_path / "site")


def test_the_source_digest_follows_bsrs_sources_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "bsr_cli" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    (tmp_path / "bsr_cli" / "a.py").write_text("x = 1\n")
    first = wheels.source_digest(tmp_path)
    (tmp_path / "bsr_cli" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"compiled")
    (tmp_path / "notes.txt").write_text("not packaged")
    assert wheels.source_digest(tmp_path) == first
    (tmp_path / "bsr_cli" / "a.py").write_text("x = 2\n")
    assert wheels.source_digest(tmp_path) != first


@pytest.mark.parametrize(
    ("step", "status", "ok"),
    [
        ("vllm", "pass", True),
        ("vllm", "skipped", True),  # vLLM cannot travel: its absence is said, not failed
        ("vllm", "fail", False),
        ("engine", "skipped", False),
        ("install", "fail", False),
        ("store", "pass", True),
    ],
)
def test_only_the_vllm_step_may_be_skipped(step: str, status: str, ok: bool) -> None:
    assert gpu_check._step_ok({"step": step, "status": status}) is ok
