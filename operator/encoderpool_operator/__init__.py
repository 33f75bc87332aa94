"""encoderpool's Kubernetes operator: the EncoderPool API, its CRD, and the reconcile."""
