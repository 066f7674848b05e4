"""Replica threads of one process (XLA:CPU) each run the user's script in a ``__main__`` of their own.

With ``runpy``, the replica that returned first put the spawner's ``__main__`` back under the other,
whose ``torch.save`` of a ``TrainingArguments`` subclass defined in the script then failed (the
Trainer's ``save_model`` on 2 XLA:CPU replicas). These threads reproduce that order exactly.
"""

from __future__ import annotations

import sys
import textwrap
import threading
import types
from pathlib import Path

from xshard.backends.launchers import thread_main

SCRIPT = """
import pickle, sys
sync = sys.modules["_thread_main_test"]

class Args:  # defined in the script, as the Qwen example defines its TrainingArguments subclass
    def __init__(self, name):
        self.name = name

sync.ready[{index}].set()
sync.go[{index}].wait(10)
restored = pickle.loads(pickle.dumps(Args("replica {index}")))
assert type(restored) is Args, type(restored)
import __main__
sync.results[{index}] = (restored.name, __main__.__file__, __name__)
"""


def test_each_replica_thread_pickles_its_own_script_classes_after_the_other_returned(tmp_path: Path) -> None:
    sync = types.ModuleType("_thread_main_test")
    sync.ready, sync.go = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    sync.results, errors = {}, []
    sys.modules["_thread_main_test"] = sync
    original_main = sys.modules["__main__"]
    scripts = []
    for index in range(2):
        scripts.append(tmp_path / f"replica{index}.py")
        scripts[index].write_text(textwrap.dedent(SCRIPT.format(index=index)))

    def replica(index: int) -> None:
        try:
            thread_main.run_path(str(scripts[index]))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        assert all(e.wait(10) for e in sync.ready)
        sync.go[1].set()  # replica 1 finishes first ...
        threads[1].join(10)
        sync.go[0].set()  # ... then replica 0 pickles its class
        threads[0].join(10)
    finally:
        del sys.modules["_thread_main_test"]
    assert not errors, errors
    assert sync.results == {i: (f"replica {i}", str(scripts[i]), "__main__") for i in range(2)}
    # a thread that runs no script (here: the test's) sees the original __main__
    main = sys.modules["__main__"]
    assert isinstance(main, thread_main.ThreadMain)
    # (a pytest-xdist worker's __main__ has no __file__: then neither has the proxy)
    assert getattr(main, "__file__", None) == getattr(original_main, "__file__", None)
    sys.modules["__main__"] = original_main


def test_a_script_run_as_a_module_gets_its_spec_and_package(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "pkg_thread_main"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text("import pickle\nclass A: pass\nRESULT = (__name__, __package__, __spec__.name,"
                                    " type(pickle.loads(pickle.dumps(A()))) is A)\nimport builtins\n"
                                    "builtins._thread_main_result = RESULT\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    original_main = sys.modules["__main__"]
    try:
        thread_main.run_module("pkg_thread_main.job")
        import builtins

        assert builtins._thread_main_result == ("__main__", "pkg_thread_main", "pkg_thread_main.job", True)
        del builtins._thread_main_result
    finally:
        sys.modules["__main__"] = original_main


def test_replica_threads_exchange_payloads_in_replica_order_round_after_round() -> None:
    """``replica_threads.exchange`` (what xm.rendezvous / xm.mesh_reduce become on XLA:CPU): every replica gets
    every payload in replica order, and a fast replica's next payload never reaches a slow one's current round."""
    from xshard.backends.collectives import replica_threads

    world, rounds = 3, 20
    seen: dict[int, list[list[bytes]]] = {i: [] for i in range(world)}

    def replica(index: int) -> None:
        for r in range(rounds):
            if index == r % world:
                threading.Event().wait(0.002)  # a different replica is late each round
            seen[index].append(replica_threads.exchange(world, index, f"{index}:{r}".encode()))

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = [[f"{i}:{r}".encode() for i in range(world)] for r in range(rounds)]
    assert all(seen[i] == expected for i in range(world)), seen
    assert replica_threads.exchange(1, 0, b"alone") == [b"alone"]
