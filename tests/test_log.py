"""xshard.runtime.rank_logging: the main process logs at INFO, replicas at WARNING, both settable; rank prefixes."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from xshard.runtime.rank_logging import plan_logging


def test_main_process_info_replicas_warning():
    assert plan_logging(0, 0, 4, env={}).level == logging.INFO
    replica = plan_logging(3, 1, 4, env={})
    assert replica.level == logging.WARNING and not replica.is_log_main


def test_environment_overrides_and_arguments_override_the_environment():
    env = {"XSHARD_LOG_LEVEL": "debug", "XSHARD_LOG_LEVEL_REPLICA": "ERROR"}
    assert plan_logging(0, 0, 2, env=env).level == logging.DEBUG
    assert plan_logging(1, 1, 2, env=env).level == logging.ERROR
    assert plan_logging(1, 1, 2, replica_level="INFO", env=env).level == logging.INFO


def test_log_on_each_node_makes_every_local_rank_0_a_main_process():
    assert not plan_logging(2, 0, 4, env={}).is_log_main
    assert plan_logging(2, 0, 4, env={"XSHARD_LOG_ON_EACH_NODE": "1"}).is_log_main
    assert plan_logging(2, 0, 4, log_on_each_node=True, env={}).level == logging.INFO
    assert not plan_logging(2, 0, 4, env={"XSHARD_LOG_ON_EACH_NODE": "False"}).is_log_main


def test_bad_values_name_the_variable_and_the_choices():
    with pytest.raises(ValueError, match="XSHARD_LOG_LEVEL='LOUD'.*DEBUG, INFO, WARNING"):
        plan_logging(0, 0, 1, env={"XSHARD_LOG_LEVEL": "LOUD"})
    with pytest.raises(ValueError, match="XSHARD_LOG_ON_EACH_NODE='maybe' is not a boolean"):
        plan_logging(0, 0, 1, env={"XSHARD_LOG_ON_EACH_NODE": "maybe"})


def test_prefix_only_in_multi_process_jobs():
    assert plan_logging(0, 0, 1, env={}).prefix == ""
    assert plan_logging(1, 1, 2, env={}).prefix == "[rank 1/2] "


_SCRIPT = """
import sys
from xshard.runtime.rank_logging import setup_logging, get_logger, progress
setup_logging(rank=int(sys.argv[1]), local_rank=int(sys.argv[1]), world_size=2)
for name in ("xshard.demo", "user_script"):
    log = get_logger(name)
    log.info("info line")
    log.warning("warning line")
bar = progress(range(3), disable=False)  # a terminal-less test asks for the bar explicitly
print("bar disabled" if bar.disable else "bar shown")
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_what_each_process_actually_prints(rank, clean_env):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(rank)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("xshard.demo", "user_script"):
        assert f"[rank {rank}/2] WARNING {name}: warning line" in out.stderr
        assert (f"[rank 0/2] INFO {name}: info line" in out.stderr) == (rank == 0)
    assert out.stderr.count("warning line") == 2  # once per logger: no duplicate through the root logger
    assert out.stdout.strip() == ("bar shown" if rank == 0 else "bar disabled")


def test_replica_level_from_the_environment_reaches_the_process(clean_env):
    clean_env.setenv("XSHARD_LOG_LEVEL_REPLICA", "INFO")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, "1"], capture_output=True, text=True, timeout=60)
    assert "[rank 1/2] INFO xshard.demo: info line" in out.stderr
