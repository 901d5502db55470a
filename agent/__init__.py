"""edge-agent: an ONNX Runtime inference daemon that proves its model on the device before it serves."""

__version__ = "0.1.0"
