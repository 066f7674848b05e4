"""``accelerate.Accelerator``'s members and what ``xshard.Accelerator`` does with each (``ACCELERATOR_ROWS``).

The refused members are the ones ``missing.ACCELERATOR_MEMBERS`` names (``Accelerator.__getattr__`` raises
their way); the others are compared with stock Accelerate on 2 processes in ``tests/test_accelerate_members.py``
or in the tests named.
"""

from __future__ import annotations

from ..missing import ACCELERATOR_MEMBERS
from . import Row

MEMBERS = "test_accelerate_members.py::test_accelerator_members_match_accelerate"
REFUSED = "test_accelerate_conformance.py::test_every_refused_member_names_xshards_way"
SCRIPT = "test_accelerate_script.py::test_accelerate_and_xshard_give_the_same_run_in_one_process"
NO_TRAINER = "test_no_trainer_script.py::test_no_trainer_script_gives_accelerates_losses_and_resumes_exactly"
BEHAVIOUR = "test_accelerate_behaviour.py::test_sync_points_no_sync_window_clipping_and_scheduler_steps"
PROFILE = "test_accelerate_profile.py::test_profile_writes_accelerates_trace_files_on_each_process"
OPTIMIZER = ("test_accelerate_optimizer_surface.py::"
             "test_setting_gradient_accumulation_steps_mid_run_gives_accelerates_windows_and_losses")


def _same(how: str, test: str = MEMBERS) -> Row:
    return Row("same", how, test)


def _rows(how: str, *names: str, test: str = MEMBERS) -> dict[str, Row]:
    return {name: _same(how, test) for name in names}


ACCELERATOR_ROWS: dict[str, Row] = {
    # the job's processes
    **_rows("the job's process facts", "num_processes", "process_index", "local_process_index", "is_main_process",
            "is_local_main_process", "is_last_process", "use_distributed", "distributed_type"),
    "device": Row("different", "torch.device('cpu') on CPUs where Accelerate says 'cpu:0' (the same device); "
                               "the backend's device elsewhere", MEMBERS),
    "multi_device": Row("different", "True whenever the job has more than one process; Accelerate's is False for "
                                     "MULTI_CPU (several accelerators only)", MEMBERS),
    "state": Row("different", "Accelerate's AcceleratorState fields, from this job (its device as `device`)",
                 MEMBERS),
    "gradient_state": _same("sync_gradients, end_of_dataloader, remainder, in_dataloader, num_steps"),
    **_rows("every process takes part", "wait_for_everyone", "main_process_first", "local_main_process_first",
            "print", "split_between_processes", "pad_across_processes", "gather", "reduce", "set_trigger",
            "check_trigger"),
    **_rows("decorators: the function runs on the named process only (None elsewhere)", "on_main_process",
            "on_local_main_process", "on_last_process", "on_process", "on_local_process"),
    "gather_for_metrics": _same("each sample once, in the loader's order; objects with use_gather_object"),
    # configuration read back
    **_rows("the constructor's setting read back", "mixed_precision", "split_batches", "even_batches",
            "non_blocking", "use_seedable_sampler", "step_scheduler_with_optimizer", "device_placement",
            "native_amp", "scaler", "deepspeed_plugin", "is_fsdp2", "project_dir", "logging_dir", "save_iteration",
            "project_configuration", "profile_handler"),
    "gradient_accumulation_steps": _same("read and set (the window counts as Accelerate's)", OPTIMIZER),
    "dispatch_batches": Row("different", "False: every rank reads its own batches (Accelerate: None, decided per "
                                         "loader, False for a map-style dataset)", MEMBERS),
    "use_stateful_dataloader": Row("different", "True: a prepared loader's position is always checkpointed",
                                   MEMBERS),
    "dataloader_config": Row("different", "Accelerate's DataLoaderConfiguration of what prepare does "
                                          "(dispatch_batches False, use_stateful_dataloader True)", MEMBERS),
    "trackers": _same("the running trackers (main process)"),
    # the training step
    **_rows("the prepared objects train as Accelerate's (losses, norms, LRs compared)", "prepare", "prepare_model",
            "prepare_optimizer", "prepare_scheduler", "prepare_data_loader", "accumulate", "backward",
            "clip_grad_norm_", "clip_grad_value_", "unscale_gradients", "sync_gradients",
            "optimizer_step_was_skipped", "no_sync", "trigger_sync_in_backward", "autocast", "join_uneven_inputs",
            "unwrap_model", "free_memory", "clear"),
    "step": Row("different", "optimizer steps taken (Accelerate counts micro-steps in a window)", MEMBERS),
    "profile": _same("torch.profiler over the block, from ProfileKwargs (trace files as Accelerate's)", PROFILE),
    "verify_device_map": _same("True for a model loaded over several devices (hf_device_map)"),
    "skip_first_batches": Row("different", "a position in the epoch: after load_state restored it, skipping to "
                                           "the same batch skips nothing more", MEMBERS),
    # saving
    "save": _same("torch.save (or safetensors) on the main process"),
    "save_model": _same("model.safetensors (or shards and their index), tied weights once"),
    "get_state_dict": Row("different", "the whole weights on the main process, empty elsewhere (every process "
                                       "must call it), as Accelerate's FSDP full state dict", MEMBERS),
    **{name: Row("different", "xshard's atomic, checksummed checkpoint format; loads Accelerate's save_state "
                              "folders too", NO_TRAINER)
       for name in ("save_state", "load_state", "register_for_checkpointing")},
    # trackers
    **_rows("trackers through their real libraries, main process only", "init_trackers", "log", "get_tracker",
            "end_training", test=SCRIPT),
    # what xshard has not: an AttributeError naming xshard's way
    **{name: Row("refused", way, REFUSED) for name, way in ACCELERATOR_MEMBERS.items()},
}
