"""A real Kubernetes control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, and kwok standing in for kubelets.

kind cannot run without a Docker engine; these are the same binaries a real
cluster runs (built by ``build.sh``), so CRD validation, RBAC, garbage
collection, Deployments and Jobs behave as they do in production. kwok pods
run nothing: tests that need a pod's work run its command as a local process.

    python -m e2e.cluster up STATE_DIR     # for humans; prints the KUBECONFIG
    python -m e2e.cluster down STATE_DIR
"""

from e2e.cluster.runner import LocalCluster, bin_dir

__all__ = ["LocalCluster", "bin_dir"]
