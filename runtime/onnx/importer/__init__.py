"""ONNX import: an ONNX model's graph as a kiln `ir.Graph`, node by node through registered converters.

`registry` holds the converters (one per ONNX op type and opset range), `call` the view of one node a converter
receives, and `driver` walks a model's graph. Converters live in the `convert_*` modules, one per op family.
"""
