"""Buffer intake: one descriptor for every accepted array kind; clear errors for the rest."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from ddlcore.kernels.dtypes import DType

from ddlcore.buffers import MemoryKind, as_buffer, empty_like


@pytest.mark.parametrize(
    "dtype,code",
    [
        (np.float16, DType.FLOAT16),
        (ml_dtypes.bfloat16, DType.BFLOAT16),
        (np.float32, DType.FLOAT32),
        (np.float64, DType.FLOAT64),
        (np.int8, DType.INT8),
        (np.uint8, DType.UINT8),
        (np.int32, DType.INT32),
        (np.int64, DType.INT64),
    ],
)
def test_numpy_arrays(dtype, code):
    arr = np.arange(12).astype(dtype).reshape(3, 4)
    d = as_buffer(arr)
    assert (d.ptr, d.nbytes, d.count, d.code, d.shape) == (
        arr.ctypes.data,
        arr.nbytes,
        12,
        code,
        (3, 4),
    )
    assert d.memory == MemoryKind.HOST and d.device == -1 and not d.readonly
    assert bytes(d.view(1, 3)) == arr.reshape(-1)[1:3].tobytes()


def test_zero_length_and_zero_dim():
    assert as_buffer(np.empty(0, np.float32)).nbytes == 0
    d = as_buffer(np.array(3.0))
    assert (d.count, d.shape) == (1, ())


def test_buffer_protocol_and_readonly():
    d = as_buffer(memoryview(np.arange(4, dtype=np.int32)))
    assert d.count == 4 and d.code == DType.INT32
    ro = np.arange(3.0)
    ro.flags.writeable = False
    assert as_buffer(ro).readonly
    assert as_buffer(bytearray(5)).code == DType.UINT8


def test_buffer_protocol_objects_are_read_in_place_and_give_numpy_results():
    """As the README says: a bytearray or array.array is used without a copy; a new result
    (empty_like) is a NumPy array of the same dtype and shape; out= may be such an object."""
    import array

    for obj, dtype in ((bytearray(b"abc"), np.uint8), (array.array("i", [1, -2, 3]), np.int32)):
        d = as_buffer(obj)
        assert d.dtype == dtype and d.count == 3
        assert d.array.ctypes.data == np.frombuffer(obj, dtype).ctypes.data  # no copy
        new = empty_like(d)
        assert isinstance(d.wrap(new.array), np.ndarray) and new.dtype == dtype
        assert not as_buffer(obj, "out").readonly


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="grads.*complex64"):
        as_buffer(np.ones(3, np.complex64), "grads")
    with pytest.raises(ValueError, match="grads is not C-contiguous"):
        as_buffer(np.ones((4, 4))[:, 0], "grads")
    with pytest.raises(TypeError, match="grads must be an array"):
        as_buffer([1, 2, 3], "grads")
    with pytest.raises(TypeError, match="uint16"):
        as_buffer(np.ones(3, np.uint16))


def test_big_endian_is_rejected():
    with pytest.raises(TypeError, match="dtype"):
        as_buffer(np.ones(3, ">f4"))


def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32)
    d = as_buffer(t)
    assert d.ptr == t.data_ptr() and d.count == 6
    out = empty_like(d)
    assert isinstance(out.wrap(out.array), torch.Tensor)


def test_bool_arrays_reduce_as_uint8_but_compare_as_bool():
    """bool is accepted without a copy; the kernels see uint8 (its bytes are 0 or 1), the
    checks that compare ranks' calls see a code of its own, and the messages its name."""
    from ddlcore.kernels.dtypes import BOOL_CODE, check_code, dtype_name

    arr = np.array([True, False, True])
    d = as_buffer(arr)
    assert (d.ptr, d.count, d.nbytes, d.dtype) == (arr.ctypes.data, 3, 3, np.dtype(bool))
    assert d.code == DType.UINT8 and d.logical and d.check_code == BOOL_CODE
    assert as_buffer(np.ones(3, np.uint8)).check_code == int(DType.UINT8)
    assert not as_buffer(np.ones(3, np.uint8)).logical
    assert check_code(np.bool_) == BOOL_CODE and check_code(np.complex64) is None
    assert dtype_name(BOOL_CODE) == "bool" and dtype_name(DType.FLOAT32) == "float32"
    assert dtype_name(99) == "dtype code 99"
    new = empty_like(d)
    assert new.dtype == np.bool_ and new.logical
    assert as_buffer(memoryview(arr)).logical  # the buffer protocol's "?"


def test_bool_ops_are_logical():
    """sum and max are or, prod and min and (gloo's results); avg has none."""
    from ddlcore import calls
    from ddlcore.ops import Op

    x = np.zeros(4, bool)
    for op, kernel_op in (("sum", Op.MAX), ("max", Op.MAX), ("prod", Op.MIN), ("min", Op.MIN)):
        assert calls.prepare("allreduce", x, op, None, 0, 2).op == kernel_op, op
        assert calls.prepare("reduce_scatter", x, op, None, 0, 2).op == kernel_op, op
        assert calls.prepare("reduce", x, op, None, 1, 2, rank=1).op == kernel_op, op
    for collective in ("allreduce", "reduce_scatter", "reduce"):
        with pytest.raises(TypeError, match="op='avg' has no bool result"):
            calls.prepare(collective, x, "avg", None, 0, 2)
    assert calls.prepare("allreduce", x.view(np.uint8), "sum", None, 0, 2).op == Op.SUM


def test_torch_bool_tensors_are_viewed_without_a_copy():
    torch = pytest.importorskip("torch")
    t = torch.tensor([True, False, True])
    d = as_buffer(t)
    assert d.ptr == t.data_ptr() and d.logical and d.code == DType.UINT8
    back = empty_like(d)
    assert back.wrap(back.array).dtype == torch.bool


def test_torch_bfloat16_tensors_are_viewed_without_a_copy():
    torch = pytest.importorskip("torch")
    t = torch.randn(7).bfloat16()
    d = as_buffer(t)
    assert d.ptr == t.data_ptr() and d.count == 7 and d.dtype.name == "bfloat16"
    back = d.wrap(d.array)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()
    with pytest.raises(ValueError, match="C-contiguous"):
        as_buffer(torch.randn(3, 4).bfloat16().t())


def test_cuda_array_without_a_usable_gpu_gets_a_clear_message():
    class DeviceArray:  # what CuPy or PyTorch would hand us, on a machine with no GPU
        __cuda_array_interface__ = {
            "shape": (3,),
            "typestr": "<f4",
            "data": (1 << 20, False),
            "version": 3,
            "strides": None,
        }

    import ddlcore.device

    if ddlcore.device.cuda_usable():
        pytest.skip("a GPU is present: this checks the message on machines without one")
    with pytest.raises(TypeError, match="grads is a CUDA array"):
        as_buffer(DeviceArray(), "grads")
