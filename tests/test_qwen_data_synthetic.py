"""The example's synthetic Alpaca data: shipped file == generator output, both record kinds, correct answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "qwen_finetune"
sys.path.insert(0, str(EXAMPLE))
import make_synthetic_data as synth  # noqa: E402

SHIPPED = EXAMPLE / "data" / "alpaca_synthetic.json"


def test_shipped_file_is_the_generator_output():
    assert SHIPPED.read_text(encoding="utf-8") == synth.render(synth.generate())


def test_script_writes_the_same_file(tmp_path, capsys):
    out = tmp_path / "alpaca.json"
    assert synth.main(["--output", str(out)]) == 0
    assert out.read_bytes() == SHIPPED.read_bytes()
    assert "wrote 400 records" in capsys.readouterr().out


def test_both_record_kinds_and_every_task():
    records = json.loads(SHIPPED.read_text(encoding="utf-8"))
    assert 200 <= len(records) <= 1000
    assert all(set(r) == {"instruction", "input", "output"} for r in records)
    with_input = [r for r in records if r["input"]]
    assert len(with_input) >= 50 and len(records) - len(with_input) >= 50
    instructions = {r["instruction"].split()[0] for r in records}
    assert {"Add", "Subtract", "Reverse", "Sort", "Convert", "How", "Write", "What", "Name"} <= instructions


def test_answers_follow_the_rules():
    """The patterns are learnable only if they are right: check every checkable answer independently."""
    checked = 0
    for r in json.loads(SHIPPED.read_text(encoding="utf-8")):
        instruction, given, output = r["instruction"], r["input"], r["output"]
        if instruction == "Add the two numbers.":
            a, b = given.split(" + ")
            assert int(output) == int(a) + int(b)
        elif instruction.startswith("Subtract"):
            a, b = given.split(" - ")
            assert int(output) == int(a) - int(b) >= 0
        elif instruction.startswith("Reverse"):
            assert output == given[::-1]
        elif instruction.startswith("Sort"):
            numbers = [int(x) for x in given.split(", ")]
            expected = sorted(numbers, reverse="descending" in instruction)
            assert [int(x) for x in output.split(", ")] == expected
        elif instruction.startswith("How many words"):
            assert int(output) == len(given.split())
        elif instruction.startswith("Convert"):
            assert output == given.upper()
        else:
            continue
        checked += 1
    assert checked > 200


def test_capitals_are_consistent():
    """Each made-up country always has the same capital (a fact the model can memorise)."""
    capital_of: dict[str, str] = {}
    for r in json.loads(SHIPPED.read_text(encoding="utf-8")):
        if r["instruction"].startswith("What is the capital of "):
            country = r["instruction"].removeprefix("What is the capital of ").rstrip("?")
            capital = r["output"].removeprefix(f"The capital of {country} is ").rstrip(".")
        elif r["instruction"] == "Name the capital city of the country.":
            country, capital = r["input"], r["output"]
        else:
            continue
        assert capital_of.setdefault(country, capital) == capital
    assert len(capital_of) >= 10


def test_seed_and_size_change_the_output():
    assert synth.generate(50, seed=1) != synth.generate(50, seed=2)
    assert synth.generate(50, seed=1) == synth.generate(50, seed=1)
    assert synth.generate(30) == synth.generate(400)[:30]
    with pytest.raises(ValueError, match="at least 1"):
        synth.generate(0)
