"""Mutation check: break the code the way real bugs break it, and name the test that catches each.

Each mutant is one textual change to one file of the tree (a SUM where an AVG belongs, a divide done
twice, a unit's all-gather skipped, the device synchronisation before an async save's copies are used
removed) and the tests that must then fail. The runner copies the working tree (without virtual
environments and caches) into a temporary folder per mutant, applies the change, runs those tests
there with the copy first on the import path, and reports for each mutant whether the tests failed
and the first assertion that did. A mutant whose tests still pass is a hole in the suite.

    .venv/bin/python tests/support/mutants.py                 # every mutant of the main environment
    .venv/bin/python tests/support/mutants.py exchange-sum    # one, by name
    .venv/bin/python tests/support/mutants.py --xla           # the XLA mutants (needs .venv-xla)

Not part of ``make test``: each mutant runs its tests in full (minutes in all); the suite itself holds
the reference-side mutation (``test_a_wrong_gradient_scale_fails_the_comparison``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".venv", ".venv-xla", ".cache", ".git", ".pytest_cache", ".mypy_cache", "out", "__pycache__"}


@dataclass(frozen=True)
class Mutant:
    """``old`` (found exactly once in ``path``) replaced by ``new``; ``tests`` must fail."""

    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    xla: bool = False


PARITY_STAGES = ("tests/test_sharding_parity.py::test_every_stage_matches_single_process_2_ranks",
                 "tests/test_sharding_parity.py::test_every_stage_matches_single_process_4_ranks")
NATIVE = ("tests/test_sharding_parity_native.py",)
XLA_PARITY = ("tests/test_xla_core_parity.py::test_two_xla_replicas_train_like_one_cpu_process",)
EXCHANGE_DIVIDE = '                if op == "avg":\n                    dest.div_(world)\n'
SUM_THEN_DIVIDE = "            return dist.ReduceOp.SUM, float(self.world_size)\n"
NATIVE_OP = "        return _DIST_OPS[op], None\n"
XLA_DIVIDE = "        if op == \"avg\":\n            tensor.div_(self.world_size)\n"
GATHER = ('        handle = collectives.all_gather_into_tensors(targets, inputs, async_op=True, '
          'tag=f"all-gather of {what} {self.name}")\n')

MUTANTS = (
    Mutant("exchange-sum", "CPU forms, stages 1-3: the reduce-scatter by exchange sums (gradients x world)",
           "backends/collectives/process_group.py", EXCHANGE_DIVIDE, EXCHANGE_DIVIDE.replace("div_(world)", "div_(1)"),
           PARITY_STAGES),
    Mutant("exchange-halve", "CPU forms, stages 1-3: the exchange divides twice (gradients / world)",
           "backends/collectives/process_group.py", EXCHANGE_DIVIDE, EXCHANGE_DIVIDE.replace("div_(world)", "div_(world * world)"),
           PARITY_STAGES),
    Mutant("sum-then-divide-sum", "AVG as SUM then divide, without the divide (CPU stage 0's all-reduce; the "
           "TPU/MPS setup at every stage): gradients x world", "backends/collectives/process_group.py", SUM_THEN_DIVIDE,
           SUM_THEN_DIVIDE.replace("float(self.world_size)", "None"), PARITY_STAGES + NATIVE),
    Mutant("sum-then-divide-halve", "AVG as SUM then divide, divided twice: gradients / world",
           "backends/collectives/process_group.py", SUM_THEN_DIVIDE,
           SUM_THEN_DIVIDE.replace("float(self.world_size)", "float(self.world_size) ** 2"), PARITY_STAGES + NATIVE),
    Mutant("native-avg-sum", "native AVG setups (CUDA, NPU): AVG issued as SUM (gradients x world)",
           "backends/collectives/process_group.py", NATIVE_OP, '        return _DIST_OPS["sum" if op == "avg" else op], None\n',
           NATIVE),
    Mutant("native-avg-halve", "native AVG setups (CUDA, NPU): AVG and a divide after it (gradients / world)",
           "backends/collectives/process_group.py", NATIVE_OP,
           '        return _DIST_OPS[op], (float(self.world_size) if op == "avg" else None)\n', NATIVE),
    Mutant("stage3-gather-skipped", "stage 3: the second block's all-gather skipped (its full weights hold "
           "this rank's rows only)", "xshard/sharding/unit.py", GATHER,
           '        if self.name.endswith("s.1"):  # mutant\n'
           '            from xshard.backends.collectives.handle import _finished\n'
           '            handle = _finished(targets)\n'
           '        else:\n    ' + GATHER, PARITY_STAGES),
    Mutant("async-save-unsynchronized", "async save: the device synchronize() before the copies are used removed",
           "xshard/checkpoint/async_save.py",
           "        synchronize()  # the copies from the device are complete before training changes the tensors\n",
           "        pass\n", ("tests/test_checkpoint_async_device_sync.py",)),
    Mutant("xla-avg-sum", "XLA: AVG without its divide (gradients x world)", "backends/collectives/xla_graph.py",
           XLA_DIVIDE, XLA_DIVIDE.replace("div_(self.world_size)", "div_(1)"), XLA_PARITY, xla=True),
    Mutant("xla-avg-halve", "XLA: AVG divided twice (gradients / world)", "backends/collectives/xla_graph.py",
           XLA_DIVIDE, XLA_DIVIDE.replace("div_(self.world_size)", "div_(self.world_size ** 2)"), XLA_PARITY,
           xla=True),
)


def _copy_tree(dest: Path) -> None:
    for entry in ROOT.iterdir():
        if entry.name in SKIP:
            continue
        if entry.is_dir():  # links stay links: xshard/backends must keep pointing at the copy's backends/
            shutil.copytree(entry, dest / entry.name, symlinks=True, ignore=shutil.ignore_patterns(*SKIP))
        else:
            shutil.copy2(entry, dest / entry.name)


def run(mutant: Mutant) -> tuple[str, list[str], float]:
    """(verdict, the failed tests with their first lines, seconds): "caught", "MISSED" (the tests
    passed), or "error" (the run ended otherwise: a timeout, a collection error)."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        target = tree / mutant.path
        assert (tree / "xshard" / "backends").is_symlink(), "the copy must import its own backends/"
        text = target.read_text()
        if text.count(mutant.old) != 1:
            return "error", [f"the text to change occurs {text.count(mutant.old)} times in {mutant.path}"], 0.0
        target.write_text(text.replace(mutant.old, mutant.new))
        python = ROOT / (".venv-xla" if mutant.xla else ".venv") / "bin" / "python"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        if mutant.xla:
            env["PJRT_DEVICE"] = "CPU"
        start = time.monotonic()
        proc = subprocess.run([str(python), "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider",
                               *(["-m", "xla"] if mutant.xla else []), *mutant.tests],
                              cwd=tree, env=env, capture_output=True, text=True)
        took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "MISSED", ["the tests passed"], took
    failed = [line[len("FAILED "):][:400] for line in out.splitlines() if line.startswith("FAILED ")]
    # each failed test's first error line (pytest prints "E   <exception>: <message>" under the test)
    failed += [f"  {m.group(1)[:200]}" for m in re.finditer(r"^E\s+(\w*(?:Error|Exception)\b.*)$", out, flags=re.M)]
    # the parity groups list each failing case ("stage N <options>: <first difference>")
    cases = dict.fromkeys(m.group(1)[:160] for m in re.finditer(r"^E\s+(stage \d.*)$", out, flags=re.M))
    failed += [f"  case {case}" for case in cases]
    if proc.returncode != 1 or "+ Timeout +" in out or " hung for " in out or not failed:
        return "error", [f"pytest exit {proc.returncode}: {out.strip().splitlines()[-1]}", *failed], took
    return "caught", failed, took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: every one of the environment)")
    parser.add_argument("--xla", action="store_true", help="the XLA mutants (in .venv-xla)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if (m.name in args.names if args.names else m.xla == args.xla)]
    if not chosen:
        parser.error(f"no such mutant; the mutants: {', '.join(m.name for m in MUTANTS)}")
    results = []
    for mutant in chosen:
        verdict, details, took = run(mutant)
        results.append(verdict)
        print(f"{mutant.name}: {verdict} in {took:.0f} s -- {mutant.what}", flush=True)
        for line in details:
            print(f"    {line}", flush=True)
    caught = results.count("caught")
    print(f"{caught} of {len(results)} mutants caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
