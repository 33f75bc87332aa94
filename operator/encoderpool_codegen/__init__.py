"""Generators of the files derived from the operator's code: the CRD, the chart's files, docs.

    python -m encoderpool_codegen.crd crds/                       # the CRD, from the API models
    python -m encoderpool_codegen.chart charts/encoderpool-operator  # values schema, RBAC, CRD copy
    python -m encoderpool_codegen.apidoc docs/api.md              # docs/api.md's reference tables

They run at development time (``make crds``; tests check that the committed
files are fresh). They are a package of their own, beside the operator's, so
that what the operator image runs (``encoderpool_operator``) holds only what a
reconcile needs, and a generator can grow (pyyaml, schema rewriting, the
chart's values model) without the runtime importing it.
"""
