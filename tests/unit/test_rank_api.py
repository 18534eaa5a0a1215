"""The rank-ops contract (bsr_cli.api.ranks): every request and result survives the pipe (pickle) and its JSON form
unchanged; every op has a typed method on RankOps and a dispatcher entry; an op a host does not serve answers the
typed refusal; a malformed job is refused with one clear line before anything is restored."""

from __future__ import annotations

import inspect
import json
import pickle
import subprocess
import sys
from typing import Any, ClassVar

import pytest

from bsr_cli.api import codec
from bsr_cli.api.ranks import (
    REQUESTS,
    RESULTS,
    CanonicalHashRequest,
    CanonicalHashResult,
    InvalidateRequest,
    InvalidateResult,
    ObjectRef,
    OutputHashRequest,
    OutputHashResult,
    PrefillRequest,
    PrefillResult,
    ProbeRequest,
    ProbeResult,
    QuarantinedObject,
    RankOps,
    RemoveAllRequest,
    RemoveAllResult,
    ResetPeakRequest,
    ResetPeakResult,
    RestoreJob,
    RestoreRequest,
    RestoreResult,
    ScrubRequest,
    ScrubResult,
    SetBudgetRequest,
    SetBudgetResult,
    SetFsConcurrencyRequest,
    SetFsConcurrencyResult,
    StatsRequest,
    StatsResult,
    StoreRequest,
    StoreResult,
    TierStatus,
    UnsupportedOp,
    UnsupportedOps,
    WindowJob,
    dispatch,
    request_from_json,
    request_to_json,
    result_from_json,
)
from bsr_cli.core.evidence import ScrubScope, ScrubState
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.scrub import ScrubProgress
from bsr_cli.errors import BadRequest, ExitCode
from unit.fixtures import FakeEngine

TABLES = {"full": [3, 4, 5], "swa": [7, 8]}
JOB = RestoreJob(
    request_id="req-00007",
    w=2,
    windows=[
        WindowJob(0, 0, 2, 0, 32, {"full": (0, 2), "swa": (0, 1)}),
        WindowJob(1, 2, 3, 32, 40, {"full": (2, 3), "swa": (1, 2)}),
    ],
    objects={
        "full": [
            ObjectRef("k/full/0", "mooncake", 128),
            ObjectRef("k/full/1", "mooncake", 128),
            ObjectRef("k/full/2", "fs", 64),
        ],
        "swa": [
            ObjectRef("k/swa/0", "mooncake", 64),
            ObjectRef("k/swa/1", "mooncake", 64),
            ObjectRef("k/swa/2", "fs", 32),
        ],
    },
    block_tables=TABLES,
    faults=[FaultSpec(kind="timeout", rank=1, window=1, group="swa", count=2, id=9, fired=1)],
    fetch_timeout_s=1.5,
    admit_timeout_s=30.0,
    prompt="p",
    chunk_hashes=("a", "b", "c"),
)

REQUEST_EXAMPLES: list[Any] = [
    ProbeRequest(["a", "b"], ["mooncake", "fs"], timeout_s=2.5),
    StoreRequest(["a", "b"], 40, TABLES, {"fs": [0, 2]}),
    RestoreRequest(JOB),
    StatsRequest(health=True),
    ResetPeakRequest(),
    SetBudgetRequest(4096),
    SetFsConcurrencyRequest(4),
    RemoveAllRequest("fs"),
    ScrubRequest("scrub-1", "fs", ScrubScope.PROMPT, 100, 1 << 20, hashes=["a", "b"], prompt="p", shards=2),
    PrefillRequest(["a", "b"], 40, 1, TABLES),
    OutputHashRequest(TABLES, 40),
    CanonicalHashRequest(["a", "b"], 40),
    InvalidateRequest(TABLES),
]
RESULT_EXAMPLES: dict[str, Any] = {
    "probe": ProbeResult({"full": "33", "swa": "31"}, {"mooncake": "TierUnavailable: down"}),
    "store": StoreResult({"fs": 4, "mooncake": 0}, {"mooncake": "full"}),
    "restore": RestoreResult(
        rank=1,
        ok=False,
        valid={"full": True, "swa": False},
        windows_done=1,
        bytes_restored=384,
        seconds=0.25,
        reason="timeout",
        failed_window=1,
        failed_chunks=(2, 3),
        fired_faults=[9],
        kind="tier",
        tier="mooncake",
    ),
    "stats": StatsResult(0, {"live_bytes": 0, "budget_bytes": 4096}, {"fs": TierStatus(True, "ok")}, tp_rank=3),
    "reset_peak": ResetPeakResult(),
    "set_budget": SetBudgetResult({"budget_bytes": 4096}),
    "set_fs_concurrency": SetFsConcurrencyResult(4),
    "remove_all": RemoveAllResult(12),
    "scrub": ScrubResult(
        ScrubProgress("scrub-1", 1, "fs", ScrubScope.PROMPT, ScrubState.CUT, 1.5, "p", "req-1", 4, 3, 96, 1, 1, 1),
        [QuarantinedObject("k/full/2", "/fs/quarantine/x.bsr", "payload checksum mismatch", 2.0, 96)],
    ),
    "prefill": PrefillResult(24),
    "output_hash": OutputHashResult({"full": "ab", "swa": "cd"}),
    "canonical_hash": CanonicalHashResult({"full": "ab", "swa": "cd"}),
    "invalidate": InvalidateResult(),
}


def test_the_examples_cover_every_op() -> None:
    assert [type(r) for r in REQUEST_EXAMPLES] == list(REQUESTS.values())
    assert set(RESULT_EXAMPLES) == set(RESULTS) == set(REQUESTS)
    assert all(isinstance(RESULT_EXAMPLES[op], cls) for op, cls in RESULTS.items())


@pytest.mark.parametrize("req", REQUEST_EXAMPLES, ids=lambda r: r.op)
def test_every_request_survives_the_pipe_and_its_json_form(req: Any) -> None:
    assert pickle.loads(pickle.dumps(req)) == req
    wire = json.loads(json.dumps(request_to_json(req)))
    assert wire["op"] == req.op
    back = request_from_json(wire)
    assert type(back) is type(req)
    assert codec.to_json(back) == codec.to_json(req)


def test_the_restore_job_keeps_its_types_through_json() -> None:
    back = request_from_json(json.loads(json.dumps(request_to_json(RestoreRequest(JOB))))).job  # type: ignore[attr-defined]
    assert isinstance(back.windows[0], WindowJob) and back.windows[0].blocks["full"] == (0, 2)
    assert back.objects["full"][2] == ObjectRef("k/full/2", "fs", 64)
    assert back.faults == [FaultSpec(kind="timeout", rank=1, window=1, group="swa", count=2, id=9, fired=1)]
    assert back.faults[0].exhausted() is False and back.fetch_timeout_s == 1.5


@pytest.mark.parametrize("op", list(RESULT_EXAMPLES))
def test_every_result_survives_the_pipe_and_its_json_form(op: str) -> None:
    res = RESULT_EXAMPLES[op]
    assert pickle.loads(pickle.dumps(res)) == res
    assert result_from_json(op, json.loads(json.dumps(codec.to_json(res)))) == res


def test_rank_ops_names_every_op_and_each_request_reaches_its_own_method() -> None:
    methods = {n for n, _ in inspect.getmembers(RankOps, inspect.isfunction) if not n.startswith("_")}
    assert methods - {"abort"} == set(REQUESTS)

    seen: list[str] = []

    def method(name: str) -> Any:
        def serve(self: Any, req: Any) -> Any:
            seen.append(name)
            return RESULT_EXAMPLES[name]

        return serve

    # A host whose every method records its own name: each request must reach the method of its op.
    host = type("Recorder", (UnsupportedOps,), {name: method(name) for name in REQUESTS})()
    for req in REQUEST_EXAMPLES:
        assert dispatch(host, req) == RESULT_EXAMPLES[req.op]
    assert seen == list(REQUESTS)
    # A host without them refuses each op by name.
    for req in REQUEST_EXAMPLES:
        with pytest.raises(UnsupportedOp, match=f"op '{req.op}' is not supported by this host"):
            dispatch(UnsupportedOps(), req)
    with pytest.raises(BadRequest, match="not a rank request: dict"):
        dispatch(host, {"op": "probe"})  # type: ignore[arg-type]

    # A request is one of the ops the contract names, not anything of a request's shape.
    class LookAlike:
        op: ClassVar[str] = "probe"

        def apply(self, ops: RankOps) -> ProbeResult:
            return ops.probe(ProbeRequest(hashes=[], tiers=[]))

    with pytest.raises(BadRequest, match="not a rank request: LookAlike"):
        dispatch(host, LookAlike())


def test_each_request_stands_alone() -> None:
    # The requests share no base: each is a RankRequest of its result by its shape (op and apply) alone.
    assert all(cls.__bases__ == (object,) for cls in REQUESTS.values())


def test_an_op_the_host_does_not_serve_is_refused_with_its_typed_error(fake_engine: FakeEngine) -> None:
    # The unit fake serves no filesystem-concurrency setting: the coordinator's call answers the host's refusal.
    with pytest.raises(UnsupportedOp) as e:
        fake_engine.coordinator.set_fs_concurrency(4)
    assert e.value.op == "set_fs_concurrency" and e.value.exit_code == ExitCode.BAD_REQUEST
    assert str(e.value) == "op 'set_fs_concurrency' is not supported by the unit-test fake rank"
    assert fake_engine.coordinator.settings.fs_concurrency == 1  # nothing half-applied
    # The refusal crosses a process boundary whole (the embedded engine's pipe pickles it).
    back = pickle.loads(pickle.dumps(UnsupportedOp("store", "not here", hint="go there")))
    assert (type(back), back.op, back.message, back.hint) == (UnsupportedOp, "store", "not here", "go there")
    # A served op still works through the same seam.
    fake_engine.coordinator.set_budget(2 * fake_engine.reg.bytes_per_chunk)
    assert all(r.ops.pool.stats().budget_bytes == 2 * fake_engine.reg.bytes_per_chunk for r in fake_engine.ranks)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"job": {**codec.to_json(JOB), "w": "two"}},
            r"malformed restore request\.job\.w: expected an integer, got 'two'",
        ),
        ({"job": {k: v for k, v in codec.to_json(JOB).items() if k != "windows"}}, "missing field 'windows'"),
        ({"job": {**codec.to_json(JOB), "extra": 1}}, "unknown field.*'extra'"),
        (
            {"job": {**codec.to_json(JOB), "objects": {"full": [["k", "fs"]]}}},
            r"objects\['full'\]\[0\]: expected an object, got \['k', 'fs'\]",
        ),
        (
            {"job": {**codec.to_json(JOB), "block_tables": {"full": [1, True]}}},
            r"block_tables\['full'\]\[1\]: expected an integer",
        ),
    ],
)
def test_a_malformed_job_is_refused_naming_the_field(args: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message) as e:
        request_from_json({"op": "restore", "args": args})
    assert "\n" not in str(e.value)


def test_an_unknown_op_or_shape_is_refused() -> None:
    with pytest.raises(BadRequest, match="unknown rank op 'restor'") as e:
        request_from_json({"op": "restor", "args": {}})
    assert e.value.hint is not None and "restore" in e.value.hint
    with pytest.raises(BadRequest, match="malformed rank request"):
        request_from_json(["probe"])


def test_a_job_that_does_not_cover_its_windows_is_refused_before_anything_moves(fake_engine: FakeEngine) -> None:
    fake_engine.coordinator.submit(synthetic_tokens(5 * 16, seed=4))  # computed and stored: the tier holds it
    rank = fake_engine.ranks[0]
    short = RestoreJob(
        request_id="req-bad",
        w=2,
        windows=[WindowJob(0, 0, 2, 0, 32, {"full": (0, 8), "swa": (0, 4)})],
        objects={"full": [ObjectRef("k", "mooncake", 128)], "swa": [ObjectRef("k", "mooncake", 64)]},
        block_tables={"full": list(range(8)), "swa": list(range(4))},
    )
    reads = fake_engine.tiers["mooncake"].get_calls
    with pytest.raises(
        BadRequest,
        match="malformed restore job for req-bad: window 0 needs chunks up to 2 of group 'full', the job lists 1",
    ):
        rank.submit(RestoreRequest(short)).result(timeout=10)
    assert fake_engine.tiers["mooncake"].get_calls == reads  # nothing fetched
    assert rank.ops.kv.installs == [] and rank.ops.kv.invalidated == []  # nothing installed, nothing to scrub
    assert rank.ops.jobs == []  # never reached the window loop


def test_the_wire_types_do_no_io() -> None:
    """bsr_cli.api is plain data: importing it loads no network, process, UI or tensor library."""
    code = (
        "import sys, json\nbefore = set(sys.modules)\nimport bsr_cli.api\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in set(sys.modules) - before})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    loaded = set(json.loads(out.stdout))
    forbidden = {"socket", "subprocess", "http", "urllib", "ssl", "asyncio", "multiprocessing", "torch", "httpx"}
    forbidden |= {"rich", "typer", "textual", "yaml", "mooncake", "lmcache"}
    assert not (loaded & forbidden), loaded & forbidden
