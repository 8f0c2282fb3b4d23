"""What a numpy or PyTorch user reaches for on a Tensor: indexing, `.T`, `len`, `np.asarray`, scalar conversion,
`reshape`'s spellings, comparison and logical operators; each result against numpy on the same data."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.frontend.tensor import placeholder
from kiln.ir import DType, TensorType

X = np.arange(60, dtype=np.float32).reshape(3, 4, 5)

KEYS = [
    0, -1, (1, 2), (slice(None), slice(1, 3)), (slice(None, None, -1),), (slice(None), slice(-1, 0, -2)),
    (Ellipsis, 2), (Ellipsis, None), (None, 0, Ellipsis), (slice(1, None), None, slice(None, None, 2), -2),
    (2, slice(5, 1, -1), slice(-3, None)), (slice(10, 20),), (Ellipsis,), (), (0, 0, 0),
]


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_basic_indexing_matches_numpy(key):
    """numpy basic indexing: integers (negative count from the end), slices with steps, '...' and None."""
    t = kiln.tensor(X)[key]
    expected = X[key]
    assert t.shape == expected.shape
    np.testing.assert_array_equal(t.numpy(), expected)


@pytest.mark.parametrize("key, message", [
    (3, "index 3 is out of bounds for axis 0 with size 3"),
    ((0, -5), "index -5 is out of bounds for axis 1 with size 4"),
    ((0, 0, 0, 0), "too many indices for a tensor of rank 3: 4 given"),
    ((Ellipsis, 0, Ellipsis), "an index can only have a single ellipsis"),
    (slice(None, None, 0), "slice step cannot be zero"),
    (1.5, "unsupported index 1.5"),
    (True, "a boolean scalar index"),
    ([0, 2], "indexing with a int64 array is not supported"),
    ((slice(None), kiln.tensor([True])), "unsupported index Tensor.*a boolean mask must be the whole index"),
])
def test_bad_indices_are_one_line_errors(key, message):
    with pytest.raises(IndexError, match=message.replace("(", r"\(").replace("[", r"\[")):
        kiln.tensor(X)[key]


def test_boolean_masks_with_a_known_value_match_numpy():
    """A mask known now (array, list or realized tensor) fixes the result's shape: its count of True values."""
    full = X % 7 == 0
    rows = np.array([True, False, True])
    for mask in [full, full[:, :, 0], rows, rows.tolist(), kiln.tensor(rows)]:
        expected = X[np.asarray(mask)]
        t = kiln.tensor(X)[mask]
        assert t.shape == expected.shape
        np.testing.assert_array_equal(t.numpy(), expected)


def test_a_lazy_or_mismatched_mask_is_refused():
    t = kiln.tensor(X)
    with pytest.raises(IndexError, match="lazy boolean mask: the result's shape is its count of True values"):
        t[t > 3]
    with pytest.raises(IndexError, match=r"mask of shape \[4\] does not match the leading dims .* \[3, 4, 5\]"):
        t[np.ones(4, bool)]


def test_indexing_a_dynamic_dim():
    """An integer (negative too) or a slice on a dim unknown until run time keeps working; a new axis needs at
    most one dynamic dim for its reshape."""
    x = placeholder("x", TensorType((None, 4), DType.f32), kiln.Device("cpu"))
    assert x[-1].shape == (4,)
    assert x[1:, None].shape == (None, 1, 4)
    assert x[::2, 0].shape == (None,)
    y = placeholder("y", TensorType((None, None), DType.f32), kiln.Device("cpu"))
    with pytest.raises(IndexError, match=r"indexing with None reshapes to \[None, 1, None\]"):
        y[:, None]


def test_transpose_len_and_iteration():
    """`.T` reverses the dims, like numpy's; `len` is the first dim; iterating yields `t[i]`."""
    t = kiln.tensor(X)
    np.testing.assert_array_equal(t.T.numpy(), X.T)
    assert len(t) == 3
    np.testing.assert_array_equal(np.stack([r.numpy() for r in t]), X)
    with pytest.raises(TypeError, match=r"len\(\) of a 0-d tensor"):
        len(kiln.tensor(1.0))
    x = placeholder("x", TensorType((None, 4), DType.f32), kiln.Device("cpu"))
    with pytest.raises(TypeError, match="its first dim is dynamic"):
        len(x)


def test_asarray_realizes_the_tensor():
    """`np.asarray(t)` gave an object array wrapping the Tensor; it must hold the values."""
    t = kiln.tensor(X) * 2
    got = np.asarray(t)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, X * 2)
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    np.testing.assert_array_equal(np.array(t), X * 2)


def test_one_element_tensors_convert_to_python_scalars():
    t = kiln.tensor([[2.5]])
    assert (float(t), int(t), bool(t), t.item()) == (2.5, 2, True, 2.5)
    assert bool(kiln.tensor(0)) is False
    with pytest.raises(ValueError, match=r"only a one-element tensor converts .* \(2 elements\)"):
        float(kiln.tensor([1.0, 2.0]))


def test_reshape_spellings():
    """`reshape(3, 2)` as in PyTorch and numpy, besides `reshape((3, 2))` and `reshape(shape=...)`."""
    t = kiln.tensor(X)
    for got in [t.reshape(12, 5), t.reshape((12, 5)), t.reshape([12, -1]), t.reshape(shape=(12, 5))]:
        np.testing.assert_array_equal(got.numpy(), X.reshape(12, 5))
    with pytest.raises(TypeError, match="positionally or as shape=, not both"):
        t.reshape(12, 5, shape=(12, 5))


A = np.array([[1.0, np.nan, 3.0], [-2.0, 0.0, 5.0]], np.float32)
B = np.array([1.0, np.nan, 4.0], np.float32)


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_comparisons_match_numpy(op):
    """Comparisons give bool tensors and broadcast; NaN compares false except under !=, as in numpy."""
    fn = eval(f"lambda a, b: a {op} b")
    a, b = kiln.tensor(A), kiln.tensor(B)
    for got, expected in [(fn(a, b), fn(A, B)), (fn(a, 1.0), fn(A, np.float32(1))), (fn(3.0, a), fn(3, A))]:
        assert got.dtype is DType.bool
        np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("op", ["&", "|", "^"])
def test_logical_operators_match_numpy(op):
    fn = eval(f"lambda a, b: a {op} b")
    p, q = A > 0, np.array([True, False, True])
    for got, expected in [(fn(kiln.tensor(p), kiln.tensor(q)), fn(p, q)), (fn(kiln.tensor(p), True), fn(p, True)),
                          (fn(False, kiln.tensor(p)), fn(False, p))]:
        np.testing.assert_array_equal(got.numpy(), expected)
    np.testing.assert_array_equal((~kiln.tensor(p)).numpy(), ~p)


def test_a_python_number_an_integer_tensor_cannot_hold_is_refused():
    """`i64 < 2.5` once compared with 2 (the float cast to the tensor's dtype): a silent wrong result."""
    t = kiln.tensor([1, 2, 3])
    np.testing.assert_array_equal((t < 2).numpy(), np.array([1, 2, 3]) < 2)
    for bad in [lambda: t < 2.5, lambda: t + 0.5, lambda: kiln.tensor([True]) == 2]:
        with pytest.raises(TypeError, match=r"operand (2.5|0.5|2) is not a (i64|bool) value"):
            bad()


def test_an_operand_that_is_no_number_is_one_clear_error():
    with pytest.raises(TypeError, match="equal: operand None is neither a Tensor nor a number or array"):
        _ = kiln.tensor(A) == None  # noqa: E711
    with pytest.raises(TypeError, match="add: operand 'x' is neither a Tensor nor a number or array"):
        kiln.tensor(A) + "x"


def test_logical_operators_need_bool_operands():
    with pytest.raises(TypeError, match=r"operator & needs bool operands, got f32"):
        kiln.tensor(A) & kiln.tensor(A)
    with pytest.raises(TypeError, match=r"operator ~ needs bool operands, got i64"):
        ~kiln.tensor([1, 2])


def test_a_numpy_array_on_the_left_defers_to_the_tensor():
    """`np.array < t` stays a lazy kiln tensor (numpy would otherwise realize t and answer itself)."""
    got = B < kiln.tensor(A)
    assert isinstance(got, kiln.Tensor)
    np.testing.assert_array_equal(got.numpy(), B < A)
    np.testing.assert_array_equal((B + kiln.tensor(A)).numpy(), B + A)


def test_a_traced_value_has_no_python_value():
    class Branchy(kiln.Module):
        def forward(self, x: kiln.Tensor) -> kiln.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(kiln.ir.KilnError, match="depends on a traced input or parameter, so it has no value while "
                                                "tracing"):
        kiln.trace(Branchy(), ((2,), "f32"))


class Indexing(kiln.Module):
    """Indexing, comparisons and logic in a forward, traced and compiled through TVM."""

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        keep = (x > -0.5) & ~(x >= 0.5) | (x == 1.0)
        return keep.where(x, x * 0)[1:, 5:0:-2][:, None, -1] + x.T[0][..., None, None]


def test_indexing_and_operators_compile_through_tvm():
    exe = kiln.compile(Indexing(), ((None, 6), "f32"))
    x = np.random.default_rng(0).uniform(-1, 1, (5, 6)).astype(np.float32)
    x[0, 0] = 1.0
    keep = (x > -0.5) & ~(x >= 0.5) | (x == 1.0)
    want = np.where(keep, x, 0)[1:, 5:0:-2][:, None, -1] + x.T[0][..., None, None]
    np.testing.assert_allclose(exe(x), want, rtol=1e-6)


def test_tensors_hash_by_identity():
    """`==` builds a tensor, so hashing stays by identity: tensors still key dicts and fill sets."""
    a, b = kiln.tensor(A), kiln.tensor(A)
    assert len({a: 1, b: 2}) == 2 and a in {a} and b not in {a}


def test_cuda_means_cuda_0():
    assert kiln.Device("cuda") == kiln.Device("cuda:0")
    assert str(kiln.Device("cuda")) == "cuda:0"
    assert kiln.Device("cuda").autodiff().name == "cuda:0"


def test_computing_on_an_absent_gpu_is_one_kiln_error(monkeypatch):
    """A CUDA device is accepted anywhere; the first realization on one the machine lacks fails clearly."""
    from kiln.runtime.tvm import target
    monkeypatch.setattr(target, "cuda_present", lambda index: False)
    t = kiln.tensor(X, device="cuda") + 1  # building is fine
    with pytest.raises(kiln.ir.KilnError, match=r"^device cuda:0 is not available: TVM finds no CUDA GPU cuda:0"):
        t.numpy()
    loss = (kiln.tensor(X, device=kiln.Device("cuda:1").autodiff()) * 2).sum()
    with pytest.raises(kiln.ir.KilnError, match="device cuda:1 is not available"):
        loss.backward()


def test_this_machine_really_refuses_a_missing_gpu():
    """The same without a stand-in: tvm.cuda(0).exist decides."""
    from kiln.runtime.tvm.target import cuda_present
    if cuda_present(0):
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(kiln.ir.KilnError, match="device cuda:0 is not available"):
        (kiln.tensor(X, device="cuda") + 1).numpy()
