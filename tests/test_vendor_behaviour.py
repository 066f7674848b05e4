"""Behaviour the vendor paths must have that names and signatures cannot show, per backend:

- the reduce op each collective hands the process group is one that backend's collective library
  implements for that collective (NCCL, gloo: torch's own ``ReduceOp`` documentation; HCCL: torch_npu
  2.13.0's wheel; TorchTPU: torch-tpu 0.2.0's wheel), for the averages, sums and maxima the sharded core
  asks for in fp32, bf16 and fp16;
- the dtype of each collective's buffer is the dtype of the tensors it moves (never silently up- or
  down-cast: a bf16 gradient is reduced in bf16), and a gather of mixed dtypes moves bytes (uint8);
- the GradScaler class each backend hands out is its vendor's (torch_npu's own for NPUs, torch's for the
  device type elsewhere), and none where the vendor has none and the precision is refused (TPUs).

The collectives are driven through the real ``DistCollectives`` each backend builds (its ``native_avg`` and
``collective_options()``), with the c10d calls recorded instead of sent: a world of 4 on one process.
"""

from __future__ import annotations

import ast
import os
import zipfile

import pytest
import torch
import torch.distributed as dist
from support.vendor_sources import WheelSources, npu_wheel_path, tpu_wheel_path

from xshard.backends import World, backend_class
from xshard.backends.collectives import PACK_BELOW_BYTES, DistCollectives
from xshard.backends.collectives import process_group as collectives_module

pytest_plugins = ("support.fakes.fixtures",)  # fixtures: fake_npu, make_fake_tpu

R = dist.ReduceOp.RedOpType
#: read once: tests that start from a clean environment drop every XSHARD_ variable
WHEELS_REQUIRED = os.environ.get("XSHARD_REQUIRE_VENDOR_WHEELS") == "1"
WORLD = 4
#: the collective kinds xshard issues with a reduce op, as the records below name them
REDUCING = ("all_reduce", "reduce_scatter", "reduce")


# ---------------------------------------------------------------- what each library implements


def _ops_named_in(wheel: WheelSources, module: str, function: str) -> set:
    """The ``ReduceOp`` members a function of the wheel names (an if-chain that raises on any other)."""
    node = next(n for n in ast.walk(wheel.tree(module)) if isinstance(n, ast.FunctionDef) and n.name == function)
    names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
             and n.value.attr == "ReduceOp" and n.attr.isupper()}
    raises = any(isinstance(n, ast.Raise) for n in ast.walk(node))
    assert names and raises, f"{module}.{function} no longer lists the reduce ops it takes"
    return {getattr(R, name) for name in names}


def _wheel(path_fn, what: str) -> WheelSources:
    path = path_fn()
    if path is None:
        why = f"the {what} wheel is absent: `make vendor-wheels` downloads it (`make test` does)"
        if WHEELS_REQUIRED:
            pytest.fail(why)
        pytest.skip(why)
    return WheelSources(path)


def library_ops(backend: str) -> dict[str, set]:
    """{collective kind: the ReduceOps the backend's collective library implements for it}."""
    doc = dist.ReduceOp.__doc__ or ""
    if backend in ("cpu", "cuda"):
        # torch's own documentation of ReduceOp (this torch): AVG is NCCL's alone; PREMUL_SUM is NCCL's and
        # only as an op built with a factor (ReduceOp.PREMUL_SUM(factor)), never the bare enum
        assert "``AVG`` is only available with the ``NCCL`` backend" in " ".join(doc.split())
        assert "``ReduceOp.PREMUL_SUM(factor)``" in doc
        common = {R.SUM, R.PRODUCT, R.MIN, R.MAX}
        ops = common | ({R.AVG} if backend == "cuda" else {R.BAND, R.BOR, R.BXOR})
        return dict.fromkeys(REDUCING, ops)
    if backend == "npu":
        # torch_npu maps the ReduceOps of its HCCL collectives in its graph converters, raising on any other
        wheel = _wheel(npu_wheel_path, "torch-npu")
        all_reduce = _ops_named_in(
            wheel, "torch_npu.dynamo.torchair._ge_concrete_graph.ge_converter.experimental.hcom_allreduce",
            "convert_reduce_op")
        reduce_scatter = _ops_named_in(wheel, "torch_npu.dynamo.npugraph_ex.ops._hcom_reducescatter",
                                       "convert_reduce_type")
        return {"all_reduce": all_reduce, "reduce": all_reduce, "reduce_scatter": reduce_scatter}
    if backend == "tpu":
        # TorchTPU's communicator forwards these ReduceOps to ProcessGroupTpu, raising on any other
        wheel = _wheel(tpu_wheel_path, "torch-tpu")
        ops = _ops_named_in(wheel, "torch_tpu._internal.distributed.torchcomm_tpu", "_to_dist_reduce_op")
        return dict.fromkeys(REDUCING, ops)
    raise AssertionError(backend)


# ---------------------------------------------------------------- what xshard issues


class _Done:
    """A finished c10d work."""

    def wait(self) -> bool:
        return True


@pytest.fixture
def recorded(monkeypatch):
    """Record every c10d call DistCollectives makes, as (kind, op, dtype), without sending anything."""
    calls: list[tuple[str, object, torch.dtype]] = []

    def recorder(kind: str, reduces: bool):
        def call(*args, **kw):
            tensor = args[1] if kind in ("all_gather", "reduce_scatter") else args[0]
            calls.append((kind, kw.get("op", R.SUM) if reduces else None, tensor.dtype))
            return _Done()
        return call

    monkeypatch.setattr(collectives_module, "_all_gather_single", recorder("all_gather", False))
    monkeypatch.setattr(collectives_module, "_reduce_scatter_single", recorder("reduce_scatter", True))
    for kind, reduces in (("all_reduce", True), ("reduce", True), ("broadcast", False)):
        monkeypatch.setattr(dist, kind, recorder(kind, reduces))
    for kind, name in (("send", "isend"), ("recv", "irecv")):  # point-to-point: a reduce-scatter by exchange
        monkeypatch.setattr(dist, name, recorder(kind, False))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    return calls


def make_backend(name: str, request) -> object:
    """The backend, on its fake vendor module where it needs one."""
    if name == "npu":
        request.getfixturevalue("fake_npu")
    if name == "tpu":
        request.getfixturevalue("make_fake_tpu")()
    return backend_class(name)(World())


def collectives_of(backend) -> DistCollectives:
    """The DistCollectives the backend builds for a job (``CommunicationAPI._make_collectives``)."""
    return DistCollectives(native_avg=backend.native_avg, **backend.collective_options())


def drive(coll: DistCollectives) -> None:
    """What the sharded core asks of the collectives: averages (gradients), sums, maxima (the scaler's
    overflow verdict), gathers, broadcasts, in each training dtype."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        shard = torch.ones(3, dtype=dtype)
        full = torch.ones(3 * WORLD, dtype=dtype)
        for op in ("avg", "sum", "max"):
            coll.all_reduce(torch.ones(5, dtype=dtype), op=op)
            coll.reduce_scatter_tensor(torch.empty(3, dtype=dtype), torch.ones(3 * WORLD, dtype=dtype), op=op)
        coll.reduce_scatter_tensors([torch.empty(3, dtype=dtype), torch.empty(2, dtype=dtype)],
                                    [torch.ones(3 * WORLD, dtype=dtype), torch.ones(2 * WORLD, dtype=dtype)])
        coll.all_gather_into_tensor(full, shard)
        coll.all_gather_into_tensors([torch.empty(3 * WORLD, dtype=dtype), torch.empty(2 * WORLD, dtype=dtype)],
                                     [shard, torch.ones(2, dtype=dtype)])
        coll.broadcast(full)


BACKENDS = ["cpu", "cuda", "npu", "tpu"]


@pytest.mark.parametrize("name", BACKENDS)
def test_every_reduce_op_is_one_the_backend_s_library_implements(name, recorded, request) -> None:
    implemented = library_ops(name)
    drive(collectives_of(make_backend(name, request)))
    reduces = [(kind, op, dtype) for kind, op, dtype in recorded if op is not None]
    assert {kind for kind, _, _ in reduces} <= set(REDUCING) and reduces
    wrong = sorted({f"{kind} with {op} ({dtype})" for kind, op, dtype in reduces if op not in implemented[kind]})
    assert not wrong, f"{name}: ops its collective library does not implement: {wrong}"


@pytest.mark.parametrize("name", BACKENDS)
def test_averages_use_the_library_s_own_avg_only_where_the_backend_says_it_has_one(name, recorded, request) -> None:
    backend = make_backend(name, request)
    coll = collectives_of(backend)
    coll.all_reduce(torch.ones(4), op="avg")
    coll.reduce_scatter_tensor(torch.empty(1), torch.ones(WORLD), op="avg")
    expected = R.AVG if backend.native_avg else R.SUM
    # a reduce-scatter by point-to-point exchange (gloo) reduces locally: it hands the library no op
    reducing = 1 if coll.reduce_scatter_form == "exchange" else 2
    assert [op for kind, op, _ in recorded if kind in REDUCING] == [expected] * reducing
    assert (R.AVG in library_ops(name)["all_reduce"]) >= backend.native_avg  # claims no AVG the library lacks


@pytest.mark.parametrize("name", BACKENDS)
def test_each_collective_s_buffer_has_the_dtype_it_moves(name, recorded, request) -> None:
    coll = collectives_of(make_backend(name, request))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        recorded.clear()
        coll.all_reduce(torch.ones(4, dtype=dtype), op="avg")
        coll.reduce_scatter_tensor(torch.empty(2, dtype=dtype), torch.ones(2 * WORLD, dtype=dtype), op="avg")
        coll.reduce_scatter_tensors([torch.empty(2, dtype=dtype), torch.empty(1, dtype=dtype)],
                                    [torch.ones(2 * WORLD, dtype=dtype), torch.ones(WORLD, dtype=dtype)])
        coll.all_gather_into_tensors([torch.empty(2 * WORLD, dtype=dtype), torch.empty(WORLD, dtype=dtype)],
                                     [torch.ones(2, dtype=dtype), torch.ones(1, dtype=dtype)])
        coll.broadcast(torch.ones(3, dtype=dtype))
        assert {d for _, _, d in recorded} == {dtype}, (name, dtype, recorded)
    # fp32 norms beside bf16 weights in one unit: one packed buffer of bytes (gloo's broadcasts: one per rank)
    recorded.clear()
    coll.all_gather_into_tensors([torch.empty(2 * WORLD), torch.empty(2 * WORLD, dtype=torch.bfloat16)],
                                 [torch.ones(2), torch.ones(2, dtype=torch.bfloat16)])
    assert [d for _, _, d in recorded] == [torch.uint8] * (WORLD if coll.all_gather_via_broadcast else 1)
    # large fp32 and bf16 tensors: gloo's broadcasts go straight into each output, in its own dtype
    if coll.all_gather_via_broadcast:
        recorded.clear()
        n = PACK_BELOW_BYTES  # elements per rank: above the packing size in either dtype
        coll.all_gather_into_tensors([torch.empty(n * WORLD), torch.empty(n * WORLD, dtype=torch.bfloat16)],
                                     [torch.ones(n), torch.ones(n, dtype=torch.bfloat16)])
        assert [d for _, _, d in recorded] == [torch.float32] * WORLD + [torch.bfloat16] * WORLD


# ---------------------------------------------------------------- the grad scaler each backend hands out


def test_cuda_and_mps_hand_out_torch_s_scaler_for_their_device(clean_env) -> None:
    for name in ("cuda", "mps"):
        scaler = backend_class(name)(World()).grad_scaler(enabled=False)
        assert type(scaler) is torch.amp.GradScaler and scaler._device == name


def test_npu_hands_out_torch_npu_s_own_scaler(fake_npu) -> None:
    wheel = _wheel(npu_wheel_path, "torch-npu")
    real = wheel.lookup("torch_npu.npu.amp.GradScaler")
    assert real is not None and real.kind == "class"  # the release has its own scaler class ...
    scaler = backend_class("npu")(World()).grad_scaler()
    assert type(scaler) is torch.npu.amp.GradScaler  # ... and the backend hands out that one
    assert type(scaler) is not torch.amp.GradScaler


def test_tpu_hands_out_no_scaler_for_fp16(make_fake_tpu) -> None:
    wheel = _wheel(tpu_wheel_path, "torch-tpu")
    with zipfile.ZipFile(wheel.path) as zf:  # the release has no scaler class anywhere in its Python
        assert not any(b"class GradScaler" in zf.read(n) for n in zf.namelist() if n.endswith(".py"))
    make_fake_tpu()
    backend = backend_class("tpu")(World())
    with pytest.raises(ValueError, match="use bf16"):
        backend.grad_scaler()
    scaler = backend.grad_scaler(enabled=False)
    assert type(scaler) is torch.amp.GradScaler and scaler._device == "tpu" and not scaler.is_enabled()
