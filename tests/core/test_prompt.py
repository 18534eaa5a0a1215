"""A prompt as a request names it: its token ids or a synthetic prompt, never both, written as the request body's
prompt part."""

from __future__ import annotations

import json

import pytest

from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.prompt import Prompt


def test_a_prompt_is_written_as_the_part_of_a_request_body_that_names_it() -> None:
    assert json.dumps(Prompt.of_tokens([5, 6, 7]).to_wire()) == '{"tokens": [5, 6, 7]}'
    assert json.dumps(Prompt.synthetic_of(300, 9).to_wire()) == '{"synthetic": {"n": 300, "seed": 9}}'


def test_a_prompt_knows_its_token_ids_as_the_engine_generates_them() -> None:
    assert Prompt.of_tokens([5, 6]).token_ids() == [5, 6]
    assert Prompt.synthetic_of(300, 9).token_ids() == synthetic_tokens(300, 9)


def test_a_prompt_is_exactly_one_of_its_forms() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Prompt()
    with pytest.raises(ValueError, match="exactly one"):
        Prompt(tokens=(1,), synthetic=Prompt.synthetic_of(3, 1).synthetic)
