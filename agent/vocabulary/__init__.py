"""The pure vocabulary of a bundle: manifest schema and values, preprocessing, output decoders, input feeds.

Every other package speaks it; it imports none of them and never onnxruntime.
"""
