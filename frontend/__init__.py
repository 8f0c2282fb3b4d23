"""kiln.frontend: what users write — modules, parameters, flags, devices, tensors, layers, trace."""

from kiln.ir.layout import Layout
from kiln.ir.param_id import ParamId
from kiln.ir.param_id import seed_param_ids as seed
from kiln.passes.group import ParamGroup
from kiln.runtime.records.record import DTypePolicy, ModuleRecord
from kiln.runtime.tvm.aligned import aligned, aligned_empty

from . import nn, optim, train
from .compile import compile
from .device import Device
from .grad import grad
from .gradients import Gradients, GradientsParams
from .module import Module, ModuleMapper, ModuleVisitor
from .onnx import export_onnx, import_onnx
from .onnx_module import OnnxModule
from .param import Flag, Param, ParamMapper, Reparam
from .pytorch_adapter import PyTorchAdapter
from .reparam import Dora, Lora, QLora, Quantizer, QuantScheme, Reparameterizer
from .step import TrainStep, compile_step
from .tensor import Tensor, tensor
from .trace import trace

__all__ = [
    "DTypePolicy",
    "Device",
    "Dora",
    "Flag",
    "Gradients",
    "GradientsParams",
    "Layout",
    "Lora",
    "Module",
    "ModuleMapper",
    "ModuleRecord",
    "ModuleVisitor",
    "OnnxModule",
    "Param",
    "ParamGroup",
    "ParamId",
    "ParamMapper",
    "PyTorchAdapter",
    "QLora",
    "QuantScheme",
    "Quantizer",
    "Reparam",
    "Reparameterizer",
    "Tensor",
    "TrainStep",
    "aligned",
    "aligned_empty",
    "compile",
    "compile_step",
    "export_onnx",
    "grad",
    "import_onnx",
    "nn",
    "optim",
    "seed",
    "tensor",
    "trace",
    "train",
]
