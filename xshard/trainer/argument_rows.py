"""Every field of the installed transformers' ``TrainingArguments`` and ``Seq2SeqTrainingArguments``, and what
xshard's Trainer does with it.

One ``Row`` (``xshard.accelerate_compat.conformance``) per field: "same" (honored: the stock Trainer's
behaviour, with the test that compares the two), "warned" (accepted; a value other than the default is named
in one warning saying what xshard does instead) or "refused" (an error naming the fix). ``TRIGGERS`` holds, for
each warned or refused field, a value that sets it off. ``tests/test_trainer_argument_table.py`` fails on a
field of the installed transformers without a row, checks every warning and error, and checks that
docs/trainer-scripts.md shows ``table()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from xshard.accelerate_compat.conformance import Row

__all__ = ["ROWS", "TRIGGERS", "argument_fields", "table"]

_ONE = "test_trainer.py::test_stock_and_xshard_trainers_give_the_same_run_in_one_process"
_SCHEDULE = ("test_trainer_arguments_parity.py::test_the_trainers_own_arguments_give_the_stock_run"
             "[schedule_evaluation_logging]")
_OPTIMIZER = "test_trainer_arguments_parity.py::test_the_trainers_own_arguments_give_the_stock_run[optimizer_and_loss]"
_MISSING = "test_trainer_arguments_parity.py::test_arguments_that_need_what_is_not_installed_fail_as_on_the_stock_trainer"
_GENERATE = "test_trainer_seq2seq.py::test_predict_with_generate_gives_the_stock_classs_tokens_at_stages_3_and_0"
_BEAMS = "test_trainer_arguments_parity.py::test_beam_search_generation_gives_the_stock_classs_tokens"
_COMPILE = "test_trainer_compile.py::test_torch_compile_compiles_and_gives_the_stock_trainers_losses"
_FACTS = "test_trainer_compile.py::test_the_arguments_report_the_processes_as_the_stock_arguments_do"
_SAMPLING = "test_trainer_sampling.py::test_a_sampling_strategy_gives_the_stock_trainers_losses_on_2_processes"
_STREAM = "test_trainer_sampling.py::test_an_iterable_train_set_gives_the_stock_trainers_losses_on_2_processes"
_RESUME = ("test_trainer_stock_checkpoint.py::"
           "test_a_stock_trainer_checkpoint_resumes_under_xshard_at_stage_3_with_the_stock_runs_losses")
_BEST = "test_trainer.py::test_load_best_model_at_end_keeps_the_best_checkpoint_and_ends_with_its_weights"
_ROTATE = "test_trainer.py::test_two_processes_train_rotate_checkpoints_and_evaluate_each_sample_once"
_SAME_CONFIG = "test_trainer_arguments.py::test_stock_arguments_give_the_same_config"
_WARNED = "test_trainer_argument_table.py::test_a_warned_argument_is_named_in_one_warning"
_REFUSED = "test_trainer_argument_table.py::test_a_refused_argument_is_an_error_naming_the_fix"

_OWN = "the Trainer's own code"


def _same(how: str, test: str) -> Row:
    return Row("same", how, test)


def _rows(test: str, how: str, *names: str) -> dict[str, Row]:
    return {name: _same(how, test) for name in names}


ROWS: dict[str, Row] = {
    # -- what one step does: the Trainer's own loop, on the sharded model
    **_rows(_ONE, f"{_OWN}: batch, steps, accumulation window, clipping, seeding, logging, output folder",
            "output_dir", "per_device_train_batch_size", "max_steps", "learning_rate", "gradient_accumulation_steps",
            "max_grad_norm", "logging_steps", "seed", "disable_tqdm", "report_to"),
    **_rows(_SCHEDULE, f"{_OWN}: epochs, schedule, logging, evaluation, data loading, seeding",
            "num_train_epochs", "lr_scheduler_kwargs", "warmup_steps", "per_device_eval_batch_size",
            "logging_strategy", "logging_first_step", "logging_nan_inf_filter", "include_num_input_tokens_seen",
            "eval_strategy", "eval_steps", "eval_delay", "eval_on_start", "eval_accumulation_steps",
            "eval_do_concat_batches", "prediction_loss_only", "dataloader_drop_last", "dataloader_pin_memory",
            "dataloader_persistent_workers", "dataloader_prefetch_factor", "torch_empty_cache_steps", "data_seed",
            "full_determinism", "log_level", "log_level_replica", "log_on_each_node", "label_names",
            "tf32", "use_cache", "activation_checkpointing", "activation_checkpointing_kwargs", "remove_unused_columns",
            "enable_jit_checkpoint"),
    "skip_memory_metrics": _same(f"{_OWN}: its memory report (on; the amounts vary from run to run and are not "
                                 "compared)", _SCHEDULE),
    "save_only_model": _same("checkpoint-N without the optimizer's rows (this run saves at step 3; the folders hold "
                             "xshard's state)", _SCHEDULE),
    **_rows(_SCHEDULE, f"{_OWN}, with a compute_metrics function (set in this run, which has none)",
            "include_for_metrics", "batch_eval_metrics", "eval_use_gather_object"),
    **_rows(_SCHEDULE, "read by scripts, not by the Trainer (set in this run)", "do_train", "do_eval", "do_predict"),
    "resume_from_checkpoint": _same("the script passes it to train(): a stock Trainer's checkpoint resumes to the "
                                    "stock run's losses", _RESUME),
    **_rows(_SCHEDULE, "used only with push_to_hub or report_to trackio, which the Trainer's own code runs on the "
                       "main process over the same folders; set here, no effect on either run",
            "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
            "hub_model_id", "hub_strategy", "hub_private_repo", "hub_always_push", "hub_revision"),
    **_rows(_SCHEDULE, f"{_OWN} when resuming (set in this run, which does not resume)", "ignore_data_skip",
            "restore_callback_states_from_checkpoint"),
    **_rows(_SCHEDULE, f"{_OWN} with train_sampling_strategy group_by_length (set in this run, which samples "
                       "sequentially)", "length_column_name"),
    **_rows(_OPTIMIZER, f"{_OWN}: its optimizer with decay groups, schedule, loss, checkpointing of the model",
            "optim", "optim_args", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_type",
            "label_smoothing_factor", "gradient_checkpointing", "gradient_checkpointing_kwargs",
            "neftune_noise_alpha", "average_tokens_across_devices", "debug", "auto_find_batch_size"),
    **_rows(_MISSING, f"{_OWN}; needs a package or the network this test has not: the same error as the stock Trainer",
            "use_liger_kernel", "liger_kernel_config", "optim_target_modules", "push_to_hub", "hub_token"),
    **_rows(_SAMPLING, f"{_OWN}: samplers and loader workers; xshard deals the batches as Accelerate does",
            "train_sampling_strategy", "dataloader_num_workers"),
    **_rows(_STREAM, "split_batches, dispatch_batches, even_batches, non_blocking, use_seedable_sampler, "
                     "gradient_accumulation_kwargs read as the stock Trainer reads them", "accelerator_config"),
    "dataloader_multiprocessing_context": _same(f"{_OWN}: the loader's workers start so", _SCHEDULE),
    "dataloader_in_order": _same("kept by the sharded loader (only the batching changes)", _SCHEDULE),
    # -- how the job is distributed
    "torch_compile": _same("the stock Trainer's TorchDynamoPlugin: prepare compiles the sharded model", _COMPILE),
    "torch_compile_backend": _same("the compile backend (torch_compile_backend sets torch_compile)", _COMPILE),
    "torch_compile_mode": _same("the torch.compile mode, given as the stock Trainer gives it", _COMPILE),
    "local_rank": _same("where the process sits: xshard's backend answers (world_size, process_index, "
                        "local_process_index, device, n_gpu, parallel_mode)", _FACTS),
    "ddp_timeout": _same("the collectives' timeout", _COMPILE),
    "ddp_bucket_cap_mb": _same("the stage-0 all-reduce bucket size", _COMPILE),
    "use_cpu": _same("the cpu backend", _SAME_CONFIG),
    "bf16": _same("mixed precision where the backend computes in bf16 (CPUs too); else one warning and fp32",
                  "test_trainer_arguments.py::test_bf16_on_a_cpu_is_mixed_precision"),
    "fp16": _same("mixed precision with the grad scaler where the backend computes in fp16 (the stock run to "
                  "1e-3: stage 3 computes with fp16 copies of the parameters, as FSDP's param_dtype); else one "
                  "warning and fp32",
                  "test_trainer_arguments_parity.py::test_the_trainers_own_arguments_give_the_stock_run"
                  "[fp16_mixed_precision]"),
    "fsdp": _same("the FSDP words: stage 3, 2, 0, hybrid sharding, offload",
                  "test_trainer_arguments.py::test_fsdp_words"),
    "fsdp_config": _same("units, prefetch, state_dict_type, activation checkpointing; XLA FSDP's keys",
                         "test_trainer_arguments.py::test_fsdp_config_classes_size_and_unknown_word"),
    "deepspeed": _same("a ds_config read without DeepSpeed, \"auto\" filled as the Trainer fills it",
                       "test_trainer_arguments.py::test_deepspeed_auto_values_are_filled_from_the_arguments_without_deepspeed"),
    # -- checkpoints: xshard's state in the Trainer's checkpoint-N folders
    "save_strategy": _same("checkpoint-N folders at the stock steps, holding xshard's portable state", _ROTATE),
    "save_steps": _same("checkpoint-N folders at the stock steps, holding xshard's portable state", _ROTATE),
    "save_total_limit": _same("rotation as the stock Trainer rotates (a link is never counted)", _ROTATE),
    "load_best_model_at_end": _same("the best checkpoint is kept and its weights loaded at the end", _BEST),
    "metric_for_best_model": _same(f"{_OWN}: which checkpoint is the best", _BEST),
    "greater_is_better": _same(f"{_OWN}: which checkpoint is the best", _BEST),
    # -- Seq2SeqTrainingArguments
    "predict_with_generate": _same("generation at every stage (stage 3: units gathered as the steps need them)",
                                   _GENERATE),
    "generation_max_length": _same(f"{_OWN}: the generate() keywords", _GENERATE),
    "generation_num_beams": _same(f"{_OWN}: the generate() keywords", _BEAMS),
    "generation_config": _same(f"{_OWN}: the generate() keywords", _BEAMS),
    "sortish_sampler": _same("not read by the transformers 5 Trainer, stock or xshard's", _BEAMS),
    # -- warned: accepted, no effect
    "ddp_backend": Row("warned", "the backend XSHARD_BACKEND selects picks its collective library", _WARNED),
    "ddp_broadcast_buffers": Row("warned", "buffers are always broadcast from rank 0, as DDP's default does", _WARNED),
    "ddp_static_graph": Row("warned", "nothing to declare: xshard's hooks follow the graph each step", _WARNED),
    "ddp_find_unused_parameters": Row("warned", "not needed: ranks whose batches skip units train at every stage as "
                                                "DDP with it on", _WARNED),
    "save_on_each_node": Row("warned", "one process writes each checkpoint (use a file system every node sees)",
                             _WARNED),
    # -- refused
    "bf16_full_eval": Row("refused", "the Trainer would cast the sharded model in place for evaluation; --bf16 "
                                     "evaluates in mixed precision", _REFUSED),
    "fp16_full_eval": Row("refused", "the Trainer would cast the sharded model in place for evaluation; --fp16 "
                                     "evaluates in mixed precision", _REFUSED),
    "parallelism_config": Row("refused", "tensor/context/sequence parallelism: xshard is data parallel; shard with "
                                         "--fsdp or --deepspeed stage 3", _REFUSED),
}

#: a value of each warned or refused field that xshard names (a factory: some need an object built)
TRIGGERS: dict[str, Any] = {
    "ddp_backend": lambda: "gloo",
    "ddp_broadcast_buffers": lambda: False,
    "ddp_static_graph": lambda: True,
    "ddp_find_unused_parameters": lambda: True,
    "save_on_each_node": lambda: True,
    "bf16_full_eval": lambda: True,
    "fp16_full_eval": lambda: True,
    "parallelism_config": lambda: _TensorParallel(),
}


class _TensorParallel:
    """What ``accelerate.ParallelismConfig(tp_size=2)`` holds of the sizes xshard reads."""

    tp_size, cp_size, sp_size, dp_replicate_size = 2, 1, 1, 1


def argument_fields() -> list[str]:
    """The field names of the installed transformers' ``TrainingArguments``, then ``Seq2SeqTrainingArguments``'
    own, in the classes' order."""
    import transformers

    names = [f.name for f in dataclasses.fields(transformers.TrainingArguments)]
    names += [f.name for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments) if f.name not in names]
    return names


def table() -> str:
    """The Markdown table of every field's row (docs/trainer-scripts.md shows it)."""
    lines = ["| argument | on xshard | what xshard does | test |", "|---|---|---|---|"]
    for name in argument_fields():
        row = ROWS.get(name)
        if row is None:
            lines.append(f"| `{name}` | **no row** | | |")
            continue
        status = "honored" if row.status == "same" else row.status
        lines.append(f"| `{name}` | {status} | {row.how} | `{row.test}` |")
    return "\n".join(lines) + "\n"
