"""docs/runbook-vllm.md, run as written: `vllm serve` (vLLM's CPU build) + LMCache + a real Mooncake master.

The page's blocks are read from the markdown and run literally in one shell, in page order, with only the
placeholders its table documents substituted (the test checks that it substitutes exactly those): LMCache's config
is written from the page's YAML block, the page's ``vllm serve`` block starts the OpenAI-compatible server as an
operator does (the block must stay exports and one ``vllm serve``: its shape is checked), the page's ``/tokenize``
line makes ``prompt.json`` from the prompt's text, and every request goes over HTTP to the completions API (the
page's ``curl`` lines). The rehearsal arms a fault through rank 0's admin API and the prompt's next load fails
closed at window G2; the page's four commands and its "more" block show the marker and the failed load; the
recovery block sends the prompt twice more (forced local, then loaded); then one stored chunk is corrupted in
Mooncake (its bytes flipped through a Mooncake client: the one step an operator does not do) and the page's
corrupted-chunk block shows the verify failure, the chunk stored again and the prefix loaded whole.

Every output the page quotes is compared with what the command printed at TP 1 (request ids, prompt hashes and
times masked; ``...`` in a quote stands for any text). Once at TP 1 and once at TP 2 (vLLM's CPU build binds each
rank's threads to its own cores: the page's ``VLLM_CPU_OMP_THREADS_BIND`` line), one server start each, shared by
the tests of that size. A wrong command or a stale quote on the page fails this test (``BSR_RUNBOOK_OUTPUTS=PATH``
writes every command's output to ``PATH.tp1.json`` / ``PATH.tp2.json``, to update the quotes from).

The `bsr` on PATH is a two-line script running ``python -m bsr_cli`` in the stage's venv: it stands in for the
console script `pip install` makes (bsr is not installed in that venv; the stage puts the checkout on PYTHONPATH).
The `vllm` on PATH is the venv's own console script, which needs the ``vllm`` metadata scripts/setup-vllm writes
(the page's vllm-cpu line).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from driver import prompt
from vllmstage import CHUNK, ROOT, _remove_unmapped, chunk_prefix, vllm_ports, vllm_segments

from bsr_cli.core.keys import prompt_hash
from bsr_cli.core.lmcache_keys import lmcache_chunk_hashes, lmcache_dtype, lmcache_key, vllm_seeded_start
from bsr_cli.mooncake import services

RUNBOOK = ROOT / "docs" / "runbook-vllm.md"
SETUP_VLLM = ROOT / "scripts" / "setup-vllm"
N = 5 * CHUNK + 60  # 5 full chunks + a tail LMCache never stores
SEED = 5
PREFIX = chunk_prefix(N)
TOKEN = "runbook-token"
MAX_COMMANDS_TO_EXPLAIN = 5
SERVE_START_S = float(os.environ.get("BSR_RUNBOOK_SERVE_START_S", "540"))  # vLLM's start-up under load
UNTIL_RESTORABLE = "# until it says restorable"
CORRUPT_CHUNK = 1  # in window G1 (W = 2)
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # Mooncake's transfer endpoint on loopback


# -- the page ----------------------------------------------------------------------------------------------------
def blocks(page: str, mark: str) -> list[str]:
    """The fenced code blocks right after each ``<!-- runbook: MARK -->`` line, in page order."""
    out = []
    for part in page.split(f"<!-- runbook: {mark} -->\n")[1:]:
        body = part.split("```", 2)
        assert len(body) == 3 and not body[0].strip(), f"no code block right after the runbook mark {mark!r}"
        out.append(body[1].split("\n", 1)[1])  # drop the fence's language line
    return out


def commands(block: str) -> list[str]:
    """A block's commands: one per line (a trailing backslash continues it), blank lines and comments left out."""
    cmds: list[str] = []
    pending = ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        cmds.append(pending.strip())
        pending = ""
    assert not pending, f"a command ends in a backslash: {pending!r}"
    return cmds


def placeholders(page: str) -> list[str]:
    """The first column (in backticks, ``\\|`` for a literal bar) of the table after the placeholders mark."""
    table = page.split("<!-- runbook: placeholders -->", 1)[1].strip().split("\n\n", 1)[0]
    cells = [re.split(r"(?<!\\)\|", row)[1].strip() for row in table.splitlines()[2:]]
    return [c.strip("`").replace("\\|", "|") for c in cells]


def substitute(text: str, values: dict[str, str]) -> str:
    """Every placeholder replaced in one pass (a value that holds another placeholder is left as it is)."""
    pattern = re.compile("|".join(re.escape(k) for k in sorted(values, key=len, reverse=True)))
    return pattern.sub(lambda m: values[m.group(0)], text)


def quoted_outputs(page: str) -> dict[str, str]:
    """``PHASE: COMMAND`` -> the output the page quotes after ``<!-- runbook: output PHASE: COMMAND -->``."""
    names = re.findall(r"<!-- runbook: output (.+?) -->", page)
    return {name: blocks(page, f"output {name}")[0] for name in names}


MASKS = (
    (re.compile(r"cmpl-[0-9a-f]+(-\d+-[0-9a-f]+)?"), "REQ"),
    (re.compile(r"\b[0-9a-f]{16}\b"), "HASH"),
    (re.compile(r"\b\d\d:\d\d:\d\d\b"), "TIME"),
)


def masked(line: str) -> str:
    for rx, to in MASKS:
        line = rx.sub(to, line)
    return line.rstrip()


def quote_matches(quote: str, output: str) -> list[str]:
    """The quoted lines not found in the output, in order (masked; ``...`` in a quote matches any text)."""
    lines = [masked(x) for x in output.splitlines()]
    missing, at = [], 0
    for q in (masked(x) for x in quote.splitlines() if x.strip()):
        rx = re.compile(".*".join(re.escape(p) for p in q.split("...")) + "$")
        hit = next((i for i in range(at, len(lines)) if rx.match(lines[i])), None)
        if hit is None:
            missing.append(q)
        else:
            at = hit + 1
    return missing


# -- one shell, as the operator's terminal -------------------------------------------------------------------------
@dataclass
class Step:
    phase: str
    cmd: str
    rc: int | None
    output: str


@dataclass
class Shell:
    """Runs the page's commands one at a time; an ``export`` carries on to the commands after it."""

    cwd: Path
    env: dict[str, str]
    steps: list[Step] = field(default_factory=list)
    exports: list[str] = field(default_factory=list)

    def run(self, phase: str, cmd: str, timeout: float = 120) -> Step:
        script = "\n".join(["exec 2>&1", *self.exports, cmd])
        try:
            p = subprocess.run(
                ["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout
            )
            step = Step(phase, cmd, p.returncode, p.stdout.strip())
        except subprocess.TimeoutExpired as e:
            step = Step(phase, cmd, None, f"timed out after {timeout:.0f} s: {e.stdout!r}")
        if cmd.startswith("export ") and step.rc == 0:
            self.exports.append(cmd)
        self.steps.append(step)
        return step

    def run_until(self, phase: str, cmd: str, want: str, deadline_s: float = 90) -> Step:
        """A command the page says to repeat until its output says ``want`` (LMCache stores asynchronously)."""
        end = time.monotonic() + deadline_s
        while True:
            step = self.run(phase, cmd)
            if step.rc != 0 or want in step.output or time.monotonic() > end:
                return step
            self.steps.pop()  # only the last try is the page's step
            time.sleep(0.5)

    def block(self, phase: str, cmds: list[str]) -> None:
        for cmd in cmds:
            if cmd.endswith(UNTIL_RESTORABLE):
                self.run_until(phase, cmd, ": restorable")
            else:
                self.run(phase, cmd)

    def output(self, phase: str, starts: str) -> str:
        return next(s.output for s in self.steps if s.phase == phase and s.cmd.startswith(starts))


def completion(step: Step) -> dict[str, Any]:
    assert step.rc == 0, step
    try:
        got: dict[str, Any] = json.loads(step.output)
    except json.JSONDecodeError:
        raise AssertionError(f"not a completion: {step}") from None
    assert "choices" in got, step
    return got


# -- the server ----------------------------------------------------------------------------------------------------
@dataclass
class Served:
    tp: int
    http: str
    rank_urls: list[str]
    ktc: dict[str, Any]
    values: dict[str, str]
    shell: Shell
    events: list[dict[str, Any]]
    log: str
    doc_probe_line: str
    n_steps: int
    corrupted: dict[str, Any]

    def loads(self, request_id: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "bsr_load" and str(e["req"]).startswith(request_id)]

    def lookups(self, request_id: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "bsr_lookup" and str(e["req"]).startswith(request_id)]

    def completions(self, phase: str) -> list[dict[str, Any]]:
        return [completion(s) for s in self.shell.steps if s.phase == phase and s.cmd.startswith("curl ")]


def serve_shape(block: str) -> tuple[list[str], str]:
    """The serve block is exports then one `vllm serve` command: anything else changes what operators run."""
    cmds = commands(block)
    exports, serve = cmds[:-1], cmds[-1] if cmds else ""
    assert serve.startswith("vllm serve ") and all(c.startswith("export ") for c in exports), (
        f"the runbook's serve block is no longer exports + one `vllm serve` command: {cmds}"
    )
    return exports, serve


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    end = time.monotonic() + SERVE_START_S
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"`vllm serve` exited ({proc.returncode}) before it served:\n{tail(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                return
        time.sleep(1.0)
    raise AssertionError(f"`vllm serve` not healthy within {SERVE_START_S:.0f} s:\n{tail(log)}")


def tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def stop(proc: subprocess.Popen[bytes], shm_before: set[Path]) -> None:
    """SIGINT first (vLLM shuts its workers down and frees their shared memory), the whole group killed after."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    _remove_unmapped(vllm_segments() - shm_before)


def server_env(root: Path, events: Path) -> dict[str, str]:
    """The stage's environment, without what the page's block must set itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_CPU_", "LMCACHE_", "PYTHONHASHSEED"))}
    for d in ("rpc", "tmp"):
        (root / d).mkdir(exist_ok=True)
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",  # the venv's `vllm`
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")]),
            "VLLM_RPC_BASE_PATH": str(root / "rpc"),
            "TMPDIR": str(root / "tmp"),
            "BSR_VLLM_EVENTS": str(events),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


def bsr_on_path(bin_dir: Path) -> Path:
    """A `bsr` command for the shell (see the module docstring)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "bsr"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m bsr_cli "$@"\n')
    exe.chmod(0o755)
    return bin_dir


FLIP_BYTES = """
import json, sys
from driver import _mooncake_client
metadata, master, key = sys.argv[1:4]
store = _mooncake_client(metadata, master)
data = bytearray(store.get(key))
before = bytes(data)
for i in range(64, len(data), 97):
    data[i] ^= 0x5A
rc = store.upsert(key, bytes(data))
print(json.dumps({"key": key, "bytes": len(data), "rc": rc, "changed": store.get(key) != before}))
"""


def corrupt_chunk(master: services.ServiceHandle, model: Path, tp: int) -> dict[str, Any]:
    """Flip bytes of rank 0's object of the prompt's chunk CORRUPT_CHUNK in Mooncake, through a client of the real
    master (the key as LMCache wrote it: bf16 KV, PYTHONHASHSEED=0)."""
    hashes = lmcache_chunk_hashes(prompt(N, SEED), CHUNK, vllm_seeded_start("0"))
    key = lmcache_key(str(model), tp, 0, hashes[CORRUPT_CHUNK], lmcache_dtype("bf16"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(ROOT)])}
    cmd = [sys.executable, "-c", FLIP_BYTES, master.metadata_url, master.rpc_address, key]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0 and out["changed"], out
    return out


# -- fixtures ------------------------------------------------------------------------------------------------------
WORDS = 1024  # the tiny model's vocabulary: token t is the word f"w{t}"


@pytest.fixture(scope="module")
def served_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """The stage's tiny Llama with a tokenizer (a served model has one: the completions API and /tokenize use it):
    a word-level vocabulary where token t is ``w{t}``, written as the `tokenizers` library's JSON."""
    path = tmp_path_factory.mktemp("served") / "my-model"
    shutil.copytree(model_dir, path)
    special = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(special)} | {f"w{t}": t for t in range(len(special), WORDS)}
    added = [
        {"id": i, "content": w, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
        | {"special": True}
        for i, w in enumerate(special)
    ]
    tokenizer = {
        "version": "1.0",
        **dict.fromkeys(["truncation", "padding", "normalizer", "post_processor", "decoder"]),
        "added_tokens": added,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "</s>"}))
    return path


def page_values(
    tp: int, port: int, http: int, model: Path, lmcache_yaml: Path, master: services.ServiceHandle
) -> dict[str, str]:
    """The test's value of every placeholder the page documents."""
    return {
        "8470": str(port),
        "change-me": TOKEN,
        "/models/my-model": str(model),
        "8000": str(http),
        "--tensor-parallel-size 1": f"--tensor-parallel-size {tp}",
        "/etc/lmcache.yaml": str(lmcache_yaml),
        "10.0.0.5:50051": master.rpc_address,
        "http://10.0.0.5:8080/metadata": master.metadata_url,
        "http://10.0.0.5:9003": master.admin_url,
        "10.0.0.7": "127.0.0.1",
        "--kv-cache-memory-bytes 40G": "--kv-cache-memory-bytes 256M",  # a tiny model; a host shared with others
        "0-31|32-63": "0|1" if tp == 2 else "0-1",
        "prompt.txt": "prompt.txt",  # the files the shell's working directory holds
        "prompt.json": "prompt.json",
    }


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def run(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    served_model: Path,
) -> Served:
    tp = int(request.param)
    root = tmp_path_factory.mktemp(f"runbook-tp{tp}")
    # Each walk is a deployment of its own, with its own master: a master that served the TP 1 walk still lists
    # that instance's segments until its client TTL drops them (120 s), and places some of TP 2's puts there,
    # where they are lost (the runbook's "evicted chunk" while a holder is gone; see docs/runbook-vllm.md).
    (root / "mooncake").mkdir()
    master = services.start_master(root / "mooncake")
    try:
        return walk(root, tp, served_model, master)
    finally:
        services.stop(master, timeout=5)


def walk(root: Path, tp: int, served_model: Path, master: services.ServiceHandle) -> Served:
    """One server start at TP ``tp``, the page followed against it, and what the walk left to check."""
    raw = RUNBOOK.read_text()
    port = vllm_ports(tp)  # rank r serves on bsr_admin_port + r
    http = vllm_ports()  # `vllm serve` binds it once the model is loaded
    lmcache_yaml = root / "lmcache.yaml"
    values = page_values(tp, port, http, served_model, lmcache_yaml, master)
    assert sorted(placeholders(raw)) == sorted(values), "substitute exactly the placeholders the page documents"
    page = substitute(raw, values)
    (yaml_block,) = blocks(raw, "file /etc/lmcache.yaml")
    lmcache_yaml.write_text(substitute(yaml_block, values))
    (serve,) = blocks(page, "serve")
    serve_shape(serve)
    m = re.search(r"--kv-transfer-config '(\{.*?\})'", serve, re.S)
    assert m, serve

    work = root / "shell"
    work.mkdir()
    (work / "prompt.txt").write_text(" ".join(f"w{t}" for t in prompt(N, SEED)))  # the failed prompt, as sent
    shell_env = {k: v for k, v in os.environ.items() if not k.startswith("BSR_")}
    shell_env["PATH"] = f"{bsr_on_path(root / 'bin')}{os.pathsep}{os.environ['PATH']}"
    shell = Shell(work, shell_env)
    events = root / "events.jsonl"
    log = root / "serve.log"
    shm_before = vllm_segments()
    with log.open("wb") as logf:
        proc = subprocess.Popen(
            ["bash", "-c", serve], cwd=work, env=server_env(root, events), stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    t0, took = time.monotonic(), {}
    try:
        wait_healthy(proc, f"http://127.0.0.1:{http}", log)
        took["start_s"] = round(time.monotonic() - t0, 1)
        corrupted = follow_the_page(shell, page, tp, master, served_model)
    finally:
        stop(proc, shm_before)
        took["served_s"] = round(time.monotonic() - t0, 1)
        if dump := os.environ.get("BSR_RUNBOOK_OUTPUTS"):  # every command's output, to update the page's quotes
            Path(f"{dump}.tp{tp}.json").write_text(json.dumps([took, *(s.__dict__ for s in shell.steps)], indent=1))
    more = [c for b in blocks(page, "more") for c in commands(b)]
    return Served(
        tp=tp,
        http=f"http://127.0.0.1:{http}",
        rank_urls=[f"http://127.0.0.1:{port + r}" for r in range(tp)],
        ktc=json.loads(m.group(1)),
        values=values,
        shell=shell,
        events=[json.loads(x) for x in events.read_text().splitlines()] if events.exists() else [],
        log=log.read_text(errors="replace"),
        doc_probe_line=next(c for c in more if c.startswith("bsr probe --store")),
        n_steps=len([c for b in blocks(page, "step") for c in commands(b)]),
        corrupted=corrupted,
    )


def follow_the_page(shell: Shell, page: str, tp: int, master: services.ServiceHandle, model: Path) -> dict[str, Any]:
    """The page's blocks in page order; at TP > 1 the printed probe line replaces the page's TP 1 one."""
    (make_prompt,) = (c for b in blocks(page, "prompt") for c in commands(b))
    shell.run("prompt", make_prompt)
    shell.block("rehearse", [c for b in blocks(page, "rehearse") for c in commands(b)])
    shell.block("step", [c for b in blocks(page, "step") for c in commands(b)])
    more = [c for b in blocks(page, "more") for c in commands(b)]
    if tp > 1:
        printed = shell.output("step", "bsr engine endpoints")
        more = [c for c in more if not c.startswith("bsr probe --store")]
        more += [ln.split(": ", 1)[1] for ln in printed.splitlines() if ln.startswith("probe the store: ")]
    shell.block("more", more)
    printed = shell.output("step", "bsr engine endpoints")
    every_rank = [ln.split(": ", 1)[1] for ln in printed.splitlines() if ln.startswith("every rank at once: ")]
    shell.block("every rank", every_rank)
    shell.block("recover", [c for b in blocks(page, "recover") for c in commands(b)])
    corrupted = corrupt_chunk(master, model, tp)
    shell.block("corrupted", [c for b in blocks(page, "corrupted") for c in commands(b)])
    return corrupted


# -- the tests -----------------------------------------------------------------------------------------------------
def _fault_request(run: Served) -> str:
    return str(run.completions("rehearse")[1]["id"])


@pytest.mark.timeout(900)
def test_every_command_on_the_page_runs_as_written(run: Served) -> None:
    ktc = run.ktc
    assert ktc["kv_connector"] == "BSRConnector" and ktc["kv_connector_module_path"] == "vllm_bsr.connector"
    assert ktc["kv_role"] == "kv_both" and ktc["kv_load_failure_policy"] == "recompute"
    # vLLM ran what the block says: its TP size and prefix caching off.
    assert f"world_size={run.tp}, local_world_size={run.tp}" in run.log and "'enable_prefix_caching': False" in run.log
    for s in run.shell.steps:
        assert s.rc == 0 and "Traceback" not in s.output, s
    # The page's /tokenize line made the token ids vLLM computed with.
    assert json.loads((run.shell.cwd / "prompt.json").read_text()) == prompt(N, SEED)
    # Every request generated the same tokens: loaded, failed and recomputed, forced local, corrupted or not.
    texts = {c["choices"][0]["text"] for s in ("rehearse", "recover", "corrupted") for c in run.completions(s)}
    assert len(texts) == 1, texts


def test_the_vllm_cpu_line_is_the_one_the_setup_runs() -> None:
    """The stage's `vllm serve` works because the setup ran this line: the page (and deployment.md's recipe) give
    operators the same one."""
    (block,) = blocks(RUNBOOK.read_text(), "vllm-cpu")
    (line,) = commands(block)
    assert line.startswith("python -c ") and line in SETUP_VLLM.read_text(), line
    assert line in (ROOT / "docs" / "deployment.md").read_text(), line


@pytest.mark.timeout(900)
def test_explain_of_the_failed_prompt_within_five_commands(run: Served) -> None:
    # The rehearsal's fault, armed through rank 0 (what BSR_ENGINE names), failed rank 0's load at G2 only.
    failed = [(e["rank"], e["failed_window"]) for e in run.loads(_fault_request(run)) if not e["ok"]]
    assert failed == [(0, 1)], run.loads(_fault_request(run))
    assert "on tp-rank 0 (this worker only), window G2" in run.shell.output("rehearse", "bsr inject-fault")
    cmds = [s.cmd for s in run.shell.steps if s.phase in ("prompt", "step")]
    assert cmds[-1].startswith("bsr explain --tokens-file"), cmds
    assert len(cmds) <= MAX_COMMANDS_TO_EXPLAIN, cmds
    marker = prompt_hash(prompt(N, SEED)[:PREFIX])
    markers = run.shell.output("step", "bsr markers list")
    assert marker in markers and "window G2" in markers, markers
    explained = run.shell.output("step", "bsr explain")
    assert "force-local-marker" in explained and f"marker: prompt {marker}" in explained, explained
    assert "failed rank 0 window G2" in explained, explained
    status = run.shell.output("more", "bsr status")
    assert f"advertised {PREFIX} tokens, loaded 0, recomputed {PREFIX}" in status, status
    assert f"force-local marker prompt {marker}" in status, status


@pytest.mark.timeout(900)
def test_one_command_prints_every_endpoint_and_the_probe_store_line(run: Served) -> None:
    shown = run.shell.output("step", "bsr engine endpoints")
    for r, url in enumerate(run.rank_urls):  # rank 0 is the page's port; rank r serves on port + r
        assert f"rank {r}  {url}" in shown, shown
    assert f"rank {run.tp}  " not in shown, shown
    assert "token: accepted (from env BSR_TOKEN)" in shown, shown
    # The line it prints for every rank at once works: one row per rank, each answering.
    assert f"every rank at once: bsr status --engine {','.join(run.rank_urls)}" in shown, shown
    fleet = run.shell.output("every rank", "bsr status --engine")
    assert all(u.split("//")[1] in fleet for u in run.rank_urls), fleet
    assert f"--world-size {run.tp} " in shown, shown  # the printed probe line carries the instance's TP
    probed = run.shell.output("more", "bsr probe --store")
    # (The bitmap also counts the prompt's partial tail as a chunk LMCache never stores: "held 5/6".)
    assert f"committable prefix: {PREFIX} tokens ({PREFIX // CHUNK} chunks)" in probed, probed
    if run.tp == 1:  # the probe line it prints is the page's (placeholders substituted)
        assert f"probe the store: {run.doc_probe_line}" in shown, shown


@pytest.mark.timeout(900)
def test_the_next_request_is_forced_local_and_the_one_after_loads(run: Served) -> None:
    forced, loaded = (str(c["id"]) for c in run.completions("recover"))
    assert [e["force_local"] for e in run.lookups(forced)] == [True], run.lookups(forced)
    assert run.loads(forced) == [], run.loads(forced)  # computed locally: no load at all
    assert [(e["ok"], e["loaded"]) for e in run.loads(loaded)] == [(True, PREFIX)] * run.tp, run.loads(loaded)
    assert "no force-local markers" in run.shell.output("recover", "bsr markers list")


@pytest.mark.timeout(900)
def test_a_corrupted_chunk_is_named_removed_and_stored_again(run: Served) -> None:
    failed, forced, loaded = (str(c["id"]) for c in run.completions("corrupted"))
    bad = [e for e in run.loads(failed) if not e["ok"]]
    assert [(e["rank"], e["failed_window"]) for e in bad] == [(0, CORRUPT_CHUNK // 2)], run.loads(failed)
    explained = run.shell.output("corrupted", "bsr explain")
    key = run.corrupted["key"]
    assert f"checksum mismatch in chunk {CORRUPT_CHUNK} (tier mooncake, key {key})" in explained, explained
    assert "removed from the store" in explained, explained
    assert [e["force_local"] for e in run.lookups(forced)] == [True], run.lookups(forced)
    # The forced request stored the chunk again; the next loaded the whole prefix, verified.
    assert [(e["ok"], e["loaded"]) for e in run.loads(loaded)] == [(True, PREFIX)] * run.tp, run.loads(loaded)


@pytest.mark.timeout(900)
def test_the_outputs_the_page_quotes_are_what_the_commands_print(run: Served) -> None:
    if run.tp != 1:
        pytest.skip("the page quotes TP 1's outputs (TP 2's differences are checked above)")
    quotes = quoted_outputs(substitute(RUNBOOK.read_text(), run.values))
    assert quotes, "the page quotes no output"
    stale = {}
    for name, quote in quotes.items():
        phase, cmd = name.split(": ", 1)
        out = run.shell.output(phase, cmd)
        if missing := quote_matches(quote, out):
            stale[name] = {"missing": missing, "printed": out}
    assert not stale, json.dumps(stale, indent=1)
