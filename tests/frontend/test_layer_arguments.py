"""Layer construction arguments and lookups a user gets wrong: non-positive sizes fail at construction naming the
argument, Sequential takes its layers either way, and Embedding refuses an index outside its table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import nn
from kiln.ir import interpret

# issue 11: "`Linear(0, 4)`, `Conv2d(kernel_size=0)` and similar non-positive sizes fail at construction with a
# one-line ValueError naming the argument, not at the first forward"
BAD_SIZES = [
    (lambda: nn.Linear(0, 4), "Linear: d_input", "0"),
    (lambda: nn.Linear(4, -1), "Linear: d_output", "-1"),
    (lambda: nn.Embedding(0, 4), "Embedding: n_embedding", "0"),
    (lambda: nn.Embedding(4, 2.5), "Embedding: d_model", "2.5"),
    (lambda: nn.Conv2d(3, 8, kernel_size=0), "Conv2d: kernel_size", "0"),
    (lambda: nn.Conv2d(3, 8, kernel_size=(3, 0)), "Conv2d: kernel_size", "(3, 0)"),
    (lambda: nn.Conv2d(0, 8, 3), "Conv2d: channels_in", "0"),
    (lambda: nn.Conv1d(3, 8, 3, stride=0), "Conv1d: stride", "0"),
    (lambda: nn.Conv1d(3, 8, 3, padding=-1), "Conv1d: padding", "-1"),
    (lambda: nn.Conv2d(4, 8, 3, groups=0), "Conv2d: groups", "0"),
    (lambda: nn.MaxPool2d(0), "MaxPool2d: kernel_size", "0"),
    (lambda: nn.AvgPool2d(2, stride=0), "AvgPool2d: stride", "0"),
    (lambda: nn.AdaptiveAvgPool2d(0), "AdaptiveAvgPool2d: output_size", "0"),
    (lambda: nn.LayerNorm(0), "LayerNorm: d_model", "0"),
    (lambda: nn.RMSNorm(-2), "RMSNorm: d_model", "-2"),
    (lambda: nn.BatchNorm2d(0), "BatchNorm2d: num_features", "0"),
    (lambda: nn.MultiHeadAttention(8, 0), "MultiHeadAttention: n_heads", "0"),
    (lambda: nn.TransformerEncoderLayer(8, 2, 0), "TransformerEncoderLayer: d_ff", "0"),
]


@pytest.mark.parametrize(("build", "named", "value"), BAD_SIZES, ids=[n for _, n, _ in BAD_SIZES])
def test_non_positive_sizes_fail_at_construction(build, named, value):
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert message.startswith(named) and message.endswith(f"got {value}") and "\n" not in message


def test_zero_padding_is_allowed():
    assert nn.Conv2d(3, 8, 3, padding=0).padding == (0, 0)


def test_sequential_takes_layers_as_arguments_or_one_list():
    # issue 11: "`nn.Sequential([a, b])` and `nn.Sequential(a, b)` both work"
    a, b = nn.Linear(3, 4), nn.ReLU()
    for seq in (nn.Sequential(a, b), nn.Sequential([a, b]), nn.Sequential((a, b))):
        assert seq.layers == [a, b]
        assert [path for path, _ in seq.leaves()] == ["layers.0.weight", "layers.0.bias"]
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    weight, bias = a.weight.val().numpy(), a.bias.val().numpy()
    np.testing.assert_allclose(nn.Sequential([a, b])(kiln.tensor(x)).numpy(), np.maximum(x @ weight + bias, 0),
                               rtol=1e-6)


def test_sequential_refuses_a_non_module_naming_its_position():
    with pytest.raises(TypeError, match=r"^Sequential: layer 1 is a int, not a kiln.Module$"):
        nn.Sequential(nn.ReLU(), 3)


@pytest.mark.parametrize("index", [-1, 5, 7])
def test_embedding_refuses_an_index_outside_its_table(index):
    # torch's Embedding refuses both a negative index and one past the table (IndexError); kiln names both
    with pytest.raises(IndexError):
        torch.nn.Embedding(5, 2)(torch.tensor([0, index]))
    emb = nn.Embedding(5, 2)
    with pytest.raises(kiln.ShapeError, match=rf"^Embedding: index {index} is out of range for a table of 5 "):
        emb(kiln.tensor(np.array([0, index], np.int64)))


def test_embedding_in_range_matches_row_lookup_eager_and_traced():
    emb = nn.Embedding(5, 2)
    index = np.array([[4, 0], [2, 2]], np.int64)
    table = emb.weight.val().numpy()
    np.testing.assert_array_equal(emb(kiln.tensor(index)).numpy(), table[index])
    np.testing.assert_array_equal(emb(index).numpy(), table[index])  # a numpy index array, as the op takes it
    with pytest.raises(kiln.ShapeError, match=r"^Embedding: index -2 is out of range"):
        emb(np.array([-2]))
    graph = kiln.trace(emb, ((None, 2), "i64"))
    np.testing.assert_array_equal(interpret(graph, [index])[0], table[index])


def test_traced_embedding_interpreted_refuses_an_index_past_its_table():
    # the take op's reference: indices in [-n, n), so the interpreter names an index past the table and its size
    graph = kiln.trace(nn.Embedding(5, 2), ((None,), "i64"))
    with pytest.raises(kiln.ShapeError, match=r"^take: index 5 is out of bounds for axis 0 with size 5$"):
        interpret(graph, [np.array([0, 5], np.int64)])
