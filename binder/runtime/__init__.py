"""A pass at run time: the cluster-wide lock, the pass itself, the API server side, answers."""
