"""A save that the disk refuses is one line naming the folder and the fix, and leaves nothing of itself: an
async save on a full disk (a small private tmpfs) removes its ``checkpoint-N.tmp`` and says how many bytes
it needs and how many are free; a save into a read-only folder (a tmpfs mounted read-only) names the folder
and the fix instead of a raw ``OSError``. The earlier checkpoint and the user's own files are kept."""

from __future__ import annotations

from pathlib import Path

from support.private_tmpfs import output_lines, run_on_private_tmpfs

SCRIPT = r'''
import os, sys, torch, xshard
from xshard.checkpoint.files import CheckpointError
out = sys.argv[1]
(open(os.path.join(out, "notes.txt"), "w") if sys.argv[2] == "full" else open(os.devnull, "w")).write("mine")
acc = xshard.Accelerator(config={"stage": 0}, seed=0)
model = torch.nn.Linear(8, 4)
model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters()))
if sys.argv[2] == "full":
    acc.save_state(os.path.join(out, "checkpoint-1"))
    with open(os.path.join(out, "filler"), "wb") as f:  # the disk fills up, but for a few pages
        try:
            f.write(b"\0" * (1 << 20))
        except OSError:
            pass
    os.truncate(os.path.join(out, "filler"), max(0, os.path.getsize(os.path.join(out, "filler")) - 8192))
try:
    acc.save_state(os.path.join(out, "checkpoint-2"), async_save=sys.argv[2] == "full")
    acc.end()
    print("SAVED")
except (CheckpointError, OSError) as exc:
    print(f"ERROR:{type(exc).__name__}:{exc}")
print("LEFT:" + ",".join(sorted(os.listdir(out))))
if sys.argv[2] == "full":
    acc.load_state(os.path.join(out, "checkpoint-1"))
    print("LOADED")
'''


def _in_private_tmpfs(tmp_path: Path, options: str, mode: str) -> dict[str, str]:
    """Run the script on a tmpfs mounted with ``options`` in a private mount namespace; its output lines."""
    proc, mount = run_on_private_tmpfs(tmp_path, SCRIPT, options, mode, timeout=200, env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**output_lines(proc), "_mount": str(mount), "_stdout": proc.stdout}


def test_an_async_save_on_a_full_disk_removes_its_tmp_folder_and_gives_the_byte_counts(tmp_path):
    lines = _in_private_tmpfs(tmp_path, "size=1m", "full")
    error = lines["ERROR"]
    assert "\n" not in error
    assert error.startswith(f"CheckpointError:the background write of {lines['_mount']}/checkpoint-2 failed: the disk "
                            "is full (No space left on device: this rank's files need ")
    needed = int(error.split("need ")[1].split(" bytes")[0].replace(",", ""))
    free = int(error.split("bytes, ")[1].split(" are free")[0].replace(",", ""))
    assert needed > free >= 0 and "free some space or save to another disk" in error
    assert lines["LEFT"] == ".xshard_job.lock,checkpoint-1,filler,notes.txt"  # no checkpoint-2.tmp
    assert "LOADED" in lines["_stdout"]


def test_a_save_into_a_read_only_folder_is_one_line_naming_the_folder_and_the_fix(tmp_path):
    lines = _in_private_tmpfs(tmp_path, "size=1m,ro", "read-only")
    mount = lines["_mount"]
    assert lines["ERROR"] == (f"CheckpointSaveError:cannot save the checkpoint {mount}/checkpoint-2: {mount}: "
                              f"Read-only file system; save to a folder this process may write to, or make {mount} "
                              "writable; nothing was written")
    assert lines["LEFT"] == ""
