"""Checkpoint files written around the page cache (xshard/checkpoint/direct_io.py) hold exactly the bytes
written, at their exact length, whether the filesystem takes O_DIRECT, refuses it at open, or refuses it
at a write; page-aligned data goes to the file from where it is; an async save's staged file image is
byte for byte the file a blocking save writes; a save's files load back."""

from __future__ import annotations

import errno
import mmap
import os

import pytest
import torch

from xshard.checkpoint import direct_io
from xshard.checkpoint.async_save import HostStaging
from xshard.checkpoint.checksum import new_hasher
from xshard.checkpoint.files import FileWriter

CHUNK = direct_io.CHUNK
# lengths around the chunk size, written in pieces of awkward sizes (a header, then odd blocks)
LENGTHS = [0, 1, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 4097]


def _data(length: int) -> bytes:
    return torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(length)
                         ).numpy().tobytes()


def _write(path, data: bytes, raw_wrapper=None) -> bool:
    """Write ``data`` in pieces; whether whole chunks went direct at the start."""
    with open(path, "wb", buffering=0, opener=direct_io.opener) as f:
        blocks = direct_io.BlockWriter(raw_wrapper(f) if raw_wrapper else f)
        started_direct = blocks.direct
        for start, size in _pieces(len(data)):
            assert blocks.write(data[start:start + size]) == size
        blocks.finish()
    return started_direct


def _pieces(length: int):
    start, sizes, i = 0, [8, 4093, 3 * 2**20 + 5, CHUNK + 11], 0
    while start < length:
        size = min(sizes[i % len(sizes)], length - start)
        yield start, size
        start += size
        i += 1


class _RawFile:
    """An unbuffered file seen through a test's ``write`` (subclasses define it)."""

    def __init__(self, raw):
        self.raw = raw

    def fileno(self):
        return self.raw.fileno()


def _takes_o_direct(folder) -> bool:
    if not direct_io.O_DIRECT:
        return False
    try:
        os.close(os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | direct_io.O_DIRECT))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("length", LENGTHS)
def test_a_file_holds_exactly_the_bytes_written(tmp_path, length):
    data = _data(length)
    started_direct = _write(tmp_path / "f", data)
    assert (tmp_path / "f").read_bytes() == data
    # whole chunks went around the page cache where this filesystem takes O_DIRECT (not silently buffered)
    assert started_direct == _takes_o_direct(tmp_path)


def test_a_filesystem_that_refuses_o_direct_at_open_gets_the_same_bytes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & direct_io.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    data = _data(2 * CHUNK + 4097)
    started_direct = _write(tmp_path / "f", data)
    assert not started_direct and (tmp_path / "f").read_bytes() == data


@pytest.mark.skipif(not direct_io.O_DIRECT, reason="no O_DIRECT on this platform")
def test_a_filesystem_that_refuses_o_direct_at_a_write_gets_the_same_bytes(tmp_path):
    if not _takes_o_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT at open")

    direct_writes = []

    class RefusesDirectWrites(_RawFile):
        """The second direct write fails as some filesystems' do; buffered writes pass."""

        def write(self, view):
            import fcntl

            if fcntl.fcntl(self.raw.fileno(), fcntl.F_GETFL) & direct_io.O_DIRECT:
                direct_writes.append(len(view))
                if len(direct_writes) == 2:
                    raise OSError(errno.EINVAL, "Invalid argument")
            return self.raw.write(view)

    data = _data(3 * CHUNK + 1)
    assert _write(tmp_path / "f", data, RefusesDirectWrites)
    assert direct_writes == [CHUNK, CHUNK]  # one chunk direct, the refused one, then none: it fell back and went on
    assert (tmp_path / "f").read_bytes() == data  # no chunk lost, none written twice


def test_a_writers_files_load_back_with_their_checksums(tmp_path):
    tensors = {"w": torch.randn(3 * CHUNK // 4 + 7), "b": torch.arange(5, dtype=torch.int64)}
    writer = FileWriter(tmp_path, 0)
    writer.safetensors("model.safetensors", tensors)
    writer.torch("optimizer.bin", {"state": tensors, "step": 3})
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    state = torch.load(tmp_path / "optimizer.bin", weights_only=True)
    assert state["step"] == 3 and all(torch.equal(state["state"][k], v) for k, v in tensors.items())
    for name, entry in writer.files.items():
        raw = (tmp_path / name).read_bytes()
        digest = new_hasher()
        digest.update(raw)
        assert entry["bytes"] == len(raw) and next(v for k, v in entry.items() if k != "bytes") == digest.hexdigest()


@pytest.mark.skipif(not direct_io.O_DIRECT, reason="no O_DIRECT on this platform")
def test_page_aligned_data_at_a_chunk_boundary_goes_to_the_file_from_where_it_is(tmp_path):
    """An async save's staged file images are page-aligned: their whole chunks are handed to the device
    as they lie in memory, not copied through the writer's buffer first (its CPU cost, direct_io.py)."""
    if not _takes_o_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT at open")
    length = 3 * CHUNK + 5
    image = mmap.mmap(-1, length)  # page-aligned, as HostStaging's images are
    image[:] = _data(length)
    start = direct_io._address(memoryview(image))
    writes = []

    class Recorder(_RawFile):
        def write(self, view):
            writes.append((direct_io._address(view), len(view)))
            return self.raw.write(view)

    with open(tmp_path / "f", "wb", buffering=0, opener=direct_io.opener) as f:
        blocks = direct_io.BlockWriter(Recorder(f))
        blocks.write(image)
        blocks.finish()
    assert (tmp_path / "f").read_bytes() == image[:]
    from_image = sum(n for address, n in writes if start <= address < start + length)
    assert from_image == 3 * CHUNK  # every whole chunk straight from the image; the 5-byte tail buffered


def _awkward_tensors() -> dict[str, torch.Tensor]:
    """Tensors whose byte offsets in a file are not multiples of their element size, a transposed one,
    an empty one, a scalar and every element width."""
    g = torch.Generator().manual_seed(0)
    return {
        "odd_bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f32": torch.randn(CHUNK // 4 + 3, generator=g),
        "transposed": torch.randn(5, 3, generator=g).t(),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "mask": torch.rand(9, generator=g) > 0.5,
        "i8": torch.randint(-100, 100, (11,), dtype=torch.int8, generator=g),
    }


def test_a_staged_file_image_is_the_file_a_blocking_save_writes(tmp_path):
    tensors = _awkward_tensors()
    for name in ("blocking", "async"):
        (tmp_path / name).mkdir()
    FileWriter(tmp_path / "blocking", 0).safetensors("model.safetensors", tensors)
    staging = HostStaging(lambda n: torch.empty(n, dtype=torch.uint8))
    staging.begin()
    image = staging.image(tensors, {"format": "pt"})
    assert image.data_ptr() % mmap.PAGESIZE == 0
    writer = FileWriter(tmp_path / "async", 0)
    writer.image("model.safetensors", image)
    assert (tmp_path / "async" / "model.safetensors").read_bytes() == (
        tmp_path / "blocking" / "model.safetensors").read_bytes()
    # the next save of the same sizes reuses the buffer: no new host memory
    allocated = staging.bytes_allocated
    staging.begin()
    assert staging.image(tensors, {"format": "pt"}).data_ptr() == image.data_ptr()
    assert staging.bytes_allocated == allocated
