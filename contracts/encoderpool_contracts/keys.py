"""Names of the per-pool keys the operator hands to pods, shared by renderer and readers.

The operator makes a Secret ``<pool>-internal`` per pool and never reads it; pods get
its keys through ``valueFrom.secretKeyRef`` under these variable names, so the
operator that renders them and the code that reads them cannot drift.
"""

# The per-pool key of producers and consumers: signs the rdma transport's messages and
# the shared volume's entries.
CHANNEL_KEY_ENV = "ENCODERPOOL_CHANNEL_KEY"
