"""Serving frames: sources, the pipeline's threads and queues, the engine a winner becomes, sinks, metrics.
"""
