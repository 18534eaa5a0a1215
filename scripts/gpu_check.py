"""The GPU check (driven by scripts/gpu-check): bsr's CUDA paths, which the CPU machines never run, in ≤ 8 minutes.

Made for a GPU machine that has only Python 3.12 with a CUDA torch (and numpy) and no network: ``install`` puts
bsr and everything else it needs there from the wheel folder that ``scripts/gpu-check --prepare`` made
(scripts/gpu_check_wheels.py), into a fresh directory, using nothing but that folder. Then these steps, each with
its own deadline, all run even when one fails:

1. ``preflight``  torch with CUDA, the GPU's name, Mooncake's binaries, bsr importable (from the install).
2. ``engine``     the embedded engine with CUDA destination KV: every rank reports a ``cuda`` device (pinned restore
                  pool, H2D installs, stream sync before release); submit, a windowed restore from Mooncake only
                  (committed, canonical hash), a fault on one rank fails closed, the next submit honours the
                  force-local marker it left (served from fs or recomputed, canonical hash, marker cleared).
3. ``sweep``      ``bsr bench sweep --embedded`` at two prefixes (peak pool = RWS(W) in every row).
4. ``store``      ``bsr bench store --embedded``, one trial (memcpy/CRC32C ceilings, Mooncake GET/PUT, restores).
5. ``vllm``       vLLM (CUDA build) + LMCache 0.5.6 + BSRConnector on a tiny random-weight Llama
                  (scripts/gpu_check_vllm.py under ``$VLLM_PY``, or the host's Python when it has both): the second
                  request loads its prefix through the connector (hit tokens asserted), and both generations agree.
                  vLLM cannot travel as wheels; on a machine without it this step is skipped, saying so.

``--dry-run`` runs the same steps on CPU, on a Python 3.12 with torch standing in for the GPU machine's
(``$PY``, else the one ``scripts/gpu-check --make-host`` made), installing from the same wheel folder: the devices
expected are ``cpu``, the prefixes smaller, every carried library is used, and the vLLM step only checks that its
interpreter imports vLLM, LMCache and the connector (LMCache under a CPU vLLM loads nothing). ``--no-install``
runs the steps from this checkout with ``$PY`` as it is (a machine where bsr's engine extra is installed).

Writes ``report.json``, ``report.md`` and the bench bundles into the output directory. Exit 0 when every step
passed (the vLLM step may be skipped for want of vLLM), 1 otherwise, 2 when the install from the wheel folder failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check_wheels as wheels  # noqa: E402 - beside this script, not a package

BUDGET_S = 8 * 60
# The Python the dry run stands in for the GPU machine's with (scripts/gpu-check --make-host makes it).
DRY_RUN_HOST = Path.home() / ".cache" / "bsr" / "gpu-check-host-py312" / "bin" / "python"
VLLM_NEEDED = (
    "needs a machine with vLLM (CUDA build) and LMCache 0.5.6, which cannot travel as wheels: set VLLM_PY to such a "
    "Python there"
)


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT) -> tuple[int, str, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(cwd))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out, f"timed out after {timeout:.0f}s"
    return p.returncode, p.stdout, p.stderr


class Check:
    def __init__(self, py: str, out: Path, dry: bool, wheel_dir: Path | None) -> None:
        self.py, self.out, self.dry, self.wheel_dir = py, out, dry, wheel_dir
        self.steps: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.state = Path(tempfile.mkdtemp(prefix="bsr-gpu-check-"))
        # Every bsr process runs in the state directory, so that this checkout is never on its path by accident.
        self.cwd = self.state
        self.env = dict(os.environ, BSR_STATE_DIR=str(self.state), XDG_CONFIG_HOME=str(self.state / "config"))
        if wheel_dir is None:  # --no-install: bsr from this checkout
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), self.env.get("PYTHONPATH", "")]))
        else:
            self.env.pop("PYTHONPATH", None)
        self.installed: wheels.Installed | None = None
        self.vllm_py: str | None = os.environ.get("VLLM_PY")

    def left(self) -> float:
        return BUDGET_S - (time.monotonic() - self.t0)

    def bsr(self, *args: str, timeout: float = 120) -> tuple[int, Any, str]:
        rc, out, err = _run(
            [self.py, "-m", "bsr_cli", *args, "--json"], min(timeout, max(self.left(), 5)), self.env, self.cwd
        )
        try:
            data = json.loads(out) if out.strip() else None
        except json.JSONDecodeError:
            data = None
        return rc, data, (err.strip().splitlines() or [""])[-1]

    def step(self, name: str, fn: Any) -> None:
        t = time.monotonic()
        rec: dict[str, Any] = {"step": name}
        try:
            status, facts = fn()
            rec |= {"status": status, **facts}
        except (AssertionError, wheels.WheelsError) as e:
            rec |= {"status": "fail", "reason": str(e) or "assertion failed"}
        except Exception as e:  # noqa: BLE001 - a broken step is reported, the others still run
            rec |= {"status": "fail", "reason": f"{type(e).__name__}: {e}"}
        rec["seconds"] = round(time.monotonic() - t, 1)
        self.steps.append(rec)
        print(
            f"gpu-check {name}: {rec['status']} ({rec['seconds']} s)"
            + (f" - {rec.get('reason')}" if rec.get("reason") else ""),
            flush=True,
        )

    # -- steps ---------------------------------------------------------------------------------------------------
    def install(self) -> tuple[str, dict[str, Any]]:
        assert self.wheel_dir is not None
        target = self.state / "site"
        # The dry run takes every carried library, so that the copies a bare GPU image would load are checked.
        self.installed = wheels.install(self.wheel_dir, self.py, target, use_all_carried=self.dry)
        self.env |= self.installed.env
        manifest = json.loads((self.wheel_dir / wheels.MANIFEST).read_text())
        return "pass", {
            "python": self.py,
            "wheel_folder": str(self.wheel_dir),
            "wheel_folder_mib": round(manifest["bytes"] / 2**20, 1),
            "wheels": len(manifest["wheels"]),
            # Empty: the system has every library Mooncake loads.
            "carried_libraries_used": self.installed.carried,
        }

    def preflight(self) -> tuple[str, dict[str, Any]]:
        code = (
            "import json, sys, importlib.util as u, torch, bsr_cli; from bsr_cli.mooncake import services; "
            "ok = torch.cuda.is_available(); "
            "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': ok, "
            "'gpu': torch.cuda.get_device_name(0) if ok else None, 'gpus': torch.cuda.device_count(), "
            "'bsr': bsr_cli.__file__, 'mooncake_master': str(services.find_binary(services.MASTER_BINARY)), "
            "'has_vllm': bool(u.find_spec('vllm') and u.find_spec('lmcache'))}))"
        )
        rc, out, err = _run([self.py, "-c", code], 120, self.env, self.cwd)
        assert rc == 0, f"bsr/torch/Mooncake not importable with {self.py}: {_last_line(err)}"
        facts = json.loads(out.strip().splitlines()[-1])
        if self.installed is not None:
            assert Path(facts["bsr"]).is_relative_to(self.installed.target), (
                f"bsr imported from {facts['bsr']}, not from the install in {self.installed.target}"
            )
        if not self.dry:
            assert facts["cuda"], f"torch {facts['torch']} sees no CUDA device (run with --dry-run on CPU)"
        if self.vllm_py is None and facts.pop("has_vllm"):
            self.vllm_py = self.py
        facts.pop("has_vllm", None)
        return "pass", facts

    def engine(self) -> tuple[str, dict[str, Any]]:
        n = 8192 if self.dry else 65536
        want = "cpu" if self.dry else "cuda"
        rc, _, err = self.bsr(
            "engine", "up", "--enable-faults", "--max-tokens", str(n), "--kv-tokens", str(2 * n), timeout=180
        )
        assert rc == 0, f"engine up: {err}"
        try:
            rc, _, err = self.bsr("status")
            assert rc == 0, f"status: {err}"
            # Each rank reports its device when it comes up; the supervisor keeps it in the state directory.
            state = json.loads((self.state / "state.json").read_text())
            devices = sorted({str(v) for v in _find(state, "device")})
            assert devices and all(d.startswith(want) for d in devices), f"rank devices {devices}, expected {want}"
            rc, sub, err = self.bsr("submit", "--synthetic", str(n), "--seed", "3", timeout=240)
            assert rc == 0 and sub and sub.get("hash_ok") is True, f"submit: {err or _brief(sub)}"
            rc, res, err = self.bsr(
                "restore", "--synthetic", str(n), "--seed", "3", "--W", "8", "--exclude-tier", "fs", timeout=240
            )
            assert rc == 0 and res and res.get("outcome") == "committed" and res.get("committed_tokens") == n, (
                f"restore: {err or _brief(res)}"
            )
            assert res.get("hash_ok") is True, "restore: installed KV differs from the canonical KV"
            rc, _, err = self.bsr("inject-fault", "--rank", "1", "--kind", "restore-fault", "--window", "2")
            assert rc == 0, f"inject-fault: {err}"
            rc, bad, err = self.bsr(
                "restore", "--synthetic", str(n), "--seed", "3", "--W", "8", "--exclude-tier", "fs", timeout=240
            )
            assert rc == 10 and bad and bad["committed_tokens"] == 0, (
                f"faulted restore did not fail closed: rc {rc} {err}"
            )
            rc, again, err = self.bsr("submit", "--synthetic", str(n), "--seed", "3", timeout=240)
            # The failed restore left a force-local marker: the next submit honours it (never the path that just
            # failed), is served with the canonical KV, and clears it.
            marker = (again or {}).get("force_local") or {}
            assert rc == 0 and again and again.get("hash_ok") is True and marker.get("cleared") is True, (
                f"fallback after the fault: {err or _brief(again)}"
            )
            assert again.get("source") in ("fs", "recompute"), (
                f"fallback after the fault came from {again.get('source')}"
            )
            return "pass", {
                "devices": devices,
                "tokens": n,
                "restore_seconds": res.get("seconds"),
                "restore_gbps": res.get("gbps"),
                "windows": res.get("windows"),
                "fallback_source": again.get("source"),
                "peak_pool_bytes": [r.get("peak_live_bytes") for r in res.get("ranks", [])],
            }
        finally:
            self.bsr("engine", "down", timeout=60)

    def bench(self, experiment: str, *args: str, timeout: float) -> tuple[str, dict[str, Any]]:
        rc, data, err = self.bsr(
            "bench", experiment, "--embedded", "--out", str(self.out), "--no-plots", *args, timeout=timeout
        )
        assert data is not None, f"bench {experiment}: rc {rc}: {err}"
        assert rc == 0, f"bench {experiment}: rc {rc}: {err}"
        return "pass", {
            "bundle": Path(data["files"]["bundle"]).name,
            "summary": data.get("summary"),
            "targets": data.get("targets"),
        }

    def sweep(self) -> tuple[str, dict[str, Any]]:
        toks = "8192,16384" if self.dry else "32768,131072"
        return self.bench("sweep", "--tokens", toks, "--no-repeat", timeout=200)

    def store(self) -> tuple[str, dict[str, Any]]:
        n, raw = ("8192", "64MiB") if self.dry else ("131072", "512MiB")
        return self.bench("store", "--tokens", n, "--trials", "1", "--raw-bytes", raw, "--copy-bytes", raw, timeout=200)

    def vllm(self) -> tuple[str, dict[str, Any]]:
        vpy = self.vllm_py
        if not vpy:
            return "skipped", {"reason": VLLM_NEEDED}
        env = dict(self.env)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "plugins"), env["PYTHONPATH"]])
        env |= {"PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"}
        argv = [vpy, str(ROOT / "scripts" / "gpu_check_vllm.py"), str(self.state / "vllm")]
        if self.dry:
            argv.append("--imports-only")
        rc, out, err = _run(argv, min(300, max(self.left(), 5)), env, self.cwd)
        (self.out / "vllm.log").write_text(out + "\n--- stderr ---\n" + err[-200_000:])
        lines = [x for x in out.splitlines() if x.startswith("{")]
        assert rc == 0 and lines, f"vLLM check rc {rc}: {(err.strip().splitlines() or [''])[-1]}"
        return "pass", json.loads(lines[-1])

    def finish(self) -> int:
        ok = bool(self.steps) and all(_step_ok(s) for s in self.steps)
        report = {"dry_run": self.dry, "ok": ok, "seconds": round(time.monotonic() - self.t0, 1), "steps": self.steps}
        (self.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        md = [f"# bsr GPU check{' (dry run on CPU)' if self.dry else ''}: {'PASS' if ok else 'FAIL'}", ""]
        md += [
            f"- {s['step']}: {s['status']} ({s['seconds']} s)" + (f" - {s['reason']}" if s.get("reason") else "")
            for s in self.steps
        ]
        if any(s["step"] == "vllm" and s["status"] == "skipped" for s in self.steps):
            md += ["", f"The vLLM step was skipped, not failed: it {VLLM_NEEDED}."]
        (self.out / "report.md").write_text("\n".join(md) + "\n")
        shutil.rmtree(self.state, ignore_errors=True)
        print(f"gpu-check: {'PASS' if ok else 'FAIL'} in {report['seconds']} s; report {self.out / 'report.md'}")
        return 0 if ok else 1


def _last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[-1]


def _brief(result: Any) -> str:
    """One line of a bsr --json answer for a failure reason: the fields that say what happened."""
    if not isinstance(result, dict):
        return "no JSON answer"
    keys = ("outcome", "source", "committed_tokens", "external_tokens", "hash_ok", "failure", "error")
    return ", ".join(f"{k} {result[k]}" for k in keys if result.get(k) is not None) or "an answer without an outcome"


def _step_ok(step: dict[str, Any]) -> bool:
    """Every step must pass, except that the vLLM step may be skipped: vLLM cannot travel to a machine without it."""
    return step["status"] == "pass" or (step["step"] == "vllm" and step["status"] == "skipped")


def _find(obj: Any, key: str) -> list[Any]:
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == key] + [x for v in obj.values() for x in _find(v, key)]
    if isinstance(obj, list):
        return [x for v in obj for x in _find(v, key)]
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", help="output directory [default: $OUT/gpu-check, or a new temp dir]")
    ap.add_argument("--dry-run", action="store_true", help="run every step on CPU (no GPU needed)")
    ap.add_argument(
        "--wheels",
        type=Path,
        default=Path(os.environ.get("BSR_GPU_WHEELS", wheels.DEFAULT_DIR)),
        help="the wheel folder to install from [default: .gpu-wheels]",
    )
    ap.add_argument("--no-install", action="store_true", help="run bsr from this checkout with $PY as it is")
    a = ap.parse_args()
    out = Path(
        a.out
        or (
            Path(os.environ["OUT"]) / "gpu-check"
            if os.environ.get("OUT")
            else tempfile.mkdtemp(prefix="bsr-gpu-check-out-")
        )
    )
    out.mkdir(parents=True, exist_ok=True)
    wheel_dir = None if a.no_install else a.wheels.resolve()
    py = _python(a.dry_run, installing=wheel_dir is not None)
    if py is None:
        print(
            f"gpu-check: no Python 3.12 with torch for the dry run at {DRY_RUN_HOST}: make it with "
            "scripts/gpu-check --make-host, or set PY",
            file=sys.stderr,
        )
        return 2
    if wheel_dir is not None and not (wheel_dir / wheels.MANIFEST).exists():
        print(
            f"gpu-check: no wheel folder at {wheel_dir}: make it with scripts/gpu-check --prepare (and carry it), "
            "or run with --no-install where bsr's engine extra is installed",
            file=sys.stderr,
        )
        return 2
    c = Check(py, out, a.dry_run, wheel_dir)
    print(f"gpu-check: bsr's Python {py}" + (f", installing from {wheel_dir}" if wheel_dir else ""), flush=True)
    installed = True
    try:
        if wheel_dir is not None:
            c.step("install", c.install)
            installed = c.steps[-1]["status"] == "pass"
        if installed:
            for name in ("preflight", "engine", "sweep", "store", "vllm"):
                c.step(name, getattr(c, name))
    finally:
        # Nothing may outlive the check: stop an engine a failed step left behind.
        if installed:
            _run([py, "-m", "bsr_cli", "engine", "down"], 60, c.env, c.cwd)
    rc = c.finish()
    return rc if installed else 2


def _python(dry: bool, installing: bool) -> str | None:
    """bsr's Python: $PY; else, installing, the GPU machine's own python3 (the dry run: the stand-in made by
    --make-host); else this checkout's .venv."""
    if os.environ.get("PY"):
        return os.environ["PY"]
    if installing:
        if dry:
            return str(DRY_RUN_HOST) if DRY_RUN_HOST.exists() else None
        return shutil.which("python3") or sys.executable
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


if __name__ == "__main__":
    sys.exit(main())
