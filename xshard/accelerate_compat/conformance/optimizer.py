"""The prepared optimizer and LR scheduler against Accelerate's ``AcceleratedOptimizer`` and ``AcceleratedScheduler``.

One ``Row`` per public member of the installed classes (what ``dir()`` gives without a leading underscore,
torch's inherited members included, and the attributes a prepared instance holds); xshard's classes are
``xshard.runtime.prepared``'s.
"""

from __future__ import annotations

from . import Row

_SURFACE = "test_accelerate_optimizer_surface.py::"
_MEMBERS = _SURFACE + "test_the_prepared_optimizers_members_reach_the_users_optimizer_as_in_accelerate"
_TORCH_MEMBERS = _SURFACE + "test_torchs_class_members_of_the_prepared_optimizer_are_accelerates"
_SCHEDULE_FREE = _SURFACE + "test_a_schedule_free_optimizers_train_and_eval_give_accelerates_losses"
_WINDOWS = _SURFACE + "test_setting_gradient_accumulation_steps_mid_run_gives_accelerates_windows_and_losses"
_SCHEDULER = _SURFACE + "test_the_prepared_schedulers_members_answer_as_accelerates"
_STATE = "the prepared objects do not hold the Accelerator's state: an AttributeError naming {where}"
_HOOK = ("registered on your optimizer, {when} (Accelerate 1.15 raises AttributeError here: its wrapper skips "
         "torch's __init__)")

#: ``accelerate.optimizer.AcceleratedOptimizer``'s public members -> what the prepared optimizer does
OPTIMIZER_ROWS: dict[str, Row] = {
    "OptimizerPreHook": Row("same", "torch's type of a step pre-hook, inherited", _TORCH_MEMBERS),
    "OptimizerPostHook": Row("same", "torch's type of a step post-hook, inherited", _TORCH_MEMBERS),
    "profile_hook_step": Row("same", "torch's step decorator, inherited", _TORCH_MEMBERS),
    "add_param_group": Row("same", "adds the group to your optimizer", _MEMBERS),
    "defaults": Row("same", "your optimizer's defaults (read and set)", _MEMBERS),
    "param_groups": Row("same", "your optimizer's groups: an lr set here is the one it steps with", _MEMBERS),
    "state": Row("same", "your optimizer's state (this rank's shards at stages 1-3)", _MEMBERS),
    "state_dict": Row("same", "your optimizer's state dict (over this rank's shards at stages 1-3)", _MEMBERS),
    "load_state_dict": Row("same", "into your optimizer (same rank, world size and stage as saved)", _MEMBERS),
    "train": Row("same", "your optimizer's train() (schedule-free optimizers); nothing without one",
                 _SCHEDULE_FREE),
    "eval": Row("same", "your optimizer's eval() (schedule-free optimizers); nothing without one", _SCHEDULE_FREE),
    "step": Row("same", "steps at a window's end only, through the precision chain (unscale, clip, fp16 skip)",
                _WINDOWS),
    "zero_grad": Row("same", "clears at a window's end only; set_to_none defaults to True, an error for an "
                     "optimizer whose zero_grad lacks it", _MEMBERS),
    "step_was_skipped": Row("same", "True after an fp16 step skipped for inf/nan gradients (all ranks agree)",
                            _MEMBERS),
    "optimizer": Row("same", "your optimizer (its parameters are the shards at stages 1-3)", _MEMBERS),
    "scaler": Row("same", "the job's fp16 grad scaler, or None", _MEMBERS),
    "device_placement": Row("same", "True: the state lives where its parameters (or shards) do", _MEMBERS),
    "accelerator_state": Row("refused", _STATE.format(where="accelerator.state"), _MEMBERS),
    "gradient_state": Row("refused", _STATE.format(where="accelerator.gradient_state"), _MEMBERS),
    "register_step_pre_hook": Row("different", _HOOK.format(when="runs before each real step"), _MEMBERS),
    "register_step_post_hook": Row("different", _HOOK.format(when="runs after each real step"), _MEMBERS),
    "register_state_dict_pre_hook": Row("different", _HOOK.format(when="runs in state_dict()"), _MEMBERS),
    "register_state_dict_post_hook": Row("different", _HOOK.format(when="runs in state_dict()"), _MEMBERS),
    "register_load_state_dict_pre_hook": Row("different", _HOOK.format(when="runs in load_state_dict()"), _MEMBERS),
    "register_load_state_dict_post_hook": Row("different", _HOOK.format(when="runs in load_state_dict()"), _MEMBERS),
}

#: ``accelerate.scheduler.AcceleratedScheduler``'s public members -> what the prepared scheduler does
SCHEDULER_ROWS: dict[str, Row] = {
    "step": Row("same", "Accelerate's rule: at window ends, never after a skipped step, num_processes times "
                "(once with split_batches; every call with step_scheduler_with_optimizer=False)",
                "test_accelerate_behaviour.py::test_sync_points_no_sync_window_clipping_and_scheduler_steps"),
    "get_last_lr": Row("same", "your scheduler's", _SCHEDULER),
    "get_lr": Row("same", "your scheduler's", _SCHEDULER),
    "state_dict": Row("same", "your scheduler's", _SCHEDULER),
    "load_state_dict": Row("same", "into your scheduler", _SCHEDULER),
    "scheduler": Row("same", "your scheduler", _SCHEDULER),
    "optimizers": Row("same", "the prepared optimizers it follows", _SCHEDULER),
    "split_batches": Row("same", "the Accelerator's split_batches (one schedule step per optimizer step)",
                         _SCHEDULER),
    "step_with_optimizer": Row("same", "the Accelerator's step_scheduler_with_optimizer", _SCHEDULER),
    "gradient_state": Row("refused", _STATE.format(where="accelerator.gradient_state"), _SCHEDULER),
    "print_lr": Row("same", "your scheduler's (torch's schedulers have none: AttributeError, as in Accelerate)",
                    _SCHEDULER),
}
