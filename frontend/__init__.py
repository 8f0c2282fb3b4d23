"""kiln.frontend: what users write — modules, parameters, flags, devices, tensors, layers, trace."""

from kiln.passes.group import ParamGroup
from kiln.runtime.record import DTypePolicy, ModuleRecord

from . import nn
from .device import Device
from .module import Lora, Module, ModuleMapper, ModuleVisitor, Reparameterizer
from .param import Flag, Param, Reparam
from .quantize import QLora, Quantizer, QuantScheme
from .tensor import Tensor, tensor
from .trace import trace

__all__ = ["DTypePolicy", "Device", "Flag", "Lora", "Module", "ModuleMapper", "ModuleRecord", "ModuleVisitor",
           "Param", "ParamGroup", "QLora", "QuantScheme", "Quantizer", "Reparam", "Reparameterizer", "Tensor", "nn",
           "tensor", "trace"]
