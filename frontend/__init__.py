"""kiln.frontend: what users write — modules, parameters, flags, devices, tensors, layers, trace."""

from kiln.passes.group import ParamGroup

from . import nn
from .device import Device
from .module import Module, ModuleMapper, ModuleVisitor
from .param import Flag, Param
from .tensor import Tensor, tensor
from .trace import trace

__all__ = ["Device", "Flag", "Module", "ModuleMapper", "ModuleVisitor", "Param", "ParamGroup", "Tensor", "nn",
           "tensor", "trace"]
