"""Every TrainingArguments field has a row in xshard/trainer/argument_rows.py, and each row is kept.

- A field of the installed transformers' ``TrainingArguments`` / ``Seq2SeqTrainingArguments`` without a row
  fails here (a new transformers release shows its new arguments as failures, never as silence), as does a row
  for a field it no longer has.
- "honored" rows name a test that exists; each "warned" field set away from its default is named in one
  warning, and its default in none; each "refused" field is an error naming it.
- docs/trainer-scripts.md shows the table ``argument_rows.table()`` makes.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from xshard.config import XShardConfigError, XShardConfigWarning
from xshard.trainer import TrainingArguments, sharding_config
from xshard.trainer.argument_rows import ROWS, TRIGGERS, argument_fields, table

TESTS = Path(__file__).resolve().parent
PAGE = TESTS.parent / "docs" / "trainer-scripts.md"
WARNED = sorted(name for name, row in ROWS.items() if row.status == "warned")
REFUSED = sorted(name for name, row in ROWS.items() if row.status == "refused")


@pytest.fixture(autouse=True)
def one_cpu_process(clean_env):
    clean_env.setenv("XSHARD_BACKEND", "cpu")
    return clean_env


def _arguments(tmp_path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")


def test_every_field_of_the_installed_transformers_has_a_row_and_every_row_a_field():
    fields = argument_fields()
    assert [name for name in fields if name not in ROWS] == [], "fields without a row in argument_rows.py"
    assert [name for name in ROWS if name not in fields] == [], "rows for fields transformers no longer has"


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_row_names_a_test_that_exists(name):
    file, _, test = ROWS[name].test.partition("::")
    source = (TESTS / file).read_text()
    assert re.search(rf"^def {re.escape(test.split('[')[0])}\(", source, re.M), ROWS[name].test
    if "[" in test:  # a parametrized case: its id is one of the test's
        assert f'"{test.split("[")[1].rstrip("]")}"' in source, ROWS[name].test
    if ROWS[name].status != "same":
        assert file == "test_trainer_argument_table.py"


def _xshard_warnings(args) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharding_config(args)
    return [str(w.message) for w in caught if issubclass(w.category, XShardConfigWarning)]


@pytest.mark.parametrize("name", WARNED)
def test_a_warned_argument_is_named_in_one_warning(tmp_path, name):
    args = _arguments(tmp_path)
    assert not any(name in message for message in _xshard_warnings(args)), "the default is warned"
    value = TRIGGERS[name]()
    setattr(args, name, value)
    messages = _xshard_warnings(args)
    assert len(messages) == 1 and messages[0].count(f"{name}={value!r}") == 1, messages
    assert ROWS[name].how.split(":")[0] in messages[0]  # what xshard does, as the row says


@pytest.mark.parametrize("name", REFUSED)
def test_a_refused_argument_is_an_error_naming_the_fix(tmp_path, name):
    args = _arguments(tmp_path)
    setattr(args, name, TRIGGERS[name]())
    with pytest.raises(XShardConfigError, match=rf"{name}.*(remove|shard with)"):
        sharding_config(args)


def test_the_page_shows_the_generated_table():
    text = PAGE.read_text()
    start, end = "<!-- argument-table: start -->\n", "<!-- argument-table: end -->"
    assert start in text and end in text, "docs/trainer-scripts.md has no generated argument table"
    shown = text.split(start, 1)[1].split(end, 1)[0]
    assert shown == table(), ("docs/trainer-scripts.md's argument table is not argument_rows.table(): paste "
                              "`python -c 'from xshard.trainer.argument_rows import table; print(table(), end=\"\")'`")
