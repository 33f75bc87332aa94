"""encoderpool's in-pod code: EC connectors loaded by vLLM, the width Job, and the contracts.

Importing this package imports neither torch nor vLLM: the operator and the
router share its ``contracts`` without them.
"""
