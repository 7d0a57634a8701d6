"""kiln.bench: Kiln next to onnxruntime and torch on the same model, inputs and machine.

``kiln bench`` (sweep.py) measures every configuration in a fresh worker process
(worker.py) so resident memory is each system's own; systems.py holds the three ways
of running a model; roofline.py the batch-1 decode bound of this machine. The scripts
``serving.py`` / ``kernel_profile.py`` run as ``python bench/NAME.py``.
Nothing here is imported by ``kiln.runtime``.
"""
