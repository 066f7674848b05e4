"""The prepared data loader's members (Accelerate's ``DataLoaderShard``, with what it hands on from torch's
``DataLoader``) and what xshard's prepared loader does with each (``LOADER_ROWS``).

xshard's loader is ``xshard.runtime.data.ShardedDataLoader``; Accelerate's members it does not need for itself
are in ``xshard.runtime.loader_surface`` (whose ``LOADER_MEMBERS`` the refused rows come from). The iterator
protocol's members (``end_of_dataloader``, ``iteration``, ``set_epoch``, ``state_dict`` ...) are compared with
Accelerate's loader in ``tests/test_data_accelerate_protocol.py``; the rest on 2 processes in
``tests/test_accelerate_members.py``.
"""

from __future__ import annotations

from ...runtime.loader_surface import LOADER_MEMBERS
from . import Row

MEMBERS = "test_accelerate_members.py::test_loader_members_match_accelerate"
REFUSED = "test_accelerate_conformance.py::test_every_refused_member_names_xshards_way"
PROTOCOL = "test_data_accelerate_protocol.py::"
PASSES = PROTOCOL + "test_each_iter_is_a_new_pass_as_accelerates"
RESUME = PROTOCOL + "test_a_resumed_loader_reads_the_uninterrupted_order"
SKIP = PROTOCOL + "test_skip_first_batches_starts_one_pass_there_and_the_next_pass_is_whole"
REMAINDER = PROTOCOL + "test_remainder_is_accelerates_samples_in_the_last_global_batch"


def _rows(how: str, *names: str) -> dict[str, Row]:
    return {name: Row("same", how, MEMBERS) for name in names}


LOADER_ROWS: dict[str, Row] = {
    **_rows("the user's DataLoader setting, kept by the rebuilt loader", "num_workers", "collate_fn", "pin_memory",
            "pin_memory_device", "drop_last", "timeout", "worker_init_fn", "prefetch_factor", "persistent_workers",
            "generator", "in_order", "multiprocessing_context", "check_worker_number_rationality"),
    "dataset": Row("same", "the user's dataset object", MEMBERS),
    "device": Row("same", "the device batches are placed on", MEMBERS),
    "total_batch_size": Row("same", "the per-process batch times the number of processes", MEMBERS),
    "total_dataset_length": Row("same", "the dataset's total_length, else its length", MEMBERS),
    "base_dataloader": Row("same", "the torch DataLoader of this rank's batches", MEMBERS),
    "batch_size": Row("different", "the per-process batch size (Accelerate's loader, built from a batch sampler, "
                                   "says None)", MEMBERS),
    "use_stateful_dataloader": Row("different", "True: state_dict() / load_state_dict() always resume mid-epoch",
                                   MEMBERS),
    "sampler": Row("different", "xshard's sampler of this rank's batches (the epoch's order dealt over the ranks), "
                                "not the user's", MEMBERS),
    "batch_sampler": Row("different", "the rebuilt loader's batch sampler of this rank's batches", MEMBERS),
    "get_sampler": Row("different", "xshard's sampler of this rank's batches (Accelerate's returns the "
                                    "sampler it wraps, None for a plain DataLoader)", MEMBERS),
    "end_of_dataloader": Row("same", "True while the pass's last batch is used", PASSES),
    "iteration": Row("same", "the pass (epoch) number, counted as Accelerate counts it", PASSES),
    "set_epoch": Row("same", "start an epoch's order (the same epoch again keeps the position)", PASSES),
    "remainder": Row("same", "the samples of the last global batch (-1 outside a pass)", REMAINDER),
    "state_dict": Row("different", "xshard's position (epoch, batches consumed): resumes mid-epoch, also on "
                                   "another world size", RESUME),
    "load_state_dict": Row("different", "restores xshard's position (state_dict)", RESUME),
    "skip_batches": Row("same", "the batches the pass skips (skip_first_batches)", SKIP),
    **{name: Row("refused", way, REFUSED) for name, way in LOADER_MEMBERS.items()},
}
