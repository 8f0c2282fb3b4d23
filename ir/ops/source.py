"""Ops with no operands: constants and filled tensors."""

from __future__ import annotations

import numpy as np

from ..attrs import DENSE, DTYPE, FLOAT, INTS, Attr
from ..dtypes import DType
from ..errors import ShapeError
from ..traits import Trait
from ..types import TensorType
from .common import define


def _constant_infer(ts, attrs):
    value = attrs["value"]
    try:
        dtype = DType.from_numpy(value.dtype)
    except ValueError as e:
        raise ShapeError(f"constant: {e}") from None
    return (TensorType(tuple(value.shape), dtype),)


define("constant", (), _constant_infer, lambda xs, attrs: (attrs["value"],), {"value": Attr(DENSE)},
       traits={Trait.SOURCE})


def _filled(name: str, fill) -> None:
    def infer(ts, attrs):
        if any(d < 0 for d in attrs["shape"]):
            raise ShapeError(f"{name}: negative dim in shape {list(attrs['shape'])}")
        return (TensorType(attrs["shape"], attrs["dtype"]),)

    def reference(xs, attrs):
        return (np.full(attrs["shape"], fill(attrs), dtype=attrs["dtype"].numpy),)

    schema = {"shape": Attr(INTS), "dtype": Attr(DTYPE, DType.f32)}
    if name == "full":
        schema["value"] = Attr(FLOAT)
    define(name, (), infer, reference, schema, traits={Trait.SOURCE})


_filled("zeros", lambda attrs: 0)
_filled("ones", lambda attrs: 1)
_filled("full", lambda attrs: attrs["value"])
