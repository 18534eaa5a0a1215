"""Reading user files into core objects: registrations, HF configs, probe results, token lists, request traces.

The core parses dicts; this module does the file I/O and format sniffing so the core stays pure.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.hf_config import registration_from_hf_config
from bsr_cli.core.host_model import HostCalibration
from bsr_cli.core.registration import Registration
from bsr_cli.core.trace import Trace, TraceRequest, build_trace, parse_request
from bsr_cli.errors import InvalidInput

# Registrations shipped with bsr, usable by name (`--registration demo`).
BUILTIN_REGISTRATIONS = {
    "paper-mtp-off": "the paper's MTP-off registration: 167 tensors, 16,408,576 bytes per chunk",
    "paper-mtp-on": "the paper's MTP-on registration: 170 tensors",
    "demo": "the embedded engine's default: 4 tensors in 2 KV groups, 4 KiB per token per rank",
}


_RELATIVE = "paths are relative to the current directory; the examples ship in examples/ (run from the repository root)"
_TOKENS_HINT = "a tokens file is a JSON list of token ids ([1, 2, 3]) or integers separated by spaces or commas"
_TRACE_HINT = "a trace is JSON Lines in the Mooncake format (examples/trace.jsonl); `bsr events --trace` writes one"


def _why(e: OSError | UnicodeDecodeError) -> str:
    """An OS error's reason without the path the message already names (``[Errno 2] ...: 'x'`` says it twice)."""
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).rstrip(".")


def read_structured(path: Path) -> Any:
    """Parse a JSON or YAML file (by extension; JSON first when unknown)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InvalidInput(f"file not found: {path}", hint=_RELATIVE) from None
    except IsADirectoryError:
        raise InvalidInput(f"{path} is a directory, not a file", hint="name the file inside it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read {path}: {_why(e)}", hint="check its permissions and encoding") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        return _yaml(text, path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        if path.suffix.lower() == ".json":
            raise InvalidInput(
                f"{path}: invalid JSON at line {e.lineno}: {e.msg}", hint=f"`python -m json.tool {path}` shows where"
            ) from None
        return _yaml(text, path)
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits, absurd nesting
        raise InvalidInput(
            f"{path}: unacceptable JSON ({type(e).__name__})", hint="bsr refuses absurdly long numbers or nesting"
        ) from None


def _yaml(text: str, path: Path) -> Any:
    import yaml  # only when a YAML file is actually given

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidInput(
            f"{path}: invalid YAML ({str(e).splitlines()[0]})", hint="check the indentation at the line it names"
        ) from None


def builtin_registration(name: str) -> Registration:
    data = json.loads(resources.files("bsr_cli.data").joinpath(f"{name}.json").read_text())
    return Registration.from_dict(data, source=name)


def load_registration(spec: str | Path) -> Registration:
    """A registration from a file (JSON/YAML) or a built-in name."""
    text = str(spec)
    if text in BUILTIN_REGISTRATIONS and not Path(text).exists():
        return builtin_registration(text)
    path = Path(text)
    if not path.exists():
        names = ", ".join(BUILTIN_REGISTRATIONS)
        raise InvalidInput(f"registration not found: {text}", hint=f"give a file or one of: {names}")
    data = read_structured(path)
    if isinstance(data, dict) and "registration" in data and "tensors" not in data:
        data = data["registration"]  # accept `bsr registration show --json` output and engine info dumps
    return Registration.from_dict(data, source=str(path))


def load_hf_registration(path: Path, **kwargs: Any) -> Registration:
    data = read_structured(Path(path))
    return registration_from_hf_config(data, source=str(path), **kwargs)


# What to do about a calibration file that cannot be used.
_CALIBRATION_HINT = "calibrate again (`bsr bench trace` writes calibration.json), or give --cores and --cpu-per-gb"


def load_calibration(path: Path) -> HostCalibration:
    """A calibration saved by `bsr bench trace` (``kind: bsr.calibration``), its host model checked."""
    p = Path(path)
    data = read_structured(p)
    if not isinstance(data, dict) or data.get("kind") != HostCalibration.kind:
        raise InvalidInput(
            f"{p}: not a calibration (kind {HostCalibration.kind!r})",
            hint="give the calibration.json `bsr bench trace` wrote, or --cores and --cpu-per-gb",
        )
    try:
        calibration = HostCalibration.from_wire(data)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"{p}: unreadable calibration ({e})", hint=_CALIBRATION_HINT) from None
    try:
        calibration.host.check()
    except InvalidInput as e:
        raise InvalidInput(f"{p}: {e.message}", hint=_CALIBRATION_HINT) from None
    if not calibration.bandwidth > 0:
        raise InvalidInput(
            f"{p}: the calibration's bandwidth must be positive, got {calibration.bandwidth!r}", hint=_CALIBRATION_HINT
        )
    return calibration


def load_probe(path: Path) -> HitBitmap:
    return HitBitmap.from_dict(read_structured(Path(path)), source=str(path))


def read_tokens_file(path: Path) -> list[int]:
    """Token ids from a JSON list (or {"tokens": [...]}) or whitespace/comma separated integers."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidInput(f"cannot read tokens file {p}: {_why(e)}", hint=_TOKENS_HINT) from None
    data: Any
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    except (ValueError, RecursionError):
        raise InvalidInput(f"{p}: unacceptable JSON", hint=_TOKENS_HINT) from None
    if data is None:
        # Plain text: whitespace- or comma-separated decimal integers.
        words = text.replace(",", " ").split()
        bad = next((w for w in words if not (w.isascii() and w.isdigit())), None)
        if bad is not None:
            raise InvalidInput(f"{p}: token ids must be integers, got {bad[:40]!r}", hint=_TOKENS_HINT)
        data = [int(w) for w in words]
    if isinstance(data, dict):
        data = data.get("tokens")
    if not isinstance(data, list):
        raise InvalidInput(f"{p}: expected a list of token ids", hint=_TOKENS_HINT)
    # Exactly integers: 1.5 would otherwise be truncated to 1 and restore a different prompt. (The checks run at C
    # speed first, `type` excluding bool: a million-token prompt is read in a fraction of a second.)
    if data and set(map(type, data)) != {int}:
        bad_t = next(t for t in data if type(t) is not int)
        raise InvalidInput(f"{p}: token ids must be integers, got {bad_t!r}", hint=_TOKENS_HINT)
    tokens: list[int] = data
    if tokens and (min(tokens) < 0 or max(tokens) >= 1 << 32):
        raise InvalidInput(f"{p}: token ids must be in [0, 2^32)", hint=_TOKENS_HINT)
    return tokens


def load_trace(path: Path) -> Trace:
    """A request trace in the Mooncake format (JSON Lines, one request per line; blank lines are skipped)."""
    p = Path(path)
    try:
        f = p.open("rb")
    except FileNotFoundError:
        raise InvalidInput(f"trace not found: {p}", hint=_TRACE_HINT) from None
    except IsADirectoryError:
        raise InvalidInput(f"{p} is a directory, not a trace file", hint=_TRACE_HINT) from None
    except OSError as e:
        raise InvalidInput(f"cannot read {p}: {_why(e)}", hint="check its permissions") from None

    def records() -> Iterator[tuple[str, TraceRequest]]:
        with f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{p}:{n}"
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise InvalidInput(
                        f"{where}: not a JSON object ({getattr(e, 'msg', None) or e})", hint=_TRACE_HINT
                    ) from None
                except (ValueError, RecursionError) as e:
                    raise InvalidInput(f"{where}: unacceptable JSON ({type(e).__name__})", hint=_TRACE_HINT) from None
                yield where, parse_request(record, where)

    try:
        return build_trace(records(), source=str(p))
    except OSError as e:
        raise InvalidInput(f"cannot read {p}: {_why(e)}", hint="check the file and its disk") from None
