from cluster_util import make_cluster  # noqa: F401 - a fixture, used by name
