"""What crosses the wire, below both parallel/ and comm/: codecs, device-side timing, the replicas' first broadcast.

parallel/ (the parallelized model's own collectives: the expert dispatch) and comm/ (the gradient reductions) both
use these; this package imports neither (nor Lightning).
"""
