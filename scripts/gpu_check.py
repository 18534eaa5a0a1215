"""The GPU check (driven by scripts/gpu-check): bsr's CUDA paths, which the CPU machines never run, in ≤ 8 minutes.

Steps, each with its own deadline, all run even when one fails:

1. ``preflight``  torch with CUDA, the GPU's name, Mooncake's binaries, bsr importable.
2. ``engine``     the embedded engine with CUDA destination KV: every rank reports a ``cuda`` device (pinned restore
                  pool, H2D installs, stream sync before release); submit, a windowed restore from Mooncake only
                  (committed, canonical hash), a fault on one rank fails closed, the next submit falls back to fs.
3. ``sweep``      ``bsr bench sweep --embedded`` at two prefixes (peak pool = RWS(W) in every row).
4. ``store``      ``bsr bench store --embedded``, one trial (memcpy/CRC32C ceilings, Mooncake GET/PUT, restores).
5. ``vllm``       vLLM (CUDA build) + LMCache 0.5.6 + BSRConnector on a tiny random-weight Llama
                  (scripts/gpu_check_vllm.py under ``$VLLM_PY``): the second request loads its prefix through the
                  connector (hit tokens asserted), and both generations agree.

``--dry-run`` runs the same steps on CPU (the devices expected are ``cpu``; smaller prefixes; the vLLM step only
checks that its interpreter imports vLLM, LMCache and the connector, because LMCache under a CPU vLLM loads
nothing). Writes ``report.json``, ``report.md`` and the bench bundles into the output directory. Exit 0 when every
step passed, 1 otherwise (a step skipped for a missing prerequisite counts as not passed outside a dry run).
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
BUDGET_S = 8 * 60


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out, f"timed out after {timeout:.0f}s"
    return p.returncode, p.stdout, p.stderr


class Check:
    def __init__(self, py: str, out: Path, dry: bool) -> None:
        self.py, self.out, self.dry = py, out, dry
        self.steps: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.state = Path(tempfile.mkdtemp(prefix="bsr-gpu-check-"))
        self.env = dict(os.environ, BSR_STATE_DIR=str(self.state), XDG_CONFIG_HOME=str(self.state / "config"))
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), self.env.get("PYTHONPATH", "")]))

    def left(self) -> float:
        return BUDGET_S - (time.monotonic() - self.t0)

    def bsr(self, *args: str, timeout: float = 120) -> tuple[int, Any, str]:
        rc, out, err = _run([self.py, "-m", "bsr_cli", *args, "--json"], min(timeout, max(self.left(), 5)), self.env)
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
        except AssertionError as e:
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
    def preflight(self) -> tuple[str, dict[str, Any]]:
        code = (
            "import json, torch; from bsr_cli.mooncake import services; "
            "ok = torch.cuda.is_available(); "
            "print(json.dumps({'torch': torch.__version__, 'cuda': ok, "
            "'gpu': torch.cuda.get_device_name(0) if ok else None, 'gpus': torch.cuda.device_count(), "
            "'mooncake_master': str(services.find_binary(services.MASTER_BINARY))}))"
        )
        rc, out, err = _run([self.py, "-c", code], 120, self.env)
        assert rc == 0, f"bsr/torch/Mooncake not importable with {self.py}: {err.strip().splitlines()[-1:]}"
        facts = json.loads(out.strip().splitlines()[-1])
        if not self.dry:
            assert facts["cuda"], f"torch {facts['torch']} sees no CUDA device (run with --dry-run on CPU)"
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
            assert rc == 0 and sub and sub.get("hash_ok") is True, f"submit: {err or sub}"
            rc, res, err = self.bsr(
                "restore", "--synthetic", str(n), "--seed", "3", "--W", "8", "--exclude-tier", "fs", timeout=240
            )
            assert rc == 0 and res["outcome"] == "committed" and res["committed_tokens"] == n, f"restore: {err or res}"
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
            assert rc == 0 and again.get("hash_ok") is True and again.get("source") == "fs", f"fallback: {err or again}"
            return "pass", {
                "devices": devices,
                "tokens": n,
                "restore_seconds": res.get("seconds"),
                "restore_gbps": res.get("gbps"),
                "windows": res.get("windows"),
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
        vpy = os.environ.get("VLLM_PY")
        if not vpy:
            return ("skipped" if self.dry else "fail"), {
                "reason": "VLLM_PY (a Python with vLLM, LMCache 0.5.6) not set"
            }
        env = dict(self.env)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "plugins"), env["PYTHONPATH"]])
        env |= {"PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"}
        argv = [vpy, str(ROOT / "scripts" / "gpu_check_vllm.py"), str(self.state / "vllm")]
        if self.dry:
            argv.append("--imports-only")
        rc, out, err = _run(argv, min(300, max(self.left(), 5)), env)
        (self.out / "vllm.log").write_text(out + "\n--- stderr ---\n" + err[-200_000:])
        lines = [x for x in out.splitlines() if x.startswith("{")]
        assert rc == 0 and lines, f"vLLM check rc {rc}: {(err.strip().splitlines() or [''])[-1]}"
        return "pass", json.loads(lines[-1])

    def finish(self) -> int:
        ok = all(s["status"] == "pass" or (self.dry and s["status"] == "skipped") for s in self.steps)
        report = {"dry_run": self.dry, "ok": ok, "seconds": round(time.monotonic() - self.t0, 1), "steps": self.steps}
        (self.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        md = [f"# bsr GPU check{' (dry run on CPU)' if self.dry else ''}: {'PASS' if ok else 'FAIL'}", ""]
        md += [
            f"- {s['step']}: {s['status']} ({s['seconds']} s)" + (f" - {s['reason']}" if s.get("reason") else "")
            for s in self.steps
        ]
        (self.out / "report.md").write_text("\n".join(md) + "\n")
        shutil.rmtree(self.state, ignore_errors=True)
        print(f"gpu-check: {'PASS' if ok else 'FAIL'} in {report['seconds']} s; report {self.out / 'report.md'}")
        return 0 if ok else 1


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
    py = os.environ.get("PY") or (
        str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
    )
    c = Check(py, out, a.dry_run)
    try:
        for name in ("preflight", "engine", "sweep", "store", "vllm"):
            c.step(name, getattr(c, name))
    finally:
        # Nothing may outlive the check: stop an engine a failed step left behind.
        _run([py, "-m", "bsr_cli", "engine", "down"], 60, c.env)
    return c.finish()


if __name__ == "__main__":
    sys.exit(main())
