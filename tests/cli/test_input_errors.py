"""Bad input anywhere in the CLI is one line and exit 2, never "internal error" (exit 1), and never silently
accepted: non-finite timeouts, binary files, malformed store URLs, fractional token ids, registrations of another
schema or with unknown fields, unknown config-file settings, a profile's malformed urls."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bsr_cli.errors import ExitCode

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    p = tmp_path / "blob.json"
    p.write_bytes(b"\xb3\x00\xff\xfe" + os.urandom(256))
    return p


def _one_error(r, needle: str) -> None:
    assert r.code == ExitCode.INVALID_INPUT, (r.code, r.err)
    assert "internal error" not in r.err and "Traceback" not in r.err
    assert r.err.startswith("bsr: error: ") and needle in r.err.splitlines()[0], r.err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_timeout_must_be_finite_and_positive(bsr, value: str) -> None:
    _one_error(bsr("--timeout", value, "config", "show"), "timeout must be a finite, positive number")


def test_timeout_from_the_environment_is_checked_too(bsr, monkeypatch) -> None:
    monkeypatch.setenv("BSR_TIMEOUT", "nan")
    _one_error(bsr("config", "show"), "env BSR_TIMEOUT")


def test_a_binary_config_file(bsr, binary: Path) -> None:
    _one_error(bsr("--config", str(binary), "config", "show"), "not a text file")


def test_unknown_config_settings_are_refused(bsr, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('engine = "http://127.0.0.1:1"\ntimout = 5\n')
    _one_error(bsr("--config", str(cfg), "config", "show"), "unknown setting(s) timout")
    cfg.write_text('[profiles.prod]\nurl = "http://127.0.0.1:1"\ntoken = "t"\nverify = false\n')
    _one_error(bsr("--config", str(cfg), "config", "show"), "profile 'prod' has unknown setting(s) verify")
    cfg.write_text('engine = "prod"\ntimeout = 5\n[profiles.prod]\nurl = "http://127.0.0.1:1"\ntoken = "t"\n')
    assert bsr("--config", str(cfg), "config", "show").code == 0


@pytest.mark.parametrize("urls", ['"http://127.0.0.1:1"', '["http://127.0.0.1:1", 2]'])
def test_a_profile_whose_urls_are_not_a_list_of_strings_is_refused_when_the_config_is_read(
    bsr, tmp_path: Path, urls: str
) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(f"[profiles.fleet]\nurls = {urls}\n")
    for command in (("config", "show"), ("status", "--engine", "fleet")):
        _one_error(bsr("--config", str(cfg), *command), "profile 'fleet': urls must be a list of URLs or profile names")


def test_bench_validate_of_a_binary_file(bsr, binary: Path) -> None:
    _one_error(bsr("bench", "validate", str(binary)), "not a text file")


@pytest.mark.parametrize("url", ["mooncake://host:notaport", "mooncake://host:99999", "mooncake://host"])
def test_a_malformed_store_url(bsr, url: str) -> None:
    _one_error(bsr("probe", "--store", url, "--model", "m", "--synthetic", "10"), "--store must look like")


@pytest.mark.parametrize("content", ["[1.5, 2]", "[true, 2]", '["1", 2]', "[null]", "1 2.5 3", "1 x"])
def test_fractional_or_non_integer_token_ids_are_refused(bsr, tmp_path: Path, content: str) -> None:
    f = tmp_path / "tokens.json"
    f.write_text(content)
    # --store reads the prompt before touching the network: the error comes first.
    r = bsr("probe", "--store", "mooncake://127.0.0.1:1", "--model", "m", "--tokens-file", str(f))
    _one_error(r, "token ids must be integers")


def test_integer_token_files_still_load(tmp_path: Path) -> None:
    from bsr_cli.loaders import read_tokens_file

    for content, want in (("[1, 2, 3]", [1, 2, 3]), ('{"tokens": [7]}', [7]), ("4, 5\n6", [4, 5, 6])):
        f = tmp_path / "t.txt"
        f.write_text(content)
        assert read_tokens_file(f) == want


def _demo(tmp_path: Path, **changes) -> Path:
    from bsr_cli.loaders import builtin_registration

    data = builtin_registration("demo").to_dict() | changes
    p = tmp_path / "reg.json"
    p.write_text(json.dumps(data))
    return p


def test_a_registration_of_another_schema_is_refused(bsr, tmp_path: Path) -> None:
    _one_error(bsr("registration", "show", str(_demo(tmp_path, schema=99))), "schema 99 is not supported")


def test_a_registration_with_unknown_fields_is_refused(bsr, tmp_path: Path) -> None:
    _one_error(bsr("registration", "show", str(_demo(tmp_path, chunk_sise=128))), "unknown registration field(s)")
    reg = json.loads(_demo(tmp_path).read_text())
    reg["tensors"][0]["shpae"] = [1]
    p = tmp_path / "t.json"
    p.write_text(json.dumps(reg))
    _one_error(bsr("registration", "show", str(p)), "unknown field(s) shpae")
    reg = json.loads(_demo(tmp_path).read_text())
    reg["groups"][0]["blocksize"] = 16
    p.write_text(json.dumps(reg))
    _one_error(bsr("registration", "show", str(p)), "unknown field(s) blocksize")
    # What `bsr registration show --json` writes still loads.
    shown = bsr("registration", "show", "demo", "--json")
    p.write_text(shown.out)
    assert bsr("registration", "show", str(p)).code == 0
