"""kiln.runtime.records: module records and their file formats (burnpack, QFloat); imports neither TVM nor onnx."""
