"""The error ``xshard.trainer`` raises when transformers' Trainer cannot be imported: its real reason, in one line."""

from __future__ import annotations

__all__ = ["transformers_trainer_error"]


def transformers_trainer_error(exc: ImportError) -> ImportError:
    """An ImportError naming the innermost reason ``exc`` holds (transformers' lazy import hides it behind
    "Could not import module ...") and the install that gives the Trainer what it needs."""
    reason: BaseException = exc
    while reason.__cause__ is not None or (reason.__context__ is not None and not reason.__suppress_context__):
        reason = reason.__cause__ or reason.__context__  # type: ignore[assignment]
    if str(getattr(reason, "name", None) or "").split(".")[0] == "xshard":
        return exc  # xshard's own import went wrong: not a missing requirement
    return ImportError(f"xshard.trainer needs transformers' Trainer, which cannot be imported: {reason}; "
                       "`pip install 'xshard[hf]'` installs transformers with what its Trainer needs (accelerate)")
