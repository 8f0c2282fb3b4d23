"""kiln.runtime.onnx: ONNX exchange — export of kiln graphs, initializers as records; never imports TVM."""
